"""The control-flow forms (scan, while, cond) as one table read by every pass.

Each form says three things about a primitive with bodies: which bodies it
has (program.BODIES, which program.py turns into sub-programs), how values flow between the
caller and the bodies (propagation/propagate.py turns these into identity links), and
how to run it on local shards (lower_regions.py). Adding a loop form means
adding a row here and an entry in registry.py that points to it, never
touching the three passes. A pipeline is a scan over its
schedule table (gshard_jax/pipeline.py), so it needs no row of its own.

Links are (a, b, tag, stacked, stacked_b): a's sharding flows to b; stacked=1
gives the stacked side (a, or b if stacked_b) an extra leading dim kept whole.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from ..costs.liveness import nbytes
from ..representation.jax_compat import scan_counts
from ..representation.program import BODIES, Token
from ..representation.sharding import Sharding
from . import deferral as DF, prefetch as PF
from .reshard import linear_axis_index

Link = tuple  # (a, b, tag, stacked, stacked_b)


def _is_value(v) -> bool:
    """A program Value (a body result may also be a Const, which links nothing)."""
    return not hasattr(v, "val")


def stacked(s: Sharding) -> Sharding:
    """The sharding of a scan's stacked value whose slices are sharded as s (scan dim whole)."""
    return Sharding(((),) + s.dims, s.partial, frozenset(d + 1 for d in s.padded))


@dataclasses.dataclass(frozen=True)
class Form:
    bodies: Callable[[dict], dict]  # params -> {sub-program name: jaxpr}
    links: Callable[[Any], tuple[list[Link], list[Link]]]  # eqn -> (into the bodies, out of them)
    lower: Callable[[Any, Any, Any, list], tuple[list, str]]  # (lowering, eqn, env, log) -> (results, strategy)
    # eqn -> (body, its carries in, its carries out, trips or None): where an accumulator may defer its reduction
    carries: Callable[[Any], tuple] = lambda e: (None, (), (), None)
    # eqn -> (body, the body's per-trip results, the eqn's stacked outputs): a summand an outer loop may defer
    stacked: Callable[[Any], tuple] = lambda e: (None, (), ())
    # eqn -> the index of its first carry among its operands (a loop's)
    first_carry: Optional[Callable[[Any], int]] = None
    # eqn -> how many leading operands its body reads as its leading inputs, unchanged every trip (a scan's
    # consts: fold.py follows known constants into the body through them)
    consts: Optional[Callable[[Any], int]] = None


# ---------------------------------------------------------------------------------------------------- scan
def _scan_links(e):
    body, tag = e.subs["body"], e.name
    nc, nk = scan_counts(e.params)
    into = [(a, b, tag, int(i >= nc + nk), False) for i, (a, b) in enumerate(zip(e.invars, body.invars))]
    out = []
    for k in range(nk):
        cin, cout = body.invars[nc + k], body.outvars[k]
        out += [(cout, cin, tag + " carry", 0, False), (cout, e.outvars[k], tag, 0, False)]
    out += [(y_body, y_out, tag, 1, True) for y_body, y_out in zip(body.outvars[nk:], e.outvars[nk:])
            if _is_value(y_body)]
    return into, out


