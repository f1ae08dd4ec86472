"""What the pipeline loops share: the stage-stacked layout, microbatches, per-stage reads and writes, and the
`Run` of one pipeline call (its schedule, stage function and mesh axis)."""
from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from .. import annotations as A, passes
from ..partitioner.strategies.roll import roll as roll_dim
from . import schedules as S

PyTree = Any


def stages_of(params: PyTree, repeats: int) -> int:
    """The stage count p: leaves lead with [p] (repeats == 1) or [repeats, p] (repeats > 1)."""
    lead = 1 if repeats == 1 else 2
    shapes = {tuple(x.shape[:lead]) if x.ndim >= lead else None for x in jax.tree.leaves(params)}
    want = "[stages]" if repeats == 1 else f"[repeats={repeats}, stages]"
    if len(shapes) != 1 or None in shapes or (repeats > 1 and next(iter(shapes))[0] != repeats):
        raise ValueError(f"pipeline params: every leaf must lead with the same stacked dims {want}; got leading "
                         f"dims {sorted(map(str, shapes))}")
    return next(iter(shapes))[-1]


def stage_axis(axis: str, stages: int) -> Optional[str]:
    """The mesh axis the stage dim is split over, or None outside gs.partition (or on a mesh without it)."""
    mesh = A.current_mesh()
    if mesh is None or axis not in mesh.axis_names:
        return None
    if mesh.shape[axis] != stages:
        raise ValueError(f"pipeline: {stages} stages on mesh axis {axis!r} of size {mesh.shape[axis]}; the "
                         f"stacked params must lead with stages * repeats = {mesh.shape[axis]} * repeats chunks")
    return axis


def shard_leading(tree: PyTree, lead: tuple, specs: Optional[PyTree], axis: Optional[str],
                  grad: bool = True) -> PyTree:
    """Annotate every leaf with `lead` (stage on the stacked dim) then its spec from `specs` (grad=False: the
    forward value only, as `gs.shard` says)."""
    if axis is None:
        return tree
    leaves, treedef = jax.tree.flatten(tree)
    spec_leaves = [()] * len(leaves) if specs is None else treedef.flatten_up_to(specs)
    return treedef.unflatten([A.shard(x, (*lead, *tuple(s or ())), grad=grad) for x, s in zip(leaves, spec_leaves)])


