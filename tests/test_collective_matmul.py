"""Collective matmul: a dot_general's all-gather or reduce-scatter run as a ring of collective-permutes.

Each case compares values and gradients with the unpartitioned function, reads the collectives off the
compiled HLO (no all-gather / reduce-scatter for the rewritten op; a loop of n - 1 trips with one permute per
direction) and holds explain() to it, statically (as the HLO lists them) and per call (trips counted).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import assert_close, assert_report_matches_hlo, gs, hlo_stats, randn

GPU_LIKE = gs.Hardware.uniform("overlapping-accelerator", bandwidth=50e9, latency=5e-6, flops=10e12,
                              overlap=True)


def _sp(x, w1):
    """The sequence-parallel pattern: rows of x split, gathered into a column-parallel matmul."""
    return gs.shard(gs.shard(x, ("model", None)) @ gs.shard(w1, (None, "model")), (None, "model"))


def _rp(h, w2):
    """Row-parallel: a contracting split whose partial sum leaves reduce-scattered over rows."""
    return gs.shard(gs.shard(h, (None, "model")) @ gs.shard(w2, ("model", None)), ("model", None))


def _fsdp(x, w):
    """FSDP: the weight stored split along its contracting dim, gathered for a batch-split matmul."""
    return gs.shard(gs.shard(x, ("data", None)) @ gs.shard(w, ("data", None)), ("data", None))


def _megatron_sp_mlp(x, w1, w2):
    """Megatron sequence-parallel MLP: all-gather into the column-parallel matmul, reduce-scatter out of the
    row-parallel one."""
    x = gs.shard(x, ("model", None))
    h = jax.nn.gelu(gs.shard(x @ gs.shard(w1, (None, "model")), (None, "model")))
    return gs.shard(h @ gs.shard(w2, ("model", None)), ("model", None))


def _kinds(stats):
    return {k: v["count"] for k, v in stats.items() if v["count"]}


def _rings(report):
    return [r.strategy for r in report.rows if r.strategy.startswith("collective matmul")]


def _ring_rows(report):
    return [r for r in report.rows if "/ring/" in "/" + r.primitive]


def _sent_per_call(report):
    """Permutes per call: each ring's loop runs n - 1 trips."""
    return report.totals(dynamic=True)["collective-permute"]["count"]


def _loss(fn):
    return lambda *a: jnp.sum(jnp.sin(fn(*a)))


