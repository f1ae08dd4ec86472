"""Factor rules: one einsum-like description per primitive.

Each builder names the factors of an equation's operand and result dims
(factors.py has the vocabulary); registry.py says which builder each
primitive uses. Propagation, strategy choice and costing all read these
rules: there is no per-op code path.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import jax

from ..representation.factors import FactorNames, Rule
from ..representation.program import Eqn, shape_of

# The pointwise ops: one rule (elementwise) partitions them all, and XLA fuses them (liveness.py). fma and fmuladd
# (a * b + c) are ternary; random_gamma_grad is d sample / d alpha of each (alpha, sample) pair.
POINTWISE = frozenset("""
abs acos acosh acospi add add_any and asin asinh asinpi atan atan2 atan2pi atanh atanpi bessel_i0e bessel_i1e
cbrt ceil clamp complex conj convert_element_type copy cos cosh cospi digamma div eq erf erf_inv erfc exp exp2
exp2m1 expm1 floor fma fmuladd ge gt igamma igamma_grad_a igammac imag integer_pow is_finite le le_to lgamma log
log1p log2 log2p1 logistic lt lt_to max min mul ne neg nextafter not one_minus_square or polygamma polynomial pow
random_gamma_grad real reduce_precision regularized_incomplete_beta rem round rsqrt select_n shift_left
shift_right_arithmetic shift_right_logical sign sin sinh sinpi sqrt square sub tan tanh tanpi xor population_count
clz stop_gradient zeta
""".split())


def elementwise(eqn: Eqn) -> Optional[Rule]:
    """Same factor for every dim; rank-0 operands and size-1 (implicitly broadcast) dims get their own."""
    out_shape = shape_of(eqn.outvars[0])
    n = FactorNames()
    dims = tuple((n.new(s),) for s in out_shape)
    ops = []
    for x in eqn.invars:
        shape = shape_of(x)
        if len(shape) not in (0, len(out_shape)):
            return None
        ops.append(tuple(f if s == out_shape[d] else (n.new(s),) for d, (s, f) in enumerate(zip(shape, dims))))
    return Rule("elementwise", tuple(ops), (dims,) * len(eqn.outvars), n.sizes, pointwise=True)


def bitcast_convert_type(eqn: Eqn) -> Optional[Rule]:
    """Elementwise when the element widths agree (the shape is unchanged); otherwise a dim is added or removed."""
    return elementwise(eqn) if shape_of(eqn.invars[0]) == shape_of(eqn.outvars[0]) else None


def broadcast_in_dim(eqn: Eqn) -> Rule:
    x = eqn.invars[0]
    shape, bdims = eqn.params["shape"], eqn.params["broadcast_dimensions"]
    n = FactorNames()
    res = [(n.new(s),) for s in shape]
    op = []
    for i, d in enumerate(bdims):
        op.append(res[d] if shape_of(x)[i] == shape[d] else (n.new(shape_of(x)[i]),))
    extra = tuple(() for _ in eqn.invars[1:])
    return Rule("broadcast", (tuple(op),) + extra, (tuple(res),), n.sizes, late_backward=True)


def reshape(eqn: Eqn) -> Optional[Rule]:
    """Split and merge dims into a common refinement of factors.

    Where the two shapes share no further factor (e.g. [6,4]->[4,6] after the
    leading 2), the remaining dims get factors that must stay replicated. With `dimensions` (transpose,
    then reshape: what a grouped conv's gradient emits) the factors are those of the transposed operand.
    """
    perm = eqn.params.get("dimensions") or tuple(range(len(shape_of(eqn.invars[0]))))
    src, dst = [shape_of(eqn.invars[0])[d] for d in perm], list(eqn.params["new_sizes"])
    n = FactorNames()
    if 0 in src:  # an empty array (e.g. jnp.pad's edge mode on a side of width 0): nothing to split
        op_e, res_e = tuple((n.new(s),) for s in shape_of(eqn.invars[0])), tuple((n.new(s),) for s in dst)
        return Rule("reshape", (op_e,) + tuple(() for _ in eqn.invars[1:]), (res_e,), n.sizes,
                    replicated=frozenset(n.sizes))
    op: list[list[str]] = [[] for _ in src]
    res: list[list[str]] = [[] for _ in dst]
    rep: set[str] = set()
    rem_a, rem_b = list(src), list(dst)
    i = j = 0
    while i < len(src) and j < len(dst):
        if rem_a[i] == 1:
            if not op[i]:
                op[i].append(n.new(1))
            i += 1
            continue
        if rem_b[j] == 1:
            if not res[j]:
                res[j].append(n.new(1))
            j += 1
            continue
        g = min(rem_a[i], rem_b[j]) if max(rem_a[i], rem_b[j]) % min(rem_a[i], rem_b[j]) == 0 \
            else math.gcd(rem_a[i], rem_b[j])
        if g == 1:
            break
        f = n.new(g)
        op[i].append(f)
        res[j].append(f)
        rem_a[i] //= g
        rem_b[j] //= g
    for dims, rem, start in ((op, rem_a, i), (res, rem_b, j)):
        for d in range(start, len(dims)):
            if rem[d] > 1 or not dims[d]:
                f = n.new(rem[d])
                dims[d].append(f)
                rep.add(f)
    extra = tuple(() for _ in eqn.invars[1:])
    unperm: list = [None] * len(op)
    for j, d in enumerate(perm):
        unperm[d] = tuple(op[j])
    return Rule("reshape", (tuple(unperm),) + extra, (tuple(map(tuple, res)),), n.sizes,
                replicated=frozenset(rep))


def transpose(eqn: Eqn) -> Rule:
    n = FactorNames()
    op = [(n.new(s),) for s in shape_of(eqn.invars[0])]
    return Rule("transpose", (tuple(op),), (tuple(op[p] for p in eqn.params["permutation"]),), n.sizes)


def squeeze(eqn: Eqn) -> Rule:
    n = FactorNames()
    drop = {d % len(shape_of(eqn.invars[0])) for d in eqn.params["dimensions"]}
    op = [(n.new(s),) for s in shape_of(eqn.invars[0])]
    return Rule("squeeze", (tuple(op),), (tuple(f for d, f in enumerate(op) if d not in drop),), n.sizes)


_REDUCE_KINDS = {"reduce_sum": "sum", "reduce_max": "max", "reduce_min": "min", "reduce_prod": "prod",
                 "reduce_and": "and", "reduce_or": "or", "argmax": "argmax", "argmin": "argmin"}


def reduction(eqn: Eqn) -> Rule:
    n = FactorNames()
    axes = set(eqn.params["axes"])
    op = [(n.new(s),) for s in shape_of(eqn.invars[0])]
    kind = _REDUCE_KINDS[eqn.name]
    return Rule(f"reduce({kind})", (tuple(op),), (tuple(f for d, f in enumerate(op) if d not in axes),),
                n.sizes, reductions={op[d][0]: kind for d in axes})


def dot_general(eqn: Eqn) -> Rule:
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    ls, rs = shape_of(eqn.invars[0]), shape_of(eqn.invars[1])
    n = FactorNames()
    lhs = [(n.new(s),) for s in ls]
    rhs: list = [None] * len(rs)
    for a, b in zip(lb, rb):
        rhs[b] = lhs[a]
    for a, b in zip(lc, rc):
        rhs[b] = lhs[a]
    red = {lhs[a][0]: "sum" for a in lc}
    for d, s in enumerate(rs):
        if rhs[d] is None:
            rhs[d] = (n.new(s),)
    lfree = [d for d in range(len(ls)) if d not in lb and d not in lc]
    rfree = [d for d in range(len(rs)) if d not in rb and d not in rc]
    out = tuple(lhs[a] for a in lb) + tuple(lhs[d] for d in lfree) + tuple(rhs[d] for d in rfree)
    return Rule("dot_general", (tuple(lhs), tuple(rhs)), (out,), n.sizes, reductions=red, rings=True)


def iota(eqn: Eqn) -> Rule:
    n = FactorNames()
    res = tuple((n.new(s),) for s in eqn.params["shape"])
    return Rule("iota", tuple(() for _ in eqn.invars), (res,), n.sizes)


def along_axis(eqn: Eqn) -> Rule:
    """Ops that need their axis whole (sort) and pass the other dims through."""
    axis = eqn.params.get("axis", eqn.params.get("dimension"))
    shape = shape_of(eqn.invars[0])
    n = FactorNames()
    dims = tuple((n.new(s),) for s in shape)
    axis %= len(shape)
    return Rule(f"{eqn.name}(axis whole)", (dims,) * len(eqn.invars), (dims,) * len(eqn.outvars), n.sizes,
                replicated=frozenset({dims[axis][0]}))


def cumulative(eqn: Eqn) -> Rule:
    """cumsum & co: every dim passes through; a split scan axis is fixed up by the hook (shard totals)."""
    n = FactorNames()
    dims = tuple((n.new(s),) for s in shape_of(eqn.invars[0]))
    return Rule("cumulative", (dims,), (dims,), n.sizes)


def top_k(eqn: Eqn) -> Rule:
    """The top-k dim is a reduction-like factor (candidates combined by the hook); k stays whole."""
    shape = shape_of(eqn.invars[0])
    axis = eqn.params.get("axis", -1) % len(shape)
    n = FactorNames()
    dims = [(n.new(s),) for s in shape]
    k = (n.new(eqn.params["k"]),)
    out = tuple(dims[:axis]) + (k,) + tuple(dims[axis + 1:])
    return Rule("top_k", (tuple(dims),), (out, out), n.sizes, reductions={dims[axis][0]: "top_k"},
                replicated=frozenset(k))


def _paired_dims(n: "FactorNames", a_shape, b_shape, whole: Sequence[bool]):
    """Dims of two tensors side by side: shared factors where flagged whole and equal, else replicated pairs."""
    a_dims, b_dims, rep = [], [], set()
    for d, (a, b) in enumerate(zip(a_shape, b_shape)):
        if whole[d] and a == b:
            f = n.new(a)
            a_dims.append((f,))
            b_dims.append((f,))
        else:
            fa, fb = n.new(a), n.new(b)
            a_dims.append((fa,))
            b_dims.append((fb,))
            rep |= {fa, fb}
    return tuple(a_dims), tuple(b_dims), rep


def _windowed(eqn: Eqn, operand_shape, result_shape, whole: Sequence[bool], extra_operands: int) -> Rule:
    """Dims flagged whole pass through; the others (sliced, padded, ...) stay replicated."""
    n = FactorNames()
    op, res, rep = _paired_dims(n, operand_shape, result_shape, whole)
    ops = (op,) + tuple(() for _ in range(extra_operands))
    return Rule(eqn.name, ops, (res,), n.sizes, replicated=frozenset(rep))


def dynamic_slice_rule(eqn: Eqn) -> Rule:
    shape, out = shape_of(eqn.invars[0]), shape_of(eqn.outvars[0])
    return _windowed(eqn, shape, out, [a == b for a, b in zip(shape, out)], len(eqn.invars) - 1)


def dynamic_update_slice_rule(eqn: Eqn) -> Rule:
    shape, upd = shape_of(eqn.invars[0]), shape_of(eqn.invars[1])
    n = FactorNames()
    op, up, rep = _paired_dims(n, shape, upd, [True] * len(shape))
    idx = tuple(() for _ in eqn.invars[2:])
    return Rule(eqn.name, (op, up) + idx, (op,), n.sizes, replicated=frozenset(rep))


def pieces_rule(kind: str, whole: Sequence[int], axis: int, pieces: Sequence[Optional[int]], whole_is_result: bool,
                **policy) -> Rule:
    """A rule between one whole array and its pieces along `axis` (concatenate and split, stack and unstack),
    every other dim shared. A piece with rows along the axis (its length there) has a factor of its own, tied to
    the whole's (a split of the whole's rows is the pieces' split); a piece without (None) lacks the axis, and
    the whole keeps that axis whole (one entry per piece). policy: the Rule's other fields (ties_propagate)."""
    n = FactorNames()
    dims = [(n.new(s),) for s in whole]
    parts, ties = [], {}
    for rows in pieces:
        if rows is None:
            parts.append(tuple(dims[:axis] + dims[axis + 1:]))
        else:
            f = n.new(rows)
            ties[f] = dims[axis][0]
            parts.append(tuple(dims[:axis]) + ((f,),) + tuple(dims[axis + 1:]))
    replicated = frozenset(dims[axis]) if None in pieces else frozenset()
    sides = (tuple(parts), (tuple(dims),)) if whole_is_result else ((tuple(dims),), tuple(parts))
    return Rule(kind, *sides, n.sizes, replicated=replicated, ties=ties, **policy)


def stack_rule(eqn: Eqn) -> Rule:
    """jnp.stack: the pieces' dims pass through; the new axis (one entry per piece) stays whole."""
    shape = shape_of(eqn.outvars[0])
    return pieces_rule("stack", shape, eqn.params["axis"] % len(shape), [None] * len(eqn.invars), True)


def unstack_rule(eqn: Eqn) -> Rule:
    """The inverse of stack: the unstacked axis stays whole, the other dims pass through to every piece."""
    shape = shape_of(eqn.invars[0])
    return pieces_rule("unstack", shape, eqn.params["axis"] % len(shape), [None] * len(eqn.outvars), False)


def gather_rule(eqn: Eqn) -> Rule:
    """Index-parallel batch dims, pass-through operand dims, and trivially sliced indexed dims.

    An indexed operand dim with slice size 1 may be split: each device gathers
    the rows it holds (indices shifted into its range, others zeroed), which
    leaves a partial sum over that dim's axes (the hook does the masking).
    """
    dn = eqn.params["dimension_numbers"]
    sizes_ = eqn.params["slice_sizes"]
    os, is_, out_shape = shape_of(eqn.invars[0]), shape_of(eqn.invars[1]), shape_of(eqn.outvars[0])
    n = FactorNames()
    out: list = [None] * len(out_shape)
    idx: list = [None] * len(is_)
    rep, red = set(), {}
    batch_out = [d for d in range(len(out_shape)) if d not in dn.offset_dims]
    for k, d in enumerate(batch_out):
        out[d] = idx[k] = (n.new(out_shape[d]),)
    idx[-1] = (n.new(is_[-1]),)
    rep.add(idx[-1][0])
    op: list = [None] * len(os)
    for od, ibd in zip(dn.operand_batching_dims, dn.start_indices_batching_dims):
        op[od] = idx[ibd]
    offset_operand = [d for d in range(len(os))
                      if d not in dn.collapsed_slice_dims and d not in dn.operand_batching_dims]
    # A whole-dim window starts at 0 whatever its index when starts are clamped (a vmapped dynamic_slice).
    clamped = eqn.params["mode"] in (jax.lax.GatherScatterMode.CLIP, jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS)
    for k, d in enumerate(offset_operand):
        od = dn.offset_dims[k]
        if sizes_[d] == os[d] and (d not in dn.start_index_map or clamped):
            op[d] = out[od] = (n.new(os[d]),)
        else:
            op[d], out[od] = (n.new(os[d]),), (n.new(out_shape[od]),)
            rep |= {op[d][0], out[od][0]}
    for d in dn.collapsed_slice_dims:
        op[d] = (n.new(os[d]),)
        if d in dn.start_index_map and sizes_[d] == 1:
            red[op[d][0]] = "sum"
        else:
            rep.add(op[d][0])
    return Rule("gather", (tuple(op), tuple(idx)), (tuple(out),), n.sizes, reductions=red, replicated=frozenset(rep))


def scatter_rule(eqn: Eqn) -> Optional[Rule]:
    """scatter-add: update batch dims may split (a partial sum); indexed dims of size-1 windows may split."""
    dn = eqn.params["dimension_numbers"]
    os, is_, us = (shape_of(x) for x in eqn.invars[:3])
    n = FactorNames()
    op: list = [(n.new(s),) for s in os]
    idx: list = [None] * len(is_)
    upd: list = [None] * len(us)
    rep, red = set(), {}
    scatter_upd = [d for d in range(len(us)) if d not in dn.update_window_dims]
    batched = dict(zip(dn.scatter_indices_batching_dims, dn.operand_batching_dims))
    for k, d in enumerate(scatter_upd):
        if k in batched:
            upd[d] = idx[k] = op[batched[k]]
        else:
            upd[d] = idx[k] = (n.new(us[d]),)
            if eqn.name == "scatter-add":
                red[upd[d][0]] = "sum"
            else:
                rep.add(upd[d][0])
    idx[-1] = (n.new(is_[-1]),)
    rep.add(idx[-1][0])
    window_operand = [d for d in range(len(os))
                      if d not in dn.inserted_window_dims and d not in dn.operand_batching_dims]
    # A whole-dim window lands at 0 whatever its index when indices are clamped (a vmapped update slice).
    clamped = eqn.params["mode"] in (jax.lax.GatherScatterMode.CLIP, jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS)
    for k, d in enumerate(window_operand):
        ud = dn.update_window_dims[k]
        if us[ud] == os[d] and (d not in dn.scatter_dims_to_operand_dims or clamped):
            upd[ud] = op[d]
        else:
            upd[ud] = (n.new(us[ud]),)
            rep |= {upd[ud][0], op[d][0]}
    for d in dn.inserted_window_dims:
        if d not in dn.scatter_dims_to_operand_dims:
            rep.add(op[d][0])
    return Rule(eqn.name, (tuple(op), tuple(idx), tuple(upd)), (tuple(op),), n.sizes, reductions=red,
                replicated=frozenset(rep))


def random_bits_rule(eqn: Eqn) -> Optional[Rule]:
    """Partitionable threefry bits are a function of the global position: every dim may split (hook). Bits of
    a key array (jax.vmap over keys) are elementwise in its dims, one key each; the dims each key draws stay
    whole."""
    kd = len(shape_of(eqn.invars[0]))
    if kd:
        n = FactorNames()
        lead = tuple((n.new(s),) for s in shape_of(eqn.invars[0]))
        trail = tuple((n.new(s),) for s in eqn.params["shape"])
        return Rule("random_bits", (lead,), (lead + trail,), n.sizes, replicated=frozenset(f for (f,) in trail))
    if not jax.config.jax_threefry_partitionable:
        return None
    if "fry" not in str(eqn.invars[0].aval.dtype):
        return None
    n = FactorNames()
    res = tuple((n.new(s),) for s in eqn.params["shape"])
    return Rule("random_bits", ((),), (res,), n.sizes)


def trailing(eqn: Eqn) -> Rule:
    """Leading dims shared by operand and result; trailing extra dims (key words, split counts) kept whole."""
    a, b = shape_of(eqn.invars[0]), shape_of(eqn.outvars[0])
    n = FactorNames()
    common = min(len(a), len(b))
    shared = [(n.new(s),) for s in a[:common]]
    ea = [(n.new(s),) for s in a[common:]]
    eb = [(n.new(s),) for s in b[common:]]
    rep = frozenset(f for (f,) in ea + eb)
    extra = tuple(shape_of(x) and tuple(shared[: len(shape_of(x))]) or () for x in eqn.invars[1:])
    return Rule(eqn.name, (tuple(shared + ea),) + extra, (tuple(shared + eb),), n.sizes, replicated=rep)
