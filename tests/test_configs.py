"""Experiment configs (experiments/*.py) and `gshard-jax params`: the papers' parameter counts."""
import glob
import json
import os
import subprocess
import sys

import pytest

from gshard_jax import configs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXPERIMENTS = sorted(glob.glob(os.path.join(ROOT, "experiments", "*.py")))

# GShard (docs/references.md) (GShard Table 1) and B (Mula): (total, active per token); None: not stated.
PAPER = {
    "gshard_moe_2048e_36l": (600e9, None), "gshard_moe_2048e_12l": (200e9, None),
    "gshard_moe_512e_36l": (150e9, None), "gshard_moe_512e_12l": (50e9, None),
    "gshard_moe_128e_36l": (37e9, None), "gshard_moe_128e_12l": (12.5e9, None),
    "gshard_dense_t96l": (2.3e9, 2.3e9),
    "mula_1b": (1.3e9, 1.3e9), "mula_7b_a1b": (6.9e9, 1.3e9), "mula_20b_a2b": (20e9, 2.4e9),
    "mula_100b_a7b": (100e9, 7.6e9), "mula_220b_a10b": (220e9, 10e9),
}
# The papers round. GShard's own formula for the expert weights, (L/2) E 2 M H, is already 3-4.5% above its
# quoted totals (38.7B for MoE(128E, 36L) against "37B"), so GShard gets 7%; Mula's figures are within 3%.
TOLERANCE = {"gshard": 0.07, "mula": 0.03}


def name(path):
    return os.path.basename(path)[:-3]


@pytest.mark.parametrize("key", list(PAPER))
def test_parameter_counts_match_the_papers(key):
    counts = configs.count_params(configs.load(os.path.join(ROOT, "experiments", f"{key}.py")).model)
    total, active = PAPER[key]
    tol = TOLERANCE[key.split("_")[0]]
    assert abs(counts["total_params"] / total - 1) < tol, counts
    if active is not None:
        assert abs(counts["active_params"] / active - 1) < tol, counts
    assert counts["active_params"] <= counts["total_params"]


def test_gshard_active_params_are_two_experts_per_moe_layer():
    c = configs.load(os.path.join(ROOT, "experiments", "gshard_moe_128e_12l.py"))
    counts = configs.count_params(c.model)
    M, H, E = 1024, 8192, 128
    expert = 6 * E * 2 * M * H  # 6 MoE layers (every other of 12)
    assert counts["total_params"] - counts["active_params"] == expert - expert * 2 // E


@pytest.mark.parametrize("path", EXPERIMENTS, ids=[name(p) for p in EXPERIMENTS])
def test_every_config_has_the_runtime_fields_and_builds(path):
    cfg = configs.load(path)
    for key in ("num_steps", "checkpoint_every", "log_every", "eval_every"):
        assert isinstance(cfg.train[key], int), key
    assert cfg.debug.nan_at_step == -1
    assert set(cfg.mesh) == {"stage", "data", "z", "expert", "context", "y", "x", "model",  # docs/models.md
                             "auto", "memory_budget"}  # and automatic sharding's (docs/training.md)
    assert set(configs.typed(cfg).mesh.sizes()) == {"stage", "data", "z", "expert", "context", "y", "x", "model"}
    # experiments/README.md's sections, and the mesh order field
    assert set(cfg) == {"model", "mesh", "train", "data", "pipeline", "debug", "mesh_order"}
    configs.transformer_config(cfg.model)  # every field is a TransformerConfig / MoeConfig field


def test_params_cli_prints_json():
    out = subprocess.run([sys.executable, "-m", "gshard_jax.cli", "params", "--config",
                          os.path.join(ROOT, "experiments", "mula_7b_a1b.py"), "--json"],
                         capture_output=True, text=True, check=True).stdout
    counts = json.loads(out)
    assert set(counts) == {"total_params", "active_params"}
    assert all(isinstance(v, int) for v in counts.values())
    assert counts == configs.count_params(configs.load(os.path.join(ROOT, "experiments", "mula_7b_a1b.py")).model)


