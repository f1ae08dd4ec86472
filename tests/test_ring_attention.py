"""Ring attention (models/ring_attention.py): a sequence split over `context`, K/V rotating by collective-permute
with an online softmax, forward and backward, against plain unsplit attention on the natural order; the
compiled program moves K/V only by permutes; zigzag order balances the causal work."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jcore

import gshard_jax as gs
from gshard_jax.models import ring_attention as R
from helpers import assert_close, assert_per_step_matches_hlo, assert_report_matches_hlo, hlo_stats, randn

B, L, H, D = 2, 128, 4, 8
MESHES = {"context8": {"context": 8}, "data2xcontext4": {"data": 2, "context": 4}}
_meshes: dict = {}


def mesh_of(name):
    if name not in _meshes:
        _meshes[name] = gs.make_mesh(MESHES[name])
    return _meshes[name]


def qkv(seed=0, kv_heads=H):
    rng = np.random.default_rng(seed)
    return randn(rng, B, L, H, D), randn(rng, B, L, kv_heads, D), randn(rng, B, L, kv_heads, D)


def weights():
    """A fixed cotangent, so the loss's gradient is not symmetric in anything."""
    return np.asarray(np.random.default_rng(7).standard_normal((B, L, H, D)), np.float32)


def ring_fns(mesh, causal, layout, batch_axes=(), block_size=512):
    """(forward, grad w.r.t. q, k, v) partitioned, taking and giving the natural order (the zigzag permutation
    and its inverse applied outside, where a model enters and leaves context parallelism)."""
    n = dict(mesh.shape)["context"]
    zz = causal and layout == "zigzag"
    perm = (lambda x: R.zigzag(x, n)) if zz else (lambda x: x)
    inv = (lambda x: R.unzigzag(x, n)) if zz else (lambda x: x)
    attn = lambda q, k, v: R.ring_attention(q, k, v, causal=causal, layout=layout, batch_axes=batch_axes,
                                            block_size=block_size)
    w = perm(weights())
    loss = lambda q, k, v: jnp.sum(attn(q, k, v) * w)
    fwd, grad = gs.partition(attn, mesh), gs.partition(jax.grad(loss, argnums=(0, 1, 2)), mesh)
    return (lambda *a: inv(fwd(*map(perm, a))),
            lambda *a: tuple(inv(g) for g in grad(*map(perm, a))), fwd, grad, perm)


def reference(causal, args):
    attn = lambda q, k, v: R.reference_attention(q, k, v, causal=causal)
    w = weights()
    grad = jax.grad(lambda q, k, v: jnp.sum(attn(q, k, v) * w), argnums=(0, 1, 2))
    return jax.jit(attn)(*args), jax.jit(grad)(*args)


# (mesh, causal, layout, k/v heads, key tile): chunks are 8 positions on context8 under zigzag, 16 contiguous
CASES = [("context8", True, "zigzag", H, 512), ("context8", False, "zigzag", H, 512),
         ("context8", True, "contiguous", H, 512), ("data2xcontext4", True, "zigzag", H, 512),
         ("data2xcontext4", False, "contiguous", H, 512), ("context8", True, "zigzag", 2, 512),
         ("data2xcontext4", True, "contiguous", 1, 512), ("context8", True, "zigzag", H, 4),
         ("context8", True, "contiguous", 2, 4), ("data2xcontext4", False, "contiguous", H, 8)]


@pytest.mark.parametrize("mesh_name,causal,layout,kv_heads,block_size", CASES)
def test_forward_and_gradients_equal_unsplit_attention(mesh_name, causal, layout, kv_heads, block_size):
    mesh = mesh_of(mesh_name)
    args = qkv(kv_heads=kv_heads)
    fwd, grad, *_ = ring_fns(mesh, causal, layout, batch_axes=("data",) if "data" in mesh.shape else (),
                             block_size=block_size)
    want_out, want_grads = reference(causal, args)
    assert_close(fwd(*args), want_out, rtol=1e-5, atol=1e-5)
    assert_close(grad(*args), want_grads, rtol=1e-5, atol=1e-5)


