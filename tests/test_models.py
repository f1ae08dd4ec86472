"""The Flax MoE Transformers (models/transformer.py) from the tiny experiment configs: forward and backward,
partitioned by our partitioner on meshes {1}, {8}, {2,4}, {2,2,2}, equal the unpartitioned model, with no
fallback and explain() equal to the compiled HLO."""
import dataclasses
import os
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gshard_jax as gs
from gshard_jax import configs
from gshard_jax.models.transformer import DecoderLM, EncoderDecoder, loss_fn
from helpers import assert_close, assert_report_matches_hlo, hlo_stats

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESHES = {"1": {"data": 1}, "8": {"expert": 8}, "2x4": {"data": 2, "expert": 4},
          "2x2x2": {"data": 2, "expert": 2, "model": 2}}


def experiment(name):
    return configs.load(os.path.join(ROOT, "experiments", f"{name}.py"))


def model_and_batch(name, **overrides):
    cfg = experiment(name)
    cfg.model.update(overrides)
    model = configs.build_model(cfg.model)
    tokens = jax.random.randint(jax.random.key(0), (8, 17), 1, cfg.model.vocab_size)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    if isinstance(model, EncoderDecoder):
        batch["source"] = jax.random.randint(jax.random.key(1), (8, 12), 0, cfg.model.vocab_size)
        params = model.init(jax.random.key(2), batch["source"], batch["inputs"])
    else:
        params = model.init(jax.random.key(2), batch["inputs"])
    return model, nn.unbox(params), batch  # the arrays; their logical axes are what gshard_jax.training.layout reads


def mesh_of(name):
    return gs.make_mesh(MESHES[name], devices=jax.devices()[:1] if name == "1" else None)


def check_partitioned(model, params, batch, mesh):
    step = jax.value_and_grad(lambda p, b: loss_fn(model, p, b)[0])
    want = step(params, batch)
    part = gs.partition(step, mesh)
    assert_close(part(params, batch), want, rtol=2e-4, atol=2e-5)
    report = gs.explain(step, mesh, params, batch)
    assert report.fallbacks == []
    stats = hlo_stats(part, params, batch)
    assert_report_matches_hlo(report, stats)
    return stats


# the one-device mesh (20-27 s, nothing split) runs with -m slow
@pytest.mark.parametrize("mesh_name", [pytest.param(m, marks=pytest.mark.slow) if m == "1" else m for m in MESHES])
@pytest.mark.parametrize("name", ["tiny_moe_lm", "tiny_moe_encdec"])
def test_tiny_models_partition_faithfully_on_every_mesh(name, mesh_name):
    model, params, batch = model_and_batch(name)
    stats = check_partitioned(model, params, batch, mesh_of(mesh_name))
    if "expert" in MESHES[mesh_name] and MESHES[mesh_name]["expert"] > 1:
        moe_layers = model.cfg.num_layers // model.cfg.period + (
            model.cfg.num_decoder_layers // model.cfg.period if isinstance(model, EncoderDecoder) else 0)
        assert stats["all-to-all"]["count"] == 4 * moe_layers  # two each way, forward and backward


@pytest.mark.parametrize("name", [pytest.param("tiny_moe_lm", marks=pytest.mark.newest_jax),
                                  pytest.param("tiny_moe_encdec", marks=pytest.mark.slow)])  # 21 s
def test_scanned_checkpointed_layers_partition_like_the_loop(name):
    """nn.scan over layer periods with a remat policy: same numbers, and the scanned body (compiled once per
    layer stack) holds its MoE layer's forward pair of all-to-alls and the backward pair; under "full" also
    the recomputed forward pair, while "dots" keeps the experts' matmul results (grouped.EXPERT_MATMUL), so the
    backward sends no token to its expert again."""
    stacks = 2 if name == "tiny_moe_encdec" else 1
    for remat, pairs in (("dots", 2), ("full", 3)):
        model, params, batch = model_and_batch(name, scan=True, remat=remat)
        stats = check_partitioned(model, params, batch, mesh_of("2x4"))
        assert stats["all-to-all"]["count"] == 2 * pairs * stacks, (remat, stats["all-to-all"])
        assert stats["all-gather"]["count"] == 0


def test_dropless_lm_partitions_under_expert_parallelism():
    model, params, batch = model_and_batch("tiny_moe_lm")
    moe = dataclasses.replace(model.cfg.moe, dispatch="dropless")
    model = DecoderLM(dataclasses.replace(model.cfg, moe=moe))
    check_partitioned(model, params, batch, mesh_of("2x2x2"))


