"""Memory in the strategy choice: a windowed op keeps a split dim split (halo exchange) at any size.

These programs are a few KB per device, where two exchanges cost more time than one all-gather: a user
split the dim because the whole of it does not fit, so the gather is taken only where the profile says
memory is no concern.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import assert_close, assert_report_matches_hlo, gs, hlo_stats

DN = ("NHWC", "HWIO", "NHWC")


def _ints(rng, *shape):
    """Small integers in float32: partitioned and unpartitioned sums are exact."""
    return jnp.asarray(rng.integers(-3, 4, shape), jnp.float32)


def _conv(spec, stride=(1, 1), padding="SAME"):
    def f(x, w):
        x = gs.shard(x, spec)
        return gs.shard(jax.lax.conv_general_dilated(x, w, stride, padding, dimension_numbers=DN), spec)
    return f


def _maxpool(spec):
    def f(x):
        x = gs.shard(x, spec)
        return gs.shard(jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 3, 3, 1), (1, 1, 1, 1), "SAME"), spec)
    return f


def _avgpool(spec):
    def f(x):
        x = gs.shard(x, spec)
        return gs.shard(jax.lax.reduce_window(x, 0.0, jax.lax.add, (1, 3, 1, 1), (1, 1, 1, 1), "SAME"), spec)
    return f


def _shift(spec):
    def f(x):
        x = gs.shard(x, spec)
        return gs.shard(jnp.pad(x, ((0, 0), (2, 0), (0, 0), (0, 0)))[:, :-2], spec)
    return f


ROWS = (None, "x", None, None)
HW = (None, "a", "b", None)
CASES = {
    # name: (mesh axes, function, argument shapes)
    "7x1 conv, halo past the neighbour": ({"x": 8}, _conv(ROWS), [(1, 16, 8, 4), (7, 1, 4, 4)]),
    "3x3 conv, H and W over {2,4}": ({"a": 2, "b": 4}, _conv(HW), [(1, 16, 16, 4), (3, 3, 4, 4)]),
    "3x3 conv stride 2": ({"x": 8}, _conv(ROWS, (2, 2)), [(2, 32, 8, 4), (3, 3, 4, 4)]),
    "3x3 max pool, H and W over {2,4}": ({"a": 2, "b": 4}, _maxpool(HW), [(1, 16, 16, 4)]),
    "3x1 sum pool": ({"x": 8}, _avgpool(ROWS), [(2, 32, 8, 4)]),
    "shift right by 2 (pad then slice)": ({"x": 8}, _shift(ROWS), [(2, 32, 8, 4)]),
}


def _kinds(stats):
    return {k: v["count"] for k, v in stats.items() if v["count"]}


@pytest.mark.parametrize("name", list(CASES))
def test_small_windowed_ops_exchange_halos_instead_of_gathering(name):
    axes, fn, shapes = CASES[name]
    mesh = gs.make_mesh(axes)
    rng = np.random.default_rng(0)
    args = [_ints(rng, *s) for s in shapes]
    loss = lambda *a: jnp.sum(fn(*a) ** 2)
    for f in (fn, jax.grad(loss, argnums=tuple(range(len(args))))):
        part = gs.partition(f, mesh)
        assert_close(part(*args), f(*args), rtol=0, atol=0)
        stats = hlo_stats(part, *args)
        assert "all-gather" not in _kinds(stats) and _kinds(stats).get("collective-permute", 0) >= 1, \
            _kinds(stats)
        assert_report_matches_hlo(gs.explain(f, mesh, *args), stats)
        per_device = max(np.prod(s) for s in shapes) * 4 // 8
        assert per_device <= 2048  # a few KB per device: where a time-only cost model would gather


def test_a_profile_without_memory_concerns_may_gather_small_activations():
    axes, fn, shapes = CASES["3x3 conv, H and W over {2,4}"]
    mesh = gs.make_mesh(axes)
    rng = np.random.default_rng(1)
    args = [_ints(rng, *s) for s in shapes]
    roomy = dataclasses.replace(gs.partition(fn, mesh)._profile, name="roomy", memory_matters=False)
    part = gs.partition(fn, mesh, profile=roomy)
    assert_close(part(*args), fn(*args), rtol=0, atol=0)
    stats = hlo_stats(part, *args)
    assert "all-gather" in _kinds(stats)
    assert_report_matches_hlo(gs.explain(fn, mesh, *args, profile=roomy), stats)
    (row,) = [r for r in gs.explain(fn, mesh, *args, profile=roomy).rows if r.primitive == "conv_general_dilated"]
    # The row says what it holds: the whole 16x16x4 input and output (4 KiB each) and the 576-byte kernel.
    assert f"held whole ({(2 * 4096 + 576) / 1024:.1f}KiB per device): the profile says memory is no concern" \
        in row.strategy
