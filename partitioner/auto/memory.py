"""The memory rows of automatic sharding: the arguments' and outputs' bytes, and the temporaries alive at a
point of the step, each as a linear function of the nodes' options.

A temporary's bytes are those of its shard in the sharding its maker's option makes it (graph.values: an
op's result, or a merged op's, viewed), or the one its reader needs of it (graph.free: a value any device
makes). A value the graph does not choose (a while loop's body's, a result left to propagation) counts
whole, on every device. An operand a reader's option needs in a sharding its maker's option does not make
is a copy (`Copy`, what explain() counts from the lowering's reshards): one per value and sharding, made
for the first reader that needs it and kept until the last, as the lowering's reshard cache keeps it; a
loop's operand is read at the loop's entry, so its copy is alive through all of the loop's points. At a
point, a copy is a variable z in [0, 1], at least each reader's need there, and at least B + A - 1 with B
(A) at least the need of each reader before (after) the point: exact for 0/1 choices. Per point of the
program (liveness.py), the sum is a row the integer program keeps within the budget with the arguments and
outputs. Rows are added as they are violated (a cutting plane: solve, find the point of the choice's peak,
add its row if over the budget, solve again), starting from the peaks of the program with every value at
its largest and at its smallest shard.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from ..costs import liveness as LV
from ..costs.buffer_reuse import less_held
from ..costs.fusion import fusion_aware
from ..costs.lifetimes import Lifetimes, lifetimes
from ..representation.jax_compat import scan_counts
from ..representation.program import Eqn, Program, Value
from ..representation.sharding import Sharding
from .graph import Graph, _local_bytes, viewed


@dataclasses.dataclass
class Row:
    """Bytes per device as a linear function of the choice: const + sum of per_node[node][its option], and the
    copies that may be alive at its point."""
    per_node: dict  # node -> np.ndarray of bytes per option (its least moved into const)
    const: float
    copies: list = dataclasses.field(default_factory=list)  # Copy
    point: int = 0  # the program point the copies are alive at

    def at(self, picks) -> float:
        return self.const + sum(float(b[picks[i]]) for i, b in self.per_node.items()) + sum(
            c.bytes for c in self.copies if c.alive(self.point, picks))


@dataclasses.dataclass
class Reader:
    """An op that may read a copy: its node, which of its options need the copy, and its points."""
    node: int
    needs: np.ndarray  # per option of the node: whether it needs the value in the copy's sharding
    first: int
    last: int


@dataclasses.dataclass(eq=False)
class Copy:
    """A value in one sharding its maker's option may not make: made for the first reader that needs it and
    kept until the last (the lowering's reshard cache reuses it), so alive at a point where a reader at or
    before it and one at or after it need it and the maker makes it otherwise."""
    maker: int  # node
    made: np.ndarray  # per maker option: whether it makes the value in this sharding (no copy)
    bytes: float  # per device
    readers: list  # Reader
    value: Optional[Value] = None  # the value it copies
    what: str = ""  # the value, its sharding and its first reader, for messages

    def span(self) -> tuple[int, int]:
        return min(r.first for r in self.readers), max(r.last for r in self.readers)

    def held(self, picks) -> Optional[tuple[int, int]]:
        """The points it is alive at under a choice (first, last), or None where no copy is made."""
        need = [r for r in self.readers if r.needs[picks[r.node]]] if not self.made[picks[self.maker]] else []
        return (min(r.first for r in need), max(r.last for r in need)) if need else None

    def alive(self, point: int, picks) -> bool:
        held = self.held(picks)
        return held is not None and held[0] <= point <= held[1]


def row(terms: dict, const: float = 0.0, slack: float = 0.0) -> Row:
    """A row with each node's least bytes moved into its constant, and nodes whose options hold alike dropped.
    slack: bytes the row may overstate by: the nodes whose options differ least, up to that much in all, are
    counted at their largest (a constant: fewer variables for the solver, never under the truth)."""
    per_node, fixed, used = {}, set(), 0.0
    for spread, i in sorted((float(b.max() - b.min()), i) for i, b in terms.items()):
        if used + spread > slack:
            break
        used += spread
        fixed.add(i)
    for i, b in terms.items():
        least = float(b.max() if i in fixed else b.min())
        const += least
        if i not in fixed:
            per_node[i] = b - least
    return Row(per_node, const)


@dataclasses.dataclass
class Temporaries:
    """The step's temporaries over the graph's options."""
    lt: Lifetimes
    node: np.ndarray  # per temporary, the node whose option sets its bytes (-1: none does)
    sizes: list  # per temporary, its bytes per option of that node (one entry where none does)
    makers: list  # per temporary, the op that makes it (or what it is: XLA:CPU's own buffers)
    copies: list = dataclasses.field(default_factory=list)  # Copy: the operands' copies ops may make
    outputs: list = dataclasses.field(default_factory=list)  # (node, its bytes per option, the point it is made
    # at) per output not in a donated buffer: what it holds before (buffer_reuse.py)
    own: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, bool))  # per temporary: XLA:CPU's
    # own buffer (_xla_cpu), not a value of the program

    def at(self, picks) -> np.ndarray:
        """Per point, the bytes alive under a choice of one option per node, less what the outputs' buffers
        hold before the outputs are made (buffer_reuse.py)."""
        sizes = np.array([s[picks[i]] if i >= 0 else s[0] for i, s in zip(self.node, self.sizes)], float)
        copies = [(c.bytes, *held) for c in self.copies for held in [c.held(picks)] if held is not None]
        at = self.lt.bytes_at(sizes)
        items = list(zip(sizes, self.lt.start.tolist(), self.lt.end.tolist()))
        for n, a, b in copies:
            at[a: b + 1] += n
            items.append((n, a, b))
        return less_held(at, items, [(b[picks[j]], made) for j, b, made in self.outputs])[0]

    def bound(self, largest: bool) -> np.ndarray:
        """Per point, the bytes alive with every value at its largest (or smallest) shard (largest: and each
        value's largest copy over all its readers' points)."""
        pick = np.max if largest else np.min
        at = self.lt.bytes_at(np.array([pick(s) for s in self.sizes], float))
        if largest:
            widest: dict = {}
            for c in self.copies:
                key = id(c.value)
                a, b = c.span()
                if key not in widest or c.bytes > widest[key][0]:
                    widest[key] = (c.bytes, a, b)
            for n, a, b in widest.values():
                at[a: b + 1] += n
        return at

    def row(self, point: int, memory: list, slack: float = 0.0, strict: bool = False) -> Row:
        """The arguments' and outputs' bytes (memory: per node per option) and the temporaries alive at point
        (slack: as row()'s), the outputs made after it left out unless strict: their buffers hold temporaries
        until then (buffer_reuse.py; a row of all the arguments and outputs bounds the rest). Over as many
        bytes as the buffers are, never under: a point the choice is over at is solved again strict."""
        later = set() if strict else {j for j, _, made in self.outputs if made > point}
        terms = {i: m for i, m in enumerate(memory) if m.any() and i not in later}
        const = 0.0
        for k in self.lt.alive(point):
            i, s = int(self.node[k]), self.sizes[k]
            if i < 0:
                const += float(s[0])
            else:
                terms[i] = terms[i] + s if i in terms else s.astype(float)
        out = row(terms, const, slack)
        out.copies = [c for c in self.copies if c.span()[0] <= point <= c.span()[1]]
        out.point = point
        return out

    def alive(self, point: int, picks) -> list[tuple[float, str]]:
        """(bytes, what holds them) of each value and copy alive at point under a choice, largest first."""
        held = [(float(self.sizes[k][picks[self.node[k]]] if self.node[k] >= 0 else self.sizes[k][0]),
                 _result_of(self.makers[k])) for k in self.lt.alive(point)]
        held += [(c.bytes, c.what) for c in self.copies if c.alive(point, picks)]
        return sorted(held, key=lambda t: -t[0])

    def first_points(self) -> list[int]:
        """The points a budgeted solve starts from: the peaks with every value at its largest and smallest shard."""
        if not self.lt.ops:
            return []
        return list(dict.fromkeys(int(np.argmax(self.bound(b))) for b in (True, False)))


def _result_of(e) -> str:
    if isinstance(e, str):  # (XLA:CPU's own buffer, named as made)
        return e
    return f"the result of {e.name}" + (f" at {e.source}" if e.source else "")


def temporaries(g: Graph, program: Program, mesh_shape: dict, cpu: bool = False) -> Temporaries:
    """The temporaries of the program the graph was built from, over its nodes' options, as explain() counts
    them (fusion.fusion_aware: the values XLA fuses away left out, its sinks run early; and the outputs held
    as made until they leave; cpu: and XLA:CPU's copies of dot operands and shared broadcasts, `_xla_cpu`)."""
    fresh = {id(v): j for j, v, _, _ in g.outputs if g.nodes[j].value is None}  # (not in a donated buffer)
    lt = fusion_aware(program, lifetimes(program, {e: 0 for e in _prefetchable(program)}), set(fresh))
    made = {id(v): e for e in program.all_eqns() for v in e.outvars}
    node, sizes, makers = [], [], [made[id(v)] for v in lt.values]
    made_values = list(lt.values)
    for v in lt.values:
        i, per = _per_option(g, v, mesh_shape)
        node.append(i)
        sizes.append(per)
    copies = _copies(g, program, lt, mesh_shape)
    if cpu:  # (after the copies: their readers' points are the values')
        lt, extra = _xla_cpu(g, program, lt, mesh_shape)
        for i, per, e in extra:
            node.append(i)
            sizes.append(per)
            makers.append(e)
    outputs = [(fresh[id(o)], np.array([p.memory for p in g.nodes[fresh[id(o)]].options], float), at)
               for o, at in lt.fresh]
    own = np.arange(len(node)) >= len(made_values)
    return Temporaries(lt, np.array(node, int), sizes, makers, copies, outputs, own)


def _xla_cpu(g: Graph, program: Program, lt: Lifetimes, mesh_shape: dict) -> tuple[Lifetimes, list]:
    """lt with XLA:CPU's own buffers added as temporaries, each alive over its readers' points: a dot's
    operand it relays (liveness.relaid, on the local shapes the dot's option reads), and a shared broadcast
    at its reader's result's sharding (liveness.broadcast_copies); and per buffer (node, bytes per its
    option, what it is)."""
    need: dict = {}  # (id(reader), id(value)) -> (node, per option of it: the sharding it needs of the value)
    for edge in g.edges:
        if edge.reader is not None:
            per = _needs(g, edge)
            if None not in per:
                need.setdefault((id(edge.reader), id(edge.value)), (edge.dst, per))
    where = lambda e: f" at {e.source}" if e.source else ""  # noqa: E731
    extra, spans, starts = [], [], LV.from_start(program)
    for e in program.all_eqns():
        if e.name != "dot_general":
            continue
        reads = [need.get((id(e), id(x))) if isinstance(x, Value) else None for x in e.invars[:2]]
        for k, x in enumerate(e.invars[:2]):
            if not isinstance(x, Value):
                continue
            if reads[0] is not None and reads[1] is not None and reads[0][0] == reads[1][0]:  # per option of the dot
                i, sh = reads[0][0], list(zip(reads[0][1], reads[1][1]))
                per = np.array([_local_bytes(x, s[k], mesh_shape) if k in LV.relaid(e, [
                    s[j].local_shape(y.shape, mesh_shape) for j, y in enumerate(e.invars[:2])]) else 0.0
                    for s in sh], float)
            elif k in LV.relaid(e, [getattr(y, "shape", ()) for y in e.invars[:2]]):
                i, per = _per_option(g, x, mesh_shape)  # (as it is made: no option of the dot's reads it)
            else:
                continue
            if per.any():
                extra.append((i, per, f"an operand of {e.name}{where(e)}, relaid"))
                spans.append(lt.span([e] + ([program.eqns[0]] if starts(x) else [])))
    for c in LV.broadcast_copies(program, lambda e, x: 0):
        extra.append((*_per_option(g, c.readers[0].outvars[0], mesh_shape), f"a broadcast for {c.readers[0].name}"
                      f"{where(c.readers[0])}"))
        spans.append(lt.span(c.readers))
    lt = dataclasses.replace(lt, values=lt.values + [None] * len(extra),
                             start=np.concatenate([lt.start, np.array([a for a, _ in spans], int)]),
                             end=np.concatenate([lt.end, np.array([b for _, b in spans], int)]))
    return lt, extra


def _prefetchable(program: Program) -> list[Eqn]:
    """The scans whose stacked inputs the lowering may gather a trip ahead (prefetch.py): their peeled trip's
    recomputation is counted through the loop whatever the choice (over where the choice gathers none)."""
    from ..strategies import deferral as DF, prefetch as PF
    made_by = {id(v): e for e in program.all_eqns() for v in e.outvars}
    if not PF.ENABLED.get():
        return []
    out = []
    for e in program.all_eqns():
        if e.name == "scan" and e.params["length"] >= 2:
            nc, nk = scan_counts(e.params)
            if any(getattr(made_by.get(id(x)), "name", None) not in DF.LOOPS for x in e.invars[nc + nk:]):
                out.append(e)
    return out


def _copies(g: Graph, program: Program, lt: Lifetimes, mesh_shape: dict) -> list[Copy]:
    """A Copy per value and sharding some reader's option needs of it that its maker's options may not make.
    A scan's const is copied at the scan's entry (the lowering reads it there), so its readers in the body
    read the caller's value over all of the scan's points. A scan's stacked input gathered for its body is
    gathered a trip ahead where the lowering pipelines the loop (prefetch.py): the trip's slice and the next
    one's, held over all of the loop's points."""
    from ..strategies import prefetch as PF
    entry: dict = {}  # a scan body's const -> (the scan, the caller's value it stands for)
    stacked: dict = {}  # a prefetchable scan body's stacked input -> the scan
    prefetched = set(_prefetchable(program))
    for e in program.all_eqns():
        if e.name == "scan":
            nc, nk = scan_counts(e.params)
            entry.update((b, (e, x)) for b, x in zip(e.subs["body"].invars[:nc], e.invars[:nc]) if isinstance(x, Value))
            if e in prefetched:
                stacked.update((b, e) for b in e.subs["body"].invars[nc + nk:])
    groups: dict = {}
    for edge in g.edges:
        x, reader = edge.value, edge.reader
        if reader is None or reader not in lt.spans or not getattr(x.aval, "shape", None) or x not in g.values:
            continue
        first, last = lt.spans[reader]
        while x in entry:  # read at the loop's entry
            reader, x = entry[x]
            first, last = lt.spans[reader]
        ahead = x in stacked and stacked[x] in lt.spans
        if ahead:
            first, last = lt.spans[stacked[x]]
        if edge.at_end:
            first = last
        a, r, view = g.values[edge.value]
        if a == edge.dst:
            continue
        makes = [o.made[r] if r < len(o.made) else None for o in g.nodes[a].options]
        if any(m is None for m in makes):
            continue
        makes = [m if view is None else viewed(m, view) for m in makes]
        need = _needs(g, edge)
        for t in {n for n in need if n is not None}:
            done = np.array([m == t for m in makes], bool)
            if done.all():
                continue
            key = (id(x), t)
            if key not in groups:
                held = g.nodes[a].what if g.nodes[a].value is x else f"a value of {g.nodes[a].what}"
                n = float(_local_bytes(x, t, mesh_shape)) * (PF.AHEAD_LAYERS if ahead else 1)
                groups[key] = Copy(a, done, n, [], x,
                                   f"{held} resharded to {t} for {reader.name}" + (f" at {reader.source}"
                                                                                if reader.source else ""))
            groups[key].readers.append(Reader(edge.dst, np.array([n == t for n in need], bool), first, last))
    return list(groups.values()) + _exits(g, lt, mesh_shape)


def _needs(g: Graph, edge) -> list:
    """Per option of an edge's reader, the sharding it needs of the edge's value (None: none it states)."""
    if edge.operand < 0:
        return edge.needs
    return [o.need[edge.operand] if edge.operand < len(o.need) else None for o in g.nodes[edge.dst].options]


def _exits(g: Graph, lt: Lifetimes, mesh_shape: dict) -> list[Copy]:
    """An output that leaves in a sharding other than its maker's is held as made until it leaves (the made
    value is a temporary, the output another buffer): per sharding m a maker's option makes it in, a Copy
    alive where the maker makes m and the output leaves otherwise (its `maker` is the output's node, its
    reader the maker's; from the maker's op to the program's end)."""
    out = []
    end = len(lt.ops) - 1
    for j, v, k, _ in g.outputs:
        if v not in g.values or g.nodes[j].value is not None or end < 0:
            continue  # (an output in a donated argument's buffer leaves as the argument arrives)
        a, r, view = g.values[v]
        if a == j:
            continue
        makes = [o.made[r] if r < len(o.made) else None for o in g.nodes[a].options]
        if any(m is None for m in makes):
            continue
        makes = [m if view is None else viewed(m, view) for m in makes]
        leaves = [o.need[0] for o in g.nodes[j].options]
        eqn = g.nodes[a].eqn
        first = lt.spans[eqn][0] if eqn is not None and eqn in lt.spans else end
        for m in dict.fromkeys(makes):
            done = np.array([t == m for t in leaves], bool)
            if done.all():
                continue
            out.append(Copy(j, done, float(_local_bytes(v, m, mesh_shape)),
                            [Reader(a, np.array([x == m for x in makes], bool), first, end)], v,
                            f"output {k} as made in {m}, before it leaves resharded"))
    return out


def _per_option(g: Graph, v: Value, mesh_shape: dict) -> tuple[int, np.ndarray]:
    whole = np.array([_local_bytes(v, Sharding.replicated(len(v.shape)), mesh_shape)], float)
    if v in g.values:
        i, r, view = g.values[v]
        made = [o.made[r] if r < len(o.made) else None for o in g.nodes[i].options]
        if any(m is None for m in made):
            return -1, whole
        return i, np.array([_local_bytes(v, m if view is None else viewed(m, view), mesh_shape) for m in made], float)
    if v in g.free:
        i, k = g.free[v]
        need = k if not isinstance(k, int) else [o.need[k] if k < len(o.need) else None for o in g.nodes[i].options]
        if any(n is None for n in need):
            return -1, whole
        return i, np.array([_local_bytes(v, n, mesh_shape) for n in need], float)
    return -1, whole
