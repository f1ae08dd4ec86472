"""How long the planner takes, as `gshard-jax plan` runs it: the screen pruned by its floors, then the top
candidates planned by the partitioner on an abstract mesh (here and in a worker process on 2+ cores). Prints
seconds, the candidates costed and the meshes and option groups pruned; --exhaustive also plans without
pruning and checks that the ranking is the same.

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
    p.add_argument("--top", type=int, default=3, help="candidates planned by the partitioner (the CLI's --top)")
    p.add_argument("--exhaustive", action="store_true", help="also plan with every candidate costed, and compare")
    a = p.parse_args()
    cfg, hw = configs.load(a.config), hardware.get(a.hardware)
    runs = [("pruned", True)] + ([("exhaustive", False)] if a.exhaustive else [])
    plans = {}
    for name, prune in runs:
        t0 = time.perf_counter()
        got = plans[name] = plan(cfg, a.devices, hw, top=a.top, worker=True, own_mesh=True, prune=prune,
                                 config_name=a.config)
        costed = len(got.screened) + got.rejection_counts().get("over memory", 0)
        print(f"{name}: {time.perf_counter() - t0:.1f} s; {costed} candidates costed ({len(got.screened)} "
              f"feasible), {got.pruned} meshes and {got.pruned_groups} option groups pruned, "
              f"{len(got.ranked)} planned")
        for r in got.ranked:
            print(f"  {r.candidate.key}: step {r.estimate.step:.3f} s (formula comm {r.formula_comm:.3f} s, "
                  f"planned {r.estimate.comm_total:.3f} s)")
    if a.exhaustive:
        same = [r.to_dict() for r in plans["pruned"].ranked] == [r.to_dict() for r in plans["exhaustive"].ranked]
        print(f"same ranking: {same}")


if __name__ == "__main__":
    main()