def test_moe_losses_are_collected_across_layers():
    model, params, batch = model_and_batch("tiny_moe_lm")
    loss, m = loss_fn(model, params, batch)
    # Every layer is MoE in tiny_moe_lm: the summed aux loss is at least one per layer (1.0 = uniform).
    assert float(m["aux_loss"]) >= 0.99 * model.cfg.num_layers
    c = model.cfg
    want = m["cross_entropy"] + c.aux_loss_weight * m["aux_loss"] + c.z_loss_weight * m["z_loss"]
    assert abs(float(loss) - float(want)) < 1e-5
    dense = configs.build_model(experiment("tiny_dense_lm").model)
    dparams = dense.init(jax.random.key(2), batch["inputs"])
    _, dm = loss_fn(dense, dparams, batch)
    assert float(dm["aux_loss"]) == 0.0 and float(dm["z_loss"]) == 0.0


def test_bfloat16_compute_keeps_float32_params():
    model, params, batch = model_and_batch("tiny_moe_lm", dtype="bfloat16")
    assert all(p.dtype == jnp.float32 for p in jax.tree_util.tree_leaves(params))
    loss, _ = loss_fn(model, params, batch)
    assert jnp.isfinite(loss)
    grads = jax.grad(lambda p: loss_fn(model, p, batch)[0])(params)
    assert all(g.dtype == jnp.float32 for g in jax.tree_util.tree_leaves(grads))


@pytest.mark.parametrize("name", ["tiny_moe_lm", "tiny_moe_encdec"])
def test_initial_cross_entropy_is_near_uniform(name):
    """Untied and tied (1/sqrt(D)-scaled) logits both start near the uniform distribution's ln V."""
    cfg = experiment(name)
    model = configs.build_model(cfg.model)
    tokens = jax.random.randint(jax.random.key(0), (4, 33), 1, cfg.model.vocab_size)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    if cfg.model.kind == "encoder_decoder":
        batch["source"] = tokens[:, 1:]
    params = model.init(jax.random.key(1), *([batch["source"]] if "source" in batch else []), batch["inputs"])
    ce = float(loss_fn(model, params, batch)[1]["cross_entropy"])
    assert abs(ce - np.log(cfg.model.vocab_size)) < 1.0, ce


def test_rules_table_splits_experts_first_and_groups_take_what_is_left():
    """docs/models.md: batch over every data-like axis; [E, G, C, M] splits E first, G takes what E leaves."""
    from gshard_jax.models.logical import DEFAULT_RULES, mesh_spec
    assert mesh_spec(("batch", "length", "embed"), DEFAULT_RULES, ("data", "expert", "model")) == \
        (("data", "expert"), None, None)
    assert mesh_spec(("expert", "group", None, "embed"), DEFAULT_RULES, ("data", "expert")) == \
        ("expert", "data", None, None)
    assert mesh_spec(("group", None, "embed"), DEFAULT_RULES, ("data", "expert")) == (("data", "expert"), None, None)
    assert mesh_spec(("heads", "mlp", "vocab"), DEFAULT_RULES, ("data",)) == (None, None, None)  # no model axis


@pytest.mark.parametrize("remat", ["none", "full", "dots", "dots_saveable"])
def test_every_remat_policy_gives_the_layer_loops_loss_and_grads(remat):
    """docs/models.md: scan over periods with any remat policy computes what the plain layer loop does."""
    model, params, batch = model_and_batch("tiny_moe_lm", num_layers=2)
    scanned, _, _ = model_and_batch("tiny_moe_lm", scan=True, remat=remat, num_layers=2)
    periods = [f"period_{i}" for i in range(model.cfg.num_layers)]
    stack = lambda dec: jax.tree.map(lambda *xs: jnp.stack(xs), *[dec[k] for k in periods])
    stacked = {"params": dict(params["params"], decoder={"layers": stack(params["params"]["decoder"])})}
    want = jax.jit(jax.value_and_grad(lambda p: loss_fn(model, p, batch)[0]))(params)
    got = jax.jit(jax.value_and_grad(lambda p: loss_fn(scanned, p, batch)[0]))(stacked)
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-5)
    assert_close(got[1]["params"]["decoder"]["layers"], stack(want[1]["params"]["decoder"]))
    assert_close({k: v for k, v in got[1]["params"].items() if k != "decoder"},
                 {k: v for k, v in want[1]["params"].items() if k != "decoder"})


