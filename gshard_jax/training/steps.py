"""The step functions: pure, module-level functions of their arrays and a static StepConfig.

As nanodo and Flax's lm1b example do, the train step is one function of (state, batch) whose other inputs
(the built models and optimizer, the state's layout, the config's fields) are bound once with
``functools.partial(train_step, c=...)`` (or passed as a static argument) and partitioned; it reads
nothing else, so what it computes is visible from its arguments. ``Trainer`` builds the StepConfig and
holds the partitioned functions.

One train step: loss and gradients (summed over microbatches in a scan), a finiteness check of the loss and
the gradient norm, the optimiser update (dropped under ``nan_policy="skip"`` when not finite). Steps are
numbered from 1: the state's ``step`` counts the updates made, so the step running is ``state["step"] + 1``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from .. import configs
from ..models import layers, pipelined
from ..models.transformer import loss_fn
from ..partitioner.representation import jax_compat
from . import faults, layout as state_layout, optim

METRICS = ("cross_entropy", "aux_loss", "z_loss", "dropped", "router_confidence")  # per step, from loss_fn


@dataclasses.dataclass(frozen=True, eq=False)
class StepConfig:
    """What the step functions read besides their array arguments, built once by Trainer (never traced).
    Compared and hashed by identity, so it can also be a jit static argument (static_argnames="c")."""
    model: nn.Module  # the train-mode model (its stack pipelined over the stage axis when there is one)
    eval_model: nn.Module  # the same model in eval mode
    init_model: nn.Module  # the model unpipelined: params are initialised and laid out as without stages
    kind: str  # model.kind: which example inputs init traces the model with
    opt: optax.GradientTransformation  # AdamW after post-warmup clipping (optim.optimizer)
    schedule: optax.Schedule  # the learning rate by update, reported with each step
    layout: state_layout.Layout  # where params, gradients and the optimizer state are sharded
    layer_order: dict  # the storage order of a scanned stack's layers (pipelined.order_key)
    train: configs.TrainConfig  # seed, microbatches, zero_stage, nan_policy, goldfish_k and goldfish_h
    nan_at_step: int  # debug.nan_at_step: the step whose loss is poisoned with NaN (-1: never)
    pipeline: Optional[pipelined.PipelineConfig]  # the model's pipeline (it runs the microbatches itself)
    shards: int  # the batch's shards: non-finite rows are counted per shard
    master: bool  # float32 master weights in the opt state: a low-precision model's, or an offloaded update's
    offload: bool  # train.offload_optimizer: the optimizer state in host memory, updated there (host_update)
    delayed: bool = False  # train.delayed_update: the update applies the previous step's gradients (delayed_step)

    @property
    def compute_dtype(self) -> Any:
        return self.model.cfg.compute_dtype


def init_state(key: jax.Array, *, c: StepConfig) -> dict:
    """A fresh state: params (in the stack's storage order), optimizer state (with master weights when
    c.master; in host memory when offloaded), step 0."""
    # a sequence per batch shard: a dropless layer's manual region splits its tokens over them, which one
    # sequence does not over more shards than it has tokens (the forward traced here is only shapes to XLA)
    params = nn.unbox(c.init_model.init(key, *configs.example_tokens(c.kind, c.shards, c.train.seq_len)))
    params = pipelined.reorder(params, c.layout.stacked, pipelined.order_key(None), c.layer_order, c.layout.ends)
    opt_state = c.opt.init(params)
    if c.master:
        opt_state = {"master": params, "adam": opt_state}
        params = jax.tree.map(lambda p: p.astype(c.compute_dtype), params)
    if c.delayed:
        opt_state["pending"] = no_pending(params)
    if c.offload:
        opt_state = jax.device_put(opt_state, jax.memory.Space.Host)
    return {"params": params, "opt_state": opt_state, "step": jnp.zeros([], jnp.int32)}


def no_pending(params: Any) -> dict:
    """The delayed update's gradients waiting on the host before the first step: zeros, not to be applied."""
    return {"grads": jax.tree.map(jnp.zeros_like, params), "norm": jnp.zeros([], jnp.float32),
            "ok": jnp.zeros([], jnp.bool_)}


