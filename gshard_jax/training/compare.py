"""``gshard-jax compare``: our partitioner against XLA's on a config's train step, in one process: the
collectives of each compiled program, bytes per device, and median step times timed alternately."""
from __future__ import annotations

import functools

import jax
import ml_collections
import numpy as np

import gshard_jax as gs
from gshard_jax.partitioner.hlo import summary

from . import train
from .timing import median_times


def train_step(cfg: ml_collections.ConfigDict, workdir: str, steps: int = 5) -> list[dict]:
    """One row per backend: collectives {kind: count}, payload bytes per device, step ms (median), and the
    largest loss difference from the unpartitioned step."""
    trainer, state, batch = train.first_step(cfg, workdir)
    ref = float(jax.jit(trainer.train_step)(state, batch)[1]["loss"])
    compiled = {}
    for backend in ("gshard", "xla"):
        compiled[backend] = trainer.partitioned("train", backend).lower(state, batch).compile()
    median_s = median_times({b: functools.partial(c, state, batch) for b, c in compiled.items()}, steps, warmup=1)
    rows = []
    for b, c in compiled.items():
        stats = gs.collective_stats(c)
        rows.append({"backend": b, "mesh": dict(trainer.mesh.shape),
                     "collectives": summary(stats),
                     "bytes_per_device": int(sum(v["payload_bytes"] for v in stats.values())),
                     "step_ms": 1e3 * median_s[b],
                     "loss_diff": float(np.abs(float(c(state, batch)[1]["loss"]) - ref))})
    return rows


def format_rows(rows: list[dict]) -> str:
    ours, xla = rows
    lines = [f"{'backend':<8} {'bytes/device':>14} {'step ms':>9}  collectives"]
    for r in rows:
        counts = " ".join(f"{k}:{v}" for k, v in r["collectives"].items()) or "none"
        lines.append(f"{r['backend']:<8} {r['bytes_per_device']:>14,} {r['step_ms']:>9.1f}  {counts}")
    ratio = ours["bytes_per_device"] / xla["bytes_per_device"] if xla["bytes_per_device"] else float("nan")
    lines.append(f"ours/xla: bytes {ratio:.2f}, step time {ours['step_ms'] / xla['step_ms']:.2f}; mesh {ours['mesh']}")
    return "\n".join(lines)
