"""Every benchmark runs, at its smallest size: a smoke run per script, so none breaks silently (the figures
themselves are the benchmarks' to print, not the tests' to hold)."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from helpers import load_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--config", "experiments/tiny_dense_lm.py"]
SMALL_MODEL = ["--set", "model.num_layers=1", "model.vocab_size=256"]
# script -> arguments of its smallest run (and what its output must hold)
RUNS = {
    "annotation_forms.py": ([], "with_sharding_constraint"),
    "auto_sharding.py": (["--scale", "0.25"], "auto, the hand program's memory"),
    "auto_training.py": (["--configs", "tiny_dense_lm", "--layers", "1"], "mesh.auto, the rules table's memory"),
    "checkpoint_io.py": (TINY + ["--processes", "1"] + SMALL_MODEL, "restored equal: True"),
    "collective_matmul.py": (["--d-model", "64", "--seq", "64", "--steps", "1"], "bidirectional"),
    "gpu.py": (["--cpu-devices", "4", "--steps", "1", "--cases", "tiny_dense_lm_tp", "--flags", "on", "--set",
                "model.num_layers=1"],
               "permutes"),
    "gpu_profile.py": (["--small", "--variants", "xla:dots", "--out", os.path.join("build", "gpu_traces")],
                       "ms of device kernels a step"),
    "host_update.py": (["--params", "65536", "--groups", "2", "--repeats", "1"], "numpy, 1 thread"),
    "lm1b_style.py": ([], "xla"),
    "memory_grid.py": (["--cases", "0", "--no-explain"], "formula / compiled"),
    "memory_prediction.py": (["--cases", "Megatron"], "MLP step, Megatron"),
    "moe_dropless.py": (["--steps", "1", "--tokens", "256"], "dropless"),
    "moe_vs_dense.py": (["--steps", "2", "--seeds", "0", "--set", "model.num_layers=1"], "MoE - dense"),
    "partition_scaling.py": (["--layers", "1", "--repeats", "1", "--compile-repeats", "1", "--no-compile"],
                             "partition s"),
    "partitioner_vs_xla.py": (["--steps", "1", "--only", "megatron_mlp fwd"], "megatron_mlp fwd"),
    "pipeline.py": (["--layers", "4", "--width", "32", "--micro", "2", "--steps", "1", "--schedules", "gpipe"],
                    "gpipe"),
    "planned_mfu.py": (["--cases", "gpt_20b_32", "--verify", "1"], "gpt_20b_32"),
    "planner.py": (TINY + ["--devices", "8", "--top", "1"], "formula comm"),
    "ring_attention.py": (["--seq", "256", "--block-sizes", "16,8"], "| ring, tile 8 |"),
    "scaling.py": (TINY + ["--devices", "4,8", "--top", "1", "--per-device", "2"], "weak-scaling efficiency"),
    "sharded_state.py": (TINY + ["--steps", "1"] + SMALL_MODEL, "EPSO"),
    "step_reductions.py": (["--no-xla"], "interleaved_1f1b"),
}
SLOW = {"sharded_state.py",  # about a minute: every ZeRO stage, with and without EPSO, compiled twice
        "moe_vs_dense.py",  # about a minute: a token corpus prepared, two training runs
        "gpu_profile.py"}  # about a minute: two programs compiled and traced in fresh processes


def test_every_benchmark_has_a_smoke_run():
    assert sorted(RUNS) == sorted(f for f in os.listdir(os.path.join(ROOT, "benchmarks")) if f.endswith(".py"))


@pytest.mark.parametrize("script", [pytest.param(s, marks=[pytest.mark.slow] if s in SLOW else []) for s in RUNS])
def test_benchmark_runs_at_its_smallest_size(script):
    args, expect = RUNS[script]
    p = subprocess.run([sys.executable, os.path.join("benchmarks", script), *args], cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert expect in p.stdout, p.stdout[-3000:]


def _gpu_benchmark():
    """benchmarks/gpu.py as a module (its CASES and configure)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import gpu
    finally:
        sys.path.pop(0)
    return gpu


def _script(name: str) -> str:
    with open(os.path.join(ROOT, "benchmarks", name)) as f:
        return f.read()


