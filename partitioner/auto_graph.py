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

The choice is an integer program (`scipy.optimize.milp`, HiGHS): one binary per node and option, summing
to 1; per edge a joint variable per pair of options whose marginals are the two nodes' (Alpa's
formulation: exact for 0/1 choices); the arguments' and outputs' bytes per device within the memory budget.
What is exact and what is not:
- exact: the optimum of this model of the program, under its costs;
- a model: a value read by several consumers pays each one's reshard (the lowering pays a repeated one
  once); temporaries are not in the memory constraint (arguments and outputs are);
- not chosen: the bodies of loops, branches and checkpointed regions (propagation carries the choices
  into them, as it carries annotations); their operands' edges cost nothing.

The choices enter the one engine as seeds (`passes.Traced.seeds`), as a planner's would: propagation and
the lowering then run unchanged, and explain() reports the program they make.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Mapping, Optional, Sequence

import numpy as np

from . import factors as F, hooks as H, manual_regions as M, registry as REG
from .cost import compute_time
from .program import Eqn, Program, Value
from .sharding import Sharding, splittable
from .strategy import Strategy


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


@dataclasses.dataclass
class Edge:
    """A value from one node's result to another's operand, with the reshard time per pair of options."""
    value: Value
    src: int
    dst: int
    operand: int  # which operand of dst it is
    seconds: np.ndarray  # [options of src, options of dst]


@dataclasses.dataclass
class Graph:
    nodes: list[Node]
    edges: list[Edge]
    outputs: list  # (its output node, the value, its index among the outputs, whether its sharding is fixed)


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


def _local_bytes(v: Value, s: Sharding, mesh_shape) -> int:
    return math.prod(s.local_shape(v.shape, mesh_shape)) * v.aval.dtype.itemsize


