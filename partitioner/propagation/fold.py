"""Program simplifications XLA would make anyway, made before planning so the plan and the report match
the compiled program: common subexpressions merged, pads folded into the windowed ops that read them.

Common subexpressions: two equations with the same primitive, params and operands compute the same value
(the gradient of a bias and of a norm's offset fed by one cotangent, say); XLA's CSE merges them and their
collectives, so they are merged here first.

Reductions of a broadcast constant (a mask of ones summed for a count, over dims that may be split) are
the constant they compute, as XLA's algebraic simplifier folds them; left in, each would be an all-reduce
that XLA hoists out of the loops it sits in and merges (one for two 1F1B phases, where the plan had two).

Fold a pad into the windowed op that reads it (as XLA's algebraic simplifier does).

`jnp.pad(x, ((1, 0),))[:-1]` (an LM's shift right), the transpose of a
strided sum pooling (pad with interior zeros, then sum windows) and
explicitly padded convolutions are a pad followed by a windowed op. Split,
the pad's output has another length than its input, so its shards would
start elsewhere and the two ops would exchange halos twice; folded, the
padding becomes the windowed op's own (and interior padding its base
dilation) and one halo exchange remains. A pad is folded when its result has
exactly one use and the op can absorb it exactly:

- slice (stride 1): pad(lo - start, hi - (n - limit)), negative padding cuts; likewise a stride-1 slice
  followed by a pad without interior padding on the cut dims;
- pad with no interior padding where the first has some, or none in both;
- reduce_window_{sum,max,min} and the input of a convolution, when the pad
  value is the op's own (0, or the identity of max/min) and the op's base
  dilation is 1 wherever the pad has interior padding.

Which op is a pad, a cut, a windowed op with its pad value, a broadcast, a conversion and so on is the
registry's (registry.Fold on each op's entry): nothing here reads an op's name.
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np
from jax import lax

from ..representation.program import Const, Eqn, Program, Value, uses
from ..strategies import registry


def _op(e: Eqn):
    """e's registry entry (None: it has none)."""
    return registry.op_for(e.name)


def _fold(e: Eqn):
    """What e's registry entry lets the rewrites do with it."""
    op = _op(e)
    return op.fold if op is not None else registry.Fold()


def _value(x) -> Optional[float]:
    if isinstance(x, Const) and np.ndim(x.val) == 0:
        return float(np.asarray(x.val))
    return None


def _merged(pad: Eqn, user: Eqn) -> Optional[dict]:
    """The user's params with the pad folded in, or None if it cannot absorb it exactly."""
    cfg = pad.params["padding_config"]
    p = user.params
    folds = _fold(user)
    if folds.cut:
        if any(s != 1 for s in (p.get("strides") or ())):
            return None
        size = pad.outvars[0].shape
        new = tuple((lo - a, hi - (n - b), i) for (lo, hi, i), a, b, n in
                    zip(cfg, p["start_indices"], p["limit_indices"], size))
        return {"padding_config": new}
    if folds.pad:
        if _value(pad.invars[1]) is None or _value(pad.invars[1]) != _value(user.invars[1]):
            return None
        inner = user.params["padding_config"]
        if any(i2 and (i1 or lo1 or hi1) for (lo1, hi1, i1), (_, _, i2) in zip(cfg, inner)):
            return None
        return {"padding_config": tuple((lo1 + lo2, hi1 + hi2, i1 + i2) for (lo1, hi1, i1), (lo2, hi2, i2)
                                        in zip(cfg, inner))}
    if folds.window is None or user.invars[0] is not pad.outvars[0]:
        return None
    identity, spatial, base_key, untouched = folds.window(user)
    if _value(pad.invars[1]) != identity or any(lo < 0 or hi < 0 for lo, hi, _ in cfg):
        return None
    if any(cfg[d] != (0, 0, 0) for d in untouched):
        return None
    spatial = list(range(len(cfg))) if spatial is None else list(spatial)
    padding, base = list(p["padding"]), list(p[base_key])
    for k, d in enumerate(spatial):
        lo, hi, interior = cfg[d]
        if interior and base[k] != 1:
            return None
        plo, phi = padding[k]
        if interior:
            base[k] = interior + 1
        padding[k] = (plo + lo, phi + hi)
    return {"padding": tuple(padding), base_key: tuple(base)}


