"""Fused attention through the partitioner: the models' `attention` option and the rule of cuDNN's kernel.

On CPU, `implementation="xla"` runs: the partitioned model must compute the einsum model's loss and every
gradient, with no more communication than XLA's partitioner. cuDNN's kernel cannot run here, but it traces
once JAX's cuDNN probes are answered, so its rule is checked on the plan and the per-device program.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from jax._src.cudnn import fused_attention_stablehlo as FAS
from jax.sharding import PartitionSpec as P
from test_models import model_and_batch

import gshard_jax as gs
from gshard_jax.models import layers
from gshard_jax.models.transformer import loss_fn
from gshard_jax.partitioner.rules import fused_attention as FA
from helpers import assert_close, assert_report_matches_hlo, get_mesh, hlo_stats


def _moved(stats) -> float:
    return sum(s["moved_bytes"] for s in stats.values())


@pytest.mark.parametrize("name", ["tiny_moe_lm", pytest.param("tiny_moe_encdec", marks=pytest.mark.slow)])
def test_xla_attention_partitions_to_the_einsum_models_loss_and_gradients(name):
    """Heads split over `model`, batch over `data`: the kernel's inputs stay where the projections put them."""
    mesh = gs.make_mesh({"data": 2, "expert": 2, "model": 2})
    einsum, params, batch = model_and_batch(name, attention="einsum")
    fused, _, _ = model_and_batch(name, attention="xla")
    step = lambda model: jax.value_and_grad(lambda p, b: loss_fn(model, p, b)[0])
    want = jax.jit(step(einsum))(params, batch)
    got = gs.partition(step(fused), mesh)(params, batch)
    assert_close(got, want, rtol=2e-4, atol=2e-5)
    report = gs.explain(step(fused), mesh, params, batch)
    assert report.fallbacks == []
    stats = {b: hlo_stats(gs.partition(step(fused), mesh, backend=b), params, batch) for b in ("gshard", "xla")}
    assert_report_matches_hlo(report, stats["gshard"])
    assert _moved(stats["gshard"]) <= _moved(stats["xla"]), (stats["gshard"], stats["xla"])
    # the fused form moves no more than the einsum model does under our partitioner: attention itself moves nothing
    assert _moved(stats["gshard"]) <= _moved(hlo_stats(gs.partition(step(einsum), mesh), params, batch))


def test_auto_takes_cudnn_only_on_a_gpu_with_half_precision_heads_it_fits(monkeypatch):
    q = lambda dtype, head: jnp.zeros((1, 4, 2, head), dtype)
    assert layers.attention_implementation("auto", q(jnp.bfloat16, 128)) == "einsum"  # this CPU
    monkeypatch.setattr(layers, "on_nvidia_gpu", lambda: True)
    assert layers.attention_implementation("auto", q(jnp.bfloat16, 128)) == "cudnn"
    assert layers.attention_implementation("auto", q(jnp.float16, 64)) == "cudnn"
    assert layers.attention_implementation("auto", q(jnp.float32, 128)) == "einsum"
    assert layers.attention_implementation("auto", q(jnp.bfloat16, 256)) == "einsum"
    assert layers.attention_implementation("xla", q(jnp.bfloat16, 128)) == "xla"


def test_an_unknown_attention_names_the_choices():
    with pytest.raises(ValueError, match=r"attention='flash'.*'auto', 'einsum', 'xla', 'cudnn'"):
        model_and_batch("tiny_moe_lm", attention="flash")


@pytest.fixture
def cudnn_traces(monkeypatch):
    """JAX's cuDNN probes answered as an H100 with cuDNN 9.10 would: the kernel traces (it cannot compile)."""
    monkeypatch.setattr(FAS, "check_cudnn_version", lambda: 91000)
    monkeypatch.setattr(FAS, "check_compute_capability", lambda capability: True)
    monkeypatch.setattr(FAS, "is_cuda_compute_capability_equal", lambda capability: False)


def _attention_step(causal: bool):
    def loss(q, k, v):
        out = jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")
        return jnp.sum(out.astype(jnp.float32) ** 2)
    return jax.value_and_grad(loss, argnums=(0, 1, 2))


def _qkv(heads=8, kv_heads=4):
    q = jnp.zeros((4, 64, heads, 32), jnp.bfloat16)
    k = jnp.zeros((4, 64, kv_heads, 32), jnp.bfloat16)
    return q, k, k


