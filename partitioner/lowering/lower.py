"""Lowering: run the program equation by equation on local shards inside jax.shard_map.

For every equation one mechanism decides (docs/partitioner.md; strategy.py):
enumerate the factor shardings its rule allows from what the operands have
and what the plan wants for the results, cost each (reshards in, reshards
out, combines, local compute) with the alpha-beta model, take the cheapest;
here the operands are resharded, the primitive bound on local shapes, and
the result resharded to its planned sharding. Reduction factors that were split leave a partial sum,
which the result reshard turns into an all-reduce or a reduce-scatter.
Op-specific behaviour is a small hook, found with the op's rule in
registry.py: position offsets, combines of split reductions, masked gathers
and scatters, cumulative fix-ups, halo exchanges, re-laid pieces. An
equation with no rule runs replicated (the fallback) and is flagged in the
report; partition() warns once per program naming those primitives (fallback.py).

Lowering is the driver: the equation loop (each op dispatched by its registry
entry's role) and the per-equation strategy choice. Its mixins hold the rest:
local_shards.py (reading, storing and resharding local values, binding a
primitive through its hook), lower_regions.py (loops, branches, checkpointed
and manual regions), lower_rows.py (the report rows), with strategy.py (the
choice) and partial_sums.py (the lowering's side of deferral).

Lowering.cost() walks the same program without arrays: every choice, reshard
and hook's collectives are decided and reported as run() decides them, but no
per-device program is traced (a planner costs candidates this way). Local
values are then opaque tokens, one per array run() would make, so what run()
reuses by identity (an identity hook's result, a closed-over constant) is
reused the same way.
"""
from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import jax

from ..costs import compilers, liveness as LV
from ..costs.cost import Collective, compute_time, platform_of
from ..costs.hardware import Hardware
from ..propagation.propagate import Assignment
from ..propagation.strategy import Choice, Strategy, StrategyCache
from ..reporting.report import Report
from ..representation.jax_compat import bind_on
from ..representation.program import Eqn, Program, Value
from ..representation.sharding import Sharding
from ..strategies import deferral as DF, registry as REG
from ..strategies.partial_sums import PartialSums
from .local_shards import LocalShards, Token
from .lower_regions import Regions, checkpoint_region
from .lower_rows import ReportRows

__all__ = ["Lowering", "Token", "checkpoint_region"]


