"""partition() and explain(): run a global-view function partitioned over a mesh, and say how."""
from __future__ import annotations

from typing import Any, Callable, Optional

import jax
from jax._src.interpreters import partial_eval as pe
from jax._src.tree_util import broadcast_prefix
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .partitioner import lower as L
from .partitioner.cost import DEFAULT_PROFILE, HardwareProfile
from .partitioner.program import Value, from_jaxpr
from .partitioner.propagation import propagate
from .partitioner.report import Report
from .partitioner.sharding import Sharding

from . import annotations as A

BACKENDS = ("gshard", "xla")


def _is_spec_tuple(x) -> bool:
    return isinstance(x, tuple) and all(e is None or isinstance(e, str) or
                                        (isinstance(e, tuple) and all(isinstance(a, str) for a in e)) for e in x)


def _is_leaf(x) -> bool:
    return x is None or isinstance(x, (PartitionSpec, NamedSharding, Sharding)) or _is_spec_tuple(x)


def _spec(leaf, mesh: Mesh, what: str):
    """A spec leaf as a tuple of per-dim entries (or a Sharding), with its axis names checked; None stays None."""
    if leaf is None or isinstance(leaf, Sharding):
        return leaf
    if isinstance(leaf, NamedSharding):
        leaf = leaf.spec
    return A.check_spec(tuple(leaf), mesh, what)


def _entries(specs, n: int, what: str) -> list:
    """Top level of in/out shardings: one entry per argument (or output), or one spec for all of them."""
    if specs is None or isinstance(specs, (PartitionSpec, NamedSharding, Sharding)):
        return [specs] * n
    if not isinstance(specs, (tuple, list)) or len(specs) != n:
        raise ValueError(f"{what} must be None, one PartitionSpec for all, or a tuple with one entry per "
                         f"{'argument' if what == 'in_shardings' else 'output'} ({n}); got {specs!r}. "
                         f"Write a spec for a single value as PartitionSpec(...) or wrap it: (spec,)")
    return list(specs)


def _flat_specs(specs, values: list, mesh: Mesh, what: str) -> list:
    """Per flat leaf of `values` (a list of pytrees), its spec tuple or None (propagation decides)."""
    out = []
    for i, (entry, value) in enumerate(zip(_entries(specs, len(values), what), values)):
        try:
            leaves = broadcast_prefix(entry, value, is_leaf=_is_leaf)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{what}[{i}] must be a prefix of that value's pytree with PartitionSpecs, tuples of "
                             f"axis names or None as leaves; got {entry!r}: {e}") from None
        out += [_spec(leaf, mesh, f"{what}[{i}]") for leaf in leaves]
    return out


def _to_sharding(spec, rank: int, what: str) -> Optional[Sharding]:
    if spec is None or isinstance(spec, Sharding):
        return spec
    if len(spec) > rank:
        raise ValueError(f"{what}: spec {spec} has {len(spec)} entries for a value of rank {rank}")
    return Sharding.from_spec(spec, rank)


def _named(specs, mesh: Mesh, what: str):
    """A pytree of NamedShardings (for jax.jit) from a pytree of specs, checking the axis names."""
    def one(s):
        return None if s is None else NamedSharding(mesh, PartitionSpec(*_spec(s, mesh, what)))
    return jax.tree_util.tree_map(one, specs, is_leaf=_is_leaf)


def _check(mesh: Mesh, backend: str) -> None:
    if not isinstance(mesh, Mesh):
        raise ValueError(f"expected a jax.sharding.Mesh (from gs.make_mesh); got {type(mesh).__name__}")
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; expected one of {BACKENDS}")


