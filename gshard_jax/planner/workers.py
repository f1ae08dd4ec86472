"""Where the planner's candidates are planned: in this process, and in one spawned worker process beside it
when there are cores to spare (planning is mostly tracing, one core each)."""
from __future__ import annotations

import collections
import concurrent.futures
import multiprocessing
import os
import threading

from ..partitioner.costs.hardware import Hardware
from ..training.faults import die_with_parent
from . import predict as PR


class Workers:
    """Where candidates are planned: here, and in one worker process when asked for (`gshard-jax plan` does),
    there are cores to spare and several to plan (started before the screen, so it is ready when the screen
    ends). A spawned worker imports the caller's __main__: only a script with a main guard may ask."""

    def __init__(self, wanted: int, allowed: bool = False, cfg=None):
        self.pool = self.warm = None
        if allowed and wanted >= 3 and (os.cpu_count() or 1) > 1:
            ctx = multiprocessing.get_context("spawn")  # never fork a process that runs JAX
            self.pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx, initializer=die_with_parent)
            self.warm = self.pool.submit(_warm, cfg)

    def run(self, cfg, batch: list, hw: Hardware, shape=None) -> list:
        """plan_one for each candidate of `batch`, results or exceptions, in order. Here and in the worker,
        each takes the next candidate when it is free (the worker's next is sent as its last one ends).
        shape: cfg's model shape on hw's platform, when known."""
        if self.warm is not None:  # the train state's shapes the worker made during the screen, made here too
            try:
                PR.prepare(cfg, state=self.warm.result())
            except Exception:  # noqa: BLE001 (the worker's error comes again, with its reason, from plan_one)
                pass
            self.warm = None
        out: list = [None] * len(batch)
        todo = collections.deque(range(len(batch)))
        remote: dict = {}  # index -> its future (None while being sent)
        turn = threading.Condition()

        def send(_done=None) -> None:  # the worker's next candidate, if any is left
            with turn:
                if not todo or self.pool is None:
                    return
                i = todo.popleft()
                remote[i] = None
            try:
                future = self.pool.submit(PR.plan_one, cfg, batch[i], hw, shape)
            except (concurrent.futures.process.BrokenProcessPool, RuntimeError):  # died or shut down: plan it here
                with turn:
                    del remote[i]
                    todo.appendleft(i)
                    turn.notify_all()
                return
            with turn:
                remote[i] = future
                turn.notify_all()
            future.add_done_callback(send)

        if self.pool is not None and len(batch) > 1:
            send()
        while True:
            with turn:
                if not todo and all(f is not None for f in remote.values()):
                    break
                if not todo:
                    turn.wait()
                    continue
                i = todo.popleft()
            out[i] = _attempt(cfg, batch[i], hw, shape)
        for i in sorted(remote):  # sent ones never come back to the queue: wait for each
            try:
                out[i] = remote[i].result()
            except (ValueError, TypeError, NotImplementedError) as e:
                out[i] = e
            except concurrent.futures.process.BrokenProcessPool:  # the worker died: plan the rest here
                self._lost()
                out[i] = _attempt(cfg, batch[i], hw, shape)
        return out

    def _lost(self) -> None:
        self.close()
        self.pool = None

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)


def _attempt(cfg, c, hw: Hardware, shape=None):
    """plan_one's result, or the error that says why the candidate cannot be planned."""
    try:
        return PR.plan_one(cfg, c, hw, shape)
    except (ValueError, TypeError, NotImplementedError) as e:
        return e


def _warm(cfg):
    """The worker's start-up, while the screen runs: unpickling this imports the module (JAX, the models);
    running it makes the train state's shapes that each of cfg's candidates starts from (returned, so this
    process need not make them too)."""
    return PR.prepare(cfg)[0] if cfg is not None else None