def _scan_lower(lo, eqn, env, log):
    plan = lo.plan.sharding
    body = eqn.subs["body"]
    (nc, nk), length = scan_counts(eqn.params), eqn.params["length"]
    deferred = lo.deferrals(eqn)
    carry_sh = [deferred.get(k) or plan(b) for k, b in enumerate(body.invars[nc: nc + nk])]
    up = PF.hoisted(lo, eqn)  # invariants gathered before the loop, as their readers need them
    const_sh = [up.get(i) or plan(b) for i, b in enumerate(body.invars[:nc])]
    ins = [(lo._read(env, x, s, log), s) for x, s in zip(eqn.invars[:nc], const_sh)]
    ins += [(lo._read_sum(env, x, s, log), s) for x, s in zip(eqn.invars[nc: nc + nk], carry_sh)]
    x_sh = [plan(b) for b in body.invars[nc + nk:]]
    xs = [lo._read(env, x, stacked(s), log) for x, s in zip(eqn.invars[nc + nk:], x_sh)]
    y_sh = [lo.deferred_ys.get((id(eqn), j)) or plan(b) for j, b in enumerate(body.outvars[nk:])]
    ahead = PF.targets(lo, eqn)
    if ahead:
        return _pipelined(lo, eqn, env, log, ins, carry_sh, xs, x_sh, y_sh, ahead, deferred, sorted(up))

    def step(carry, x):
        outs = lo._body(body, env, ins[:nc] + list(zip(carry, carry_sh)) + list(zip(x, x_sh)),
                        carry_sh + y_sh, log, "scan", length, sorted(up), outer=(eqn.invars, eqn.outvars))
        return tuple(outs[:nk]), tuple(outs[nk:])

    carry, ys = lo.scan(step, tuple(a for a, _ in ins[nc:]), tuple(xs), length, eqn.params["reverse"],
                        eqn.params["unroll"])
    results = list(zip(carry, carry_sh)) + [(y, stacked(s)) for y, s in zip(ys, y_sh)]
    return results, f"scan x{length}: carry {' '.join(map(str, carry_sh)) or '-'}" + _deferred(deferred, length)


def _pipelined(lo, eqn, env, log, ins, carry_sh, xs, x_sh, y_sh, ahead: dict, deferred: dict, hoisted: list):
    """The scan with stacked inputs `ahead` (j -> the sharding its body gathers it to) gathered a trip ahead
    (prefetch.py): the first trip's before the loop, the next trip's in each trip, the last trip peeled.
    hoisted: the consts already gathered before the loop (given to the body as they are)."""
    body = eqn.subs["body"]
    (nc, nk), n = scan_counts(eqn.params), eqn.params["length"]
    reverse, js = eqn.params["reverse"], sorted(ahead)
    xvars = body.invars[nc + nk:]
    keep = hoisted + [nc + nk + j for j in js]
    first, last = (n - 1, 0) if reverse else (0, n - 1)
    ahead_by = -1 if reverse else 1  # the next trip's index, from this trip's
    dry = lo.dry

    def at(x, i, by=0):  # trip i + by's slice, read from the whole stack (a slice of the stack is a copy)
        return x if dry else jax.lax.dynamic_index_in_dim(x, i + by, keepdims=False)

    what = {j: f"{xvars[j]} (stacked input {j} of the scan)" for j in js}
    # held through the loop: the trip's gathered weights (the carry) and the next trip's, gathered beside them
    lo.ahead[eqn] = PF.AHEAD_LAYERS * sum(nbytes(xvars[j], ahead[j].local_shape(xvars[j].shape, lo.mesh_shape))
                                       for j in js)
    w0 = [lo.gather_ahead(at(xs[j], first), xvars[j], x_sh[j], ahead[j], what[j]) for j in js]

    def given(carry, x_now, w_now):
        x = list(zip(x_now, x_sh))
        for j, w in zip(js, w_now):
            x[j] = (w, ahead[j])
        return ins[:nc] + list(zip(carry, carry_sh)) + x

    nw = len(js)

    def put(bufs, ys_now, i):  # each trip's results written into the whole stacked results, in place
        return tuple(jax.lax.dynamic_update_index_in_dim(b, y, i, 0) for b, y in zip(bufs, ys_now))

    def step(c, i):
        carry, w, bufs = c[:nk], c[nk:nk + nw], c[nk + nw:]
        i = i[0]
        outs = lo._body(body, env, given(carry, [at(x, i) for x in xs], w), carry_sh + y_sh, log, "scan", n - 1,
                        keep, lambda: [lo.gather_ahead(at(xs[j], i, ahead_by), xvars[j], x_sh[j], ahead[j], what[j])
                                       for j in js])
        k = len(outs) - nw
        return tuple(outs[:nk]) + tuple(outs[k:]) + (bufs if dry else put(bufs, outs[nk:k], i)), ()

    trips = None if dry else jnp.arange(1, n) if reverse else jnp.arange(n - 1)  # every trip's index but last's
    # The stacked results are carried whole and each trip's slice written into them (as a scan's own are):
    # joining the peeled trip's to the loop's would copy them all, a cost growing with the layers.
    bufs = tuple(Token() if dry else jnp.zeros((n, *s.local_shape(v.shape, lo.mesh_shape)), v.aval.dtype)
                 for v, s in zip(body.outvars[nk:], y_sh))
    cw, _ = lo.scan(step, tuple(a for a, _ in ins[nc:]) + tuple(w0) + bufs, (trips,), n - 1, reverse,
                    eqn.params["unroll"])
    unread = [k for k in range(nk) if not lo.reads(eqn.outvars[k])]  # final carries no one reads
    outs = lo._body(body, env, given(cw[:nk], [at(x, last) for x in xs], cw[nk:nk + nw]), carry_sh + y_sh, log,
                    "scan.last", 1, keep, dead=unread)
    carry, ys = outs[:nk], cw[nk + nw:]
    if not dry:
        ys = put(ys, outs[nk:], last)
    results = list(zip(carry, carry_sh)) + [(y, stacked(s)) for y, s in zip(ys, y_sh)]
    return results, (f"scan x{n}: carry {' '.join(map(str, carry_sh)) or '-'}; "
                     f"stacked inputs {', '.join(map(str, js))} "
                     f"gathered a trip ahead (prefetch.py: {n - 1} trips and the last peeled)" + _deferred(deferred, n))


