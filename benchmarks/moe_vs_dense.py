"""MoE against its dense twin over seeds: held-out loss of tiny_moe_lm and tiny_dense_lm (the same matmul
parameters per token, so the same training FLOPs) after the same steps, per seed, with the mean and the
spread, on 8 simulated CPU devices.

Each run is `gshard-jax train` in its own process; every run reads one token corpus (prepared once, held-out
files fixed), and a seed sets the params, the data order, the routing and the held-out windows, the same
for both models of a seed, so each seed gives a paired difference. Run:

    python benchmarks/moe_vs_dense.py [--steps 300] [--seeds 0,1,2] [--set model.num_layers=2 ...]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

MODELS = {"moe": "experiments/tiny_moe_lm.py", "dense": "experiments/tiny_dense_lm.py"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300, help="training steps of every run")
    p.add_argument("--seeds", default="0,1,2", help="train.seed values, comma-separated")
    p.add_argument("--set", nargs="*", default=[], help="config overrides KEY=VALUE for both models")
    p.add_argument("--workdir", default="", help="where runs write (default: a temporary directory)")
    return p.parse_args(argv)


def train(config: str, workdir: str, data_dir: str, steps: int, seed: int, extra: list[str]) -> float:
    """The held-out loss at the last step of one `gshard-jax train` run."""
    cmd = [sys.executable, "-m", "gshard_jax.cli", "train", "--config", config, "--cpu-devices", "8",
           "--workdir", workdir, f"--config.train.num_steps={steps}", f"--config.train.eval_every={steps}",
           f"--config.train.seed={seed}", f"--config.data.dir={data_dir}", *[f"--config.{kv}" for kv in extra]]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    held = [r for r in rows if "eval_loss" in r and r["step"] == steps]
    if not held:
        raise SystemExit(f"{workdir}/metrics.jsonl has no eval_loss at step {steps}")
    return float(held[-1]["eval_loss"])


def spread(xs: list[float]) -> str:
    """mean ± sample standard deviation (± 0 for one value)."""
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{statistics.mean(xs):.3f} ± {sd:.3f}"


def main(argv=None) -> None:
    a = parse_args(argv)
    seeds = [int(s) for s in a.seeds.split(",")]
    root = a.workdir or tempfile.mkdtemp(prefix="moe_vs_dense_")
    data_dir = os.path.join(root, "data")
    print(f"held-out loss after {a.steps} steps, 8 simulated CPU devices, runs in {root}")
    print("| seed | tiny_moe_lm | tiny_dense_lm | MoE - dense |")
    print("| ---: | ---: | ---: | ---: |", flush=True)
    got = {name: [] for name in MODELS}
    for seed in seeds:
        for name, config in MODELS.items():
            got[name].append(train(config, os.path.join(root, f"{name}_{seed}"), data_dir, a.steps, seed, a.set))
        print(f"| {seed} | {got['moe'][-1]:.3f} | {got['dense'][-1]:.3f} | {got['moe'][-1] - got['dense'][-1]:+.3f} |",
              flush=True)
    diff = [m - d for m, d in zip(got["moe"], got["dense"])]
    print(f"| mean ± sd | {spread(got['moe'])} | {spread(got['dense'])} | {spread(diff)} |")
    if len(seeds) < 2:
        print("one seed: no spread to hold the gap against")
        return
    sd = max(statistics.stdev(got[n]) for n in MODELS)
    gap = statistics.mean(diff)
    print(f"gap {gap:+.3f} nats against a spread over seeds of {sd:.3f} (the larger model's sd): "
          f"{'larger' if abs(gap) > sd else 'not larger'} than the spread; MoE ahead in "
          f"{sum(d < 0 for d in diff)} of {len(diff)} seeds")

if __name__ == "__main__":
    main()
