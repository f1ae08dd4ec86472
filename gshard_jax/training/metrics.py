"""What a run records: ``metrics.jsonl`` (one JSON object per logged step), TensorBoard event files
(tensorboardX, no TensorFlow) and a PNG of the loss curves, which ``gshard-jax plot`` also draws for
several runs on one figure."""
from __future__ import annotations

import json
import math
import os
from typing import Optional, Sequence

METRICS = "metrics.jsonl"


class MetricsWriter:
    """Appends to WORKDIR/metrics.jsonl and WORKDIR/tensorboard; on resume, drops what a crashed run wrote
    after the step it resumes from, so every step appears once."""

    def __init__(self, workdir: str, resume_step: int = 0, enabled: bool = True):
        self.enabled = enabled
        self.path = os.path.join(workdir, METRICS)
        self.tb = None
        if not enabled:
            return
        if os.path.exists(self.path):
            kept = [r for r in read(workdir) if r["step"] <= resume_step]
            with open(self.path + ".tmp", "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in kept)
            os.replace(self.path + ".tmp", self.path)
        from tensorboardX import SummaryWriter
        self.tb = SummaryWriter(os.path.join(workdir, "tensorboard"), purge_step=resume_step + 1)

    def write(self, step: int, values: dict) -> None:
        if not self.enabled:
            return
        row = {"step": int(step), **{k: _plain(v) for k, v in values.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        for k, v in row.items():
            if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
                self.tb.add_scalar(k, v, step)
        self.tb.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def _plain(v):
    return v.item() if hasattr(v, "item") else v


def read(workdir: str) -> list[dict]:
    """The rows of WORKDIR/metrics.jsonl (a torn last line from a crash is ignored)."""
    rows = []
    path = os.path.join(workdir, METRICS)
    if not os.path.exists(path):
        return rows
    with open(path) as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def plot(workdirs: Sequence[str], out: str, labels: Optional[Sequence[str]] = None) -> str:
    """Training cross-entropy (or loss) and held-out loss against step for each run, on one PNG at `out`."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(labels) if labels else [os.path.basename(os.path.normpath(d)) for d in workdirs]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (d, label) in enumerate(zip(workdirs, labels)):
        rows = read(d)
        if not rows:
            raise FileNotFoundError(f"{d!r} has no {METRICS}; is it a run's --workdir?")
        color = f"C{i}"
        # Cross-entropy when the run logs it (an MoE's loss also holds its aux and z losses), else the loss.
        key = "cross_entropy" if any("cross_entropy" in r for r in rows) else "loss"
        train = [(r["step"], r[key]) for r in rows if key in r]
        held = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
        if train:
            ax.plot(*zip(*train), color=color, alpha=0.6, label=f"{label} train")
        if held:
            ax.plot(*zip(*held), color=color, marker="o", label=f"{label} held-out")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
