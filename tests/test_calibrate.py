"""gshard-jax calibrate: the efficiency written is the one the timed step implies, the profile reads back, and
the planner prices steps on it. Times are stood in for (a device's clock is the benchmark's business), by a
clock that runs a step in proportion to its model flops, so the prediction for a config never timed is exact
exactly when the planner's formula and the measurement agree on what a step computes."""
from __future__ import annotations

import json
import os

import pytest

from gshard_jax import cli, configs
from gshard_jax.partitioner.costs import hardware
from gshard_jax.planner import calibrate, search
from gshard_jax.training import overrides, timing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "experiments", "tiny_dense_lm.py")
SMALL = ["--config.model.num_layers=2", "--config.model.vocab_size=512", "--config.train.batch_size=4",
         "--config.train.seq_len=32"]
RATE = 2e9  # flop/s of the stand-in clock: 4% of cpu-simulation's 50 GFLOP/s peak


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("data"))
    assert cli.main(["prepare-data", "--out", d, "--vocab-size", "300", "--max-bytes", "300000"]) == 0
    return d


@pytest.fixture
def clock(monkeypatch):
    """median_times as a device would answer it if each step ran at RATE flop/s of the planner's flops."""
    timed = []

    def median_times(fns, steps, warmup=0):
        for fn in fns.values():
            fn()  # the compiled step runs (it must)
        timed.append(steps)
        return dict.fromkeys(fns, current["flops"] / RATE)
    current = {}
    real = calibrate.model_flops_per_step

    def flops(cfg, platform=""):
        current["flops"] = real(cfg, platform)
        return current["flops"]
    monkeypatch.setattr(timing, "median_times", median_times)
    monkeypatch.setattr(calibrate, "model_flops_per_step", flops)
    return timed


def _cfg(*extra):
    return overrides.apply(configs.load(CONFIG), overrides.split_args([*SMALL, *extra])[1])


def test_calibrate_writes_the_measured_efficiency_and_the_planner_predicts_another_step(
        data_dir, tmp_path, clock, capsys):
    out = tmp_path / "measured.json"
    args = ["calibrate", "--config", CONFIG, "--workdir", str(tmp_path), "--out", str(out), "--steps", "2",
            f"--config.data.dir={data_dir}", *SMALL, "--check", "train.batch_size=8", "--check", "model.remat=full",
            "--json"]
    # the model flops are computed before the step is timed; the stand-in clock reads them
    assert cli.main(args) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert clock == [2, 2]  # the config and the check, each timed
    hw = hardware.get(str(out))
    assert hw.name == "cpu-simulation-calibrated" and hw.device_kinds == ("cpu",)
    assert hw.efficiency == pytest.approx(RATE / hardware.PROFILES["cpu-simulation"].peak_flops)
    assert "measured by gshard-jax calibrate on cpu" in hw.source and "tiny_dense_lm.py" in hw.source
    # the check ran another batch with full remat (4/3 of the flops): predicted as measured
    assert result["check"]["predicted_over_measured"] == pytest.approx(1.0)
    checked = _cfg("--config.train.batch_size=8", "--config.model.remat=full")
    assert result["check"]["predicted_step_s"] == pytest.approx(calibrate.predicted_step(checked, hw))
    # plan ranks on the file: the one-device candidate with the config's remat is priced at the measured step
    plan = search.plan(_cfg(), 1, hw, top=20)
    row = next(r for r in plan.ranked if r.candidate.remat == "none" and r.candidate.microbatches == 1)
    assert row.estimate.step == pytest.approx(result["step_s"], rel=1e-6)
    # the host's update was timed too (the real one, 2**25 parameters): its bandwidth prices it as measured
    per_param = result["host_update_s_per_param"]
    assert result["host_update_params"] == calibrate.HOST_UPDATE_PARAMS and 0 < per_param < 1e-6
    assert hw.host_update_bandwidth == pytest.approx((2 * 12 + 4) / per_param)  # float32 params: 4-byte gradients
    assert "host_update_bandwidth" in hw.source and "measured" in hw.source.rsplit("host_update_bandwidth", 1)[1]


