"""partition(auto=True): the automatic sharding's choice (auto/graph.py, auto/solve.py) as seeds for the one
engine, and the lines explain() adds about it: per argument and largest activation the sharding chosen,
the runner-up and what it would cost, and the memory against the budget."""
from __future__ import annotations

import collections
import dataclasses
import math
import numbers
import time
from typing import Mapping, Optional, Sequence

import numpy as np

from ..costs import compilers
from ..costs.cost import _fmt_bytes
from ..representation.program import Program, Value
from ..representation.sharding import Sharding
from . import search as auto_search
from .graph import Builder, Graph, viewed
from .memory import Temporaries, temporaries
from .solve import Infeasible, Solution, Unsolved, memory_of, solve

EXPLAINED_ARGUMENTS = 6  # the largest arguments explain() names with their runner-up (each a solve of its own)
EXPLAINED_ACTIVATIONS = 3  # and the largest values the ops make
BUDGETED_SECONDS = 120.0  # the time a choice under a memory budget may take; past it, the best found is taken
# (a search's leanest start, its answer of last resort, may take this much again: auto/search.py)
RUNNER_UP_SECONDS = 2.0  # the least each runner-up's solve may take
RUNNER_UP_SHARE = 0.25  # and its most, as a share of the choice's own (under a budget, a runner-up's proof is slow)


@dataclasses.dataclass(frozen=True)
class Auto:
    """What partition(auto=True, memory_budget=...) asks of the choice."""
    # bytes per device the arguments, the outputs and the temporaries alive at any point may hold (None: no limit)
    memory_budget: Optional[float] = None
    donate_argnums: tuple = ()  # donated positional arguments: an output reusing one's buffer leaves as it arrives

    def __post_init__(self):
        b = self.memory_budget
        if b is not None and (isinstance(b, bool) or not isinstance(b, numbers.Real) or not b > 0):
            raise ValueError(f"memory_budget={b!r}: expected a positive number of bytes per device, or None")


def choose(program: Program, seeds: Mapping[Value, tuple[Sharding, str]], mesh_shape: dict, mesh_axes: tuple,
           profile, names: Mapping[Value, str], auto: Auto, why: bool = True, out_fixed: Mapping[int, Sharding] = {},
           out_names: Mapping[int, str] = {}, ties: Mapping[int, int] = {}) -> tuple[dict, dict, dict, list[str]]:
    """(seeds for every value the choice decides and nothing fixed, each op's factor sharding chosen (for the
    lowering to take), the sharding each output not fixed leaves in (by index), explain()'s lines about it;
    with why, the runner-ups too, each a solve of its own). out_fixed: the outputs out_shardings fixes; ties:
    output index -> the input (flat index) whose donated buffer it reuses (donated_outputs)."""
    start = time.perf_counter()
    g = Builder(program, seeds, mesh_shape, mesh_axes, profile, names, out_fixed, out_names, ties).build()
    temps = temporaries(g, program, mesh_shape, compilers.of(profile.platform).relays_operands)
    limit = BUDGETED_SECONDS if auto.memory_budget is not None else None
    try:
        try:
            sol = auto_search.choose(g, mesh_shape, auto.memory_budget, temps, time_limit=limit)
        except Infeasible:
            if auto.memory_budget is None:
                raise
            # the rows may overstate a point by SLACK of the budget (fewer variables): a choice within the budget
            # they miss is found with them exact, so "no sharding fits" is said only where none does
            sol = auto_search.choose(g, mesh_shape, auto.memory_budget, temps, time_limit=limit, slack=0.0)
    except Unsolved as e:
        raise ValueError(f"memory_budget={auto.memory_budget:.0f} bytes per device: no sharding within it was "
                         f"found in {limit:.0f} s ({e}); raise the budget, or annotate the largest values") from None
    except Infeasible as e:
        if auto.memory_budget is None:
            raise RuntimeError(f"the automatic sharding found no sharding that runs this program ({e}); annotate "
                               f"the values around it, or partition without auto=True") from None
        raise ValueError(_over_budget(g, temps, mesh_shape, auto.memory_budget)) from None
    chosen: dict = {}
    pinned = {n.eqn: n.options[p].fs for n, p in zip(g.nodes, sol.picks) if n.eqn is not None and n.options[p].fs}
    readers = collections.defaultdict(list)  # (node, value) -> the edges that read it
    for e in g.edges:
        readers[e.src, e.value].append(e)
    for v, (i, r, view) in g.values.items():  # every value a node makes, or an op merged into it
        made = g.nodes[i].options[sol.picks[i]].made[r]
        if v in seeds or made is None:
            continue
        loop = g.nodes[i].loop
        if view is None and (g.nodes[i].value is not None or loop is not None and v in loop.subs["body"].invars):
            # an argument as it arrives; a loop's carry or slice as the loop holds it (planned as its readers in
            # the body need it, a stacked input would be resharded whole at the loop's entry, not a slice a trip)
            chosen[v] = (made, "automatic sharding")
            continue
        target = _target(g, sol, readers[i, v], made if view is None else viewed(made, view))
        if target is not None:
            chosen[v] = (target, "automatic sharding")
    for v, (i, k) in g.free.items():  # a value made anywhere: as its one reader needs it
        pick = sol.picks[i]
        need = k[pick] if not isinstance(k, int) else g.nodes[i].options[pick].need[k] \
            if k < len(g.nodes[i].options[pick].need) else None
        if v not in seeds and need is not None:
            chosen[v] = (need, "automatic sharding")
    leaving = {k: g.nodes[node].options[sol.picks[node]].need[0] for node, v, k, fixed in g.outputs if not fixed}
    took = time.perf_counter() - start
    lines = [f"automatic sharding: {len(g.nodes)} nodes, {len(g.edges)} edges, "
             f"{sum(len(n.options) for n in g.nodes)} options; solved in {took:.2f} s; predicted "
             f"{sol.seconds * 1e3:.3f} ms of the step's communication and compute; arguments and outputs "
             f"{_fmt_bytes(sol.memory)} and temporaries at their peak {_fmt_bytes(sol.temporaries)} per device"
             + (f" against a budget of {_fmt_bytes(auto.memory_budget)}" if auto.memory_budget else "")
             + ("" if sol.proven else f" (the best found in {limit:.0f} s, not proven the cheapest)")]
    if why:
        lines += _why(g, temps, sol, mesh_shape, auto, time_limit=max(RUNNER_UP_SECONDS, took * RUNNER_UP_SHARE))
    return chosen, pinned, leaving, lines


