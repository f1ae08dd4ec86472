"""How long the planner takes: screening every configuration of N devices by formula, then planning the
top ones with the partitioner on an abstract mesh. Prints seconds per phase and the candidates counted.

    python benchmarks/planner.py --config experiments/mula_100b_a7b.py --devices 1024 --hardware aurora-pvc
"""
from __future__ import annotations

import argparse
import time

from gshard_jax import configs
from gshard_jax.planner import hardware, plan


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="experiments/mula_100b_a7b.py")
    p.add_argument("--devices", type=int, default=1024)
    p.add_argument("--hardware", default="aurora-pvc")
    p.add_argument("--verify", type=int, default=5, help="candidates planned by the partitioner")
    a = p.parse_args()
    cfg, hw = configs.load(a.config), hardware.get(a.hardware)
    t0 = time.perf_counter()
    screen = plan(cfg, a.devices, hw, top=0, verify=0)
    t1 = time.perf_counter()
    full = plan(cfg, a.devices, hw, top=a.verify, verify=a.verify, worker=True)
    t2 = time.perf_counter()
    print(f"{a.config} on {a.devices} x {hw.name}: {len(screen.screened)} feasible, {len(screen.rejected)} rejected, "
          f"{screen.dominated} dominated")
    print(f"screen only: {t1 - t0:.1f} s; screen + {len(full.ranked)} planned by the partitioner: {t2 - t1:.1f} s")
    for r in full.ranked:
        print(f"  {r.candidate.key}: formula comm {r.formula_comm:.3f} s, planned comm "
              f"{r.estimate.comm_total:.3f} s")


if __name__ == "__main__":
    main()
