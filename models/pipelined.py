"""A Stack's periods as a pipeline over the `stage` mesh axis (gs.pipeline).

The params are the scanned stack's ([periods, ...] on a leading "layers"
dim, which the rules split over `stage` into contiguous blocks). With
repeats (circular, interleaved 1F1B) stage s runs layer chunks s, s + p,
..., so the stack is stored in that order (`storage_order`): stage s's
block holds its own chunks and the per-step ``[repeats, stages]`` view is
a local reshape, with no parameter crossing stages. A checkpoint records
its order and is re-laid on restore, so it moves between pipelined and
unpipelined runs and across stage and repeat counts. Each stage
runs ``periods / (stages * repeats)`` scanned periods on one microbatch; MoE
losses and statistics come out of each stage as the pipeline's aux and are
averaged over microbatches, as gradient accumulation averages them.

GPipe and circular run inside ``model.apply`` (autodiff differentiates the
loop) where the ends are replicated (`pipelined`). 1F1B and interleaved 1F1B
own their backward pass, so the loss must be computed inside the pipeline,
and so is it under every schedule with stage-owned ends (`loss_in_pipeline`),
so that the last stage's outputs go to the head on that stage rather than
being summed over the stages: `pipelined_loss` runs the head and the loss
per microbatch at the last stage and wraps gs.pipeline_value_and_grad in a
custom_vjp, so ``jax.grad`` of the model's loss still works.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import gshard_jax as gs
from gshard_jax.pipelines import schedules as S

from .logical import FIRST_STAGE, LAST_STAGE, end_owner, mesh_spec


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    stages: int = 1  # p: pipeline stages (the size of the `stage` mesh axis)
    microbatches: int = 1  # m: microbatches per step (train.microbatches)
    schedule: str = "gpipe"  # one of schedules.SCHEDULES
    repeats: int = 1  # r: layer chunks per stage (circular and interleaved_1f1b)

    @property
    def owns_backward(self) -> bool:
        return self.schedule in S.OWN_BACKWARD


def loss_in_pipeline(pc: Optional[PipelineConfig], end_stages: int) -> bool:
    """Whether the pipeline runs the head and loss (`pipelined_loss`): a schedule that owns its backward needs
    the loss per microbatch, and with stage-owned ends the last stage runs them on its own outputs, which
    then never cross the stage axis."""
    return pc is not None and (pc.owns_backward or end_stages > 1)


def check(pc: PipelineConfig, periods: int) -> None:
    S.check(pc.schedule, pc.stages, pc.microbatches, pc.repeats)
    if periods % (pc.stages * pc.repeats):
        raise ValueError(f"pipeline: {periods} layer periods do not split into {pc.stages} stages x "
                         f"{pc.repeats} repeats; choose num_layers / period divisible by stages * repeats")


def order_key(pc: Optional[PipelineConfig], end_stages: int = 1) -> dict:
    """The storage order of a stack's layer dim, as a checkpoint records it: layer order (stages 1,
    repeats 1) unless chunks repeat over the stages; with stage-owned ends (TransformerConfig.end_stages),
    their stage count as "ends"."""
    key = ({"stages": 1, "repeats": 1} if pc is None or pc.repeats == 1 or pc.stages == 1 else
           {"stages": pc.stages, "repeats": pc.repeats})
    return dict(key, ends=end_stages) if end_stages > 1 else key


def storage_order(periods: int, stages: int, repeats: int) -> np.ndarray:
    """Layer period held at each position of the stored stack: stage s's contiguous block holds chunks
    s, s + p, ..., s + (r - 1) p, the chunks it runs (identity for r = 1)."""
    chunk = periods // (stages * repeats)
    chunks = np.arange(stages * repeats).reshape(repeats, stages).T.reshape(-1)
    return (chunks[:, None] * chunk + np.arange(chunk)).reshape(-1)


def reorder(tree: Any, stacked: Any, src: dict, dst: dict, ends: Any = None) -> Any:
    """The leaves flagged in `stacked` (a leading stacked-layers dim) moved from storage order `src` to
    `dst` (`order_key`s); the stage-owned ends (`ends`: "first" or "last" per leaf, "" for the others) from
    src's end stages to dst's: the owner's slice taken, then stacked once per stage (the others' copies are
    never read); the rest unchanged."""
    if src == dst:
        return tree
    e_src, e_dst = src.get("ends", 1), dst.get("ends", 1)
    ends = jax.tree.map(lambda _: "", stacked) if ends is None else ends

    def move(flag, end, a):
        if isinstance(a, nn.meta.AxisMetadata):  # a boxed param (logical axes): move its value
            moved = a.replace_boxed(move(flag, end, a.unbox()))
            if end and e_src != e_dst and hasattr(a, "names"):  # and name its stage dim as the owner's
                names = tuple(a.names)[1:] if e_src > 1 else tuple(a.names)
                lead = (FIRST_STAGE if end == "first" else LAST_STAGE,) if e_dst > 1 else ()
                moved = moved.replace(names=lead + names)
            return moved
        if end and e_src != e_dst:
            a = a[0 if end == "first" else -1] if e_src > 1 else a
            return jnp.broadcast_to(a, (e_dst,) + a.shape) if e_dst > 1 else a
        if not flag or (src["stages"], src["repeats"]) == (dst["stages"], dst["repeats"]):
            return a
        n = a.shape[0]
        held = np.argsort(storage_order(n, src["stages"], src["repeats"]))  # layer -> position in src
        return a[held[storage_order(n, dst["stages"], dst["repeats"])]]
    return jax.tree.map(move, stacked, ends, tree, is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata))


def ends(boxed: Any) -> Any:
    """Per leaf of a param tree with logical axes, which end stage owns it: "first" (the embedding), "last"
    (the final norm and unembedding), or "" (not a stage-owned end)."""
    return jax.tree.map(end_owner, nn.get_partition_spec(boxed),
                        is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))


def stacked(boxed: Any) -> Any:
    """Per leaf of a param tree with logical axes, whether its leading dim is a scanned stack's layers."""
    return jax.tree.map(lambda spec: bool(spec) and spec[0] == "layers", nn.get_partition_spec(boxed),
                        is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))


