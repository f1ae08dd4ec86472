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

import contextvars
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from . import annotations as A, schedules as S
from .partitioner.roll import roll
from .residuals import Residuals

PyTree = Any

# Schedules traced while a partitioned program is built: explain() reports them.
TRACED: contextvars.ContextVar = contextvars.ContextVar("gshard_jax_pipelines", default=None)


# ----------------------------------------------------------------------------------------------- helpers
def _stages(params: PyTree, repeats: int) -> int:
    """The stage count p: leaves lead with [p] (repeats == 1) or [repeats, p] (repeats > 1)."""
    lead = 1 if repeats == 1 else 2
    shapes = {tuple(x.shape[:lead]) if x.ndim >= lead else None for x in jax.tree.leaves(params)}
    want = "[stages]" if repeats == 1 else f"[repeats={repeats}, stages]"
    if len(shapes) != 1 or None in shapes or (repeats > 1 and next(iter(shapes))[0] != repeats):
        raise ValueError(f"pipeline params: every leaf must lead with the same stacked dims {want}; got leading "
                         f"dims {sorted(map(str, shapes))}")
    return next(iter(shapes))[-1]


def _axis(axis: str, stages: int) -> Optional[str]:
    """The mesh axis the stage dim is split over, or None outside gs.partition (or on a mesh without it)."""
    mesh = A.current_mesh()
    if mesh is None or axis not in mesh.axis_names:
        return None
    if mesh.shape[axis] != stages:
        raise ValueError(f"pipeline: {stages} stages on mesh axis {axis!r} of size {mesh.shape[axis]}; the "
                         f"stacked params must lead with stages * repeats = {mesh.shape[axis]} * repeats chunks")
    return axis


def _shard(tree: PyTree, lead: tuple, specs: Optional[PyTree], axis: Optional[str]) -> PyTree:
    """Annotate every leaf with `lead` (stage on the stacked dim) then its spec from `specs`."""
    if axis is None:
        return tree
    leaves, treedef = jax.tree.flatten(tree)
    spec_leaves = [()] * len(leaves) if specs is None else treedef.flatten_up_to(specs)
    return treedef.unflatten([A.shard(x, (*lead, *tuple(s or ()))) for x, s in zip(leaves, spec_leaves)])


