"""Time and utilisation: median step times of several compiled functions, timed alternately so that each
sees the same machine load (these hosts are noisy: compare medians from one run, never single timings), and
a training run's throughput, mfu and waits per logged row."""
from __future__ import annotations

import contextlib
import statistics
import time
import warnings
from typing import Callable, Mapping

import jax

from .. import configs
from ..partitioner.costs import hardware


def median_times(fns: Mapping[str, Callable[[], object]], steps: int, warmup: int = 0) -> dict[str, float]:
    """{name: median seconds of fn()} over `steps` rounds after `warmup` untimed ones; the order within a
    round reverses every round."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(warmup + steps):
        for name in (list(fns) if i % 2 else list(fns)[::-1]):
            t = time.perf_counter()
            jax.block_until_ready(fns[name]())
            if i >= warmup:
                times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) for name, ts in times.items()}


def device_kind() -> str:
    """What the run's devices are ("NVIDIA H100 80GB HBM3", "cpu")."""
    return jax.devices()[0].device_kind


def peak_flops(cfg: configs.Config | configs.ConfigDict) -> float:
    """Flop/s of one device for the mfu metric: train.peak_flops, else train.hardware's profile, else ("auto")
    the built-in profile of the devices present; a ValueError where none knows them."""
    if cfg.train.peak_flops:
        return float(cfg.train.peak_flops)
    if cfg.train.hardware != "auto":
        return hardware.get(cfg.train.hardware).peak_flops
    kind = device_kind()
    hw = hardware.for_device(kind)
    if hw is None:
        known = sorted(f"{k} ({h.name})" for h in hardware.PROFILES.values() for k in h.device_kinds)
        raise ValueError(f"no peak flop/s is known for device kind {kind!r} (the built-in profiles know "
                         f"{', '.join(known)}); set train.peak_flops to one device's dense bf16 flop/s, e.g. "
                         f"--config.train.peak_flops=989e12 for an H100, or train.hardware to a profile's name or "
                         f"JSON file (gshard-jax calibrate writes one)")
    return hw.peak_flops


def model_flops_per_token(cfg: configs.Config | configs.ConfigDict) -> float:
    """The model's flops per trained token (6 per active parameter plus attention; the planner's too)."""
    return configs.model_flops_per_token(cfg)


class Clock:
    """Step time, throughput and utilisation over the steps since the last logged row, and the time spent
    waiting on data and checkpoints (each step is timed when its metrics reach the host, one step late)."""

    def __init__(self, t: configs.TrainConfig, devices: int, peak: float, flops_per_token: float):
        self.tokens_per_step = t.batch_size * t.seq_len
        self.devices, self.peak, self.flops_per_token = devices, peak, flops_per_token
        self.first = self.prev = time.perf_counter()
        self.steps, self.seconds = 0, 0.0
        self.waits = {"data_wait_s": 0.0, "checkpoint_s": 0.0}
        self.warned = False  # an mfu above 100% is said once

    def step_done(self, timed: bool) -> None:
        now = time.perf_counter()
        if timed:
            self.steps, self.seconds = self.steps + 1, self.seconds + now - self.prev
        self.prev = now

    def pause(self) -> None:
        self.prev = time.perf_counter()

    @contextlib.contextmanager
    def waiting(self, what: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.waits[what] += time.perf_counter() - start

    def window(self) -> dict:
        """The logged row's timing figures; the window starts again."""
        seconds = self.seconds if self.steps else time.perf_counter() - self.first
        steps = self.steps or 1
        tokens_per_s = steps * self.tokens_per_step / seconds
        mfu = self.flops_per_token * tokens_per_s / (self.devices * self.peak)
        if mfu > 1.0 and not self.warned:
            self.warned = True
            warnings.warn(f"mfu reads {mfu:.0%}: the devices compute faster than the peak it divides by "
                          f"({self.peak:.3g} flop/s per device); set train.peak_flops to their dense bf16 peak, or "
                          f"train.hardware to their profile", RuntimeWarning, stacklevel=2)
        row = {"tokens_per_s": tokens_per_s, "tokens_per_s_per_device": tokens_per_s / self.devices,
               "mfu": mfu, "step_time_s": seconds / steps, **self.waits}
        self.steps, self.seconds = 0, 0.0
        self.waits = dict.fromkeys(self.waits, 0.0)
        return row
