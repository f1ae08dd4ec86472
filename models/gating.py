"""MoE gating: which experts each token goes to, with what weight, and in which buffer slot.

Tokens come in local groups (`G` groups of `S` tokens, GShard (docs/references.md));
each expert takes at most `C` tokens per group. One mechanism covers GShard
top-2, Switch top-1 and OLMoE top-8: every token picks `k` experts
(:func:`choose`), then slots are handed out choice by choice, so every first
choice has priority over every second choice, and so on (:func:`with_capacity`).
Choices after the first are kept for all tokens ("all"), with probability
proportional to their gate ("random", GShard's rule: kept when
``k * g > max(threshold, u)`` for uniform u, so threshold 0 is the paper's
rule and a positive one drops weak choices outright), or sampled from the
remaining gates ("sampling"). Gates are renormalised over the k choices before
or after capacity drops, or not at all. Expert-choice routing (each expert
takes its top-C tokens) and forced uniform routing (every expert gets the same
tokens, for benchmarks that isolate imbalance) produce the same outputs. All
routing math runs in float32.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class GatingConfig:
    k: int = 2  # experts per token: 1 = Switch, 2 = GShard, 8 = OLMoE (for expert_choice: mean experts per token)
    capacity_factor: float = 2.0  # training capacity: C = ceil(k * S * capacity_factor / E), at least min_capacity
    eval_capacity_factor: Optional[float] = None  # capacity factor when not training (None: capacity_factor)
    min_capacity: int = 4  # floor on the per-group expert capacity
    second_policy: str = "random"  # choices after the first: "all" | "random" | "sampling"
    second_threshold: float = 0.0  # "random": keep a later choice only if k * g > max(threshold, u)
    normalize: str = "before_drop"  # renormalise gates over the k choices: "before_drop" | "after_drop" | "none"
    balance: str = "top1"  # aux loss density from the first choice (GShard, Switch) or "all" choices (OLMoE)
    routing: str = "token_choice"  # "token_choice" | "expert_choice" | "forced_uniform"


POLICIES = ("all", "random", "sampling")
NORMALIZE = ("before_drop", "after_drop", "none")
BALANCE = ("top1", "all")
ROUTINGS = ("token_choice", "expert_choice", "forced_uniform")


def check(cfg: GatingConfig) -> None:
    """A ValueError naming the first bad field of `cfg`."""
    for field, value, allowed in (("second_policy", cfg.second_policy, POLICIES),
                                  ("normalize", cfg.normalize, NORMALIZE), ("balance", cfg.balance, BALANCE),
                                  ("routing", cfg.routing, ROUTINGS)):
        if value not in allowed:
            raise ValueError(f"GatingConfig.{field}={value!r}; expected one of {allowed}")
    if not isinstance(cfg.k, int) or cfg.k < 1:
        raise ValueError(f"GatingConfig.k={cfg.k!r}; expected a positive int (experts per token)")
    for field in ("capacity_factor", "eval_capacity_factor"):
        v = getattr(cfg, field)
        if v is not None and not v > 0:
            raise ValueError(f"GatingConfig.{field}={v!r}; expected a positive number")


def capacity(tokens_per_group: int, experts: int, cfg: GatingConfig, train: bool = True) -> int:
    """Per-group expert capacity C = ceil(k S cf / E), at least min_capacity and at most S."""
    cf = cfg.capacity_factor if train or cfg.eval_capacity_factor is None else cfg.eval_capacity_factor
    c = -(-int(round(cfg.k * tokens_per_group * cf * 1e6)) // (experts * 1_000_000))
    return int(min(max(c, cfg.min_capacity), tokens_per_group))


def masked_mean(x: jax.Array, mask: Optional[jax.Array], axis=None) -> jax.Array:
    if mask is None:
        return jnp.mean(x, axis=axis)
    m = jnp.broadcast_to(mask.reshape(mask.shape + (1,) * (x.ndim - mask.ndim)), x.shape).astype(x.dtype)
    return jnp.sum(x * m, axis=axis) / jnp.maximum(jnp.sum(m, axis=axis), 1.0)


def z_loss(logits_GSE: jax.Array, mask_GS: Optional[jax.Array] = None) -> jax.Array:
    """Router z-loss (ST-MoE): mean squared log-partition over real tokens, keeping router logits small."""
    return masked_mean(jnp.square(jax.nn.logsumexp(logits_GSE.astype(jnp.float32), axis=-1)), mask_GS)


class Choice(NamedTuple):
    """Each token's k experts, in priority order."""
    experts_GSK: jax.Array  # int32 expert ids
    gates_GSK: jax.Array  # float32 weights (0 where a choice was dropped by the second-choice policy)
    valid_GSK: jax.Array  # bool: the choice survived the second-choice policy
    probs_GSE: jax.Array  # float32 router softmax