def _slice_as_pad(e: Eqn) -> Optional[tuple]:
    """A stride-1 slice's padding config (negative: the rows it cuts)."""
    if any(s != 1 for s in (e.params.get("strides") or ())):
        return None
    return tuple((-a, b - n, 0) for a, b, n in zip(e.params["start_indices"], e.params["limit_indices"],
                                                    e.invars[0].shape))


def _slice_into_pad(sl: Eqn, pad: Eqn) -> Optional[dict]:
    cut = _slice_as_pad(sl)
    if cut is None or any(i and (lo or hi) for (lo, hi, _), (_, _, i) in zip(cut, pad.params["padding_config"])):
        return None
    return {"padding_config": tuple((lo1 + lo2, hi1 + hi2, i2) for (lo1, hi1, _), (lo2, hi2, i2)
                                    in zip(cut, pad.params["padding_config"]))}


def fold_pads(program: Program) -> Program:
    """The program with every foldable pad folded into its only user (in place; sub-programs too)."""
    counts = uses(program)

    def visit(p: Program) -> None:
        producer = {e.outvars[0]: e for e in p.eqns if _fold(e).pad or _fold(e).cut}
        dropped = set()
        for e in p.eqns:
            for sub in e.subs.values():
                visit(sub)
            x = e.invars[0] if e.invars else None
            pad = producer.get(x) if isinstance(x, Value) else None
            if pad is None or id(pad) in dropped or counts.get(x) != 1 or not isinstance(pad.invars[0], Value):
                continue
            cut, into_pad = _fold(pad).cut, _fold(e).pad
            if cut and not into_pad:
                continue
            if cut:  # a cut followed by a pad: one pad
                params = _slice_into_pad(pad, e) if into_pad else None
            else:
                params = _merged(pad, e)
            if params is None:
                continue
            if _fold(e).cut:  # the slice becomes the merged pad
                e.prim, e.params = pad.prim, dict(pad.params, **params)
                e.invars = [pad.invars[0], pad.invars[1]]
            else:
                e.params = dict(e.params, **params)
                e.invars = [pad.invars[0]] + list(e.invars[1:])
            dropped.add(id(pad))
            if _fold(e).pad or _fold(e).cut:
                producer[e.outvars[0]] = e
        p.eqns[:] = [e for e in p.eqns if id(e) not in dropped]
    visit(program)
    return program


def _operand_key(x):
    if isinstance(x, Value):
        return x
    if np.ndim(x.val) == 0:
        return ("literal", str(x.aval.dtype), np.asarray(x.val).item())
    raise TypeError("array literal")


def static_slices(program: Program) -> Program:
    """dynamic_slice with constant start indices becomes the slice it is (starts clamped as dynamic_slice
    clamps them), so a split dim takes the windowed path instead of being gathered."""
    def visit(p: Program) -> None:
        for e in p.eqns:
            for sub in e.subs.values():
                visit(sub)
            if not _fold(e).static_starts or not all(isinstance(x, Const) and np.ndim(x.val) == 0
                                                    for x in e.invars[1:]):
                continue
            shape, sizes = e.invars[0].shape, e.params["slice_sizes"]
            starts = [min(max(int(np.asarray(x.val)), 0), n - s) for x, n, s in zip(e.invars[1:], shape, sizes)]
            e.prim, e.invars = lax.slice_p, [e.invars[0]]
            e.params = {"start_indices": tuple(starts), "limit_indices": tuple(a + s for a, s in zip(starts, sizes)),
                        "strides": None}
    visit(program)
    return program


