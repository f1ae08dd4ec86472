"""Pipelined models: the same loss and gradients as the unpipelined model with gradient accumulation."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gshard_jax as gs
from gshard_jax.models import pipelined as PM, transformer as T
from gshard_jax.models.moe import MoeConfig
from gshard_jax.models.pipelined import PipelineConfig
from gshard_jax.pipelines import schedules as S
from helpers import assert_report_matches_hlo, hlo_stats, ragged_all_to_all_emulated_on_cpu

B, L, V = 16, 8, 64


def _config(moe, exchange="auto", **kw) -> T.TransformerConfig:
    """moe: False, True (GShard's einsum dispatch) or "dropless" (sort + grouped matmul in a manual region,
    its tokens moved to their experts by `exchange`)."""
    dispatch = "dropless" if moe == "dropless" else "einsum"
    fields = dict(vocab_size=V, d_model=32, num_heads=2, head_dim=16, d_ff=64, num_layers=8, scan=True,
                  moe=MoeConfig(num_experts=4, d_ff=32, dispatch=dispatch, exchange=exchange) if moe else None,
                  moe_every=1)
    return T.TransformerConfig(**dict(fields, **kw))


def _batch(seed=0):
    k = jax.random.split(jax.random.key(seed), 2)
    return {"inputs": jax.random.randint(k[0], (B, L), 0, V), "targets": jax.random.randint(k[1], (B, L), 0, V)}


def _reference(model, params, batch, m):
    """Gradient accumulation over microbatches of rows i, i + m, ... (as train.microbatches splits)."""
    def mean_loss(params):
        losses = [T.loss_fn(model, params, {k: v[i::m] for k, v in batch.items()})[0] for i in range(m)]
        return sum(losses) / m
    return jax.jit(jax.value_and_grad(mean_loss))(params)


def _pipelined_loss(cfg, pc):
    model = T.DecoderLM(dataclasses.replace(cfg, pipeline=pc))
    return lambda params, batch: jax.value_and_grad(lambda p: T.loss_fn(model, p, batch)[0])(params)


def _stored(params, pc):
    """Layer-ordered params as the pipelined model stores them, and its gradients back in layer order."""
    flags, layers, piped = PM.stacked(params), PM.order_key(None), PM.order_key(pc)
    return PM.reorder(params, flags, layers, piped), lambda out: (out[0], PM.reorder(out[1], flags, piped, layers))


def _jit(f):
    return jax.jit(f)


def _assert_same(got, want):
    (loss, grads), (ref_loss, ref_grads) = got, want
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)


CASES = [("gpipe", 4, 1), ("1f1b", 4, 1), ("circular", 2, 2), ("interleaved_1f1b", 2, 2)]
# all run with -m slow (10-25 s each): the default suite has 1F1B partitioned (below), interleaved 1F1B
# through the trainer (test_sharded_state.py) and MoE 1F1B through the CLI (test_cli_train.py)
FAST = set()


@pytest.mark.parametrize("schedule,p,r,moe", [
    pytest.param(s, p, r, moe, id=f"{s}-{'moe' if moe else 'dense'}",
                 marks=() if (s, moe) in FAST else pytest.mark.slow)
    for s, p, r in CASES for moe in (False, True)])
def test_pipelined_lm_equals_gradient_accumulation(schedule, p, r, moe):
    cfg = _config(moe)
    base = T.DecoderLM(cfg)
    batch = _batch()
    params = base.init(jax.random.key(1), batch["inputs"])
    m = 2 * p
    pc = PipelineConfig(p, m, schedule, r)
    stored, back = _stored(params, pc)
    got = _jit(_pipelined_loss(cfg, pc))(stored, batch)
    _assert_same(back(got), _reference(base, params, batch, m))


@pytest.mark.slow  # 20 s
def test_pipelined_encoder_decoder_equals_gradient_accumulation():
    cfg = dataclasses.replace(_config(True), num_layers=4, num_decoder_layers=4, moe_every=2)
    base = T.EncoderDecoder(cfg)
    batch = dict(_batch(), source=_batch(1)["inputs"])
    params = base.init(jax.random.key(1), batch["source"], batch["inputs"])
    model = T.EncoderDecoder(dataclasses.replace(cfg, pipeline=PipelineConfig(2, 4, "gpipe")))
    got = jax.jit(jax.value_and_grad(lambda p: T.loss_fn(model, p, batch)[0]))(params)
    _assert_same(got, _reference(base, params, batch, 4))
    own = T.EncoderDecoder(dataclasses.replace(cfg, pipeline=PipelineConfig(2, 4, "1f1b")))
    with pytest.raises(ValueError, match="decoder-only LM"):
        T.loss_fn(own, params, batch)


def test_pipelined_stack_keeps_the_scanned_params():
    """A pipelined model's params are the scanned model's: checkpoints move across stage counts."""
    cfg = _config(True)
    tokens = _batch()["inputs"]
    plain = jax.eval_shape(T.DecoderLM(cfg).init, jax.random.key(0), tokens)
    for p, m in ((2, 2), (4, 4)):
        piped = jax.eval_shape(T.DecoderLM(dataclasses.replace(cfg, pipeline=PipelineConfig(p, m))).init,
                               jax.random.key(0), tokens)
        assert jax.tree.structure(piped) == jax.tree.structure(plain)
        assert [x.shape for x in jax.tree.leaves(piped)] == [x.shape for x in jax.tree.leaves(plain)]


def test_layer_periods_must_split_into_stages():
    cfg = dataclasses.replace(_config(False), num_layers=6, pipeline=PipelineConfig(4, 4))
    with pytest.raises(ValueError, match="6 layer periods do not split into 4 stages"):
        T.DecoderLM(cfg).init(jax.random.key(0), _batch()["inputs"])


MESHES = {"stage8": {"stage": 8}, "stage4_data2": {"stage": 4, "data": 2},
          "stage2_expert2_data2": {"stage": 2, "expert": 2, "data": 2},
          "stage2_x2_y2": {"stage": 2, "x": 2, "y": 2}}  # AxoNN's tensor axes inside each stage


def _partitioned_case(mesh_name, schedule, moe, m_per_stage=2, exchange="auto"):
    shape = MESHES[mesh_name]
    p = shape["stage"]
    r = 2 if schedule in ("circular", "interleaved_1f1b") else 1
    cfg = _config(moe, exchange, num_layers=8 * r if p == 8 else 8)
    base = T.DecoderLM(cfg)
    batch = _batch()
    params = base.init(jax.random.key(1), batch["inputs"])
    m = m_per_stage * p
    pc = PipelineConfig(p, m, schedule, r)
    f = _pipelined_loss(cfg, pc)
    mesh = gs.make_mesh(shape)
    jitted = gs.partition(f, mesh)
    stored, back = _stored(params, pc)
    _assert_same(back(jitted(stored, batch)), _reference(base, params, batch, m))
    return jitted, stored, batch, mesh, f


@pytest.mark.parametrize("mesh_name,schedule,moe", [
    ("stage4_data2", "1f1b", True),
    pytest.param("stage2_expert2_data2", "gpipe", True, marks=pytest.mark.slow),
])
def test_partitioned_pipelined_lm(mesh_name, schedule, moe):
    jitted, params, batch, mesh, f = _partitioned_case(mesh_name, schedule, moe)
    stats = hlo_stats(jitted, params, batch)
    assert stats["collective-permute"]["count"] == {"gpipe": 2, "1f1b": 4}[schedule]
    report = gs.explain(f, mesh, params, batch)
    assert report.pipelines[0]["schedule"] == schedule
    # the stacked layer params arrive split over the stages and are never gathered across them
    stacked = [v for v in report.inputs if "layers" in v.name]
    assert stacked and all("stage" in v.planned.dims[0] for v in stacked)
    assert not any(c.kind == "all-gather" and "stage" in c.axes for c in report.collectives)


@pytest.mark.parametrize("mesh_name,schedule", [  # slow: test_cost_walk traces the trainer's dropless 1F1B step
    pytest.param("stage4_data2", "1f1b", marks=pytest.mark.slow),
    pytest.param("stage2_expert2_data2", "interleaved_1f1b", marks=pytest.mark.slow),
    pytest.param("stage2_x2_y2", "circular", marks=pytest.mark.slow),
])
def test_dropless_moe_in_a_pipeline(mesh_name, schedule):
    """A dropless MoE layer is a manual region whose vjp residuals are split over every manual axis but the
    stage vmap's: the schedules that stash residuals probe them under that vmap (they used to crash with
    "Incompatible shapes for broadcasting")."""
    jitted, params, batch, mesh, f = _partitioned_case(mesh_name, schedule, "dropless")
    report = gs.explain(f, mesh, params, batch)
    assert any("manual region" in r.strategy for r in report.rows)


@pytest.mark.slow
@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "circular", "interleaved_1f1b"])
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_partitioned_pipelined_lm_every_schedule_and_mesh(mesh_name, schedule, moe):
    jitted, params, batch, mesh, f = _partitioned_case(mesh_name, schedule, moe)
    report = gs.explain(f, mesh, params, batch)
    # with repeats the stack is stored in the order the stages run it: no parameter crosses stages
    assert not any(c.kind == "all-gather" and "stage" in c.axes for c in report.collectives)


def test_storage_order_puts_each_stages_chunks_in_its_block():
    """A stack with repeats is stored stage-major: stage s's contiguous block holds chunks s, s + p, ...
    (docs/pipeline.md's example), and reorder() moves between any two orders and back."""
    assert PM.storage_order(8, 2, 2).tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    assert PM.storage_order(8, 4, 1).tolist() == list(range(8))
    for p, r in ((2, 2), (4, 2), (2, 4)):
        chunk = 16 // (p * r)
        blocks = PM.storage_order(16, p, r).reshape(p, r, chunk)
        assert all(blocks[s, k].tolist() == list(range((k * p + s) * chunk, (k * p + s + 1) * chunk))
                   for s in range(p) for k in range(r))
    a = jnp.arange(16.0)
    two, four = PM.order_key(PipelineConfig(2, 2, "circular", 2)), PM.order_key(PipelineConfig(4, 4, "circular", 2))
    moved = PM.reorder(a, True, PM.order_key(None), two)
    np.testing.assert_array_equal(moved, PM.storage_order(16, 2, 2))
    np.testing.assert_array_equal(PM.reorder(moved, True, two, four), PM.storage_order(16, 4, 2))
    np.testing.assert_array_equal(PM.reorder(PM.reorder(moved, True, two, four), True, four, PM.order_key(None)), a)


@pytest.mark.slow  # 70 s; the batching it rests on is test_moe.py's ragged vmap test
def test_a_pipeline_stage_runs_the_ragged_exchange():
    """Stages are vmapped over the stage axis, and a dropless layer's ragged exchange runs inside them: the
    real ragged_all_to_all primitive, batched by the stage vmap (partitioner/representation/jax_compat.py
    fixes JAX's rule for its unbatched receive offsets), partitioned and lowered by an emulation on XLA:CPU, gives the
    unpipelined model's loss and gradients, and explain() counts each routed row once per trip."""
    with ragged_all_to_all_emulated_on_cpu():
        jitted, params, batch, mesh, f = _partitioned_case("stage2_expert2_data2", "1f1b", "dropless",
                                                           exchange="ragged")
    report = gs.explain(f, mesh, params, batch, trace_per_device=False)
    ragged = [c for r in report.rows for c in r.collectives if c.kind == "all-to-all" and "ragged" in c.note]
    assert ragged, "the stage's dropless layer should exchange its rows by ragged_all_to_all"
    rows = B * L * 2 // 4 // (2 * 2)  # k=2 assignments per token, over 4 microbatches and data x expert shards
    assert {c.payload for c in ragged if len(c.shape) == 2} == {rows * 32 * 4}  # [rows, d_model] in float32
    assert {c.payload for c in ragged if len(c.shape) == 1} == {rows * 4}  # and their expert ids, int32


def _circular_input_gradient_case(run: bool):
    """A circular schedule's backward scatters each stage's input gradient into the microbatches' accumulator
    (its rows split over data, the updates over stage). At these sizes gathering the updates every trip
    costs more than the partial sum the scatter-add makes locally, which the loop reduces once."""
    cfg = _config(False, d_model=256, d_ff=512, head_dim=128, num_layers=8)
    pc = PipelineConfig(4, 8, "circular", 2)
    base = T.DecoderLM(cfg)
    k = jax.random.split(jax.random.key(0), 2)
    batch = {n: jax.random.randint(key, (16, 256), 0, V) for n, key in zip(("inputs", "targets"), k)}
    params = base.init(jax.random.key(1), batch["inputs"])
    f, mesh = _pipelined_loss(cfg, pc), gs.make_mesh({"stage": 4, "data": 2})
    stored, back = _stored(params, pc)
    report = gs.explain(f, mesh, stored, batch)
    scatter = [c for r in report.rows if r.primitive.endswith("scatter-add") for c in r.collectives
               if "stage" in c.axes]
    assert scatter == []  # no exchange of the updates inside the loop
    once = [c for r in report.rows if r.primitive == "scan" for c in r.collectives
            if c.kind == "all-reduce" and c.axes == ("stage",) and c.shape == (1, 8, 256, 256)]
    assert len(once) == 1  # the accumulator, reduced after the loop
    if run:
        jitted = gs.partition(f, mesh)
        _assert_same(back(jitted(stored, batch)), _reference(base, params, batch, 8))
        assert_report_matches_hlo(report, hlo_stats(jitted, stored, batch))


def test_a_circular_schedule_reduces_its_input_gradient_once():
    _circular_input_gradient_case(run=False)


@pytest.mark.slow
def test_a_circular_schedule_reduces_its_input_gradient_once_compiled():
    _circular_input_gradient_case(run=True)


def _owned_case(schedule, p, r, partitioned):
    """The untied LM with stage-owned ends (end_stages = p) against gradient accumulation: the layer-ordered
    params moved to the pipeline's storage (the ends stacked once per stage), and the gradients back."""
    cfg = dataclasses.replace(_config(False), end_stages=p)
    base = T.DecoderLM(_config(False))
    batch = _batch()
    params = base.init(jax.random.key(1), batch["inputs"])
    m = 2 * p
    pc = PipelineConfig(p, m, schedule, r)
    owned = jax.eval_shape(T.DecoderLM(dataclasses.replace(cfg, pipeline=pc)).init, jax.random.key(0),
                           batch["inputs"], batch["targets"])
    flags, ends, src, dst = PM.stacked(params), PM.ends(owned), PM.order_key(None), PM.order_key(pc, p)
    stored = PM.reorder(params, flags, src, dst, ends)
    f = _pipelined_loss(cfg, pc)
    mesh = gs.make_mesh({"stage": p, "data": 8 // p})
    run = gs.partition(f, mesh) if partitioned else jax.jit(f)
    loss, grads = run(stored, batch)
    _assert_same((loss, PM.reorder(grads, flags, dst, src, ends)), _reference(base, params, batch, m))
    for g, end in zip(jax.tree.leaves(grads), jax.tree.leaves(ends)):
        if end:  # the gradient lives on its owner's slice alone
            owner = 0 if end == "first" else p - 1
            assert np.asarray(g).any() and not np.delete(np.asarray(g), owner, axis=0).any()
    return f, mesh, stored, batch, (pc, cfg)


def _reductions_over_stage(report) -> int:
    """Per step, the bytes explain's rows all-reduce or reduce-scatter over `stage` (the permutes are sends)."""
    return sum(c.payload * c.runs * row.trips for row in report.rows for c in row.collectives
               if c.kind in ("all-reduce", "reduce-scatter") and "stage" in c.axes)


@pytest.mark.parametrize("schedule,p,r", [("gpipe", 4, 1), ("circular", 2, 2)])
def test_the_forward_schedules_run_the_head_on_the_last_stage(schedule, p, r):
    """GPipe and circular with stage-owned ends (the default for an untied decoder LM) hand the last stage's
    outputs to the head on that stage, as 1F1B does: over {stage p, data 8/p} a step reduces over `stage`
    only the scalar loss and metrics, where summing the outputs [B, L, D] over it (and their gradient, the
    input's) moved 2 B L D 4 / (8 / p) bytes. The values are test_stage_owned_ends_send_nothing_...'s."""
    cfg = dataclasses.replace(_config(False), end_stages=p)
    pc = PipelineConfig(p, 2 * p, schedule, r)
    batch = _batch()
    stored = jax.jit(T.DecoderLM(dataclasses.replace(cfg, pipeline=pc)).init)(jax.random.key(0), batch["inputs"],
                                                                              batch["targets"])
    report = gs.explain(_pipelined_loss(cfg, pc), gs.make_mesh({"stage": p, "data": 8 // p}), stored, batch)
    assert report.pipelines[0]["schedule"] == schedule
    assert _reductions_over_stage(report) <= 64  # the loss and the metrics


# slow (30 s): the default suite checks the same through the trainer's planned step
# (test_planner.py::test_what_crosses_stages_once_a_step) and the pipeline alone (test_pipeline.py)
@pytest.mark.slow
@pytest.mark.parametrize("schedule,p,r", [("1f1b", 4, 1), ("interleaved_1f1b", 2, 2), ("gpipe", 4, 1),
                                          ("circular", 2, 2)])
def test_stage_owned_ends_send_nothing_over_the_stages_but_the_loss(schedule, p, r):
    """TransformerConfig.end_stages = p: the embedding, final norm and unembedding lead with [stages]; stage
    0 reads its slice of the embedding and the last stage its slice of the head, and the gradients stay on
    their owners (GPipe and circular too: the last stage runs the head on its own outputs). The loss and
    gradients are gradient accumulation's, and partitioned over {stage p, data 8/p} the all-reduces over
    `stage` carry the scalar loss and metrics, where replicated ends all-reduce the embedding's input gradient
    [B, L, D] and the head's gradient (1F1B) or the last stage's outputs [B, L, D] (GPipe, circular) there."""
    f, mesh, stored, batch, (pc, cfg) = _owned_case(schedule, p, r, partitioned=True)

    def over_stage(report):
        return sum(c.payload * c.runs * row.trips for row in report.rows for c in row.collectives
                   if c.kind == "all-reduce" and "stage" in c.axes)

    owned = gs.explain(f, mesh, stored, batch)
    base = _config(False)
    plain = T.DecoderLM(base).init(jax.random.key(1), batch["inputs"])
    replicated = gs.explain(_pipelined_loss(base, pc), mesh, PM.reorder(plain, PM.stacked(plain), PM.order_key(None),
                                                                       PM.order_key(pc)), batch)
    residual_stream = 4 * B * L * base.d_model // (8 // p)  # a device's rows of [B, L, D] float32
    head = 4 * base.d_model * base.vocab_size
    ends = residual_stream + (head if schedule in S.OWN_BACKWARD else residual_stream)
    assert over_stage(replicated) >= ends, (over_stage(replicated), over_stage(owned))
    assert over_stage(owned) <= 64  # scalars: the loss and the MoE metrics
    assert_report_matches_hlo(owned, hlo_stats(gs.partition(f, mesh), stored, batch))
