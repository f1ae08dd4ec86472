"""Reductions deferred past loops: an accumulator carried unreduced, reduced once after the loop.

A loop that sums per-iteration partial results into its carry (gradient accumulation over microbatches, a
pipeline's weight gradients over ticks, a scanned layer stack's weight gradients) would otherwise reduce the
summand on every trip: a weight gradient of a data-split batch arrives as a partial sum over ``data``, and
resharding it to the carry's planned sharding is an all-reduce (or reduce-scatter) per trip. A sum is linear,
so the carry may hold the partial sums instead: each device adds its own summand, and the reduction runs
once, where the loop's result is resharded to its plan. This is XLA's while-loop all-reduce code motion, made
where the partitioner decides its collectives.

This module finds the pattern in a loop body, as data: carry k is an *accumulator* when the body reads it
once, in an ``add`` (or a scatter-add into it) whose result is the body's k-th carry out, and whose other
operand reaches it through a *chain* of single-use values made by ops that preserve a partial sum (a dtype
convert, an annotation, a negation, a transpose, a reshape or broadcast that drops or adds dims of size 1, a
mask (``where(p, g, 0)``), a scatter-add into zeros, sums of such). The chain's *leaves* are whatever makes
the summand (a dot_general's transpose, a scatter-add, an inner loop's accumulator or stacked per-trip partial
sums). The lowering (partial_sums.py, control_flow.py) predicts the leaves' partial sums, carries the accumulator
partial over them, keeps the chain partial on local shards, and lets the loop's result reduce on its way to
the plan. A leaf that arrives otherwise is reduced as before and enters the sum on one device of the group
(masked), so the program is right whatever arrives.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections import Counter
from typing import Optional, Sequence

from ..representation.program import Eqn, Program, Value
from ..representation.sharding import Sharding

ENABLED = contextvars.ContextVar("deferred_reductions", default=True)


@contextlib.contextmanager
def switched_off(flag: contextvars.ContextVar):
    """`flag` False inside the block: a lowering strategy left out, for benchmarks and tests to compare."""
    token = flag.set(False)
    try:
        yield
    finally:
        flag.reset(token)


def disabled():
    """Reduce every summand where it is made, as without this module (benchmarks compare the two)."""
    return switched_off(ENABLED)


@dataclasses.dataclass(frozen=True)
class Loose:
    """A chain value kept partial over `partial` in whatever dims its op makes (below a scatter-add, whose
    dims do not map one to one): its ops run through their own rules, on partial operands."""
    partial: frozenset


def _is_value(x) -> bool:
    """A program Value (not a Const, which holds `val`)."""
    return not hasattr(x, "val")

SUMS = ("add", "add_any", "sub")  # an accumulating add, or a chain node that sums partial summands
# Ops whose result is a partial sum, with the same dims, when their operand is one.
LINEAR = ("convert_element_type", "sharding_annotation", "neg", "copy", "copy_p", "reduce_precision")
# a transpose too (dims permuted), and a reshape or broadcast that drops or inserts dims of size 1
LOOPS = ("scan", "while")  # control-flow forms whose stacked or carried results may be partial sums
# Chain ops whose dims do not map one to one: run through their own rules on the partial sums (Loose)
THROUGH_RULES = ("scatter-add",)
CHAIN_OPS = SUMS + LINEAR + ("transpose", "reshape", "broadcast_in_dim", "select_n") + THROUGH_RULES


@dataclasses.dataclass(frozen=True)
class Accumulator:
    """Carry k of a loop body: the add that accumulates it, the summand's chain values and its leaves."""
    k: int
    add: "Eqn"
    # single-use values between the leaves and the add (leaves included), each with the accumulator's dim
    # that each of its dims is (a transpose permutes them)
    chain: tuple[tuple["Value", tuple[int, ...]], ...]
    leaves: tuple["Value", ...]  # the values whose producers make the summand (partial sums, as predicted)
    producers: tuple["Eqn", ...]  # each leaf's equation


REGIONS = ("remat2",)  # checkpointed regions: aliased values (program.py), walked as if inlined


def _flat(eqns) -> list:
    """The equations with checkpointed regions' bodies in their place: a region's values are the caller's, so a
    summand made inside one (a weight gradient under remat) chains to the accumulator outside it."""
    out = []
    for e in eqns:
        out += _flat(e.subs["body"].eqns) if e.name in REGIONS else [e]
    return out


def _uses(body: "Program") -> tuple[Counter, dict]:
    """How many times each value is read in the body (its results count once), and the equation making it."""
    uses: Counter = Counter()
    producer: dict = {}
    for e in _flat(body.eqns):
        for x in e.invars:
            if _is_value(x):
                uses[x] += 1
        for v in e.outvars:
            producer[v] = e
    for v in body.outvars:
        if _is_value(v):
            uses[v] += 1
    return uses, producer


