"""Factor rules for the primitives that models rarely emit but jax.lax and jax.numpy do: generators without
operands, identities over several operands (and sinks), a variadic reduce, gamma and Poisson sampling, tiling and the
block-scaled dot; and the hook of mulhi, which XLA cannot compile inside a manual region.

Each rule keeps whole only the dims whose split would change the result, so none of these ops needs the
replicated fallback (tests/test_primitive_census.py finds any primitive the registry has no rule for).
"""
from __future__ import annotations

from typing import Optional

import jax.numpy as jnp
import numpy as np
from jax import lax

from ..representation.factors import FactorNames, Rule
from ..representation.program import Eqn, shape_of
from . import factor_rules as R


def _dims(n: FactorNames, x) -> tuple:
    """A fresh factor per dim of x."""
    return tuple((n.new(s),) for s in shape_of(x))


def generator(eqn: Eqn) -> Rule:
    """No operands (jnp.empty, platform_index): every result dim may split, each device makes its block."""
    n = FactorNames()
    res = tuple(_dims(n, v) for v in eqn.outvars)
    return Rule(eqn.name, tuple(() for _ in eqn.invars), res, n.sizes)


def each_operand(eqn: Eqn) -> Rule:
    """Result i is operand i (optimization_barrier; dce_sink, which has no results and keeps its operands
    alive): every dim passes through, each operand on its own."""
    n = FactorNames()
    ops = tuple(_dims(n, x) for x in eqn.invars)
    return Rule(eqn.name, ops, ops[: len(eqn.outvars)], n.sizes)


def variadic_reduce(eqn: Eqn) -> Rule:
    """lax.reduce with its own computation (jnp.minmax): the kept dims split, the reduced ones stay whole (the
    computation is a jaxpr, so no collective combines partial results); init values are scalars."""
    axes = set(eqn.params["dimensions"])
    k = len(eqn.outvars)
    n = FactorNames()
    dims = _dims(n, eqn.invars[0])
    kept = tuple(f for d, f in enumerate(dims) if d not in axes)
    return Rule("reduce(computation)", (dims,) * k + ((),) * k, (kept,) * k, n.sizes,
                replicated=frozenset(dims[d][0] for d in axes))


def keyed_sampler(eqn: Eqn) -> Rule:
    """Gamma or Poisson samples of parameters a (alpha, lambda) from keys k: a's leading dims that k's shape
    covers are elementwise (one key each); the dims after them draw from one key split in row-major order, so
    they stay whole."""
    key, alpha = eqn.invars
    kd = len(shape_of(key))
    n = FactorNames()
    dims = _dims(n, alpha)
    return Rule(eqn.name, (dims[:kd], dims), (dims,), n.sizes, replicated=frozenset(f for (f,) in dims[kd:]))


def tile(eqn: Eqn) -> Optional[Rule]:
    """jnp.tile: a dim repeated once passes through (split alike); a repeated dim stays whole on both sides (a
    block of the repeats is not the repeats of a block)."""
    x, reps = eqn.invars[0], eqn.params["reps"]
    if len(reps) != len(shape_of(x)):
        return None
    n = FactorNames()
    ins = _dims(n, x)
    outs = tuple(f if r == 1 else (n.new(s * r),) for f, s, r in zip(ins, shape_of(x), reps))
    whole = frozenset(f for d, r in enumerate(reps) if r != 1 for (f,) in (ins[d], outs[d]))
    return Rule("tile", (ins,), (outs,), n.sizes, replicated=whole)


def scaled_dot(eqn: Eqn) -> Rule:
    """A block-scaled dot (lhs, rhs, lhs_scale, rhs_scale): lhs and rhs as dot_general's rule has them, the
    scales' dims with their operand's where sizes agree; the contracting dims stay whole (each block's scale
    multiplies its partial sum)."""
    base = R.dot_general(eqn)
    n = FactorNames()
    n.sizes = dict(base.sizes)
    whole = set(base.reductions)
    (lc, rc), _ = eqn.params["dimension_numbers"]

    def scale(x, of, contracting):
        out = []
        for d, s in enumerate(shape_of(x)):
            if d not in contracting and d < len(of) and n.sizes[of[d][0]] == s:
                out.append(of[d])
            else:
                out.append((n.new(s),))
                whole.add(out[-1][0])
        return tuple(out)

    scales = tuple(scale(x, f, c) for x, f, c in zip(eqn.invars[2:], base.operands, (lc, rc)))
    return Rule("scaled_dot", base.operands + scales, base.results, n.sizes, replicated=frozenset(whole))


def mulhi_hook(ctx, ins, params, bind):
    """lax.mulhi (the high half of a * b) from half-width limbs: XLA's CPU backend rejects the op inside a
    shard_map body, and the limbs give the same bits (the signed form corrects the unsigned product)."""
    a, b = (jnp.asarray(x) for x in ins)
    dtype = np.dtype(a.dtype)
    unsigned, half = np.dtype(f"uint{8 * dtype.itemsize}"), 4 * dtype.itemsize
    ua, ub = lax.bitcast_convert_type(a, unsigned), lax.bitcast_convert_type(b, unsigned)
    mask = unsigned.type((1 << half) - 1)
    al, ah, bl, bh = ua & mask, ua >> half, ub & mask, ub >> half
    cross1, cross2, low = ah * bl, al * bh, al * bl
    carry = ((cross1 & mask) + (cross2 & mask) + (low >> half)) >> half
    hi = ah * bh + (cross1 >> half) + (cross2 >> half) + carry
    if dtype.kind == "i":  # (a mod 2^n)(b mod 2^n) - a b = 2^n (b [a < 0] + a [b < 0]) + 2^2n (...)
        zero = unsigned.type(0)
        hi = hi - jnp.where(a < 0, ub, zero) - jnp.where(b < 0, ua, zero)
    return [lax.bitcast_convert_type(hi, dtype)]
