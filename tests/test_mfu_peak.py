"""MFU divides by the peak of the devices present: their device_kind picks a built-in profile, an unknown one
asks for train.peak_flops, and a reading above 100% warns."""
from __future__ import annotations

import json
import os
import warnings

import pytest

from gshard_jax import configs
from gshard_jax.partitioner.costs import hardware
from gshard_jax.training import timing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cfg(**train):
    cfg = configs.load(os.path.join(ROOT, "experiments", "tiny_moe_lm.py"))
    cfg.train.update(train)
    return cfg


@pytest.mark.parametrize("kind,peak", [("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 989e12),
                                       ("NVIDIA H200", 989e12), ("NVIDIA A100-SXM4-40GB", 312e12),
                                       ("TPU v3", 61.5e12), ("cpu", 50e9)])
def test_the_peak_is_the_device_kinds(monkeypatch, kind, peak):
    monkeypatch.setattr(timing, "device_kind", lambda: kind)
    assert timing.peak_flops(_cfg()) == peak


def test_the_devices_of_this_machine_are_known():
    assert timing.peak_flops(_cfg()) == hardware.PROFILES["cpu-simulation"].peak_flops


def test_an_unknown_device_asks_for_its_peak(monkeypatch):
    monkeypatch.setattr(timing, "device_kind", lambda: "Imaginary Accelerator 9000")
    with pytest.raises(ValueError, match=r"'Imaginary Accelerator 9000'.*train\.peak_flops"):
        timing.peak_flops(_cfg())
    assert timing.peak_flops(_cfg(peak_flops=123e12)) == 123e12  # what the message asks for
    assert timing.peak_flops(_cfg(hardware="h100-8")) == 989e12  # or a profile by name


def test_a_user_profile_names_its_devices(tmp_path, monkeypatch):
    raw = dict(hardware.PROFILES["h100-8"].to_dict(), name="mine", device_kinds=["imaginary"], peak_flops=1e15)
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(raw))
    hw = hardware.get(str(path))
    assert hw.device_kinds == ("imaginary",) and hash(hw)
    monkeypatch.setattr(timing, "device_kind", lambda: "Imaginary Accelerator 9000")
    assert timing.peak_flops(_cfg(hardware=str(path))) == 1e15


def test_mfu_above_100_percent_warns_once():
    t = _cfg().train
    clock = timing.Clock(t, devices=1, peak=1.0, flops_per_token=1e6)
    clock.step_done(timed=True)
    with pytest.warns(RuntimeWarning, match=r"mfu reads .*%.*train\.peak_flops"):
        assert clock.window()["mfu"] > 1.0
    clock.step_done(timed=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        clock.window()  # said once
    sane = timing.Clock(t, devices=1, peak=1e30, flops_per_token=1.0)
    sane.step_done(timed=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert sane.window()["mfu"] < 1.0