def test_the_gradient_is_a_ring_too_and_holds_no_whole_sequence():
    """partition(grad(f)): the custom_vjp's backward runs (K/V and dK/dV rotate: 4 permutes per step, plus the
    last hop of dK/dV), no all-gather anywhere, explain() lists the permutes and equals the compiled HLO, and
    no array of the per-device program spans the whole sequence (only its blocks)."""
    mesh = mesh_of("context8")
    args = qkv()
    *_, grad, perm = ring_fns(mesh, True, "zigzag")
    xs = [perm(a) for a in args]
    stats = hlo_stats(grad, *xs)
    assert stats["all-gather"]["count"] == 0 and stats["all-to-all"]["count"] == 0
    per_step = gs.collective_stats(grad.lower(*xs).compile(), per_step=True)["collective-permute"]
    n, block = 8, B * (L // 8) * H * D * 4
    # forward k, v; backward dk, dv from the local block, then k, v, dk, dv from the saved first block, and
    # dk, dv home
    assert per_step["count"] == 2 * (n - 1) + 2 + 4 * (n - 2) + 2
    assert per_step["payload_bytes"] == per_step["count"] * block
    report = gs.explain(_grad_fn(), mesh, *xs)
    regions = [r for r in report.rows if r.primitive == "shard_map"]
    assert [len(r.collectives) for r in regions] == [4, 8]  # the first step of each ring peeled
    assert {c.kind for r in regions for c in r.collectives} == {"collective-permute"}
    assert not report.fallbacks
    assert_report_matches_hlo(report, stats)
    # per step: the permutes inside the ring's loops count each trip, as the compiled program runs them
    assert report.totals(dynamic=True)["collective-permute"]["count"] == per_step["count"]
    assert_per_step_matches_hlo(report, grad.lower(*xs).compile())
    (call,) = jax.make_jaxpr(grad)(*xs).eqns
    (program,) = [e for e in call.params["jaxpr"].eqns if e.primitive.name == "shard_map"]
    assert max(_length_dims(program.params["jaxpr"])) == L // 8  # the per-device program: blocks only


def _grad_fn():
    """ring_fns's gradient on {context 8}, causal, zigzag (the function, for explain)."""
    w = R.zigzag(weights(), 8)
    return jax.grad(lambda q, k, v: jnp.sum(R.ring_attention(q, k, v) * w), argnums=(0, 1, 2))


def _length_dims(jaxpr):
    """The second dim of every rank-4 array in a jaxpr and the jaxprs nested in it (the sequence dim of the
    [B, L, H, D] values; the logits' blocks are rank 5)."""
    out = [0]
    for e in jaxpr.eqns:
        for v in list(e.invars) + list(e.outvars):
            shape = getattr(getattr(v, "aval", None), "shape", ())
            if len(shape) == 4:
                out.append(shape[1])
        for sub in jcore.jaxprs_in_params(e.params):
            out += _length_dims(sub)
    return out


def test_the_data_axis_splits_the_batch_and_moves_nothing():
    """{data 2, context 4} with batch_axes=("data",): the only collectives are the ring's permutes."""
    mesh = mesh_of("data2xcontext4")
    args = qkv()
    *_, grad, perm = ring_fns(mesh, True, "zigzag", batch_axes=("data",))
    stats = hlo_stats(grad, *[perm(a) for a in args])
    assert {k for k, s in stats.items() if s["count"]} == {"collective-permute"}


def test_grad_of_the_partitioned_function_and_xlas_partitioner_agree():
    """grad(partition(f)) (our per-device program differentiated: the ring backward too) and backend="xla" give
    the same numbers."""
    mesh = mesh_of("context8")
    args = [R.zigzag(a, 8) for a in qkv()]
    w = R.zigzag(weights(), 8)
    loss = lambda q, k, v: jnp.sum(R.ring_attention(q, k, v) * w)
    want = gs.partition(jax.grad(loss, argnums=(0, 1, 2)), mesh)(*args)
    outer = jax.jit(jax.grad(gs.partition(loss, mesh), argnums=(0, 1, 2)))
    assert_close(outer(*args), want, rtol=1e-5, atol=1e-5)
    # the region's custom_vjp is kept in the per-device program, so its ring backward runs in this order too
    per_step = gs.collective_stats(outer.lower(*args).compile(), per_step=True)["collective-permute"]
    assert per_step["count"] == 2 * 7 + 2 + 4 * 6 + 2
    assert_close(gs.partition(jax.grad(loss, argnums=(0, 1, 2)), mesh, backend="xla")(*args), want,
                 rtol=1e-5, atol=1e-5)


def test_outside_a_partition_it_is_plain_attention():
    args = qkv()
    assert_close(R.ring_attention(*args), R.reference_attention(*args), rtol=1e-6, atol=1e-6)


def test_zigzag_is_a_permutation_and_unzigzag_inverts_it():
    x = np.arange(2 * 32).reshape(2, 32)
    z = np.asarray(R.zigzag(x, 4))
    assert z[0].tolist() == [0, 1, 2, 3, 28, 29, 30, 31, 4, 5, 6, 7, 24, 25, 26, 27,
                             8, 9, 10, 11, 20, 21, 22, 23, 12, 13, 14, 15, 16, 17, 18, 19]
    assert (np.asarray(R.unzigzag(z, 4)) == x).all()
    assert (np.asarray(R.zigzag_indices(32, 4)) == z[0]).all()


def _work(blocks):
    return sum(1.0 if kind == R.FULL else 0.5 for _, _, kind in blocks)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_the_schedule_covers_the_causal_triangle_once_and_zigzag_balances_it(n):
    for layout, chunks in (("zigzag", 2 * n), ("contiguous", n)):
        sched = R.schedule(n, causal=True, layout=layout)
        blocks = [b for dev in sched for step in dev for b in step]
        # every (query chunk, key chunk) at or below the diagonal exactly once, the diagonal masked
        assert sorted((a, b) for a, b, _ in blocks) == [(a, b) for a in range(chunks) for b in range(a + 1)]
        assert all((kind == R.DIAG) == (a == b) for a, b, kind in blocks)
    zig = [_work([b for step in dev for b in step]) for dev in R.schedule(n, layout="zigzag")]
    con = [_work([b for step in dev for b in step]) for dev in R.schedule(n, layout="contiguous")]
    assert len(set(zig)) == 1 and zig[0] == 2 * n  # 2n blocks of (S/2n)^2 each: the causal half, shared evenly
    assert con == [i + 0.5 for i in range(n)]  # device i: i full blocks and its diagonal
    # and per step every zigzag device computes the same (ring steps stay in lockstep)
    for s in range(n):
        assert len({len(dev[s]) for dev in R.schedule(n, layout="zigzag")}) == 1
    noncausal = R.schedule(n, causal=False)
    assert all(len(step) == 1 and step[0][2] == R.FULL for dev in noncausal for step in dev)
