"""``gshard-jax compare``: our partitioner against XLA's on a config's train step, in one process: the
collectives of each compiled program, bytes per device, and median step times timed alternately."""
from __future__ import annotations

import statistics
import time

import jax
import ml_collections
import numpy as np

import gshard_jax as gs

from . import train


def train_step(cfg: ml_collections.ConfigDict, workdir: str, steps: int = 5) -> list[dict]:
    """One row per backend: collectives {kind: count}, payload bytes per device, step ms (median), and the
    largest loss difference from the unpartitioned step."""
    trainer = train.Trainer(cfg, workdir)
    tokens = train.prepare_data(cfg, workdir)
    state = trainer.fresh_state()
    batch = trainer.batch(tokens, "train", 1)
    ref = float(jax.jit(trainer.train_step)(state, batch)[1]["loss"])
    compiled = {}
    for backend in ("gshard", "xla"):
        compiled[backend] = gs.partition(trainer.train_step, trainer.mesh, backend=backend).lower(state, batch).compile()
    times = {b: [] for b in compiled}
    for i in range(steps + 1):  # the first round warms up
        for b in (list(compiled) if i % 2 else list(compiled)[::-1]):
            t = time.perf_counter()
            jax.block_until_ready(compiled[b](state, batch))
            if i:
                times[b].append(time.perf_counter() - t)
    rows = []
    for b, c in compiled.items():
        stats = gs.collective_stats(c)
        rows.append({"backend": b, "mesh": dict(trainer.mesh.shape),
                     "collectives": {k: v["count"] for k, v in stats.items() if v["count"]},
                     "bytes_per_device": int(sum(v["payload_bytes"] for v in stats.values())),
                     "step_ms": 1e3 * statistics.median(times[b]),
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
