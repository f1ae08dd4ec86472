"""The partitioner's stages for one global function, each a function of the one before:

    trace(fn, ...)  -> Traced: the program (folded) and its seeds (in/out shardings, committed placements)
    propagate(...)  -> Assignment: a sharding for every value (partitioner/propagation/propagate.py)
    lower_traced(...)      -> Lowering: the per-device program; .run() on local shards inside shard_map, or .cost()
                       to decide and report it without arrays
    plan_and_lower  -> the two above, on the mesh or on one with sub-axes
                       (partitioner/representation/subaxes.py), whichever the cost model prefers
    partition_program -> all of it: the one driver partition() and explain() call

A planner adds shardings (seeds) and reads the costs; it never rewrites the program (Shardy's contract for
an auto-partitioner).
"""
from __future__ import annotations

import contextvars
import dataclasses
from typing import Any, Callable, Optional, Sequence

import jax
from jax.interpreters import partial_eval as pe

from . import annotations as A, sources as SRC, specs as S
from .partitioner.auto import choice as AU
from .partitioner.costs.hardware import Hardware
from .partitioner.lowering import lower as L
from .partitioner.propagation.fold import fold_constant_reductions, fold_pads, merge_common, static_slices
from .partitioner.propagation.propagate import Assignment, propagate
from .partitioner.propagation.strategy import StrategyCache
from .partitioner.reporting.report import Report, ValueInfo
from .partitioner.representation import subaxes as SUB
from .partitioner.representation.program import Program, Value, from_jaxpr
from .partitioner.representation.sharding import Sharding
from .partitioner.strategies.roll import fold_rolls

# The pipeline schedules traced while a partitioned program is built (gshard_jax/pipelines appends them, and
# explain() reports them).
TRACED: contextvars.ContextVar = contextvars.ContextVar("gshard_jax_pipelines", default=None)


@dataclasses.dataclass
class Traced:
    """A global function traced for partitioning: its program, seeds, and how its values are named."""
    program: Program
    seeds: dict  # Value -> (Sharding, where it came from)
    notes: list[str]  # in_shardings that override a committed placement
    names: list[str]  # per flat input leaf
    out_names: list[str]  # per flat output leaf
    out_tree: Any
    placed: list[Optional[Sharding]]  # per input leaf: the sharding it arrives in (None: not committed)
    leaving: dict[int, Sharding]  # outputs resharded on exit (an input, another output or a constant)
    pipelines: list  # the schedules of the pipelines traced in fn
    factoring: dict = dataclasses.field(default_factory=dict)  # axes planned as parts (subaxes.py): axis -> sizes
    pinned: dict = dataclasses.field(default_factory=dict)  # eqn -> its factor sharding, chosen (auto/choice.py)


def trace(fn: Callable, mesh, in_shardings, out_shardings, placements: tuple, args: tuple, kwargs: dict,
          context=None) -> Traced:
    """fn traced to a program (values nothing uses dropped, folds applied) with its seeds.

    `placements` holds, per flat argument leaf, the spec it is committed to on the mesh (None: not committed).
    `context`: the mesh fn is traced under when the caller set none (the mesh as the user gave it, Explicit
    axes included, so a bare PartitionSpec in reshard resolves as under jax.set_mesh); default `mesh`.
    """
    mesh_shape = dict(mesh.shape)
    flat_args, in_tree = jax.tree_util.tree_flatten((args, kwargs))
    names = S.leaf_names(fn, args, kwargs)
    arg_names = S.arg_names(fn, len(args))
    in_specs = S.flat_specs(in_shardings, list(args), mesh, "in_shardings", arg_names,
                            names[:len(jax.tree_util.tree_leaves(args))])
    in_specs += [None] * (len(flat_args) - len(in_specs))  # keyword arguments: propagation decides

    def flat_fn(*flat):
        a, kw = jax.tree_util.tree_unflatten(in_tree, flat)
        return fn(*a, **kw)

    traced_pipelines: list = []
    token = TRACED.set(traced_pipelines)
    try:
        def make(*flat):  # an attempt traced again (sources.trace_in_context) starts with no pipelines
            traced_pipelines.clear()
            return jax.make_jaxpr(flat_fn, return_shape=True)(*flat)

        with A.active(mesh, "gshard"):
            closed, out_shape = SRC.trace_in_context(make, flat_args, mesh if context is None else context)
    finally:
        TRACED.reset(token)
    # Assignment the program XLA will run: values nothing uses (e.g. the forward loss inside jax.grad) are
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
    program = SRC.annotations(from_jaxpr(closed), mesh)  # with_sharding_constraint & co: our annotations
    program = fold_pads(fold_rolls(merge_common(fold_constant_reductions(static_slices(program)))))
    seeds, notes = {}, []
    placements = [p if p is not None else SRC.typed(v.aval, mesh) for v, p in zip(program.invars, placements)]
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
    leaving: dict[int, Sharding] = {}
    for k, (v, name, spec) in enumerate(zip(program.outvars, out_names, out_specs)):
        sh = S.to_sharding(spec, v.shape, f"out_shardings for {name}")
        if sh is None:
            continue
        if not isinstance(v, Value) or (v in seeds and seeds[v][0] != sh):
            leaving[k] = sh  # as jax.jit does: the value keeps its own sharding and leaves resharded
            continue
        seeds[v] = (sh, f"out_shardings for {name}")
    return Traced(program, seeds, notes, names, out_names, out_tree, placed, leaving, traced_pipelines)


