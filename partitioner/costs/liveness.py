"""The temporaries' peak per device: each value alive over its lifetime (lifetimes.py) as XLA holds it
(fusion.py), with the operands' copies the lowering made and what the fresh outputs' buffers hold before
the outputs are written (buffer_reuse.py). explain() reports it; the automatic sharding bounds the same
counts under a memory budget (auto/memory.py)."""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np

from ..representation.program import Eqn, Program, Value
from ..rules.factor_rules import POINTWISE
from .buffer_reuse import less_held
from .fusion import fusion_aware
from .identities import identity
from .lifetimes import Lifetimes, lifetimes

# XLA:CPU's temporaries hold, for each result it makes a tuple (a collective's over several operands: an
# all-to-all's pieces, all-reduces it combines), a table of the elements' pointers in a slot of its 64-byte
# aligned heap, outside the values: one slot a collective the lowering issues bounds them.
TUPLE_SLOT = 64


def nbytes(v: Value, local_shape: tuple) -> int:
    """Bytes of a value's local shard (a typed PRNG key's: its key data's)."""
    return math.prod(local_shape) * v.aval.dtype.itemsize


@dataclasses.dataclass(eq=False)
class Copy:
    """An operand's local copy in the sharding its readers need, as the lowering made it."""
    local: object  # the local array (or a walk's token): what the ops that reuse the copy read; None: a copy
    # XLA makes in another layout (dot_operand_copies)
    value: Value  # the value it copies
    bytes: int  # per device
    readers: list = dataclasses.field(default_factory=list)  # the ops that read it, the first the one it was made for


@dataclasses.dataclass(frozen=True)
class Peak:
    """The most bytes per device the temporaries hold at once, where, and the largest of them there."""
    bytes: int
    op: str  # the op running at the peak, and where the user wrote it
    largest: tuple = ()  # ((what made it, bytes), ...) the largest values alive there, largest first

    def to_dict(self) -> dict:
        return {"bytes": self.bytes, "op": self.op, "largest": [list(x) for x in self.largest]}


def peak(program: Program, local_bytes: Callable[[Value], int], lt: Optional[Lifetimes] = None,
         named: int = 3, copies: Sequence[Copy] = (), names: Mapping[Value, str] = {},
         ahead: Mapping[Eqn, int] = {}, exits: Sequence[Value] = (), fresh: set = frozenset(),
         sharding: Optional[Callable[[Value], Any]] = None, throughout: int = 0) -> Peak:
    """The temporaries' peak (as XLA holds them: fusion_aware) with each value at local_bytes(value) per
    device, and the operands' copies (each alive from its first reader's first point to its last reader's
    last); named: how many to name, names: what to call the program's inputs, ahead: as lifetimes(), exits:
    the outputs that leave resharded, each held as made from its op to the program's end (the output is
    another buffer), fresh: as fusion_aware's, sharding: the plan's, as lifetimes(), throughout: bytes held at
    every point beside the values (TUPLE_SLOT's). What the fresh outputs' buffers hold before the outputs are
    made is not counted (buffer_reuse.py)."""
    if lt is None:
        lt = fusion_aware(program, lifetimes(program, ahead, sharding), fresh)
        lt = merge_identities(program, lt, sharding) if sharding is not None else lt
    if not lt.ops:
        return Peak(0, "")
    sizes = np.array([local_bytes(v) for v in lt.values], float)
    at = lt.bytes_at(sizes)
    spans = [lt.span(c.readers) for c in copies]
    for c, (a, b) in zip(copies, spans):
        at[a: b + 1] += c.bytes
    made = {id(v): e for e in program.all_eqns() for v in e.outvars}
    held_out = [(lt.spans[made[id(v)]][0], local_bytes(v), v) for v in exits if made.get(id(v)) in lt.spans]
    for a, n, _ in held_out:
        at[a:] += n
    items = [(float(n), int(a), int(b)) for n, a, b in zip(sizes, lt.start, lt.end)]
    items += [(float(c.bytes), a, b) for c, (a, b) in zip(copies, spans)]
    at, in_outputs = less_held(at, items, [(local_bytes(o), made) for o, made in lt.fresh])
    at = at + throughout
    p = int(np.argmax(at))

    def made_by(v: Value) -> str:
        e = made.get(id(v))
        return f"the result of {e.name}" if e is not None else str(v)

    held = [(int(sizes[i]), f"{made[id(lt.values[i])].name} at {made[id(lt.values[i])].source}")
            for i in lt.alive(p) if i not in in_outputs]
    how = lambda c: "relaid" if c.local is None else "resharded"  # noqa: E731
    held += [(c.bytes, f"{names.get(c.value) or made_by(c.value)} {how(c)} for {c.readers[0].name} at "
                       f"{c.readers[0].source}") for k, (c, (a, b)) in enumerate(zip(copies, spans))
             if a <= p <= b and len(sizes) + k not in in_outputs]
    held += [(int(n), what) for a, b, n, what in lt.scratch if a <= p <= b]
    held += [(n, f"{made_by(v)}, before it leaves resharded") for a, n, v in held_out if a <= p]
    held += [(throughout, "the tables of the collectives' tuple-shaped results")] if throughout else []
    largest = tuple((what, n) for n, what in sorted(held, key=lambda t: -t[0])[:named])
    return Peak(int(at[p]), f"{lt.ops[p].name} at {lt.ops[p].source}", largest)