def gradients(params: Any, batch: dict, step: jax.Array, *, c: StepConfig
              ) -> tuple[jax.Array, dict, Any, jax.Array]:
    """(loss, metrics, float32 gradients reduced to the layout's gradient spec, non-finite rows per batch
    shard), summed over train.microbatches in a scan (the accumulator sharded as the optimizer state from
    zero_stage 2 on). The rows are watched where they are embedded (faults.watch_rows)."""
    t, lo = c.train, c.layout
    poison = jnp.where(step == c.nan_at_step, jnp.nan, 1.0)
    rng = jax.random.fold_in(jax.random.key(t.seed), step)

    def loss(p, probe_B, b, key):
        fault_B = b["soft_fail"][:, 0] if "soft_fail" in b else None
        with nn.intercept_methods(faults.row_watcher(layers.Embed, probe_B, fault_B)):
            value, m = loss_fn(c.model, p, b, key)
        return value * poison, {k: m[k] for k in METRICS}

    def one(b, key, specs):
        probe_B = jnp.zeros(b["inputs"].shape[:1], jnp.float32)
        (value, m), (g, rows_B) = jax.value_and_grad(loss, (0, 1), has_aux=True)(params, probe_B, b, key)
        if specs is not None:  # in the microbatch scan the partitioner reduces the sum once, after it
            g = state_layout.constrain(g, specs)
        bad_S = faults.nonfinite_per_shard(rows_B, c.shards)
        return value, m, jax.tree.map(lambda x: x.astype(jnp.float32), g), bad_S

    k = 1 if c.pipeline is not None else t.microbatches  # a pipeline runs the microbatches itself
    if k == 1:
        return one(batch, rng, lo.gradients)
    # Rows i, i + k, ... form microbatch i: each device's rows split evenly, with no data movement.
    micro = jax.tree.map(lambda x: x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1), batch)
    acc_specs = lo.gradients if t.zero_stage >= 2 else lo.stored

    def body(acc, xs):
        i, b = xs
        *out, bad_S = one(b, jax.random.fold_in(rng, i), None)
        return jax.tree.map(jnp.add, acc, (tuple(out), bad_S)), None

    zeros = (jnp.zeros([], jnp.float32), {n: jnp.zeros([], jnp.float32) for n in METRICS},
             state_layout.constrain(jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params), acc_specs))
    init = (zeros, jnp.zeros([c.shards], jnp.int32))
    (value, m, g), bad_S = jax.lax.scan(body, init, (jnp.arange(k), micro))[0]
    value, m, g = jax.tree.map(lambda x: x / k, (value, m, g))
    return value, m, state_layout.constrain(g, lo.gradients), bad_S


def apply_update(state: dict, grads: Any, *, c: StepConfig, norm: Optional[jax.Array] = None) -> dict:
    """The optimizer step: float32 gradients (in the layout's gradient spec) -> the next state. The moments
    (and master weights) are updated where they are sharded; the new params are gathered to their spec.
    `norm`: the gradients' global norm where the caller has it (clipping then does not sum them again)."""
    lo = c.layout
    if c.master:
        master, inner = state["opt_state"]["master"], state["opt_state"]["adam"]
        updates, inner = c.opt.update(grads, inner, master, global_norm=norm)
        master = optax.apply_updates(master, updates)
        params = jax.tree.map(lambda p: p.astype(c.compute_dtype), master)
        opt_state = {"master": master, "adam": inner}
    else:
        held = state_layout.constrain(state["params"], lo.optimizer)  # this device's slice: no communication
        updates, opt_state = c.opt.update(grads, state["opt_state"], held, global_norm=norm)
        params = optax.apply_updates(held, updates)
    return {"params": state_layout.constrain(params, lo.stored), "opt_state": opt_state, "step": state["step"] + 1}


def host_update(state: dict, grads: Any, grad_norm: jax.Array, ok: Optional[jax.Array], *, c: StepConfig
                ) -> dict:
    """ZeRO-Offload's update, for an optimizer state kept in host memory: the gradients go down in the
    params' dtype (2 bytes a parameter for bf16), the host's cores update the float32 master weights and
    moments where they live, and the new params come up in their dtype; clipping takes the norm the device
    computed. Under nan_policy="skip" an update whose `ok` is false is dropped on both sides."""
    return _apply_on_host(state, *jax.device_put((_flat(_low(grads, state, c), c.layout.optimizer), grad_norm, ok),
                                                 jax.memory.Space.Host), c=c)