def _without_uneven(s: Sharding, shape, mesh_shape) -> Sharding:
    """s with the axes of its uneven dims dropped: how a value crosses the program boundary (XLA needs even)."""
    bad = s.uneven(shape, mesh_shape)
    return Sharding(tuple(() if d in bad else ax for d, ax in enumerate(s.dims)))


def boundary(t: Traced, plan: Assignment, mesh_shape: dict) -> tuple[list[Sharding], list[Sharding]]:
    """How each input (then constant) enters and each output leaves the per-device program: evenly, over whole
    mesh axes."""
    values = list(t.program.invars) + [v for v, _ in t.program.consts]
    cross = lambda s, v: SUB.coarse(_without_uneven(s, v.shape, mesh_shape), t.factoring)
    entry = [p if p is not None else cross(plan.sharding(v), v)
             for v, p in zip(values, t.placed + [None] * len(t.program.consts))]
    exit_ = [cross(t.leaving.get(k) or plan.sharding(v), v) for k, v in enumerate(t.program.outvars)]
    return entry, exit_


def lower_traced(t: Traced, plan: Assignment, mesh, profile: Hardware, report: Optional[Report],
          collective_matmul: str = "auto", cache: Optional[StrategyCache] = None) -> L.Lowering:
    """The per-device program of a traced, planned function (the report's header filled when there is one)."""
    entry, exit_ = boundary(t, plan, dict(mesh.shape))
    value_names = t.names + [f"constant {v}" for v, _ in t.program.consts]
    lowering = L.Lowering(t.program, plan, mesh, profile, report, entry, exit_, value_names, t.out_names,
                          collective_matmul, cache)
    if report is not None:
        report.rows.clear()
        report.notes = list(t.notes)
        report.pipelines = [sc.summary() for sc in t.pipelines]
        report.inputs = [ValueInfo(n, tuple(v.shape), str(v.dtype), plan.sharding(v), e, plan.origins.get(v, ""),
                                   _in_host_memory(v)) for n, v, e in zip(t.names, t.program.invars, entry)]
        report.outputs = [ValueInfo(n, tuple(v.shape), str(v.aval.dtype), plan.sharding(v), x,
                                    plan.origins.get(v, "") if isinstance(v, Value) else "constant")
                          for n, v, x in zip(t.out_names, t.program.outvars, exit_)]
    return lowering


def _in_host_memory(v: Value) -> bool:
    return getattr(v.aval, "memory_space", None) == jax.memory.Space.Host


def refined(t: Traced, factoring: SUB.Factoring) -> Traced:
    """t over a mesh whose factored axes are split into parts: its seeds and annotations renamed."""
    ref = lambda s: SUB.refine(s, factoring)
    return dataclasses.replace(
        t, program=SUB.refine_program(t.program, factoring), seeds={v: (ref(s), w) for v, (s, w) in t.seeds.items()},
        placed=[ref(s) for s in t.placed], leaving={k: ref(s) for k, s in t.leaving.items()}, factoring=dict(factoring))


