"""scan, while_loop, cond/switch: bodies partitioned, stable carries never resharded inside the loop."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import gshard_jax as gs
from helpers import assert_close, check, get_mesh, hlo_counts, randn

pytestmark = pytest.mark.newest_jax  # .ci/run runs this file on the newest supported JAX too


def layers(x, ws, data="data", model="model"):
    x = gs.shard(x, (data, None))

    def layer(h, w):
        w1, w2 = w
        a = jax.nn.relu(gs.shard(h @ gs.shard(w1, (None, model)), (data, model)))
        return gs.shard(h + a @ gs.shard(w2, (model, None)), (data, None)), jnp.mean(a)

    return jax.lax.scan(layer, x, ws)


def stacked(rng, n=3, d=16, f=32):
    return randn(rng, n, d, f) / 4, randn(rng, n, f, d) / 6


def test_scan_over_layers(rng):
    mesh = get_mesh("2x4")
    x, ws = randn(rng, 8, 16), stacked(rng)
    f = gs.partition(layers, mesh)
    assert_close(f(x, ws), layers(x, ws), rtol=1e-5, atol=1e-5)
    # Megatron per layer: one all-reduce over model in the body (plus the mean's), never a reshard of the carry.
    report = gs.explain(layers, mesh, x, ws)
    scan_row = [r for r in report.rows if r.primitive == "scan"][0]
    assert scan_row.collectives == [] and "carry [data, -]" in scan_row.strategy
    assert set(hlo_counts(f, x, ws)) == {"all-reduce"}


def test_data_parallel_scan_has_no_communication(rng):
    mesh = get_mesh("8")
    x, ws = randn(rng, 8, 16), stacked(rng)

    def fn(x, ws):
        x = gs.split(x, 0, 8)
        return jax.lax.scan(lambda h, w: (gs.split(jnp.tanh(h @ w[0]) @ w[1], 0, 8), None), x, ws)[0]

    f = gs.partition(fn, mesh)
    assert_close(f(x, ws), fn(x, ws), rtol=1e-5, atol=1e-5)
    assert hlo_counts(f, x, ws) == {}


def test_grad_through_scan(rng):
    mesh = get_mesh("2x4")
    x, ws = randn(rng, 8, 16), stacked(rng)
    loss = lambda x, ws: jnp.mean(layers(x, ws)[0] ** 2) + jnp.sum(layers(x, ws)[1])
    want = jax.grad(loss, argnums=(0, 1))(x, ws)
    assert_close(gs.partition(jax.grad(loss, argnums=(0, 1)), mesh)(x, ws), want, rtol=1e-4, atol=1e-5)


def test_while_loop_with_sharded_predicate(mesh, rng):
    def fn(x):
        def cond(c):
            return (jnp.sum(jnp.abs(c[0])) < 100.0) & (c[1] < 20)
        return jax.lax.while_loop(cond, lambda c: (c[0] * 1.5 + 0.1, c[1] + 1), (x, 0))

    check(fn, [randn(rng, 8, 4)], mesh, seed=1, n=4)


def test_vmapped_while_loop_runs_each_row_its_own_trips(mesh, rng):
    """jax.vmap of a while_loop whose trip count depends on the row: the loop's predicate holds a flag per row,
    and a row stops taking the body's result once its flag clears (a Newton square root to a per-row tolerance,
    with a key per row split each trip, as jax.random.poisson's sampler loops before JAX 0.12.1)."""
    def one(key, a):
        def body(c):
            i, k, y = c
            k, sub = jax.random.split(k)
            return i + 1, k, 0.5 * (y + a / y) + 1e-3 * jax.random.uniform(sub, a.shape)
        return jax.lax.while_loop(lambda c: (jnp.max(jnp.abs(c[2] ** 2 - a)) > 1e-2 * c[0]) & (c[0] < 30),
                                  body, (0, key, a + 1.0))

    def fn(x):
        keys = jax.random.split(jax.random.key(7), x.shape[0])
        trips, keys, y = jax.vmap(one)(keys, x)
        return trips, jax.random.key_data(keys), y

    x = jnp.abs(randn(rng, 8, 4)) * jnp.arange(1, 9, dtype=jnp.float32)[:, None] ** 3
    trips = jax.jit(fn)(x)[0]
    assert len(set(trips.tolist())) > 2, trips  # the rows stop at different trips
    check(fn, [x], mesh, seed=5, n=4)


def test_fori_loop(mesh, rng):
    check(lambda x: jax.lax.fori_loop(0, 4, lambda i, c: c @ c.T @ c * 0.1 + i, x), [randn(rng, 8, 8) / 3],
          mesh, seed=2, n=4)


def test_cond_and_switch(mesh, rng):
    def fn(x, y):
        a = jax.lax.cond(jnp.sum(x) > 0, lambda u, v: u @ v, lambda u, v: u @ v * -1.0, x, y)
        i = (jnp.sum(y > 0) % 3).astype(jnp.int32)
        b = jax.lax.switch(i, [lambda u: u.sum(0), lambda u: u.max(0), lambda u: u.min(0)], x)
        return a, b

    check(fn, [randn(rng, 8, 8), randn(rng, 8, 8)], mesh, seed=3, n=6)


class Block(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        h = gs.shard(h, ("data", None))
        a = nn.relu(nn.Dense(32, use_bias=False)(h))
        return gs.shard(h + nn.Dense(16, use_bias=False)(a), ("data", None)), None


class Stack(nn.Module):
    @nn.compact
    def __call__(self, x):
        scan = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
        return scan()(x, None)[0]


def test_flax_scan_over_layers(rng):
    mesh = get_mesh("2x4")
    x = randn(rng, 8, 16)
    params = Stack().init(jax.random.key(0), x)
    fn = lambda p, x: Stack().apply(p, x)
    f = gs.partition(fn, mesh)
    assert_close(f(params, x), fn(params, x), rtol=1e-5, atol=1e-5)
    assert not gs.explain(fn, mesh, params, x).fallbacks
