"""The lowering's local values: each value's local shard read in the sharding an op needs, stored resharded
to its plan, and a primitive bound on local shards (through its registry hook).

A mixin of Lowering (lower.py): it reads the plan, the strategy's reshard steps and the lowering's caches
(`_cache`: values already resharded in this region, `_resharded`: the shardings each is available in) and
fills report rows through lower_rows.py. In a walk without arrays (Lowering.cost) local values are Tokens.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import jax.numpy as jnp

from ..costs.cost import Collective
from ..costs.liveness import Copy, nbytes
from ..propagation.strategy import Choice
from ..reporting.report import Operand, Result
from ..representation import factors as F
from ..representation.jax_compat import bind_on
from ..representation.program import Const, Eqn, Token, Value
from ..representation.sharding import Sharding
from ..strategies import collective_matmul as CM, deferral as DF, hooks as H, registry as REG, reshard as RS


class LocalShards:
    """Reading, storing and resharding local values, and binding primitives on them (a mixin of Lowering)."""

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
                remade = self._remade(env, v, src, dst)
                if remade is not None:
                    y, src = remade, dst
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
        if self._reader is not None and self.report is not None:  # a copy an op reads: alive while its readers run
            y = self._cache[key]
            copy = self.copies.setdefault(id(y), Copy(y, v, nbytes(v, dst.local_shape(v.shape, self.mesh_shape))))
            copy.readers.append(self._reader)
        return self._cache[key], dst

    def _remade(self, env, v: Value, src: Sharding, dst: Sharding):
        """v made again in dst where it is a scalar broadcast, annotated or not (every device can make any block
        of it), and resharding it would move bytes: as XLA folds a collective of a constant. None: not so."""
        folds = lambda e: getattr(REG.op_for(e.name), "fold", REG.Fold())  # (an op the registry lacks: none)
        e = self.producers().get(v)
        while e is not None and folds(e).identity:  # (an annotation or copy: the same values)
            e = self.producers().get(e.invars[0])
        if e is None or not folds(e).spreads_scalar or len(e.invars) != 1 or e.invars[0].shape or dst.partial \
                or all(st.kind == "all-slice" for st in self.reshard_steps(src, dst, v.shape)):
            return None
        x = e.invars[0]
        if isinstance(x, Value) and x not in env:
            return None
        if self.dry:
            return Token()
        scalar = x.val if isinstance(x, Const) else env[x][0]
        return jnp.broadcast_to(scalar, dst.local_shape(v.shape, self.mesh_shape)).astype(v.aval.dtype)

    @contextlib.contextmanager
    def reading(self, eqn: Optional[Eqn]) -> Iterator[None]:
        """Reshards made within are copies of eqn's operands (None: of no op's, as a body's own edges)."""
        saved, self._reader = self._reader, eqn
        try:
            yield
        finally:
            self._reader = saved

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

    def _bind(self, eqn: Eqn, rule: Optional[F.Rule], choice: Choice, local_in: list, log: list):
        """Bind the primitive on local shards, with local-shape params, through its hook if it has one."""
        params = dict(eqn.params)
        for key in ("sharding", "out_sharding"):
            if key in params:
                params[key] = None
        if rule is not None and choice.made:  # (a sink, dce_sink, makes nothing)
            local_out = choice.made[0].local_shape(eqn.outvars[0].shape, self.mesh_shape)
            if "shape" in params:  # the result's shape, or its trailing dims past a key array's (random_split)
                params["shape"] = local_out[len(local_out) - len(params["shape"]):]
            if "new_sizes" in params:
                params["new_sizes"] = local_out

        def bind(*args, **kw):
            if self.dry:
                return [Token() for _ in eqn.outvars]

            def run(*a):
                outs = eqn.prim.bind(*a, **kw)
                return list(outs) if eqn.prim.multiple_results else [outs]
            if eqn.compute_type and not self._placed_region:  # inside a placed run, the run's region places it
                return bind_on(eqn.compute_type, run, args, [v.aval for v in eqn.outvars])
            return run(*args)

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
        op = REG.op_for(eqn.name)
        if not self.dry:
            local_in = H.mask_padding(ctx, local_in, op.padding, op.masked_operands)
        hook = op.hook
        if hook is None:
            return bind(*local_in, **params)
        log.extend(REG.collectives(ctx))
        if self.dry:  # the hook's results, without running it: an identity's is its operand
            for key in REG.received(ctx):
                self._cache[key] = Token()
            return [local_in[0]] if hook is H.identity_hook else bind()
        return hook(ctx, local_in, params, bind)