class Builder:
    """The graph of a program's top-level values and ops on a mesh, costed on a profile."""

    def __init__(self, program: Program, seeds: Mapping[Value, tuple[Sharding, str]], mesh_shape: dict,
                 mesh_axes: tuple, profile, names: Mapping[Value, str], out_fixed: Mapping[int, Sharding] = {},
                 out_names: Mapping[int, str] = {}):
        self.program, self.seeds, self.names = program, seeds, names
        self.out_fixed, self.out_names = out_fixed, out_names  # outputs by index: out_shardings', their names
        self.mesh_shape = dict(mesh_shape)
        self.strategy = Strategy(None, self.mesh_shape, mesh_axes, profile, collective_matmul="off")
        self.profile = profile
        self.tuples = axis_tuples(self.mesh_shape)

    def build(self) -> Graph:
        nodes, makers = [], {}
        for v in self.program.invars:
            if not isinstance(v, Value):
                continue
            fixed = self.seeds.get(v)
            choices = [fixed[0]] if fixed else tensor_shardings(v.shape, self.mesh_shape)
            name = self.names.get(v, f"argument {len(nodes)}")
            nodes.append(Node(name, [Option((), (s,), 0.0, _local_bytes(v, s, self.mesh_shape), str(s))
                                     for s in choices], value=v))
            makers[v] = (len(nodes) - 1, 0, False)
        edges: list[Edge] = []
        reduced: set = set()  # (node, result) whose partial sums a follower's reduction is charged to
        for e in self.program.eqns:
            lead = self._follows(e, makers)
            if lead is not None:
                makers[e.outvars[0]] = self._follow(nodes, makers[lead], e, reduced)
                continue
            node = Node(f"{e.name} at {e.source}", self._options(e), eqn=e)
            nodes.append(node)
            i = len(nodes) - 1
            for k, x in enumerate(e.invars):
                if isinstance(x, Value) and x in makers and len(x.shape):
                    edge = self._edge(nodes, makers[x], (i, k), x)
                    if edge is not None:
                        edges.append(edge)
            for r, v in enumerate(e.outvars):
                makers[v] = (i, r, False)
        outputs = []
        for k, v in enumerate(self.program.outvars):  # an output leaves in a sharding of its own, or as fixed
            if isinstance(v, Value) and v in makers:
                fixed = self.out_fixed.get(k)
                a, r, _ = makers[v]
                maker = nodes[a].eqn
                if fixed is None and maker is not None and getattr(REG.op_for(maker.name), "annotation", False):
                    fixed = nodes[a].options[0].made[r]  # the user annotated the value it returns: kept
                choices = [fixed] if fixed is not None else tensor_shardings(v.shape, self.mesh_shape)
                nodes.append(Node(f"output {self.out_names.get(k, k)}",
                                  [Option((s,), (), 0.0, _local_bytes(v, s, self.mesh_shape), str(s))
                                   for s in choices]))
                outputs.append((len(nodes) - 1, v, k, fixed is not None))
                edge = self._edge(nodes, makers[v], (len(nodes) - 1, 0), v)
                if edge is not None:
                    edges.append(edge)
        return Graph(nodes, edges, outputs)

    def _follows(self, e: Eqn, makers: dict) -> Optional[Value]:
        """The one operand an elementwise op follows (the others scalars or constants), or None: such an op
        runs in its operand's sharding, so it is merged into that operand's maker, as Alpa merges them."""
        op = REG.op_for(e.name)
        if e.subs or len(e.outvars) != 1 or self.seeds.get(e.outvars[0]) or op is None or op.annotation:
            return None
        rule = REG.rule_for(e)
        if rule is None or not rule.pointwise:
            return None
        big = [x for x in e.invars if isinstance(x, Value) and len(x.shape)]
        if len(big) != 1 or tuple(big[0].shape) != tuple(e.outvars[0].shape) or big[0] not in makers:
            return None
        if any(isinstance(x, Value) and not len(x.shape) and x not in makers for x in e.invars):
            return None
        return big[0]

    def _follow(self, nodes: list, maker: tuple, e: Eqn, reduced: set) -> tuple:
        """e's result as its operand's maker makes it (partial sums reduced first: charged to the maker's
        option once), with e's compute on each option's local shard added to it."""
        a, r, _ = maker
        v = e.outvars[0]
        charged = []
        for o in nodes[a].options:
            m = o.made[r]
            extra = 0.0
            if m is not None:
                whole = Sharding(m.dims, frozenset(), m.padded)
                if m.partial and (a, r) not in reduced:
                    operand = next(x for x in e.invars if isinstance(x, Value) and len(x.shape))
                    extra += self.strategy.reshard_time(m, whole, v.shape, operand.aval.dtype)
                extra += compute_time(math.prod(whole.local_shape(v.shape, self.mesh_shape)), self.profile)
            charged.append(dataclasses.replace(o, seconds=o.seconds + extra))
        nodes[a].options = charged
        reduced.add((a, r))
        return a, r, True

    def _edge(self, nodes: list, src: tuple, dst: tuple, x: Value) -> Optional[Edge]:
        (a, r, follower), (b, k) = src, dst
        made = [o.made[r] for o in nodes[a].options]
        if follower:  # a merged elementwise op's result: its maker's sharding with the sums reduced
            made = [None if m is None else Sharding(m.dims, frozenset(), m.padded) for m in made]
        need = [o.need[k] if k < len(o.need) else None for o in nodes[b].options]
        if all(m is None for m in made) or all(n is None for n in need):
            return None
        cost = np.zeros((len(made), len(need)))
        for s, m in enumerate(made):
            for t, n in enumerate(need):
                if m is not None and n is not None:
                    cost[s, t] = self.strategy.reshard_time(m, n, x.shape, x.aval.dtype)
        return Edge(x, a, b, k, cost)

    def _options(self, e: Eqn) -> list[Option]:
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
            seconds = sum(c.time(self.profile) for c in hook) + self.strategy._compute(rule, fs)
            need = tuple(n if isinstance(x, Value) and len(x.shape) else None for x, n in zip(e.invars, need))
            label = f"{' '.join(str(n) for n in need if n is not None)} -> {' '.join(map(str, made))}"
            out.append(Option(need, tuple(made), seconds, label=label, fs=fs))
        best: dict = {}  # options that need and make the same: the cheapest stands for them
        for o in out:
            if (o.need, o.made) not in best or o.seconds < best[o.need, o.made].seconds:
                best[o.need, o.made] = o
        return list(best.values())