class Routing(NamedTuple):
    combine_GSEC: jax.Array  # float32 weight of token s's slot c at expert e (0 if none)
    dispatch_GSEC: jax.Array  # bool: token s occupies slot c of expert e
    aux_loss: jax.Array  # load-balancing loss, E^2-scaled so uniform routing gives 1.0
    stats: dict  # dropped (overall), dropped_per_choice [k], expert_usage [E], router_confidence


def balance_loss(probs_GSE: jax.Array, experts_GSK: jax.Array, cfg: GatingConfig,
              mask_GS: Optional[jax.Array]) -> jax.Array:
    E = probs_GSE.shape[-1]
    chosen = experts_GSK[..., :1] if cfg.balance == "top1" else experts_GSK
    assigned_GSE = jnp.sum(jax.nn.one_hot(chosen, E, dtype=jnp.float32), axis=-2) / chosen.shape[-1]
    density_GE = masked_mean(assigned_GSE, mask_GS, axis=1)
    return jnp.mean(density_GE * masked_mean(probs_GSE, mask_GS, axis=1)) * E * E


def choose(logits_GSE: jax.Array, cfg: GatingConfig, rng: Optional[jax.Array] = None,
           mask_GS: Optional[jax.Array] = None) -> Choice:
    """Top-k experts per token under the second-choice policy, gates normalised if cfg says before_drop.

    mask_GS marks real tokens; padding tokens get no valid choice.
    """
    check(cfg)
    G, S, E = logits_GSE.shape
    k = cfg.k
    if k > E:
        raise ValueError(f"GatingConfig.k={k} but the router has only {E} experts; expected k <= {E}")
    probs_GSE = jax.nn.softmax(logits_GSE.astype(jnp.float32), axis=-1)
    random_later = k > 1 and cfg.second_policy != "all" and cfg.routing == "token_choice"
    if random_later and rng is None:
        raise ValueError(f"second_policy={cfg.second_policy!r} draws random numbers: pass rng "
                         f"(or use second_policy='all')")
    if cfg.routing == "forced_uniform":
        # Token s's j-th choice is expert (s k + j) mod E: every expert receives the same number of tokens.
        experts_GSK = jnp.broadcast_to((jnp.arange(S)[:, None] * k + jnp.arange(k)) % E, (G, S, k)).astype(jnp.int32)
        gates_GSK = jnp.take_along_axis(probs_GSE, experts_GSK, axis=-1)
    elif cfg.second_policy == "sampling" and k > 1:
        first = jnp.argmax(probs_GSE, axis=-1)
        gumbel = jax.random.gumbel(rng, probs_GSE.shape)
        score = jnp.where(jax.nn.one_hot(first, E, dtype=bool), -jnp.inf,
                          jnp.log(jnp.maximum(probs_GSE, 1e-30)) + gumbel)
        rest = jax.lax.top_k(score, k - 1)[1]
        experts_GSK = jnp.concatenate([first[..., None], rest], axis=-1).astype(jnp.int32)
        gates_GSK = jnp.take_along_axis(probs_GSE, experts_GSK, axis=-1)
    else:
        gates_GSK, experts_GSK = jax.lax.top_k(probs_GSE, k)
        experts_GSK = experts_GSK.astype(jnp.int32)
    if cfg.normalize == "before_drop" and k > 1:
        gates_GSK = gates_GSK / jnp.sum(gates_GSK, axis=-1, keepdims=True)
    valid_GSK = jnp.ones((G, S, k), bool)
    if random_later and cfg.second_policy == "random":
        u = jax.random.uniform(rng, (G, S, k - 1))
        keep = k * gates_GSK[..., 1:] > jnp.maximum(cfg.second_threshold, u)
        valid_GSK = jnp.concatenate([valid_GSK[..., :1], keep], axis=-1)
    if mask_GS is not None:
        valid_GSK = valid_GSK & mask_GS[..., None]
    return Choice(experts_GSK, jnp.where(valid_GSK, gates_GSK, 0.0), valid_GSK, probs_GSE)


