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
report.

Lowering.cost() walks the same program without arrays: every choice, reshard
and hook's collectives are decided and reported as run() decides them, but no
per-device program is traced (a planner costs candidates this way). Local
values are then opaque tokens, one per array run() would make, so what run()
reuses by identity (an identity hook's result, a closed-over constant) is
reused the same way.
"""
from __future__ import annotations

import collections
import math
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
from jax.extend.core.primitives import remat_p

from . import (
    collective_matmul as CM,
    control_flow as CF,
    deferral as DF,
    factors as F,
    hooks as H,
    manual_regions as M,
    registry as REG,
    reshard as RS,
)
from .cost import Collective, HardwareProfile, compute_time, on_the_wire, platform_of
from .jax_compat import convert_constvars_jaxpr
from .partial_sums import PartialSums
from .program import Const, Eqn, Program, Value
from .propagation import Assignment
from .report import Operand, Report, Result, Row
from .sharding import Sharding
from .strategy import Choice, Strategy, StrategyCache


class Token:
    """A local value in a walk without arrays (Lowering.cost): only its identity matters."""
    __slots__ = ()


def checkpoint_region(fn, args: list, params: dict, positions: list[int]) -> list:
    """fn(*args) emitted as a checkpoint region (remat2) with the original region's policy and prevent_cse.

    The region is traced on local shards (its collectives included) and bound
    with the same `differentiated` flag, so the lowering keeps its optimization
    barrier and XLA cannot merge the recomputation with the forward pass.
    `positions` maps each arg to the original operand (for a per-operand prevent_cse).
    """
    closed = jax.make_jaxpr(fn)(*args)
    cse = params["prevent_cse"]
    if not isinstance(cse, bool):
        cse = (False,) * len(closed.consts) + tuple(cse[i] for i in positions)
    return remat_p.bind(*closed.consts, *args, jaxpr=convert_constvars_jaxpr(closed.jaxpr), prevent_cse=cse,
                        differentiated=params["differentiated"], policy=params["policy"])


class Lowering(Strategy, PartialSums):
    """The per-device interpreter of a planned program, and its report."""

    _new_token = staticmethod(lambda: Token())

    def __init__(self, program: Program, plan: Assignment, mesh: jax.sharding.Mesh, profile: HardwareProfile,
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
        self._lazy: dict[Value, Sharding] = {}  # accumulator chains kept partial in a loop (deferral.py)
        self._sums: set[int] = set()  # id() of the adds that accumulate them
        self._roots: dict[int, Sharding] = {}  # id() of an add summing partial sums -> its operands' sharding
        self._in_tree: set[Value] = set()  # the values of those sums' chains
        self._deferred: dict[int, dict[int, Sharding]] = {}  # id(loop eqn) -> carry index -> sharding in the loop
        # (id(scan eqn), index among its stacked results) -> a per-trip result kept a partial sum for an outer loop
        self.deferred_ys: dict[tuple[int, int], Sharding] = {}

    # ------------------------------------------------------------------ execution
    def run(self, *local_args):
        """The per-device program: local shards in, local shards out."""
        env: dict[Value, tuple[Any, Sharding]] = {}
        self._cache: dict = {}
        self._resharded: dict = {}  # value -> shardings it is already available in (mirrors _cache)
        self._made_by: Optional[dict] = None  # producers()
        self._reads: Optional[dict] = None  # value -> its readers (PartialSums._next_loop)
        self._prefix, self._trips = "", 1
        values = list(self.program.invars) + [v for v, _ in self.program.consts]
        for v, x, e, name in zip(values, local_args, self.entry, self.in_names):
            log: list[Collective] = []
            self._store(env, v, x, e, log)
            if e != self.plan.sharding(v):
                self._boundary_row("input", name, v, e, self.plan.sharding(v), log)
        self.sum_trees(self.program)
        self._run_eqns(self.program.eqns, env)
        outs = []
        for v, x, name in zip(self.program.outvars, self.exit, self.out_names):
            log = []
            outs.append(self._read(env, v, x, log))
            if isinstance(v, Value) and x != self.plan.sharding(v):
                self._boundary_row("output", name, v, self.plan.sharding(v), x, log)
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
    def scan(self, step, init: tuple, xs: tuple, length: int, reverse: bool, unroll):
        if not self.dry:
            return jax.lax.scan(step, init, xs, length=length, reverse=reverse, unroll=unroll)
        carry, ys = step(tuple(Token() for _ in init), tuple(Token() for _ in xs))
        return tuple(Token() for _ in carry), tuple(Token() for _ in ys)

    def while_loop(self, cond_fn, body_fn, init: tuple):
        if not self.dry:
            return jax.lax.while_loop(cond_fn, body_fn, init)
        cond_fn(tuple(Token() for _ in init))
        return tuple(Token() for _ in body_fn(tuple(Token() for _ in init)))

    def switch(self, index, branches: list, *ops):
        if not self.dry:
            return jax.lax.switch(index, branches, *ops)
        outs = [br(*[Token() for _ in ops]) for br in branches]
        return tuple(Token() for _ in outs[0])

    def _boundary_row(self, kind: str, name: str, v: Value, src: Sharding, dst: Sharding, log: list) -> None:
        """A report row for the reshard of an input on entry (placement, padding) or an output on exit (cut)."""
        if self.report is None:
            return
        why = ("placed as the argument arrives, resharded to the plan" if kind == "input" else
               "resharded from the plan to how the output leaves")
        if dst.padded != src.padded:
            why += "; uneven dims padded on entry" if kind == "input" else "; uneven dims gathered and cut on exit"
        shape, dtype = tuple(v.shape), str(v.aval.dtype)
        reads, writes = ((), (id(v),)) if kind == "input" else ((id(v),), ())
        self._add_row(-1, name, kind, [Operand(shape, dtype, src, dst)],
                      [Result(shape, dtype, dst, dst, self.plan.origins.get(v, ""))], why, log, None, 0.0, 1,
                      reads, writes)

    def _add_row(self, index: int, source: str, name: str, ops: list, res: list, strategy: str, log: list,
                 fallback: Optional[str], compute: float, trips: int, reads: tuple = (), writes: tuple = (),
                 issue: Optional[int] = None) -> None:
        """Append a report row whose collectives are as the backend sends them (see cost.on_the_wire)."""
        sent = [on_the_wire(c, self.platform) for c in log]
        self.report.rows.append(Row(index, source, name, ops, res, strategy, sent, fallback, compute,
                                    sum(c.time(self.profile) for c in sent), trips, reads, writes,
                                    len(sent) if issue is None else issue, self._trips))

    def _run_eqns(self, eqns: Sequence[Eqn], env) -> None:
        for eqn in eqns:
            if eqn.name == "remat2":
                self._checkpoint(eqn, env)
            elif eqn.subs:
                self._control_flow(eqn, env)
            elif M.is_region(eqn):
                self._manual(eqn, env)
            else:
                self._eqn(eqn, env)

    def _read(self, env, v, dst: Sharding, log: list):
        """v's local value in sharding dst (constants are replicated scalars)."""
        if isinstance(v, Const):
            return Token() if self.dry else jnp.full(dst.local_shape(v.shape, self.mesh_shape), v.val, v.aval.dtype)
        return self._reshard(env, v, dst, log)[0]

    def _store(self, env, v: Value, x, have: Sharding, log: list) -> None:
        """Bind v to a local value sharded as `have`, resharded to v's planned sharding (an accumulator's summand
        that arrives as the partial sum its loop carries stays one)."""
        env[v] = (x, have)
        if v in self._lazy and DF.kept(self._lazy[v], have):
            return
        planned = self.plan.sharding(v)
        env[v] = (self._reshard(env, v, planned, log)[0], planned)

    def _reshard(self, env, v, dst: Sharding, log: list[Collective]):
        x, src = env[v]
        if src == dst:
            return x, src
        if 0 in v.shape:  # an empty array: every sharding holds nothing, so nothing moves
            return (Token() if self.dry else jnp.zeros(dst.local_shape(v.shape, self.mesh_shape), v.dtype)), dst
        key = (v, dst)
        if key not in self._cache:
            # Another value may hold the very same local array (an op that is the identity on this device's
            # block) of the same global shape: its reshard is reused, as XLA would merge the two (a different
            # global shape pads or cuts differently).
            same = self._cache.get(("array", id(x), src, dst, tuple(v.shape)))
            if same is not None and same[0] is x:
                self._cache[key] = same[1]
            else:
                # Step by step: a sharding on the way that an earlier reshard of v reached is reused (an exit
                # reshard that starts with the all-gather an op already made sends it once, as XLA's CSE does).
                y = x
                for st in self.reshard_steps(src, dst, v.shape):
                    done = self._cache.get((v, st.after))
                    if done is None:
                        log.extend(RS.collectives([st], v.shape, v.dtype, self.mesh_shape))
                        done = Token() if self.dry else RS.apply([st], y, self.mesh_shape)
                        if not st.after.partial:
                            self._cache[(v, st.after)] = done
                    y = done
                self._cache[key] = y
                self._cache[("array", id(x), src, dst, tuple(v.shape))] = (x, y)
            self._resharded.setdefault(v, set()).add(dst)
        return self._cache[key], dst

    # ------------------------------------------------------------------ control flow
    def _body(self, program: Program, env, inputs: Sequence[tuple[Any, Sharding]], targets: Sequence[Sharding],
              log: list, name: str, trips: int, keep: Sequence[int] = (),
              prologue: Optional[Callable[[], list]] = None) -> list:
        """Run a body on local inputs (each in the given sharding, resharded to the plan; those at `keep` stay as
        given); results in targets, then whatever `prologue` (run first, inside the body) returns."""
        saved = (self._cache, self._resharded, self._prefix, self._trips)
        self._cache, self._prefix, self._trips = dict(self._cache), f"{self._prefix}{name}/", self._trips * trips
        self._resharded = {v: set(d) for v, d in self._resharded.items()}
        try:
            benv = collections.ChainMap({}, env)
            extra = prologue() if prologue is not None else []
            edge: list[Collective] = []  # reshards on the way in and out of the body: every trip runs them
            for k, (v, (x, have)) in enumerate(zip(program.invars, inputs)):
                if k in keep:
                    benv[v] = (x, have)
                else:
                    self._store(benv, v, x, have, edge)
            self._edge_row(name, "inputs resharded to the plan", edge, (), program.invars)
            self.sum_trees(program)
            self._run_eqns(program.eqns, benv)
            edge = []
            outs = [self._read_sum(benv, v, t, edge) for v, t in zip(program.outvars, targets)]  # partial: carried
            self._edge_row(name, "results resharded to the loop's", edge, program.outvars, ())
            return outs + list(extra)
        finally:
            self._cache, self._resharded, self._prefix, self._trips = saved

    def producers(self) -> dict:
        """Value -> the equation making it, over the whole program (bodies included), built once."""
        if self._made_by is None:
            self._made_by = {v: e for e in self.program.all_eqns() for v in e.outvars}
        return self._made_by

    def _edge_row(self, name: str, what: str, log: list, reads, writes) -> None:
        """A row for a body's own reshards of its inputs or results (run every trip, so counted with its trips)."""
        if log and self.report is not None:
            self._add_row(-1, f"{name} body", f"{self._prefix}{'results' if reads else 'inputs'}", [], [], what,
                          log, None, 0.0, self._trips, tuple(id(v) for v in reads if isinstance(v, Value)),
                          tuple(id(v) for v in writes if isinstance(v, Value)))

    def gather_ahead(self, x, v: Value, src: Sharding, dst: Sharding, what: str):
        """x (a local slice of stacked input v's) resharded from src to dst where it is issued, as a row of its
        own that reads nothing of the region it sits in (prefetch.py)."""
        log: list[Collective] = []
        steps = self.reshard_steps(src, dst, v.shape)
        log.extend(RS.collectives(steps, v.shape, v.dtype, self.mesh_shape))
        out = Token() if self.dry else RS.apply(steps, x, self.mesh_shape)
        if self.report is not None:
            shape, dtype = tuple(v.shape), str(v.aval.dtype)
            self._add_row(-1, what, f"{self._prefix}prefetch", [Operand(shape, dtype, src, dst)],
                          [Result(shape, dtype, dst, dst, "")], f"{what}: gathered a trip ahead (prefetch.py)",
                          log, None, 0.0, self._trips)
        return out

    def _checkpoint(self, eqn: Eqn, env) -> None:
        """A checkpointed region: its body (which reads the caller's values) re-emitted as a checkpoint."""
        body = eqn.subs["body"]
        ins = list(dict.fromkeys(v for v in body.invars if isinstance(v, Value)))
        args = [env[v][0] for v in ins]
        log: list[Collective] = []

        made: list = []  # each result's sharding: as planned, or a summand kept a partial sum (partial_sums.py)

        def region(*xs):
            saved = (self._cache, self._resharded, self._prefix)
            self._cache, self._resharded, self._prefix = {}, {}, f"{self._prefix}checkpoint/"  # recompute inside
            try:
                benv = collections.ChainMap({v: (x, env[v][1]) for v, x in zip(ins, xs)}, env)
                self._run_eqns(body.eqns, benv)
                made[:] = [benv[v][1] for v in eqn.outvars]
                return [benv[v][0] for v in eqn.outvars]
            finally:
                self._cache, self._resharded, self._prefix = saved

        if self.dry:
            outs = [Token() for _ in region(*[Token() for _ in args])]
        else:
            outs = checkpoint_region(region, args, eqn.params, [eqn.invars.index(v) for v in ins])
        for v, x, m in zip(eqn.outvars, outs, made):
            env[v] = (x, m)
        policy = eqn.params["policy"]
        name = getattr(policy, "__name__", None) or type(policy).__name__ if policy is not None else "save nothing"
        self._record(eqn, [(v, env[v][1], env[v][1]) for v in ins], made,
                     f"checkpoint region: {len(body.eqns)} ops recomputed in the backward pass (policy {name}, "
                     f"prevent_cse={eqn.params['prevent_cse']})", log, values=False)

    def _control_flow(self, eqn: Eqn, env) -> None:
        """A loop or branch (control_flow.FORMS): its bodies run on local shards, results stored to the plan."""
        log: list[Collective] = []
        results, strategy = CF.FORMS[eqn.name].lower(self, eqn, env, log)
        issue = len(log)  # the results' reshards (a deferred reduction among them) wait for the loop
        for v, (x, have) in zip(eqn.outvars, results):
            self._store(env, v, x, have, log)
        self._record(eqn, [(x, env[x][1], env[x][1]) for x in eqn.invars if isinstance(x, Value)],
                     [self.plan.sharding(v) for v in eqn.outvars], strategy, log, issue=issue)

    def _manual(self, eqn: Eqn, env) -> None:
        """A manual region: operands resharded to its in_specs, the body on local shards, results as declared."""
        ins, outs = M.specs(eqn)
        log: list[Collective] = []
        local_in = [self._read(env, x, s, log) for x, s in zip(eqn.invars, ins)]
        inner = M.collectives(eqn.params["jaxpr"], self.mesh_shape)
        log.extend(inner)
        results = [Token() for _ in eqn.outvars] if self.dry else M.run(eqn, local_in)
        issue = len(log)
        for v, o, m in zip(eqn.outvars, results, outs):
            self._store(env, v, o, m, log)
        have = [env[x][1] if isinstance(x, Value) else s for x, s in zip(eqn.invars, ins)]
        auto = M.auto_axes(eqn, self.mesh_shape)
        manual = [a for a in self.mesh_axes if a not in auto]
        self._record(eqn, list(zip(eqn.invars, have, ins)), outs,
                     f"manual region over {', '.join(manual)}: {len(eqn.params['jaxpr'].eqns)} ops on local "
                     f"shards, {len(inner)} collectives of its own"
                     + (f"; whole along its automatic axes {', '.join(auto)}" if auto else ""), log, issue=issue)

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
        local_in = []
        for x, n in zip(eqn.invars, choice.need):
            local_in.append(self._reshard(env, x, n, log)[0] if isinstance(x, Value) else x.val)
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

    def _record(self, eqn: Eqn, operands: list[tuple[Any, Sharding, Sharding]], made: list[Sharding],
                strategy: str, log: list, fallback: Optional[str] = None, compute: float = 0.0,
                issue: Optional[int] = None, values: bool = True) -> None:
        """One report row for an equation (when explain() is collecting one): (value, have, need) per operand.
        issue: how many of log's collectives run before the op computes (the rest wait for its result; None:
        all). values=False: the row reads and writes nothing for overlap.py (a region whose rows did)."""
        if self.report is None:
            return
        ops = [Operand(tuple(x.shape), str(x.aval.dtype), h, n) for x, h, n in operands if len(x.shape)]
        res = [Result(tuple(v.shape), str(v.aval.dtype), m, self.plan.sharding(v), self.plan.origins.get(v, ""))
               for v, m in zip(eqn.outvars, made)]
        reads = tuple(id(x) for x in eqn.invars if isinstance(x, Value)) if values else ()
        writes = tuple(id(v) for v in eqn.outvars) if values else ()
        self._add_row(eqn.index, eqn.source, self._prefix + eqn.name, ops, res, strategy, log, fallback, compute,
                      self._trips, reads, writes, issue)

    def _bind(self, eqn: Eqn, rule: Optional[F.Rule], choice: Choice, local_in: list, log: list):
        """Bind the primitive on local shards, with local-shape params, through its hook if it has one."""
        params = dict(eqn.params)
        for key in ("sharding", "out_sharding"):
            if key in params:
                params[key] = None
        if rule is not None:
            local_out = choice.made[0].local_shape(eqn.outvars[0].shape, self.mesh_shape)
            if "shape" in params:
                params["shape"] = local_out
            if "new_sizes" in params:
                params["new_sizes"] = local_out

        def bind(*args, **kw):
            if self.dry:
                return [Token() for _ in eqn.outvars]
            outs = eqn.prim.bind(*args, **kw)
            return list(outs) if eqn.prim.multiple_results else [outs]

        if rule is None:
            return bind(*local_in, **params)
        if choice.ring is not None:
            ring = choice.ring
            x = eqn.outvars[0] if ring.kind == "reduce-scatter" else eqn.invars[ring.operand]
            piece = (choice.made[0] if ring.kind == "reduce-scatter" else choice.need[ring.operand]).local_shape(
                x.shape, self.mesh_shape)
            if self.report is not None:  # the loop's permutes: a row of their own, run n - 1 times per call
                self._add_row(eqn.index, eqn.source, f"{self._prefix}ring/{eqn.name}", [], [],
                              f"the ring's loop: {ring.n - 1} trips, a collective-permute per direction each",
                              CM.collectives(ring, tuple(piece), x.aval.dtype),
                              None, 0.0, self._trips * (ring.n - 1),
                              tuple(id(v) for v in eqn.invars if isinstance(v, Value)))
            if self.dry:
                return [Token()]
            local_out = choice.made[0].local_shape(eqn.outvars[0].shape, self.mesh_shape)
            return [CM.run(ring, rule, local_in, tuple(local_out), self.mesh_shape, lambda *xs: bind(*xs, **params))]
        ctx = H.OpContext(eqn, rule, choice.fs, choice.made, self.mesh_shape, choice.need, self._cache, self.profile)
        if not self.dry:
            local_in = H.mask_padding(ctx, local_in)
        hook = REG.hook(eqn.name)
        if hook is None:
            return bind(*local_in, **params)
        log.extend(REG.collectives(ctx))
        if self.dry:  # the hook's results, without running it: an identity's is its operand
            for key in REG.received(ctx):
                self._cache[key] = Token()
            return [local_in[0]] if hook is H.identity_hook else bind()
        return hook(ctx, local_in, params, bind)
