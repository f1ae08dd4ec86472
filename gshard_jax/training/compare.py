"""``gshard-jax compare``: our partitioner against XLA's on a config's train step, in one process: the
collectives of each compiled program and bytes per device, as one step executes them (a loop's collectives
times its trip count) and as the HLO lists them, and median step times timed alternately."""
from __future__ import annotations

import functools

import jax
import numpy as np

import gshard_jax as gs
from gshard_jax.partitioner.reporting.hlo import summary

from .. import configs
from . import train
from .timing import median_times


def train_step(cfg: configs.Config | configs.ConfigDict, workdir: str, steps: int = 5) -> list[dict]:
    """One row per backend: collectives {kind: count} and payload bytes per device per step (`_per_step`: loops
    times their trip counts) and as listed once (`_static`), step ms (median), and the loss difference from the
    unpartitioned step."""
    trainer, state, batch = train.step_inputs(cfg, workdir)
    ref = float(jax.jit(trainer.train_step)(state, batch)[1]["loss"])
    compiled = {}
    for backend in ("gshard", "xla"):
        compiled[backend] = trainer.partitioned("train", backend).lower(state, batch).compile()
    median_s = median_times({b: functools.partial(c, state, batch) for b, c in compiled.items()}, steps, warmup=1)
    rows = []
    for b, c in compiled.items():
        stats, static = gs.collective_stats(c, per_step=True), gs.collective_stats(c)
        rows.append({"backend": b, "mesh": dict(trainer.mesh.shape),
                     "collectives_per_step": summary(stats),
                     "bytes_per_step": int(sum(v["payload_bytes"] for v in stats.values())),
                     "collectives_static": summary(static),
                     "bytes_static": int(sum(v["payload_bytes"] for v in static.values())),
                     "step_ms": 1e3 * median_s[b],
                     "loss_diff": float(np.abs(float(c(state, batch)[1]["loss"]) - ref))})
    return rows


def format_rows(rows: list[dict]) -> str:
    """Per step first (what a step executes), then the static counts of the HLO text."""
    ours, xla = rows
    lines = [f"{'backend':<8} {'bytes/step':>14} {'step ms':>9}  collectives per step"]
    for r in rows:
        counts = " ".join(f"{k}:{v}" for k, v in r["collectives_per_step"].items()) or "none"
        lines.append(f"{r['backend']:<8} {r['bytes_per_step']:>14,} {r['step_ms']:>9.1f}  {counts}")
    ratio = ours["bytes_per_step"] / xla["bytes_per_step"] if xla["bytes_per_step"] else float("nan")
    lines.append(f"ours/xla: bytes per step {ratio:.2f}, step time {ours['step_ms'] / xla['step_ms']:.2f}; "
                 f"mesh {ours['mesh']}")
    for r in rows:
        counts = " ".join(f"{k}:{v}" for k, v in r["collectives_static"].items()) or "none"
        lines.append(f"static ({r['backend']}, each instruction once): {r['bytes_static']:,} bytes, {counts}")
    return "\n".join(lines)