def _fused_eqns(jaxpr) -> list:
    """The fused kernel's equations in a (partitioned) program, shard_map bodies included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name.startswith("dot_product_attention"):
            found.append(eqn)
        inner = eqn.params.get("jaxpr")
        if inner is not None:
            found += _fused_eqns(getattr(inner, "jaxpr", inner))
    return found


@pytest.mark.newest_jax  # cuDNN's primitives and params are private: checked on each end of the range
def test_the_layout_values_are_jaxs(cudnn_traces):
    assert (FA.BTNH, FA.BNTH) == (FAS.AttentionLayout.BTNH.value, FAS.AttentionLayout.BNTH.value)


@pytest.mark.newest_jax
def test_cudnn_attention_runs_on_each_devices_batch_and_kv_head_groups(cudnn_traces):
    """GQA: 8 query heads share 4 K/V heads; `model` (4) splits the K/V heads, each device keeps its 2 query
    heads with their one K/V head (never repeated), `data` the batch. No collective but the loss's sum."""
    mesh = get_mesh("2x4")
    q, k, v = _qkv()
    spec = P("data", None, "model", None)
    step = _attention_step(causal=True)
    report = gs.explain(step, mesh, q, k, v, in_shardings=(spec,) * 3)
    assert report.fallbacks == []
    kinds = {r.primitive: r.strategy for r in report.rows if r.primitive.startswith("dot_product_attention")}
    assert set(kinds) == {"dot_product_attention_fwd_wrapper", "dot_product_attention_bwd_wrapper"}
    assert all(("fused_attention" in s) and "=data" in s and "=model" in s for s in kinds.values()), kinds
    assert [str(c).split()[0] for c in report.collectives] == ["all-reduce[data,model]"]  # the scalar loss
    assert [str(o.planned) for o in report.outputs[1:]] == ["[data, -, model, -]"] * 3
    local = _fused_eqns(jax.make_jaxpr(gs.partition(step, mesh, in_shardings=(spec,) * 3))(q, k, v).jaxpr)
    assert [tuple(x.aval.shape) for x in local[0].invars[:3]] == [(2, 64, 2, 32), (2, 64, 1, 32), (2, 64, 1, 32)]
    assert len(local) == 2
    # the predicted work is the kernel's: 2 matmuls of T x S per row and head, half of them causal, 2.5x backward
    fwd, bwd = (next(r for r in report.rows if r.primitive == p) for p in
                ("dot_product_attention_fwd_wrapper", "dot_product_attention_bwd_wrapper"))
    flops = 2 * 2 * 2 * 64 * 64 * (32 + 32) * 0.5
    assert fwd.compute_time == pytest.approx(flops / report.profile.flops)
    assert bwd.compute_time == pytest.approx(2.5 * flops / report.profile.flops)