def microbatches(x: PyTree, m: int) -> PyTree:
    """[B, ...] -> [B/m, m, ...], microbatch i being [:, i] (rows i, i + m, ...): a reshape, so no copy is
    made and each device's rows split evenly."""
    def one(a):
        if a.shape[0] % m:
            raise ValueError(f"pipeline: batch dim {a.shape[0]} is not a multiple of num_microbatches={m}")
        return a.reshape(a.shape[0] // m, m, *a.shape[1:])
    return jax.tree.map(one, x)


def unmicrobatch(y: PyTree) -> PyTree:
    """The inverse of `microbatches`."""
    return jax.tree.map(lambda a: a.reshape(a.shape[0] * a.shape[1], *a.shape[2:]), y)


def _one(a) -> tuple:
    """The shape of one microbatch of a microbatched leaf."""
    return (a.shape[0],) + a.shape[2:]


def _rows(tree, idx):
    """Per stage s, microbatch idx[s] of microbatched leaves ([B/m, m, ...] -> [p, B/m, ...])."""
    return jax.tree.map(lambda a: jnp.moveaxis(jnp.take(a, jnp.maximum(idx, 0), axis=1), 1, 0), tree)


def _put_rows(tree, idx, value, ok):
    """Per stage s where ok[s], microbatch idx[s] of leaf[s] ([p, B/m, m, ...]) = value[s]."""
    def one(a, v):
        return jax.vmap(lambda b, i, u, o: b.at[:, i].set(jnp.where(o, u, b[:, i])))(a, jnp.maximum(idx, 0), v, ok)
    return jax.tree.map(one, tree, value)


def _where(ok, a, b):
    return jax.tree.map(lambda u, v: jnp.where(_mask(ok, u), u, v), a, b)


def _zero_unless(ok, tree):
    return jax.tree.map(lambda u: jnp.where(_mask(ok, u), u, jnp.zeros((), u.dtype)), tree)


def _put(tree, idx, value, ok):
    """Per stage s where ok[s], leaf[s, idx[s]] = value[s] (a stage-local write)."""
    def one(a, v):
        return jax.vmap(lambda b, i, u, o: b.at[i].set(jnp.where(o, u, b[i])))(a, jnp.maximum(idx, 0), v, ok)
    return jax.tree.map(one, tree, value)


def _chunk(params_rp: PyTree, repeat: jax.Array, r: int) -> PyTree:
    """Per stage s, the layer chunk of repeat[s]: params_rp[repeat[s], s] ([r, p, ...] -> [p, ...])."""
    if r == 1:
        return jax.tree.map(lambda a: a[0], params_rp)
    return jax.tree.map(lambda a: jax.vmap(lambda b, k: b[k], in_axes=(1, 0))(a, jnp.maximum(repeat, 0)), params_rp)


class _Run:
    """What one pipeline call shares between its ticks: the schedule, the stage function, the axes."""

    def __init__(self, stage_fn: Callable, has_aux: bool, schedule: S.Schedule, axis: Optional[str],
                 x_spec: Optional[PyTree]):
        self.fn, self.has_aux, self.sc, self.axis, self.x_spec = stage_fn, has_aux, schedule, axis, x_spec
        p = schedule.stages
        self.stage_ids = jnp.arange(p)

    def vmap(self, f, **kw):
        return jax.vmap(f, spmd_axis_name=self.axis, **kw)

    def call(self, w, x):
        out = self.fn(w, x)
        return out if self.has_aux else (out, {})

    def state(self, tree):
        return _shard(tree, (self.axis,), self.x_spec, self.axis)

    def rows(self, wave: S.Wave, ticks: range) -> tuple:
        sl = slice(ticks.start, ticks.stop)
        return jnp.asarray(wave.microbatch[sl]), jnp.asarray(wave.repeat[sl]), jnp.asarray(wave.slot[sl])

    def inject(self, xs, state, mb, rep):
        """Stage 0's input at the first repeat is the next microbatch; every other input rolled in."""
        first = (self.stage_ids == 0) & (rep == 0)
        fresh = _rows(xs, mb)
        return self.state(_where(first, fresh, state))

    def roll(self, tree, shift: int):
        return self.state(jax.tree.map(lambda a: roll(a, shift, 0), tree))


# ------------------------------------------------------------------------------------------------ forward
def pipeline(stage_fn: Callable, params: PyTree, x: PyTree, *, num_microbatches: int, schedule: str = "gpipe",
             repeats: int = 1, has_aux: bool = False, axis: str = "stage", x_spec: Optional[PyTree] = None,
             param_specs: Optional[PyTree] = None, unroll: bool = False):
    """Run `stage_fn(chunk_params, x_mb) -> y_mb` (or (y_mb, aux) with has_aux) as a pipeline over x's batch.

    params: a pytree whose leaves lead with [stages] (repeats == 1) or [repeats, stages] (MaxText's
    layout): leaf[k, s] is the layer chunk stage s runs in repeat k, so in layer order chunk k * p + s.
    x: leaves [B, ...], split into
    num_microbatches microbatches of rows i, i + m, ...; y has x's structure and shapes. aux (a pytree of
    scalars) is summed over microbatches and stages. x_spec / param_specs: each leaf's PartitionSpec-like
    tuple over the other mesh axes (one microbatch / one chunk), for the annotations the pipeline makes.
    unroll: unroll the tick loop (XLA may then overlap a tick's permute with the next tick's compute, and
    cost_analysis() counts every tick).
    The 1F1B schedules run their forward order here; their backward needs `pipeline_value_and_grad`.
    """
    p = _stages(params, repeats)
    S.check(schedule, p, num_microbatches, repeats)
    name = {"1f1b": "gpipe", "interleaved_1f1b": "circular"}.get(schedule, schedule)
    sc = S.make(name, p, num_microbatches, repeats)
    _trace(sc)
    ax = _axis(axis, p)
    run = _Run(stage_fn, has_aux, sc, ax, x_spec)
    params_rp = _stacked(params, repeats, p, ax, param_specs)
    xs = microbatches(x, num_microbatches)
    y0 = run.state(jax.tree.map(lambda a: jnp.zeros((p,) + _one(a), a.dtype), xs))
    out0 = jax.tree.map(lambda a: jnp.zeros((p,) + a.shape, a.dtype), xs)
    aux0 = _aux_zeros(run, params_rp, y0)

    stages = _lean_stages(run, params_rp, xs, repeats)

    def tick(carry, row):
        state, out, aux = carry
        mb, rep, _ = row
        valid = mb >= 0
        inp = run.inject(xs, state, mb, rep)
        y, a = stages(params_rp, rep, inp, valid)
        last = valid & (run.stage_ids == p - 1) & (rep == repeats - 1)
        out = _put_rows(out, mb, y, last)
        aux = jax.tree.map(jnp.add, aux, _zero_unless(valid, a))
        return (run.roll(y, 1), out, aux), None

    with jax.named_scope(f"pipeline.{name}"):
        (_, out, aux), _ = jax.lax.scan(tick, (y0, out0, aux0), run.rows(sc.forward, range(sc.ticks)),
                                        unroll=unroll)
    y = unmicrobatch(_from_stage(out, p - 1))
    aux = jax.tree.map(lambda a: a.sum(0), aux)
    return (y, aux) if has_aux else y


def _lean_stages(run: "_Run", params_rp, xs, r: int) -> Callable:
    """(params_rp, rep, inp, valid) -> every stage on its chunk of repeat rep[s]: (y, aux).

    With repeats the chunk a stage reads changes every tick, so autodiff would keep each tick's gathered
    weights for the backward; here only the residuals that depend on the activation are kept per tick, and
    the chunk is gathered again in the backward pass (as the 1F1B schedules do)."""
    def plain(params_rp, rep, inp, valid):
        return run.vmap(lambda w, u, ok: run.call(w, _zero_unless(ok, u)))(_chunk(params_rp, rep, r), inp, valid)

    if r == 1:  # the one chunk is loop-invariant: autodiff keeps it once
        return plain
    res = Residuals(run.vmap, run.call,
                    jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), params_rp),
                    jax.tree.map(lambda a: jax.ShapeDtypeStruct((run.sc.stages,) + _one(a), a.dtype), xs))
    lean = jax.custom_vjp(plain)

    def fwd(params_rp, rep, inp, valid):
        def stage(w, u, ok):
            out, vjp = jax.vjp(run.call, w, _zero_unless(ok, u))
            return out, res.split(jax.tree.leaves(vjp))

        out, saved = run.vmap(stage)(_chunk(params_rp, rep, r), inp, valid)
        return out, (params_rp, rep, valid, saved)

    def bwd(residuals, ct):
        params_rp, rep, valid, saved = residuals
        w, chunk_vjp = jax.vjp(lambda prp: _chunk(prp, rep, r), params_rp)

        def stage(recomputed, saved, ct, ok):
            dw, du = res.rebuild(recomputed, saved)(ct)
            return _zero_unless(ok, dw), _zero_unless(ok, du)

        dw, dinp = run.vmap(stage)(res.recompute(w), saved, ct, valid)
        return chunk_vjp(dw)[0], None, dinp, None

    lean.defvjp(fwd, bwd)
    return lean


