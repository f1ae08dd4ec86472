"""A choice under a memory budget on a graph too large for one integer program within its time limit, found
by neighbourhood search (large neighbourhood search: each step exact on a part of the graph, the rest held).

The budget's rows couple every node they hold, so elimination leaves most of an unrolled train step's graph
and the relaxation turns fractional: its integer program (tens of thousands of options) does not get past
its root relaxation within minutes. Instead:
- start: every node restricted to its leanest options (the fewest bytes of the arguments, outputs and
  temporaries its option sets) and its whole ones (the most), solved exactly under the budget in
  START_SHARE of the time; if that finds nothing, the leanest alone, given at least the whole time limit
  whatever the first took (the answer of last resort, on a loaded machine too);
- then windows: a run of consecutive nodes (the program's order) of WINDOW_OPTIONS options, with the
  argument nodes its ops read, gets all its options back, every other node keeps its pick, and the window
  is solved exactly under the budget; a cheaper choice is kept. Each window starts halfway through the
  last; after a pass that gains less than MIP_GAP, windows double. A whole-graph window is the exact program.
The result is the best choice found by the time limit; it is proven the cheapest only by a whole-graph
window solved to its gap. A runner-up on such a graph is a window around its node (breadth first), the
rest of the choice held.
"""
from __future__ import annotations

import collections
import time
from typing import Optional, Sequence

import numpy as np

from .graph import Graph
from .memory import Temporaries
from .solve import MIP_GAP, SLACK, Infeasible, Solution, Unsolved, memory_of, solve

EXACT_OPTIONS = 5_000  # a budgeted graph with more options than this is searched by windows, not solved whole
WINDOW_OPTIONS = 5_000  # the options a window frees at first (doubling after a pass that gains nothing)
START_SHARE = 0.5  # the share of the time limit the start (leanest or whole options) may take


def choose(g: Graph, mesh_shape: dict, budget: Optional[float], temps: Optional[Temporaries],
           time_limit: Optional[float], exclude: Sequence[tuple[int, int]] = (), points: Sequence[int] = (),
           near: Optional[Solution] = None, slack: float = SLACK) -> Solution:
    """The cheapest choice within the budget: solve()'s exact program where the graph is small enough or has
    no budget, else the neighbourhood search. near: for a runner-up on a searched graph, the choice it is
    measured from (a window around the excluded nodes, the rest of near held). slack: solve()'s."""
    if not searched(g, budget, temps):
        return solve(g, mesh_shape, budget, exclude=exclude, time_limit=time_limit, temps=temps, points=points,
                     slack=slack)
    deadline = None if time_limit is None else time.perf_counter() + time_limit
    if near is not None:
        window = _window(g, _neighbours(g), [i for i, _ in exclude], WINDOW_OPTIONS)
        return _within(g, mesh_shape, budget, temps, near.picks, window, exclude, points, deadline, slack)
    return search(g, mesh_shape, budget, temps, deadline, exclude, points, slack,
                  floor=time_limit)


def searched(g: Graph, budget: Optional[float], temps: Optional[Temporaries]) -> bool:
    """Whether choose() searches the graph rather than solving it whole."""
    return budget is not None and temps is not None and sum(len(n.options) for n in g.nodes) > EXACT_OPTIONS


