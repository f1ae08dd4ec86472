"""partition() and explain(): run a global-view function partitioned over a mesh, and say how."""
from __future__ import annotations

import contextlib
import functools
import gc
from typing import Any, Callable, Optional, Sequence

import jax
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding

from . import annotations as A, passes as P, sources as SRC, specs as S
from .partitioner.auto import choice as AU
from .partitioner.costs.cost import platform_of
from .partitioner.costs.hardware import Hardware, default_for
from .partitioner.lowering import fallback as FB
from .partitioner.reporting.report import Report
from .partitioner.representation import subaxes as SUB
from .partitioner.strategies.collective_matmul import check_mode

BACKENDS = ("gshard", "xla")


@contextlib.contextmanager
def gc_paused():
    """Pause Python's cyclic garbage collector while a program is traced, planned and lowered.

    The pass allocates many small long-lived objects (jaxpr equations, tracers, shardings); the collector's
    generation-2 sweeps over them took a third of the partition time of a large train step and find
    almost nothing to free. Reference counting still frees memory; cycles are collected once it resumes.
    The planner's screen pauses it too (a million small tuples, no cycles among them).
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


def _build(fn: Callable, mesh: Mesh, in_shardings, out_shardings, profile: Hardware,
           report: Optional[Report], placements: tuple, collective_matmul: str = "auto", given=None,
           auto: Optional[AU.Auto] = None, donate_argnums: tuple = ()) -> Callable:
    """The global function: trace fn, plan, and call the per-device program under shard_map (passes.py).

    `placements` holds, per flat argument leaf, the spec it is committed to on the mesh (None: not committed).
    `given`: the mesh as the user gave it (its axis types), which fn is traced under.
    """
    def global_fn(*args, **kwargs):
        with gc_paused():
            t, lowering, runs_on = P.partition_program(fn, mesh, in_shardings, out_shardings, placements, args,
                                                       kwargs, given, profile, report, collective_matmul, auto,
                                                       donate_argnums)
            in_specs, out_specs = P.entry_specs(lowering)
            per_device = jax.shard_map(lambda *xs: tuple(lowering.run(*xs)), mesh=runs_on, in_specs=in_specs,
                                       out_specs=out_specs, check_vma=False)
            xs = jax.tree_util.tree_leaves((args, kwargs)) + [c for _, c in t.program.consts]
            if runs_on is not mesh:  # planned with sub-axes: in and out on the user's mesh (jax.jit names its
                xs = _on(mesh, xs, lowering.entry)  # outputs' mesh after the first sharding it meets)
            with SRC.partition_context(runs_on):  # the per-device program runs on the Auto-typed mesh
                outs = list(per_device(*xs))
            if runs_on is not mesh:
                outs = _on(mesh, outs, lowering.exit)
            FB.warn({name: len(eqns) for name, eqns in lowering.unruled.items()})
            if report is not None:
                SUB.name_whole_axes(report)
            return jax.tree_util.tree_unflatten(t.out_tree, outs)

    return global_fn


def _on(mesh, xs: list, shardings) -> list:
    """xs, laid out as `shardings` over a refined mesh (subaxes.py), as the same layout on `mesh` (no data
    moves: an identity shard_map)."""
    specs = tuple(SUB.whole(s, dict(mesh.shape)).spec() for s in shardings)
    with SRC.partition_context(mesh):
        return list(jax.shard_map(lambda *a: a, mesh=mesh, in_specs=specs, out_specs=specs, check_vma=False)(*xs))


def _placed(profile: Optional[Hardware], mesh) -> Hardware:
    """The profile (default: the mesh's platform's) placed on the mesh, so collectives cost by placement."""
    return (profile or default_for(platform_of(mesh))).placed(mesh.shape)


def _fingerprint(x) -> Any:
    """What S.placement reads of a leaf: a concrete array's sharding, rank and commitment, a ShapeDtypeStruct's
    NamedSharding (None otherwise)."""
    if isinstance(x, jax.ShapeDtypeStruct) and isinstance(x.sharding, NamedSharding):
        return x.sharding, len(x.shape), True
    if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
        return None
    return x.sharding, x.ndim, getattr(x, "committed", False)


def _placements(fn: Callable, mesh: Mesh, args, kwargs) -> tuple:
    names = S.leaf_names(fn, args, kwargs)
    leaves = jax.tree_util.tree_leaves((args, kwargs))
    return tuple(S.placement(x, mesh, n) for x, n in zip(leaves, names))


class Partitioned:
    """A partitioned function: call it like fn (global arrays in and out), or .lower() it like a jax.jit.

    Arrays committed to a NamedSharding on the mesh seed propagation as in_shardings
    do; one jax.jit is kept per distinct set of placements.
    """

    def __init__(self, fn: Callable, mesh: Mesh, in_shardings, out_shardings, profile: Hardware,
                 collective_matmul: str = "auto", given=None, donate_argnums: tuple = (),
                 auto: Optional[AU.Auto] = None):
        self._fn, self._mesh, self._given, self._donate, self._auto = fn, mesh, given, donate_argnums, auto
        self._in, self._out, self._profile = in_shardings, out_shardings, profile
        self._collective_matmul = collective_matmul
        self._jits: dict = {}
        self._keys: dict = {}  # the arguments' structure and shardings -> their placements (_jit)
        functools.update_wrapper(self, fn)

    def _jit(self, args, kwargs):
        SRC.check_context(self._mesh)
        # The placements, read once per structure and shardings of the arguments: a train step's state has
        # hundreds of leaves, and naming each again on every call cost milliseconds a step.
        leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
        seen = (tree, tuple(_fingerprint(x) for x in leaves))
        key = self._keys.get(seen)
        if key is None:
            key = self._keys[seen] = _placements(self._fn, self._mesh, args, kwargs)
        if key not in self._jits:
            self._jits[key] = jax.jit(_build(self._fn, self._mesh, self._in, self._out, self._profile, None, key,
                                             self._collective_matmul, self._given, self._auto, self._donate),
                                      donate_argnums=self._donate)
        return self._jits[key]

    def __call__(self, *args, **kwargs):
        outs = self._jit(args, kwargs)(*args, **kwargs)
        if isinstance(self._given, Mesh) and self._given is not self._mesh:
            outs = jax.tree.map(self._on_given, outs)
        return outs

    def _on_given(self, x):
        """A result on the user's own mesh, axis types included (the per-device program runs on its Auto twin):
        the same buffers, relabelled; a tracer (a caller's trace) stays as its trace makes it."""
        sharding = getattr(x, "sharding", None)
        if isinstance(x, jax.core.Tracer) or not isinstance(sharding, NamedSharding) or sharding.mesh != self._mesh:
            return x
        return jax.device_put(x, NamedSharding(self._given, sharding.spec))

    def lower(self, *args, **kwargs):
        with gc_paused():  # also while JAX lowers the per-device program to StableHLO
            return self._jit(args, kwargs).lower(*args, **kwargs)

    def trace(self, *args, **kwargs):
        with gc_paused():
            return self._jit(args, kwargs).trace(*args, **kwargs)

    def eval_shape(self, *args, **kwargs):
        return self._jit(args, kwargs).eval_shape(*args, **kwargs)


class _InMesh:
    """A jax.jit function called (lowered, traced) under jax.set_mesh(mesh) unless a mesh is set or a trace is
    active (jax.grad or jax.jit of it): XLA's partitioner needs a concrete mesh in context to place a reshard
    on Explicit axes."""

    def __init__(self, jitted, mesh):
        self._jitted, self._mesh = jitted, mesh
        functools.update_wrapper(self, jitted)

    def _run(self, method, args, kwargs):
        with contextlib.ExitStack() as stack:
            if jax.sharding.get_abstract_mesh().empty:
                try:
                    stack.enter_context(jax.set_mesh(self._mesh))
                except ValueError:  # inside a trace: the caller's context (or none) stays
                    pass
            return method(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        return self._run(self._jitted, args, kwargs)

    def lower(self, *args, **kwargs):
        return self._run(self._jitted.lower, args, kwargs)

    def trace(self, *args, **kwargs):
        return self._run(self._jitted.trace, args, kwargs)

    def eval_shape(self, *args, **kwargs):
        return self._run(self._jitted.eval_shape, args, kwargs)


def partition(fn: Callable, mesh: Mesh, in_shardings: Any = None, out_shardings: Any = None,
              backend: str = "gshard", profile: Optional[Hardware] = None,
              collective_matmul: str = "auto", donate_argnums: int | Sequence[int] = (), auto: bool = False,
              memory_budget: Optional[float] = None) -> Callable:
    """Partition an annotated global-view function over `mesh`; returns a jax.jit-like function.

    in_shardings: None, one PartitionSpec for every argument, or a tuple with one
    entry per positional argument, each a prefix pytree of that argument whose
    leaves are PartitionSpecs, NamedShardings, tuples of axis names, or None
    (propagation decides). Arguments committed to a NamedSharding on `mesh`
    seed propagation too (in_shardings win). out_shardings: the same for the
    outputs (one entry per output when the function returns a tuple or list).
    backend="gshard" uses this project's partitioner; backend="xla" turns the
    annotations into sharding constraints and lets XLA's SPMD partitioner do
    the work. A mesh with Explicit axes is partitioned as its Auto twin; results come back on the mesh given.
    profile: the machine (gs.Hardware, or a planner profile: gs.hardware.get("h100-8")) the cost model decides
    on; default gs.hardware.default_for the mesh's platform: a generic accelerator's figures, without overlap
    of communication and compute on CPU devices. collective_matmul: "auto"
    (a dot_general's all-gather or reduce-scatter becomes a ring of collective-permutes overlapped with the
    matmul where the cost model, crediting overlap only where the profile has it, says it is faster), "off",
    or "unidirectional" / "bidirectional" (the ring wherever the plan has such a collective).
    donate_argnums: as jax.jit's: positional arguments whose buffers the call may reuse for its outputs (a
    train step's state), so the caller must not read them afterwards.
    auto=True: every value nobody annotated gets the sharding that minimises the step's predicted time, with
    every device's arguments, outputs and temporaries alive at any point, as explain() predicts them, within
    memory_budget bytes when given (a choice under a budget takes at most 120 s; past that, the best found);
    annotations, in_shardings and out_shardings are kept (partitioner/auto/choice.py). An output that reuses a
    donated argument's buffer (as jax.jit pairs them: the first donated argument of its shape and dtype)
    leaves in the sharding that argument arrives in, chosen once for both, and its bytes count once.
    """
    given, mesh = mesh, _check(mesh, backend)
    donate_argnums = _donated(donate_argnums)
    choice = _auto(auto, memory_budget, backend, donate_argnums)
    check_mode(collective_matmul)
    _validate(in_shardings, mesh, "in_shardings")
    _validate(out_shardings, mesh, "out_shardings")
    if backend == "xla":
        def xla_fn(*args, **kwargs):
            with A.active(mesh, "xla"), SRC.tracing_context(given):
                return fn(*args, **kwargs)
        kw = {name: S.named(specs, mesh, name) for name, specs in
              (("in_shardings", in_shardings), ("out_shardings", out_shardings)) if specs is not None}
        jitted = jax.jit(xla_fn, donate_argnums=donate_argnums, **kw)
        explicit = isinstance(given, Mesh) and AxisType.Explicit in given.axis_types
        return _InMesh(jitted, given) if explicit else jitted
    return Partitioned(fn, mesh, in_shardings, out_shardings, _placed(profile, mesh), collective_matmul,
                       given, donate_argnums, choice)


def _auto(auto: bool, memory_budget: Optional[float], backend: str = "gshard",
          donate_argnums: tuple = ()) -> Optional[AU.Auto]:
    """partition's and explain's auto and memory_budget as the choice's options, or a ValueError saying why not."""
    if not isinstance(auto, bool):
        raise ValueError(f"auto={auto!r}: expected True (choose the shardings nobody annotated) or False")
    if not auto:
        if memory_budget is not None:
            raise ValueError(f"memory_budget={memory_budget!r} bounds the automatic sharding's choice: pass "
                             f"auto=True with it")
        return None
    if backend != "gshard":
        raise ValueError(f"auto=True is this project's choice of shardings, for backend='gshard'; got "
                         f"backend={backend!r}")
    return AU.Auto(memory_budget, donate_argnums)


def _donated(donate_argnums) -> tuple:
    """donate_argnums as a tuple of ints, or a ValueError naming what was given."""
    nums = (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in nums):
        raise ValueError(f"donate_argnums={donate_argnums!r}: expected a non-negative int or a sequence of them "
                         f"(the positions of the arguments whose buffers the call may reuse), e.g. donate_argnums=0")
    return nums


def explain(fn: Callable, mesh: Mesh, *args, in_shardings: Any = None, out_shardings: Any = None,
            profile: Optional[Hardware] = None, collective_matmul: str = "auto",
            trace_per_device: bool = True, auto: bool = False, memory_budget: Optional[float] = None,
            donate_argnums: int | Sequence[int] = (), **kwargs) -> Report:
    """What partition() decides for these arguments (arrays or ShapeDtypeStructs): one row per op, and totals.

    trace_per_device=False decides and reports the same program without tracing the per-device program
    (Lowering.cost: the choices, reshards and hooks' collectives only), several times faster on a large
    train step; gs.plan costs its candidates this way. auto, memory_budget, donate_argnums: as partition's.
    """
    given, mesh = mesh, _check(mesh, "gshard")
    donated = _donated(donate_argnums)
    choice = _auto(auto, memory_budget, "gshard", donated)
    check_mode(collective_matmul)
    _validate(in_shardings, mesh, "in_shardings")
    _validate(out_shardings, mesh, "out_shardings")
    profile = _placed(profile, mesh)
    report = Report(dict(mesh.shape), profile)
    placements = _placements(fn, mesh, args, kwargs)
    if trace_per_device:
        jax.make_jaxpr(_build(fn, mesh, in_shardings, out_shardings, profile, report, placements,
                              collective_matmul, given, choice, donated))(*args, **kwargs)
        return report
    with gc_paused():
        P.partition_program(fn, mesh, in_shardings, out_shardings, placements, args, kwargs, given, profile,
                            report, collective_matmul, choice, donated)[1].cost()
        SUB.name_whole_axes(report)
    return report


def chosen_shardings(fn: Callable, mesh: Mesh, *args, in_shardings: Any = None, out_shardings: Any = None,
                     profile: Optional[Hardware] = None, memory_budget: Optional[float] = None,
                     donate_argnums: int | Sequence[int] = (), **kwargs) -> tuple[Any, Any]:
    """(in_shardings, out_shardings) the automatic sharding gives fn for these arguments (arrays or
    ShapeDtypeStructs), as PartitionSpec trees shaped like the arguments (a tuple, one per positional argument)
    and the outputs: what partition(auto=True) compiles, to fix them where a caller keeps them from call to
    call (a training loop's state). Arguments as explain's; no runner-ups are solved."""
    given, mesh = mesh, _check(mesh, "gshard")
    donated = _donated(donate_argnums)
    choice = _auto(True, memory_budget, "gshard", donated)
    _validate(in_shardings, mesh, "in_shardings")
    _validate(out_shardings, mesh, "out_shardings")
    placements = _placements(fn, mesh, args, kwargs)
    with gc_paused():
        t, lowering, _ = P.partition_program(fn, mesh, in_shardings, out_shardings, placements, args, kwargs,
                                             given, _placed(profile, mesh), None, "auto", choice, donated)
    n = len(jax.tree_util.tree_leaves(args))
    spec = lambda s: SUB.whole(s, dict(mesh.shape)).spec()  # planned with sub-axes: named over the mesh given
    ins = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(tuple(args)), [spec(s) for s in lowering.entry[:n]])
    return ins, jax.tree_util.tree_unflatten(t.out_tree, [spec(s) for s in lowering.exit])