def _build(fn: Callable, mesh: Mesh, in_shardings, out_shardings, profile: HardwareProfile,
           report: Optional[Report]) -> Callable:
    """The global function: trace fn, plan, and call the per-device program under shard_map."""

    def global_fn(*args, **kwargs):
        flat_args, in_tree = jax.tree_util.tree_flatten((args, kwargs))
        in_specs = _flat_specs(in_shardings, list(args), mesh, "in_shardings")
        in_specs += [None] * (len(flat_args) - len(in_specs))  # keyword arguments: propagation decides

        def flat_fn(*flat):
            a, kw = jax.tree_util.tree_unflatten(in_tree, flat)
            return fn(*a, **kw)

        with A.active(mesh, "gshard"):
            closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*flat_args)
        # Plan the program XLA will run: values nothing uses (e.g. the forward loss inside jax.grad) are
        # dropped first, so no collective is planned or reported for them, and there is less to partition.
        jaxpr, _ = pe.dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars), instantiate=True)
        closed = jax.extend.core.ClosedJaxpr(jaxpr, closed.consts)
        out_tree = jax.tree_util.tree_structure(out_shape)
        outputs = list(out_shape) if isinstance(out_shape, (tuple, list)) else [out_shape]
        specs = out_shardings if isinstance(out_shape, (tuple, list)) or out_shardings is None else (out_shardings,)
        out_specs = _flat_specs(specs, outputs, mesh, "out_shardings")
        program = from_jaxpr(closed)
        seeds = {}
        for i, (v, s) in enumerate(zip(program.invars, in_specs)):
            sh = _to_sharding(s, len(v.shape), f"in_shardings (argument leaf {i})")
            if sh is not None:
                seeds[v] = (sh, f"in_shardings[{i}]")
        for i, (v, s) in enumerate(zip(program.outvars, out_specs)):
            sh = _to_sharding(s, len(v.shape), f"out_shardings (output leaf {i})")
            if sh is None:
                continue
            if not isinstance(v, Value) or (v in seeds and seeds[v][0] != sh):
                raise ValueError(f"out_shardings (output leaf {i}): {sh} conflicts with the sharding this output "
                                 f"already has as an input or another output, or it is a constant; return a copy "
                                 f"(x + 0) or drop one of the two shardings")
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

    in_shardings: None, one PartitionSpec for every argument, or a tuple with one
    entry per positional argument, each a prefix pytree of that argument whose
    leaves are PartitionSpecs, NamedShardings, tuples of axis names, or None
    (propagation decides). out_shardings: the same for the outputs (one entry
    per output when the function returns a tuple or list). backend="gshard"
    uses this project's partitioner; backend="xla" turns the annotations into
    sharding constraints and lets XLA's SPMD partitioner do the work.
    """
    _check(mesh, backend)
    if backend == "xla":
        def xla_fn(*args, **kwargs):
            with A.active(mesh, "xla"):
                return fn(*args, **kwargs)
        kw = {name: _named(specs, mesh, name) for name, specs in
              (("in_shardings", in_shardings), ("out_shardings", out_shardings)) if specs is not None}
        return jax.jit(xla_fn, **kw)
    # Check the specs' axis names now, not at the first call. The partitioned function takes its inputs
    # as they come: in_shardings seed propagation (an uneven one is padded inside), and XLA places the
    # arguments where the per-device program wants them.
    if in_shardings is not None:
        _named(in_shardings, mesh, "in_shardings")
    if out_shardings is not None:
        _named(out_shardings, mesh, "out_shardings")
    return jax.jit(_build(fn, mesh, in_shardings, out_shardings, profile or DEFAULT_PROFILE, None))


def explain(fn: Callable, mesh: Mesh, *args, in_shardings: Any = None, out_shardings: Any = None,
            profile: Optional[HardwareProfile] = None) -> Report:
    """What partition() decides for these arguments (arrays or ShapeDtypeStructs): one row per op, and totals."""
    _check(mesh, "gshard")
    profile = profile or DEFAULT_PROFILE
    report = Report(dict(mesh.shape), profile)
    jax.make_jaxpr(_build(fn, mesh, in_shardings, out_shardings, profile, report))(*args)
    return report
