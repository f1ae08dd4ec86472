"""GShard (docs/references.md)'s per-op table: the collectives in the compiled HLO, one test per row."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gshard_jax as gs
from gshard_jax.models.moe import expert_einsums
from helpers import assert_close, hlo_counts, hlo_stats, randn

D = 8


@pytest.fixture(scope="module")
def mesh1d():
    return gs.make_mesh({"x": D})


def run(fn, mesh, *args):
    f = gs.partition(fn, mesh)
    assert_close(f(*args), fn(*args), rtol=1e-5, atol=1e-4)
    return hlo_counts(f, *args)


def test_add_split(mesh1d, rng):
    a, b = randn(rng, 16, 8), randn(rng, 16, 8)
    assert run(lambda a, b: gs.split(gs.split(a, 0, D) + gs.split(b, 0, D), 0, D), mesh1d, a, b) == {}


def test_matmul_contracting_split_all_reduce(mesh1d, rng):
    a, b = randn(rng, 16, 64), randn(rng, 64, 32)
    fn = lambda a, b: gs.replicate(gs.split(a, 1, D) @ gs.split(b, 0, D))
    assert run(fn, mesh1d, a, b) == {"all-reduce": 1}


def test_matmul_contracting_split_reduce_scatter(mesh1d, rng):
    a, b = randn(rng, 16, 64), randn(rng, 64, 32)
    fn = lambda a, b: gs.split(gs.split(a, 1, D) @ gs.split(b, 0, D), 0, D)
    assert run(fn, mesh1d, a, b) == {"reduce-scatter": 1}


def test_matmul_free_split(mesh1d, rng):
    a, b = randn(rng, 16, 64), randn(rng, 64, 32)
    fn = lambda a, b: gs.split(gs.split(a, 0, D) @ gs.replicate(b), 0, D)
    assert run(fn, mesh1d, a, b) == {}


def test_matmul_free_and_contracting_split(mesh1d, rng):
    # lhs split on A (free), rhs split on B (contracting): one operand is gathered.
    a, b = randn(rng, 16, 64), randn(rng, 64, 32)
    fn = lambda a, b: gs.split(gs.split(a, 0, D) @ gs.split(b, 0, D), 0, D)
    assert run(fn, mesh1d, a, b) == {"all-gather": 1}


def test_matmul_both_free_split(mesh1d, rng):
    # lhs split on A, rhs split on C, one mesh axis: the output can keep one split; the other operand is gathered.
    a, b = randn(rng, 16, 64), randn(rng, 64, 32)
    fn = lambda a, b: gs.split(gs.split(a, 0, D) @ gs.split(b, 1, D), 0, D)
    assert run(fn, mesh1d, a, b) == {"all-gather": 1}


def test_matmul_both_free_split_2d(rng):
    mesh = gs.make_mesh({"data": 2, "model": 4})
    a, b = randn(rng, 16, 64), randn(rng, 64, 32)
    fn = lambda a, b: gs.shard(gs.shard(a, ("data", None)) @ gs.shard(b, (None, "model")), ("data", "model"))
    assert run(fn, mesh, a, b) == {}


def test_reduce_kept_dim_split(mesh1d, rng):
    a = randn(rng, 16, 8)
    assert run(lambda a: gs.split(gs.split(a, 0, D).sum(1), 0, D), mesh1d, a) == {}


def test_reduce_reduced_dim_split(mesh1d, rng):
    a = randn(rng, 16, 8)
    assert run(lambda a: gs.replicate(gs.split(a, 0, D).sum(0)), mesh1d, a) == {"all-reduce": 1}


def test_batch_split_matmul(mesh1d, rng):
    a, b = randn(rng, 8, 4, 16), randn(rng, 8, 16, 4)
    fn = lambda a, b: gs.split(jnp.einsum("bij,bjk->bik", gs.split(a, 0, D), gs.split(b, 0, D)), 0, D)
    assert run(fn, mesh1d, a, b) == {}


def test_dispatch_einsum_all_to_all(mesh1d, rng):
    G, S, E, C, M = 8, 4, 8, 2, 16
    mask = (rng.random((G, S, E, C)) < 0.2).astype(np.float32)
    x = randn(rng, G, S, M)

    def fn(mask, x):
        out = jnp.einsum("GSEC,GSM->EGCM", gs.split(mask, 0, D), gs.split(x, 0, D))
        return gs.split(out, 0, D)

    assert run(fn, mesh1d, mask, x) == {"all-to-all": 1}


def moe_chain(dispatch, combine, x, wi, wo):
    return expert_einsums(dispatch, combine, x, wi, wo, D)


def moe_inputs(rng, G=8, S=8, E=8, C=4, M=16, H=32):
    dispatch = (rng.random((G, S, E, C)) < 0.1).astype(np.float32)
    combine = dispatch * rng.random((G, S, E, C)).astype(np.float32)
    return dispatch, combine, randn(rng, G, S, M), randn(rng, E, M, H), randn(rng, E, H, M)


def test_moe_chain_two_all_to_alls(mesh1d, rng):
    assert run(moe_chain, mesh1d, *moe_inputs(rng)) == {"all-to-all": 2}


def test_collective_stats_reads_mesh_replica_groups():
    """XLA's newer syntax names the group by mesh axes: replica_groups=mesh[...] {axes}."""
    line = ("  %ar = (f32[8]{0}, f32[]) all-reduce(%a, %b), channel_id=3, replica_groups=mesh['axis_0'=2,"
            "'axis_1'=4] {'axis_0'}, use_global_device_ids=true, to_apply=%add")
    stats = gs.collective_stats(line)["all-reduce"]
    # Two all-reduces combined into one instruction: 2(n-1)/n x 36 bytes moved with n=2.
    assert (stats["count"], stats["payload_bytes"], stats["moved_bytes"]) == (2, 36, 36.0)
    both = line.replace("{'axis_0'}", "{'axis_0','axis_1'}")
    assert gs.collective_stats(both)["all-reduce"]["moved_bytes"] == 2 * 7 / 8 * 36
    permuted = line.replace("'axis_1'=4] {'axis_0'}", "'axis_1'=4], device_ids=([2,4]T(1,0)) {'axis_1'}")
    assert gs.collective_stats(permuted)["all-reduce"]["moved_bytes"] == 2 * 3 / 4 * 36


