"""Settling a step: its metrics brought to the host, where the run acts on them.

A step's metrics are read one step late (``defer``, then ``flush`` once the next step is dispatched), so the
host's read does not leave the device idle; a step whose state is evaluated or saved is settled at once
(``settle``), so its row is written before its checkpoint and a NaN halts before it is saved. Settling a
step is the NaN check (halt, or count a skipped update), the timing window, the held-out loss, the logged
row and the progress bar.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import jax
import numpy as np

from ..configs import TrainConfig
from . import faults

log = logging.getLogger("gshard_jax")


class NonFiniteStep(RuntimeError):
    """A step's loss or gradient norm was NaN or infinite under nan_policy="halt"; `culprits` are the batch
    shards whose rows went non-finite, with their devices and processes (faults.name_shards)."""

    def __init__(self, step: int, loss: float, grad_norm: float, culprits: list[dict]):
        self.step, self.culprits = step, culprits
        super().__init__(f"step {step}: non-finite loss {loss} or gradient norm {grad_norm}; "
                         f"{faults.describe(culprits)}; stopped before any checkpoint at or after step {step} "
                         f"(train.nan_policy='halt'; 'skip' drops such steps)")


class Settler:
    """The host side of a run's steps: what each step's metrics do once read, and the run's summary.

    train: the train section (nan_policy, log_every, eval_every, num_steps, batch_size); start: the step the
    run resumed from; writer: a metrics.MetricsWriter; clock: a timing.Clock; bar: a tqdm bar or None;
    evaluate: params -> held-out loss; batch_sharding and batch_shape: where the batch's rows live, to name
    the devices of non-finite rows.
    """

    def __init__(self, train: TrainConfig, start: int, writer: Any, clock: Any, bar: Any,
                 evaluate: Callable[[Any], float], batch_sharding: jax.sharding.Sharding, batch_shape: tuple):
        self.t, self.start = train, start
        self.writer, self.clock, self.bar = writer, clock, bar
        self.evaluate = evaluate
        self.batch_sharding, self.batch_shape = batch_sharding, batch_shape
        self.skipped = 0  # updates dropped under nan_policy="skip"
        self.summary: dict = {"start_step": start}  # the last logged step's figures, for the run's summary
        self.pending: Optional[tuple[int, dict]] = None  # (step, metrics still on the device)

    def defer(self, step: int, m: dict) -> None:
        """Keep `step`'s metrics to settle after the next step is dispatched."""
        self.pending = (step, m)

    def flush(self, params: Any) -> None:
        """Settle the deferred step, if any (`params`: the newest, for an evaluation that never falls due
        on a deferred step)."""
        if self.pending is not None:
            step, m = self.pending
            self.pending = None
            self.settle(step, m, params)

    def settle(self, step: int, m: dict, params: Any) -> None:
        """One step's metrics on the host: the NaN check, the logged row, the progress bar; `params` are the
        state's after `step`, evaluated when the step is due an evaluation."""
        t = self.t
        bad_S = np.asarray(m["nonfinite_rows"])
        host = {k: float(v) for k, v in m.items() if k != "nonfinite_rows"}
        finite = bool(host.pop("finite"))
        row = {}
        if not finite:
            self._nonfinite(step, host, bad_S, row)
        row.update(host, skipped_steps=self.skipped)
        self.clock.step_done(step > self.start + 1)  # the first step also compiles: throughput is timed from its end
        if step % t.log_every == 0 or step == t.num_steps:
            row.update(self.clock.window())
        if step % t.eval_every == 0 or step == t.num_steps:
            row["eval_loss"] = self.evaluate(params)
            self.clock.pause()  # eval time is not training throughput
        if "tokens_per_s" in row or "eval_loss" in row or not finite:  # a skipped step's row says whose NaN
            self.writer.write(step, row)
            self.summary.update(step=step, **{k: row[k] for k in ("loss", "eval_loss") if k in row})
        self._progress(host, row)

    def _nonfinite(self, step: int, host: dict, bad_S: np.ndarray, row: dict) -> None:
        """Name the processes whose rows went non-finite in `row`; halt (NonFiniteStep) or count the skip."""
        culprits = faults.name_shards(bad_S, self.batch_sharding, self.batch_shape)
        row["nonfinite_processes"] = sorted({p for c in culprits for p in c["processes"]})
        if self.t.nan_policy == "halt":
            self.writer.write(step, {"loss": host["loss"], "grad_norm": host["grad_norm"], "halted": True, **row})
            faults.report_soft_failure(step, culprits)
            raise NonFiniteStep(step, host["loss"], host["grad_norm"], culprits)
        self.skipped += 1
        log.warning("step %d: non-finite loss or gradient norm; %s; update skipped (%d so far)", step,
                    faults.describe(culprits), self.skipped)

    def _progress(self, host: dict, row: dict) -> None:
        if self.bar is None:
            return
        self.bar.update(1)
        post = {"loss": f"{host['loss']:.3f}", "aux": f"{host['aux_loss']:.3f}", "dropped": f"{host['dropped']:.3f}"}
        if "tokens_per_s" in row:
            post["tok/s"] = f"{row['tokens_per_s']:,.0f}"
            post["mfu"] = f"{row['mfu']:.1%}"
        self.bar.set_postfix(post, refresh=False)
