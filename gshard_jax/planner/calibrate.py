"""``gshard-jax calibrate``: the compute efficiency the planner assumes, measured on the device present.

The planner prices a step's compute as model flops / (devices x peak x efficiency) (estimate.compute_time).
Peak is the data sheet's; efficiency is what a step of this model reaches, and only a device can say. This
times a config's train step, partitioned by us, on one device (so no collective runs and the time is all
compute), and writes a hardware profile: the built-in profile of that device (or `base`), its efficiency
replaced by the measured one and its source saying where it came from. `gshard-jax plan --hardware FILE`
then ranks candidates on it.

One calibration predicts its own config exactly (the same formula, inverted); check it against a step it did
not measure (another batch, remat policy or model: docs/planner.md, "Calibrating").
"""
from __future__ import annotations

import dataclasses
import datetime
import json
from typing import Any, Optional

import jax
import ml_collections

from .. import configs
from ..partitioner import hardware
from ..partitioner.hardware import Hardware
from . import estimate as E


def model_flops_per_step(cfg: ml_collections.ConfigDict) -> float:
    """The planner's flops of the config's step: model flops per token x tokens x full remat's recompute."""
    t = cfg.train
    return configs.model_flops_per_token(cfg) * t.batch_size * t.seq_len * E.recompute(cfg.model.remat)


def predicted_step(cfg, hw: Hardware) -> float:
    """Seconds the planner gives the config's step on one device of `hw` (compute alone: nothing to send)."""
    return model_flops_per_step(cfg) / (hw.peak_flops * hw.efficiency)


def base_profile(device_kind: str, base: str = "") -> Hardware:
    """`base` (a profile's name or JSON file), else the built-in profile of the device kind."""
    if base:
        return hardware.get(base)
    hw = hardware.for_device(device_kind)
    if hw is None:
        raise ValueError(f"no built-in profile knows device kind {device_kind!r}: pass --base with a profile "
                         f"(a name from {sorted(hardware.PROFILES)} or a JSON file) holding its peak flop/s")
    return hw


def measure(cfg, workdir: str, steps: int = 10, warmup: int = 2) -> dict[str, Any]:
    """Median seconds of the config's train step on the first device (the mesh made one device whatever the
    config says), with what was timed."""
    from ..training.timing import median_times
    from ..training.train import Trainer, prepare_data
    one = jax.sharding.Mesh(jax.devices()[:1], ("data",))
    trainer = Trainer(configs.typed(cfg), workdir, mesh=one)
    state, batch = trainer.fresh_state(), trainer.batch(prepare_data(trainer.cfg, workdir), "train", 1)
    step = trainer.step_fn.lower(state, batch).compile()  # the trainer's step: its state donated
    flops = model_flops_per_step(cfg)
    held = [state]

    def one():
        held[0], metrics = step(held[0], batch)
        return metrics["loss"]
    seconds = median_times({"step": one}, steps, warmup)["step"]
    return {"step_s": seconds, "flops": flops, "device_kind": jax.devices()[0].device_kind,
            "batch_size": cfg.train.batch_size, "seq_len": cfg.train.seq_len, "remat": cfg.model.remat,
            "attention": cfg.model.attention, "dtype": cfg.model.dtype, "steps": steps, "jax": jax.__version__}


def calibrated(base: Hardware, measured: dict[str, Any], config_name: str) -> Hardware:
    """`base` with the efficiency the measurement implies, named and sourced as measured."""
    efficiency = measured["flops"] / (measured["step_s"] * base.peak_flops)
    when = datetime.date.today().isoformat()
    note = (f"efficiency {efficiency:.3f} measured by gshard-jax calibrate on {measured['device_kind']} ({when}, "
            f"JAX {measured['jax']}): {config_name}, batch {measured['batch_size']} x {measured['seq_len']} "
            f"tokens, remat {measured['remat']}, attention {measured['attention']}, {measured['dtype']}, "
            f"median of {measured['steps']} steps {measured['step_s'] * 1e3:.1f} ms")
    return dataclasses.replace(base, name=f"{base.name}-calibrated", efficiency=efficiency,
                               source=f"{base.source}; {note}")


def write(hw: Hardware, path: str) -> None:
    """The profile as JSON (hardware.from_json reads it back)."""
    with open(path, "w") as f:
        json.dump(hw.to_dict(), f, indent=1, sort_keys=True)
        f.write("\n")


def run(cfg, workdir: str, out: str, config_name: str, base: str = "", steps: int = 10,
        check: Optional[Any] = None) -> dict[str, Any]:
    """Measure, write the profile to `out`; with `check` (another config), time it too and compare the
    planner's prediction for it on the new profile. -> what was measured and predicted."""
    measured = measure(cfg, workdir, steps)
    hw = calibrated(base_profile(measured["device_kind"], base), measured, config_name)
    write(hw, out)
    result = {"profile": out, "efficiency": hw.efficiency, "peak_flops": hw.peak_flops, **measured,
              "predicted_step_s": predicted_step(cfg, hw)}
    if check is not None:
        other = measure(check, workdir, steps)
        predicted = predicted_step(check, hw)
        result["check"] = {"measured_step_s": other["step_s"], "predicted_step_s": predicted,
                           "predicted_over_measured": predicted / other["step_s"]}
    return result
