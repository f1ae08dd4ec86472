"""Embedding lookups, scatter-adds and slicing ops on split and unsplit dims."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gshard_jax as gs
from helpers import assert_close, check, get_mesh, hlo_counts, randn


def ids(rng, *shape, vocab=32):
    return rng.integers(0, vocab, size=shape).astype(np.int32)


LOOKUPS = {
    "take": lambda t, i: jnp.take(t, i, axis=0),
    "getitem": lambda t, i: t[i],
    "take_clip": lambda t, i: jnp.take(t, i, axis=0, mode="clip"),
    "take_fill_oob": lambda t, i: jnp.take(t, i + 30, axis=0, mode="fill", fill_value=-1.0),
    "take_along_axis": lambda t, i: jnp.take_along_axis(t, jnp.tile(i, (4, 1)) % 16, axis=1),
    "one_row_per_batch": lambda t, i: t[i[:, 0]],
}


@pytest.mark.parametrize("name", list(LOOKUPS))
def test_lookups_under_random_shardings(mesh, rng, name):
    table, idx = randn(rng, 32, 16), ids(rng, 8, 4)
    check(LOOKUPS[name], [table, idx], mesh, seed=len(name), n=8)


@pytest.mark.parametrize("out_split,collectives", [(False, {"all-reduce": 1}), (True, {"reduce-scatter": 1})])
def test_vocab_split_lookup_is_one_reduction(rng, out_split, collectives):
    """The partial sum of a vocabulary-split lookup: an all-reduce, or a reduce-scatter when the rows are split."""
    mesh = get_mesh("8")
    table, idx = randn(rng, 64, 16), ids(rng, 8, 4, vocab=64)
    out = (lambda y: gs.split(y, 0, 8)) if out_split else gs.replicate
    fn = lambda t, i: out(jnp.take(gs.split(t, 0, 8), gs.replicate(i), axis=0))
    f = gs.partition(fn, mesh)
    assert_close(f(table, idx), fn(table, idx))
    assert hlo_counts(f, table, idx) == collectives


def test_feature_split_and_index_parallel_lookups_need_no_communication(rng):
    mesh = get_mesh("2x4")
    table, idx = randn(rng, 64, 16), ids(rng, 8, 4, vocab=64)
    fn = lambda t, i: gs.shard(jnp.take(gs.shard(t, (None, "model")), gs.shard(i, ("data", None)), axis=0),
                               ("data", None, "model"))
    f = gs.partition(fn, mesh)
    assert_close(f(table, idx), fn(table, idx))
    assert hlo_counts(f, table, idx) == {}


def test_embedding_gradient_scatter_add(mesh, rng):
    table, idx = randn(rng, 32, 16), ids(rng, 8, 4)

    def grad(t, i, g):
        return jax.vjp(lambda tt: jnp.take(tt, i, axis=0), t)[1](g)[0]

    check(grad, [table, idx, randn(rng, 8, 4, 16)], mesh, seed=5, n=8)


def test_scatter_add_vocab_split_with_batch_split_updates(rng):
    mesh = get_mesh("2x4")
    table, idx, upd = randn(rng, 32, 16), ids(rng, 8, 4), randn(rng, 8, 4, 16)

    def fn(t, i, u):
        t = gs.shard(jnp.asarray(t), ("model", None))
        return gs.shard(t.at[gs.shard(i, ("data", None))].add(gs.shard(u, ("data", None, None))), ("model", None))

    f = gs.partition(fn, mesh)
    assert_close(f(table, idx, upd), fn(table, idx, upd))
    assert hlo_counts(f, table, idx, upd) == {"all-reduce": 1}  # the partial sum over data


SLICING = {
    "slice": lambda x: x[2:6, 1:],
    "slice_whole_rows": lambda x: x[:, :3],
    "pad": lambda x: jnp.pad(x, ((1, 2), (0, 0))),
    "pad_cols": lambda x: jnp.pad(x, ((0, 0), (2, 1)), constant_values=3.0),
    "concatenate": lambda x: jnp.concatenate([x, 2 * x], axis=0),
    "concatenate_cols": lambda x: jnp.concatenate([x, x[:, :2]], axis=1),
    "rev": lambda x: x[::-1],
    "dynamic_slice": lambda x: jax.lax.dynamic_slice_in_dim(x, 3, 4, axis=0),
    "dynamic_update_slice": lambda x: jax.lax.dynamic_update_slice_in_dim(x, jnp.ones((8, 2)), 1, axis=1),
    "strided": lambda x: x[::2],
}


@pytest.mark.parametrize("name", list(SLICING))
def test_slicing_ops(mesh, rng, name):
    check(SLICING[name], [randn(rng, 8, 8)], mesh, seed=len(name), n=6)


def test_gather_fill_mode_on_an_unsplit_indexed_dim(rng):
    mesh = get_mesh("8")
    t = np.arange(64.0, dtype=np.float32).reshape(16, 4)
    i, j = np.array([0, 3, 9, 15], np.int32), np.array([0, 1, 7, 2], np.int32)  # (9, 7) is out of range
    fn = lambda t, i, j: gs.split(jnp.asarray(t), 0, 8).at[i, j].get(mode="fill")
    assert_close(gs.partition(fn, mesh)(t, i, j), fn(t, i, j))


def test_scatter_clip_mode_on_an_unsplit_indexed_dim(rng):
    mesh = get_mesh("8")
    op, u = np.zeros((16, 4), np.float32), np.array([1.0, 2, 3, 4], np.float32)
    i, j = np.array([1, 5, 9, 14], np.int32), np.array([0, 7, 2, 3], np.int32)  # column 7 clamps to 3
    fn = lambda o, i, j, u: gs.split(jnp.asarray(o), 0, 8).at[i, j].add(u, mode="clip")
    assert_close(gs.partition(fn, mesh)(op, i, j, u), fn(op, i, j, u))


@pytest.mark.parametrize("combine", ["min", "max", "multiply"])
def test_scatter_combiners_on_a_split_operand(rng, combine):
    """x.at[i].min / .max / .multiply (scatter-min, -max, -mul) with the indexed dim split: each device applies
    the updates landing in its rows (repeated indices included), without the replicated fallback."""
    mesh = get_mesh("2x4")
    op, u = randn(rng, 16, 8), randn(rng, 12, 8)
    i = np.array([0, 3, 3, 5, 8, 9, 9, 9, 12, 15, 2, 7], np.int32)
    fn = lambda o, i, u: getattr(gs.shard(jnp.asarray(o), ("data", "model")).at[i], combine)(u)
    assert not gs.explain(fn, mesh, op, i, u).fallbacks
    assert_close(gs.partition(fn, mesh)(op, i, u), fn(op, i, u))


def test_per_row_slot_reads_and_writes_keep_their_other_dims_split():
    """buf[s, k[s]] read and buf[s, k[s]] += u[s] per row s (a pipeline's per-stage stash): the slot's whole
    window dims stay split, on every shard (a shard other than the first must not drop its part)."""
    mesh = gs.make_mesh({"stage": 4, "expert": 2})
    rng = np.random.default_rng(0)
    buf, upd = randn(rng, 4, 3, 8, 6), randn(rng, 4, 8, 6)
    k = np.array([2, 0, 1, 2], np.int32)

    def f(buf, upd, k):
        buf = gs.shard(buf, ("stage", None, "expert"))
        read = jax.vmap(lambda b, i: b[i])(buf, k)
        wrote = jax.vmap(lambda b, i, u: b.at[i].add(u))(buf, k, gs.shard(upd, ("stage", "expert")))
        return gs.shard(read, ("stage", "expert")), gs.shard(wrote, ("stage", None, "expert"))

    jitted = gs.partition(f, mesh)
    assert_close(jitted(buf, upd, k), f(buf, upd, k))
    assert "all-gather" not in hlo_counts(jitted, buf, upd, k)
    g = gs.partition(jax.grad(lambda b, u: jnp.sum(f(b, u, k)[0] ** 2) + jnp.sum(f(b, u, k)[1] ** 3)), mesh)
    want = jax.grad(lambda b, u: jnp.sum(f(b, u, k)[0] ** 2) + jnp.sum(f(b, u, k)[1] ** 3))(buf, upd)
    assert_close(g(buf, upd), want)