def accumulators(body: "Program", carry_in: Sequence["Value"], carry_out: Sequence) -> list[Accumulator]:
    """The accumulating carries of a loop body (carry_in[k] -> carry_out[k] through one add)."""
    uses, producer = _uses(body)
    out = []
    for k, (cin, cout) in enumerate(zip(carry_in, carry_out)):
        add = producer.get(cout) if _is_value(cout) else None
        if add is None or uses[cin] != 1 or uses[cout] != 1:
            continue
        if add.name in RELAYOUTS or add.name == "scatter-add":
            scattered = _scattered(cin, cout, uses, producer)  # acc.at[i].add(g), maybe transposed around
            if scattered is not None:
                out.append(dataclasses.replace(scattered, k=k))
            continue
        if add.name not in ("add", "add_any"):
            continue
        others = [x for x in add.invars if x is not cin]
        if len(others) != 1 or cin not in add.invars or not _is_value(others[0]):
            continue
        chain: list = []
        leaves: list = []
        _walk(others[0], tuple(range(len(cout.shape))), uses, producer, chain, leaves)
        if leaves:
            out.append(Accumulator(k, add, tuple(chain), tuple(leaves), tuple(producer[v] for v in leaves)))
    return out


RELAYOUTS = ("transpose", "reshape", "convert_element_type", "copy")  # one operand, every element kept


def _scattered(cin, cout, uses: Counter, producer: dict) -> Optional[Accumulator]:
    """cout = f(scatter-add(g(cin), i, u)) with f, g chains of RELAYOUTS: linear in the carry and the updates
    together; the relaid values run through their own rules (Loose)."""
    relaid, v = [], cout
    while producer[v].name in RELAYOUTS and _is_value(producer[v].invars[0]):
        v = producer[v].invars[0]
        if uses[v] != 1:
            return None
        relaid.append((v, None))
    add = producer[v]
    if add.name != "scatter-add" or not _is_value(add.invars[0]) or not _is_value(add.invars[2]):
        return None
    x = add.invars[0]
    while x is not cin:
        e = producer.get(x)
        if e is None or e.name not in RELAYOUTS or uses[x] != 1 or not _is_value(e.invars[0]):
            return None
        relaid.append((x, None))
        x = e.invars[0]
    chain: list = []
    leaves: list = []
    _walk(add.invars[2], None, uses, producer, chain, leaves)
    if not leaves:
        return None
    return Accumulator(-1, add, tuple(relaid + chain), tuple(leaves), tuple(producer[v] for v in leaves))


def summand(body: "Program", y: "Value") -> Optional[Accumulator]:
    """A loop's per-trip result y (a scan's stacked output) as a chain of partial sums, when it is one: an outer
    loop that accumulates the stacked result may then carry it unreduced (k and add unset)."""
    uses, producer = _uses(body)
    chain: list = []
    leaves: list = []
    if _is_value(y):
        _walk(y, tuple(range(len(y.shape))), uses, producer, chain, leaves)
    return Accumulator(-1, None, tuple(chain), tuple(leaves), tuple(producer[v] for v in leaves)) if leaves else None


def sum_trees(body: "Program") -> list[Accumulator]:
    """The sums of several partial sums in a body (dX = dQ Wq' + dK Wk' + dV Wv' of a tensor-parallel attention's
    backward): each add whose operands chain to two or more leaves, not itself a chain value of a larger one
    (k unset, `add` its root). Each leaf reduced where it is made would send one collective apiece; summed as
    partial sums, the root reduces once (XLA's all-reduce reassociation, made where the partitioner decides)."""
    uses, producer = _uses(body)
    out, claimed = [], set()
    for e in reversed(_flat(body.eqns)):
        if e.name not in ("add", "add_any") or e.outvars[0] in claimed or len(e.invars) != 2:
            continue
        a, b = e.invars
        if not (_is_value(a) and _is_value(b)) or a is b:
            continue
        chain: list = []
        leaves: list = []
        dims = tuple(range(len(e.outvars[0].shape)))
        for x in (a, b):
            _walk(x, dims, uses, producer, chain, leaves)
        if len(leaves) < 2:
            continue
        claimed.update(v for v, _ in chain)
        out.append(Accumulator(-1, e, tuple(chain), tuple(leaves), tuple(producer[v] for v in leaves)))
    return out


