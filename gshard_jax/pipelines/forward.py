"""Pipeline parallelism in global view: stages stacked on a dim split over the `stage` mesh axis.

Every tick runs all stages at once (``vmap`` over the stage dim, each
device running its own stage) and moves activations one stage on by a
roll of that dim, which the partitioner lowers to one collective-permute.
Which microbatch each stage runs is read from the schedule's table
(schedules.py); bubble slots run on zeros and their results and gradients
are cut off by ``where``, so nothing in a bubble can leak into the loss.

``pipeline`` is the forward (GPipe, circular): differentiate through it and
autodiff's backward stores every tick's residuals (memory grows with m).
``pipeline_value_and_grad`` also runs the 1F1B schedules, which own their
backward: the per-stage ``jax.vjp`` residuals that depend on the activation
wait in a ring buffer of 2 r p - 1 slots (those that depend on the weights
alone are recomputed), so memory is bounded whatever m is.

The stage function's own annotations (over data, x/y/z, expert) apply
inside each stage: under the pipeline's vmap they gain the stage axis on
the stacked dim.
"""
from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp

from . import schedules as S
from .common import (
    PyTree,
    Run,
    aux_zeros,
    check_owned,
    chunk,
    from_stage,
    put_rows,
    record,
    stacked,
    stage_axis,
    stage_inputs,
    stages_of,
    unmicrobatch,
    zero_unless,
)
from .residuals import Residuals


def pipeline(stage_fn: Callable, params: PyTree, x: PyTree, *, num_microbatches: int, schedule: str = "gpipe",
             repeats: int = 1, has_aux: bool = False, axis: str = "stage", x_spec: Optional[PyTree] = None,
             param_specs: Optional[PyTree] = None, unroll: bool = False, owned_ends: bool = False):
    """Run `stage_fn(chunk_params, x_mb) -> y_mb` (or (y_mb, aux) with has_aux) as a pipeline over x's batch.

    params: a pytree whose leaves lead with [stages] (repeats == 1) or [repeats, stages] (MaxText's
    layout): leaf[k, s] is the layer chunk stage s runs in repeat k, so in layer order chunk k * p + s.
    x: leaves [B, ...], split into
    num_microbatches microbatches of rows i, i + m, ...; y has x's structure and shapes. aux (a pytree of
    scalars) is summed over microbatches and stages. x_spec / param_specs: each leaf's PartitionSpec-like
    tuple over the other mesh axes (one microbatch / one chunk), for the annotations the pipeline makes.
    unroll: unroll the tick loop (XLA may then overlap a tick's permute with the next tick's compute, and
    cost_analysis() counts every tick).
    owned_ends: the pipeline's ends are owned by its end stages, as in `pipeline_value_and_grad`. x leads
    with [stages] (split over the stage axis) and stage 0 reads its own slice; y comes back as [stages, B, ...],
    the last stage's slice holding the outputs and the others zeros, for a head run on the last stage
    (vmapped over the stage dim). Otherwise y is replicated over the stages: the last stage's outputs are
    summed over the stage axis with the others' zeros, an all-reduce as big as y (and x's gradient is too).
    The 1F1B schedules run their forward order here; their backward needs `pipeline_value_and_grad`.
    """
    p = stages_of(params, repeats)
    S.check(schedule, p, num_microbatches, repeats)
    name = {"1f1b": "gpipe", "interleaved_1f1b": "circular"}.get(schedule, schedule)
    if owned_ends:
        check_owned(p, x=x)
    sc = S.make(name, p, num_microbatches, repeats)
    record(sc)
    ax = stage_axis(axis, p)
    run = Run(stage_fn, has_aux, sc, ax, x_spec)
    params_rp = stacked(params, repeats, p, ax, param_specs)
    xs, one_x = stage_inputs(x, num_microbatches, p, ax, x_spec, owned_ends)
    y0 = run.state(jax.tree.map(lambda a, shape: jnp.zeros(shape, a.dtype), xs, one_x))
    # per stage, every microbatch's output: only the last stage's slice is written
    out0 = jax.tree.map(lambda a: jnp.zeros(a.shape if owned_ends else (p,) + a.shape, a.dtype), xs)
    aux0 = aux_zeros(run, params_rp, y0)

    stages = _lean_stages(run, params_rp, y0, repeats)

    def tick(carry, row):
        state, out, aux = carry
        mb, rep, _ = row
        valid = mb >= 0
        inp = run.inject(xs, state, mb, rep, owned_ends)
        y, a = stages(params_rp, rep, inp, valid)
        last = valid & (run.stage_ids == p - 1) & (rep == repeats - 1)
        out = put_rows(out, mb, y, last)
        aux = jax.tree.map(jnp.add, aux, zero_unless(valid, a))
        return (run.roll(y, 1), out, aux), None

    with jax.named_scope(f"pipeline.{name}"):
        (_, out, aux), _ = jax.lax.scan(tick, (y0, out0, aux0), run.rows(sc.forward, range(sc.ticks)),
                                        unroll=unroll)
    y = jax.vmap(unmicrobatch)(out) if owned_ends else unmicrobatch(from_stage(out, p - 1))
    aux = jax.tree.map(lambda a: a.sum(0), aux)
    return (y, aux) if has_aux else y


def _lean_stages(run: "Run", params_rp, state, r: int) -> Callable:
    """(params_rp, rep, inp, valid) -> every stage on its chunk of repeat rep[s]: (y, aux).

    With repeats the chunk a stage reads changes every tick, so autodiff would keep each tick's gathered
    weights for the backward; here only the residuals that depend on the activation are kept per tick, and
    the chunk is gathered again in the backward pass (as the 1F1B schedules do)."""
    def plain(params_rp, rep, inp, valid):
        return run.vmap(lambda w, u, ok: run.call(w, zero_unless(ok, u)))(chunk(params_rp, rep, r), inp, valid)

    if r == 1:  # the one chunk is loop-invariant: autodiff keeps it once
        return plain
    res = Residuals(run.vmap, run.call,
                    jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), params_rp),
                    jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state))
    lean = jax.custom_vjp(plain)

    def fwd(params_rp, rep, inp, valid):
        def stage(w, u, ok):
            out, vjp = jax.vjp(run.call, w, zero_unless(ok, u))
            return out, res.split(jax.tree.leaves(vjp))

        out, saved = run.vmap(stage)(chunk(params_rp, rep, r), inp, valid)
        return out, (params_rp, rep, valid, saved)

    def bwd(residuals, ct):
        params_rp, rep, valid, saved = residuals
        w, chunk_vjp = jax.vjp(lambda prp: chunk(prp, rep, r), params_rp)

        def stage(recomputed, saved, ct, ok):
            dw, du = res.rebuild(recomputed, saved)(ct)
            return zero_unless(ok, dw), zero_unless(ok, du)

        dw, dinp = run.vmap(stage)(res.recompute(w), saved, ct, valid)
        return chunk_vjp(dw)[0], None, dinp, None

    lean.defvjp(fwd, bwd)
    return lean
