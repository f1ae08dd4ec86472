"""A user's own jax.shard_map inside a partitioned function, as users write it: JAX's default check_vma=True
and check_vma=False, every collective, partial-manual regions, gradients, and the examples of JAX's shard_map
documentation. Each equals the function run unpartitioned (jax.jit), and explain() equals the compiled HLO."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from helpers import assert_close, assert_report_matches_hlo, gs, hlo_stats, randn

MESHES = {"8": {"i": 8}, "2x4": {"j": 2, "i": 4}}


def _bodies(mesh):
    """name -> (body, in_specs, out_specs, argument shapes); collectives over axis 'i'."""
    n = mesh.shape["i"]
    return {
        "psum": (lambda a: jax.lax.psum(a, "i"), P("i"), P(), [(8 * n, 4)]),
        "pmean": (lambda a: jax.lax.pmean(a, "i"), P("i"), P(), [(8 * n, 4)]),
        "pmax": (lambda a: jax.lax.pmax(a, "i"), P("i"), P(), [(8 * n, 4)]),
        "all_gather": (lambda a: jax.lax.all_gather(a, "i", tiled=True) * 2, P("i"), P("i"), [(8 * n, 4)]),
        "psum_scatter": (lambda a: jax.lax.psum_scatter(a, "i", tiled=True), P(None, "i"), P("i"), [(8 * n, 4 * n)]),
        "all_to_all": (lambda a: jax.lax.all_to_all(a, "i", 0, 1, tiled=True), P("i", None), P(None, "i"),
                       [(8 * n, 4 * n)]),
        "ppermute": (lambda a: jax.lax.ppermute(a, "i", [(k, (k + 1) % n) for k in range(n)]), P("i"), P("i"),
                     [(8 * n, 4)]),
        "axis_index": (lambda a: a * (jax.lax.axis_index("i") + 1).astype(a.dtype), P("i"), P("i"), [(8 * n, 4)]),
    }


def _wrapped(mesh, body, in_specs, out_specs, check_vma):
    """Global-view code around the region, so it is partitioned with the rest."""
    region = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma)

    def f(x):
        return jnp.tanh(region(jnp.sin(x) * 2.0)) + 1.0
    return f


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("name", list(_bodies(gs.make_mesh({"i": 8}))))
def test_collective_in_a_users_shard_map(name, mesh_name, check_vma):
    mesh = gs.make_mesh(MESHES[mesh_name])
    body, ins, outs, shapes = _bodies(mesh)[name]
    f = _wrapped(mesh, body, ins, outs, check_vma)
    x = randn(np.random.default_rng(0), *shapes[0])
    part = gs.partition(f, mesh)
    assert_close(part(x), jax.jit(f)(x))
    assert_report_matches_hlo(gs.explain(f, mesh, x), hlo_stats(part, x))
    if name == "pmax":
        return  # pmax has no transpose rule
    loss = lambda x: jnp.sum(f(x) ** 2)
    want = jax.jit(jax.grad(loss))(x)
    assert_close(jax.grad(lambda x: jnp.sum(part(x) ** 2))(x), want, rtol=1e-4, atol=1e-5)
    assert_close(gs.partition(jax.grad(loss), mesh)(x), want, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------------------------------------
# Examples of JAX's shard_map documentation ("Introduction to shard_map"), written as there.

def _docs_mesh():
    return gs.make_mesh({"i": 8})


def matmul_allgather_overlapped(lhs_block, rhs_block):
    """The documentation's collective matmul: lhs blocks travel round the ring while each is multiplied."""
    size = jax.lax.axis_size("i")
    idx = jax.lax.axis_index("i")
    shift = functools.partial(jax.lax.ppermute, axis_name="i", perm=[(i, (i + 1) % size) for i in range(size)])
    B = lhs_block.shape[1] // size
    lhs_blocks = lambda i: jax.lax.dynamic_slice_in_dim(lhs_block, i * B, B, 1)
    out_block = lhs_blocks(idx) @ rhs_block
    for i in range(1, size):
        rhs_block = shift(rhs_block)
        out_block += lhs_blocks((idx - i) % size) @ rhs_block
    return out_block


def test_docs_collective_matmul_inside_a_partitioned_function():
    mesh = _docs_mesh()
    rng = np.random.default_rng(1)
    lhs, rhs = randn(rng, 64, 128), randn(rng, 128, 32)
    region = jax.shard_map(matmul_allgather_overlapped, mesh=mesh, in_specs=(P("i", None), P("i", None)),
                           out_specs=P("i", None))

    def f(lhs, rhs):
        return jax.nn.relu(region(lhs * 0.5, rhs))

    part = gs.partition(f, mesh)
    assert_close(part(lhs, rhs), jax.jit(f)(lhs, rhs), rtol=1e-4, atol=1e-4)  # the reference under XLA's jit
    stats = hlo_stats(part, lhs, rhs)
    assert stats["collective-permute"]["count"] == 7
    assert_report_matches_hlo(gs.explain(f, mesh, lhs, rhs), stats)
    want = jax.jit(jax.grad(lambda a, b: jnp.sum(f(a, b) ** 2), argnums=(0, 1)))(lhs, rhs)
    got = jax.grad(lambda a, b: jnp.sum(part(a, b) ** 2), argnums=(0, 1))(lhs, rhs)
    assert_close(got, want, rtol=1e-4, atol=1e-3)


