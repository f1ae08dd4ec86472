"""``gshard-jax calibrate``: the compute efficiency the planner assumes, measured on the device present.

The planner prices a step's compute as model flops / (devices x peak x efficiency) (estimate.compute_time).
Peak is the data sheet's; efficiency is what a step of this model reaches, and only a device can say. This
times a config's train step, partitioned by us, on one device (so no collective runs and the time is all
compute), and writes a hardware profile: the built-in profile of that device (or `base`), its efficiency
replaced by the measured one and its source saying where it came from. `gshard-jax plan --hardware FILE`
then ranks candidates on it.

One calibration predicts its own config exactly (the same formula, inverted); check it against a step it did
not measure (another batch, remat policy or model: docs/planner.md, "Calibrating").

It also times the host's part of an offloaded optimizer update (XLA:CPU's AdamW, which XLA:GPU runs for a
compute_on("device_host") region) and writes the host-update bandwidth that time implies, so the planner's
price for offloading (estimate.host_transfer_s) is measured too.
"""
from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import statistics
import time
from typing import Any, Optional

import jax
import jax.numpy as jnp
import ml_collections
import optax

from .. import configs
from ..partitioner.costs import hardware
from ..partitioner.costs.hardware import Hardware
from . import estimate as E, space as SP


def model_flops_per_step(cfg: ml_collections.ConfigDict, platform: str = "") -> float:
    """The planner's flops of the config's step on `platform` (which decides what attention="auto" runs):
    the model's and what its remat policy computes again (estimate.flops)."""
    return E.flops(SP.model_shape(cfg, platform), SP.Candidate((), remat=cfg.model.remat))


def predicted_step(cfg, hw: Hardware) -> float:
    """Seconds the planner gives the config's step on one device of `hw` (compute alone: nothing to send)."""
    return model_flops_per_step(cfg, hw.platform) / (hw.peak_flops * hw.efficiency)


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
    flops = model_flops_per_step(cfg, jax.default_backend())
    held = [state]

    def one():
        held[0], metrics = step(held[0], batch)
        return metrics["loss"]
    seconds = median_times({"step": one}, steps, warmup)["step"]
    return {"step_s": seconds, "flops": flops, "device_kind": jax.devices()[0].device_kind,
            "batch_size": cfg.train.batch_size, "seq_len": cfg.train.seq_len, "remat": cfg.model.remat,
            "attention": cfg.model.attention, "dtype": cfg.model.dtype, "steps": steps, "jax": jax.__version__}


HOST_UPDATE_PARAMS = 2**25  # parameters the host's update is timed on: 32M, 0.4 GiB of float32 state


def host_update_s_per_param(params: int, leaves: int = 1, repeats: int = 5, dtype: str = "bfloat16") -> float:
    """Median seconds a parameter of XLA:CPU's AdamW update of about `params` parameters in `leaves` equal
    leaves on the host's CPU backend: float32 master weights and moments updated in place (donated, as the
    offloaded step's state is), gradients in and params out in `dtype`. This is the computation an offloaded
    update runs on the host, which XLA:GPU runs with XLA:CPU's runtime."""
    if params < leaves or leaves < 1:
        raise ValueError(f"host_update_s_per_param(params={params}, leaves={leaves}): time at least one "
                         f"parameter a leaf and one leaf")
    tx, low = optax.adamw(1e-4, weight_decay=0.1), jnp.dtype(dtype)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def update(p, s, g):
        u, s = tx.update([x.astype(jnp.float32) for x in g], s, p)
        p = optax.apply_updates(p, u)
        return p, s, [x.astype(low) for x in p]
    with jax.default_device(jax.devices("cpu")[0]):
        p = [jnp.full((params // leaves,), 0.1, jnp.float32) for _ in range(leaves)]
        g = [jnp.full((params // leaves,), 0.01, low) for _ in range(leaves)]
        s = tx.init(p)
        p, s, _ = jax.block_until_ready(update(p, s, g))
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            p, s, _ = jax.block_until_ready(update(p, s, g))
            times.append(time.perf_counter() - t)
    return statistics.median(times) / (leaves * (params // leaves))


def host_update_bandwidth(seconds_per_param: float, dtype: str) -> float:
    """The host_update_bandwidth that prices an update at the measured seconds per parameter: the bytes
    estimate.host_transfer_s charges a parameter on the host (the state read and written, 2 x
    HOST_STATE_BYTES, and the gradient read, in the params' dtype) over those seconds."""
    return (2 * E.HOST_STATE_BYTES + jnp.dtype(dtype).itemsize) / seconds_per_param


def calibrated(base: Hardware, measured: dict[str, Any], config_name: str) -> Hardware:
    """`base` with the efficiency the measurement implies (and the host-update bandwidth, where the host's
    update was timed), named and sourced as measured."""
    efficiency = measured["flops"] / (measured["step_s"] * base.peak_flops)
    when = datetime.date.today().isoformat()
    note = (f"efficiency {efficiency:.3f} measured by gshard-jax calibrate on {measured['device_kind']} ({when}, "
            f"JAX {measured['jax']}): {config_name}, batch {measured['batch_size']} x {measured['seq_len']} "
            f"tokens, remat {measured['remat']}, attention {measured['attention']}, {measured['dtype']}, "
            f"median of {measured['steps']} steps {measured['step_s'] * 1e3:.1f} ms")
    host = {}
    if measured.get("host_update_s_per_param"):
        host["host_update_bandwidth"] = host_update_bandwidth(measured["host_update_s_per_param"], measured["dtype"])
        note += (f"; host_update_bandwidth {host['host_update_bandwidth'] / 1e9:.2f} GB/s measured (XLA:CPU's "
                 f"AdamW on the host, {measured['host_update_s_per_param'] * 1e9:.2f} ns a parameter over "
                 f"{measured['host_update_params']:,})")
    return dataclasses.replace(base, name=f"{base.name}-calibrated", efficiency=efficiency,
                               source=f"{base.source}; {note}", **host)


def write(hw: Hardware, path: str) -> None:
    """The profile as JSON (hardware.from_json reads it back)."""
    with open(path, "w") as f:
        json.dump(hw.to_dict(), f, indent=1, sort_keys=True)
        f.write("\n")


def run(cfg, workdir: str, out: str, config_name: str, base: str = "", steps: int = 10,
        check: Optional[Any] = None, host_params: int = HOST_UPDATE_PARAMS) -> dict[str, Any]:
    """Measure, write the profile to `out`; with `check` (another config), time it too and compare the
    planner's prediction for it on the new profile; with host_params, time the host's update of that many
    parameters too (0: keep the base profile's host-update bandwidth). -> what was measured and predicted."""
    if host_params < 0:
        raise ValueError(f"host_params={host_params}: the parameters to time the host's update on, 0 to keep the "
                         f"base profile's host_update_bandwidth")
    measured = measure(cfg, workdir, steps)
    if host_params:
        measured["host_update_params"] = host_params
        measured["host_update_s_per_param"] = host_update_s_per_param(host_params, dtype=measured["dtype"])
    hw = calibrated(base_profile(measured["device_kind"], base), measured, config_name)
    write(hw, out)
    result = {"profile": out, "efficiency": hw.efficiency, "peak_flops": hw.peak_flops,
              "host_update_bandwidth": hw.host_update_bandwidth, **measured,
              "predicted_step_s": predicted_step(cfg, hw)}
    if check is not None:
        other = measure(check, workdir, steps)
        predicted = predicted_step(check, hw)
        result["check"] = {"measured_step_s": other["step_s"], "predicted_step_s": predicted,
                           "predicted_over_measured": predicted / other["step_s"]}
    return result