def _scan_carries(e):
    (nc, nk), body = scan_counts(e.params), e.subs["body"]
    return body, body.invars[nc: nc + nk], body.outvars[:nk], e.params["length"]


def carry_offset(e) -> int:
    """The index of a scan's or while loop's first carry among its operands."""
    first = FORMS[e.name].first_carry
    return first(e) if first is not None else 0


def _scan_consts(e) -> int:
    return scan_counts(e.params)[0]


def _while_first_carry(e) -> int:
    return e.params["cond_nconsts"] + e.params["body_nconsts"]


def _scan_stacked(e):
    nk, body = scan_counts(e.params)[1], e.subs["body"]
    return body, body.outvars[nk:], e.outvars[nk:]


def _deferred(deferred: dict, trips) -> str:
    return f"; {DF.summary(len(deferred), trips)}" if deferred else ""


# --------------------------------------------------------------------------------------------------- while
def _while_links(e):
    cond, body, tag = e.subs["cond"], e.subs["body"], e.name
    cn, bn = e.params["cond_nconsts"], e.params["body_nconsts"]
    consts_c, consts_b, init = e.invars[:cn], e.invars[cn:cn + bn], e.invars[cn + bn:]
    into = [(a, b, tag, 0, False) for a, b in
            [*zip(consts_c, cond.invars[:cn]), *zip(consts_b, body.invars[:bn]), *zip(init, body.invars[bn:]),
             *zip(init, cond.invars[cn:])]]
    out = []
    for cout, cin, ccond, final in zip(body.outvars, body.invars[bn:], cond.invars[cn:], e.outvars):
        out += [(cout, cin, tag + " carry", 0, False), (cout, ccond, tag, 0, False), (cout, final, tag, 0, False)]
    return into, out


