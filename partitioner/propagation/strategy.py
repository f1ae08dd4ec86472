"""The strategy choice: for each equation, the cheapest factor sharding its rule allows.

Candidates come from what the operands have and what the plan wants for the results; each is costed with the
alpha-beta model (reshards in, reshards out, the hook's own communication, local compute). A windowed op
keeps a split windowed dim split where memory matters; a dot_general may take a collective matmul in place of
its plan's all-gather or reduce-scatter.

The choice is a pure function of the plan, the profile, the equation, the shardings its operands have and
those they are already available in (`ready`: an earlier op's reshard): nothing is read from a run in
progress, so a planner can cost a program without tracing it. Choices repeat across a model's layers, so
they are memoized in a StrategyCache that the caller passes in (and may share between lowerings of one
mesh and profile).
"""
from __future__ import annotations

import collections
import dataclasses
import math
from typing import Optional, Sequence

from ..costs.cost import Collective, _fmt_bytes, compute_time
from ..representation import factors as F
from ..representation.program import Const, Eqn
from ..representation.sharding import Sharding
from ..strategies import collective_matmul as CM, hooks as H, registry as REG, reshard as RS


@dataclasses.dataclass
class Choice:
    fs: F.FactorSharding
    need: list[Sharding]
    made: list[Sharding]
    cost: float
    ring: Optional[CM.Ring] = None  # a collective matmul in place of the plan's all-gather or reduce-scatter
    note: str = ""  # why the choice holds a split dim whole, where it does
    peak: int = 0  # bytes per device its operands (as it needs them) and results (as it makes them) occupy


def _merge_fs(dims_fs: Sequence[Optional[F.FactorSharding]]) -> F.FactorSharding:
    out: F.FactorSharding = {}
    for d in dims_fs:
        for f, ax in (d or {}).items():
            if ax:
                out.setdefault(f, ax)
    return out


def _choice_key(eqn: Eqn, rule: F.Rule, have: list[Sharding], planned: list[Sharding]) -> Optional[tuple]:
    """What a strategy choice depends on (None if a param or literal cannot be hashed: no reuse)."""
    consts = ()
    for i, x in enumerate(eqn.invars):
        if isinstance(x, Const):
            if x.aval.shape:
                return None  # an array literal: its contents could matter to a hook
            consts += ((i, x.val.item() if hasattr(x.val, "item") else x.val),)
    try:
        key = (eqn.prim, tuple(eqn.params.items()), rule.key, tuple(have), tuple(planned), consts,
               tuple([x.aval.dtype for x in eqn.invars]), tuple([v.aval.dtype for v in eqn.outvars]))
        hash(key)
    except TypeError:
        return None
    return key


def _fresh(have: Sequence[Sharding], need: Sequence[Sharding], ready: Ready) -> list[Sharding]:
    """What each operand has, or what it needs where a reshard to that is already materialised (an earlier op
    gathered it: holding it costs nothing more)."""
    return [n if n in r else h for h, n, r in zip(have, need, ready)]


def _materialises_split_dim(rule: F.Rule, have: Sequence[Sharding], need: Sequence[Sharding],
                            made: Sequence[Sharding], planned: Sequence[Sharding]) -> bool:
    """Whether a windowed op's candidate holds the whole of a split windowed dim: an operand gathered there, or
    a result computed whole where the plan splits it (the memory a user split that dim to save)."""
    tied = set(rule.ties) | set(rule.ties.values())
    for tensors, big, small in ((rule.operands, have, need), (rule.results, planned, made)):
        for tf, b, s in zip(tensors, big, small):
            if any(tied.intersection(fd) and len(s.dims[d]) < len(b.dims[d]) for d, fd in enumerate(tf)
                   if d < len(b.dims)):
                return True
    return False

