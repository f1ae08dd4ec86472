"""GShard's sharding annotations: replicate, split, shard (paper section 3.2, appendix A.3).

Annotations are identity ops. Outside ``partition()`` they return their input
unchanged, so annotated model code also runs unpartitioned. Inside, they are
resolved against the mesh being partitioned over: with our backend they
become a ``sharding_annotation`` primitive in the jaxpr that the partitioner
treats as a fixed user sharding; with ``backend="xla"`` they become
``jax.lax.with_sharding_constraint``. The primitive differentiates to itself,
so cotangents keep the annotation.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import itertools
import math
from typing import Sequence, Union

import jax
import numpy as np
from jax.extend import core
from jax.interpreters import ad, batching, mlir
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .partitioner.representation.sharding import Sharding

# --------------------------------------------------------------------------- the primitive

sharding_annotation_p = core.Primitive("sharding_annotation")
sharding_annotation_p.def_impl(lambda x, **_: x)
sharding_annotation_p.def_abstract_eval(lambda x, **_: x)
mlir.register_lowering(sharding_annotation_p, lambda ctx, x, **_: [x])


def _transpose(ct, x, *, sharding, what, grad=True):
    """The cotangent is annotated the same way, unless the annotation is forward-only (grad=False)."""
    if type(ct) is ad.Zero or not grad:
        return [ct]
    return [sharding_annotation_p.bind(ct, sharding=sharding, what=what, grad=grad)]


ad.deflinear2(sharding_annotation_p, _transpose)


def _batch(axis_data, args, dims, *, sharding, what, grad=True):
    """Under vmap the new dim is split over vmap's spmd_axis_name (gs.pipeline's stage axis), else whole."""
    (x,), (d,) = args, dims
    if d is None:  # not batched
        return sharding_annotation_p.bind(x, sharding=sharding, what=what, grad=grad), d
    spmd = axis_data.spmd_name
    spmd = () if spmd is None else (spmd,) if isinstance(spmd, str) else tuple(spmd)
    clash = set(spmd) & set(sharding.axes)
    if clash:
        raise ValueError(f"{what} inside vmap(spmd_axis_name={spmd}) names {sorted(clash)}, the axis the vmapped "
                         f"dim is split over (a pipeline's stage axis); annotate the other dims only")
    dims_ = list(sharding.dims)
    dims_.insert(d, spmd)
    moved = Sharding(tuple(dims_), sharding.partial, frozenset(q + (q >= d) for q in sharding.padded))
    return sharding_annotation_p.bind(x, sharding=moved, what=what, grad=grad), d


batching.fancy_primitive_batchers[sharding_annotation_p] = _batch

# --------------------------------------------------------------------------- the active partitioner

_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("gshard_jax_active", default=None)


@contextlib.contextmanager
def active(mesh: Mesh, backend: str):
    """Annotations made inside resolve against `mesh` for `backend` ("gshard" or "xla")."""
    token = _ACTIVE.set((mesh, backend))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def current_mesh() -> "Mesh | None":
    """The mesh being partitioned over (either backend), or None outside gs.partition."""
    ctx = _ACTIVE.get()
    return None if ctx is None else ctx[0]


def _annotate(x, resolve, what: str, grad: bool = True):
    ctx = _ACTIVE.get()
    if ctx is None:
        return x
    mesh, backend = ctx
    sharding = resolve(mesh)
    if backend == "xla":
        if _explicit(sharding):  # under Explicit axes a constraint only asserts the type: reshard to it
            return jax.sharding.reshard(x, sharding.spec())
        named = NamedSharding(mesh, sharding.spec())
        return jax.lax.with_sharding_constraint(x, named) if grad else _forward_only(x, named)
    return sharding_annotation_p.bind(x, sharding=sharding, what=what, grad=grad)


def _explicit(sharding: Sharding) -> bool:
    """Whether the context mesh (jax.set_mesh) types any axis the sharding names as Explicit."""
    context = jax.sharding.get_abstract_mesh()
    if context.empty:
        return False
    types = dict(zip(context.axis_names, context.axis_types))
    return any(types.get(a) == jax.sharding.AxisType.Explicit for a in sharding.axes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _forward_only(x, named):
    """XLA's sharding constraint on x, none on its cotangent."""
    return jax.lax.with_sharding_constraint(x, named)


