"""Weak scaling as the planner predicts it: a config planned on each device count with the same batch per
device (the seed's: one sequence of 2,048 tokens per tile), its planned step, MFU and efficiency against
the smallest count, beside the seed's own figure (Mula-220B-A10B from 384 to 12,288 Aurora tiles kept about
90%: seed 001, Figure 4b). Each plan is `gshard-jax plan`'s: pruned screen, the top candidates planned by
the partitioner, the config's own mesh beside them.

    python benchmarks/scaling.py --config experiments/mula_220b_a10b.py --devices 384,768,1536,3072,6144,12288
"""
from __future__ import annotations

import argparse
import time

from gshard_jax import configs
from gshard_jax.planner import hardware, plan


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="experiments/mula_220b_a10b.py")
    p.add_argument("--devices", default="384,768,1536,3072,6144,12288", help="device counts, comma-separated")
    p.add_argument("--hardware", default="aurora-pvc")
    p.add_argument("--per-device", type=float, default=1.0, help="sequences per device (the seed's: 1)")
    p.add_argument("--top", type=int, default=3, help="candidates planned by the partitioner per count")
    a = p.parse_args()
    hw = hardware.get(a.hardware)
    print(f"{a.config} on {a.hardware}, {a.per_device:g} sequences per device (efficiency {hw.efficiency:.0%}, "
          f"assumed)")
    print("| devices | batch | #1 | step s | MFU | weak-scaling efficiency | own mesh step s | plan s |")
    print("| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |", flush=True)
    base = None
    for n in (int(d) for d in a.devices.split(",")):
        cfg = configs.load(a.config)
        cfg.train.batch_size = int(round(a.per_device * n))
        t0 = time.perf_counter()
        got = plan(cfg, n, hw, top=a.top, worker=True, own_mesh=True, config_name=a.config)
        best = got.best
        own = next((r for _, _, r, _ in got.pinned if r is not None and r.candidate.sizes == got.own), None)
        base = base or best.estimate.step
        print(f"| {n} | {cfg.train.batch_size} | {best.candidate.key} | {best.estimate.step:.3f} | "
              f"{best.mfu(got.shape, hw, n):.1%} | {base / best.estimate.step:.1%} | "
              f"{own.estimate.step if own else float('nan'):.3f} | {time.perf_counter() - t0:.0f} |", flush=True)
    print("seed 001 (Figure 4b): about 90% weak-scaling efficiency from 384 to 12,288 tiles")


if __name__ == "__main__":
    main()
