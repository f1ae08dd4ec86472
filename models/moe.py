"""The position-wise MoE layer (GShard, Switch, OLMoE) as a Flax module, annotated for the partitioner.

Tokens are regrouped into local groups ``[G, S, M]`` (padded to fit) and routed
by ``models.gating``. Two ways to run the experts:

- ``dispatch="einsum"``: GShard's Algorithm 2. Groups G are split over the
  batch axes on the way in, experts E over the expert axis in between, so the
  partitioner emits exactly one all-to-all before the experts and one after;
- ``dispatch="dropless"``: sort by expert and grouped matmuls
  (``models.dropless``), no capacity and nothing dropped.

Logical axis names used here: ``group`` (G), ``expert`` (E), ``embed`` (M),
``mlp`` (F). The layer returns its output, its losses (aux, z) and its routing
statistics, so a model can sum them over layers.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

import gshard_jax as gs

from . import dropless as D, gating
from .grouped import EXPERT_MATMUL, IMPLS
from .logical import Rules, axes_of, constrain, mesh_spec


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    num_experts: int = 8  # experts in the layer (E)
    d_ff: int = 256  # expert hidden units (F)
    activation: str = "relu"  # expert FFN: "relu" (GShard: wi, wo) or "swiglu" (OLMoE: wi_gate, wi_up, wo)
    gating: gating.GatingConfig = gating.GatingConfig()  # k, capacity factors, policies, routing kind
    group_size: Optional[int] = None  # tokens per local group S (None: num_groups, or one group per sequence)
    num_groups: Optional[int] = None  # local groups G (used when group_size is None)
    dispatch: str = "einsum"  # "einsum" (GSEC one-hot, with capacity) or "dropless" (sort + grouped matmul)
    exchange: str = "auto"  # dropless under expert parallelism: "auto" (ragged on GPU/TPU, else all_to_all) |
    # "all_to_all" | "all_gather" | "ragged"
    grouped_matmul: str = "auto"  # dropless: "ragged_dot" (GPU/TPU kernel), "blocked" (scan), "auto": by backend
    peer_bound: Optional[float] = None  # dropless all_to_all/ragged: per-peer rows / average (None: never drop)
    router_jitter: float = 0.0  # training: router input scaled by U(1 - eps, 1 + eps) (Switch); 0 = off
    router_logit_cap: Optional[float] = None  # logits -> cap * tanh(logits / cap); None = off


ACTIVATIONS = ("relu", "swiglu")
DISPATCHES = ("einsum", "dropless")


def check(cfg: MoeConfig) -> None:
    """A ValueError naming the first bad field of `cfg`."""
    if cfg.activation not in ACTIVATIONS:
        raise ValueError(f"MoeConfig.activation={cfg.activation!r}; expected one of {ACTIVATIONS}")
    if cfg.dispatch not in DISPATCHES:
        raise ValueError(f"MoeConfig.dispatch={cfg.dispatch!r}; expected one of {DISPATCHES}")
    if cfg.exchange not in D.EXCHANGES:
        raise ValueError(f"MoeConfig.exchange={cfg.exchange!r}; expected one of {D.EXCHANGES}")
    if cfg.grouped_matmul not in IMPLS:
        raise ValueError(f"MoeConfig.grouped_matmul={cfg.grouped_matmul!r}; expected one of {IMPLS}")
    if cfg.dispatch == "dropless" and cfg.gating.routing == "expert_choice":
        raise ValueError("MoeConfig: expert_choice routing has a capacity by definition; use dispatch='einsum'")
    gating.check(cfg.gating)


def groups(tokens: int, batch: int, cfg: MoeConfig) -> tuple[int, int]:
    """(G, S): local groups and tokens per group; G * S >= tokens (the rest is padding)."""
    if cfg.group_size is not None:
        S = int(cfg.group_size)
        return -(-tokens // S), S
    G = int(cfg.num_groups) if cfg.num_groups is not None else batch
    return G, -(-tokens // G)


def _kernel_init(fan_in_axis: int):
    return nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=fan_in_axis, out_axis=-1,
                                            batch_axis=(0,))


class Router(nn.Module):
    """Router logits [G, S, E] in float32, with optional jitter (training) and tanh cap."""
    num_experts: int
    jitter: float = 0.0
    logit_cap: Optional[float] = None

    @nn.compact
    def __call__(self, x_GSM: jax.Array, train: bool) -> jax.Array:
        x = x_GSM.astype(jnp.float32)
        if train and self.jitter > 0:
            x = x * jax.random.uniform(self.make_rng("gating"), x.shape, jnp.float32, 1 - self.jitter, 1 + self.jitter)
        kernel_ME = self.param("kernel", nn.with_logical_partitioning(
            nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal"), ("embed", None)),
                               (x.shape[-1], self.num_experts), jnp.float32)
        logits = jnp.einsum("GSM,ME->GSE", x, kernel_ME)
        if self.logit_cap is not None:
            logits = self.logit_cap * jnp.tanh(logits / self.logit_cap)
        return logits


def _activation(name: str):
    return jax.nn.relu if name == "relu" else jax.nn.silu


class MoeFFN(nn.Module):
    """x [B, L, M] -> (y [B, L, M], {"aux_loss", "z_loss"}, stats)."""
    cfg: MoeConfig
    rules: Rules
    dtype: jnp.dtype = jnp.float32  # compute dtype (params stay float32)

    def _weights(self, M: int) -> dict:
        E, F = self.cfg.num_experts, self.cfg.d_ff
        names = ("wi_gate", "wi_up", "wo") if self.cfg.activation == "swiglu" else ("wi", "wo")
        w = {}
        for n in names:
            shape, logical = (((E, F, M), ("expert", "mlp", "embed")) if n == "wo" else
                              ((E, M, F), ("expert", "embed", "mlp")))
            init = nn.with_logical_partitioning(_kernel_init(1), logical)
            w[n] = constrain(self.param(n, init, shape, jnp.float32).astype(self.dtype), logical, self.rules,
                             grad=False)
        return w

    @nn.compact
    def __call__(self, x_BLM: jax.Array, train: bool = False):
        cfg = self.cfg
        check(cfg)
        B, L, M = x_BLM.shape
        T = B * L
        G, S = groups(T, B, cfg)
        x_TM = x_BLM.reshape(T, M)
        if G * S != T:
            x_TM = jnp.pad(x_TM, ((0, G * S - T), (0, 0)))
        mask_GS = (jnp.arange(G * S) < T).reshape(G, S) if G * S != T else None  # None: no padding
        # Dropless routing has no capacity, so its groups shape only the balance loss. With one group per
        # sequence (the default) and sequences split (context), the groups are [batch, length] as the tokens
        # lie: merging a split length into the batch's split would gather every token of the layer.
        as_laid = cfg.dispatch == "dropless" and (G, S) == (B, L) and bool(self._split("length"))
        groups_in = ("batch", "length") if as_laid else ("group", None)
        x_GSM = constrain((x_BLM if as_laid else x_TM.reshape(G, S, M)).astype(self.dtype), (*groups_in, "embed"),
                          self.rules)
        logits_GSE = Router(cfg.num_experts, cfg.router_jitter, cfg.router_logit_cap, name="router")(x_GSM, train)
        logits_GSE = constrain(logits_GSE, (*groups_in, None), self.rules)
        g = cfg.gating if train else dataclasses.replace(cfg.gating, second_policy="all")
        needs_rng = train and cfg.gating.second_policy != "all" and g.k > 1 and g.routing == "token_choice"
        rng = self.make_rng("gating") if needs_rng else None
        w = self._weights(M)
        if cfg.dispatch == "einsum":
            r = gating.route(logits_GSE, g, rng, train, mask_GS)
            y_GSM = self._einsums(x_GSM, r.combine_GSEC, r.dispatch_GSEC, w)
            aux, stats = r.aux_loss, r.stats
        else:
            y_GSM, aux, stats = self._dropless(x_GSM, logits_GSE, g, rng, mask_GS, w, as_laid)
        y_BLM = y_GSM if as_laid else y_GSM.reshape(G * S, M)[:T].reshape(B, L, M)
        losses = {"aux_loss": aux, "z_loss": gating.z_loss(logits_GSE, mask_GS)}
        return y_BLM.astype(x_BLM.dtype), losses, stats

    def _split(self, name: str) -> tuple:
        """The mesh axes the rules split logical axis `name` over in the current mesh (after "batch")."""
        mesh = gs.annotations.current_mesh()
        if mesh is None:
            return ()
        return axes_of(mesh_spec(("batch", name), self.rules, mesh.axis_names)[1])

    def _ffn(self, x, w):
        """Expert FFN on dispatched tokens [E, G, C, M]."""
        rules = self.rules
        def mm(spec, a, b):  # every expert matmul is batched over E: named for remat "dots" (grouped.py)
            return checkpoint_name(jnp.einsum(spec, a, b), EXPERT_MATMUL)
        if "wi_gate" in w:
            h = jax.nn.silu(mm("EGCM,EMF->EGCF", x, w["wi_gate"])) * mm("EGCM,EMF->EGCF", x, w["wi_up"])
        else:
            h = jax.nn.relu(mm("EGCM,EMF->EGCF", x, w["wi"]))
        h = constrain(h, ("expert", "group", None, "mlp"), rules)
        return mm("EGCF,EFM->GECM", h, w["wo"])

    def _einsums(self, x_GSM, combine_GSEC, dispatch_GSEC, w):
        """GShard's Algorithm 2: all-to-all in (G split -> E split) and out (E split -> G split)."""
        rules = self.rules
        combine = constrain(combine_GSEC.astype(self.dtype), ("group", None, None, None), rules)
        dispatch = constrain(dispatch_GSEC.astype(self.dtype), ("group", None, None, None), rules)
        x_EGCM = checkpoint_name(jnp.einsum("GSEC,GSM->EGCM", dispatch, x_GSM), EXPERT_MATMUL)  # batched over G
        x_EGCM = constrain(x_EGCM, ("expert", "group", None, "embed"), rules)
        y_GECM = constrain(self._ffn(x_EGCM, w), ("group", None, None, "embed"), rules)
        y_GSM = checkpoint_name(jnp.einsum("GSEC,GECM->GSM", combine, y_GECM), EXPERT_MATMUL)
        return constrain(y_GSM, ("group", None, "embed"), rules)

    def _dropless(self, x_GSM, logits_GSE, g, rng, mask_GS, w, as_laid: bool = False):
        """as_laid: x_GSM is [batch, length, M] split as the activations are (length over context)."""
        G, S, M = x_GSM.shape
        choice = gating.choose(logits_GSE, g, rng, mask_GS)
        gates_GSK = choice.gates_GSK
        if g.normalize == "after_drop" and g.k > 1:  # nothing is dropped for capacity: renormalise the survivors
            total = jnp.sum(gates_GSK, axis=-1, keepdims=True)
            gates_GSK = gates_GSK / jnp.where(total > 0, total, 1.0)
        mesh = gs.annotations.current_mesh()
        names = None if mesh is None else mesh.axis_names
        group_axes = axes_of(mesh_spec(("batch" if as_laid else "group",), self.rules, names)[0]) if names else ()
        length_axes = self._split("length") if as_laid else ()
        expert_axes = axes_of(mesh_spec(("expert",), self.rules, names)[0]) if names else ()
        model_axes = axes_of(mesh_spec(("expert", "mlp"), self.rules, names)[1]) if names else ()
        token_axes = group_axes + tuple(a for a in expert_axes if a not in group_axes)
        K = g.k
        experts = jnp.where(choice.valid_GSK, choice.experts_GSK, self.cfg.num_experts)  # invalid: no expert
        tokens = (G, S) if as_laid else (G * S,)  # as laid: the region takes [batch, length] as it lies
        y_TM, dropped = D.dropless(x_GSM.reshape(*tokens, M), experts.reshape(*tokens, K),
                                   gates_GSK.reshape(*tokens, K), w, _activation(self.cfg.activation),
                                   num_experts=self.cfg.num_experts, token_axes=token_axes,
                                   expert_axes=expert_axes, model_axes=model_axes, exchange=self.cfg.exchange,
                                   peer_bound=self.cfg.peer_bound, matmul=self.cfg.grouped_matmul,
                                   length_axes=length_axes)
        used_E = jnp.sum(jax.nn.one_hot(experts, self.cfg.num_experts, dtype=jnp.float32), axis=(0, 1, 2))
        stats = {"dropped": dropped, "dropped_per_choice": jnp.zeros((K,), jnp.float32) + dropped,
                 "expert_usage": used_E / jnp.maximum(jnp.sum(used_E), 1.0),
                 "router_confidence": gating.masked_mean(jnp.max(choice.probs_GSE, axis=-1), mask_GS)}
        aux = gating.balance_loss(choice.probs_GSE, choice.experts_GSK, g, mask_GS)
        return y_TM.reshape(G, S, M), aux, stats


def expert_einsums(dispatch, combine, x, wi, wo, num_partitions: int):
    """dispatch/combine [G, S, E, C], x [G, S, M], wi [E, M, H], wo [E, H, M] -> [G, S, M].

    GShard's Algorithm 2 annotated with split(): groups G split on the way in
    and out, experts E in between (the MoeFFN module does the same with
    logical axis names).
    """
    n = num_partitions
    x = gs.split(x, 0, n)
    dispatch, combine = gs.split(dispatch, 0, n), gs.split(combine, 0, n)
    e_in = gs.split(jnp.einsum("GSEC,GSM->EGCM", dispatch, x), 0, n)
    h = jax.nn.relu(jnp.einsum("EGCM,EMH->EGCH", e_in, gs.split(wi, 0, n)))
    e_out = gs.split(jnp.einsum("EGCH,EHM->GECM", h, gs.split(wo, 0, n)), 0, n)
    return gs.split(jnp.einsum("GSEC,GECM->GSM", combine, e_out), 0, n)