def search(g: Graph, mesh_shape: dict, budget: float, temps: Temporaries, deadline: Optional[float],
           exclude: Sequence[tuple[int, int]] = (), points: Sequence[int] = (), slack: float = SLACK,
           floor: Optional[float] = None) -> Solution:
    """The neighbourhood search (the module docstring): the best choice found by the deadline (floor: the
    seconds the leanest start gets at least)."""
    for pool, share, least in ((_ends(g, temps, whole=True), START_SHARE, 0.0),
                               (_ends(g, temps, whole=False), 1.0, floor or 0.0)):
        try:
            best = solve(g, mesh_shape, budget, exclude=[*exclude, *((i, s) for i, keep in enumerate(pool)
                                                                    for s in np.flatnonzero(~keep))],
                         time_limit=None if deadline is None else max(_left(deadline) * share, least),
                         temps=temps, points=points, slack=slack)
            break
        except Unsolved:  # none found in its share of the time: the leanest options alone, a smaller program
            continue
    else:
        raise Unsolved("no choice within the budget was found among the leanest options")
    best.proven = False
    near = _neighbours(g)
    size = WINDOW_OPTIONS
    while deadline is None or time.perf_counter() < deadline:
        gained = False
        for window in _windows(g, near, size):
            if deadline is not None and time.perf_counter() >= deadline:
                break
            try:
                sol = _within(g, mesh_shape, budget, temps, best.picks, window, exclude, best.points, deadline,
                              slack)
            except (Unsolved, Infeasible):
                continue
            gained = gained or sol.seconds < best.seconds * (1 - MIP_GAP)  # else a pass stays at this size
            if sol.seconds < best.seconds:
                best = sol
            best.points = sol.points
            if len(window) == len(g.nodes) and sol.proven:  # the whole program, solved: the optimum
                best.proven = True
                return best
        if not gained:
            size *= 2
    return best


def _windows(g: Graph, near: list, size: int):
    """Windows covering the graph: runs of consecutive nodes (the program's order) of about size options, each
    half over the last, with the arguments their ops read."""
    n = len(g.nodes)
    options = np.cumsum([len(node.options) for node in g.nodes])
    lo = 0
    while lo < n:
        hi = min(int(np.searchsorted(options, options[lo] - len(g.nodes[lo].options) + size)) + 1, n)
        run = range(lo, hi)
        args = {j for i in run for j in near[i] if g.nodes[j].value is not None}
        yield np.array(sorted(set(run) | args), int)
        if hi >= n:
            return
        lo = max(lo + 1, (lo + hi) // 2)


def _within(g: Graph, mesh_shape: dict, budget: float, temps: Temporaries, picks: list, window: np.ndarray,
            exclude: Sequence[tuple[int, int]], points: Sequence[int], deadline: Optional[float],
            slack: float = SLACK) -> Solution:
    """The best choice with the window's nodes free and every other node at its pick."""
    free = np.zeros(len(g.nodes), bool)
    free[window] = True
    held = [(i, s) for i, n in enumerate(g.nodes) if not free[i] for s in range(len(n.options)) if s != picks[i]]
    sol = solve(g, mesh_shape, budget, exclude=[*exclude, *held], time_limit=_left(deadline), temps=temps,
                points=points, slack=slack)
    sol.proven = sol.proven and bool(free.all())
    return sol


def _ends(g: Graph, temps: Temporaries, whole: bool) -> list[np.ndarray]:
    """Per node, which options hold its fewest bytes (its arguments', outputs' and temporaries', XLA:CPU's own
    buffers aside: a dot's relaid operand is as much its operands' choice), and with whole its most: the
    leanest choice, and the whole values a small model's cheapest choice holds."""
    held = memory_of(g)
    for i, sizes, own in zip(temps.node, temps.sizes, temps.own):
        if i >= 0 and not own:
            held[i] = held[i] + sizes
    return [(b <= b.min() * (1 + 1e-9)) | (whole & (b >= b.max() * (1 - 1e-9))) for b in held]


def _neighbours(g: Graph) -> list[list[int]]:
    near = collections.defaultdict(set)
    for e in g.edges:
        if e.src != e.dst:
            near[e.src].add(e.dst)
            near[e.dst].add(e.src)
    return [sorted(near[i]) for i in range(len(g.nodes))]


def _window(g: Graph, near: list, seeds: Sequence[int], size: int) -> np.ndarray:
    """The nodes reached breadth first from the seeds until their options reach size."""
    taken, queue = dict.fromkeys(seeds), collections.deque(seeds)
    options = sum(len(g.nodes[i].options) for i in seeds)
    while queue and options < size:
        for j in near[queue.popleft()]:
            if j not in taken and options < size:
                taken[j] = None
                queue.append(j)
                options += len(g.nodes[j].options)
    return np.array(list(taken), int)


def _left(deadline: Optional[float]) -> Optional[float]:
    return None if deadline is None else max(deadline - time.perf_counter(), 0.1)
