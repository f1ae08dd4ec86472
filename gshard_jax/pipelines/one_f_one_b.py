"""The pipeline schedules that own their backward pass (1F1B, interleaved 1F1B), in lockstep SPMD.

At tick t stage s runs the forward of one microbatch and the backward of
another (the schedule's table says which); the backward of virtual stage u
runs 2 (r p - 1 - u) ticks after its forward, so the last stage runs
forward, loss and backward of a microbatch in one tick and gradients roll
down a stage per tick. Each stage's ``jax.vjp`` residuals that depend on the
activation wait in a ring buffer of 2 r p - 1 slots; those that depend on
the weights alone are recomputed at the backward, so memory does not grow
with the number of microbatches.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from . import schedules as S
from .common import (
    Run,
    aux_zeros,
    chunk,
    f32,
    from_stage,
    microbatches,
    put,
    put_rows,
    record,
    rows,
    shard_leading,
    stacked,
    stage_axis,
    stage_inputs,
    unmicrobatch,
    weights_like,
    where,
    zero_unless,
)
from .residuals import Residuals


def one_f_one_b(stage_fn, params, x, loss_fn, loss_params, targets, p, m, schedule, r, has_aux, aux_weights, axis,
                x_spec, param_specs, unroll, owned_ends=False):
    """pipeline_value_and_grad's 1F1B and interleaved 1F1B: warmup (forward wave), steady (both waves, the
    loss at the last stage between them) and cooldown (backward wave), each a scan over the schedule's rows.
    owned_ends: x and loss_params lead with [p] (split over the stage axis); stage 0 reads its own slice of x
    and the last stage its own slice of loss_params, and their gradients stay per stage (nothing summed)."""
    sc = S.make(schedule, p, m, r)
    record(sc)
    ax = stage_axis(axis, p)
    run = Run(stage_fn, has_aux, sc, ax, x_spec)
    params_rp = stacked(params, r, p, ax, param_specs)
    xs, one_x = stage_inputs(x, m, p, ax, x_spec, owned_ends)  # loss_params keep their layout (vmap splits dim 0)
    ts = microbatches(targets, m)
    res = Residuals(run.vmap, run.call,
                    jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), params_rp),
                    jax.tree.map(lambda a, shape: jax.ShapeDtypeStruct(shape, a.dtype), xs, one_x))
    zeros_state = run.state(jax.tree.map(lambda a, shape: jnp.zeros(shape, a.dtype), xs, one_x))
    aux0 = aux_zeros(run, params_rp, zeros_state)
    weights = jax.tree.map(lambda a, w: jnp.broadcast_to(jnp.asarray(w, a.dtype), a.shape[1:]), aux0,
                           weights_like(aux0, aux_weights))
    carry = _initial_carry(run, res, sc, zeros_state, aux0, params_rp, xs, loss_params, p, ax, param_specs,
                           owned_ends)
    forward, loss, backward = _tick_bodies(run, res, params_rp, xs, ts, loss_fn, loss_params, weights, p, r,
                                           owned_ends)
    forward = jax.jit(forward)  # the warmup's and the steady phase's bodies trace it once

    def warm(c, row):
        return forward(c, row)[0], None

    def steady(c, rows):
        c, y, last, mb = forward(c, rows[0])
        c, dy = loss(c, y, last, mb)
        return backward(c, rows[1], dy), None

    def cool(c, row):
        return backward(c, row), None

    def loop(f, c, wave, ticks):
        """A scan over a phase's rows; a phase of no ticks is no loop (XLA drops a zero-trip loop's body)."""
        if not len(ticks):
            return c
        rows = tuple(run.rows(w, ticks) for w in wave) if isinstance(wave, tuple) else run.rows(wave, ticks)
        return jax.lax.scan(f, c, rows, unroll=unroll)[0]

    w_ticks, s_ticks, c_ticks = sc.phases
    with jax.named_scope(f"pipeline.{schedule}"):
        with jax.named_scope("warmup"):
            carry = loop(warm, carry, sc.forward, w_ticks)
        with jax.named_scope("steady"):
            carry = loop(steady, carry, (sc.forward, sc.backward), s_ticks)
        with jax.named_scope("cooldown"):
            if len(c_ticks) == 1:  # no loop (XLA would inline it): its gradients go nowhere, so no roll
                carry = backward(carry, [a[0] for a in run.rows(sc.backward, c_ticks)], roll=False)
            else:  # in a loop the last tick rolls too: one body keeps the temp memory of one tick
                carry = loop(cool, carry, sc.backward, c_ticks)
    return _results(carry, r, owned_ends)


def _initial_carry(run, res, sc, zeros_state, aux0, params_rp, xs, loss_params, p, ax, param_specs, owned_ends):
    """The loops' carry before the first tick: the two waves, the stash, and the sums the ticks add to."""
    return {
        "f": zeros_state,  # activations moving up a stage per tick
        "b": zeros_state,  # their gradients moving down
        "stash": [jnp.zeros((p, sc.stash) + tuple(a.shape), a.dtype) for a in res.stashed],
        "loss": jnp.zeros((p,), jnp.float32),
        "aux": aux0,
        "dw": shard_leading(jax.tree.map(lambda a: jnp.zeros(a.shape, _acc_dtype(a)), params_rp), (None, ax),
                            param_specs, ax),
        "dl": jax.tree.map(lambda a: jnp.zeros(jnp.shape(a) if owned_ends else (p,) + jnp.shape(a), _acc_dtype(a)),
                           loss_params),
        "dx": jax.tree.map(lambda a: jnp.zeros(a.shape if owned_ends else (p,) + a.shape, a.dtype), xs),
    }



