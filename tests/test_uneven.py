"""Dims whose size is not a multiple of their split are padded and masked: results equal unpartitioned."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gshard_jax as gs
from helpers import assert_close, check, get_mesh, hlo_counts, randn

OPS = {
    "elementwise": lambda x: jnp.tanh(x) * 2.0 + 1.0,
    "sum0": lambda x: x.sum(0),
    "sum_all": lambda x: jnp.sum(x),
    "mean1": lambda x: x.mean(1),
    "max0": lambda x: x.max(0),
    "min1": lambda x: x.min(1),
    "prod0": lambda x: jnp.prod(1.0 + 0.01 * x, axis=0),
    "any0": lambda x: jnp.any(x > 1.5, axis=0),
    "softmax0": lambda x: jax.nn.softmax(x, axis=0),
    "softmax1": lambda x: jax.nn.softmax(x, axis=1),
    "logsumexp": lambda x: jax.nn.logsumexp(x, axis=0),
    "argmax0": lambda x: jnp.argmax(x, axis=0),
    "argmin1": lambda x: jnp.argmin(x, axis=1),
    "cumsum0": lambda x: jnp.cumsum(x, axis=0),
    "cumsum_reverse": lambda x: jax.lax.cumsum(x, axis=0, reverse=True),
    "cummax1": lambda x: jax.lax.cummax(x, axis=1),
    "top_k": lambda x: jax.lax.top_k(x, 3),
    "matmul": lambda x: x.T @ x,
    "matmul_free": lambda x: x @ x.T,
    "transpose": lambda x: x.T + 1.0,
    "broadcast": lambda x: x[:, None, :] * x[:, :, None],
    "iota": lambda x: x + jnp.arange(x.shape[0], dtype=jnp.float32)[:, None],
}


@pytest.mark.parametrize("name", list(OPS))
def test_uneven_ops(mesh, rng, name):
    check(OPS[name], [randn(rng, 10, 7)], mesh, seed=len(name), n=6, uneven=True)


def test_ten_rows_on_eight_devices(rng):
    mesh = get_mesh("8")
    x = randn(rng, 10, 4)
    fn = lambda v: gs.split(jnp.cumsum(jax.nn.softmax(gs.split(v, 0, 8), axis=0), axis=0), 0, 8)
    assert_close(gs.partition(fn, mesh)(x), fn(x))
    report = gs.explain(fn, mesh, x)
    assert "x(pad)" in str(report.inputs[0].planned)


def test_vocabulary_50257_on_four(rng):
    """Logits split over an uneven vocabulary: cross-entropy, argmax and an embedding lookup."""
    mesh = gs.make_mesh({"data": 2, "model": 4})
    vocab = 50257
    h, w = randn(rng, 4, 8), randn(rng, 8, vocab) / 3
    targets = rng.integers(0, vocab, size=(4,)).astype(np.int32)

    def fn(h, w, t):
        logits = gs.shard(gs.shard(h, ("data", None)) @ gs.shard(w, (None, "model")), ("data", "model"))
        logz = jax.nn.logsumexp(logits, axis=-1)
        target = jnp.take_along_axis(logits, t[:, None], axis=-1)[:, 0]
        emb = jnp.take(gs.shard(w.T, ("model", None)), t, axis=0)
        return jnp.mean(logz - target), jnp.argmax(logits, axis=-1), emb

    f = gs.partition(fn, mesh)
    assert_close(f(h, w, targets), fn(h, w, targets), rtol=1e-5, atol=1e-5)
    counts = hlo_counts(f, h, w, targets)
    assert "all-gather" not in counts or counts["all-gather"] <= 2  # argmax candidates only, never the logits


def test_uneven_gather_and_scatter(mesh, rng):
    table, idx = randn(rng, 37, 6), rng.integers(0, 37, size=(10,)).astype(np.int32)
    check(lambda t, i: jnp.take(t, i, axis=0), [table, idx], mesh, seed=7, n=6, uneven=True)

    def grad(t, i, g):
        return jax.vjp(lambda tt: jnp.take(tt, i, axis=0), t)[1](g)[0]

    check(grad, [table, idx, randn(rng, 10, 6)], mesh, seed=8, n=6, uneven=True)


def test_uneven_grad_and_scan(rng):
    mesh = get_mesh("2x4")
    x, ws = randn(rng, 10, 6), randn(rng, 3, 6, 6) / 3

    def loss(x, ws):
        x = gs.shard(x, (("data", "model"), None))
        h = jax.lax.scan(lambda c, w: (gs.shard(jnp.tanh(c @ w), (("data", "model"), None)), None), x, ws)[0]
        return jnp.mean(h ** 2)

    want = jax.grad(loss, argnums=(0, 1))(x, ws)
    assert_close(gs.partition(jax.grad(loss, argnums=(0, 1)), mesh)(x, ws), want, rtol=1e-4, atol=1e-6)


def test_bool_max_min_uneven():
    mesh = get_mesh("8")
    b = np.array([True, False] * 5)
    for fn in (lambda v: jnp.max(gs.split(v, 0, 8)), lambda v: jnp.min(gs.split(v, 0, 8)),
               lambda v: jnp.all(gs.split(v, 0, 8)), lambda v: jnp.any(gs.split(~v, 0, 8))):
        assert bool(gs.partition(fn, mesh)(b)) == bool(fn(b))


def test_uneven_in_shardings(rng):
    mesh = get_mesh("8")
    x = randn(rng, 10, 4)
    f = gs.partition(lambda v: v * 2.0, mesh, in_shardings=(jax.sharding.PartitionSpec("x"),))
    assert_close(f(x), x * 2.0)
