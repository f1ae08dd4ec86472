"""Every benchmark runs, at its smallest size: a smoke run per script, so none breaks silently (the figures
themselves are the benchmarks' to print, not the tests' to hold)."""
from __future__ import annotations

import json
import os
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
    "gpu_check.py": (["--small", "--parts", "speed", "--out", os.path.join("build", "gpu_check")], "| target |"),
    "gpu.py": (["--cpu-devices", "4", "--steps", "1", "--cases", "tiny_dense_lm_tp", "--flags", "on", "--set",
                "model.num_layers=1"],
               "permutes"),
    "gpu_profile.py": (["--small", "--variants", "xla:dots", "--out", os.path.join("build", "gpu_traces")],
                       "ms of device kernels a step"),
    "host_update.py": (["--params", "65536", "--groups", "2", "--repeats", "1"], "numpy, 1 thread"),
    "lm1b_style.py": ([], "xla"),
    "fit_habits.py": (["cpu", "--cases", "0"], "cpu fitted: 1 rows, 1 within [0.9, 1.15]"),
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
        "gpu_profile.py",  # about a minute: two programs compiled and traced in fresh processes
        "gpu_check.py"}  # about two minutes: the anchor's four variants and four of our steps, each in a process


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


def test_the_gpu_checks_runs_set_fields_the_configs_have():
    """benchmarks/gpu_check.py runs where a GPU is lent, for minutes: every run's overrides must be ones the
    config takes and mean what the run's name says, checked here where it costs nothing."""
    gpu, check = _gpu_benchmark(), load_script("benchmarks", "gpu_check.py")
    from gshard_jax import configs
    assert {r.part for r, _ in check.PLAN} == set(check.PARTS)
    assert set(sum(check.CALLS, ())) == set(check.DEFAULT_PARTS)
    for parts in check.CALLS:  # each call of a device session fits the budget by the table's estimates
        assert sum(s for _, s in check.plan(parts)) <= check.BUDGET_S, parts
    names = [r.name for r, _ in check.PLAN]
    assert len(names) == len(set(names))
    for k, (run, seconds) in enumerate(check.PLAN):
        assert seconds > 0 and (not run.after or run.after in names[:k])  # what a run follows runs before it
        argv = check.command(run, "OUT", "ANCHOR", False, 1.0)
        if run.kind == "ours":
            sets = argv[argv.index("--set") + 1:]
            assert sets[0] == "model.attention=cudnn"
            typed = configs.typed(gpu.configure("mula_1b", 1, "auto", sets))
            t, m = typed.train, typed.model.transformer
            assert m.remat == ("dots" if "dots" in run.name or "offload" in run.name else "none")
            if run.part == "speed":
                assert m.scan == run.name.endswith("_scan") and m.num_layers == 16
            else:  # offload_LAYERS_{device | dDELAYED_gGROUPS}[_mMICROBATCHES]
                _, layers, *what = run.name.split("_")
                micro = int(what.pop()[1:]) if what[-1].startswith("m") else 1
                assert (m.num_layers, t.microbatches, t.batch_size) == (int(layers), micro, 4 * micro)
                assert t.offload_optimizer == (what != ["device"])
                if t.offload_optimizer:
                    assert what == [f"d{int(t.delayed_update)}", f"g{t.host_update_groups}"]
        elif run.kind in ("anchor", "profile"):
            variants = argv[argv.index("--variants") + 1].split(",")
            assert all(v.split(":")[0] == "cudnn" and v.split(":")[1] in ("dots", "none") and
                       v.split(":")[2:] in ([], ["scan"]) for v in variants), variants
        elif run.kind == "calibrate":
            mula = configs.load(os.path.join(ROOT, "experiments", "mula_1b.py"))
            keys = [a.split("=")[0][len("--config."):] for a in argv if a.startswith("--config.")]
            keys += [argv[argv.index("--check") + 1].split("=")[0]]
            for key in keys:
                section, field = key.split(".")
                assert field in mula[section], key
    assert os.access(os.path.join(ROOT, "benchmarks", "gpu_check.sh"), os.X_OK)


def _row(ms, xla=None, mfu=0.5, total=40 * 2**30, optimizer=0, host=0, measured=None, **extra) -> dict:
    """A benchmarks/gpu.py row with the fields gpu_check's report reads (but its `sets`)."""
    row = {"ours_ms": ms, "mfu": mfu, "flops_per_token": 8e9, "peak_flops": 1e15,
           "device_kind": "NVIDIA H200", "jax": "0.11.2", "parameters": 10**9, "ours_measured_peak_bytes": measured,
           "ours_step_memory": {"total": total, "optimizer": optimizer, "host": host}, **extra}
    return dict(row, xla_ms=xla) if xla else row


