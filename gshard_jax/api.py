"""partition() and explain(): run a global-view function partitioned over a mesh, and say how."""
from __future__ import annotations

from typing import Any, Callable, Optional

import jax
from jax._src.tree_util import broadcast_prefix
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from partitioner import lower as L
from partitioner.cost import DEFAULT_PROFILE, HardwareProfile
from partitioner.program import from_jaxpr
from partitioner.propagation import propagate
from partitioner.report import Report
from partitioner.sharding import Sharding

from . import annotations as A

BACKENDS = ("gshard", "xla")


def _is_spec(x) -> bool:
    if x is None or isinstance(x, (PartitionSpec, Sharding)):
        return True
    return isinstance(x, tuple) and all(e is None or isinstance(e, str) or
                                        (isinstance(e, tuple) and all(isinstance(a, str) for a in e)) for e in x)


def _flat_specs(specs, tree_like, what: str) -> list:
    """Broadcast a prefix pytree of specs (None = let propagation decide) onto the flat leaves of tree_like."""
    if specs is None:
        return [None] * len(jax.tree_util.tree_leaves(tree_like))
    try:
        return broadcast_prefix(specs, tree_like, is_leaf=_is_spec)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{what} must be a prefix of the arguments' pytree with PartitionSpecs, tuples of "
                         f"axis names or None as leaves; got {specs!r}: {e}") from None


def _to_sharding(spec, rank: int, mesh: Mesh, what: str) -> Optional[Sharding]:
    if spec is None:
        return None
    if isinstance(spec, Sharding):
        return spec
    spec = tuple(spec)
    if len(spec) > rank:
        raise ValueError(f"{what}: spec {spec} has {len(spec)} entries for a value of rank {rank}")
    for s in spec:
        for a in (() if s is None else (s,) if isinstance(s, str) else s):
            if a not in mesh.axis_names:
                raise ValueError(f"{what}: unknown mesh axis {a!r} in {spec}; the mesh has {tuple(mesh.axis_names)}")
    return Sharding.from_spec(spec, rank)


def _named(specs, mesh: Mesh, what: str):
    """A pytree of NamedShardings from a pytree of specs, checking the axis names."""
    def one(s):
        if s is None:
            return None
        s = s if isinstance(s, PartitionSpec) else PartitionSpec(*s)
        for entry in s:
            for a in (() if entry is None else (entry,) if isinstance(entry, str) else entry):
                if a not in mesh.axis_names:
                    raise ValueError(f"{what}: unknown mesh axis {a!r} in {s}; the mesh has {tuple(mesh.axis_names)}")
        return NamedSharding(mesh, s)
    return jax.tree_util.tree_map(one, specs, is_leaf=_is_spec)


def _check(mesh: Mesh, backend: str) -> None:
    if not isinstance(mesh, Mesh):
        raise ValueError(f"expected a jax.sharding.Mesh (from gs.make_mesh); got {type(mesh).__name__}")
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; expected one of {BACKENDS}")