def test_bad_config_paths_and_fields_are_clear_errors(tmp_path):
    r = subprocess.run([sys.executable, "-m", "gshard_jax.cli", "params", "--config", str(tmp_path / "no.py")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "does not exist" in r.stderr
    cfg = configs.load(os.path.join(ROOT, "experiments", "tiny_moe_lm.py"))
    cfg.model.kind = "rnn"
    with pytest.raises(ValueError, match="model.kind='rnn'"):
        configs.build_model(cfg.model)


def test_docs_parameter_table_matches_the_configs():
    """docs/models.md's table and README's example figures are what `gshard-jax params` computes."""
    import re
    rows = re.findall(r"^\| (\w+) \| ([\d.]+)B \| ([\d.]*)B? \|", open(os.path.join(ROOT, "docs", "models.md")).read(),
                      re.M)
    assert {r[0] for r in rows} == set(PAPER)
    for key, total, active in rows:
        counts = configs.count_params(configs.load(os.path.join(ROOT, "experiments", f"{key}.py")).model)
        digits = len(total.split(".")[1])
        assert f"{counts['total_params'] / 1e9:.{digits}f}" == total, (key, counts)
        assert f"{counts['active_params'] / 1e9:.{len(active.split('.')[1])}f}" == active, (key, counts)
    readme = open(os.path.join(ROOT, "README.md")).read()
    counts = configs.count_params(configs.load(os.path.join(ROOT, "experiments", "gshard_moe_2048e_36l.py")).model)
    total, active = counts["total_params"], counts["active_params"]
    assert f"{total:,} parameters ({total / 1e9:.2f}B), {active:,} active per token ({active / 1e9:.2f}B)" in readme


def test_tiny_dense_twin_has_the_moe_lms_active_weights_per_token():
    """Same matmul work per token: the dense twin's parameters are the MoE LM's active ones less its routers."""
    moe = configs.load(os.path.join(ROOT, "experiments", "tiny_moe_lm.py")).model
    dense = configs.load(os.path.join(ROOT, "experiments", "tiny_dense_lm.py")).model
    routers = moe.num_layers * moe.d_model * moe.moe.num_experts  # every layer is MoE (moe_every = 1)
    assert moe.moe_every == 1
    assert configs.count_params(dense)["total_params"] == configs.count_params(moe)["active_params"] - routers


def test_the_default_run_is_the_model_readme_describes():
    """README: a 4-layer LM with 8 SwiGLU experts (top-2) in every layer on {data 2, expert 4}, 300 steps."""
    cfg = configs.load(os.path.join(ROOT, "experiments", "tiny_moe_lm.py"))
    m = configs.transformer_config(cfg.model)
    assert (m.num_layers, m.moe.num_experts, m.moe.gating.k, m.moe.activation) == (4, 8, 2, "swiglu")
    assert cfg.model.moe_every == 1 and cfg.train.num_steps == 300
    assert {k: v for k, v in configs.typed(cfg).mesh.sizes().items() if v != 1} == {"data": 2, "expert": 4}
    assert not cfg.mesh.auto


@pytest.mark.parametrize("name,stages", [("mula_100b_a7b", 4), ("mula_220b_a10b", 8)])
def test_mula_configs_pipeline_as_seed_001(name, stages):
    """Seed 001 trains Mula-100B-A7B on 4 and 220B-A10B on 8 pipeline stages with 1F1B, expert parallelism
    over 12 tiles, with 3,072 sequences of 2,048 tokens on 3,072 tiles: each microbatch splits over the
    data x expert shards, as many microbatches as that allows."""
    from gshard_jax.models import pipelined
    from gshard_jax.planner import space
    cfg = configs.load(os.path.join(ROOT, "experiments", f"{name}.py"))
    pc = configs.pipeline_config(cfg, cfg.mesh.stage)
    assert (pc.stages, pc.schedule) == (stages, "1f1b")
    pipelined.check(pc, cfg.model.num_layers // cfg.model.moe_every)  # the layers split into the stages
    assert (cfg.train.batch_size, cfg.train.seq_len) == (3072, 2048)
    sizes = space.config_mesh(cfg, 3072)
    assert sizes["stage"] == stages and sizes["expert"] == 12
    shards = sizes["data"] * sizes["expert"]
    assert cfg.train.batch_size // pc.microbatches == shards  # one sequence per shard per microbatch


@pytest.mark.parametrize("name,mesh", [("mula_1b", {"data": 3072}), ("mula_7b_a1b", {"data": 3072}),
                                       ("mula_20b_a2b", {"data": 256, "expert": 12})])
def test_mula_configs_carry_seed_001s_batch_and_layout(name, mesh):
    """Every Mula file: 3,072 sequences of 2,048 tokens (6.3M), and seed 001's layout on its 3,072 tiles."""
    from gshard_jax.planner import space
    cfg = configs.load(os.path.join(ROOT, "experiments", f"{name}.py"))
    assert (cfg.train.batch_size, cfg.train.seq_len) == (3072, 2048)
    assert {a: n for a, n in space.config_mesh(cfg, 3072).items() if n > 1} == mesh


@pytest.mark.parametrize("path", EXPERIMENTS, ids=[name(p) for p in EXPERIMENTS])
def test_the_typed_config_holds_the_configdict_exactly(path):
    """configs.typed(): one frozen dataclass per section, the model section as the models' own dataclasses;
    it writes back the ConfigDict's JSON (WORKDIR/config.json is unchanged) and is made once."""
    cfg = configs.load(path)
    typed = configs.typed(cfg)
    assert typed.to_json(indent=1) == cfg.to_json(indent=1)
    assert configs.typed(typed) is typed
    assert typed.model.transformer == configs.transformer_config(cfg.model)
    axes = {k: v for k, v in cfg.mesh.items() if k not in configs.NOT_AXES}
    assert typed.mesh.sizes() == axes and list(typed.mesh.sizes()) == list(axes)  # name order
    assert typed.train.batch_size == cfg.train.batch_size and typed.pipeline.schedule == cfg.pipeline.schedule
    with pytest.raises(Exception, match="cannot assign"):
        typed.train.seed = 1  # frozen


def test_the_sections_defaults_are_their_dataclasses():
    assert configs.typed(configs.gpt(2, 128, 2)).train == configs.dataclasses.replace(
        configs.TrainConfig(), batch_size=256, seq_len=2048, warmup_steps=2500)
    assert dict(configs.mesh_defaults()) == dict(configs.MeshConfig().sizes(), auto=False, memory_budget=0.0)
    assert configs.pipeline_defaults().to_dict() == {"schedule": "gpipe", "repeats": 1, "owned_ends": True}


def test_the_typed_config_names_an_unknown_field():
    cfg = configs.load(os.path.join(ROOT, "experiments", "tiny_moe_lm.py"))
    cfg.train.num_step = 10  # a typo the ConfigDict takes silently
    with pytest.raises(ValueError, match=r"train has unknown fields \['num_step'\]"):
        configs.typed(cfg)
    cfg = configs.load(os.path.join(ROOT, "experiments", "tiny_moe_lm.py"))
    del cfg.train["offload_optimizer"]  # a config written before the field existed: its default
    assert configs.typed(cfg).train.offload_optimizer is False


def test_the_end_stages_own_the_ends_only_where_the_run_allows_it():
    """configs.end_stages_of: the pipeline's stages on an untied decoder LM with pipeline.owned_ends, whatever
    the schedule; replicated ends (1) otherwise: tied embeddings, the option off, an offloaded optimizer
    state, the encoder-decoder, no pipeline."""
    from gshard_jax.models.pipelined import PipelineConfig
    cfg = configs.load(os.path.join(ROOT, "experiments", "tiny_dense_lm.py"))
    one_f_one_b, gpipe = PipelineConfig(4, 8, "1f1b"), PipelineConfig(4, 8, "gpipe")
    assert configs.end_stages_of(cfg, one_f_one_b) == 4
    assert configs.end_stages_of(cfg, PipelineConfig(2, 4, "interleaved_1f1b", 2)) == 2
    assert configs.end_stages_of(cfg, gpipe) == 4
    assert configs.end_stages_of(cfg, PipelineConfig(2, 4, "circular", 2)) == 2
    assert configs.end_stages_of(cfg, None) == 1
    for section, field, value in (("model", "tie_embeddings", True), ("pipeline", "owned_ends", False),
                                  ("train", "offload_optimizer", True)):
        other = configs.load(os.path.join(ROOT, "experiments", "tiny_dense_lm.py"))
        other[section][field] = value
        assert configs.end_stages_of(other, one_f_one_b) == 1, field
    assert configs.end_stages_of(configs.gshard(0, 4), one_f_one_b) == 1
