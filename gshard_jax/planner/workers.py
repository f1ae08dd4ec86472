"""Where the planner's candidates are planned: in this process, and in one spawned worker process beside it
when there are cores to spare (planning is mostly tracing, one core each)."""
from __future__ import annotations

import concurrent.futures
import multiprocessing
import os

from ..partitioner.hardware import Hardware
from ..training.faults import die_with_parent
from . import predict as PR


class Workers:
    """Where candidates are planned: here, and in one worker process when asked for (`gshard-jax plan` does),
    there are cores to spare and several to plan (started before the screen, so it is ready when the screen
    ends). A spawned worker imports the caller's __main__: only a script with a main guard may ask."""

    def __init__(self, wanted: int, allowed: bool = False):
        self.pool = None
        if allowed and wanted >= 3 and (os.cpu_count() or 1) > 1:
            ctx = multiprocessing.get_context("spawn")  # never fork a process that runs JAX
            self.pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx, initializer=die_with_parent)
            self.pool.submit(_warm)

    def run(self, cfg, batch: list, hw: Hardware) -> list:
        """plan_one for each candidate of `batch` (every second one in the worker), results or exceptions, in
        order."""
        remote: dict = {}
        if self.pool is not None and len(batch) > 1:
            try:
                remote = {i: self.pool.submit(PR.plan_one, cfg, c, hw) for i, c in enumerate(batch) if i % 2}
            except concurrent.futures.process.BrokenProcessPool:
                self._lost()
        out: list = [None] * len(batch)
        for i, c in enumerate(batch):
            if i not in remote:
                out[i] = _attempt(cfg, c, hw)
        for i, future in remote.items():
            try:
                out[i] = future.result()
            except (ValueError, TypeError, NotImplementedError) as e:
                out[i] = e
            except concurrent.futures.process.BrokenProcessPool:  # the worker died: plan the rest here
                self._lost()
                out[i] = _attempt(cfg, batch[i], hw)
        return out

    def _lost(self) -> None:
        self.close()
        self.pool = None

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)


def _attempt(cfg, c, hw: Hardware):
    """plan_one's result, or the error that says why the candidate cannot be planned."""
    try:
        return PR.plan_one(cfg, c, hw)
    except (ValueError, TypeError, NotImplementedError) as e:
        return e


def _warm() -> None:
    """Nothing to do: unpickling it imports this module (JAX, the models), the worker's start-up."""
