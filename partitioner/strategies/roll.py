"""A roll along a split dim as collective-permutes, not a gather.

``jnp.roll(x, s, axis=d)`` traces to two slices of x and their
concatenation; `fold_rolls` turns that pattern back into one ``roll``
equation before planning. Every dim passes through a roll, so a split dim
stays split: with blocks of b rows, a shift of q b + r rows sends each
device's block q blocks on (one collective-permute), plus, when r > 0, its
last r rows one block further (a second one). A pipeline moves its
activations to the next stage this way. An uneven dim is gathered, rolled
and cut.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.extend import core, source_info_util
from jax.interpreters import ad, batching, mlir

from ..costs.cost import Collective
from ..representation.factors import FactorNames, Rule
from ..representation.program import Eqn, Program, Value, uses
from .halo import gather_collectives, gather_rows, ppermute
from .reshard import linear_axis_index

# Report the caller of roll(), not this module.
source_info_util.register_exclusion(__file__)

roll_p = core.Primitive("roll")
roll_p.def_impl(lambda x, *, shift, axis: jnp.roll(x, shift, axis))
roll_p.def_abstract_eval(lambda x, **_: x)
mlir.register_lowering(roll_p, mlir.lower_fun(lambda x, *, shift, axis: jnp.roll(x, shift, axis),
                                              multiple_results=False))
ad.deflinear2(roll_p, lambda ct, x, *, shift, axis: [ct if type(ct) is ad.Zero else
                                                      roll_p.bind(ct, shift=-shift, axis=axis)])


def _roll_batch(args, dims, *, shift, axis):
    (x,), (d,) = args, dims
    return roll_p.bind(x, shift=shift, axis=axis + (d <= axis)), d


batching.primitive_batchers[roll_p] = _roll_batch


def roll(x, shift: int, axis: int):
    """jnp.roll(x, shift, axis) as one equation (its transpose is a roll back), so a split axis is permuted
    both ways; outside gs.partition it is jnp.roll."""
    return roll_p.bind(x, shift=int(shift), axis=int(axis) % x.ndim)


# ------------------------------------------------------------------------------------------------- folding
def _is_cut(e: Eqn, x, axis: int, start: int, stop: int) -> bool:
    """e is a stride-1 slice of x taking rows [start, stop) of `axis` and everything of the other dims."""
    if e.name != "slice" or e.invars[0] is not x or any(s != 1 for s in (e.params.get("strides") or ())):
        return False
    starts, limits = e.params["start_indices"], e.params["limit_indices"]
    return all((a, b) == ((start, stop) if d == axis else (0, n))
               for d, (a, b, n) in enumerate(zip(starts, limits, x.shape)))


def fold_rolls(program: Program) -> Program:
    """Each concatenate(x[n - s:], x[:n - s]) along one dim, whose slices have no other use, becomes
    roll(x, s) (in place; sub-programs too)."""
    counts = uses(program)

    def visit(p: Program) -> None:
        producer = {e.outvars[0]: e for e in p.eqns if e.name == "slice"}
        dropped = set()
        for e in p.eqns:
            for sub in e.subs.values():
                visit(sub)
            if e.name != "concatenate" or len(e.invars) != 2 or not all(isinstance(v, Value) for v in e.invars):
                continue
            head, tail = (producer.get(v) for v in e.invars)
            if head is None or tail is None or any(counts.get(v) != 1 for v in e.invars):
                continue
            x, d = head.invars[0], e.params["dimension"]
            n = x.shape[d] if isinstance(x, Value) else 0
            s = head.outvars[0].shape[d] if isinstance(x, Value) else 0
            if not (0 < s < n and _is_cut(head, x, d, n - s, n) and _is_cut(tail, x, d, 0, n - s)):
                continue
            e.prim, e.invars, e.params = roll_p, [x], {"shift": s, "axis": d}
            dropped |= {id(head), id(tail)}
        p.eqns[:] = [e for e in p.eqns if id(e) not in dropped]
    visit(program)
    return program


# ------------------------------------------------------------------------------------------ rule and hook
def roll_rule(eqn: Eqn) -> Rule:
    """Every dim passes through; a split rolled dim is fixed up by the hook."""
    n = FactorNames()
    dims = tuple((n.new(s),) for s in eqn.invars[0].aval.shape)
    return Rule("roll", (dims,), (dims,), n.sizes)


def _split(ctx):
    """(axes, tiles, block rows) of the rolled dim, or None where it is whole."""
    d = ctx.eqn.params["axis"]
    axes = ctx.axes(ctx.rule.operands[0][d][0])
    if not axes:
        return None
    k = ctx.group(axes)
    return axes, k, ctx.need[0].local_shape(ctx.eqn.invars[0].shape, ctx.mesh_shape)[d]


def _moves(shift: int, n: int, k: int, block: int) -> list[tuple[int, int, int]]:
    """(first row, rows, blocks on) of the local block sent per collective-permute."""
    s = shift % n
    q, r = divmod(s, block)
    out = [(0, block - r, q)] if block - r else []
    return out + ([(block - r, r, q + 1)] if r else [])


def roll_collectives(ctx) -> list[Collective]:
    found = _split(ctx)
    if found is None:
        return []
    axes, k, block = found
    x, d = ctx.eqn.invars[0], ctx.eqn.params["axis"]
    shape = list(ctx.need[0].local_shape(x.shape, ctx.mesh_shape))
    item = x.aval.dtype.itemsize
    if x.shape[d] % k:
        return gather_collectives(shape, d, axes, str(x.aval.dtype), item, ctx.mesh_shape, "uneven rolled rows")
    out = []
    for _, rows, hop in _moves(ctx.eqn.params["shift"], x.shape[d], k, block):
        if hop % k:
            piece = tuple(rows if e == d else s for e, s in enumerate(shape))
            out.append(Collective("collective-permute", axes, k, math.prod(piece) * item, piece, str(x.aval.dtype),
                                  f"rolled rows {hop} block(s) on"))
    return out


def roll_hook(ctx, ins, params, bind):
    (x,) = ins
    found = _split(ctx)
    if found is None:
        return bind(x, **params)
    axes, k, block = found
    d, size, shift = params["axis"], ctx.eqn.invars[0].shape[params["axis"]], params["shift"]
    if size % k:
        full = jnp.roll(gather_rows(x, d, axes, size, 0)[tuple(slice(0, size) if e == d else slice(None)
                                                                for e in range(x.ndim))], shift, d)
        full = jnp.pad(full, [(0, k * block - size) if e == d else (0, 0) for e in range(x.ndim)])
        return [jax.lax.dynamic_slice_in_dim(full, linear_axis_index(axes, ctx.mesh_shape) * block, block, axis=d)]
    parts = []
    for first, rows, hop in _moves(shift, size, k, block):
        piece = jax.lax.slice_in_dim(x, first, first + rows, axis=d)
        if hop % k:
            piece = ppermute(piece, axes, [(j, (j + hop) % k) for j in range(k)], ctx.mesh_shape)
        parts.append(piece)
    # the rows that went one block further land first in their new block
    return [jnp.concatenate(parts[::-1], axis=d) if len(parts) > 1 else parts[0]]
