"""Sharding propagation over a Program through the factor rules.

Shardings only ever grow: a value's dims gain axes, never lose them, so the
fixed point is reached in a few passes. User shardings (annotations,
in/out shardings) are fixed. Values proposed by several neighbours take the
first proposal, in order: fixed values, then operands on forward passes and
results on backward passes. Backward propagation out of a broadcast is held
back until the other sources are exhausted, and so is forward propagation
into a repeat (a broadcast whose new dim reshapes merge into a neighbour, as
jnp.repeat does to k/v heads). Every value records where its
sharding came from, for explain().

Control flow is propagated through *links*: identity constraints tie a loop's
initial carry, the body's carry parameters, the body's carry results and the
final carry together (so a stable carry needs no reshard inside the body);
stacked values (scan xs/ys) are tied to the body's slices with the scan dim
replicated; cond branches share their operands and results. A checkpointed
region (remat2) needs no links: its body already uses the caller's values.

`propagate` runs named phases over one `Propagation` state: seed_from_arguments
(in/out shardings and a planner's seeds), rules_of and constraints (a
constraint per rule and per control-flow link), seed_from_annotations (the
user's annotations and manual regions, read through the registry's entries),
pin_linked (values linked to a fixed one are read first), prepare_constraints
(what each constraint reads and may change), run_phases (forward and backward
passes of `visit` to a fixed point, elementwise ops first, broadcasts backward
last) and finish (origins formatted, unreached values replicated, whole dims
explained).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Mapping, Optional, Sequence

from ..representation import factors as F
from ..representation.program import Eqn, Program, Value
from ..representation.sharding import Sharding
from ..strategies import manual_regions as M, registry as REG
from .constraints import Constraint, constraints, link, merge, repeats


@dataclasses.dataclass
class Assignment:
    """A sharding and its provenance for every value, and a rule for every equation."""

    shardings: dict[Value, Sharding]
    origins: dict[Value, str]
    rules: dict[Eqn, Optional[F.Rule]]
    # an op's factor sharding chosen before the lowering (the automatic sharding's), which its strategy takes
    pinned: dict = dataclasses.field(default_factory=dict)

    def sharding(self, v) -> Sharding:
        if isinstance(v, Value):
            return self.shardings.get(v) or Sharding.replicated(len(v.shape))
        return Sharding.replicated(len(v.shape))



@dataclasses.dataclass
class Propagation:
    """The state the phases of one propagation share: what each value has, where it came from, what is fixed."""

    mesh_shape: Mapping[str, int]
    shardings: dict[Value, Sharding]
    origins: dict[Value, object]  # a string, or (forward, constraint) until finish() formats it
    fixed: set[Value]  # user shardings: never changed
    annotated: set[Value] = dataclasses.field(default_factory=set)  # values fixed because an annotation applies
    closed: dict[Value, frozenset[int]] = dataclasses.field(default_factory=dict)  # dims a P.UNCONSTRAINED
    # annotation fixes (the rest open)
    blocked: dict[Value, dict[int, str]] = dataclasses.field(default_factory=dict)  # why a dim a neighbour
    # would split stays whole


def propagate(program: Program, mesh_shape: Mapping[str, int],
              seeds: Mapping[Value, tuple[Sharding, str]], max_passes: int = 50) -> Assignment:
    """Propagate from the seeds (value -> (sharding, origin)) to every value of the program."""
    state = seed_from_arguments(seeds, mesh_shape)
    rules = rules_of(program)
    cons = constraints(program, rules)
    cons += seed_from_annotations(state, program)
    pinned = pin_linked(state, cons)
    prepare_constraints(state, cons, pinned)
    run_phases(state, cons, max_passes)
    finish(state, program)
    return Assignment(state.shardings, state.origins, rules)


def seed_from_arguments(seeds: Mapping[Value, tuple[Sharding, str]], mesh_shape: Mapping[str, int]) -> Propagation:
    """The state at the start: the seeds (in/out shardings, a planner's) fixed, everything else unset."""
    shardings: dict[Value, Sharding] = {}
    origins: dict[Value, object] = {}
    for v, (s, why) in seeds.items():
        shardings[v], origins[v] = s.canonical(v.shape, mesh_shape), why
    return Propagation(mesh_shape, shardings, origins, set(seeds))


def rules_of(program: Program) -> dict[Eqn, Optional[F.Rule]]:
    """The rule of every equation (None: control flow, or an op without one). Equal rules (the same op on the
    same shapes, e.g. in every layer) are one object, sharing its memo."""
    interned: dict[tuple, F.Rule] = {}
    rules = {}
    for e in program.all_eqns():
        r = None if e.subs else REG.rule_for(e)
        rules[e] = r if r is None else interned.setdefault(r.key, r)
    return rules


def seed_from_annotations(state: Propagation, program: Program) -> list[Constraint]:
    """Fix what the user's annotations and manual regions say; the links that draw a manual region's operands
    towards its in_specs."""
    links: list[Constraint] = []
    for e in program.all_eqns():
        op = REG.op_for(e.name)
        if op is not None and op.annotation and e.params.get("open"):
            _seed_open_annotation(state, e)
        elif op is not None and op.annotation:
            _seed_annotation(state, e)
        elif op is not None and op.manual:
            links += _seed_manual_region(state, e)
    return links


def _seed_open_annotation(state: Propagation, e: Eqn) -> None:
    """An annotation with P.UNCONSTRAINED dims: the others are the user's, these are propagation's to split."""
    shut = frozenset(range(len(e.outvars[0].shape))) - e.params["open"]
    for x in [x for x in (e.outvars[0], e.invars[0]) if shut and isinstance(x, Value) and x not in state.fixed]:
        start = state.shardings.get(x) or Sharding.replicated(len(x.shape))
        state.closed[x] = state.closed.get(x, frozenset()) | shut
        dims = tuple(e.params["sharding"].dims[d] if d in shut else ax for d, ax in enumerate(start.dims))
        used = {a for d in shut for a in dims[d]}
        dims = tuple(ax if d in shut else tuple(a for a in ax if a not in used) for d, ax in enumerate(dims))
        state.shardings[x] = Sharding(dims).canonical(x.shape, state.mesh_shape)
        state.origins[x] = (f"user annotation {e.params['what']} at {e.source}"
                            + ("" if x is e.outvars[0] else " (the value it annotates)"))


def _seed_annotation(state: Propagation, e: Eqn) -> None:
    """An annotation: its result fixed as the user says, and (unless forward-only) the value it annotates."""
    v = e.outvars[0]
    state.shardings[v] = e.params["sharding"].canonical(v.shape, state.mesh_shape)
    state.origins[v] = f"user annotation {e.params['what']} at {e.source}"
    state.fixed.add(v)
    # The value it annotates is the op's result the user sharded: it takes the user's sharding, which
    # outranks what the op would propagate forward from its operands (Shardy's priorities put user
    # shardings first). in/out_shardings and an earlier annotation of the same value win. It is not
    # read before other values: its op's operands still take their own fixed splits first. A
    # forward-only annotation (grad=False: a stored weight at its use) says how the value is used, not
    # where it lives, so its input keeps its own sharding (e.g. a scanned layer's slice of a stack
    # stored split: gathered per layer inside the loop, not as a whole stack before it).
    x = e.invars[0]
    if isinstance(x, Value) and x not in state.fixed and e.params.get("grad", True):
        state.shardings[x] = state.shardings[v]
        state.origins[x] = f"user annotation {e.params['what']} at {e.source} (the value it annotates)"
        state.fixed.add(x)
        state.annotated.add(x)


def _seed_manual_region(state: Propagation, e: Eqn) -> list[Constraint]:
    """A manual region: results fixed by out_specs; operands drawn towards in_specs through a link."""
    M.check(e, state.mesh_shape)
    ins, outs = M.specs(e)
    for v, s in zip(e.outvars, outs):
        state.shardings[v] = s.canonical(v.shape, state.mesh_shape)
        state.origins[v] = f"manual region out_specs at {e.source}"
        state.fixed.add(v)
    links = []
    for x, s in zip(e.invars, ins):
        if isinstance(x, Value):
            want = Value(x.aval, "in_specs")
            state.shardings[want] = s.canonical(x.shape, state.mesh_shape)
            state.origins[want] = "manual region in_specs"
            state.fixed.add(want)
            links.append(link(want, x, "manual region", e))
    return links


def pin_linked(state: Propagation, cons: list[Constraint]) -> set[Value]:
    """The values read first: fixed ones, and those linked through control flow to a fixed value (e.g. a scan's
    residual of an annotated weight, as the backward body sees it), which carry its authority."""
    pinned = state.fixed - state.annotated
    links = [c for c in cons if c.rule.link]
    grew = True
    while grew:
        grew = False
        for c in links:
            a, b = c.ins[0], c.outs[0]
            if (a in pinned) != (b in pinned):
                pinned.update((a, b))
                grew = True
    return pinned


def prepare_constraints(state: Propagation, cons: list[Constraint], pinned: set[Value]) -> None:
    """Per constraint, indexed by direction (0 backward, 1 forward): the tensors it reads, pinned values first,
    and the tensors it may change (values that are not fixed; `fixed` does not change while propagating); and
    whether it waits for the late phase."""
    readers: dict[Value, list[Constraint]] = {}  # value -> the constraints that read it
    for c in cons:
        for v in c.ins:
            if isinstance(v, Value):
                readers.setdefault(v, []).append(c)
    fixed = state.fixed
    for c in cons:
        n_in = len(c.ins)
        ins = [t for t in c.tensors[:n_in] if isinstance(t[0], Value)]
        outs = [t for t in c.tensors[n_in:] if isinstance(t[0], Value)]
        c.reads = tuple([t for t in ts if t[0] in pinned] + [t for t in ts if t[0] not in pinned]
                        for ts in (outs + ins, ins + outs))
        c.writes = tuple([t for t in ts if t[0] not in fixed] for ts in (ins, outs))
        c.late = c.rule.late_backward
        c.late_forward = repeats(c, readers)
        c.rule._memo(state.mesh_shape)  # the rules' memos are for this mesh from here on


def _note_whole(state: Propagation, c: Constraint, forward: bool, whole: dict) -> None:
    """Record, on c's targets in this direction, the dims c keeps whole although a neighbour split a factor."""
    tensors, n_in = c.tensors, len(c.ins)
    targets = range(n_in, len(tensors)) if forward else range(n_in)
    for i in targets:
        v, tf = tensors[i]
        if not isinstance(v, Value) or v in state.fixed:
            continue
        for d, fd in enumerate(tf):
            for f in fd:
                if f in whole:
                    state.blocked.setdefault(v, {})[d] = (
                        f"{c.name} at {c.source or '?'} needs dim {d} whole ({c.rule.kind}), so the split "
                        f"over {'*'.join(whole[f])} stops there")


def _note_unexpressible(state: Propagation, c: Constraint, v: Value, tf, fs: F.FactorSharding) -> Sharding:
    """The proposal for v when its factors' axes make no tensor sharding (a merged dim split off its major
    factor): the dims that can be expressed, each other one recorded as blocked with why."""
    rule, mesh_shape = c.rule, state.mesh_shape
    dims = [F.factors_to_dim(d, fs, rule.sizes, mesh_shape) for d in tf]
    for d, (ax, fd) in enumerate(zip(dims, tf)):
        if ax is None:
            split = {f: fs[f] for f in fd if fs.get(f)}
            tiles = math.prod(mesh_shape[a] for ax_ in split.values() for a in ax_)
            names = "*".join(a for ax_ in split.values() for a in ax_)
            major = rule.sizes[fd[0]]
            state.blocked.setdefault(v, {})[d] = (
                f"a {c.name} at {c.source or '?'} merges this dim (size {v.shape[d]}) from dims of sizes "
                f"{[rule.sizes[f] for f in fd]}, and "
                + (f"{major} does not divide by {tiles} ({names})" if major % tiles else
                   f"the split over {names} ({tiles} tiles) does not fall on its major dim"))
    return Sharding(tuple(ax or () for ax in dims))


def _proposer(c: Constraint) -> str:
    return f"{c.name} at {c.source or '?'}"


def visit(state: Propagation, c: Constraint, forward: bool, late: bool) -> list[Value]:
    """Propose shardings to c's targets in this direction from its other values; the values it changed."""
    shardings, mesh_shape = state.shardings, state.mesh_shape
    rule = c.rule
    memo, replicated, ties = rule.memo, rule.replicated, rule.ties
    opaque = () if rule.ties_propagate else rule.ties.keys() | set(rule.ties.values())
    fs: F.FactorSharding = {}
    used: set[str] = set()
    whole: dict[str, tuple] = {}  # factors the rule keeps whole that a neighbour has split
    for v, tf in c.reads[forward]:
        s = shardings.get(v)
        if s is None or not s.axes:  # replicated: implies no factor sharding
            continue
        pairs = memo.get((tf, s, None))
        if pairs is None:
            pairs = rule.split_factors(tf, s, mesh_shape)
        for f, ax in pairs:
            if f in opaque:
                continue
            f = ties.get(f, f)  # a follower's split is its leader's
            if f in replicated:
                whole.setdefault(f, ax)
            elif f not in fs and used.isdisjoint(ax):
                fs[f] = ax
                used.update(ax)
    if whole:
        _note_whole(state, c, forward, whole)
    if not fs or (not forward and c.late and not late) or (forward and c.late_forward and not late):
        return []
    if ties:
        fs = rule.tie(fs)
    changed = []
    for v, tf in c.writes[forward]:
        proposal = rule.to_tensor(tf, fs, mesh_shape)
        if proposal is None:
            proposal = _note_unexpressible(state, c, v, tf, fs)
        cur = shardings.get(v) or Sharding.replicated(len(tf))
        shut = state.closed.get(v)
        if shut:
            proposal = Sharding(tuple(cur.dims[d] if d in shut else ax for d, ax in enumerate(proposal.dims)))
        if proposal.dims == cur.dims:
            continue
        new = merge(cur, proposal, v.shape, mesh_shape, state.blocked.setdefault(v, {}),
                     functools.partial(_proposer, c))
        if new != cur:
            shardings[v] = new
            state.origins[v] = (forward, c)  # formatted once propagation ends
            changed.append(v)
    return changed


@dataclasses.dataclass
class Revisits:
    """When a constraint is due for another visit. A visit depends only on the shardings of the constraint's
    values, so a constraint is revisited (in a given direction and phase) only when one of its values changed
    since its last visit."""

    users: dict[Value, list[int]]  # value -> the constraints it belongs to
    touched: list[int]  # touched[i]: the clock when a value of constraint i last changed
    # seen[direction][i]: the clock at constraint i's last visit in that direction (-1: never). Only a
    # backward visit of a late constraint (seen[2]) and a forward visit of a repeat's broadcast (seen[3]) differ
    # between the phases; the others are shared, so the late phase revisits them only if their values changed.
    seen: list[list[int]]
    clock: int = 0

    @classmethod
    def of(cls, cons: list[Constraint]) -> "Revisits":
        users: dict[Value, list[int]] = {}
        for i, c in enumerate(cons):
            for v in c.ins + c.outs:
                if isinstance(v, Value):
                    users.setdefault(v, []).append(i)
        return cls(users, [0] * len(cons), [[-1] * len(cons) for _ in range(4)])


def _run(state: Propagation, due: Revisits, i: int, c: Constraint, forward: bool, late: bool) -> bool:
    """Visit constraint i in this direction and phase if one of its values changed since its last visit."""
    last_seen = due.seen[2 if late and not forward and c.late else
                         3 if late and forward and c.late_forward else int(forward)]
    last = last_seen[i]
    if last >= 0 and due.touched[i] <= last:
        return False
    due.clock += 1
    last_seen[i] = due.clock
    changed = visit(state, c, forward, late)
    if changed:
        due.clock += 1
        for v in changed:
            for j in due.users[v]:
                due.touched[j] = due.clock
    return bool(changed)


def run_phases(state: Propagation, cons: list[Constraint], max_passes: int) -> None:
    """Forward and backward passes over the constraints to a fixed point, in three phases (Shardy's op
    priorities): first the user's shardings spread through elementwise ops in both directions, so a value next
    to an annotation takes it before a dot or reshape proposes another split; then every op; then broadcasts
    backward too (and a repeat's broadcast forward)."""
    due = Revisits.of(cons)
    everything = range(len(cons))
    elementwise = [i for i in everything if cons[i].rule.pointwise]
    for late, among in ((False, elementwise), (False, everything), (True, everything)):
        for _ in range(max_passes):
            changed = False
            for i in among:
                changed |= _run(state, due, i, cons[i], True, late)
            for i in reversed(among):
                changed |= _run(state, due, i, cons[i], False, late)
            if not changed:
                break


def _values(p: Program) -> Sequence[Value]:
    """Every value of p, its bodies' included."""
    out = list(p.invars) + [v for v, _ in p.consts]
    for e in p.eqns:
        out += e.outvars
        for sub in e.subs.values():
            out += _values(sub)
    return out


def finish(state: Propagation, program: Program) -> None:
    """Settle what propagation left open: origins formatted, values no split reached replicated, and every dim
    left whole that a neighbour would have split explained."""
    shardings, origins = state.shardings, state.origins
    for v, why in origins.items():
        if type(why) is tuple:  # noqa: E721
            forward, c = why
            origins[v] = f"{'forward' if forward else 'backward'} from {c.name} at {c.source or '?'}"
    for v in _values(program):
        if v not in shardings:
            shardings[v] = Sharding.replicated(len(v.shape))
            origins[v] = "replicated: no annotation or sharded neighbour reached it"
        whole = {d: why for d, why in state.blocked.get(v, {}).items() if not shardings[v].dims[d]}
        if whole:
            why = "; ".join(f"dim {d} whole: {w}" for d, w in sorted(whole.items()))
            origins[v] = f"replicated: {why}" if shardings[v].is_replicated else f"{origins[v]}; {why}"