def test_the_measured_host_update_bandwidth_prices_an_update_at_the_time_measured():
    """estimate.host_transfer_s's host part, on a profile calibrate wrote, is the timed update's seconds for
    the same parameters; with --host-params 0 the base profile's assumed bandwidth stays."""
    from gshard_jax.planner import estimate
    from gshard_jax.planner.space import Candidate
    seconds = 2**20 * calibrate.host_update_s_per_param(2**20, repeats=3)
    assert 0 < seconds < 10
    with pytest.raises(ValueError, match="params=2, leaves=3"):
        calibrate.host_update_s_per_param(2, leaves=3)
    measured = {"flops": 1e9, "step_s": 1.0, "device_kind": "cpu", "jax": "x", "batch_size": 1, "seq_len": 1,
                "remat": "none", "attention": "einsum", "steps": 1, "dtype": "bfloat16",
                "host_update_params": 2**20, "host_update_s_per_param": seconds / 2**20}
    base = hardware.PROFILES["cpu-simulation"]
    hw = calibrate.calibrated(base, measured, "x.py")
    mem = {"host_optimizer": 12.0 * 2**20, "host_exchange": 2.0 * 2**20}  # bf16 params: 2-byte exchange
    on_host = estimate.host_transfer_s(hw, Candidate(mesh=(), offload=True), mem) \
        - 2 * mem["host_exchange"] / hw.host_bandwidth
    assert on_host == pytest.approx(seconds)
    assert calibrate.calibrated(base, {**measured, "host_update_s_per_param": None}, "x.py").host_update_bandwidth \
        == base.host_update_bandwidth


def test_an_unknown_device_needs_a_base_profile():
    with pytest.raises(ValueError, match=r"'Imaginary 9000'.*--base"):
        calibrate.base_profile("Imaginary 9000")
    assert calibrate.base_profile("Imaginary 9000", "h100-8").peak_flops == 989e12
    assert calibrate.base_profile("NVIDIA H100 80GB HBM3").name == "h100-8"


def test_the_built_in_efficiencies_are_the_assumptions_docs_planner_lists():
    """docs/planner.md, "Calibrating": none of these was measured; a calibrated profile is a JSON file."""
    assert {name: hw.efficiency for name, hw in hardware.PROFILES.items()} == {
        "generic-accelerator": 1.0, "generic-cpu": 1.0, "cpu-simulation": 0.5, "h100-8": 0.5, "h200-8": 0.5,
        "perlmutter-a100": 0.5, "tpu-v3": 0.5, "aurora-pvc": 0.4}


def test_every_built_in_profile_assumes_the_host_update_bandwidth_docs_planner_states():
    """docs/planner.md (offload): the host's update runs at an assumed 20 GB/s per device in every profile."""
    assert {hw.host_update_bandwidth for hw in hardware.PROFILES.values()} == {20e9}


def test_the_h200_profile_on_record_is_the_calibration_docs_planner_quotes():
    """docs/planner.md quotes an efficiency of 0.490 measured on one H200 and ships the profile calibrate wrote:
    it reads back, names the H200, and prices the timed config at the step its source says was measured;
    the remat-dots check docs/planner.md quotes (132.3 ms measured) is 10.5% under the price of that step,
    whose backward runs the fused kernel's forward again (estimate.recomputed_flops_per_token)."""
    hw = hardware.from_json(os.path.join(ROOT, "benchmarks", "profiles", "h200_calibrated.json"))
    assert hw.device_kinds == ("h200",) and hw.peak_flops == 989e12 and round(hw.efficiency, 3) == 0.490
    assert "measured by gshard-jax calibrate on NVIDIA H200" in hw.source and "remat none" in hw.source
    cfg = configs.load(os.path.join(ROOT, "experiments", "mula_1b.py"))
    cfg.train.batch_size, cfg.train.seq_len, cfg.model.remat = 4, 2048, "none"
    measured_ms = float(hw.source.rsplit("median of 10 steps ", 1)[1].split(" ms")[0])
    assert 1e3 * calibrate.predicted_step(cfg, hw) == pytest.approx(measured_ms, abs=0.05)
    cfg.model.remat = "dots"
    assert 1e3 * calibrate.predicted_step(cfg, hw) / 132.3 == pytest.approx(1.118, abs=0.001)
    assert 1e3 * calibrate.predicted_step(cfg, hw) == pytest.approx(147.9, abs=0.05)
    # the flops it quotes (none and dots), and the efficiency a calibration on the dots step would read
    dots = calibrate.model_flops_per_step(cfg, "gpu")
    cfg.model.remat = "none"
    assert (calibrate.model_flops_per_step(cfg, "gpu") / 1e12, dots / 1e12) == pytest.approx((69.5, 71.7), abs=0.05)
    assert dots / (0.1323 * hw.peak_flops) == pytest.approx(0.548, abs=0.0005)


def test_the_h200_profile_keeps_the_assumed_host_bandwidth_docs_planner_says_and_its_measured_figure():
    """docs/planner.md: h200_calibrated.json predates the host timing and keeps 20 GB/s; the H200's 3.1 ns a
    parameter (docs/training.md) would read about 8.4 GB/s for bf16 params."""
    hw = hardware.from_json(os.path.join(ROOT, "benchmarks", "profiles", "h200_calibrated.json"))
    assert hw.host_update_bandwidth == 20e9
    assert calibrate.host_update_bandwidth(3.1e-9, "bfloat16") / 1e9 == pytest.approx(8.4, abs=0.05)