def microbatches(x: PyTree, m: int) -> PyTree:
    """[B, ...] -> [B/m, m, ...], microbatch i being [:, i] (rows i, i + m, ...): a reshape, so no copy is
    made and each device's rows split evenly."""
    def one(a):
        if a.shape[0] % m:
            raise ValueError(f"pipeline: batch dim {a.shape[0]} is not a multiple of num_microbatches={m}")
        return a.reshape(a.shape[0] // m, m, *a.shape[1:])
    return jax.tree.map(one, x)


def stage_inputs(x: PyTree, m: int, p: int, axis: Optional[str], x_spec: Optional[PyTree],
                 owned: bool) -> tuple[PyTree, PyTree]:
    """(xs, one microbatch's [p, ...] shapes): x's microbatches, [B/m, m, ...] per leaf, or with owned ends
    [p, B/m, m, ...], x leading with [p] split over the stage axis so that stage 0 reads its own slice."""
    if not owned:
        xs = microbatches(x, m)
        return xs, jax.tree.map(lambda a: (p,) + one_shape(a), xs)
    xs = jax.vmap(lambda a: microbatches(a, m))(shard_leading(x, (axis,), x_spec, axis))  # [p, B/m, m, ...]
    return xs, jax.tree.map(lambda a: (p,) + one_shape(a[0]), xs)


def check_owned(p: int, **trees: PyTree) -> None:
    """owned ends' inputs: every leaf leads with the p stages."""
    for name, tree in trees.items():
        bad = [tuple(jnp.shape(a)) for a in jax.tree.leaves(tree) if jnp.ndim(a) == 0 or jnp.shape(a)[0] != p]
        if bad:
            raise ValueError(f"owned_ends=True: every leaf of {name} must lead with the {p} stages (stage s's "
                             f"slice at [s]); got shapes {bad[:3]}. Stack the replicated value p times, e.g. "
                             f"jnp.broadcast_to(a, ({p},) + a.shape)")


def unmicrobatch(y: PyTree) -> PyTree:
    """The inverse of `microbatches`."""
    return jax.tree.map(lambda a: a.reshape(a.shape[0] * a.shape[1], *a.shape[2:]), y)


def one_shape(a) -> tuple:
    """The shape of one microbatch of a microbatched leaf."""
    return (a.shape[0],) + a.shape[2:]


def rows(tree, idx):
    """Per stage s, microbatch idx[s] of microbatched leaves ([B/m, m, ...] -> [p, B/m, ...])."""
    return jax.tree.map(lambda a: jnp.moveaxis(jnp.take(a, jnp.maximum(idx, 0), axis=1), 1, 0), tree)


def own_rows(tree, idx):
    """Per stage s, microbatch idx[s] of its own slice of stage-led microbatched leaves ([p, B/m, m, ...] ->
    [p, B/m, ...])."""
    return jax.tree.map(lambda a: jax.vmap(lambda b, i: jnp.take(b, i, axis=1))(a, jnp.maximum(idx, 0)), tree)


def put_rows(tree, idx, value, ok):
    """Per stage s where ok[s], microbatch idx[s] of leaf[s] ([p, B/m, m, ...]) = value[s]."""
    def one(a, v):
        return jax.vmap(lambda b, i, u, o: b.at[:, i].set(jnp.where(o, u, b[:, i])))(a, jnp.maximum(idx, 0), v, ok)
    return jax.tree.map(one, tree, value)


def where(ok, a, b):
    return jax.tree.map(lambda u, v: jnp.where(mask(ok, u), u, v), a, b)


def zero_unless(ok, tree):
    return jax.tree.map(lambda u: jnp.where(mask(ok, u), u, jnp.zeros((), u.dtype)), tree)


@jax.custom_vjp
def gradient_where(ok, tree):
    """tree, its cotangent zeroed where not ok: what a stage that must not use a value computes from it reaches
    no gradient (a select of the value itself would be a new array for the partitioner to lay out)."""
    return tree


def _gradient_where_fwd(ok, tree):
    return tree, ok


def _gradient_where_bwd(ok, ct):
    return None, zero_unless(ok, ct)


gradient_where.defvjp(_gradient_where_fwd, _gradient_where_bwd)


def put(tree, idx, value, ok):
    """Per stage s where ok[s], leaf[s, idx[s]] = value[s] (a stage-local write)."""
    def one(a, v):
        return jax.vmap(lambda b, i, u, o: b.at[i].set(jnp.where(o, u, b[i])))(a, jnp.maximum(idx, 0), v, ok)
    return jax.tree.map(one, tree, value)


def chunk(params_rp: PyTree, repeat: jax.Array, r: int) -> PyTree:
    """Per stage s, the layer chunk of repeat[s]: params_rp[repeat[s], s] ([r, p, ...] -> [p, ...])."""
    if r == 1:
        return jax.tree.map(lambda a: a[0], params_rp)
    return jax.tree.map(lambda a: jax.vmap(lambda b, k: b[k], in_axes=(1, 0))(a, jnp.maximum(repeat, 0)), params_rp)


class Run:
    """What one pipeline call shares between its ticks: the schedule, the stage function, the axes."""

    def __init__(self, stage_fn: Callable, has_aux: bool, schedule: S.Schedule, axis: Optional[str],
                 x_spec: Optional[PyTree]):
        # jitted: the schedule calls the stage at the same shapes from several places (the residuals' probe,
        # the aux shapes, each phase's forward); JAX traces it once for those that agree
        self.fn, self.has_aux, self.sc, self.axis, self.x_spec = jax.jit(stage_fn), has_aux, schedule, axis, x_spec
        p = schedule.stages
        self.stage_ids = jnp.arange(p)

    def vmap(self, f, **kw):
        return jax.vmap(f, spmd_axis_name=self.axis, **kw)

    def call(self, w, x):
        out = self.fn(w, x)
        return out if self.has_aux else (out, {})

    def state(self, tree):
        return shard_leading(tree, (self.axis,), self.x_spec, self.axis)

    def rows(self, wave: S.Wave, ticks: range) -> tuple:
        sl = slice(ticks.start, ticks.stop)
        return jnp.asarray(wave.microbatch[sl]), jnp.asarray(wave.repeat[sl]), jnp.asarray(wave.slot[sl])

    def inject(self, xs, state, mb, rep, owned: bool = False):
        """Stage 0's input at the first repeat is the next microbatch; every other input rolled in. owned: xs
        lead with [p], and each stage reads its own slice (stage-local, no communication)."""
        first = (self.stage_ids == 0) & (rep == 0)
        fresh = own_rows(xs, mb) if owned else rows(xs, mb)
        return self.state(where(first, fresh, state))

    def roll(self, tree, shift: int):
        return self.state(jax.tree.map(lambda a: roll_dim(a, shift, 0), tree))


def from_stage(tree, s: int):
    """leaf[s] of stage-stacked leaves, as a masked sum over the stage dim (one all-reduce, not a gather)."""
    return jax.tree.map(lambda a: jnp.where(mask(jnp.arange(a.shape[0]) == s, a), a, 0).sum(0).astype(a.dtype),
                        tree)


def mask(ok, a):
    return jnp.reshape(ok, ok.shape + (1,) * (a.ndim - ok.ndim))


def stacked(params, r, p, axis, specs):
    """[p, ...] or [r, p, ...] -> [r, p, ...] with the stage dim split over the stage axis. The weights only:
    their gradients (partial sums over the batch's axes when they leave the schedule's loop) are left to
    propagation, so they are reduced once to where the optimizer wants them (a reduce-scatter under ZeRO),
    not all-reduced to the weights' own layout."""
    params_rp = jax.tree.map(lambda a: a[None], params) if r == 1 else params
    return shard_leading(params_rp, (None, axis), specs, axis, grad=False)


def aux_zeros(run, params_rp, state):
    w = in_context(jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), params_rp))
    s = in_context(jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state))
    _, aux = jax.eval_shape(lambda w, s: run.vmap(run.call)(w, s), w, s)
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), aux)


