"""partition() and explain(): run a global-view function partitioned over a mesh, and say how."""
from __future__ import annotations

import contextlib
import functools
import gc
from typing import Any, Callable, Optional

import jax
from jax._src.interpreters import partial_eval as pe
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from . import annotations as A
from . import pipelining as PL
from . import specs as S
from .partitioner import lower as L
from .partitioner.collective_matmul import check_mode
from .partitioner.cost import HardwareProfile, default_profile, platform_of
from .partitioner.fold import fold_pads, merge_common, static_slices
from .partitioner.roll import fold_rolls
from .partitioner.program import Value, from_jaxpr
from .partitioner.propagation import propagate
from .partitioner.report import Report, ValueInfo
from .partitioner.sharding import Sharding

BACKENDS = ("gshard", "xla")


@contextlib.contextmanager
def _gc_paused():
    """Pause Python's cyclic garbage collector while a program is traced, planned and lowered.

    The pass allocates many small long-lived objects (jaxpr equations, tracers, shardings); the collector's
    generation-2 sweeps over them took a third of the partition time of a large train step and find
    almost nothing to free. Reference counting still frees memory; cycles are collected once it resumes.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _check(mesh, backend: str):
    """The mesh the partitioner runs on: the user's devices and axes, Auto typed (shard_map needs no types).

    An AbstractMesh (axis names and sizes, no devices) plans and explains a program for devices this host
    does not have; only a Mesh runs one.
    """
    if not isinstance(mesh, (Mesh, AbstractMesh)):
        raise ValueError(f"expected a jax.sharding.Mesh (from gs.make_mesh or jax.make_mesh) or an AbstractMesh; "
                         f"got {type(mesh).__name__}")
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; expected one of {BACKENDS}")
    if all(t == AxisType.Auto for t in mesh.axis_types):
        return mesh
    auto = (AxisType.Auto,) * len(mesh.axis_names)
    if isinstance(mesh, AbstractMesh):
        return AbstractMesh(mesh.axis_sizes, mesh.axis_names, axis_types=auto)
    return Mesh(mesh.devices, mesh.axis_names, axis_types=auto)


def _without_uneven(s: Sharding, shape, mesh_shape) -> Sharding:
    """s with the axes of its uneven dims dropped: how a value crosses the program boundary (XLA needs even)."""
    bad = s.uneven(shape, mesh_shape)
    return Sharding(tuple(() if d in bad else ax for d, ax in enumerate(s.dims)))


def _validate(specs, mesh: Mesh, what: str) -> None:
    """Check axis names now, not at the first call; a top-level tuple may be one spec or one per value."""
    if specs is None:
        return
    try:
        S.named(specs, mesh, what)
    except ValueError:
        if not isinstance(specs, (tuple, list)):
            raise
        for entry in specs:
            S.named(entry, mesh, what)


def _build(fn: Callable, mesh: Mesh, in_shardings, out_shardings, profile: HardwareProfile,
           report: Optional[Report], placements: tuple, collective_matmul: str = "auto") -> Callable:
    """The global function: trace fn, plan, and call the per-device program under shard_map.

    `placements` holds, per flat argument leaf, the spec it is committed to on the mesh (None: not committed).
    """
    mesh_shape = dict(mesh.shape)

    def global_fn(*args, **kwargs):
        with _gc_paused():
            return traced(*args, **kwargs)

    def traced(*args, **kwargs):
        flat_args, in_tree = jax.tree_util.tree_flatten((args, kwargs))
        names = S.leaf_names(fn, args, kwargs)
        arg_names = S.arg_names(fn, len(args))
        in_specs = S.flat_specs(in_shardings, list(args), mesh, "in_shardings", arg_names,
                                names[:len(jax.tree_util.tree_leaves(args))])
        in_specs += [None] * (len(flat_args) - len(in_specs))  # keyword arguments: propagation decides

        def flat_fn(*flat):
            a, kw = jax.tree_util.tree_unflatten(in_tree, flat)
            return fn(*a, **kw)

        traced_pipelines = []
        token = PL.TRACED.set(traced_pipelines)
        try:
            with A.active(mesh, "gshard"):
                closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*flat_args)
        finally:
            PL.TRACED.reset(token)
        # Plan the program XLA will run: values nothing uses (e.g. the forward loss inside jax.grad) are
        # dropped first, so no collective is planned or reported for them, and there is less to partition.
        jaxpr, _ = pe.dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars), instantiate=True)
        closed = jax.extend.core.ClosedJaxpr(jaxpr, closed.consts)
        out_tree = jax.tree_util.tree_structure(out_shape)
        out_names = S.output_names(out_shape)
        multiple = isinstance(out_shape, (tuple, list))
        outputs = list(out_shape) if multiple else [out_shape]
        top = [f"out[{i}]" for i in range(len(outputs))] if multiple else ["out"]
        wrapped = (isinstance(out_shardings, (tuple, list)) and len(out_shardings) == 1
                   and not S.is_spec_tuple(tuple(out_shardings)))  # (spec,) for the one output
        single = out_shardings if wrapped else (out_shardings,)
        out_specs = S.flat_specs(out_shardings if multiple or out_shardings is None else single,
                                 outputs, mesh, "out_shardings", top, out_names)
        program = fold_pads(fold_rolls(merge_common(static_slices(from_jaxpr(closed)))))
        seeds, notes = {}, []
        placed = [S.to_sharding(p, v.shape, f"placement of {n}") for v, p, n in zip(program.invars, placements, names)]
        for v, name, spec, at in zip(program.invars, names, in_specs, placed):
            sh = S.to_sharding(spec, v.shape, f"in_shardings for {name}")
            if sh is not None:
                seeds[v] = (sh, f"in_shardings for {name}")
                if at is not None and at.canonical(v.shape, mesh_shape) != sh.canonical(v.shape, mesh_shape):
                    notes.append(f"{name}: in_shardings {sh} wins over the array's placement {at}; "
                                 f"it is resharded on entry")
            elif at is not None:
                seeds[v] = (at, f"placement of {name} (committed NamedSharding)")
        leaving: dict[int, Sharding] = {}  # outputs resharded on exit: an input, another output or a constant
        for k, (v, name, spec) in enumerate(zip(program.outvars, out_names, out_specs)):
            sh = S.to_sharding(spec, v.shape, f"out_shardings for {name}")
            if sh is None:
                continue
            if not isinstance(v, Value) or (v in seeds and seeds[v][0] != sh):
                leaving[k] = sh  # as jax.jit does: the value keeps its own sharding and leaves resharded
                continue
            seeds[v] = (sh, f"out_shardings for {name}")
        plan = propagate(program, mesh_shape, seeds)
        values = list(program.invars) + [v for v, _ in program.consts]
        entry = [p if p is not None else _without_uneven(plan.sharding(v), v.shape, mesh_shape)
                 for v, p in zip(values, placed + [None] * len(program.consts))]
        exit_ = [_without_uneven(leaving.get(k) or plan.sharding(v), v.shape, mesh_shape)
                 for k, v in enumerate(program.outvars)]
        value_names = names + [f"constant {v}" for v, _ in program.consts]
        lowering = L.Lowering(program, plan, mesh, profile, report, entry, exit_, value_names, out_names,
                              collective_matmul)
        if report is not None:
            report.rows.clear()
            report.notes = notes
            report.pipelines = [sc.summary() for sc in traced_pipelines]
            report.inputs = [ValueInfo(n, tuple(v.shape), str(v.dtype), plan.sharding(v), e,
                                       plan.origins.get(v, "")) for n, v, e in zip(names, program.invars, entry)]
            report.outputs = [ValueInfo(n, tuple(v.shape), str(v.aval.dtype), plan.sharding(v), x,
                                        plan.origins.get(v, "") if isinstance(v, Value) else "constant")
                              for n, v, x in zip(out_names, program.outvars, exit_)]
        per_device = jax.shard_map(lambda *xs: tuple(lowering.run(*xs)), mesh=mesh,
                                   in_specs=tuple(s.spec() for s in entry), out_specs=tuple(s.spec() for s in exit_),
                                   check_vma=False)
        outs = per_device(*flat_args, *[c for _, c in program.consts])
        return jax.tree_util.tree_unflatten(out_tree, list(outs))

    return global_fn


def _default_profile(mesh) -> HardwareProfile:
    return default_profile(platform_of(mesh))


def _placements(fn: Callable, mesh: Mesh, args, kwargs) -> tuple:
    names = S.leaf_names(fn, args, kwargs)
    leaves = jax.tree_util.tree_leaves((args, kwargs))
    return tuple(S.placement(x, mesh, n) for x, n in zip(leaves, names))


class Partitioned:
    """A partitioned function: call it like fn (global arrays in and out), or .lower() it like a jax.jit.

    Arrays committed to a NamedSharding on the mesh seed propagation as in_shardings
    do; one jax.jit is kept per distinct set of placements.
    """

    def __init__(self, fn: Callable, mesh: Mesh, in_shardings, out_shardings, profile: HardwareProfile,
                 collective_matmul: str = "auto"):
        self._fn, self._mesh = fn, mesh
        self._in, self._out, self._profile = in_shardings, out_shardings, profile
        self._collective_matmul = collective_matmul
        self._jits: dict = {}
        functools.update_wrapper(self, fn)

    def _jit(self, args, kwargs):
        key = _placements(self._fn, self._mesh, args, kwargs)
        if key not in self._jits:
            self._jits[key] = jax.jit(_build(self._fn, self._mesh, self._in, self._out, self._profile, None, key,
                                             self._collective_matmul))
        return self._jits[key]

    def __call__(self, *args, **kwargs):
        return self._jit(args, kwargs)(*args, **kwargs)

    def lower(self, *args, **kwargs):
        with _gc_paused():  # also while JAX lowers the per-device program to StableHLO
            return self._jit(args, kwargs).lower(*args, **kwargs)

    def trace(self, *args, **kwargs):
        with _gc_paused():
            return self._jit(args, kwargs).trace(*args, **kwargs)

    def eval_shape(self, *args, **kwargs):
        return self._jit(args, kwargs).eval_shape(*args, **kwargs)


def partition(fn: Callable, mesh: Mesh, in_shardings: Any = None, out_shardings: Any = None,
              backend: str = "gshard", profile: Optional[HardwareProfile] = None,
              collective_matmul: str = "auto") -> Callable:
    """Partition an annotated global-view function over `mesh`; returns a jax.jit-like function.

    in_shardings: None, one PartitionSpec for every argument, or a tuple with one
    entry per positional argument, each a prefix pytree of that argument whose
    leaves are PartitionSpecs, NamedShardings, tuples of axis names, or None
    (propagation decides). Arguments committed to a NamedSharding on `mesh`
    seed propagation too (in_shardings win). out_shardings: the same for the
    outputs (one entry per output when the function returns a tuple or list).
    backend="gshard" uses this project's partitioner; backend="xla" turns the
    annotations into sharding constraints and lets XLA's SPMD partitioner do
    the work. A mesh with Explicit axes is used as the same mesh with Auto axes.
    profile: the HardwareProfile the cost model uses (default: the CPU simulation's on CPU devices, which
    does not overlap communication with compute, else a generic accelerator's). collective_matmul: "auto"
    (a dot_general's all-gather or reduce-scatter becomes a ring of collective-permutes overlapped with the
    matmul where the cost model, crediting overlap only where the profile has it, says it is faster), "off",
    or "unidirectional" / "bidirectional" (the ring wherever the plan has such a collective).
    """
    mesh = _check(mesh, backend)
    check_mode(collective_matmul)
    _validate(in_shardings, mesh, "in_shardings")
    _validate(out_shardings, mesh, "out_shardings")
    if backend == "xla":
        def xla_fn(*args, **kwargs):
            with A.active(mesh, "xla"):
                return fn(*args, **kwargs)
        kw = {name: S.named(specs, mesh, name) for name, specs in
              (("in_shardings", in_shardings), ("out_shardings", out_shardings)) if specs is not None}
        return jax.jit(xla_fn, **kw)
    return Partitioned(fn, mesh, in_shardings, out_shardings, profile or _default_profile(mesh), collective_matmul)


def explain(fn: Callable, mesh: Mesh, *args, in_shardings: Any = None, out_shardings: Any = None,
            profile: Optional[HardwareProfile] = None, collective_matmul: str = "auto", **kwargs) -> Report:
    """What partition() decides for these arguments (arrays or ShapeDtypeStructs): one row per op, and totals."""
    mesh = _check(mesh, "gshard")
    check_mode(collective_matmul)
    _validate(in_shardings, mesh, "in_shardings")
    _validate(out_shardings, mesh, "out_shardings")
    profile = profile or _default_profile(mesh)
    report = Report(dict(mesh.shape), profile)
    build = _build(fn, mesh, in_shardings, out_shardings, profile, report, _placements(fn, mesh, args, kwargs),
                   collective_matmul)
    jax.make_jaxpr(build)(*args, **kwargs)
    return report
