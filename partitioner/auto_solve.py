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

from .auto_graph import Edge, Graph

MIP_GAP = 1e-3  # HiGHS stops within 0.1% of the optimum's bound: a choice at most that far from the best


@dataclasses.dataclass
class Solution:
    picks: list[int]  # per node, its option
    seconds: float  # the objective: predicted seconds of the step under the model
    memory: int  # the arguments' and outputs' bytes per device
    proven: bool = True  # within MIP_GAP of the optimum (False: the best found within a time limit)


class Infeasible(Exception):
    """No choice fits the budget."""


class Unsolved(Exception):
    """No choice found within the time limit."""


def memory_of(g: Graph) -> list[np.ndarray]:
    """Per node, per option: bytes per device held for the step (an argument's, an output's)."""
    return [np.array([o.memory for o in n.options], float) for n in g.nodes]


def _presolved(g: Graph) -> tuple[list[np.ndarray], list[Edge]]:
    """(per node its options' seconds, the edges left): an edge from or to a node of one option is a cost on
    the other node's options, edges between the same two nodes are one (their costs summed), and an edge
    that costs nothing is none."""
    unary = [np.array([o.seconds for o in node.options], float) for node in g.nodes]
    joined: dict = {}
    for e in g.edges:
        ns, nt = e.seconds.shape
        if ns == 1:
            unary[e.dst] += e.seconds[0]
        elif nt == 1:
            unary[e.src] += e.seconds[:, 0]
        elif (e.src, e.dst) in joined:
            joined[e.src, e.dst].seconds = joined[e.src, e.dst].seconds + e.seconds
        else:
            joined[e.src, e.dst] = dataclasses.replace(e)
    return unary, [e for e in joined.values() if e.seconds.any()]


def solve(g: Graph, mesh_shape: dict, budget: Optional[float] = None, exclude: Sequence[tuple[int, int]] = (),
          objective: str = "time", time_limit: Optional[float] = None) -> Solution:
    """The cheapest choice of one option per node (exclude: (node, option) pairs forbidden). objective="memory":
    the least memory instead (what a budget no choice meets is measured against). time_limit: seconds the
    solver may take; past them the best choice found is returned, marked not proven."""
    offsets, n = [], 0
    for node in g.nodes:
        offsets.append(n)
        n += len(node.options)
    unary, edges = _presolved(g)
    edge_at, m = [], n
    for e in edges:
        edge_at.append(m)
        m += e.seconds.size
    memory = memory_of(g)
    c = np.zeros(m)
    if objective == "time":
        for u, at in zip(unary, offsets):
            c[at: at + len(u)] = u * 1e6  # in microseconds
        for e, at in zip(edges, edge_at):
            c[at: at + e.seconds.size] = e.seconds.ravel() * 1e6
        c[np.abs(c) < 1e-6] = 0.0  # below a picosecond: noise to the solver
    else:
        for at, mem in zip(offsets, memory):
            c[at: at + len(mem)] = mem / 2**20  # in MiB
    rows, cols, vals, lo, hi = [], [], [], [], []

    def row(at: list, coef: list, low: float, high: float) -> None:
        """One constraint: low <= sum coef * x[at] <= high."""
        rows.extend([len(lo)] * len(at))
        cols.extend(at)
        vals.extend(coef)
        lo.append(low)
        hi.append(high)

    for node, at in zip(g.nodes, offsets):  # one option per node
        row(list(range(at, at + len(node.options))), [1.0] * len(node.options), 1.0, 1.0)
    for e, at in zip(edges, edge_at):  # each edge's joint has the two nodes' choices as marginals
        ns, nt = e.seconds.shape
        for s in range(ns):
            row([at + s * nt + t for t in range(nt)] + [offsets[e.src] + s], [1.0] * nt + [-1.0], 0.0, 0.0)
        for t in range(nt):
            row([at + s * nt + t for s in range(ns)] + [offsets[e.dst] + t], [1.0] * ns + [-1.0], 0.0, 0.0)
    if budget is not None and objective == "time":  # the memory row, in budgets so it reads <= 1
        row([at + k for at, mem in zip(offsets, memory) for k in range(len(mem))],
            [b / budget for mem in memory for b in mem], -np.inf, 1.0)
    a = sparse.csr_array((vals, (rows, cols)), shape=(len(lo), m))
    upper = np.ones(m)
    for node, s in exclude:
        upper[offsets[node] + s] = 0.0
    integrality = np.zeros(m)
    integrality[:n] = 1
    options = {"mip_rel_gap": MIP_GAP, **({"time_limit": time_limit} if time_limit else {})}
    res = milp(c, integrality=integrality, bounds=Bounds(np.zeros(m), upper),
               constraints=LinearConstraint(a, np.array(lo), np.array(hi)), options=options)
    if res.x is None and res.status == 1:
        raise Unsolved(res.message)
    if res.status == 2 or res.x is None:
        raise Infeasible(res.message)
    if not res.success and res.status != 1:  # 1: the time limit, with a choice found
        raise RuntimeError(f"the automatic sharding's integer program was not solved: {res.message}")
    picks = [int(np.argmax(res.x[at: at + len(node.options)])) for node, at in zip(g.nodes, offsets)]
    held = int(sum(mem[p] for mem, p in zip(memory, picks)))
    seconds = float(sum(node.options[p].seconds for node, p in zip(g.nodes, picks))
                    + sum(e.seconds[picks[e.src], picks[e.dst]] for e in g.edges))
    return Solution(picks, seconds, held, proven=res.status == 0)