def fold_constant_reductions(program: Program) -> Program:
    """Reductions (through conversions) of a scalar broadcast to a shape become that broadcast's result: a
    broadcast of the reduced value (in place; sums only where the product is exact in the dtype)."""
    def visit(p: Program, known: dict) -> None:  # known: Value -> the scalar every element of it holds
        for e in p.eqns:
            ins = [known.get(x) if isinstance(x, Value) else None for x in e.invars]
            op = _op(e)
            form = op.form if op is not None else None
            for sub in e.subs.values():  # a scan's constants are known in its body
                inner = {}
                if form is not None and form.consts is not None:
                    inner = {b: k for b, k in zip(sub.invars[:form.consts(e)], ins) if k is not None}
                visit(sub, inner)
            folds = op.fold if op is not None else registry.Fold()
            if folds.spreads_scalar and isinstance(e.invars[0], Const) and len(e.invars) == 1:
                known[e.outvars[0]] = np.asarray(e.invars[0].val)
            elif folds.identity and ins[0] is not None:
                known[e.outvars[0]] = ins[0]  # identities of the global view
            elif folds.convert and ins[0] is not None:
                known[e.outvars[0]] = np.asarray(ins[0]).astype(e.outvars[0].dtype)
            elif folds.reduce is not None and len(e.invars) == 1 and ins[0] is not None:
                n = math.prod(e.invars[0].shape[d] for d in e.params["axes"])
                out = e.outvars[0]
                exact = folds.reduce(ins[0].item(), n)
                value = np.asarray(exact).astype(out.dtype)
                if value.item() != exact:
                    continue
                known[out] = value
                e.prim, e.invars = lax.broadcast_in_dim_p, [Const(value, out.aval.update(shape=()))]
                e.params = {"shape": tuple(out.shape), "broadcast_dimensions": (), "sharding": None}
    visit(program, {})
    return program


def _constant(e: Eqn, same: dict) -> bool:
    """A constant: a broadcast literal, an iota, or a pointwise op or broadcast of constants only (optax's
    norms square a broadcast zero, each leaf's imaginary part, for every parameter). Free to make in whatever
    layout each use wants, so never merged: one merged constant would take one use's split and be re-laid for
    the others (optax's lamb and adafactor broadcast the same ones for every parameter of a shape, row- and
    column-split alike), or, read by differently split values, carry one's split to the other (a tied
    embedding's gradient split as the MLP kernel of its shape is, through their shared squared zero)."""
    folds = _fold(e)
    if folds.generator and not any(isinstance(x, Value) for x in e.invars):
        return True
    ops = [x for x in e.invars if isinstance(x, Value)]
    return len(e.outvars) == 1 and bool(ops) and all(x in same for x in ops) and folds.keeps_constant


def merge_common(program: Program) -> Program:
    """The program with repeated computations merged (in place; each sub-program on its own)."""
    def visit(p: Program, rename: dict, merge: bool) -> None:
        seen: dict = {}
        kept = []
        same: dict = {}  # a constant's value -> what it is: ops on equal constants merge, as XLA's CSE merges them
        for e in p.eqns:
            e.invars = [rename.get(x, x) if isinstance(x, Value) else x for x in e.invars]
            op = _op(e)
            checkpoint = op is not None and op.checkpoint
            for sub in e.subs.values():  # a checkpointed region keeps its recomputation: nothing merged in it
                if checkpoint:  # its inputs are the caller's values (program.py): renamed with them
                    sub.invars[:] = [rename.get(x, x) if isinstance(x, Value) else x for x in sub.invars]
                visit(sub, rename, merge and not checkpoint)
            constant = merge and _constant(e, same) and len(e.outvars) == 1
            if constant:
                try:
                    k = ("constant", e.prim, tuple(e.params.items()),
                         tuple(same[x] if isinstance(x, Value) else _operand_key(x) for x in e.invars),
                         e.outvars[0].aval)
                    hash(k)
                    same[e.outvars[0]] = k
                except TypeError:
                    pass
            if not merge or e.subs or not registry.mergeable(e.name) or constant:
                kept.append(e)
                continue
            try:
                key = (e.prim, tuple(e.params.items()), tuple(same.get(x, x) if isinstance(x, Value) else
                                                              _operand_key(x) for x in e.invars),
                       tuple(v.aval for v in e.outvars))
                hash(key)
            except TypeError:
                kept.append(e)
                continue
            first = seen.get(key)
            if first is None:
                seen[key] = e
                kept.append(e)
                continue
            for a, b in zip(e.outvars, first.outvars):
                rename[a] = b
        p.eqns[:] = kept
        p.outvars[:] = [rename.get(x, x) if isinstance(x, Value) else x for x in p.outvars]
    visit(program, {}, True)
    return program