def _from_stage(tree, s: int):
    """leaf[s] of stage-stacked leaves, as a masked sum over the stage dim (one all-reduce, not a gather)."""
    return jax.tree.map(lambda a: jnp.where(_mask(jnp.arange(a.shape[0]) == s, a), a, 0).sum(0).astype(a.dtype),
                        tree)


def _mask(ok, a):
    return jnp.reshape(ok, ok.shape + (1,) * (a.ndim - ok.ndim))


def _stacked(params, r, p, axis, specs):
    """[p, ...] or [r, p, ...] -> [r, p, ...] with the stage dim split over the stage axis."""
    params_rp = jax.tree.map(lambda a: a[None], params) if r == 1 else params
    return _shard(params_rp, (None, axis), specs, axis)


def _aux_zeros(run, params_rp, state):
    w = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), params_rp)
    s = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)
    _, aux = jax.eval_shape(lambda w, s: run.vmap(run.call)(w, s), w, s)
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), aux)


def _trace(sc: S.Schedule) -> None:
    seen = TRACED.get()
    if seen is not None:
        seen.append(sc)


# ------------------------------------------------------------------------------------------ value and grad
def pipeline_value_and_grad(stage_fn: Callable, params: PyTree, x: PyTree, loss_fn: Callable, loss_params: PyTree,
                            targets: PyTree, *, num_microbatches: int, schedule: str = "1f1b", repeats: int = 1,
                            has_aux: bool = False, aux_weights: Optional[PyTree] = None, axis: str = "stage",
                            x_spec: Optional[PyTree] = None, param_specs: Optional[PyTree] = None,
                            unroll: bool = False):
    """The pipeline with a loss on its output, and the gradients: ((loss, aux), (d params, d x, d loss_params)).

    loss_fn(loss_params, y_mb, targets_mb) -> scalar is summed over microbatches; with has_aux the stage's
    aux (summed as in `pipeline`) adds sum(aux_weights * aux) to the objective (aux_weights: a pytree like
    aux of weights, 0 for statistics; None: aux is not differentiated). Gradients are float32 for floating
    leaves. GPipe and circular differentiate `pipeline`; 1F1B and interleaved 1F1B run their own backward
    wave, holding per stage at most 2 r p - 1 microbatches' residuals.
    """
    p = _stages(params, repeats)
    S.check(schedule, p, num_microbatches, repeats)
    if schedule not in S.OWN_BACKWARD:
        def objective(params, x, loss_params):
            out = pipeline(stage_fn, params, x, num_microbatches=num_microbatches, schedule=schedule,
                           repeats=repeats, has_aux=has_aux, axis=axis, x_spec=x_spec, param_specs=param_specs,
                           unroll=unroll)
            y, aux = out if has_aux else (out, {})
            ys, ts = microbatches(y, num_microbatches), microbatches(targets, num_microbatches)
            by_microbatch = jax.tree.map(lambda a: jnp.moveaxis(a, 1, 0), (ys, ts))
            loss = jax.lax.map(lambda yt: loss_fn(loss_params, *yt), by_microbatch).sum()
            return loss + _weighted(aux, aux_weights), (loss, aux)

        (_, (loss, aux)), grads = jax.value_and_grad(objective, argnums=(0, 1, 2), has_aux=True)(params, x, loss_params)
        return (loss, aux), _f32(grads)
    from .one_f_one_b import one_f_one_b  # the lockstep loop reads this module's helpers
    return one_f_one_b(stage_fn, params, x, loss_fn, loss_params, targets, p, num_microbatches, schedule, repeats,
                       has_aux, aux_weights, axis, x_spec, param_specs, unroll)


def _weights_like(aux, weights):
    """aux_weights as a tree like aux: None is all zeros; a dict may name only the keys that are weighted."""
    if weights is None:
        return jax.tree.map(lambda a: 0.0, aux)
    if isinstance(aux, dict) and isinstance(weights, dict):
        unknown = set(weights) - set(aux)
        if unknown and aux:
            raise ValueError(f"aux_weights names {sorted(unknown)}, which the stage's aux {sorted(aux)} lacks")
        return {k: _weights_like(v, weights.get(k, 0.0)) if isinstance(v, dict) else weights.get(k, 0.0)
                for k, v in aux.items()}
    return weights


def _weighted(aux, weights):
    return sum((jnp.sum(a * w) for a, w in zip(jax.tree.leaves(aux), jax.tree.leaves(_weights_like(aux, weights)))),
               0.0)


def _f32(tree):
    return jax.tree.map(lambda g: g.astype(jnp.float32) if jnp.issubdtype(g.dtype, jnp.floating) else g, tree)