def donated_outputs(program: Program, donated: Sequence[int]) -> dict[int, int]:
    """{output index: input index} for the outputs that reuse a donated input's buffer, paired as jax.jit
    pairs them: each output, in order, takes the first donated input of its shape and dtype not yet taken."""
    free = collections.defaultdict(collections.deque)
    for j in donated:
        v = program.invars[j]
        free[tuple(v.shape), str(v.aval.dtype)].append(j)
    out = {}
    for k, v in enumerate(program.outvars):  # a constant output takes its donated buffer too (jax.jit's pairing)
        key = (tuple(v.shape), str(v.aval.dtype))
        if free[key]:
            j = free[key].popleft()
            if isinstance(v, Value):
                out[k] = j
    return out


def _target(g: Graph, sol: Solution, readers: list, made: Optional[Sharding]) -> Optional[Sharding]:
    """The sharding a result is planned in: what its readers all need, else as made (its sums reduced)."""
    if made is None:
        return None
    needs = {e.needs[sol.picks[e.dst]] if e.needs is not None
             else g.nodes[e.dst].options[sol.picks[e.dst]].need[e.operand] for e in readers}
    needs.discard(None)
    if len(needs) == 1:
        return needs.pop()
    return Sharding(made.dims, frozenset(), made.padded)


def _why(g: Graph, temps: Temporaries, sol: Solution, mesh_shape: dict, auto: Auto,
         time_limit: float) -> list[str]:
    """The choice for the largest arguments and activations, each against its runner-up (the best choice
    without it, found within time_limit seconds)."""
    def size(v: Value) -> int:
        return math.prod(v.shape) * v.aval.dtype.itemsize

    args = sorted((i for i, n in enumerate(g.nodes) if n.value is not None and len(n.options) > 1),
                  key=lambda i: -size(g.nodes[i].value))[:EXPLAINED_ARGUMENTS]
    made = sorted((i for i, n in enumerate(g.nodes) if n.eqn is not None and len(n.options) > 1
                   and n.eqn.outvars and isinstance(n.eqn.outvars[0], Value)),
                  key=lambda i: -size(g.nodes[i].eqn.outvars[0]))[:EXPLAINED_ACTIVATIONS]
    lines, window = [], auto_search.searched(g, auto.memory_budget, temps)  # a runner-up is a window's
    for i in args + made:
        node, pick = g.nodes[i], sol.picks[i]
        what = node.what if node.value is not None else f"the result of {node.what}"
        try:
            other = auto_search.choose(g, mesh_shape, auto.memory_budget, temps, time_limit, exclude=[(i, pick)],
                                       points=sol.points, near=sol)
        except Infeasible:
            lines.append(f"{what}: {node.options[pick].label}; every other choice is over the budget" + (
                " (of those in a window around it, the rest held)" if window else ""))
            continue
        except Unsolved:
            lines.append(f"{what}: {node.options[pick].label}; no other choice found in {time_limit:.1f} s")
            continue
        lines.append(f"{what}: {node.options[pick].label}; runner-up {node.options[other.picks[i]].label}, "
                     f"{(other.seconds - sol.seconds) * 1e3:+.3f} ms a step"
                     + (" (the best in a window around it, the rest held)" if window
                        else "" if other.proven else f" (the best found in {time_limit:.1f} s)"))
    return lines


def _over_budget(g: Graph, temps: Temporaries, mesh_shape: dict, budget: float) -> str:
    """The message for a budget no choice meets: the least memory found (the arguments, outputs and temporaries
    at the peak), and the values holding most of it."""
    try:  # raises Infeasible where no option is left
        least = solve(g, mesh_shape, objective="memory", temps=temps, time_limit=BUDGETED_SECONDS)
    except Unsolved:
        return (f"memory_budget={budget:.0f} bytes per device: no sharding of this program fits it, and the least "
                f"memory was not found in {BUDGETED_SECONDS:.0f} s. Raise the budget, use a mesh with more "
                f"devices, or keep less state (a smaller model or batch)")
    memory = memory_of(g)
    held = [(memory[i][p], g.nodes[i].what) for i, p in enumerate(least.picks) if memory[i][p]]
    at = temps.at(least.picks)
    if len(at):
        point = int(np.argmax(at))
        held += temps.alive(point, least.picks)
    holders = ", ".join(f"{what} ({_fmt_bytes(b)})" for b, what in sorted(held, key=lambda t: -t[0])[:4])
    temporaries = "" if not least.temporaries else \
        f" ({_fmt_bytes(least.memory)} of arguments and outputs, {_fmt_bytes(least.temporaries)} of temporaries)"
    return (f"memory_budget={budget:.0f} bytes per device: no sharding of this program fits it; the smallest "
            f"found holds {_fmt_bytes(least.memory + (least.temporaries or 0))} per device{temporaries}, most of "
            f"it in {holders}. Raise the budget, use a mesh with more devices, or keep less state (a smaller model "
            f"or batch)")
