"""The integer program of automatic sharding (auto_graph.py's Graph), solved by scipy.optimize.milp (HiGHS).

Variables: x[n, s] in {0, 1}, node n runs option s, one per node; y[e, s, t] in [0, 1] per edge e and pair of
options of its two nodes, with sum_t y[e, s, t] = x[src, s] and sum_s y[e, s, t] = x[dst, t] (the joint of two
0/1 choices is their product: exact). Minimised: the options' seconds plus the edges' reshard seconds. The
arguments' and outputs' bytes per device stay within a budget when one is given.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np
from scipy import sparse
from scipy.optimize import Bounds, LinearConstraint, milp

from .auto_graph import Graph


@dataclasses.dataclass
class Solution:
    picks: list[int]  # per node, its option
    seconds: float  # the objective: predicted seconds of the step under the model
    memory: int  # the arguments' and outputs' bytes per device


class Infeasible(Exception):
    """No choice fits the budget."""


def memory_of(g: Graph) -> list[np.ndarray]:
    """Per node, per option: bytes per device held for the step (an argument's, an output's)."""
    return [np.array([o.memory for o in n.options], float) for n in g.nodes]


def solve(g: Graph, mesh_shape: dict, budget: Optional[float] = None, exclude: Sequence[tuple[int, int]] = (),
          objective: str = "time") -> Solution:
    """The cheapest choice of one option per node (exclude: (node, option) pairs forbidden). objective="memory":
    the least memory instead (what a budget no choice meets is measured against)."""
    offsets, n = [], 0
    for node in g.nodes:
        offsets.append(n)
        n += len(node.options)
    edge_at, m = [], n
    for e in g.edges:
        edge_at.append(m)
        m += e.seconds.size
    memory = memory_of(g)
    c = np.zeros(m)
    if objective == "time":
        for node, at in zip(g.nodes, offsets):
            c[at: at + len(node.options)] = [o.seconds for o in node.options]
        for e, at in zip(g.edges, edge_at):
            c[at: at + e.seconds.size] = e.seconds.ravel()
    else:
        for at, mem in zip(offsets, memory):
            c[at: at + len(mem)] = mem
    rows, cols, vals, lo, hi = [], [], [], [], []
    r = 0
    for node, at in zip(g.nodes, offsets):  # one option per node
        k = len(node.options)
        rows += [r] * k
        cols += list(range(at, at + k))
        vals += [1.0] * k
        lo.append(1.0)
        hi.append(1.0)
        r += 1
    for e, at in zip(g.edges, edge_at):  # each edge's joint has the two nodes' choices as marginals
        ns, nt = e.seconds.shape
        for s in range(ns):
            rows += [r] * (nt + 1)
            cols += [at + s * nt + t for t in range(nt)] + [offsets[e.src] + s]
            vals += [1.0] * nt + [-1.0]
            lo.append(0.0)
            hi.append(0.0)
            r += 1
        for t in range(nt):
            rows += [r] * (ns + 1)
            cols += [at + s * nt + t for s in range(ns)] + [offsets[e.dst] + t]
            vals += [1.0] * ns + [-1.0]
            lo.append(0.0)
            hi.append(0.0)
            r += 1
    if budget is not None and objective == "time":
        for at, mem in zip(offsets, memory):
            rows += [r] * len(mem)
            cols += list(range(at, at + len(mem)))
            vals += list(mem)
        lo.append(-np.inf)
        hi.append(float(budget))
        r += 1
    a = sparse.csr_array((vals, (rows, cols)), shape=(r, m))
    upper = np.ones(m)
    for node, s in exclude:
        upper[offsets[node] + s] = 0.0
    integrality = np.zeros(m)
    integrality[:n] = 1
    res = milp(c, integrality=integrality, bounds=Bounds(np.zeros(m), upper),
               constraints=LinearConstraint(a, np.array(lo), np.array(hi)), options={"mip_rel_gap": 1e-9})
    if res.status == 2 or res.x is None:  # infeasible
        raise Infeasible(res.message)
    if not res.success:
        raise RuntimeError(f"the automatic sharding's integer program was not solved: {res.message}")
    picks = [int(np.argmax(res.x[at: at + len(node.options)])) for node, at in zip(g.nodes, offsets)]
    held = int(sum(mem[p] for mem, p in zip(memory, picks)))
    seconds = float(sum(node.options[p].seconds for node, p in zip(g.nodes, picks))
                    + sum(e.seconds[picks[e.src], picks[e.dst]] for e in g.edges))
    return Solution(picks, seconds, held)
