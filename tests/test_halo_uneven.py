"""Halo exchange on uneven splits and strided slices (issue 63, item 2): collective-permutes, no all-gather.

A dim of 30 rows over 8 devices is stored padded (4 rows a shard, the last shard half padding). An uneven
value inside the program (a slice, a convolution on it, a pad back to an even length) keeps its split and
exchanges only the rows valid results read; a strided slice keeps its split (each device's results come from
its own rows and a few of its neighbour's), and so does its gradient (a pad with interior padding, whose
shards start at different dilation phases). Results equal jax.jit's exactly (integer-valued float32); the
bytes are compared with XLA's partitioner on the same annotations. An uneven *program output* still leaves
gathered: jax.jit cannot return an uneven sharding (IndivisibleError), nor can XLA's partitioner.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import assert_report_matches_hlo, gs, hlo_stats

DN = ("NHWC", "HWIO", "NHWC")
ROWS4, ROWS3 = (None, "x", None, None), (None, "x", None)


def _ints(rng, *shape):
    return rng.integers(-2, 3, shape).astype(np.float32)


def _conv_inside(n: int, lo: int, rows: int):
    """rows [lo, lo + rows) of an n-row split input (uneven over 8), a SAME conv on them, padded back to n."""
    def f(x, w):
        z = jax.lax.conv_general_dilated(gs.shard(x, ROWS4)[:, lo:lo + rows], w, (1, 1), "SAME",
                                         dimension_numbers=DN)
        return gs.shard(jnp.pad(z, ((0, 0), (lo, n - lo - rows), (0, 0), (0, 0))), ROWS4)
    return f


def _strided(start: int, stop: int, stride: int):
    """x[:, start:stop:stride] of a split dim, zero-filled to a multiple of 8 rows (an even output)."""
    def f(x):
        y = gs.shard(x, ROWS3)[:, start:stop:stride]
        return gs.shard(jnp.pad(y, ((0, 0), (0, -y.shape[1] % 8), (0, 0))), ROWS3)
    return f


def _grads(f):
    def loss(*args):
        y = f(*args)
        return jnp.sum(y * (jnp.arange(y.size).reshape(y.shape) % 5 - 2).astype(y.dtype))
    return jax.grad(loss, argnums=tuple(range(f.__code__.co_argcount)))


def _bytes(stats) -> dict:
    return {k: v["payload_bytes"] for k, v in stats.items() if v["count"]}


def _compare(f, args) -> tuple[dict, dict]:
    """Ours == jax.jit exactly, explain() == HLO, no all-gather; (ours, XLA's) payload bytes by kind."""
    mesh = gs.make_mesh({"x": 8})
    part = gs.partition(f, mesh)
    for a, b in zip(jax.tree_util.tree_leaves(part(*args)), jax.tree_util.tree_leaves(jax.jit(f)(*args))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    stats = hlo_stats(part, *args)
    assert_report_matches_hlo(gs.explain(f, mesh, *args), stats)
    ours = _bytes(stats)
    assert set(ours) <= {"collective-permute", "all-reduce"}, ours  # all-reduce: a weight gradient's sum
    return ours, _bytes(hlo_stats(gs.partition(f, mesh, backend="xla"), *args))


CONVS = [(32, 1, 30, 3), (32, 2, 27, 3), (32, 2, 27, 5), (16, 3, 9, 3), (16, 3, 9, 7)]


@pytest.mark.parametrize("n,lo,rows,k", CONVS)
def test_conv_on_an_uneven_dim_exchanges_halos(n, lo, rows, k, rng):
    """30, 27 and 9 rows over 8 (9: shards of 2, shard 4 holds one row, 5-7 none; a 7x7 window reads 3 rows
    each side, two hops), forward and gradient: collective-permutes only (and the kernel gradient's
    all-reduce); within XLA's bytes for 30 and 27 rows."""
    x, w = _ints(rng, 2, n, 8, 4), _ints(rng, k, k, 4, 4)
    f = _conv_inside(n, lo, rows)
    for g in (f, _grads(f)):
        ours, xla = _compare(g, (x, w))
        assert ours["collective-permute"] > 0
        if n == 32:
            assert sum(ours.values()) <= sum(xla.values()), (ours, xla)


SLICES = [(2, 62, 2), (0, 64, 2), (1, 64, 2), (5, 63, 2), (1, 60, 3), (5, 64, 3), (0, 61, 4), (2, 58, 4),
          (1, 47, 3)]


@pytest.mark.parametrize("start,stop,stride", SLICES)
def test_strided_slice_of_a_split_dim_keeps_it_split(start, stop, stride, rng):
    """Strides 2-4, offsets 0-5, ends inside the array, sliced lengths not divisible by 8: collective-permutes
    only, forward and gradient. Where the slice cuts fewer rows at either end than it returns (the rule
    carries the split across), no more bytes than XLA's partitioner (less for stride 3, where only rows valid
    results read are sent). x[1:47:3] cuts 17 rows for 15 results: its halo takes two hops of whole blocks
    (13 rows against XLA's 11)."""
    x = _ints(rng, 4, 64, 8)
    f = _strided(start, stop, stride)
    carried = max(start, 64 - stop) < len(range(start, stop, stride))
    for g in (f, _grads(f)):
        ours, xla = _compare(g, (x,))
        assert not carried or sum(ours.values()) <= sum(xla.values()), (ours, xla)


def test_stride_three_sends_only_the_rows_valid_results_read(rng):
    """x[1:60:3]: 20 results padded to 24 (3 a shard); shard 7 holds only padding and reads nothing, so the
    halo is 5 rows (shard 5's), not the 7 its window spans: 640 bytes against XLA's 768."""
    ours, xla = _compare(_strided(1, 60, 3), (_ints(rng, 4, 64, 8),))
    assert ours == {"collective-permute": 640} and xla == {"collective-permute": 768}


def test_uneven_program_output_gathers_once_with_fewer_halo_bytes_than_xla(rng):
    """The boundary: a 3x3 conv on 30 input rows returns 30 rows, which jax.jit cannot return split, so both
    partitioners gather it once on exit; the halo itself is 2 collective-permutes against XLA's 3."""
    mesh = gs.make_mesh({"x": 8})
    x, w = _ints(rng, 4, 30, 16, 16), _ints(rng, 3, 3, 16, 4)

    def f(x, w):
        return jax.lax.conv_general_dilated(gs.shard(x, ROWS4), w, (1, 1), "SAME", dimension_numbers=DN)
    ours = hlo_stats(gs.partition(f, mesh), x, w)
    xla = hlo_stats(gs.partition(f, mesh, backend="xla"), x, w)
    np.testing.assert_array_equal(np.asarray(gs.partition(f, mesh)(x, w)), np.asarray(jax.jit(f)(x, w)))
    assert ours["all-gather"]["count"] == xla["all-gather"]["count"] == 1
    assert ours["collective-permute"]["payload_bytes"] < xla["collective-permute"]["payload_bytes"]
