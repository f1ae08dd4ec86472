"""Programs that random testing found wrong, each reduced to its smallest form (issue: real programs)."""
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import gshard_jax as gs
from helpers import assert_report_matches_hlo, hlo_counts, hlo_stats

M222 = {"a": 2, "b": 2, "c": 2}
M24 = {"a": 2, "b": 4}


def same(fn, mesh_axes, *args, **kw):
    """Partitioned equals unpartitioned, dtypes included; the report equals the compiled program."""
    mesh = gs.make_mesh(mesh_axes)
    want, f = jax.jit(fn)(*args), gs.partition(fn, mesh, **kw)
    got = f(*args)
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        assert np.asarray(g).dtype == np.asarray(w).dtype and np.shape(g) == np.shape(w)
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6)
    kw_explain = {k: v for k, v in kw.items() if k in ("in_shardings", "out_shardings")}
    assert_report_matches_hlo(gs.explain(fn, mesh, *args, **kw_explain), hlo_stats(f, *args))


def test_pad_edge_mode():  # empty intermediate arrays once divided by zero in the reshape rule
    x = np.random.default_rng(0).standard_normal((4, 12, 6)).astype(np.float32)
    same(lambda x: jnp.pad(x, ((0, 0), (2, 2), (0, 0)), mode="edge"), M222, x)


def test_take_of_bools_stays_bool():  # a partial sum of bools was all-reduced as int32
    b = np.random.default_rng(1).random((8, 5, 2)) < 0.5
    idx = np.array([3, -1, 7], np.int32)
    same(lambda b, i: jnp.take(gs.shard(b, (None, ("b",), "a")), i, axis=1, mode="wrap"), M222, b, idx)
    same(lambda b: jnp.take(gs.shard(b, (None, "b", None)), 1, axis=2), M222, b)


def test_scatter_add_into_a_padded_split():  # XLA folded a dropped update's read into the wrong element
    v = np.arange(12, dtype=np.float32) + 0.5
    for i in (0, 5, 11, -1):
        same(lambda v, i, c: gs.shard(v, ("b",)).at[i].add(c), M24, v, np.int32(i), np.float32(2.0),
             out_shardings=((("b", "a"),),))


def test_dynamic_slice_with_a_clamped_start():  # XLA folded a following slice and clamped only the sum
    x = np.arange(48, dtype=np.float32).reshape(4, 12)
    for i in (0, 2, 7, -3):
        same(lambda x, i: gs.shard(lax.dynamic_slice(x, (i, i), (4, 8)), (("c", "a"), "b")), M222, x, np.int32(i))


def test_all_to_all_between_padded_dims():  # XLA:CPU's verifier rejected the emitted all-to-all
    rng = np.random.default_rng(2)
    x, v = rng.standard_normal((2, 2, 8)).astype(np.float32), rng.standard_normal(2).astype(np.float32)

    def fn(x, v):
        x4 = gs.shard(x, (None, None, "b"))
        y = jnp.einsum("abc,b->bca", x4, v).transpose(1, 2, 0)
        return jnp.einsum("abc,cdb->da", x4, gs.shard(y, (None, ("b", "a"), None)))

    same(fn, M24, x, v)


def test_concatenate_and_uneven_split_slice():  # once hung: two all-gathers with one channel id
    x = np.random.default_rng(3).standard_normal((2, 5)).astype(np.float32)

    def fn(x):
        v2 = gs.shard(x, (None, "a"))
        v3 = jnp.concatenate([v2, v2], 0)
        v5 = gs.split(v2, 1, 8)[:, :4]
        return gs.shard(v3, ("b",)), v5, v2

    same(fn, M24, x)


def test_per_output_spec_tuples_for_two_outputs():
    same(lambda a, b: (a * 2, b + 1), {"x": 8}, np.arange(16.0), np.arange(8.0), out_shardings=(("x",), ("x",)),
         in_shardings=(("x",), ("x",)))