def relaid(e: Eqn, shapes: Sequence[tuple]) -> list[int]:
    """The operands (0: left, 1: right) XLA:CPU copies into another layout before a dot_general, given their
    local shapes: it computes a dot on operands laid out (batch, free, contracting) for the left, (batch,
    contracting, free) for the right (DotDecomposer), and transposes one in another order (dims of size 1
    aside) into a buffer of its own (an activation contracted over two dims for a weight's gradient, a
    weight with two contracting dims read by a backward pass), except a matrix read transposed (batch dims
    leading, then one free and one contracting dim), which its GEMM reads in place, unless the dot has a
    batch of one and its other operand is copied."""
    (lc, rc), (lb, rb) = e.params["dimension_numbers"]
    unsorted, matrix, single = [], [], False
    for k, (x, batch, contract) in enumerate(((e.invars[0], lb, lc), (e.invars[1], rb, rc))):
        shape = shapes[k] if isinstance(x, Value) else ()
        big = lambda ds: [d for d in ds if shape[d] > 1]  # noqa: E731
        free = big(d for d in range(len(shape)) if d not in batch and d not in contract)
        order = big(batch) + (free + big(contract) if k == 0 else big(contract) + free)
        unsorted.append(isinstance(x, Value) and order != sorted(order))
        matrix.append(len(free) == 1 and len(big(contract)) == 1 and list(batch) == sorted(batch)
                      and max(batch, default=-1) < min(order[-2:]))
        single = single or (isinstance(x, Value) and len(big(batch)) < len(batch))
    copied = [unsorted[k] and not matrix[k] for k in (0, 1)]
    return [k for k in (0, 1) if copied[k] or (unsorted[k] and single and copied[1 - k])]


def from_start(program: Program, sharding: Optional[Callable[[Value], Any]] = None) -> Callable[[Value], bool]:
    """Whether a copy of a value is made where the program starts (XLA:CPU runs an op as early as its operands
    allow): it is an argument, or an annotation asking for its argument's sharding (where the plan's
    shardings are known). The program's makers are read once."""
    inputs = {id(v) for v in program.invars} | {id(v) for v, _ in program.consts}
    maker = {id(v): e for e in program.all_eqns() for v in e.outvars}

    def starts(x: Value) -> bool:
        while sharding is not None and id(x) in maker and identity(maker[id(x)], sharding):
            x = maker[id(x)].invars[0]
        return id(x) in inputs
    return starts


def dot_operand_copies(program: Program, local_shape: Callable[[Value], tuple], local_bytes: Callable[[Value], int],
                       sharding: Optional[Callable[[Value], Any]] = None) -> list[Copy]:
    """The operands XLA:CPU copies before a dot (`relaid`, on their local shapes), each alive while the dot
    runs, or from the program's start (`from_start`)."""
    out, starts = [], from_start(program, sharding)
    for e in program.all_eqns():
        if e.name == "dot_general":
            for k in relaid(e, [local_shape(x) if isinstance(x, Value) else () for x in e.invars]):
                x = e.invars[k]
                out.append(Copy(None, x, local_bytes(x), [e] + ([program.eqns[0]] if starts(x) else [])))
    return out


def broadcast_copies(program: Program, local_bytes: Callable[[Value], int]) -> list[Copy]:
    """The broadcasts XLA:CPU stores: an operand several pointwise ops broadcast to the same larger shape
    (an RMSNorm's rsqrt and scale, read by its forward product and by its backward's), one of them summed
    by a reduction, is one broadcast XLA's CSE shares and its reduction fusion reads stored, alive from the
    first of those ops to the last (its forward to its backward). local_bytes(reader, operand value): the
    broadcast's bytes per device (its reader's result's)."""
    out = []
    readers: dict = {}
    for e in program.all_eqns():
        if e.name in POINTWISE and len(e.outvars) == 1:
            for x in {id(x): x for x in e.invars if isinstance(x, Value)}.values():
                if math.prod(x.shape) < math.prod(e.outvars[0].shape):
                    readers.setdefault((id(x), tuple(e.outvars[0].shape)), (x, []))[1].append(e)
    summed = {id(x) for e in program.all_eqns() if e.name == "reduce_sum" for x in e.invars}
    for x, ops in readers.values():
        if len(ops) > 1 and any(id(e.outvars[0]) in summed for e in ops):
            out.append(Copy(None, x, local_bytes(ops[0], x), ops))
    return out


def merge_identities(program: Program, lt: Lifetimes, sharding: Callable[[Value], Any]) -> Lifetimes:
    """An identity annotation's value stored beside its operand's is one buffer (XLA sees no op): the
    operand's lifetime runs to the later of the two ends and the annotation's is dropped; an argument's (or a
    body's input's) is the argument. Where the operand is never stored (fused into its reader), the
    annotation's value is the buffer, as counted."""
    index = {id(v): k for k, v in enumerate(lt.values)}
    made = {id(v) for e in program.all_eqns() for v in e.outvars}
    drop: set = set()
    for e in program.all_eqns():  # (program order: an annotation of a merged annotation joins its operand)
        if identity(e, sharding):
            a, b = index.get(id(e.invars[0])), index.get(id(e.outvars[0]))
            if b is not None and id(e.invars[0]) not in made:  # an argument's, or a body's input's: that buffer
                drop.add(b)
            elif a is not None and b is not None:
                lt.end[a] = max(lt.end[a], lt.end[b])
                drop.add(b)
                index[id(e.outvars[0])] = a
    keep = [k for k in range(len(lt.values)) if k not in drop]
    gone = {id(lt.values[k]) for k in drop}
    return dataclasses.replace(lt, values=[lt.values[k] for k in keep], start=lt.start[keep], end=lt.end[keep],
                               early=[v for v in lt.early if id(v) not in gone])