class Lowering(LocalShards, Regions, ReportRows, Strategy, PartialSums):
    """The per-device interpreter of a planned program, and its report."""

    _new_token = staticmethod(lambda: Token())

    def __init__(self, program: Program, plan: Assignment, mesh: jax.sharding.Mesh, profile: Hardware,
                 report: Optional[Report] = None, entry: Optional[Sequence[Sharding]] = None,
                 exit: Optional[Sequence[Sharding]] = None, in_names: Sequence[str] = (),
                 out_names: Sequence[str] = (), collective_matmul: str = "auto",
                 cache: Optional[StrategyCache] = None):
        """entry / exit: how each input (then constant) arrives and each output leaves the per-device program
        (default: as planned); the reshards to and from the plan are part of the program and of the report.
        collective_matmul: one of collective_matmul.MODES. cache: the strategy's memo tables (shareable
        between lowerings on one mesh shape and profile)."""
        super().__init__(plan, dict(mesh.shape), tuple(mesh.axis_names), profile, collective_matmul, cache)
        self.program = program
        values = list(program.invars) + [v for v, _ in program.consts]
        self.entry = list(entry) if entry is not None else [plan.sharding(v) for v in values]
        self.exit = list(exit) if exit is not None else [plan.sharding(v) for v in program.outvars]
        self.in_names = list(in_names) + [str(v) for v in values[len(in_names):]]
        self.out_names = list(out_names) + [f"out[{i}]" for i in range(len(out_names), len(program.outvars))]
        self.platform: str = platform_of(mesh, profile)
        self.report = report
        self.dry = False  # walking without arrays (cost())
        self._placed_region = False  # running a compute_on region's ops (_placed_run): they bind as they are
        self._lazy: dict[Value, Sharding] = {}  # accumulator chains kept partial in a loop (deferral.py)
        self._sums: set[int] = set()  # id() of the adds that accumulate them
        self._roots: dict[int, Sharding] = {}  # id() of an add summing partial sums -> its operands' sharding
        self._in_tree: set[Value] = set()  # the values of those sums' chains
        self._deferred: dict[int, dict[int, Sharding]] = {}  # id(loop eqn) -> carry index -> sharding in the loop
        # (id(scan eqn), index among its stacked results) -> a per-trip result kept a partial sum for an outer loop
        self.deferred_ys: dict[tuple[int, int], Sharding] = {}
        self._held_after: dict[Value, Sharding] = {}  # a loop's result or stacked results held partial sums
        # the operands' copies in the shardings their readers need: id(local) -> Copy (one per copy, its readers
        # every op that reuses it), and the op whose operands are being read (None: a reshard is no reader's copy)
        self.copies: dict[int, LV.Copy] = {}
        self._reader: Optional[Eqn] = None
        self.ahead: dict[Eqn, int] = {}  # a scan pipelined by prefetch.py -> the gathered weights it holds (bytes)
        self.fresh: set[int] = set()  # the outputs (by index) not written into a donated argument's buffer
        self.unruled: dict[str, set[int]] = {}  # primitive with no rule -> id() of its equations (run() fills it)

    # ------------------------------------------------------------------ execution
    def run(self, *local_args):
        """The per-device program: local shards in, local shards out."""
        env: dict[Value, tuple[Any, Sharding]] = {}
        self._cache: dict = {}
        self._resharded: dict = {}  # value -> shardings it is already available in (mirrors _cache)
        self._made_by: Optional[dict] = None  # producers()
        self._reads: Optional[dict] = None  # value -> its readers (reads())
        self._prefix, self._trips = "", 1
        self.copies, self._reader, self.ahead = {}, None, {}
        self.unruled = {}
        values = list(self.program.invars) + [v for v, _ in self.program.consts]
        for v, x, e, name in zip(values, local_args, self.entry, self.in_names):
            log: list[Collective] = []
            self._store(env, v, x, e, log)
            if e != self.plan.sharding(v):
                self._boundary_row("input", name, v, e, self.plan.sharding(v), log)
        self.sum_trees(self.program)
        self._run_eqns(self.program.eqns, env)
        outs, exits = [], []
        for v, x, name in zip(self.program.outvars, self.exit, self.out_names):
            log = []
            outs.append(self._read(env, v, x, log))
            if isinstance(v, Value) and x != self.plan.sharding(v):
                self._boundary_row("output", name, v, self.plan.sharding(v), x, log)
                exits.append(v)
        if self.report is not None:  # the temporaries at their peak, as this program holds them
            habits = compilers.of(self.platform)  # how the platform's compiler holds the values
            shape = lambda v: self.held(v).local_shape(v.shape, self.mesh_shape)  # noqa: E731
            local = lambda v: LV.nbytes(v, shape(v)) * (2 if v.aval.dtype.name in habits.widened else 1)  # noqa: E731
            relaid = LV.dot_operand_copies(self.program, shape, local, self.plan.sharding) + LV.broadcast_copies(
                self.program, lambda e, x: local(e.outvars[0])) if habits.relays_operands else []
            self.report.temporaries = LV.peak(
                self.program, local, copies=list(self.copies.values()) + relaid, names=dict(zip(values, self.in_names)),
                ahead=self.ahead, exits=exits, fresh={id(self.program.outvars[k]) for k in self.fresh},
                sharding=self.plan.sharding,
                throughout=habits.tuple_slot * sum(len(r.collectives) for r in self.report.rows))
        return outs

    def cost(self) -> None:
        """Decide and report everything run() does, without arrays or tracing (see the module docstring)."""
        if self.report is None:
            raise ValueError("Lowering.cost() fills a report: construct the Lowering with report=Report(...)")
        self.dry = True
        try:
            self.run(*[Token() for _ in range(len(self.entry))])
        finally:
            self.dry = False

    # Loops and branches, run on local shards (or walked once per body, as tracing them does, when dry).
    def _run_eqns(self, eqns: Sequence[Eqn], env) -> None:
        i = 0
        while i < len(eqns):
            placed, region = eqns[i].compute_type, eqns[i].region
            if placed and _plain(eqns[i]) and not self.dry and not self._placed_region:
                j = i + 1
                while (j < len(eqns) and eqns[j].compute_type == placed and eqns[j].region == region
                       and _plain(eqns[j])):
                    j += 1
                self._placed_run(eqns[i:j], env, placed)
                i = j
                continue
            self._run_eqn(eqns[i], env)
            i += 1

    def _placed_run(self, eqns: Sequence[Eqn], env, compute_type: str) -> None:
        """A run of consecutive ops placed elsewhere (compute_type "device_host": an offloaded update) from one
        compute_on call lowered as one region, as JAX's compute_on makes it: one host computation for the whole
        run, not one per op, which XLA:GPU would call (and wait for) one by one."""
        made = {v for e in eqns for v in e.outvars}
        reads = list(dict.fromkeys(x for e in eqns for x in e.invars if isinstance(x, Value) and x not in made))
        outs = [v for e in eqns for v in e.outvars]
        cache, resharded = self._cache, self._resharded
        kept: dict = {}

        def region(*xs):
            inner = {x: (a, env[x][1]) for x, a in zip(reads, xs)}  # only the region's own values are read
            self._cache, self._resharded, self._placed_region = {}, {}, True
            try:
                for e in eqns:
                    self._run_eqn(e, inner)
            finally:
                self._cache, self._resharded, self._placed_region = cache, resharded, False
            kept.update((v, inner[v][1]) for v in outs)
            return [inner[v][0] for v in outs]

        results = bind_on(compute_type, region, [env[x][0] for x in reads], [v.aval for v in outs])
        for v, x in zip(outs, results):
            env[v] = (x, kept[v])

    def _run_eqn(self, eqn: Eqn, env) -> None:
        op = REG.op_for(eqn.name)
        if op is not None and op.checkpoint:
            self._checkpoint(eqn, env)
        elif eqn.subs:
            self._control_flow(eqn, env)
        elif op is not None and op.manual:
            self._manual(eqn, env)
        else:
            self._eqn(eqn, env)

    def producers(self) -> dict:
        """Value -> the equation making it, over the whole program (bodies included), built once."""
        if self._made_by is None:
            self._made_by = {v: e for e in self.program.all_eqns() for v in e.outvars}
        return self._made_by

    def reads(self, v: Value) -> list:
        """v's readers over the whole program, bodies included: (op, operand index), or (None, -1) where a
        program or a body returns it; built once."""
        if self._reads is None:
            self._reads = {}
            progs = [self.program] + [sub for e in self.program.all_eqns() for sub in e.subs.values()]
            for e in self.program.all_eqns():
                for i, x in enumerate(e.invars):
                    if isinstance(x, Value):
                        self._reads.setdefault(x, []).append((e, i))
            for prog in progs:
                for x in prog.outvars:
                    if isinstance(x, Value):
                        self._reads.setdefault(x, []).append((None, -1))
        return self._reads.get(v, [])

    def _eqn(self, eqn: Eqn, env) -> None:
        inside = self._lazy.get(eqn.outvars[0]) if len(eqn.outvars) == 1 else None
        inside = self._roots.get(id(eqn), inside)
        if inside is not None and eqn.name in DF.CHAIN_OPS:
            loose = eqn.name in DF.THROUGH_RULES or any(isinstance(self._lazy.get(x), DF.Loose) for x in
                                                     [*eqn.outvars, *(x for x in eqn.invars if isinstance(x, Value))])
            if self._linear(eqn, env, inside) if loose else self._partial_sum(eqn, env, inside):
                return
        rule = self.plan.rules.get(eqn)
        have = [env[x][1] if isinstance(x, Value) else Sharding.replicated(len(x.shape)) for x in eqn.invars]
        log: list[Collective] = []
        fallback = None
        if rule is None:
            self.unruled.setdefault(eqn.name, set()).add(id(eqn))
            fallback = f"no sharding rule for {eqn.name}: operands replicated, result sliced"
            need = [Sharding.replicated(len(x.shape)) for x in eqn.invars]
            made = [Sharding.replicated(len(v.shape)) for v in eqn.outvars]
            choice = Choice({}, need, made, 0.0)
        else:
            ready = tuple(frozenset(self._resharded.get(x, ())) if isinstance(x, Value) else frozenset()
                          for x in eqn.invars)
            # A summand its loop keeps a partial sum is reduced after the loop: no ring reduces it here.
            kept = any(v in self._lazy for v in eqn.outvars)
            choice = self.choose(eqn, rule, have, ready, rings=not kept)
            if kept and not choice.made[0].partial and len(eqn.outvars) == 1:  # as predicted (PartialSums._predict)
                choice = self.choose(eqn, rule, have, ready, rings=False, planned=self._unsplit(eqn, have))
        with self.reading(eqn):
            local_in = [self._reshard(env, x, n, log)[0] if isinstance(x, Value) else x.val
                        for x, n in zip(eqn.invars, choice.need)]
        outs = self._bind(eqn, rule, choice, local_in, log)
        issue = len(log)  # operand reshards and the op's own exchanges; its results' reshards follow it
        for v, o, m in zip(eqn.outvars, outs, choice.made):
            self._store(env, v, o, m, log)
        if self.report is None:
            return
        if rule is None:
            strategy = "replicated (fallback)"
        else:
            assigned = " ".join(f"{f}={'*'.join(ax)}" for f, ax in choice.fs.items() if ax)
            strategy = f"{rule.kind} {rule.signature()} {assigned or 'unsplit'}"
            if choice.ring is not None:
                strategy = f"{choice.ring.describe()}; {strategy}"
            if choice.note:
                strategy = f"{strategy}; {choice.note}"
        work = self._compute(rule, choice.fs) if rule is not None else compute_time(
            sum(math.prod(m.local_shape(v.shape, self.mesh_shape)) for v, m in zip(eqn.outvars, choice.made)),
            self.profile)
        self._record(eqn, list(zip(eqn.invars, have, choice.need)), choice.made, strategy, log, fallback, work,
                     issue)


def _plain(eqn: Eqn) -> bool:
    """Whether an op binds as itself (no body, no manual region, no checkpoint), so it can join a placed run."""
    op = REG.op_for(eqn.name)
    return not eqn.subs and not (op is not None and (op.checkpoint or op.manual))