@pytest.mark.parametrize("mode,streams", [("unidirectional", 1), ("bidirectional", 2)])
@pytest.mark.parametrize("fn,shapes,plain,ring", [
    (_sp, [(256, 128), (128, 512)], {"all-gather": 1}, "all-gather of operand 0 dim 0 over model"),
    (_rp, [(256, 512), (512, 128)], {"reduce-scatter": 1}, "reduce-scatter of the result dim 0 over model"),
], ids=["all-gather ring (free dim)", "reduce-scatter ring"])
def test_ring_replaces_the_plans_collective(fn, shapes, plain, ring, mode, streams):
    mesh = gs.make_mesh({"model": 8})
    rng = np.random.default_rng(0)
    args = [randn(rng, *s) for s in shapes]
    off = gs.partition(fn, mesh, collective_matmul="off")
    assert _kinds(hlo_stats(off, *args)) == plain
    f = gs.partition(fn, mesh, collective_matmul=mode)
    assert_close(f(*args), fn(*args), rtol=1e-4, atol=1e-3)
    stats = hlo_stats(f, *args)
    assert _kinds(stats) == {"collective-permute": streams}
    report = gs.explain(fn, mesh, *args, collective_matmul=mode)
    assert_report_matches_hlo(report, stats)
    assert f"({mode}, 7 steps): {ring}" in _rings(report)[0]
    (loop,) = _ring_rows(report)
    assert loop.trips == 7 and _sent_per_call(report) == 7 * streams
    # A trip sends on one piece (or accumulator) of an eighth, split over the directions: over the 7 trips,
    # 7/8 of the plain collective's payload.
    piece = (shapes[0][0] // 8) * (shapes[0][1] if fn is _sp else shapes[1][1]) * 4
    assert stats["collective-permute"]["payload_bytes"] == piece
    assert report.totals(dynamic=True)["collective-permute"]["payload_bytes"] == 7 * piece
    ours = f.lower(*args).compile().memory_analysis().temp_size_in_bytes
    assert ours <= off.lower(*args).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("mode", ["unidirectional", "bidirectional"])
def test_all_gather_ring_of_a_contracting_dim_fsdp(mode):
    mesh = gs.make_mesh({"data": 8})
    rng = np.random.default_rng(2)
    x, w = randn(rng, 1024, 1024) / 8, randn(rng, 1024, 128)  # a weight larger than the rows it multiplies
    plain = gs.partition(_fsdp, mesh, collective_matmul="off")
    assert _kinds(hlo_stats(plain, x, w)) == {"all-gather": 1}
    f = gs.partition(_fsdp, mesh, collective_matmul=mode)
    assert_close(f(x, w), _fsdp(x, w), rtol=1e-4, atol=1e-4)
    stats = hlo_stats(f, x, w)
    assert set(_kinds(stats)) == {"collective-permute"}
    report = gs.explain(_fsdp, mesh, x, w, collective_matmul=mode)
    assert_report_matches_hlo(report, stats)
    assert "all-gather of operand 1 dim 0 over data" in _rings(report)[0]
    # One partial product at a time (a loop, both directions in one matmul): an accumulator and a product of
    # the local result's size and the pieces in flight: less than the gathered weight where it dominates.
    temp = f.lower(x, w).compile().memory_analysis().temp_size_in_bytes
    assert temp <= plain.lower(x, w).compile().memory_analysis().temp_size_in_bytes
    # Gradients: of the partitioned function, and the partitioned gradient (its own rings).
    want = jax.grad(_loss(_fsdp), argnums=(0, 1))(x, w)
    assert_close(jax.grad(_loss(f), argnums=(0, 1))(x, w), want, rtol=1e-4, atol=1e-3)
    g = gs.partition(jax.grad(_loss(_fsdp), argnums=(0, 1)), mesh, collective_matmul=mode)
    assert_close(g(x, w), want, rtol=1e-4, atol=1e-3)
    stats = hlo_stats(g, x, w)
    assert "all-gather" not in _kinds(stats) and "reduce-scatter" not in _kinds(stats)
    assert_report_matches_hlo(gs.explain(jax.grad(_loss(_fsdp), argnums=(0, 1)), mesh, x, w,
                                         collective_matmul=mode), stats)


@pytest.mark.parametrize("mode", ["unidirectional", "bidirectional"])
def test_megatron_sequence_parallel_mlp_forward_and_backward(mode):
    mesh = gs.make_mesh({"model": 8})
    rng = np.random.default_rng(3)
    x, w1, w2 = randn(rng, 128, 64), randn(rng, 64, 256) / 8, randn(rng, 256, 64) / 16
    plain = gs.partition(_megatron_sp_mlp, mesh, collective_matmul="off")
    assert _kinds(hlo_stats(plain, x, w1, w2)) == {"all-gather": 1, "reduce-scatter": 1}
    f = gs.partition(_megatron_sp_mlp, mesh, collective_matmul=mode)
    assert_close(f(x, w1, w2), _megatron_sp_mlp(x, w1, w2), rtol=1e-4, atol=1e-4)
    stats = hlo_stats(f, x, w1, w2)
    streams = 1 if mode == "unidirectional" else 2
    assert _kinds(stats) == {"collective-permute": 2 * streams}
    report = gs.explain(_megatron_sp_mlp, mesh, x, w1, w2, collective_matmul=mode)
    assert_report_matches_hlo(report, stats)
    assert len(_ring_rows(report)) == 2 and _sent_per_call(report) == 2 * 7 * streams
    grad = jax.grad(_loss(_megatron_sp_mlp), argnums=(0, 1, 2))
    want = grad(x, w1, w2)
    assert_close(jax.grad(_loss(f), argnums=(0, 1, 2))(x, w1, w2), want, rtol=1e-4, atol=1e-4)
    g = gs.partition(grad, mesh, collective_matmul=mode)
    assert_close(g(x, w1, w2), want, rtol=1e-4, atol=1e-4)
    stats = hlo_stats(g, x, w1, w2)
    assert "all-gather" not in _kinds(stats) and "reduce-scatter" not in _kinds(stats)
    report = gs.explain(grad, mesh, x, w1, w2, collective_matmul=mode)
    assert_report_matches_hlo(report, stats)


def test_ring_over_one_axis_of_two_and_over_both():
    mesh = gs.make_mesh({"data": 2, "model": 4})
    rng = np.random.default_rng(4)
    x, w1 = randn(rng, 64, 16), randn(rng, 16, 256)
    sp = gs.partition(_sp, mesh, collective_matmul="bidirectional")
    assert_close(sp(x, w1), _sp(x, w1), rtol=1e-5, atol=1e-5)
    stats = hlo_stats(sp, x, w1)
    assert _kinds(stats) == {"collective-permute": 2}  # a loop of 3 trips over model's 4 devices, each way
    report = gs.explain(_sp, mesh, x, w1, collective_matmul="bidirectional")
    assert_report_matches_hlo(report, stats)
    assert _sent_per_call(report) == 6

    def both(x, w1):  # rows split over both axes (data major), gathered into a replicated result
        return gs.shard(gs.shard(x, (("data", "model"), None)) @ gs.replicate(w1), (None, None))

    f = gs.partition(both, mesh, collective_matmul="unidirectional")
    assert_close(f(x, w1), both(x, w1), rtol=1e-5, atol=1e-5)
    stats = hlo_stats(f, x, w1)
    assert _kinds(stats) == {"collective-permute": 1}
    report = gs.explain(both, mesh, x, w1, collective_matmul="unidirectional")
    assert_report_matches_hlo(report, stats)
    assert _sent_per_call(report) == 7
    assert "over data*model" in _rings(report)[0]
    assert_close(jax.grad(_loss(f), argnums=(0, 1))(x, w1), jax.grad(_loss(both), argnums=(0, 1))(x, w1),
                 rtol=1e-4, atol=1e-4)


def test_auto_takes_the_ring_only_where_the_profile_overlaps():
    mesh = gs.make_mesh({"model": 8})
    x = jax.ShapeDtypeStruct((8192, 2048), jnp.float32)
    w1 = jax.ShapeDtypeStruct((2048, 8192), jnp.float32)
    assert not _rings(gs.explain(_sp, mesh, x, w1))  # CPU devices: the CPU profile, which does not overlap
    assert not _rings(gs.explain(_sp, mesh, x, w1, profile=dataclasses_replace(GPU_LIKE, overlap=False)))
    assert len(_rings(gs.explain(_sp, mesh, x, w1, profile=GPU_LIKE))) == 1
    # Where a step's permute outlasts its block of the matmul, halves each way are faster.
    slow_links = dataclasses_replace(GPU_LIKE, intra_bandwidth=10e9, inter_bandwidth=10e9)
    (ring,) = _rings(gs.explain(_sp, mesh, x, w1, profile=slow_links))
    assert "bidirectional" in ring
    # Small operands: seven permute latencies cost more than one all-gather, even with overlap.
    small = (jax.ShapeDtypeStruct((64, 32), jnp.float32), jax.ShapeDtypeStruct((32, 64), jnp.float32))
    assert not _rings(gs.explain(_sp, mesh, *small, profile=GPU_LIKE))
    assert not _rings(gs.explain(_sp, mesh, x, w1, profile=GPU_LIKE, collective_matmul="off"))


def test_auto_ring_runs_and_equals_unpartitioned():
    mesh = gs.make_mesh({"model": 8})
    rng = np.random.default_rng(5)
    x, w1 = randn(rng, 512, 256), randn(rng, 256, 512)
    cheap_compute = gs.Hardware.uniform("slow-matmul", bandwidth=1e9, latency=1e-7, flops=1e9, overlap=True)
    f = gs.partition(_sp, mesh, profile=cheap_compute)
    assert_close(f(x, w1), _sp(x, w1), rtol=1e-5, atol=1e-4)
    stats = hlo_stats(f, x, w1)
    assert "all-gather" not in _kinds(stats) and _kinds(stats)["collective-permute"] in (1, 2)
    assert_report_matches_hlo(gs.explain(_sp, mesh, x, w1, profile=cheap_compute), stats)


def test_uneven_dims_keep_the_plain_collective():
    mesh = gs.make_mesh({"model": 8})
    rng = np.random.default_rng(6)
    x, w1 = randn(rng, 250, 16), randn(rng, 16, 64)
    f = gs.partition(_sp, mesh, collective_matmul="unidirectional")
    assert_close(f(x, w1), _sp(x, w1), rtol=1e-5, atol=1e-5)
    assert "collective-permute" not in _kinds(hlo_stats(f, x, w1))
    assert not _rings(gs.explain(_sp, mesh, x, w1, collective_matmul="unidirectional"))


def test_odd_pieces_run_unidirectional_when_bidirectional_is_asked():
    mesh = gs.make_mesh({"model": 8})
    rng = np.random.default_rng(7)
    x, w1 = randn(rng, 24, 16), randn(rng, 16, 64)  # 3 rows a piece: no halves
    f = gs.partition(_sp, mesh, collective_matmul="bidirectional")
    assert_close(f(x, w1), _sp(x, w1), rtol=1e-5, atol=1e-5)
    assert _kinds(hlo_stats(f, x, w1)) == {"collective-permute": 1}
    assert "(unidirectional, 7 steps)" in _rings(gs.explain(_sp, mesh, x, w1, collective_matmul="bidirectional"))[0]


def test_bad_mode_is_an_error_naming_the_choices():
    mesh = gs.make_mesh({"model": 8})
    with pytest.raises(ValueError, match="collective_matmul='sideways'.*'auto', 'off', 'unidirectional'"):
        gs.partition(_sp, mesh, collective_matmul="sideways")
    with pytest.raises(ValueError, match="collective_matmul='ring'"):
        gs.explain(_sp, mesh, jnp.zeros((8, 8)), jnp.zeros((8, 8)), collective_matmul="ring")


def dataclasses_replace(profile, **kw):
    import dataclasses
    return dataclasses.replace(profile, **kw)


def _bytes(stats):
    return sum(v["payload_bytes"] for v in stats.values())


@pytest.mark.parametrize("fn,shapes", [
    (_sp, [(256, 128), (128, 512)]),
    (_rp, [(256, 512), (512, 128)]),
    (_megatron_sp_mlp, [(256, 128), (128, 512), (512, 128)]),
    (jax.grad(_loss(_megatron_sp_mlp), argnums=(0, 1, 2)), [(256, 128), (128, 512), (512, 128)]),
])
def test_user_annotation_on_a_result_outranks_forward_propagation(fn, shapes):
    """The plain plans (no ring) of the sequence-parallel patterns move no more than XLA's partitioner: the
    annotated result keeps the user's split, so x is gathered, not the weight (and no all-to-all re-lays the
    result); in the backward pass the annotation's transpose reaches the cotangent through elementwise ops."""
    mesh = gs.make_mesh({"model": 8})
    rng = np.random.default_rng(8)
    args = [randn(rng, *s) / np.sqrt(s[0]) for s in shapes]
    ours = gs.partition(fn, mesh, collective_matmul="off")
    xla = gs.partition(fn, mesh, backend="xla")
    assert_close(ours(*args), xla(*args), rtol=1e-4, atol=1e-5)
    stats = hlo_stats(ours, *args)
    assert "all-to-all" not in _kinds(stats)
    assert _bytes(stats) <= _bytes(hlo_stats(xla, *args))
    assert_report_matches_hlo(gs.explain(fn, mesh, *args, collective_matmul="off"), stats)
