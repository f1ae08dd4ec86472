"""Resharding between every pair of shardings is exact, and uses the collective the order prescribes."""
import random

import numpy as np
import pytest

import gshard_jax as gs
from gshard_jax.partitioner.representation.sharding import Sharding
from gshard_jax.partitioner.strategies import reshard as RS
from helpers import all_specs, assert_close, hlo_counts, randn


def _identity_partitioned(mesh, src, dst):
    return gs.partition(lambda x: gs.shard(gs.shard(x, src) * 1.0, dst), mesh)


def test_every_pair_is_exact(mesh, rng):
    shape = (8, 4, 8)
    specs = all_specs(shape, mesh)
    pairs = [(a, b) for a in specs for b in specs]
    random.Random(0).shuffle(pairs)
    x = randn(rng, *shape)
    for src, dst in pairs[:25]:
        f = gs.partition(lambda x: gs.shard(gs.shard(x, src) + 0.0, dst), mesh, out_shardings=dst)
        assert_close(f(x), x, rtol=0, atol=0)


@pytest.mark.parametrize("src,dst,kind", [
    ((None,), ("x",), None),                      # all-slice: no communication
    (("x",), (None,), "all-gather"),
    (("x", None), (None, "x"), "all-to-all"),
])
def test_single_collective_1d(src, dst, kind):
    mesh = gs.make_mesh({"x": 8})
    x = np.arange(64 * 8, dtype=np.float32).reshape(64, 8) if len(src) == 2 else np.arange(64, dtype=np.float32)
    f = gs.partition(lambda v: gs.shard(gs.shard(v, src) + 1.0, dst), mesh, in_shardings=(src,), out_shardings=dst)
    assert_close(f(x), x + 1.0, rtol=0, atol=0)
    counts = hlo_counts(f, x)
    assert counts == ({} if kind is None else {kind: 1})


def test_permute_for_swapped_axes():
    mesh = gs.make_mesh({"a": 2, "b": 4})
    src, dst = Sharding((("a", "b"),)), Sharding((("b", "a"),))
    steps = RS.plan(src, dst, (16,), dict(mesh.shape), mesh.axis_names)
    assert [s.kind for s in steps] == ["collective-permute"]
    x = np.arange(16, dtype=np.float32)
    f = gs.partition(lambda v: gs.shard(v + 1.0, (("b", "a"),)), mesh, in_shardings=((("a", "b"),),),
                     out_shardings=(("b", "a"),))
    assert_close(f(x), x + 1.0, rtol=0, atol=0)
    assert hlo_counts(f, x) == {"collective-permute": 1}


def test_partial_to_split_is_reduce_scatter():
    shape, mesh_shape = (8, 8), {"x": 8}
    src = Sharding(((), ()), frozenset({"x"}))
    assert [s.kind for s in RS.plan(src, Sharding((("x",), ())), shape, mesh_shape, ["x"])] == ["reduce-scatter"]
    assert [s.kind for s in RS.plan(src, Sharding(((), ())), shape, mesh_shape, ["x"])] == ["all-reduce"]


def test_slice_before_all_to_all():
    mesh_shape = {"x": 2, "y": 4}
    steps = RS.plan(Sharding((("x",), (), ())), Sharding(((), ("x",), ("y",))), (8, 8, 8), mesh_shape, ["x", "y"])
    assert [s.kind for s in steps] == ["all-slice", "all-to-all"]