def with_capacity(choice: Choice, C: int, cfg: GatingConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(combine_GSEC, kept_GSK, slots_GSK): slots handed out choice by choice, so earlier choices win."""
    E = choice.probs_GSE.shape[-1]
    k = choice.experts_GSK.shape[-1]
    taken_GE = jnp.zeros(choice.probs_GSE.shape[:1] + (E,), jnp.float32)
    kept, slots = [], []
    for j in range(k):
        mask_GSE = jax.nn.one_hot(choice.experts_GSK[..., j], E, dtype=jnp.float32) * choice.valid_GSK[..., j, None]
        pos_GSE = jnp.cumsum(mask_GSE, axis=1) - mask_GSE + taken_GE[:, None, :]
        keep_GSE = mask_GSE * (pos_GSE < C)
        taken_GE = taken_GE + jnp.sum(keep_GSE, axis=1)
        kept.append(jnp.sum(keep_GSE, axis=-1) > 0)
        slots.append(jnp.sum(pos_GSE * mask_GSE, axis=-1).astype(jnp.int32))
    kept_GSK, slots_GSK = jnp.stack(kept, -1), jnp.stack(slots, -1)
    gates_GSK = jnp.where(kept_GSK, choice.gates_GSK, 0.0)
    if cfg.normalize == "after_drop" and k > 1:
        total = jnp.sum(gates_GSK, axis=-1, keepdims=True)
        gates_GSK = gates_GSK / jnp.where(total > 0, total, 1.0)
    one_hot_GSKE = jax.nn.one_hot(choice.experts_GSK, E, dtype=jnp.float32) * kept_GSK[..., None]
    slot_GSKC = jax.nn.one_hot(slots_GSK, C, dtype=jnp.float32)
    combine_GSEC = jnp.einsum("GSK,GSKE,GSKC->GSEC", gates_GSK, one_hot_GSKE, slot_GSKC)
    return combine_GSEC, kept_GSK, slots_GSK


def _stats(probs_GSE: jax.Array, combine_GSEC: jax.Array, valid_GSK: jax.Array, kept_GSK: jax.Array,
           mask_GS: Optional[jax.Array]) -> dict:
    routed_GSE = jnp.sum(combine_GSEC > 0, axis=-1).astype(jnp.float32)
    used_E = jnp.sum(routed_GSE, axis=(0, 1))
    wanted_K = jnp.maximum(jnp.sum(valid_GSK, axis=(0, 1)), 1)
    return {"dropped": 1.0 - jnp.sum(kept_GSK) / jnp.maximum(jnp.sum(valid_GSK), 1),
            "dropped_per_choice": 1.0 - jnp.sum(kept_GSK, axis=(0, 1)) / wanted_K,
            "expert_usage": used_E / jnp.maximum(jnp.sum(used_E), 1.0),
            "router_confidence": masked_mean(jnp.max(probs_GSE, axis=-1), mask_GS)}


def expert_choice(probs_GSE: jax.Array, C: int) -> tuple[jax.Array, jax.Array]:
    """(combine_GSEC, picked_GSE): each expert takes its C highest-scoring tokens of the group."""
    S = probs_GSE.shape[1]
    gates_GEC, tokens_GEC = jax.lax.top_k(jnp.swapaxes(probs_GSE, 1, 2), C)
    picked_GECS = jax.nn.one_hot(tokens_GEC, S, dtype=jnp.float32)
    combine_GSEC = jnp.einsum("GEC,GECS->GSEC", gates_GEC, picked_GECS)
    return combine_GSEC, jnp.sum(picked_GECS, axis=2).swapaxes(1, 2) > 0


def route(logits_GSE: jax.Array, cfg: GatingConfig, rng: Optional[jax.Array] = None,
          train: bool = True, mask_GS: Optional[jax.Array] = None) -> Routing:
    """Dispatch mask, combine weights, aux loss and drop statistics for router logits [G, S, E].

    mask_GS marks real tokens (groups padded to a fixed size): padding takes no slot and no part in
    the losses or statistics.
    """
    check(cfg)
    G, S, E = logits_GSE.shape
    C = capacity(S, E, cfg, train)
    if cfg.routing == "expert_choice":
        probs_GSE = jax.nn.softmax(logits_GSE.astype(jnp.float32), axis=-1)
        scores_GSE = probs_GSE if mask_GS is None else jnp.where(mask_GS[..., None], probs_GSE, -1.0)
        combine_GSEC, picked_GSE = expert_choice(scores_GSE, C)
        combine_GSEC = jnp.maximum(combine_GSEC, 0.0)
        unrouted = masked_mean((jnp.sum(picked_GSE, axis=-1) == 0).astype(jnp.float32), mask_GS)  # no expert took it
        stats = {"dropped": unrouted, "dropped_per_choice": unrouted[None],
                 "expert_usage": jnp.full((E,), 1.0 / E),
                 "router_confidence": masked_mean(jnp.max(probs_GSE, axis=-1), mask_GS)}
        return Routing(combine_GSEC, combine_GSEC > 0, jnp.zeros((), jnp.float32), stats)
    choice = choose(logits_GSE, cfg, rng, mask_GS)
    combine_GSEC, kept_GSK, _ = with_capacity(choice, C, cfg)
    aux = balance_loss(choice.probs_GSE, choice.experts_GSK, cfg, mask_GS)
    return Routing(combine_GSEC, combine_GSEC > 0, aux, _stats(choice.probs_GSE, combine_GSEC,
                                                                choice.valid_GSK, kept_GSK, mask_GS))


def top2_gating(logits_GSE: jax.Array, cfg: GatingConfig = GatingConfig(),
                rng: Optional[jax.Array] = None) -> Routing:
    """GShard's top-2 gating (paper Algorithm 1): :func:`route` with k = 2."""
    return route(logits_GSE, dataclasses.replace(cfg, k=2), rng)
