"""The lowering of ops with bodies: loops and branches (control_flow.FORMS run their bodies through `_body`),
checkpointed regions re-emitted as checkpoints, and manual regions run on their own specs.

A mixin of Lowering (lower.py): a body runs through the driver's `_run_eqns` on local shards with a fresh
reshard cache; in a walk without arrays (Lowering.cost) each body is walked once, as tracing it does.
"""
from __future__ import annotations

import collections
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
from jax.extend.core.primitives import remat_p

from ..costs.cost import Collective
from ..representation import program as P
from ..representation.jax_compat import convert_constvars_jaxpr
from ..representation.program import Eqn, Program, Token, Value
from ..representation.sharding import Sharding
from ..strategies import manual_regions as M, registry as REG


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


class Regions:
    """Loops, branches, checkpointed and manual regions on local shards (a mixin of Lowering)."""

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

    # ------------------------------------------------------------------ bodies
    def _body(self, program: Program, env, inputs: Sequence[tuple[Any, Sharding]], targets: Sequence[Sharding],
              log: list, name: str, trips: int, keep: Sequence[int] = (),
              prologue: Optional[Callable[[], list]] = None, outer: Optional[tuple[Sequence, Sequence]] = None,
              dead: Sequence[int] = ()) -> list:
        """Run a body on local inputs (each in the given sharding, resharded to the plan; those at `keep` stay as
        given); results in targets, then whatever `prologue` (run first, inside the body) returns. outer: the
        operands and results the body's inputs and outputs stand for, one to one (a scan's), for the report.
        dead: results nobody reads (a peeled trip's final carries): the ops making only them are not run, and
        zeros stand for them, as XLA's dead-code elimination leaves the unrolled trip."""
        if dead:
            program = P.live_only(program, [k not in dead for k in range(len(program.outvars))])
        if outer is not None and self.report is not None:
            ins, outs = self.report.links
            ins.update((id(b), id(o)) for b, o in zip(program.invars, outer[0]) if isinstance(o, Value))
            outs.update((id(o), id(b)) for b, o in zip(program.outvars, outer[1]) if isinstance(b, Value))
        saved = (self._cache, self._resharded, self._prefix, self._trips, self._reader)
        self._cache, self._prefix, self._trips = dict(self._cache), f"{self._prefix}{name}/", self._trips * trips
        self._reader = None  # the body's own reshards are its ops' copies, not the loop's
        first = len(self.report.rows) if self.report is not None else 0
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
            outs = [self._nothing(v, t) if k in dead else self._read_sum(benv, v, t, edge)  # partial: carried
                    for k, (v, t) in enumerate(zip(program.outvars, targets))]
            self._edge_row(name, "results resharded to the loop's", edge, program.outvars, ())
            if outer is not None and trips == 1 and self.report is not None:  # XLA inlines it (overlap.py)
                self.report.one_trip.append((first, len(self.report.rows), self._prefix.count("/")))
            return outs + list(extra)
        finally:
            self._cache, self._resharded, self._prefix, self._trips, self._reader = saved

    def _nothing(self, v, s: Sharding):
        """A local value no one reads, of v's local shape in s."""
        return Token() if self.dry else jnp.zeros(s.local_shape(v.shape, self.mesh_shape), v.aval.dtype)

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
                for v in eqn.outvars:  # a result no one reads whose ops were pruned (live_only)
                    if v not in benv:
                        benv[v] = (self._nothing(v, self.plan.sharding(v)), self.plan.sharding(v))
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
        with self.reading(eqn):  # its operands' copies are alive through its bodies
            results, strategy = REG.op_for(eqn.name).form.lower(self, eqn, env, log)
        issue = len(log)  # the results' reshards (a deferred reduction among them) wait for the loop
        for v, (x, have) in zip(eqn.outvars, results):
            if self.reads(v):
                self._store(env, v, x, have, log)
            else:  # no one reads it: not resharded (XLA removes what no one reads)
                env[v] = (x, have)
        self._record(eqn, [(x, env[x][1], env[x][1]) for x in eqn.invars if isinstance(x, Value)],
                     [self.plan.sharding(v) for v in eqn.outvars], strategy, log, issue=issue)

    def _manual(self, eqn: Eqn, env) -> None:
        """A manual region: operands resharded to its in_specs, the body on local shards, results as declared."""
        ins, outs = M.specs(eqn)
        log: list[Collective] = []
        with self.reading(eqn):
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