def test_docs_fsdp_inside_a_partitioned_function():
    """The documentation's FSDP: weights stored split over the batch axis, all-gathered in the body."""
    mesh = _docs_mesh()
    rng = np.random.default_rng(2)
    params = [(randn(rng, 16, 16) / 4, randn(rng, 16)) for _ in range(3)]
    x = randn(rng, 32, 16)

    def gather(p):
        return jax.lax.all_gather(p, "i", tiled=True)

    def predict(params, inputs):
        for W, b in params:
            outputs = jnp.dot(inputs, gather(W)) + gather(b)
            inputs = jax.nn.relu(outputs)
        return outputs

    def loss(params, batch):
        inputs, targets = batch
        predictions = predict(params, inputs)
        return jax.lax.pmean(jnp.mean(jnp.sum((predictions - targets) ** 2, axis=-1)), "i")

    region = jax.shard_map(loss, mesh=mesh, in_specs=P("i"), out_specs=P())
    f = lambda params, x: region(params, (x, jnp.roll(x, 1, axis=1)))
    part = gs.partition(f, mesh)
    assert_close(part(params, x), jax.jit(f)(params, x), rtol=1e-5, atol=1e-5)
    assert_report_matches_hlo(gs.explain(f, mesh, params, x), hlo_stats(part, params, x))
    want = jax.jit(jax.grad(f))(params, x)
    assert_close(gs.partition(jax.grad(f), mesh)(params, x), want, rtol=1e-4, atol=1e-5)
    assert_close(jax.grad(part)(params, x), want, rtol=1e-4, atol=1e-5)


def test_docs_spmd_pipeline_inside_a_partitioned_function():
    """The documentation's SPMD pipeline: stage weights split over the axis, activations shifted by ppermute."""
    mesh = _docs_mesh()
    L, M, B, F = 8, 4, 2, 16  # stages, microbatches, batch per microbatch, features
    rng = np.random.default_rng(3)
    W, xs = randn(rng, L, F, F) / 4, randn(rng, M, B, F)

    def predict(Ws, xs):
        (W,) = Ws  # one stage's layer
        n = jax.lax.axis_size("i")
        outs = jnp.zeros_like(xs)
        state = jnp.zeros_like(xs[0])
        for t in range(M + n - 1):
            state = jnp.where(jax.lax.axis_index("i") == 0, xs[t % M], state)
            state = jnp.tanh(state @ W)
            outs = jnp.where(jax.lax.axis_index("i") == n - 1, outs.at[(t - n + 1) % M].set(state), outs)
            state = jax.lax.ppermute(state, "i", [(k, (k + 1) % n) for k in range(n)])
        return jax.lax.psum(outs, "i") / 1.0

    region = jax.shard_map(lambda W, xs: predict(W, xs), mesh=mesh, in_specs=(P("i"), P()), out_specs=P())
    f = lambda W, xs: jnp.sum(region(W, xs) ** 2)

    def sequential(W, xs):
        y = xs
        for layer in range(L):
            y = jnp.tanh(y @ W[layer])
        return jnp.sum(y ** 2)

    part = gs.partition(f, mesh)
    assert_close(part(W, xs), sequential(W, xs), rtol=1e-4, atol=1e-4)
    assert_report_matches_hlo(gs.explain(f, mesh, W, xs), hlo_stats(part, W, xs))
    assert_close(jax.grad(part)(W, xs), jax.grad(sequential)(W, xs), rtol=1e-4, atol=1e-4)


def test_partial_manual_region_over_one_axis():
    """shard_map manual over 'i' only ({j 2, i 4}): 'j' stays automatic; the body sees arrays whole along it."""
    mesh = gs.make_mesh({"j": 2, "i": 4})
    rng = np.random.default_rng(4)
    x = randn(rng, 8, 16)
    region = jax.shard_map(lambda a: jax.lax.psum(a, "i"), mesh=mesh, in_specs=P(None, "i"), out_specs=P(),
                           axis_names={"i"})

    def f(x):
        return region(gs.shard(x, ("j", None)) * 2.0) + 1.0
    part = gs.partition(f, mesh)
    assert_close(part(x), jax.jit(f)(x))
    assert_report_matches_hlo(gs.explain(f, mesh, x), hlo_stats(part, x))
    assert_close(jax.grad(lambda x: jnp.sum(part(x) ** 2))(x), jax.grad(lambda x: jnp.sum(f(x) ** 2))(x),
                 rtol=1e-5, atol=1e-5)