@pytest.mark.newest_jax
def test_the_kernel_vmapped_over_stages_keeps_its_rule(cudnn_traces):
    """A pipeline runs each stage's forward and backward vmapped over the stages, apart: the kernel's absent
    operands, saved for the backward, become (stages, 0), not (0,), and both halves still partition on each
    device's batch and heads."""
    mesh = get_mesh("2x4")
    q, k, v = (jnp.stack([x, x]) for x in _qkv())

    def loss(q, k, v):
        return jnp.sum(jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn") ** 2)

    def step(q, k, v):
        out, pull = jax.vmap(lambda q, k, v: jax.vjp(loss, q, k, v))(q, k, v)
        return out, jax.vmap(lambda f, g: f(g))(pull, jnp.ones_like(out))

    stacked = [str(x.aval) for e in _fused_eqns(jax.make_jaxpr(step)(q, k, v).jaxpr) for x in e.invars[3:10]]
    assert "bfloat16[2,0]" in stacked  # the case the test is about
    spec = P(None, "data", None, "model", None)
    report = gs.explain(step, mesh, q, k, v, in_shardings=(spec,) * 3)
    fused = [r for r in report.rows if r.primitive.startswith("dot_product_attention")]
    assert {r.primitive for r in fused} == {"dot_product_attention_fwd_wrapper", "dot_product_attention_bwd_wrapper"}
    assert report.fallbacks == [] and all("fused_attention" in r.strategy for r in fused)


@pytest.mark.newest_jax
@pytest.mark.parametrize("causal", [True, False])
def test_a_split_sequence_is_gathered_where_the_mask_needs_positions(cudnn_traces, causal):
    """Keys are always read whole (the kernel's softmax spans them); query rows split freely without a
    causal mask, and are gathered (a stated all-gather) with one."""
    mesh = get_mesh("2x4")
    q, k, v = _qkv(heads=4, kv_heads=4)
    spec = P(None, "model", None, None)
    report = gs.explain(_attention_step(causal), mesh, q, k, v, in_shardings=(spec,) * 3)
    assert report.fallbacks == []
    fwd = next(r for r in report.rows if r.primitive == "dot_product_attention_fwd_wrapper")
    gathered = [n for n, o in enumerate(fwd.operands[:3]) if o.have != o.need]
    assert gathered == ([0, 1, 2] if causal else [1, 2]), [str(o) for o in fwd.operands[:3]]


@pytest.mark.newest_jax  # cuDNN's primitives are private: traced on each end of the range
def test_under_cudnn_no_matmul_has_batch_dims_so_both_dots_policies_keep_the_same(cudnn_traces):
    """docs/training.md: remat "dots" and "dots_saveable" differ only on matmuls with batch dims. Einsum
    attention has two a layer (scores and context, batched over heads); with cuDNN's kernel the layer has
    none, so the two policies keep the same results and the cuDNN rows compare like for like."""
    from test_models import experiment

    from gshard_jax import configs
    _, params, batch = model_and_batch("tiny_dense_lm", num_layers=2, dtype="bfloat16")  # einsum: init runs

    def batched_dots(attention: str) -> int:
        cfg = experiment("tiny_dense_lm")
        cfg.model.update(dict(num_layers=2, attention=attention, dtype="bfloat16"))
        model = configs.build_model(cfg.model)
        eqns = _all_eqns(jax.make_jaxpr(lambda p: loss_fn(model, p, batch)[0])(params).jaxpr)
        kernels = sum(e.primitive.name.startswith("dot_product_attention") for e in eqns)
        assert kernels == (2 if attention == "cudnn" else 0), kernels  # the fused kernel, once a layer
        return sum(1 for e in eqns if e.primitive.name == "dot_general" and e.params["dimension_numbers"][1][0])
    assert batched_dots("einsum") == 2 * 2
    assert batched_dots("cudnn") == 0


@pytest.mark.newest_jax
@pytest.mark.parametrize("remat", ["none", "dots", "dots_saveable", "full"])
def test_every_remat_policy_runs_the_fused_kernels_forward_again_and_the_planner_counts_it(cudnn_traces, remat):
    """The kernel is no matmul, so no policy keeps its results: under any remat its forward runs again in the
    backward (twice a layer), and the planner's recomputed flops hold attention's forward (4 L d S a token)
    for each policy, where einsum attention under dots_saveable would hold none."""
    from test_models import experiment

    from gshard_jax import configs
    from gshard_jax.planner import estimate as E, space as SP
    _, params, batch = model_and_batch("tiny_dense_lm", num_layers=2, dtype="bfloat16")  # einsum: init runs
    cfg = experiment("tiny_dense_lm")
    cfg.model.update(dict(num_layers=2, attention="cudnn", dtype="bfloat16", remat=remat))
    model = configs.build_model(cfg.model)
    eqns = _all_eqns(jax.make_jaxpr(jax.grad(lambda p: loss_fn(model, p, batch)[0]))(params).jaxpr)
    kernels = [e.primitive.name for e in eqns if e.primitive.name.startswith("dot_product_attention")]
    assert kernels.count("dot_product_attention_fwd_wrapper") == (2 if remat == "none" else 4), kernels
    assert kernels.count("dot_product_attention_bwd_wrapper") == 2, kernels
    shape = SP.model_shape(cfg, "gpu")
    assert shape.fused_attention
    attention = 4 * shape.layers * shape.d_model * shape.seq
    assert E.recomputed_flops_per_token(shape, remat) >= (0 if remat == "none" else attention)
    if remat.startswith("dots"):
        assert E.recomputed_flops_per_token(shape, remat) == attention
        einsum = dataclasses.replace(shape, fused_attention=False)
        assert E.recomputed_flops_per_token(einsum, remat) == (attention if remat == "dots" else 0)


def _all_eqns(jaxpr) -> list:
    """Every equation of a jaxpr, nested calls and checkpoints included."""
    found = []
    for eqn in jaxpr.eqns:
        found.append(eqn)
        for p in eqn.params.values():
            inner = p if hasattr(p, "eqns") else getattr(p, "jaxpr", None)  # a Jaxpr (remat's) or ClosedJaxpr
            if inner is not None:
                found += _all_eqns(getattr(inner, "jaxpr", inner))
    return found