@dataclasses.dataclass
class StrategyCache:
    """Memo tables of the strategy choice for one mesh shape and profile: reshard plans, their times, choices."""
    plans: dict = dataclasses.field(default_factory=dict)
    times: dict = dataclasses.field(default_factory=dict)
    choices: dict = dataclasses.field(default_factory=dict)


Ready = tuple  # per operand: the shardings it is already available in (frozensets; empty for literals)


class Strategy:
    """The strategy choice for a planned program on a mesh and profile (see the module docstring)."""

    def __init__(self, plan, mesh_shape: dict[str, int], mesh_axes: tuple[str, ...], profile,
                 collective_matmul: str = "auto", cache: Optional[StrategyCache] = None):
        self.plan, self.profile = plan, profile
        self.mesh_shape, self.mesh_axes = dict(mesh_shape), tuple(mesh_axes)
        self.collective_matmul = CM.check_mode(collective_matmul)
        self.cache = cache if cache is not None else StrategyCache()

    def reshard_steps(self, src: Sharding, dst: Sharding, shape: tuple[int, ...]) -> tuple:
        key = (src, dst, tuple(shape))
        plans = self.cache.plans
        if key not in plans:
            plans[key] = tuple(RS.plan(src, dst, shape, self.mesh_shape, self.mesh_axes))
        return plans[key]

    def reshard_collectives(self, src: Sharding, dst: Sharding, shape, dtype) -> list[Collective]:
        if src == dst:
            return []
        return RS.collectives(self.reshard_steps(src, dst, tuple(shape)), shape, dtype, self.mesh_shape)

    def reshard_time(self, src, dst, shape, dtype) -> float:
        if src == dst:
            return 0.0
        if dst.partial:  # a partial sum kept past its loop (PartialSums._unsplit): a whole value is one as it
            # is, and the axes it may stay summed over need no reduction; only the dims move
            src = Sharding(src.dims, src.partial - dst.partial, src.padded)
            dst = Sharding(dst.dims, frozenset(), dst.padded)
            if src == dst:
                return 0.0
        key = (src, dst, tuple(shape), dtype)
        times = self.cache.times
        if key not in times:
            times[key] = sum(c.time(self.profile) for c in self.reshard_collectives(src, dst, shape, dtype))
        return times[key]

    def choose(self, eqn: Eqn, rule: F.Rule, have: list[Sharding], ready: Ready = (), rings: bool = True,
               planned: Optional[list[Sharding]] = None) -> Choice:
        """The cheapest factor sharding for eqn given what its operands have (and are `ready` in: operands
        already resharded for an earlier op cost nothing to have that way) and the plan for its results
        (`planned`: other targets for them, as for a partial sum kept past its loop).
        rings=False: no collective matmul (a summand kept a partial sum past its loop reduces nowhere here).

        The choice depends only on the op, its params, dtypes, rule, and those shardings, so equations
        that repeat (the layers of an unrolled model) are decided once.
        """
        ready = tuple(ready) or (frozenset(),) * len(eqn.invars)
        planned = planned or [self.plan.sharding(v) for v in eqn.outvars]
        pinned = getattr(self.plan, "pinned", {}).get(eqn)
        key = _choice_key(eqn, rule, have, planned)
        if key is not None:
            key += (ready, rings, tuple(sorted(pinned.items())) if pinned else None)
        choices = self.cache.choices
        choice = choices.get(key) if key is not None else None
        if choice is None:
            choice = self._choose(eqn, rule, have, planned, ready, rings, pinned)
            if key is not None:
                choices[key] = choice
        return choice

    def _choose(self, eqn: Eqn, rule: F.Rule, have: list[Sharding], planned: list[Sharding],
                ready: Ready, rings: bool = True, pinned: Optional[F.FactorSharding] = None) -> Choice:
        proposals = [_merge_fs(rule.to_factors(tf, s, self.mesh_shape))
                     for tf, s in zip(rule.results, planned)]
        proposals += [_merge_fs(rule.to_factors(tf, s, self.mesh_shape))
                      for tf, s in zip(rule.operands, have)]
        aligned = self._aligned(eqn, rule, have, planned, proposals) if pinned is None else None
        if aligned is not None:
            return aligned
        best: Optional[Choice] = None
        best_whole = False
        keep_split = bool(rule.ties) and self.profile.memory_matters
        candidates = F.candidate_factor_shardings(rule, proposals, self.mesh_shape)
        if pinned is not None and self._layout(rule, pinned) is not None:
            candidates = [pinned]  # chosen for the whole program (partitioner/auto/choice.py): taken as it is
        for fs in candidates:
            layout = self._layout(rule, fs)
            if layout is None:
                continue
            need, made = layout
            whole = keep_split and _materialises_split_dim(rule, _fresh(have, need, ready), need, made, planned)
            if best is not None and whole and not best_whole:
                continue
            hook = REG.collectives(H.OpContext(eqn, rule, fs, made, self.mesh_shape, need, profile=self.profile))
            # A hook that gathers (rows of a base-dilated input out of phase) keeps no exchange either.
            whole = whole or (keep_split and any(c.kind == "all-gather" for c in hook))
            cost = 0.0
            for x, h, n, r in zip(eqn.invars, have, need, ready):
                if len(x.shape) and n not in r:
                    cost += self.reshard_time(h, n, x.shape, x.aval.dtype)
            for v, m, p in zip(eqn.outvars, made, planned):
                cost += self.reshard_time(m, p, v.shape, v.dtype)
            cost += sum(c.time(self.profile) for c in hook) + self._compute(rule, fs)
            peak = self._peak(eqn, need, made)
            # Fewer split dims held whole first (where memory matters), then time, then the bytes it holds.
            if best is None or (best_whole and not whole) or (whole == best_whole and (
                    cost < best.cost - 1e-15 or (cost <= best.cost + 1e-15 and peak < best.peak))):
                best, best_whole = Choice(fs, need, made, cost, peak=peak), whole
        if best is None:  # the all-replicated candidate always exists unless a rule is inexpressible
            raise AssertionError(f"no valid factor sharding for {eqn.name} {rule.signature()}")
        if rule.rings and rings and self.collective_matmul != "off":
            return self._ring(eqn, rule, have, planned, best, ready)
        held = f" ({_fmt_bytes(best.peak)} per device)"
        if best_whole:
            best.note = (f"a split windowed dim is held whole{held}: no factor sharding from the operands and the "
                         f"plan keeps it split with a halo exchange (rows that cannot split over those axes, or a "
                         f"base-dilated input whose shards start out of phase)")
        elif rule.ties and not keep_split and _materialises_split_dim(rule, _fresh(have, best.need, ready),
                                                                      best.need, best.made, planned):
            best.note = f"a split windowed dim is held whole{held}: the profile says memory is no concern"
        return best

    def _peak(self, eqn: Eqn, need: list[Sharding], made: list[Sharding]) -> int:
        """Bytes per device the candidate's operands (as it needs them) and results (as it makes them) occupy."""
        return (sum(math.prod(n.local_shape(x.shape, self.mesh_shape)) * x.aval.dtype.itemsize
                    for x, n in zip(eqn.invars, need) if len(x.shape))
                + sum(math.prod(m.local_shape(v.shape, self.mesh_shape)) * v.aval.dtype.itemsize
                      for v, m in zip(eqn.outvars, made)))

    def _ring(self, eqn: Eqn, rule: F.Rule, have: list[Sharding], planned: list[Sharding], best: Choice,
              ready: Ready) -> Choice:
        """The chosen plan, or a collective matmul in place of its all-gather of an operand or reduce-scatter
        of the result: the cheaper under "auto", the ring wherever one applies when a direction is forced."""
        ins = [x for x in eqn.invars]
        in_steps = [() if not len(x.shape) or h == n or n in r else self.reshard_steps(h, n, x.shape)
                    for x, h, n, r in zip(ins, have, best.need, ready)]
        out = eqn.outvars[0]
        out_steps = () if best.made[0] == planned[0] else self.reshard_steps(best.made[0], planned[0], out.shape)
        rings = CM.find(rule, have, best.need, best.made[0], planned[0], in_steps, out_steps,
                        [tuple(x.shape) for x in ins], tuple(out.shape), self.mesh_shape, self.collective_matmul)
        compute = self._compute(rule, best.fs)
        options = [] if self.collective_matmul != "auto" else [best]
        for ring in rings:
            if ring.kind == "all-gather":
                i = ring.operand
                x = ins[i]
                replaced = self.reshard_time(have[i], best.need[i], x.shape, x.aval.dtype)
                piece, dtype = have[i].local_shape(x.shape, self.mesh_shape), x.aval.dtype
                need = [h if j == i else n for j, (h, n) in enumerate(zip(have, best.need))]
                made = best.made
            else:
                replaced = self.reshard_time(best.made[0], planned[0], out.shape, out.dtype)
                piece, dtype = planned[0].local_shape(out.shape, self.mesh_shape), out.dtype
                need, made = best.need, [planned[0]]
            permutes = CM.collectives(ring, tuple(piece), dtype)
            cost = best.cost - replaced - compute + CM.time(ring, permutes, compute, self.profile)
            options.append(Choice(best.fs, need, made, cost, ring))
        return min(options, key=lambda c: c.cost) if options else best

    def _layout(self, rule: F.Rule, fs: F.FactorSharding) -> Optional[tuple[list[Sharding], list[Sharding]]]:
        """The operand shardings a factor sharding needs and the results it makes (split sums partial)."""
        need = [rule.to_tensor(tf, fs, self.mesh_shape) for tf in rule.operands]
        made = [rule.to_tensor(tf, fs, self.mesh_shape) for tf in rule.results]
        if any(s is None for s in need + made):
            return None
        partial = [a for f, k in rule.reductions.items() if k == "sum" for a in fs.get(f, ())]
        return need, [m.with_partial(partial) for m in made]

    def _compute(self, rule: F.Rule, fs: F.FactorSharding) -> float:
        # A tied leader (a windowed op's input rows) is counted through its follower (output or window rows);
        # a leader of several followers (the pieces of a split or a concatenation) is counted once, for them all.
        followers = collections.Counter(rule.ties.values())
        skip = {f for f, n in followers.items() if n == 1} | {f for f, lead in rule.ties.items() if followers[lead] > 1}
        local = {f: rule.sizes[f] // math.prod(self.mesh_shape[a] for a in fs.get(f, ())) for f in rule.factors}
        if rule.work is not None:
            return compute_time(rule.work(local), self.profile)
        work = math.prod(n for f, n in local.items() if f not in skip)
        return compute_time(work * (2 if rule.reductions else 1), self.profile)

    def _aligned(self, eqn: Eqn, rule: F.Rule, have: list[Sharding], planned: list[Sharding],
                 proposals: list) -> Optional[Choice]:
        """The choice that moves nothing, when the operands already are what it needs and it makes the plan.

        No reshard in or out and no hook communication: no other candidate can cost less communication,
        and none computes on smaller shards without resharding a result. Most equations take this path,
        which skips enumerating candidates.
        """
        fs = rule.tie(_merge_fs(proposals))
        if fs is None:
            return None
        used = [a for f, ax in fs.items() if f not in rule.ties for a in ax]
        if len(used) != len(set(used)) or any(f in rule.replicated for f, ax in fs.items() if ax):
            return None
        layout = self._layout(rule, fs)
        if layout is None:
            return None
        need, made = layout
        if any(len(x.shape) and h != n for x, h, n in zip(eqn.invars, have, need)) or made != planned:
            return None
        if REG.collectives(H.OpContext(eqn, rule, fs, made, self.mesh_shape, need, profile=self.profile)):
            return None
        return Choice(fs, need, made, self._compute(rule, fs))
