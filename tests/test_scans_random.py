"""Cumulative ops, sort, top_k and argmax along split dims; random numbers equal to unpartitioned."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gshard_jax as gs
from helpers import assert_close, check, get_mesh, hlo_counts, randn

SCANS = {
    "cumsum0": lambda x: jnp.cumsum(x, axis=0),
    "cumsum1": lambda x: jnp.cumsum(x, axis=1),
    "cumsum_reverse": lambda x: jax.lax.cumsum(x, axis=0, reverse=True),
    "cumprod": lambda x: jnp.cumprod(1.0 + 0.1 * x, axis=0),
    "cummax": lambda x: jax.lax.cummax(x, axis=0),
    "cummin_reverse": lambda x: jax.lax.cummin(x, axis=0, reverse=True),
    "cumlogsumexp": lambda x: jax.lax.cumlogsumexp(x, axis=0),
    "cumsum_int": lambda x: jnp.cumsum((x > 0).astype(jnp.int32), axis=0),
    "sort": lambda x: jnp.sort(x, axis=0),
    "argsort": lambda x: jnp.argsort(x, axis=1),
    "top_k": lambda x: jax.lax.top_k(x.T, 3),
    "top_k_rows": lambda x: jax.lax.top_k(x, 2),
    "argmax": lambda x: jnp.argmax(x, axis=0),
}


@pytest.mark.parametrize("name", list(SCANS))
def test_scans_and_selections(mesh, rng, name):
    check(SCANS[name], [randn(rng, 16, 8)], mesh, seed=len(name), n=6, rtol=1e-5, atol=1e-5)


def test_split_cumsum_uses_one_small_all_gather(rng):
    mesh = get_mesh("8")
    x = randn(rng, 64, 32)
    fn = lambda v: gs.split(jnp.cumsum(gs.split(v, 0, 8), axis=0), 0, 8)
    f = gs.partition(fn, mesh)
    assert_close(f(x), fn(x), rtol=1e-5, atol=1e-4)
    stats = gs.collective_stats(f.lower(x).compile())
    assert stats["all-gather"]["count"] == 1 and stats["all-gather"]["payload_bytes"] == 8 * 32 * 4


def test_split_top_k_gathers_candidates_only(rng):
    mesh = get_mesh("8")
    x = randn(rng, 64, 32768)  # big enough that gathering the operand costs more than two small gathers
    fn = lambda v: jax.lax.top_k(gs.split(v, 1, 8), 2)
    f = gs.partition(fn, mesh)
    assert_close(f(x), fn(x))
    stats = gs.collective_stats(f.lower(x).compile())
    assert stats["all-gather"]["payload_bytes"] == 2 * (64 * 2 * 8 * 4)  # values + indices, k*8 each


@pytest.mark.parametrize("sampler", ["normal", "uniform", "bernoulli", "randint", "bits"])
def test_random_numbers_equal_unpartitioned(mesh, sampler):
    key = jax.random.key(42)
    draw = {
        "normal": lambda k: jax.random.normal(k, (16, 8)),
        "uniform": lambda k: jax.random.uniform(k, (16, 8)),
        "bernoulli": lambda k: jax.random.bernoulli(k, 0.3, (16, 8)).astype(jnp.float32),
        "randint": lambda k: jax.random.randint(k, (16, 8), 0, 100).astype(jnp.float32),
        "bits": lambda k: jax.random.bits(k, (16, 8)).astype(jnp.float32),
    }[sampler]
    names = tuple(mesh.axis_names)

    def fn(k, x):
        return gs.shard(draw(k) + x, (names[0], names[1:] or None))

    x = np.zeros((16, 8), np.float32)
    want = fn(key, x)
    f = gs.partition(fn, mesh)
    np.testing.assert_array_equal(np.asarray(f(key, x)), np.asarray(want))
    assert [r.primitive for r in gs.explain(fn, mesh, key, x).fallbacks] == []


def test_dropout_mask_in_split_layer(rng):
    mesh = get_mesh("2x4")
    x = randn(rng, 8, 32)

    def fn(k, v):
        v = gs.shard(v, ("data", "model"))
        keep = jax.random.bernoulli(k, 0.9, v.shape)
        return gs.shard(jnp.where(keep, v / 0.9, 0.0), ("data", "model")), keep

    key = jax.random.key(0)
    f = gs.partition(fn, mesh)
    (got, got_keep), (want, want_keep) = f(key, x), fn(key, x)
    np.testing.assert_array_equal(np.asarray(got_keep), np.asarray(want_keep))
    assert_close(got, want, rtol=1e-6, atol=0)
    assert hlo_counts(f, key, x) == {}


@pytest.mark.parametrize("split_dim", [0, 1])
def test_top_k_along_a_leading_axis(split_dim):
    mesh = get_mesh("8")
    x = np.asarray(jax.random.normal(jax.random.key(0), (4096, 32)))
    fn = lambda v: jax.lax.top_k(gs.split(v, split_dim, 8), 2, axis=0)
    assert_close(gs.partition(fn, mesh)(x), fn(x))