def test_collective_stats_reads_xla_gpus_async_all_to_all():
    """XLA:GPU's all-to-all-start (as it compiles the MoE dispatch for an H100 target): a tuple of its operands,
    then its result; counted once, by its result, and its -done not again."""
    start = ("  %all-to-all-start.3 = ((f32[4,2,128,2,40]{4,3,2,1,0}), f32[4,2,128,2,40]{4,3,2,1,0}) "
             "all-to-all-start(%loop_transpose_fusion.11), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, "
             "dimensions={0}")
    done = "  %all-to-all-done.3 = f32[4,2,128,2,40]{4,3,2,1,0} all-to-all-done(%all-to-all-start.3)"
    stats = gs.collective_stats(start + "\n" + done)["all-to-all"]
    assert (stats["count"], stats["payload_bytes"], stats["moved_bytes"]) == (1, 4 * 2 * 128 * 2 * 40 * 4,
                                                                               3 / 4 * 4 * 2 * 128 * 2 * 40 * 4)


def test_xla_data_parallel_grad_bytes_are_counted(rng):
    """XLA's partitioned data-parallel grad all-reduces the weight gradient: the bytes must be counted."""
    mesh = gs.make_mesh({"data": 2, "model": 4})
    w, x = randn(rng, 16, 16), randn(rng, 8, 16)
    g = jax.grad(lambda w, x: jnp.sum(jnp.tanh(gs.shard(x, ("data", None)) @ w) ** 2))
    ours = hlo_stats(gs.partition(g, mesh), w, x)["all-reduce"]
    xla = hlo_stats(gs.partition(g, mesh, backend="xla"), w, x)["all-reduce"]
    assert xla["moved_bytes"] > 0 and xla["moved_bytes"] == ours["moved_bytes"]