def plan_and_lower(t: Traced, mesh, profile: Hardware, report: Optional[Report],
                   collective_matmul: str = "auto") -> tuple[L.Lowering, Any]:
    """Propagate and lower t; returns the lowering and the mesh its per-device program runs on.

    Where a reshape could split a dim over part of an axis (subaxes.factorings), the program is also planned
    on the mesh with that axis in parts, and the plan that moves fewer bytes per step is kept (then the one the
    cost model says is faster; then whole axes). Bytes first: sub-axes re-lay what whole axes gather, which
    at a model's sizes is what the time is made of, and XLA's partitioner, the reference, moves no more.
    """
    factoring = {} if t.pipelines else SUB.factorings(t.program, dict(mesh.shape))
    options = [(t, mesh)] + ([(refined(t, factoring), SUB.refine_mesh(mesh, factoring))] if factoring else [])
    plans = [propagate(o.program, dict(m.shape), o.seeds) for o, m in options]
    plans[0].pinned = t.pinned  # the choice's ops are the unrefined program's
    best = 0
    if len(options) > 1:
        scores = []
        for (o, m), plan in zip(options, plans):
            trial = Report(dict(mesh.shape), profile)
            lower_traced(o, plan, m, profile, trial, collective_matmul).cost()
            moved = sum(t["moved_bytes"] for t in trial.totals(dynamic=True).values())
            scores.append((moved, trial.comm_time + trial.compute_time))
        best = min(range(len(scores)), key=lambda i: (scores[i], i))
    o, m = options[best]
    return lower_traced(o, plans[best], m, profile, report, collective_matmul), m


def partition_program(fn: Callable, mesh, in_shardings, out_shardings, placements: tuple, args: tuple,
                      kwargs: dict, given, profile: Hardware, report: Optional[Report],
                      collective_matmul: str = "auto", auto: Optional[AU.Auto] = None,
                      donate_argnums: tuple = ()) -> tuple[Traced, L.Lowering, Any]:
    """The one driver partition() and explain() share: fn traced for these arguments, planned and lowered
    (with auto: the automatic sharding's choices as seeds). Returns (the traced program, its lowering, the
    mesh the per-device program runs on). donate_argnums: as jax.jit's (the outputs in a donated argument's
    buffer are not fresh buffers a temporary may live in before they are written: fusion.fusion_aware)."""
    t = trace(fn, mesh, in_shardings, out_shardings, placements, args, kwargs, given)
    counts = [len(jax.tree_util.tree_leaves(a)) for a in args]
    donated = [sum(counts[:i]) + j for i in donate_argnums if i < len(args) for j in range(counts[i])]
    ties = AU.donated_outputs(t.program, donated)
    if auto is not None:
        fixed = {k: t.leaving.get(k) or t.seeds[v][0] for k, v in enumerate(t.program.outvars)
                 if k in t.leaving or (v in t.seeds and t.seeds[v][1].startswith("out_shardings"))}
        chosen, pinned, leaving, lines = AU.choose(
            t.program, t.seeds, dict(mesh.shape), tuple(mesh.axis_names), profile,
            dict(zip(t.program.invars, t.names)), auto, why=report is not None, out_fixed=fixed,
            out_names=dict(enumerate(t.out_names)), ties=ties)
        t = dataclasses.replace(t, seeds={**chosen, **t.seeds}, notes=t.notes + lines, pinned=pinned,
                                leaving={**leaving, **t.leaving})
    lowering, runs_on = plan_and_lower(t, mesh, profile, report, collective_matmul)
    lowering.fresh = {k for k in range(len(t.program.outvars)) if k not in ties}
    return t, lowering, runs_on


def entry_specs(lowering: L.Lowering) -> tuple[Sequence, Sequence]:
    """shard_map's in_specs and out_specs for a lowering."""
    return tuple(s.spec() for s in lowering.entry), tuple(s.spec() for s in lowering.exit)