def _build(fn: Callable, mesh: Mesh, in_shardings, out_shardings, profile: HardwareProfile,
           report: Optional[Report]) -> Callable:
    """The global function: trace fn, plan, and call the per-device program under shard_map."""

    def global_fn(*args):
        flat_args, in_tree = jax.tree_util.tree_flatten(args)
        in_specs = _flat_specs(in_shardings, args, "in_shardings")

        def flat_fn(*flat):
            return fn(*jax.tree_util.tree_unflatten(in_tree, flat))

        with A.active(mesh, "gshard"):
            closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*flat_args)
        out_leaves, out_tree = jax.tree_util.tree_flatten(out_shape)
        out_specs = _flat_specs(out_shardings, out_shape, "out_shardings")
        program = from_jaxpr(closed)
        seeds = {}
        for i, (v, s) in enumerate(zip(program.invars, in_specs)):
            sh = _to_sharding(s, len(v.shape), mesh, f"in_shardings (argument leaf {i})")
            if sh is not None:
                seeds[v] = (sh, f"in_shardings[{i}]")
        for i, (v, s) in enumerate(zip(program.outvars, out_specs)):
            sh = _to_sharding(s, len(v.shape), mesh, f"out_shardings (output leaf {i})")
            if sh is not None and hasattr(v, "aval") and v not in seeds and not hasattr(v, "val"):
                seeds[v] = (sh, f"out_shardings[{i}]")
        plan = propagate(program, dict(mesh.shape), seeds)
        lowering = L.Lowering(program, plan, mesh, profile, report)
        values = list(program.invars) + [v for v, _ in program.consts]
        specs_in = tuple(plan.sharding(v).spec() for v in values)
        specs_out = tuple(plan.sharding(v).spec() for v in program.outvars)
        if report is not None:
            report.rows.clear()
            report.inputs = [f"{v.shape} {plan.sharding(v)} ({plan.origins.get(v, '')})" for v in program.invars]
            report.outputs = [f"{tuple(v.shape)} {plan.sharding(v)}" for v in program.outvars]
        per_device = jax.shard_map(lambda *xs: tuple(lowering.run(*xs)), mesh=mesh, in_specs=specs_in,
                                   out_specs=specs_out, check_vma=False)
        mesh_shape = dict(mesh.shape)
        ins = [_pad(x, plan.sharding(v), v.shape, mesh_shape)
               for v, x in zip(values, list(flat_args) + [c for _, c in program.consts])]
        outs = [_unpad(x, plan.sharding(v), v.shape) for v, x in zip(program.outvars, per_device(*ins))]
        return jax.tree_util.tree_unflatten(out_tree, outs)

    return global_fn


def _pad(x, sharding: Sharding, shape, mesh_shape):
    """Inputs split unevenly enter the per-device program padded (see partitioner.sharding)."""
    if not sharding.padded:
        return x
    target = sharding.physical_shape(shape, mesh_shape)
    return jax.numpy.pad(x, [(0, t - s) for t, s in zip(target, shape)])


def _unpad(x, sharding: Sharding, shape):
    if not sharding.padded:
        return x
    return jax.lax.slice(x, (0,) * len(shape), tuple(shape))


def partition(fn: Callable, mesh: Mesh, in_shardings: Any = None, out_shardings: Any = None,
              backend: str = "gshard", profile: Optional[HardwareProfile] = None) -> Callable:
    """Partition an annotated global-view function over `mesh`; returns a jax.jit-compiled function.

    in_shardings / out_shardings: optional prefix pytrees of PartitionSpecs (or
    tuples of axis names; None lets propagation decide). backend="gshard" uses
    this project's partitioner; backend="xla" turns the annotations into
    sharding constraints and lets XLA's SPMD partitioner do the work.
    """
    _check(mesh, backend)
    if backend == "xla":
        def xla_fn(*args):
            with A.active(mesh, "xla"):
                return fn(*args)
        kw = {name: _named(specs, mesh, name) for name, specs in
              (("in_shardings", in_shardings), ("out_shardings", out_shardings)) if specs is not None}
        return jax.jit(xla_fn, **kw)
    global_fn = _build(fn, mesh, in_shardings, out_shardings, profile or DEFAULT_PROFILE, None)
    kw = {}
    named_in = _named(in_shardings, mesh, "in_shardings") if in_shardings is not None else None
    if out_shardings is not None:
        _named(out_shardings, mesh, "out_shardings")  # checks the axis names now, not at first call
    if named_in is not None and all(s is not None for s in jax.tree_util.tree_leaves(
            named_in, is_leaf=lambda x: x is None)):
        kw["in_shardings"] = named_in
    return jax.jit(global_fn, **kw)


def explain(fn: Callable, mesh: Mesh, *args, in_shardings: Any = None, out_shardings: Any = None,
            profile: Optional[HardwareProfile] = None) -> Report:
    """What partition() decides for these arguments (arrays or ShapeDtypeStructs): one row per op, and totals."""
    _check(mesh, "gshard")
    profile = profile or DEFAULT_PROFILE
    report = Report(dict(mesh.shape), profile)
    jax.make_jaxpr(_build(fn, mesh, in_shardings, out_shardings, profile, report))(*args)
    return report