def record(sc: S.Schedule) -> None:
    """Note a schedule traced while a partitioned program is built (explain() reports it)."""
    seen = passes.TRACED.get()
    if seen is not None:
        seen.append(sc)




def weights_like(aux, weights):
    """aux_weights as a tree like aux: None is all zeros; a dict may name only the keys that are weighted."""
    if weights is None:
        return jax.tree.map(lambda a: 0.0, aux)
    if isinstance(aux, dict) and isinstance(weights, dict):
        unknown = set(weights) - set(aux)
        if unknown and aux:
            raise ValueError(f"aux_weights names {sorted(unknown)}, which the stage's aux {sorted(aux)} lacks")
        return {k: weights_like(v, weights.get(k, 0.0)) if isinstance(v, dict) else weights.get(k, 0.0)
                for k, v in aux.items()}
    return weights


def weighted(aux, weights):
    return sum((jnp.sum(a * w) for a, w in zip(jax.tree.leaves(aux), jax.tree.leaves(weights_like(aux, weights)))),
               0.0)


def f32(tree):
    return jax.tree.map(lambda g: g.astype(jnp.float32) if jnp.issubdtype(g.dtype, jnp.floating) else g, tree)


def in_context(shapes: PyTree) -> PyTree:
    """ShapeDtypeStructs typed on the context's abstract mesh where its axes are all Auto, as the schedule's own
    values are: a probe's trace of the (jitted) stage is then the one the schedule's calls reuse."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or any(t != AxisType.Auto for t in mesh.axis_types):
        return shapes
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(mesh, P())), shapes)
