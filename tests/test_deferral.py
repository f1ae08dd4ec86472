"""Reductions deferred past loops (partitioner/strategies/deferral.py): accumulators found as data, and the partitioned
loops against jax.jit, the compiled HLO (explain() equal to it) and the collectives one step executes."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import gshard_jax as gs
from gshard_jax.partitioner.representation.program import from_jaxpr
from gshard_jax.partitioner.strategies import control_flow as CF, deferral as DF
from helpers import assert_per_step_matches_hlo, assert_report_matches_hlo

K, B, D = 4, 32, 16  # trips, batch, width


def loss(w, x):
    return jnp.sum(jnp.tanh(x @ w) ** 2)


def _accumulators(fn, *args):
    program = from_jaxpr(jax.make_jaxpr(fn)(*args))
    loop = next(e for e in program.eqns if e.name in CF.FORMS)
    body, cin, cout, _ = CF.FORMS[loop.name].carries(loop)
    return DF.accumulators(body, cin, cout)


def _scan(summand, carry_extra=None):
    def fn(w, xs):
        def body(acc, x):
            s = summand(w, x, acc)
            return acc + s, None
        return jax.lax.scan(body, jnp.zeros_like(w), xs)[0]
    return fn


W = jnp.zeros((D, D))
XS = jnp.zeros((K, B, D))
# (summand in the body, whether the carry is an accumulator, the ops of its chain from the add back to its
# leaves, depth first)
PATTERNS = [
    (lambda w, x, acc: jax.grad(loss)(w, x), True, ["transpose", "dot_general"]),
    (lambda w, x, acc: jax.grad(loss)(w, x).astype(jnp.bfloat16).astype(jnp.float32), True,
     ["convert_element_type", "convert_element_type", "transpose", "dot_general"]),
    (lambda w, x, acc: jax.grad(loss)(w, x) + jax.grad(loss)(w, 2 * x), True,
     ["add", "transpose", "dot_general", "transpose", "dot_general"]),
    (lambda w, x, acc: jnp.sum(x, 0).reshape(1, D).T * jnp.ones((1, D)), True, ["mul"]),  # a mul: a leaf
    (lambda w, x, acc: acc * 0.5, False, None),  # reads the carry twice: not an accumulator
]


@pytest.mark.parametrize("summand,found,chain", PATTERNS)
def test_accumulators_as_data(summand, found, chain):
    program = from_jaxpr(jax.make_jaxpr(_scan(summand))(W, XS))
    loop = next(e for e in program.eqns if e.name == "scan")
    body, cin, cout, _ = CF.FORMS["scan"].carries(loop)
    accs = DF.accumulators(body, cin, cout)
    assert bool(accs) == found
    if found:
        made = {v: e.name for e in body.eqns for v in e.outvars}
        assert [made[v] for v, _ in accs[0].chain] == chain


def test_a_summand_used_elsewhere_is_not_a_chain():
    def fn(w, xs):
        def body(acc, x):
            g = jax.grad(loss)(w, x)
            return acc + g, g.sum()  # g also leaves the loop
        return jax.lax.scan(body, jnp.zeros_like(w), xs)
    (acc,) = _accumulators(fn, W, XS) or [None]
    assert acc is None


def test_a_squeeze_keeps_the_chain_and_maps_dims():
    def fn(v, xs):
        def body(acc, x):
            return acc + jnp.sum(x, (0,), keepdims=True).reshape(D), None
        return jax.lax.scan(body, jnp.zeros_like(v), xs)[0]
    (acc,) = _accumulators(fn, jnp.zeros(D), XS)
    assert [d for _, d in acc.chain] == [(0,), (None, 0), (0,)]  # reshape, keepdims broadcast, reduce_sum


def _measure(fn, args, ins, outs=None):
    mesh = gs.make_mesh({"data": 8})
    report = gs.explain(fn, mesh, *args, in_shardings=ins, out_shardings=outs)
    f = gs.partition(fn, mesh, in_shardings=ins, out_shardings=outs)
    compiled = f.lower(*args).compile()
    np.testing.assert_allclose(np.asarray(compiled(*args)), np.asarray(jax.jit(fn)(*args)), rtol=1e-5, atol=1e-5)
    assert_report_matches_hlo(report, gs.collective_stats(compiled))
    assert_per_step_matches_hlo(report, compiled)
    return report


def _args():
    r = np.random.default_rng(0)
    return (jnp.asarray(r.standard_normal((D, D)), jnp.float32),
            jnp.asarray(r.standard_normal((K, B, D)), jnp.float32))


def test_gradient_accumulation_reduces_once_per_step():
    report = _measure(_scan(lambda w, x, acc: jax.grad(loss)(w, x)), _args(), (P(), P(None, "data")))
    per_step = report.totals(dynamic=True)
    assert per_step["all-reduce"]["count"] == 1 and per_step["all-reduce"]["payload_bytes"] == D * D * 4
    (row,) = [r for r in report.rows if r.collectives]
    assert row.primitive == "scan" and row.trips == 1
    assert f"reduction of an accumulator deferred past the loop: {K - 1} reductions of each saved" in row.strategy


def test_a_split_accumulator_is_reduce_scattered_after_the_loop():
    """ZeRO-2: the gradient's result split over data; carried whole and partial, reduce-scattered once."""
    report = _measure(_scan(lambda w, x, acc: jax.grad(loss)(w, x)), _args(), (P(), P(None, "data")),
                      P("data", None))
    per_step = report.totals(dynamic=True)
    assert per_step["reduce-scatter"]["count"] == 1 and per_step["all-reduce"]["count"] == 0