def test_the_gpu_checks_report_holds_each_target_against_rows_as_data(tmp_path):
    """gpu_check's report on rows as data: each target's figure and verdict, from the files a call writes."""
    check = load_script("benchmarks", "gpu_check.py")
    GiB = 2**30
    anchor = [{"variant": v, "step_ms": ms, "tokens_per_s": 8192 / ms * 1e3} for v, ms in
              (("cudnn:dots", 120.0), ("cudnn:dots:scan", 125.0), ("cudnn:none", 115.0), ("cudnn:none:scan", 130.0))]
    (tmp_path / "anchor.jsonl").write_text("".join(json.dumps(r) + "\n" for r in anchor))
    rows = {"ours_dots_scan": _row(128.0, 129.0, mfu=0.52, measured=40 * GiB, planned_bytes=44 * GiB,
                                   explained_bytes=39 * GiB),
            "ours_dots_unrolled": _row(123.0, 124.0, mfu=0.545), "ours_none_scan": _row(131.0),
            "ours_none_unrolled": _row(117.0),
            "offload_16_device": _row(100.0, total=30 * GiB, optimizer=8 * GiB),
            "offload_16_d0_g1": _row(500.0, total=20 * GiB, host=12 * GiB),
            "offload_16_d1_g1": _row(470.0), "offload_16_d1_g8": _row(420.0),
            "offload_16_device_m2": _row(200.0), "offload_16_d1_g8_m2": _row(420.0),
            "offload_16_device_m4": _row(400.0), "offload_16_d1_g8_m4": _row(420.0),
            "offload_4_device": _row(50.0), "offload_4_d0_g1": _row(48.0)}  # timing noise: no update resolved
    plan_sets = {r.name: r.sets for r, _ in check.PLAN}
    for name, row in rows.items():  # each row ran with its run's overrides, as benchmarks/gpu.py records them
        row["sets"] = ["model.attention=cudnn", *plan_sets[name]]
        (tmp_path / f"{name}.json").write_text(json.dumps([row]))
    (tmp_path / "host_update.json").write_text(json.dumps({"memory_bytes_per_s": 80e9}))
    text = check.report(str(tmp_path))
    verdicts = {line.split(" | ")[0][2:]: line.split(" | ")[1:] for line in text.splitlines()
                if line.endswith(("| met |", "| **not met** |", "| not measured |"))}
    assert verdicts["ours_dots_scan / anchor cudnn:dots:scan"][0] == "1.024" and \
        verdicts["ours_dots_scan / anchor cudnn:dots:scan"][-1] == "met |"
    assert verdicts["ours_dots_scan / anchor cudnn:dots"][0] == "1.067" and "not met" in \
        verdicts["ours_dots_scan / anchor cudnn:dots"][-1]
    assert verdicts["ours_dots_unrolled / anchor cudnn:dots"][0] == "1.025"
    assert verdicts["our best MFU"][0] == "0.545" and verdicts["our best MFU"][-1] == "met |"
    assert "not met" in verdicts["remat none / dots, scan"][-1] and verdicts["remat none / dots, unrolled"][0] == \
        "0.951"
    # explain() read 39 GiB against a measured 40: a prediction under the device's peak
    assert verdicts["memory predictions / measured peak (least)"][0] == "0.975"
    # the host's update: 500 - 100 ms against 28 B x 1e9 parameters at 80 GB/s = 350 ms
    host = next(k for k in verdicts if k.startswith("16 layers: host update (400 ms"))
    assert "bound (350 ms" in host and verdicts[host][0] == "1.143" and verdicts[host][-1] == "met |"
    assert verdicts["16 layers: delayed offloaded step / max(on device, host update)"][0] == "1.050"
    assert verdicts["16 layers: device memory saved / the optimizer state on the device"][0] == "1.250"
    micro = next(k for k in verdicts if k.startswith("delayed offload (8 groups)"))
    assert micro.endswith("1: 4.20, 2: 2.10, 4: 1.05") and verdicts[micro][0] == "4"
    host4 = next(k for k in verdicts if k.startswith("4 layers: host update (- ms"))
    assert verdicts[host4][-1] == "not measured |"  # an offloaded step faster than on the device times no update
    assert verdicts["4 layers: delayed offloaded step / max(on device, host update)"][-1] == "not measured |"


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


def test_the_gpu_check_skips_what_follows_a_failed_run_and_what_would_end_past_its_budget(tmp_path, monkeypatch):
    """gpu_check's runner with the commands stubbed, each taking its estimate on a stubbed clock: the whole
    model's offloaded runs after its first failed are skipped, and so is every run that would end past
    --budget-s."""
    import argparse
    import types
    check = load_script("benchmarks", "gpu_check.py")
    estimates = {r.name: s for r, s in check.PLAN}
    after = {r.name: r.after for r, _ in check.PLAN}
    ran, clock, failing = [], [0.0], [check.FULL]

    def fake_run(cmd, **_):
        name = os.path.basename(cmd[cmd.index("--json") + 1])[:-5] if "--json" in cmd else "host_update"
        ran.append(name)
        clock[0] += estimates[name]
        return types.SimpleNamespace(returncode=int(name in failing), stdout="", stderr="")
    monkeypatch.setattr(check.subprocess, "run", fake_run)
    monkeypatch.setattr(check.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(check, "report", lambda out: "")
    offload = [r.name for r, _ in check.plan(("offload",))]
    args = argparse.Namespace(out=str(tmp_path), anchor=__file__, parts="offload", budget_s=1e9, small=True)
    assert check.execute(args) == 1
    assert check.FULL in ran and ran == [n for n in offload if after[n] != check.FULL]
    assert len(ran) < len(offload)
    ran.clear(), failing.clear()
    args.budget_s = sum(estimates[n] for n in offload[:3])  # the first three runs fit, the fourth would not
    assert check.execute(args) == 0
    assert ran == offload[:3]