def _tick_bodies(run, res, params_rp, xs, ts, loss_fn, loss_params, weights, p, r, owned_ends):
    """(forward, loss, backward): one tick of each wave on every stage at once (vmapped over the stage axis),
    and the loss at the last stage between them."""
    ids = run.stage_ids

    def forward(c, row):
        mb, rep, slot = row
        valid = mb >= 0
        inp = run.inject(xs, c["f"], mb, rep, owned_ends)

        def stage(w, u, ok):
            (y, a), vjp = jax.vjp(run.call, w, zero_unless(ok, u))
            return y, zero_unless(ok, a), res.split(jax.tree.leaves(vjp))

        y, a, saved = run.vmap(stage)(chunk(params_rp, rep, r), inp, valid)
        c = dict(c, f=run.roll(y, 1), aux=jax.tree.map(jnp.add, c["aux"], a),
                 stash=put(c["stash"], slot, saved, valid))
        return c, y, valid & (ids == p - 1) & (rep == r - 1), mb

    def loss(c, y, last, mb):
        def one(lp, y, t, ok):
            value, vjp = jax.vjp(lambda lp, y: loss_fn(lp, y, t), lp, y)
            dl, dy = vjp(jnp.ones_like(value))
            return jnp.where(ok, value, 0).astype(jnp.float32), zero_unless(ok, f32(dl)), zero_unless(ok, dy)

        value, dl, dy = run.vmap(one, in_axes=(0 if owned_ends else None, 0, 0, 0))(loss_params, y, rows(ts, mb), last)
        return dict(c, loss=c["loss"] + value, dl=jax.tree.map(jnp.add, c["dl"], dl)), dy

    def backward(c, row, fresh=None, roll=True):
        mb, rep, slot = row
        valid = mb >= 0
        g = c["b"] if fresh is None else where(valid & (ids == p - 1) & (rep == r - 1), fresh, c["b"])

        def stage(recomputed, saved, g, ok):
            vjp = res.rebuild(recomputed, saved)
            dw, dx = vjp((zero_unless(ok, g), zero_unless(ok, weights)))
            return zero_unless(ok, f32(dw)), zero_unless(ok, dx)

        saved = [jax.vmap(lambda b, i: b[i])(a, jnp.maximum(slot, 0)) for a in c["stash"]]
        dw, dx = run.vmap(stage)(res.recompute(chunk(params_rp, rep, r)), saved, g, valid)
        if r == 1:
            acc = jax.tree.map(lambda G, d: G + d[None].astype(G.dtype), c["dw"], dw)
        else:
            acc = jax.tree.map(lambda G, d: jax.vmap(lambda Gs, k, ds: Gs.at[k].add(ds.astype(Gs.dtype)),
                                                     in_axes=(1, 0, 0), out_axes=1)(G, jnp.maximum(rep, 0), d),
                               c["dw"], dw)
        first = valid & (ids == 0) & (rep == 0)
        return dict(c, b=run.roll(dx, -1) if roll else c["b"], dw=acc, dx=put_rows(c["dx"], mb, dx, first))

    return forward, loss, backward


def _results(carry, r, owned_ends):
    """((the loss, the aux sums), (d params, d x, d loss_params)) from the carry after the last tick."""
    aux = jax.tree.map(lambda a: a.sum(0), carry["aux"])
    d_params = jax.tree.map(lambda a: a[0], carry["dw"]) if r == 1 else carry["dw"]
    if owned_ends:  # each stage's own: stage 0's d x and the last stage's d loss_params, the rest zeros
        d_loss_params = carry["dl"]
        d_x = jax.vmap(unmicrobatch)(carry["dx"])
    else:
        d_loss_params = jax.tree.map(lambda a: a.sum(0), carry["dl"])
        d_x = unmicrobatch(from_stage(carry["dx"], 0))
    return (carry["loss"].sum(), aux), (d_params, f32(d_x), d_loss_params)


def _acc_dtype(a):
    return jnp.float32 if jnp.issubdtype(a.dtype, jnp.floating) else a.dtype