def test_scanned_jaxpr_does_not_grow_with_depth():
    """docs/models.md: nn.scan traces one body, so the program's size is independent of depth."""
    sizes = []
    for layers in (2, 6):
        model, params, batch = model_and_batch("tiny_moe_lm", scan=True, remat="dots", num_layers=layers)
        sizes.append(len(jax.make_jaxpr(lambda p: loss_fn(model, p, batch)[0])(params).jaxpr.eqns))
    assert sizes[0] == sizes[1], sizes


def test_source_padding_changes_nothing_the_encoder_decoder_computes():
    """docs/models.md: source token 0 is padding, masked out of the encoder's self-attention and the decoder's
    cross-attention; with capacity for every token (pads take expert slots), appended pads leave the logits."""
    cfg = experiment("tiny_moe_encdec")
    cfg.model.moe.update(dict(capacity_factor=8.0, eval_capacity_factor=8.0))
    model = configs.build_model(cfg.model)
    source = jax.random.randint(jax.random.key(0), (4, 12), 1, cfg.model.vocab_size)
    target = jax.random.randint(jax.random.key(1), (4, 10), 1, cfg.model.vocab_size)
    params = model.init(jax.random.key(2), source, target)
    padded = jnp.concatenate([source, jnp.zeros((4, 4), source.dtype)], axis=1)
    apply = jax.jit(model.apply)
    want, got = apply(params, source, target)[0], apply(params, padded, target)[0]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_remat_modules_checkpoint_each_module_and_compute_the_same():
    """model.remat_modules (seed 001's selective checkpointing): each named module is its own checkpointed
    region (a remat in the gradient's program per module use), with the same loss and gradients."""
    model, params, batch = model_and_batch("tiny_moe_lm", num_layers=2)
    grad = lambda m: jax.value_and_grad(lambda p: loss_fn(m, p, batch)[0])
    want = jax.jit(grad(model))(params)
    # 2 layers: one attention, two norms and one MoE FFN each (every FFN of the tiny MoE LM is MoE)
    for modules, regions in (((), 0), (("attention",), 2), (("norm", "moe"), 2 * 2 + 2), (("ffn",), 0)):
        sel, _, _ = model_and_batch("tiny_moe_lm", num_layers=2, remat_modules=modules)
        assert str(jax.make_jaxpr(grad(sel))(params)).count("remat2[") == regions, modules
        got = jax.jit(grad(sel))(params)
        np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-6)
        assert_close(got[1], want[1])
    with pytest.raises(ValueError, match="remat_modules"):
        bad, _, _ = model_and_batch("tiny_moe_lm", remat_modules=("mlp",))


@pytest.mark.parametrize("scan", [False, True])
def test_remat_dots_recomputes_the_attention_score_matmuls_and_dots_saveable_keeps_them(scan):
    """docs/training.md: remat "dots" keeps only matmuls without batch dims (dots_with_no_batch_dims_saveable,
    MaxText's), so with einsum attention each layer's scores and context matmuls (batched over heads) run
    again in the backward; "dots_saveable" keeps every matmul, as plain JAX's checkpoint_dots does (the GPU
    anchor's "dots"). Counted in the compiled gradient: two more matmuls a layer, nothing else."""
    count = {}
    for remat in ("dots", "dots_saveable"):
        model, params, batch = model_and_batch("tiny_dense_lm", num_layers=2, attention="einsum", scan=scan,
                                               remat=remat)
        grad = jax.jit(jax.value_and_grad(lambda p: loss_fn(model, p, batch)[0]))
        text = grad.lower(params).compile().as_text()
        count[remat] = len(re.findall(r"\sdot\(", text))
    per_layer = 1 if scan else 2  # a scan's body holds one layer's
    assert count["dots"] - count["dots_saveable"] == 2 * per_layer, count


def test_mula_1bs_score_matmul_flops_docs_training_quotes():
    """docs/training.md: at Mula-1B's shapes (4 x 2,048 tokens, 16 heads of 128, 16 layers) one score matmul is
    68.7 GFLOP, and remat "dots" recomputing two a layer costs 2.2 TFLOP a step."""
    cfg = experiment("mula_1b")
    m = cfg.model
    one = 2 * 4 * m.num_heads * 2048 * 2048 * m.head_dim
    assert one / 1e9 == pytest.approx(68.7, abs=0.05)
    assert 2 * one * m.num_layers / 1e12 == pytest.approx(2.2, abs=0.05)