def test_while_and_fori_loops_defer_too():
    def gram(x):  # a partial sum over the data-split batch, with no forward value left for XLA to drop
        return jnp.einsum("bi,bj->ij", x, x)

    def fori(w, xs):
        return jax.lax.fori_loop(0, K, lambda i, acc: acc + gram(xs[i]), jnp.zeros_like(w))

    def while_(w, xs):
        def body(c):
            i, acc = c
            return i + 1, acc + gram(xs[i])
        return jax.lax.while_loop(lambda c: c[0] < K, body, (0, jnp.zeros_like(w)))[1]
    for fn in (fori, while_):
        report = _measure(fn, _args(), (P(), P(None, "data")))
        assert report.totals(dynamic=True)["all-reduce"]["count"] == 1, fn.__name__
        assert any("deferred past the loop" in r.strategy for r in report.rows)


def test_a_non_linear_use_of_the_sum_stays_in_the_loop():
    """max(acc, g) is no sum: every trip reduces g before it."""
    def fn(w, xs):
        def body(acc, x):
            return jnp.maximum(acc, jax.grad(loss)(w, x)), None
        return jax.lax.scan(body, jnp.zeros_like(w), xs)[0]
    report = _measure(fn, _args(), (P(), P(None, "data")))
    assert report.totals(dynamic=True)["all-reduce"]["count"] == K
    assert not any("deferred" in r.strategy for r in report.rows)


@pytest.mark.parametrize("policy", [None, jax.checkpoint_policies.dots_saveable])
def test_a_summand_made_under_remat_is_deferred_too(policy):
    """A weight gradient made inside a checkpointed region (jax.checkpoint / nn.remat: its dot runs in the
    region's recomputed backward) still chains to the accumulator outside it: one all-reduce per step."""
    def summand(w, x, acc):
        return jax.grad(jax.checkpoint(loss, policy=policy))(w, x)
    report = _measure(_scan(summand), _args(), (P(), P(None, "data")))
    assert report.totals(dynamic=True)["all-reduce"]["count"] == 1
    assert any("deferred past the loop" in r.strategy for r in report.rows)


def test_a_deferred_summand_takes_no_ring():
    """ZeRO-2 (the sum split over data): collective_matmul="bidirectional" would run the gradient's reduce-scatter
    as a ring of permutes on every trip; kept partial, the summand is reduce-scattered once after the loop and
    its dot takes no ring."""
    fn, args, ins = _scan(lambda w, x, acc: jax.grad(loss)(w, x)), _args(), (P(), P(None, "data"))
    mesh = gs.make_mesh({"data": 8})
    kw = dict(in_shardings=ins, out_shardings=P("data", None), collective_matmul="bidirectional")
    report = gs.explain(fn, mesh, *args, **kw)
    per_step = report.totals(dynamic=True)
    assert per_step["reduce-scatter"]["count"] == 1 and per_step["collective-permute"]["count"] == 0
    f = gs.partition(fn, mesh, **kw)
    np.testing.assert_allclose(np.asarray(f(*args)), np.asarray(jax.jit(fn)(*args)), rtol=1e-5, atol=1e-5)


def test_a_sum_of_partial_sums_is_reduced_once():
    """dX = dQ Wq' + dK Wk' + dV Wv' of column-parallel projections on {data 2, model 4}: the three products are
    partial over model; added as partial sums, they are reduced once (three all-reduces with it disabled)."""
    def f(x, wq, wk, wv):
        return jnp.sum(jnp.tanh(x @ wq) * jnp.tanh(x @ wk) * jnp.tanh(x @ wv))
    g = jax.grad(f)
    r = np.random.default_rng(0)
    args = [jnp.asarray(r.standard_normal(s), jnp.float32) for s in [(8, 16), (16, 32), (16, 32), (16, 32)]]
    ins = (P("data", None), P(None, "model"), P(None, "model"), P(None, "model"))
    mesh = gs.make_mesh({"data": 2, "model": 4})
    report = gs.explain(g, mesh, *args, in_shardings=ins)
    compiled = gs.partition(g, mesh, in_shardings=ins).lower(*args).compile()
    np.testing.assert_allclose(np.asarray(compiled(*args)), np.asarray(jax.jit(g)(*args)), rtol=1e-5, atol=1e-5)
    assert_report_matches_hlo(report, gs.collective_stats(compiled))
    assert report.totals(dynamic=True)["all-reduce"]["count"] == 1
    assert any("partial sums added, then reduced once" in r.strategy for r in report.rows)
    with DF.disabled():
        assert gs.explain(g, mesh, *args, in_shardings=ins).totals(dynamic=True)["all-reduce"]["count"] == 3