def _specs(stack: nn.Module, init: Callable):
    """Per stacked leaf, the mesh spec of its dims after the stage dim (the chunk's layers dim whole), and
    the spec of one microbatch of the pipeline's state, from the rules table."""
    mesh = gs.annotations.current_mesh()
    if mesh is None:
        return None, None
    boxed = jax.eval_shape(init, jax.random.key(0))
    rules = stack.cfg.rules
    names = nn.get_partition_spec(boxed)
    params = jax.tree.map(lambda spec: (None,) + mesh_spec(tuple(spec)[1:], rules, mesh.axis_names), names,
                          is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    act = mesh_spec(("batch", "seq", "embed"), rules, mesh.axis_names)
    state = {"x": act, "enc": act, "mask": act[:2]}
    return params, state


def _setup(stack: nn.Module, n: int, x, enc, mask, periods: Callable):
    """(stacked params as [stages] or [repeats, stages] chunks, stage function, state, specs)."""
    c, pc = stack.cfg, stack.cfg.pipeline
    check(pc, n)
    p, r = pc.stages, pc.repeats
    chunk = n // (p * r)
    args = (c, stack.causal, stack.cross, stack.train)

    x_init = x[0] if c.end_stages > 1 else x  # stage-owned ends: x leads with [stages]
    def init(rng):  # the scanned stack's params in layer order, stored in the pipeline's order
        w = periods(c, n)(*args).init({"params": rng}, x_init, enc, mask)["params"]
        return reorder(w, jax.tree.map(lambda _: True, w), order_key(None), order_key(pc))

    init = jax.jit(init)  # traced once for the specs' shapes and Flax's shape check of the stored params
    param_specs, state_specs = _specs(stack, init)
    w = stack.param("layers", init)
    # [stages, chunk] or, stored stage-major, [stages, repeats, chunk] -> [repeats, stages, chunk]: local
    w = jax.tree.map(lambda a: a.reshape(p, chunk, *a.shape[1:]) if r == 1 else
                     a.reshape(p, r, chunk, *a.shape[1:]).swapaxes(0, 1), w)
    state = {k: v for k, v in (("x", x), ("enc", enc), ("mask", mask)) if v is not None}
    body = periods(c, chunk)(*args)

    def stage(w, s):
        y, metrics = body.apply({"params": w}, s["x"], s.get("enc"), s.get("mask"))
        return dict(s, x=y), jax.tree.map(lambda a: a.sum(0), metrics)

    if state_specs is not None:
        state_specs = {k: state_specs[k] for k in state}
    return w, stage, state, param_specs, state_specs


def pipelined(stack: nn.Module, n: int, x, enc, mask, periods: Callable):
    """The Stack's period factory for pipelines (forward; autodiff's backward): (x, metrics). periods(cfg,
    length): the model's `length` layer periods as one scanned module (transformer.scanned_periods)."""
    pc = stack.cfg.pipeline
    w, stage, state, param_specs, state_specs = _setup(stack, n, x, enc, mask, periods)
    forward = {"1f1b": "gpipe", "interleaved_1f1b": "circular"}.get(pc.schedule, pc.schedule)
    y, metrics = gs.pipeline(stage, w, state, num_microbatches=pc.microbatches, schedule=forward,
                             repeats=pc.repeats, has_aux=True, x_spec=state_specs, param_specs=param_specs)
    return y["x"], jax.tree.map(lambda a: a / pc.microbatches, metrics)


def pipelined_loss(stack: nn.Module, n: int, x, head: Callable, head_params, targets, aux_weights: dict,
                   periods: Callable):
    """The mean over microbatches of head(head_params, y_mb, targets_mb) + the weighted MoE losses, where
    `loss_in_pipeline`: (loss, metrics including "cross_entropy"). GPipe and circular differentiate their loop
    here too (gs.pipeline_value_and_grad), inside the custom_vjp's forward."""
    pc = stack.cfg.pipeline
    w, stage, state, param_specs, state_specs = _setup(stack, n, x, None, None, periods)
    m = pc.microbatches

    def run(w, state, head_params, targets):
        (ce, aux), grads = gs.pipeline_value_and_grad(
            stage, w, state, lambda hp, y, t: head(hp, y["x"], t), head_params, targets, num_microbatches=m,
            schedule=pc.schedule, repeats=pc.repeats, has_aux=True,
            aux_weights=aux_weights, x_spec=state_specs,
            param_specs=param_specs, owned_ends=stack.cfg.end_stages > 1)
        total = ce + sum(jnp.sum(aux[k]) * v for k, v in aux_weights.items() if k in aux)
        return (total / m, ce / m, jax.tree.map(lambda a: a / m, aux)), grads

    @jax.custom_vjp
    def loss(w, state, head_params, targets):
        return run(w, state, head_params, targets)[0]

    def fwd(w, state, head_params, targets):
        out, grads = run(w, state, head_params, targets)
        return out, (grads, targets)

    def bwd(res, cts):
        (dw, dstate, dhead), targets = res
        g = cts[0] / m  # the objective is the mean over microbatches; ce and aux are reported, not differentiated
        scale = lambda tree, like: jax.tree.map(lambda d, a: (g * d).astype(a.dtype), tree, like)
        return (scale(dw, w), scale(dstate, state), scale(dhead, head_params),
                jax.tree.map(lambda t: _zero_cotangent(t), targets))

    loss.defvjp(fwd, bwd)
    total, ce, metrics = loss(w, state, head_params, targets)
    return total, dict(metrics, cross_entropy=ce)


def _zero_cotangent(t):
    return jnp.zeros(t.shape, jax.dtypes.float0) if not jnp.issubdtype(t.dtype, jnp.inexact) else jnp.zeros_like(t)