def _low(grads: Any, state: dict, c: StepConfig) -> Any:
    """Float32 gradients as this device's slice (the optimizer's layout) in the params' dtype: what goes down."""
    dtypes = jax.tree.map(lambda p: p.dtype, state["params"])
    return jax.tree.map(lambda g, d: g.astype(d), state_layout.constrain(grads, c.layout.optimizer), dtypes)


def _apply_on_host(state: dict, g_low: Any, norm: jax.Array, ok: Optional[jax.Array], *, c: StepConfig) -> dict:
    """The host's update with gradients already in host memory, in the params' dtype (flat or in their shapes):
    the master weights and moments updated there, the new params brought up to the device. The update runs as
    train.host_update_groups host computations over groups of leaves of about equal size (host_groups), none
    reading another's results."""
    lo = c.layout
    leaves, struct = jax.tree.flatten(state["params"])
    specs = jax.tree.leaves(lo.optimizer, is_leaf=lambda s: isinstance(s, P))
    held = {k: state["opt_state"][k] for k in ("master", "adam")}
    g_leaves = jax.tree.leaves(g_low)

    def update_of(idx: list[int]):
        def update(opt_state, g, norm, ok):
            master, inner = opt_state["master"], opt_state["adam"]
            g = [x.reshape(leaves[i].shape).astype(jnp.float32) for x, i in zip(g, idx)]
            updates, inner = c.opt.update(g, inner, master, global_norm=norm)
            new = {"master": optax.apply_updates(master, updates), "adam": inner}
            if ok is not None:
                new = jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, opt_state)
            return new, _flat([m.astype(leaves[i].dtype) for m, i in zip(new["master"], idx)], [specs[i] for i in idx])
        return update

    groups = host_groups([x.size for x in leaves], c.train.host_update_groups)
    parts = [jax_compat.on_host(update_of(idx), _take(held, struct, idx), [g_leaves[i] for i in idx], norm, ok)
             for idx in groups]
    opt_state = _merge(held, struct, groups, [new for new, _ in parts])
    params = _assemble(groups, [up for _, up in parts], len(leaves))
    opt_state = jax.device_put(opt_state, jax.memory.Space.Host)  # step counts: scalars XLA may keep on the device
    params = [x.reshape(p.shape) for x, p in zip(jax.device_put(params, jax.memory.Space.Device), leaves)]
    params = state_layout.constrain(jax.tree.unflatten(struct, params), lo.stored)
    if ok is not None:
        params = jax.tree.map(lambda a, b: jnp.where(ok, a, b), params, state["params"])
    return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}


def host_groups(sizes: list[int], k: int) -> list[list[int]]:
    """Leaf indices in at most k groups of about equal total size (elements of the whole leaf), each in leaf
    order and none empty: the largest leaf first, each onto the group that holds least so far."""
    groups: list[list[int]] = [[] for _ in range(max(1, min(k, len(sizes))))]
    held = [0] * len(groups)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        j = held.index(min(held))
        groups[j].append(i)
        held[j] += sizes[i]
    return [sorted(g) for g in groups if g]


def _assemble(groups: list[list[int]], lists: list, n: int) -> list:
    """The n leaves, each from the list of the group holding it (group g's list in its leaf order)."""
    leaves: list = [None] * n
    for idx, got in zip(groups, lists):
        for i, x in zip(idx, got):
            leaves[i] = x
    return leaves


def _params_shaped(struct: Any):
    """Whether a subtree of the optimizer state is shaped as the params (master weights, a moment)."""
    return lambda t: jax.tree.structure(t) == struct


def _take(tree: Any, struct: Any, idx: list[int]) -> Any:
    """`tree` (the master weights and optimizer state) with each subtree shaped as the params (`struct`) cut to
    the list of its leaves at idx; the rest (step counts) as they are."""
    whole = _params_shaped(struct)

    def cut(t):
        leaves = jax.tree.leaves(t)
        return [leaves[i] for i in idx]
    return jax.tree.map(lambda t: cut(t) if whole(t) else t, tree, is_leaf=whole)