def _walk(v: "Value", dims: tuple[int, ...], uses: Counter, producer: dict, chain: list, leaves: list) -> None:
    """Collect v's chain back to its leaves; a value used more than once (or made outside) ends nothing.
    dims[j]: the accumulator's dim that v's dim j is."""
    if uses[v] != 1:
        return
    e = producer.get(v)
    if e is None:  # a body input (an xs slice, a constant): not a partial sum
        return
    chain.append((v, dims))
    operands = [x for x in e.invars if _is_value(x)]
    if e.name == "scatter-add" and _zero(e.invars[0], producer) and _is_value(e.invars[2]):
        # scattered into zeros: linear in the updates. Followed where they are a loop's per-trip partial sums
        # (a pipeline's repeats); otherwise the scatter-add is the leaf (an embedding's gradient, whose own
        # sum over the batch makes the partial sum).
        below: tuple[list, list] = ([], [])
        _walk(e.invars[2], None, uses, producer, *below)
        if below[1] and all(producer[x].name in LOOPS for x in below[1]):
            chain += below[0]
            leaves += below[1]
        else:
            leaves.append(v)
    elif dims is None and ((e.name in LINEAR + ("transpose", "reshape", "broadcast_in_dim") and len(operands) == 1)
                           or (e.name in SUMS and len(operands) == len(e.invars) == 2
                               and operands[0] is not operands[1])):
        for x in operands:
            _walk(x, None, uses, producer, chain, leaves)
    elif dims is None and e.name == "select_n" and _masks(e, producer):
        (x,) = [c for c in e.invars[1:] if not _zero(c, producer)]
        _walk(x, None, uses, producer, chain, leaves)
    elif dims is None:
        leaves.append(v)
    elif e.name == "transpose" and len(operands) == 1:
        inner = [0] * len(dims)
        for i, p in enumerate(e.params["permutation"]):
            inner[p] = dims[i]
        _walk(operands[0], tuple(inner), uses, producer, chain, leaves)
    elif e.name == "broadcast_in_dim" and len(operands) == 1 and _expands(e, operands[0].shape, v.shape):
        _walk(operands[0], tuple(dims[d] for d in e.params["broadcast_dimensions"]), uses, producer, chain, leaves)
    elif e.name == "select_n" and _masks(e, producer):  # where(p, g, 0): a sum of masked summands is masked
        (x,) = [c for c in e.invars[1:] if not _zero(c, producer)]
        _walk(x, dims, uses, producer, chain, leaves)
    elif e.name == "reshape" and len(operands) == 1 and _squeezes(operands[0].shape, v.shape):
        kept = iter(d for d, n in zip(dims, v.shape) if n != 1)
        _walk(operands[0], tuple(next(kept) if n != 1 else None for n in operands[0].shape), uses, producer,
              chain, leaves)
    elif (e.name in LINEAR and len(operands) == 1) or (e.name in SUMS and len(operands) == len(e.invars) == 2
                                                         and operands[0] is not operands[1]):
        for x in operands:
            _walk(x, dims, uses, producer, chain, leaves)
    else:
        leaves.append(v)


def _squeezes(a: tuple, b: tuple) -> bool:
    """Whether a reshape from a to b only drops or inserts dims of size 1."""
    return [n for n in a if n != 1] == [n for n in b if n != 1]


_KEEPS_ZERO = ("broadcast_in_dim", "convert_element_type", "reshape", "squeeze", "transpose")


def _zero(x, producer: dict) -> bool:
    """Whether x is all zeros: a zero literal, or a broadcast (reshape, convert) of zeros."""
    if not _is_value(x):
        return not (x.val != 0).any() if hasattr(x.val, "any") else x.val == 0
    e = producer.get(x)
    return e is not None and e.name in _KEEPS_ZERO and _zero(e.invars[0], producer)


def _masks(e: "Eqn", producer: dict) -> bool:
    """Whether a select_n picks between one value and zeros (a mask: linear in the value)."""
    pred, *cases = e.invars
    rest = [c for c in cases if not _zero(c, producer)]
    return len(rest) == 1 and _is_value(rest[0]) and rest[0] is not pred and len(cases) > 1


def _expands(e: "Eqn", a: tuple, b: tuple) -> bool:
    """Whether a broadcast_in_dim from a to b only inserts dims of size 1 (an expand_dims)."""
    kept = e.params["broadcast_dimensions"]
    return all(b[d] == n for d, n in zip(kept, a)) and all(n == 1 for i, n in enumerate(b) if i not in kept)


def in_loop(inside: Sharding, dims: Optional[tuple]):
    """A chain value's sharding when the accumulator's is `inside` (dims: the accumulator's dim per dim, None
    for a dim of size 1 a reshape inserted; no dims: Loose, below a scatter-add)."""
    if dims is None:
        return Loose(inside.partial)
    return Sharding(tuple(inside.dims[d] if d is not None else () for d in dims), inside.partial)


def kept(want, have: Sharding) -> bool:
    """Whether a value arriving as `have` is the partial sum its chain keeps (`want`: in_loop's)."""
    return want == have or (isinstance(want, Loose) and bool(have.partial) and have.partial == want.partial)


def deferred_sharding(planned: Sharding, partial: frozenset) -> Sharding:
    """The accumulator's sharding in the loop: the planned dims without the axes it is partial over."""
    dims = tuple(tuple(a for a in d if a not in partial) for d in planned.dims)
    return Sharding(dims, partial)


def summary(count: int, trips: Optional[int]) -> str:
    """The report's words for a loop's deferred reductions."""
    what = "an accumulator" if count == 1 else f"{count} accumulators"
    saved = f": {trips - 1} reductions of each saved" if trips and trips > 1 else ": one per trip saved"
    return f"reduction of {what} deferred past the loop{saved}"
