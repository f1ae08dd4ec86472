"""Automatic sharding: a sharding for every value nobody annotated, chosen to minimise the step's predicted time.

Alpa's intra-operator pass, on this partitioner's own pieces. Every top-level op with a factor rule gets
its *options*: each way of splitting its factors over the mesh axes (each factor whole or split over one or
more axes, no axis used twice), costed as the lowering costs it (`Strategy`): the op's own communication
(its hook's collectives, a split reduction's partial sum left for its consumers) and its local compute.
Each value's edge from its producer's option to a consumer's costs the reshard between what one makes and
what the other needs (a partial sum reduced there). An argument is a node of its own whose options are
its shardings (one, where in_shardings or a committed placement fixes it) and whose memory is its local
bytes. An output is a node too, whose options are the shardings it may leave in (its maker's partial sums
reduced on the way). An annotation, a manual region's specs, in_shardings and out_shardings are options of
one.

The choice is an integer program (auto/solve.py: `scipy.optimize.milp`, HiGHS) over this graph, made
smaller first by exact steps (ops merged into their operands' nodes, values made from scalars left to their
reader, chain nodes eliminated); every device's memory within the budget (auto/memory.py).
What is exact and what is not:
- exact: the optimum of this model of the program, under its costs;
- a model: a value read by several consumers pays each one's reshard (the lowering pays a repeated one
  once); the memory rows are auto/memory.py's;
- a scan's body is in the graph once, at trips times its cost (Builder._scan), and a checkpointed region's
  body is the caller's code; a while loop's and a branch's bodies are not chosen (propagation carries the
  choices into them, as it carries annotations), and their operands' edges cost nothing.

The choices enter the one engine as seeds (`passes.Traced.seeds`), as a planner's would: propagation and
the lowering then run unchanged, and explain() reports the program they make.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Mapping, Optional, Sequence

import numpy as np

from ..costs.cost import compute_time
from ..costs.liveness import nbytes
from ..propagation.strategy import Strategy
from ..representation import factors as F, program as P
from ..representation.jax_compat import scan_counts
from ..representation.program import Eqn, Program, Value
from ..representation.sharding import Sharding, splittable
from ..strategies import hooks as H, manual_regions as M, registry as REG
from ..strategies.control_flow import stacked


@dataclasses.dataclass(frozen=True)
class Option:
    """One way to run a node: the shardings it needs of its operands and makes of its results, and its cost."""
    need: tuple  # per operand: a Sharding, or None (an operand it takes as it comes, or not an array)
    made: tuple  # per result: a Sharding, or None (a result whose sharding propagation decides)
    seconds: float  # its own communication and compute
    memory: int = 0  # bytes per device it holds for the step (an argument's local bytes)
    label: str = ""
    fs: Optional[dict] = dataclasses.field(default=None, compare=False)  # an op's factor sharding


@dataclasses.dataclass
class Node:
    what: str  # "argument NAME", or the op and where it is
    options: list[Option]
    eqn: Optional[Eqn] = None
    value: Optional[Value] = None  # an argument's value
    loop: Optional[Eqn] = None  # a carry's, stacked input's or stacked output's node: its scan


@dataclasses.dataclass
class Edge:
    """A value from one node's result to another's operand, with the reshard time per pair of options."""
    value: Value
    src: int
    dst: int
    operand: int  # which operand of dst it is (-1: of an op merged into dst, needed as `needs` says)
    seconds: np.ndarray  # [options of src, options of dst]
    needs: Optional[list] = None  # operand -1: per option of dst, the sharding it needs of the value
    reader: Optional[Eqn] = None  # the op that reads it where a copy would be made (None: an output's exit)
    at_end: bool = False  # read at the reader's last point only (a loop's body's result, each trip)


@dataclasses.dataclass
class Graph:
    nodes: list[Node]
    edges: list[Edge]
    # (its output node, the value, its index among the outputs, whether its sharding is fixed); an output in a
    # donated argument's buffer has that argument's node, whose options need it as they make the argument
    outputs: list
    values: dict = dataclasses.field(default_factory=dict)  # value -> (its node, result, view: viewed's perm)
    free: dict = dataclasses.field(default_factory=dict)  # a value made anywhere -> its reader (node, operand
    # index, or per option of the node the sharding it needs)


def axis_tuples(mesh_shape: Mapping[str, int]) -> list[tuple[str, ...]]:
    """Every non-empty set of mesh axes (of size > 1), in mesh order: what a factor or dim may split over."""
    axes = [a for a, n in mesh_shape.items() if n > 1]
    return [c for k in range(1, len(axes) + 1) for c in itertools.combinations(axes, k)]


def tensor_shardings(shape: Sequence[int], mesh_shape: Mapping[str, int]) -> list[Sharding]:
    """Every sharding of a tensor: each mesh axis on one dim or none, dims split evenly or padded."""
    axes = [a for a, n in mesh_shape.items() if n > 1]
    out = []
    for where in itertools.product(range(len(shape) + 1), repeat=len(axes)):  # len(shape): not used
        dims = tuple(tuple(a for a, w in zip(axes, where) if w == d) for d in range(len(shape)))
        if all(splittable(n, math.prod(mesh_shape[a] for a in ax)) for n, ax in zip(shape, dims)):
            s = Sharding(dims).canonical(shape, mesh_shape)
            if s not in out:
                out.append(s)
    return out


# ops that make a value from scalars alone, on any device in any sharding (with the pointwise ops: Builder._free)
MADE_ANYWHERE = ("broadcast_in_dim", "iota", "reshape", "transpose", "convert_element_type", "squeeze",
                 "expand_dims")


def viewed(m: Sharding, perm: tuple) -> Sharding:
    """m with its partial sums reduced, its dims permuted (a merged transpose's result: dim i is m's perm[i])."""
    return Sharding(tuple(m.dims[p] for p in perm), frozenset(), frozenset(i for i, p in enumerate(perm)
                                                                             if p in m.padded))


def _local_bytes(v: Value, s: Sharding, mesh_shape) -> int:
    return nbytes(v, s.local_shape(v.shape, mesh_shape))


class Builder:
    """The graph of a program's top-level values and ops on a mesh, costed on a profile."""

    def __init__(self, program: Program, seeds: Mapping[Value, tuple[Sharding, str]], mesh_shape: dict,
                 mesh_axes: tuple, profile, names: Mapping[Value, str], out_fixed: Mapping[int, Sharding] = {},
                 out_names: Mapping[int, str] = {}, ties: Mapping[int, int] = {}):
        self.program, self.seeds, self.names = program, seeds, names
        self.out_fixed, self.out_names = out_fixed, out_names  # outputs by index: out_shardings', their names
        self.ties = ties  # output index -> the input (flat index) whose donated buffer it reuses
        self.mesh_shape = dict(mesh_shape)
        self.strategy = Strategy(None, self.mesh_shape, mesh_axes, profile, collective_matmul="off")
        self.profile = profile
        self.tuples = axis_tuples(self.mesh_shape)
        self.costs: dict = {}  # (made, need, shape, dtype) -> an edge's reshard seconds: a layer's repeat
        self.uses = P.uses(program)  # how often each value is read, bodies included
        self.reduced: set = set()  # (node, result) whose partial sums a follower's reduction is charged to

    def build(self) -> Graph:
        nodes, makers, arg_node = [], {}, {}
        canon = lambda s, v: s.canonical(v.shape, self.mesh_shape)
        # a donated argument whose output out_shardings fixes arrives as that output leaves: its buffer is reused
        given_by_output = {j: canon(self.out_fixed[k], self.program.outvars[k])
                           for k, j in self.ties.items() if k in self.out_fixed}
        for j, v in enumerate(self.program.invars):
            if not isinstance(v, Value):
                continue
            fixed = self.seeds.get(v)
            choices = [canon(fixed[0], v)] if fixed else [given_by_output[j]] if j in given_by_output else \
                tensor_shardings(v.shape, self.mesh_shape)
            name = self.names.get(v, f"argument {len(nodes)}")
            nodes.append(Node(name, [Option((), (s,), 0.0, _local_bytes(v, s, self.mesh_shape), str(s))
                                     for s in choices], value=v))
            makers[v] = arg_node[j] = (len(nodes) - 1, 0, None)
        edges: list[Edge] = []
        free: dict = {}  # values any device makes in any sharding from scalars alone, read once -> their reader
        self._ops(self.program.eqns, nodes, edges, makers, free, 1.0)
        outputs = []
        for k, v in enumerate(self.program.outvars):  # an output leaves in a sharding of its own, or as fixed
            if isinstance(v, Value) and v in makers:
                fixed = self.out_fixed.get(k)
                a, r, view = makers[v]
                maker = nodes[a].eqn if view is None else None
                if fixed is None and maker is not None and getattr(REG.op_for(maker.name), "annotation", False):
                    fixed = nodes[a].options[0].made[r]  # the user annotated the value it returns: kept
                j = arg_node[self.ties[k]][0] if self.ties.get(k) in arg_node else None
                if j is not None and fixed is None and len(nodes[j].options) == 1:
                    fixed = nodes[j].options[0].made[0]  # in a given argument's buffer: it leaves as that arrives
                choices = [canon(fixed, v)] if fixed is not None else tensor_shardings(v.shape, self.mesh_shape)
                if j is not None and [o.made[0] for o in nodes[j].options] == choices:
                    # in a donated argument's buffer: the argument's node, which it leaves as it arrives
                    nodes[j].options = [dataclasses.replace(o, need=o.made) for o in nodes[j].options]
                else:
                    nodes.append(Node(f"output {self.out_names.get(k, k)}", [
                        Option((s,), (), 0.0, _local_bytes(v, s, self.mesh_shape), str(s)) for s in choices]))
                    j = len(nodes) - 1
                outputs.append((j, v, k, fixed is not None))
                self._link(nodes, edges, makers[v], (j, 0), v, 1.0)
        return Graph(nodes, edges, outputs, makers, {v: r for v, r in free.items() if r is not None})

    def _ops(self, eqns: Sequence[Eqn], nodes: list, edges: list, makers: dict, free: dict, scale: float) -> None:
        """The nodes and edges of a program's ops, each run `scale` times a step (a scan body's trips)."""
        for e in eqns:
            if e.name == "remat2":  # a checkpointed region: its body reads and makes the caller's values
                self._ops(e.subs["body"].eqns, nodes, edges, makers, free, scale)
                continue
            if e.name == "scan":
                self._scan(e, nodes, edges, makers, free, scale)
                continue
            anywhere = self._free(e, free, makers)
            if anywhere and all(self.uses.get(v, 0) <= 1 for v in e.outvars):
                free.update((v, None) for v in e.outvars)
                continue
            lead = None if anywhere else self._follows(e, makers, free)
            if lead is not None:
                makers[e.outvars[0]] = self._follow(nodes, edges, makers, lead, e, free, scale)
                continue
            # made anywhere but read more than once: a node whose options are its shardings, at no cost
            options = [Option((None,) * len(e.invars), (s,), 0.0, label=str(s))
                       for s in tensor_shardings(e.outvars[0].shape, self.mesh_shape)] \
                if anywhere and len(e.outvars) == 1 else self._options(e, scale)
            nodes.append(Node(f"{e.name} at {e.source}", options, eqn=e))
            i = len(nodes) - 1
            for k, x in enumerate(e.invars):
                if isinstance(x, Value) and x in free:
                    free[x] = (i, k)
                if isinstance(x, Value) and x in makers:  # scalars too: a partial sum is reduced on the way
                    self._link(nodes, edges, makers[x], (i, k), x, scale, reader=e)
            for r, v in enumerate(e.outvars):
                makers[v] = (i, r, None)

    def _scan(self, e: Eqn, nodes: list, edges: list, makers: dict, free: dict, scale: float) -> None:
        """A scan's body, once, its ops and edges at trips times their cost; a node per carry (its sharding in
        the loop: the initial value comes to it, and each trip's result), per stacked input and per stacked
        output (a slice's sharding, the scan dim whole). The caller's consts are read as they are made."""
        body, trips = e.subs["body"], e.params["length"]
        nc, nk = scan_counts(e.params)

        def loop_node(what: str, v: Value, stacked_in: bool, stacked_out: bool) -> int:
            nodes.append(Node(f"{what} of the scan at {e.source}", [
                Option((stacked(s) if stacked_in else s,), (stacked(s) if stacked_out else s,), 0.0, label=str(s))
                for s in tensor_shardings(v.shape, self.mesh_shape)], loop=e))
            return len(nodes) - 1

        for x, b in zip(e.invars[:nc], body.invars[:nc]):
            if isinstance(x, Value) and x in makers:
                makers[b] = makers[x]
            elif isinstance(x, Value) and x in free and self.uses.get(b, 0) <= 1:
                free[b] = None
            elif isinstance(x, Value) and x in free:  # made anywhere, read more than once: a node of no cost
                nodes.append(Node(f"a const of the scan at {e.source}", [
                    Option((None,), (s,), 0.0, label=str(s)) for s in tensor_shardings(b.shape, self.mesh_shape)]))
                makers[b] = (len(nodes) - 1, 0, None)
        carries = []
        for j, (x, b) in enumerate(zip(e.invars[nc:], body.invars[nc:])):
            i = loop_node("carry" if j < nk else "stacked input", b, j >= nk, False)
            if isinstance(x, Value) and x in makers:
                self._link(nodes, edges, makers[x], (i, 0), x, scale, reader=e)
            makers[b] = (i, 0, None)
            carries += [i] if j < nk else []
        self._ops(body.eqns, nodes, edges, makers, free, scale * trips)
        for k, (y, out) in enumerate(zip(body.outvars, e.outvars)):
            if k < nk:
                makers[out] = (carries[k], 0, None)  # the loop's carry, whatever each trip's result is
            if not (isinstance(y, Value) and y in makers):
                continue
            i = carries[k] if k < nk else loop_node("stacked output", y, False, True)
            self._link(nodes, edges, makers[y], (i, 0), y, scale * trips, reader=e, at_end=True)
            makers[out] = (i, 0, None)

    def _link(self, nodes: list, edges: list, src: tuple, dst: tuple, x: Value, scale: float,
              reader: Optional[Eqn] = None, at_end: bool = False) -> None:
        edge = self._edge(nodes, src, dst, x, scale)
        if edge is not None:
            edges.append(dataclasses.replace(edge, reader=reader, at_end=at_end))

    def _free(self, e: Eqn, free: dict, makers: dict) -> bool:
        """Whether e's results are made from scalars alone (an iota, a broadcast of a scalar, and what such
        values make pointwise, reshaped or transposed): any device makes its part in any sharding, with no
        communication, so they are not nodes and their readers' edges cost nothing."""
        op = REG.op_for(e.name)
        if e.subs or op is None or op.annotation or op.manual or not e.outvars:
            return False
        # a scalar a node makes may be a partial sum, whose reduction its reader's edge must charge
        if not all(not isinstance(x, Value) or x in free or (not len(x.shape) and x not in makers)
                   for x in e.invars):
            return False
        rule = REG.rule_for(e)
        return e.name in MADE_ANYWHERE or (rule is not None and rule.pointwise)

    def _follows(self, e: Eqn, makers: dict, free: dict) -> Optional[Value]:
        """The operand an elementwise op or a transpose follows, or None. Such an op runs in its operand's
        sharding (an elementwise op whose other operands are made from scalars, or by the same node), so it
        is merged into that operand's maker, as Alpa and XLA's auto-sharding merge them."""
        op = REG.op_for(e.name)
        if e.subs or len(e.outvars) != 1 or self.seeds.get(e.outvars[0]) or op is None or op.annotation:
            return None
        if e.name == "transpose":
            x = e.invars[0]
            return x if isinstance(x, Value) and x in makers else None
        rule = REG.rule_for(e)
        if rule is None or not rule.pointwise:
            return None
        shape = tuple(e.outvars[0].shape)
        big = [x for x in e.invars if isinstance(x, Value) and len(x.shape)]
        if any(tuple(x.shape) != shape or (x not in makers and x not in free) for x in big):
            return None
        made = [x for x in big if x in makers]
        if len({makers[x][0] for x in made}) != 1:  # operands of two nodes: an op of its own, choosing between them
            return None
        return made[0]

    def _follow(self, nodes: list, edges: list, makers: dict, lead: Value, e: Eqn, free: dict,
                scale: float) -> tuple:
        """e's result as its lead operand's maker makes it (partial sums reduced first: charged to the maker's
        option once; a transpose's dims permuted), with e's compute on each option's local shard added to it.
        An elementwise op's other operands come to the lead's sharding: edges into the lead's node."""
        a, r, view = makers[lead]
        v = e.outvars[0]
        charged = []
        for o in nodes[a].options:
            m = o.made[r]
            extra = 0.0
            if m is not None:
                whole = Sharding(m.dims, frozenset(), m.padded)
                if m.partial and (a, r) not in self.reduced:
                    extra += self.strategy.reshard_time(m, whole, lead.shape, lead.aval.dtype)
                extra += compute_time(math.prod(whole.local_shape(v.shape, self.mesh_shape)), self.profile)
            charged.append(dataclasses.replace(o, seconds=o.seconds + extra * scale))
        nodes[a].options = charged
        self.reduced.add((a, r))
        perm = tuple(range(len(v.shape))) if view is None else view
        if e.name == "transpose":
            return a, r, tuple(perm[p] for p in e.params["permutation"])
        need = [None if m is None else viewed(m, perm) for m in (o.made[r] for o in nodes[a].options)]
        for x in e.invars:  # the other operands, resharded to the lead's
            if isinstance(x, Value) and x in free and len(x.shape):  # (a scalar is one as it is)
                free[x] = (a, need)
            if isinstance(x, Value) and len(x.shape) and x is not lead and x in makers:
                edge = self._edge(nodes, makers[x], (a, need), x, scale)
                if edge is None:
                    continue
                edge.reader = e
                if edge.src == a:  # both from one node: a cost on its options
                    nodes[a].options = [dataclasses.replace(o, seconds=o.seconds + edge.seconds[t, t])
                                        for t, o in enumerate(nodes[a].options)]
                else:
                    edges.append(edge)
        return a, r, perm

    def _edge(self, nodes: list, src: tuple, dst: tuple, x: Value, scale: float = 1.0) -> Optional[Edge]:
        """The edge of value x from its maker (node, result, view) to a reader: (node, operand index), or
        (node, what each of its options needs of x) for an elementwise op merged into that node."""
        (a, r, view), (b, k) = src, dst
        made = [o.made[r] for o in nodes[a].options]
        if view is not None:  # a merged op's result: its maker's sharding with the sums reduced, permuted
            made = [None if m is None else viewed(m, view) for m in made]
        need = [o.need[k] if k < len(o.need) else None for o in nodes[b].options] if isinstance(k, int) else k
        if all(m is None for m in made) or all(n is None for n in need):
            return None
        key = (tuple(made), tuple(need), tuple(x.shape), x.aval.dtype)
        cost = self.costs.get(key)
        if cost is None:
            cost = self.costs[key] = np.zeros((len(made), len(need)))
            for s, m in enumerate(made):
                for t, n in enumerate(need):
                    if m is not None and n is not None:
                        cost[s, t] = self.strategy.reshard_time(m, n, x.shape, x.aval.dtype)
        cost = cost * scale
        return Edge(x, a, b, k, cost) if isinstance(k, int) else Edge(x, a, b, -1, cost, list(k))

    def _options(self, e: Eqn, scale: float = 1.0) -> list[Option]:
        """The ways to run e: every factor sharding its rule allows; one for an annotation or manual region;
        one that takes its operands as they come and leaves its results to propagation otherwise."""
        op = REG.op_for(e.name)
        if op is not None and op.annotation and not e.params.get("open"):
            s = e.params["sharding"].canonical(e.outvars[0].shape, self.mesh_shape)
            return [Option((s,) + (None,) * (len(e.invars) - 1), (s,), 0.0, label=f"annotated {s}")]
        if op is not None and op.manual:
            ins, outs = M.specs(e)
            return [Option(tuple(s.canonical(x.shape, self.mesh_shape) if isinstance(x, Value) else None
                                 for x, s in zip(e.invars, ins)),
                           tuple(s.canonical(v.shape, self.mesh_shape) for v, s in zip(e.outvars, outs)), 0.0,
                           label="manual region's specs")]
        rule = REG.rule_for(e) if not e.subs else None
        if rule is None:
            return [Option((None,) * len(e.invars), (None,) * len(e.outvars), 0.0, label="as propagated")]
        proposals = [{f: ax} for f in rule.factors for ax in self.tuples]
        out = []
        for fs in F.candidate_factor_shardings(rule, proposals, self.mesh_shape):
            layout = self.strategy._layout(rule, fs)
            if layout is None:
                continue
            need, made = layout
            hook = REG.collectives(H.OpContext(e, rule, fs, made, self.mesh_shape, need, profile=self.profile))
            seconds = (sum(c.time(self.profile) for c in hook) + self.strategy._compute(rule, fs)) * scale
            need = tuple(n if isinstance(x, Value) else None for x, n in zip(e.invars, need))
            label = f"{' '.join(str(n) for n in need if n is not None)} -> {' '.join(map(str, made))}"
            out.append(Option(need, tuple(made), seconds, label=label, fs=fs))
        best: dict = {}  # options that need and make the same: the cheapest stands for them
        for o in out:
            if (o.need, o.made) not in best or o.seconds < best[o.need, o.made].seconds:
                best[o.need, o.made] = o
        return list(best.values())