_forward_only.defvjp(lambda x, named: (_forward_only(x, named), None), lambda named, _, ct: (ct,))


def _rank(x) -> int:
    return len(np.shape(x))


# --------------------------------------------------------------------------- public API

def replicate(x):
    """Annotate `x` as replicated on every device."""
    return _annotate(x, lambda mesh: Sharding.replicated(_rank(x)), "replicate()")


def split(x, split_dimension: int, num_partitions: int):
    """Annotate `x` as split along `split_dimension` into `num_partitions` tiles, replicated otherwise.

    The tiles are laid over the mesh axes whose sizes multiply to
    `num_partitions` (all axes when it is the device count).
    """
    rank = _rank(x)
    if isinstance(split_dimension, bool) or not isinstance(split_dimension, (int, np.integer)):
        raise ValueError(f"split(x, split_dimension={split_dimension!r}, ...): expected an int dim; "
                         f"got {type(split_dimension).__name__}")
    if not -rank <= split_dimension < rank:
        raise ValueError(f"split(x, split_dimension={split_dimension!r}, num_partitions={num_partitions!r}): "
                         f"split_dimension is out of range for x of shape {tuple(np.shape(x))} (rank {rank}); "
                         f"expected an int in [{-rank}, {rank})")
    if isinstance(num_partitions, bool) or not isinstance(num_partitions, (int, np.integer)) or num_partitions < 1:
        raise ValueError(f"split(x, {split_dimension}, num_partitions={num_partitions!r}): expected a positive int")
    dim = int(split_dimension) % rank
    what = f"split(dim={dim}, n={num_partitions})"

    def resolve(mesh: Mesh) -> Sharding:
        axes = axes_for(mesh, int(num_partitions), what)
        return Sharding(tuple(axes if d == dim else () for d in range(rank)))

    return _annotate(x, resolve, what)


def axes_for(mesh: Mesh, n: int, what: str = "split") -> tuple[str, ...]:
    """Mesh axes (in mesh order) whose sizes multiply to n: one axis if possible, else the fewest."""
    names, shape = list(mesh.axis_names), dict(mesh.shape)
    if n == 1:
        return ()
    for k in range(1, len(names) + 1):
        for combo in itertools.combinations(names, k):
            if math.prod(shape[a] for a in combo) == n:
                return combo
    possible = sorted({math.prod(shape[a] for a in c) for k in range(len(names) + 1)
                       for c in itertools.combinations(names, k)})
    raise ValueError(f"{what}: no set of axes of mesh {shape} has sizes multiplying to {n}; "
                     f"num_partitions can be one of {possible}. To choose axes by name use "
                     f"gs.shard(x, spec) with a tuple like {tuple(names[:1]) + (None,)}")


SpecLike = Union[PartitionSpec, Sequence[Union[None, str, Sequence[str]]]]


def shard(x, device_assignment_or_spec: Union[np.ndarray, SpecLike], grad: bool = True):
    """Annotate `x` with a tile-to-device assignment (GShard A.3) or a spec of mesh axis names.

    - an integer array with one entry per tile (rank of x, or rank+1 with a
      trailing replication dim) naming the device id that holds the tile;
    - a PartitionSpec or tuple with, per dim, None, a mesh axis name, or a
      tuple of names (major to minor).

    grad=False annotates only the forward value: its cotangent is left to propagation (a weight used
    gathered whose gradient should be reduce-scattered, not all-reduced, to where the weight is stored).
    """
    rank = _rank(x)
    arg = device_assignment_or_spec
    def is_spec_entry(a):
        return a is None or isinstance(a, str) or (isinstance(a, (tuple, list)) and all(isinstance(n, str) for n in a))

    if isinstance(arg, (np.ndarray, jax.Array)) or (isinstance(arg, list) and arg and
                                                    not all(is_spec_entry(a) for a in arg)):
        assignment = np.asarray(arg)
        if not np.issubdtype(assignment.dtype, np.integer):
            raise ValueError(f"shard(x, device_assignment): expected an integer array of device ids; "
                             f"got dtype {assignment.dtype}")
        if assignment.ndim not in (rank, rank + 1):
            raise ValueError(f"shard(x, device_assignment): the assignment has rank {assignment.ndim} "
                             f"(shape {assignment.shape}) but x has rank {rank} (shape {tuple(np.shape(x))}); "
                             f"expected rank {rank}, or {rank + 1} with a trailing replication dim")
        what = f"shard(device_assignment shape {assignment.shape})"
        return _annotate(x, lambda mesh: from_device_assignment(mesh, assignment, rank), what, grad)
    spec = tuple(tuple(a) if isinstance(a, list) else a for a in arg)
    if len(spec) > rank:
        raise ValueError(f"shard(x, {spec!r}): the spec has {len(spec)} entries but x has rank {rank} "
                         f"(shape {tuple(np.shape(x))}); expected at most {rank}")
    for s in spec:
        if not (s is None or isinstance(s, str) or (isinstance(s, tuple) and all(isinstance(a, str) for a in s))):
            raise ValueError(f"shard(x, {spec!r}): entry {s!r} is not None, a mesh axis name or a tuple of names")
    what = f"shard({spec})"

    def resolve(mesh: Mesh) -> Sharding:
        return Sharding.from_spec(check_spec(spec, mesh, what), rank)

    return _annotate(x, resolve, what, grad)


