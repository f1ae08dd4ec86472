"""The lowering's side of reductions deferred past loops (deferral.py finds the pattern): which accumulators a
loop carries as partial sums, the sharding each summand is predicted to arrive in, reading a value into a
partial sum without communication, and running an accumulator chain's ops on local partial sums.

A mixin of Lowering: it reads the plan, the strategy's choices and the lowering's reads and report rows.
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp

from ..costs.cost import Collective
from ..representation.program import Eqn, Value
from ..representation.sharding import Sharding
from . import control_flow as CF, deferral as DF, manual_regions as M, reshard as RS


class PartialSums:
    """Deferred reductions in the lowering: `_lazy` holds the values kept partial, `_sums` the adds that
    accumulate them, `_roots` the adds that sum partial sums and reduce them once (their sharding before the
    reduction), `_deferred` and `deferred_ys` each loop's carries and stacked results kept so."""

    def deferrals(self, eqn: Eqn) -> dict[int, Sharding]:
        """A loop's accumulating carries that stay partial sums in it: carry index -> its sharding in the loop.

        Predicted from the plan (what each summand's op makes from planned operands), once per loop; the loop's
        chains are then kept partial where they arrive so (deferral.py)."""
        out = self._deferred.get(id(eqn))
        if out is not None:
            return out
        out = self._deferred[id(eqn)] = {}
        body, carry_in, carry_out, _ = CF.FORMS[eqn.name].carries(eqn)
        if body is None or not DF.ENABLED.get():
            return out
        for acc in DF.accumulators(body, carry_in, carry_out):
            planned = self.plan.sharding(carry_in[acc.k])
            if planned.partial or planned.padded:
                continue
            made = [self._predict(v, e) for v, e in zip(acc.leaves, acc.producers)]
            partial = frozenset().union(*(m.partial for m in made))
            if not partial:
                continue
            inside = out[acc.k] = DF.deferred_sharding(planned, partial)
            self._lazy[acc.add.outvars[0]] = DF.Loose(partial)  # relaid to the carry's dims (if not the carry)
            self._lazy[carry_in[acc.k]] = self._lazy[carry_out[acc.k]] = inside
            for v, dims in acc.chain:
                self._lazy[v] = DF.in_loop(inside, dims)
            self._sums.add(id(acc.add))
        for k, inside in out.items():  # a later loop that goes on accumulating this one's result
            self._held_after[eqn.outvars[k]] = inside
            after = self._next_loop(eqn.outvars[k])
            if after is not None and self.deferrals(after[0]).get(after[1]) == inside:
                self._lazy[eqn.outvars[k]] = inside  # handed over partial: the last loop reduces once
        return out

    def held(self, v: Value) -> Sharding:
        """The sharding the lowering holds v in: a loop's accumulator kept a partial sum (deferral.py) is the
        unreduced sums in the loop's carry (reduced after it), and a scan's stacked partial sums so too."""
        return self._held_after.get(v) or self.plan.sharding(v)

    def _next_loop(self, v: Value) -> Optional[tuple[Eqn, int]]:
        """(loop, carry index) where v's one use is the initial value of a loop's carry (1F1B's or an
        interleaved schedule's phases, one after another, accumulating the same gradients)."""
        reads = self.reads(v)
        if len(reads) != 1 or reads[0][0] is None or reads[0][0].name not in CF.FORMS:
            return None
        e, i = reads[0]
        k = i - CF.carry_offset(e)
        return (e, k) if 0 <= k < len(CF.FORMS[e.name].carries(e)[1]) else None

    def sum_trees(self, program) -> None:
        """Mark a body's sums of partial sums (deferral.sum_trees) whose leaves are all predicted partial over the
        same axes: their chains stay partial and each root add reduces once, to its plan."""
        if not DF.ENABLED.get():
            return
        for tree in DF.sum_trees(program):
            root = tree.add.outvars[0]
            if id(tree.add) in self._sums or root in self._lazy or any(v in self._lazy for v, _ in tree.chain):
                continue
            planned = self.plan.sharding(root)
            if planned.partial or planned.padded:
                continue
            made = {self._predict(v, e).partial for v, e in zip(tree.leaves, tree.producers)}
            if len(made) != 1 or not next(iter(made)):
                continue
            inside = self._roots[id(tree.add)] = DF.deferred_sharding(planned, next(iter(made)))
            for v, dims in tree.chain:
                self._lazy[v] = DF.in_loop(inside, dims)
                self._in_tree.add(v)

    def _predict(self, v: Value, eqn: Eqn) -> Sharding:
        """The sharding eqn makes v in, from its operands as planned (an inner loop's deferred accumulator: as
        the loop carries it)."""
        if eqn.name in CF.FORMS:
            k = eqn.outvars.index(v)
            return self.deferrals(eqn).get(k) or self._stacked_sum(eqn, v) or self.plan.sharding(v)
        rule = self.plan.rules.get(eqn)
        if rule is None or eqn.subs or M.is_region(eqn):
            return self.plan.sharding(v)
        ops, i = self.planned_operands(eqn), eqn.outvars.index(v)
        made = self.choose(eqn, rule, ops, rings=False).made[i]
        if made.partial:
            return made
        # The plan may split the result over the axes its operands split the contraction over (a ZeRO
        # gradient), which an exchange of operands makes on every trip; aimed at the plan without those axes,
        # the op makes a partial sum instead, which its loop reduces once.
        return self.choose(eqn, rule, ops, rings=False, planned=self._unsplit(eqn, ops)).made[i]

    def _unsplit(self, eqn: Eqn, ops: list[Sharding]) -> list[Sharding]:
        """eqn's results as planned, without the mesh axes its operands split a summed factor over (a ZeRO
        gradient's contracted batch, the rows a scatter-add sums into one place); where they split none,
        without every axis they are split over. Aimed there, the op makes its partial sum and keeps the
        rest of the plan: a scatter-add of per-stage updates into a batch-split accumulator stays split
        over the batch rather than gathering the updates every trip."""
        rule = self.plan.rules.get(eqn)
        summed: set = set()
        for tf, s in zip(rule.operands if rule is not None else (), ops):
            for dim in rule.to_factors(tf, s, self.mesh_shape) or ():
                summed.update(a for f, axes in (dim or {}).items() if rule.reductions.get(f) == "sum" for a in axes)
        if summed:  # the partial sum itself is the target: what it costs to make, not to reduce
            return [DF.deferred_sharding(self.plan.sharding(o), frozenset(summed)) for o in eqn.outvars]
        used = frozenset(a for s in ops for d in s.dims for a in d)
        return [DF.deferred_sharding(self.plan.sharding(o), used).without_partial() for o in eqn.outvars]

    def planned_operands(self, eqn: Eqn) -> list[Sharding]:
        """eqn's operands as the plan has them (a literal replicated): what a choice predicted ahead reads."""
        return [self.plan.sharding(x) if isinstance(x, Value) else Sharding.replicated(len(x.shape))
                for x in eqn.invars]

    def _stacked_sum(self, eqn: Eqn, v: Value) -> Optional[Sharding]:
        """A scan's stacked output v that an outer accumulator sums, when its per-trip result is a partial sum:
        the scan then stacks the partial sums (its sharding), so the outer loop reduces them once."""
        body, ys, outs = CF.FORMS[eqn.name].stacked(eqn)
        if v not in outs or not DF.ENABLED.get():
            return None
        j = outs.index(v)
        acc = DF.summand(body, ys[j])
        if acc is None:
            return None
        planned = self.plan.sharding(ys[j])
        made = [self._predict(x, e) for x, e in zip(acc.leaves, acc.producers)]
        partial = frozenset().union(*(m.partial for m in made))
        if not partial or planned.partial or planned.padded:
            return None
        inside = self.deferred_ys[(id(eqn), j)] = DF.deferred_sharding(planned, partial)
        self._held_after[v] = CF.stacked(inside)
        for x, dims in acc.chain:
            self._lazy[x] = DF.in_loop(inside, dims)
        return CF.stacked(inside)

    def _read_sum(self, env, x, dst: Sharding, log: list):
        """x's local value as a partial sum sharded as dst, with no communication: where x is split over an axis
        dst sums over (minor to dst's axes of that dim), each device's block sits in zeros at its offset; over
        the other summed axes it is kept on one device (zero on the others). The sum over them is x."""
        if not dst.partial or (isinstance(x, Value) and env[x][1] == dst):
            return self._read(env, x, dst, log)
        have = env[x][1] if isinstance(x, Value) else Sharding.replicated(len(x.shape))
        extra = [h[len(d):] for h, d in zip(have.dims, dst.dims)]
        local_fits = (not have.partial and not have.padded and not dst.padded and
                      all(h[:len(d)] == d and set(e) <= dst.partial for h, d, e in zip(have.dims, dst.dims, extra)))
        if not local_fits:
            have = dst.without_partial()
            extra = [()] * len(dst.dims)
        local = self._read(env, x, have, log)
        if self.dry:
            return local
        if any(extra):
            block = have.local_shape(x.shape, self.mesh_shape)
            offsets = [RS.linear_axis_index(e, self.mesh_shape) * n if e else 0 for e, n in zip(extra, block)]
            zeros = jnp.zeros(dst.without_partial().local_shape(x.shape, self.mesh_shape), local.dtype)
            local = jax.lax.dynamic_update_slice(zeros, local, offsets)
        rest = sorted(dst.partial - {a for e in extra for a in e})
        if not rest:
            return local
        first = functools.reduce(jnp.logical_and, [jax.lax.axis_index(a) == 0 for a in rest])
        return jnp.where(first, local, jnp.zeros_like(local))

    def _filled(self, env, x, dst: Sharding, log: list):
        """x in sharding dst; a broadcast (a mask's predicate, its zeros) is made there again from its smaller
        operand (zeros from nothing), where resharding it would gather on every trip what each device can
        fill in itself."""
        made_by = self.producers()
        e = made_by.get(x) if isinstance(x, Value) else None
        if e is None or e.name != "broadcast_in_dim" or dst.partial or dst.padded:
            return self._read(env, x, dst, log)
        local = tuple(dst.local_shape(x.shape, self.mesh_shape))
        if DF._zero(x, made_by):
            return self._new_token() if self.dry else jnp.zeros(local, x.dtype)
        o, dims = e.invars[0], e.params["broadcast_dimensions"]
        inner = Sharding(tuple(dst.dims[d] if n == x.shape[d] else () for n, d in zip(o.shape, dims)))
        small = self._read(env, o, inner, log)
        return small if self.dry else jax.lax.broadcast_in_dim(small, local, dims)

    def _partial_sum(self, eqn: Eqn, env, inside: Sharding) -> bool:
        """An accumulator chain's op on partial sums, on local shards; False where an operand arrived otherwise
        (then the op runs as planned: its operand is reduced, as without deferral)."""
        accumulates = id(eqn) in self._sums or id(eqn) in self._roots
        log: list[Collective] = []
        have = [env[x][1] if isinstance(x, Value) else Sharding.replicated(len(x.shape)) for x in eqn.invars]
        chain = [isinstance(x, Value) and x in self._lazy for x in eqn.invars]
        whole = Sharding(inside.dims)  # a mask's predicate and zeros: as the sum's dims, not summed
        want = [self._lazy[x] if c else inside if accumulates else whole if len(x.shape) else Sharding(())
                for x, c in zip(eqn.invars, chain)]
        if any(c and h != w for c, h, w in zip(chain, have, want)) and not accumulates:
            return False
        local = [env[x][0] if h == w else self._read_sum(env, x, w, log) if accumulates else
                 self._filled(env, x, w, log) for x, h, w in zip(eqn.invars, have, want)]
        v = eqn.outvars[0]
        if self.dry or eqn.name == "sharding_annotation":
            out = self._new_token() if self.dry else local[0]
        else:
            params = {k: None if k in ("sharding", "out_sharding") else p for k, p in eqn.params.items()}
            for key in ("new_sizes", "shape"):  # a reshape or broadcast of 1-dims: local sizes
                if key in params:
                    params[key] = tuple(inside.local_shape(v.shape, self.mesh_shape))
            out = eqn.prim.bind(*local, **params)
        env[v] = (out, inside)
        root, issue = id(eqn) in self._roots, len(log)
        if root:  # a sum of partial sums: reduced here, once
            self._store(env, v, out, inside, log)
        what = ("partial sums added, then reduced once" if root else "summand of a sum reduced once"
                if v in self._in_tree else f"{'accumulated' if accumulates else 'summand'} reduced once after the loop")
        self._record(eqn, [(x, h, w) for x, h, w in zip(eqn.invars, have, want) if isinstance(x, Value)], [inside],
                     f"partial sum over {','.join(sorted(inside.partial))} kept: {what}", log, issue=issue)
        return True

    def _linear(self, eqn: Eqn, env, keep) -> bool:
        """An op linear in its chain operands (a scatter-add into zeros, or any chain op below one), run through
        its own rule on the partial sums as if they were whole: its reshards of them and its local op commute
        with the sum, so long as none of its factors is split over the summed axes. False (run as planned,
        reducing the operand) otherwise."""
        rule = self.plan.rules.get(eqn)
        chain = [isinstance(x, Value) and x in self._lazy for x in eqn.invars]
        have = [env[x][1] if isinstance(x, Value) else Sharding.replicated(len(x.shape)) for x in eqn.invars]
        summed = {h.partial for h, c in zip(have, chain) if c}
        if rule is None or len(summed) != 1 or not next(iter(summed)) or any(
                h.partial for h, c in zip(have, chain) if not c):
            return False
        (partial,) = summed
        # the others (a mask's predicate and zeros) as if not split over the summed axes either: filled in
        # locally where they are broadcasts (_filled), instead of the op splitting a factor over those axes
        whole = [h.without_partial() if c else DF.deferred_sharding(h, partial).without_partial()
                 for h, c in zip(have, chain)]
        # aimed at the plan without the summed axes: the sum is over them, so no factor may split over them
        aims = [DF.deferred_sharding(self.plan.sharding(v), partial).without_partial() for v in eqn.outvars]
        choice = self.choose(eqn, rule, whole, planned=aims)
        split = {a for axes in choice.fs.values() for a in axes}
        if split & partial or choice.made[0].partial or choice.ring is not None:
            return False
        log: list[Collective] = []
        local_in = []
        for x, h, w, n, c in zip(eqn.invars, have, whole, choice.need, chain):
            if not isinstance(x, Value):
                local_in.append(x.val)
                continue
            if c:  # the partial sum, resharded as if whole (linear steps: no axis it sums over moves)
                env[x] = (env[x][0], w)
                local_in.append(self._reshard(env, x, n, log)[0])
            else:
                local_in.append(self._filled(env, x, n, log))
        outs = self._bind(eqn, rule, choice, local_in, log)
        made, issue = choice.made[0].with_partial(partial), len(log)
        self._store(env, eqn.outvars[0], outs[0], made, log)  # kept, or reduced if the chain wants other dims
        self._record(eqn, [(x, h, n) for x, h, n in zip(eqn.invars, have, choice.need) if isinstance(x, Value)],
                     [made], f"partial sum over {','.join(sorted(partial))} kept through {eqn.name}: "
                     f"reduced once after the loop", log, issue=issue)
        return True