def test_a_constant_shared_by_differently_split_values_is_not_re_laid():
    """Two uses of the same broadcast constant, one row- and one column-split (optax's lamb and adafactor do
    this for every parameter of a shape): each makes its own, so nothing moves."""
    mesh = gs.make_mesh({"data": 2, "model": 4})
    a, b = np.ones((8, 8), np.float32), np.ones((8, 8), np.float32)

    def fn(a, b):
        a, b = gs.shard(a, ("model", None)), gs.shard(b, (None, "model"))
        return gs.shard(jnp.where(a > 0, jnp.ones_like(a), a), ("model", None)), \
            gs.shard(jnp.where(b > 0, jnp.ones_like(b), b), (None, "model"))

    f = gs.partition(fn, mesh)
    for got, want in zip(f(a, b), fn(a, b)):
        np.testing.assert_array_equal(got, want)
    assert hlo_counts(f, a, b) == {}


def test_a_count_of_a_constant_mask_is_folded_not_reduced():
    """A MoE router's count of valid choices (the sum of a mask of ones, over split dims) is a constant, as
    XLA's simplifier folds it: no all-reduce is planned, in a loop or out of it, and the numbers stay exact."""
    mesh = gs.make_mesh({"data": 4, "model": 2})
    x = np.arange(64.0, dtype=np.float32).reshape(8, 8)

    def fn(x):
        x = gs.shard(x, ("data", "model"))
        valid = gs.shard(jnp.ones(x.shape, bool), ("data", "model"))  # split, as a router's mask is
        count = jnp.maximum(jnp.sum(valid), 1)
        top = jnp.max(gs.shard(jnp.full(x.shape, 3, jnp.int32), ("data", "model")))
        body = lambda c, _: (c + x / jnp.sum(valid.astype(jnp.float32)), None)  # noqa: E731
        y, _ = jax.lax.scan(body, x, None, length=3)
        inexact = jnp.sum(gs.shard(jnp.full((8, 6), 0.1, jnp.float32), ("data", "model")))  # 48 x 0.1f: left
        return y * count + top, inexact

    f = gs.partition(fn, mesh)
    for got, want in zip(f(x), jax.jit(fn)(x)):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    report = gs.explain(fn, mesh, x)
    reduced = [r for r in report.rows if r.collectives and "reduce" in r.primitive]
    assert len(reduced) == 1 and reduced[0].collectives[0].shape == ()  # only the inexact float sum
    assert_report_matches_hlo(report, hlo_stats(f, x))


def test_an_identity_slice_of_another_global_shape_is_resharded_on_its_own():
    """Random program 100418: a slice that is the identity on a device's block holds the same local array as
    its operand; their reshards (to leave the program) pad and cut to different global shapes."""
    mesh = gs.make_mesh({"a": 4, "b": 2})

    def fn(x):
        v10 = gs.shard(jnp.logical_not(gs.shard(x, (None, "a"))), (None, "b"))
        v12 = gs.shard(jnp.roll(v10, -5, axis=1), (None, ("b", "a")))
        return v12[:, :3], v10

    x = np.random.default_rng(0).random((1, 7)) < 0.5
    got, want = gs.partition(fn, mesh)(x), jax.jit(fn)(x)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        np.testing.assert_array_equal(g, w)


def test_a_value_merged_with_one_a_checkpointed_region_reads():
    """Random program: an expression computed twice, once returned and once passed into jax.checkpoint, is
    merged into one value; the region reads the caller's values (its sub-program aliases them), so it reads
    the merged one, whichever of the two came first and however often the region and its caller use it."""
    v = np.random.default_rng(4).standard_normal(80).astype(np.float32)
    r = lambda v: lax.rsqrt(v * v + 1.0)  # noqa: E731
    region = jax.checkpoint(lambda a: gs.split(jnp.sin(a), 0, 2) + 1.0)
    same(lambda v: (r(v), region(r(v))), M24, v)  # as found: the returned copy first
    same(lambda v: (region(r(v)), r(v)), M24, v)  # the region's copy first
    same(lambda v: jax.checkpoint(lambda x, y: gs.split(x * jnp.sin(y), 0, 2))(r(v), r(v)), M24, v)
    same(lambda v: (r(v), jax.checkpoint(lambda x, v: gs.split(x * jnp.sin(r(v)), 0, 2))(r(v), v)), M24, v)
    nested = jax.checkpoint(lambda x: jax.checkpoint(lambda y: gs.split(jnp.sin(y), 0, 2))(x) + r(x))
    same(lambda v: (r(v), nested(r(v))), M24, v)
    same(jax.value_and_grad(lambda v: jnp.sum(r(v) * region(r(v)))), M24, v)  # remat in the backward pass