def test_the_one_command_gpu_benchmark_runs_every_case():
    """benchmarks/gpu.sh names every case of benchmarks/gpu.py (the dropless one cannot compile on XLA:CPU, so
    the script itself runs where GPUs are)."""
    gpu = _gpu_benchmark()
    script = _script("gpu.sh")
    listed = next(line for line in script.splitlines() if "--cases" in line).split("--cases")[1].split()[0]
    assert sorted(listed.split(",")) == sorted(gpu.CASES)
    assert os.access(os.path.join(ROOT, "benchmarks", "gpu.sh"), os.X_OK)


def test_the_gpu_check_script_sets_fields_the_configs_have():
    """benchmarks/gpu_check.sh runs where a GPU is lent, for minutes: every override it passes must be one the
    config takes, checked here where it costs nothing (the cuDNN variant builds; it runs only on a GPU)."""
    gpu = _gpu_benchmark()
    from gshard_jax import configs
    script = _script("gpu_check.sh")
    variants, offloads = re.findall(r"for variant in (.*?); do", script, re.S)
    sets = re.search(r'--set "model.attention=\$attention" "model.remat=\$remat" "train.offload_optimizer=\$offload" '
                     r'"model.scan=\$scan"', script)
    assert sets, "the variant loop's --set arguments changed: update this test"
    for attention, remat, offload, scan in (v.split() for v in re.findall(r'"([^"]+)"', variants)):
        cfg = gpu.configure("mula_1b", 1, "auto", [f"model.attention={attention}", f"model.remat={remat}",
                                                   f"train.offload_optimizer={offload}", f"model.scan={scan}"])
        typed = configs.typed(cfg)
        assert (typed.model.transformer.attention, typed.model.transformer.remat) == (attention, remat)
        assert typed.model.transformer.scan == (scan == "true")
        assert typed.train.offload_optimizer == (offload == "true")
    offload_sets = (r'"model.num_layers=4" "train.offload_optimizer=\$offload" \\\n\s+"train.delayed_update=\$delayed" '
                    r'"train.host_update_groups=\$groups"')
    assert re.search(offload_sets, script), "the offload loop's --set arguments changed: update this test"
    for offload, delayed, groups in (v.split() for v in re.findall(r'"([^"]+)"', offloads)):
        cfg = gpu.configure("mula_1b", 1, "auto", ["model.attention=cudnn", "model.remat=dots", "model.num_layers=4",
                                                   f"train.offload_optimizer={offload}",
                                                   f"train.delayed_update={delayed}",
                                                   f"train.host_update_groups={groups}"])
        typed = configs.typed(cfg)
        assert typed.train.offload_optimizer == (offload == "true") and cfg.model.num_layers == 4
        assert typed.train.delayed_update == (delayed == "true")
        assert typed.train.host_update_groups == int(groups) and (groups == "1" or offload == "true")
    calibrate = script[script.index("gshard_jax.cli calibrate"):]
    for key in re.findall(r"--config\.([\w.]+)=", calibrate) + re.findall(r"--check ([\w.]+)=", calibrate):
        section, field = key.split(".")
        assert field in configs.load(os.path.join(ROOT, "experiments", "mula_1b.py"))[section], key
    assert os.access(os.path.join(ROOT, "benchmarks", "gpu_check.sh"), os.X_OK)


def test_gpu_profile_splits_a_streams_idle_time_into_launch_gaps_and_waits():
    """gpu_profile.summary on kernels as data: (name, start us, duration us) on one stream over 2 steps."""
    profile = load_script("benchmarks", "gpu_profile.py")
    kernels = [("fusion.1", 0.0, 10.0), ("nvjet_gemm", 12.0, 100.0), ("fusion.2", 115.0, 5.0),  # step 1
               ("fusion.1", 420.0, 10.0), ("nvjet_gemm", 431.0, 100.0), ("fusion.2", 535.0, 5.0)]  # step 2
    got = profile.summary(kernels, steps=2)
    assert got["kernels_per_step"] == 3
    assert got["span_ms"] == pytest.approx(540.0 / 1e3 / 2)
    assert got["launch_gaps_ms"] == pytest.approx((2 + 3 + 1 + 4) / 1e3 / 2)  # the gaps under GAP_US
    assert got["waits_ms"] == pytest.approx(300.0 / 1e3 / 2) and got["longest_waits_ms"] == [pytest.approx(0.3)]
    assert got["by_kind_ms"] == {"matmul": pytest.approx(0.1), "other": pytest.approx(0.015)}
    assert got["top"][0][0] == "nvjet_gemm" and ("fusion", pytest.approx(0.015), 2) in got["top"]
    assert profile.summary([], steps=2)["span_ms"] == 0.0