def _merge(tree: Any, struct: Any, groups: list[list[int]], parts: list) -> Any:
    """The groups' updated states (_take's form, one per group) put back in `tree`'s form: each params-shaped
    subtree from its groups' lists, the rest (step counts, the same in every group) from the first group's."""
    whole = _params_shaped(struct)
    units, outer = jax.tree.flatten(tree, is_leaf=whole)
    per = [outer.flatten_up_to(p) for p in parts]
    return jax.tree.unflatten(outer, [
        jax.tree.unflatten(struct, _assemble(groups, [p[u] for p in per], struct.num_leaves)) if whole(unit)
        else per[0][u] for u, unit in enumerate(units)])


def delayed_step(state: dict, grads: Any, grad_norm: jax.Array, ok: jax.Array, *, c: StepConfig) -> dict:
    """ZeRO-Offload's delayed parameter update: the host applies the gradients the previous step left
    waiting in host memory (none before the first step) while the device computes this step's, which go down
    to wait for the next. The device's params are one update behind the gradients it computes, and the
    host's work depends on nothing the device computes this step, so the two may run at once. `ok`: whether
    this step's gradients may be applied (nan_policy="skip" drops them when not finite)."""
    pending = state["opt_state"]["pending"]
    new = _apply_on_host(state, pending["grads"], pending["norm"], pending["ok"], c=c)
    waiting = {"grads": _low(grads, state, c), "norm": grad_norm, "ok": ok}
    new["opt_state"]["pending"] = jax.device_put(waiting, jax.memory.Space.Host)
    return new


def _flat(tree: Any, specs: Any) -> Any:
    """Each leaf split at most on its first dim as a 1-D buffer (a local reshape: no communication), the
    others as they are. What crosses to and from the host's update is flat because XLA:GPU (JAX 0.11.2) can
    lay a host computation's 2-D parameter out transposed from the buffer its call passes, and refuses to
    compile; a 1-D buffer has one layout."""
    def flat(x, spec):
        spec = tuple(spec)
        if x.ndim < 2 or any(e is not None for e in spec[1:]):
            return x
        return state_layout.constrain(x.reshape(-1), P(*spec[:1]))
    return jax.tree.map(lambda s, x: flat(x, s), specs, tree, is_leaf=lambda s: isinstance(s, P))


def update(state: dict, grads: Any, *, c: StepConfig) -> dict:
    """The optimizer step as a function of its own (Trainer's "update" partitioned function): on the device,
    or on the host under offload_optimizer."""
    if c.offload:
        new = host_update(state, grads, optax.tree.norm(grads), None, c=c)
        if c.delayed:  # the gradients given are applied now; those waiting still wait
            new["opt_state"]["pending"] = state["opt_state"]["pending"]
        return new
    return apply_update(state, grads, c=c)


def train_step(state: dict, batch: dict, *, c: StepConfig) -> tuple[dict, dict]:
    """(next state, metrics): the gradients of the batch, their norm, and the update, which nan_policy="skip"
    drops when the loss or the norm is not finite (the step still counts)."""
    t, step = c.train, state["step"] + 1
    if t.goldfish_k > 1:
        batch = dict(batch, weights=optim.goldfish_weights(batch["inputs"], t.goldfish_k, t.goldfish_h))
    value, m, grads, bad_S = gradients(state["params"], batch, step, c=c)
    grad_norm = optax.tree.norm(grads)
    ok = jnp.isfinite(value) & jnp.isfinite(grad_norm)
    skip = t.nan_policy == "skip"
    if c.delayed:
        new = delayed_step(state, grads, grad_norm, ok if skip else jnp.ones([], jnp.bool_), c=c)
    elif c.offload:
        new = host_update(state, grads, grad_norm, ok if skip else None, c=c)
    else:
        new = apply_update(state, grads, c=c, norm=grad_norm)
        if skip:
            new = jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, dict(state, step=step))
    # the learning rate of the update this step applies (under delayed_update the previous step's gradients)
    applied = jnp.maximum(step - 2, 0) if c.delayed else step - 1
    out = {"loss": value, "grad_norm": grad_norm, "learning_rate": c.schedule(applied), "finite": ok,
           "nonfinite_rows": bad_S, **m}
    return new, out


def eval_step(params: Any, batch: dict, *, c: StepConfig) -> jax.Array:
    """The held-out cross-entropy of a batch under the eval-mode model."""
    return loss_fn(c.eval_model, params, batch)[1]["cross_entropy"]
