"""Median step times of several compiled functions, timed alternately so that each sees the same machine
load (these hosts are noisy: compare medians from one run, never single timings)."""
from __future__ import annotations

import statistics
import time
from typing import Callable, Mapping

import jax


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
