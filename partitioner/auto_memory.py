"""The memory rows of automatic sharding: the arguments' and outputs' bytes, and the temporaries alive at a
point of the step, each as a linear function of the nodes' options.

A temporary's bytes are those of its shard in the sharding its maker's option makes it (graph.values: an
op's result, or a merged op's, viewed), or the one its reader needs of it (graph.free: a value any device
makes). A value the graph does not choose (a while loop's body's, a result left to propagation) counts
whole, on every device. At an op's point, an operand its option needs in another sharding than its maker's
option makes is a copy (what explain() counts from the lowering's reshards): a variable of its own, at
least the copy's bytes where the two options differ (exact for 0/1 choices). Per point of the program
(liveness.py), the sum is a row the integer program keeps within the budget with the arguments and
outputs. Rows are added as they are violated (a cutting plane: solve, find the point of the choice's peak,
add its row if over the budget, solve again), starting from the peaks of the program with every value at
its largest and at its smallest shard.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from .auto_graph import Graph, _local_bytes, viewed
from .liveness import Lifetimes, lifetimes
from .program import Eqn, Program, Value
from .sharding import Sharding


@dataclasses.dataclass
class Row:
    """Bytes per device as a linear function of the choice: const + sum of per_node[node][its option]."""
    per_node: dict  # node -> np.ndarray of bytes per option (its least moved into const)
    const: float
    copies: list = dataclasses.field(default_factory=list)  # Copy terms: an operand resharded at the point

    def at(self, picks) -> float:
        return self.const + sum(float(b[picks[i]]) for i, b in self.per_node.items()) + sum(
            c.at(picks) for c in self.copies)


@dataclasses.dataclass
class Copy:
    """An operand copied into the sharding its reader's option needs, unless its maker's option makes it so:
    need[t] bytes where the reader runs option t and its maker an option s with not same[s, t]."""
    maker: int  # node
    reader: int  # node
    same: np.ndarray  # [maker's options, reader's options]: whether the value comes as needed
    need: np.ndarray  # per reader option, the bytes of the copy

    def at(self, picks) -> float:
        s, t = picks[self.maker], picks[self.reader]
        return 0.0 if self.same[s, t] else float(self.need[t])


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
    makers: list  # per temporary, the op that makes it
    copies: dict = dataclasses.field(default_factory=dict)  # point -> [Copy]: the op's operands it may reshard

    def at(self, picks) -> np.ndarray:
        """Per point, the bytes alive under a choice of one option per node."""
        at = self.lt.bytes_at(np.array([s[picks[i]] if i >= 0 else s[0] for i, s in zip(self.node, self.sizes)],
                                       float))
        for p, cs in self.copies.items():
            at[p] += sum(c.at(picks) for c in cs)
        return at

    def bound(self, largest: bool) -> np.ndarray:
        """Per point, the bytes alive with every value at its largest (or smallest) shard."""
        pick = np.max if largest else np.min
        at = self.lt.bytes_at(np.array([pick(s) for s in self.sizes], float))
        if largest:
            for p, cs in self.copies.items():
                at[p] += sum(c.need.max() for c in cs)
        return at

    def row(self, point: int, memory: list, slack: float = 0.0) -> Row:
        """The arguments' and outputs' bytes (memory: per node per option) and the temporaries alive at point
        (slack: as row()'s)."""
        terms = {i: m for i, m in enumerate(memory) if m.any()}
        const = 0.0
        for k in self.lt.alive(point):
            i, s = int(self.node[k]), self.sizes[k]
            if i < 0:
                const += float(s[0])
            else:
                terms[i] = terms[i] + s if i in terms else s.astype(float)
        out = row(terms, const, slack)
        out.copies = list(self.copies.get(point, ()))
        return out

    def alive(self, point: int, picks) -> list[tuple[float, Eqn]]:
        """(bytes, the op making it) of each value alive at point under a choice, largest first."""
        return sorted(((float(self.sizes[k][picks[self.node[k]]] if self.node[k] >= 0 else self.sizes[k][0]),
                        self.makers[k]) for k in self.lt.alive(point)), key=lambda t: -t[0])

    def first_points(self) -> list[int]:
        """The points a budgeted solve starts from: the peaks with every value at its largest and smallest shard."""
        if not self.lt.ops:
            return []
        return list(dict.fromkeys(int(np.argmax(self.bound(b))) for b in (True, False)))


def temporaries(g: Graph, program: Program, mesh_shape: dict) -> Temporaries:
    """The temporaries of the program the graph was built from, over its nodes' options."""
    lt = lifetimes(program)
    made = {id(v): e for e in program.all_eqns() for v in e.outvars}
    node, sizes = [], []
    for v in lt.values:
        i, per = _per_option(g, v, mesh_shape)
        node.append(i)
        sizes.append(per)
    at = {op: p for p, op in enumerate(lt.ops)}
    copies: dict = {}
    for i, n in enumerate(g.nodes):
        if n.eqn is None or n.eqn not in at:
            continue
        for k, x in enumerate(n.eqn.invars):
            if not (isinstance(x, Value) and x in g.values and getattr(x.aval, "shape", None)):
                continue
            a, r, view = g.values[x]
            makes = [o.made[r] if r < len(o.made) else None for o in g.nodes[a].options]
            need = [o.need[k] if k < len(o.need) else None for o in n.options]
            if a == i or any(m is None for m in makes) or all(m is None for m in need):
                continue
            makes = [m if view is None else viewed(m, view) for m in makes]
            same = np.array([[m == t or t is None for t in need] for m in makes], bool)
            size = np.array([0.0 if t is None else _local_bytes(x, t, mesh_shape) for t in need], float)
            if not same.all():
                copies.setdefault(at[n.eqn], []).append(Copy(a, i, same, size))
    return Temporaries(lt, np.array(node, int), sizes, [made[id(v)] for v in lt.values], copies)


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
