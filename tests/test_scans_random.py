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


def test_random_bits_count_each_value_by_its_64_bit_position():
    """Partitioned random bits are threefry of each value's global flat position, 64 bits as JAX's
    iota_2x32_shape counts it: an initialiser drawing more than 2**32 values (GShard's 512 and 2,048 experts)
    gets past 2**32 with the high word carried, not wrapped."""
    from gshard_jax.partitioner.strategies.hooks import mul_add_2x32
    rng = np.random.default_rng(0)
    x = rng.integers(0, 2 ** 32, 256, dtype=np.uint64)
    acc = rng.integers(0, 2 ** 63, 256, dtype=np.uint64)
    for c in (1, 2 ** 16 + 5, 2 ** 32 - 1, 2 ** 32 + 7, 2 ** 47 + 12345, 2 ** 63 + 99):
        hi, lo = mul_add_2x32(jnp.asarray(acc >> np.uint64(32), jnp.uint32),
                              jnp.asarray(acc & np.uint64(2 ** 32 - 1), jnp.uint32), jnp.asarray(x, jnp.uint32), c)
        got = (np.asarray(hi, np.uint64) << np.uint64(32)) | np.asarray(lo, np.uint64)
        assert got.tolist() == [(int(a) + int(b) * c) % 2 ** 64 for a, b in zip(acc, x)], c
    from jax._src.random import prng
    hi, lo = prng.iota_2x32_shape((3, 5))  # JAX's own counters: (high word, low word) of the flat position
    assert np.asarray(hi).tolist() == np.zeros((3, 5), int).tolist()
    assert np.asarray(lo).tolist() == np.arange(15).reshape(3, 5).tolist()