def _while_lower(lo, eqn, env, log):
    plan = lo.plan.sharding
    cond, body = eqn.subs["cond"], eqn.subs["body"]
    cn, bn = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
    cconsts = [(lo._read(env, x, plan(b), log), plan(b)) for x, b in zip(eqn.invars[:cn], cond.invars)]
    bconsts = [(lo._read(env, x, plan(b), log), plan(b)) for x, b in zip(eqn.invars[cn:cn + bn], body.invars)]
    deferred = lo.deferrals(eqn)
    carry_sh = [deferred.get(k) or plan(b) for k, b in enumerate(body.invars[bn:])]
    read = {x for e in cond.all_eqns() for x in e.invars} | set(cond.outvars)
    for k, s in deferred.items():  # the predicate does not read the sum: it stays partial there too
        if cond.invars[cn + k] not in read:
            lo._lazy[cond.invars[cn + k]] = s
    init = [lo._read_sum(env, x, s, log) for x, s in zip(eqn.invars[cn + bn:], carry_sh)]
    # A jax.vmap'd loop's predicate holds one flag per batch element (the carries' leading dims): the loop runs
    # while any is set, and only the carries' rows whose flag is set take the body's result (as JAX lowers it).
    # The flags are read replicated, so every device runs the same trips.
    batched = len(cond.outvars[0].shape)
    pred_sh = Sharding.replicated(batched)

    def pred_of(carry, name):
        (pred,) = lo._body(cond, env, cconsts + list(zip(carry, carry_sh)), [pred_sh], log, name, 1)
        return pred

    def cond_fn(carry):
        pred = pred_of(carry, "while.cond")
        return jnp.any(pred) if batched and not lo.dry else pred

    def body_fn(carry):
        new = lo._body(body, env, bconsts + list(zip(carry, carry_sh)), carry_sh, log, "while.body", 1)
        if batched:
            pred = pred_of(carry, "while.body/pred")
            new = new if lo.dry else [_rows_where(lo, pred, n, c, s) for n, c, s in zip(new, carry, carry_sh)]
        return tuple(new)

    carry = lo.while_loop(cond_fn, body_fn, tuple(init))
    return list(zip(carry, carry_sh)), (f"while: carry {' '.join(map(str, carry_sh)) or '-'} (predicate replicated)"
                                        + _deferred(deferred, None))


def _rows_where(lo, pred, new, old, sharding: Sharding):
    """new where this device's rows of the (replicated) flags `pred` are set, else old: the flags cut to the
    carry's block of its leading dims, then broadcast over the rest."""
    for d in range(pred.ndim):
        axes = tuple(a for a in sharding.dims[d] if lo.mesh_shape[a] > 1)
        if axes:
            n = old.shape[d]  # the local block of dim d (a padded dim stores whole blocks)
            whole = n * math.prod(lo.mesh_shape[a] for a in axes)
            pred = jnp.pad(pred, [(0, whole - pred.shape[d]) if k == d else (0, 0) for k in range(pred.ndim)])
            pred = jax.lax.dynamic_slice_in_dim(pred, linear_axis_index(axes, lo.mesh_shape) * n, n, axis=d)
    pred = jnp.broadcast_to(pred.reshape(pred.shape + (1,) * (old.ndim - pred.ndim)), old.shape)
    return jax.lax.select_n(pred, old, new)


def _while_carries(e):
    bn, body = e.params["body_nconsts"], e.subs["body"]
    return body, body.invars[bn:], body.outvars, None


# ---------------------------------------------------------------------------------------------------- cond
def _cond_links(e):
    into, out = [], []
    for br in e.subs.values():
        into += [(a, b, e.name, 0, False) for a, b in zip(e.invars[1:], br.invars)]
        out += [(b, a, e.name, 0, False) for a, b in zip(e.outvars, br.outvars)
                if _is_value(b)]
    return into, out


def _cond_lower(lo, eqn, env, log):
    plan = lo.plan.sharding
    branches = list(eqn.subs.values())
    index = lo._read(env, eqn.invars[0], Sharding(()), log)
    ops = [(lo._read(env, x, plan(b), log), plan(b)) for x, b in zip(eqn.invars[1:], branches[0].invars)]
    out_sh = [plan(v) for v in eqn.outvars]

    def branch_fn(i, br):
        return lambda *xs: tuple(lo._body(br, env, list(zip(xs, [s for _, s in ops])), out_sh, log,
                                          f"cond.branch{i}", 1))

    outs = lo.switch(index, [branch_fn(i, b) for i, b in enumerate(branches)], *[x for x, _ in ops])
    return list(zip(outs, out_sh)), f"cond over {len(branches)} branches (index replicated)"


FORMS: dict[str, Form] = {
    "scan": Form(BODIES["scan"], _scan_links, _scan_lower, _scan_carries, _scan_stacked,
                 first_carry=_scan_consts, consts=_scan_consts),
    "while": Form(BODIES["while"], _while_links, _while_lower,
                  _while_carries, first_carry=_while_first_carry),
    "cond": Form(BODIES["cond"], _cond_links, _cond_lower),
}
