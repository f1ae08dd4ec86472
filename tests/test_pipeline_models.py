"""Pipelined models: the same loss and gradients as the unpipelined model with gradient accumulation."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gshard_jax as gs
from gshard_jax.models import transformer as T
from gshard_jax.models.moe import MoeConfig
from gshard_jax.models.pipelined import PipelineConfig
from helpers import hlo_stats

B, L, V = 16, 8, 64


def _config(moe: bool, **kw) -> T.TransformerConfig:
    fields = dict(vocab_size=V, d_model=32, num_heads=2, head_dim=16, d_ff=64, num_layers=8, scan=True,
                  moe=MoeConfig(num_experts=4, d_ff=32) if moe else None, moe_every=1)
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


def _jit(f):
    return jax.jit(f)


def _assert_same(got, want):
    (loss, grads), (ref_loss, ref_grads) = got, want
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)


CASES = [("gpipe", 4, 1), ("1f1b", 4, 1), ("circular", 2, 2), ("interleaved_1f1b", 2, 2)]
FAST = {("1f1b", True), ("interleaved_1f1b", False)}  # the rest run with -m slow (about 10 s each)


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
    got = _jit(_pipelined_loss(cfg, PipelineConfig(p, m, schedule, r)))(params, batch)
    _assert_same(got, _reference(base, params, batch, m))


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


def _partitioned_case(mesh_name, schedule, moe, m_per_stage=2):
    shape = MESHES[mesh_name]
    p = shape["stage"]
    r = 2 if schedule in ("circular", "interleaved_1f1b") else 1
    cfg = _config(moe, num_layers=8 * r if p == 8 else 8)
    base = T.DecoderLM(cfg)
    batch = _batch()
    params = base.init(jax.random.key(1), batch["inputs"])
    m = m_per_stage * p
    f = _pipelined_loss(cfg, PipelineConfig(p, m, schedule, r))
    mesh = gs.make_mesh(shape)
    jitted = gs.partition(f, mesh)
    _assert_same(jitted(params, batch), _reference(base, params, batch, m))
    return jitted, params, batch, mesh, f


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


@pytest.mark.slow
@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "circular", "interleaved_1f1b"])
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_partitioned_pipelined_lm_every_schedule_and_mesh(mesh_name, schedule, moe):
    jitted, params, batch, mesh, f = _partitioned_case(mesh_name, schedule, moe)
    report = gs.explain(f, mesh, params, batch)
    gathered = any(c.kind == "all-gather" and "stage" in c.axes for c in report.collectives)
    # With repeats, stage s runs layer chunks s, s + p, ...: the models keep their params in layer order (so
    # checkpoints move across stage counts), which is re-laid each step (docs/pipeline.md). gs.pipeline given
    # params as [repeats, stages] gathers nothing (test_pipeline.py).
    assert gathered == (schedule in ("circular", "interleaved_1f1b"))