def check_spec(spec: tuple, mesh: Mesh, what: str) -> tuple:
    """spec, after checking that it names only axes of `mesh`, each at most once."""
    names = [a for e in spec if e is not None for a in ((e,) if isinstance(e, str) else e)]
    for a in names:
        if a not in mesh.axis_names:
            raise ValueError(f"{what}: unknown mesh axis {a!r} in {spec}; the mesh has axes {tuple(mesh.axis_names)}")
    if len(names) != len(set(names)):
        raise ValueError(f"{what}: {spec} uses a mesh axis on more than one dim; each axis may split one dim")
    return spec


def tile_devices(mesh: Mesh, sharding: Sharding) -> dict[tuple[int, ...], set[int]]:
    """For each tile index, the ids of the devices that hold it under `sharding` on `mesh`."""
    names = list(mesh.axis_names)
    shape = dict(mesh.shape)
    out: dict = {}
    for coord in itertools.product(*(range(shape[a]) for a in names)):
        tile = sharding.tile_index(dict(zip(names, coord)), shape)
        out.setdefault(tile, set()).add(int(mesh.devices[coord].id))
    return out


def from_device_assignment(mesh: Mesh, assignment: np.ndarray, rank: int) -> Sharding:
    """The sharding whose tiles sit on the devices `assignment` names, or a ValueError saying which differ."""
    ids = sorted(int(d.id) for d in mesh.devices.flat)
    if sorted(assignment.ravel().tolist()) != ids:
        raise ValueError(f"shard(x, device_assignment): the assignment must name each of the mesh's devices "
                         f"{ids} exactly once; got {sorted(assignment.ravel().tolist())}")
    tiles = assignment.shape[:rank]
    want = {}
    for t in itertools.product(*(range(n) for n in tiles)):
        want[t] = set(np.asarray(assignment[t]).ravel().tolist())
    names = list(mesh.axis_names)
    shape = dict(mesh.shape)
    best, best_bad = None, None
    for perm in itertools.permutations(names):
        for targets in itertools.product(range(rank + 1), repeat=len(names)):
            dims = [tuple(a for a, t in zip(perm, targets) if t == d) for d in range(rank)]
            if any(math.prod(shape[a] for a in dims[d]) != tiles[d] for d in range(rank)):
                continue
            s = Sharding(tuple(dims))
            have = tile_devices(mesh, s)
            bad = [t for t in want if have.get(t) != want[t]]
            if not bad:
                return s
            if best_bad is None or len(bad) < len(best_bad):
                best, best_bad = (s, have), bad
    if best is None:
        raise ValueError(f"shard(x, device_assignment): tile counts {tiles} per dim cannot be made from the "
                         f"axes of mesh {shape}; each dim's tile count must be a product of distinct axis sizes")
    s, have = best
    t = best_bad[0]
    raise ValueError(f"shard(x, device_assignment): mesh {shape} cannot place the tiles as assigned: "
                     f"{len(best_bad)} tile(s) disagree, e.g. tile {t} is assigned devices {sorted(want[t])} "
                     f"but the closest layout ({s.spec()}) puts it on {sorted(have[t])}. Build the mesh with "
                     f"gs.make_mesh(..., devices=...) in the order the assignment uses.")
