"""The planner's pick for the papers' machines and its planned MFU: model flops per step (6 x active parameters
per token plus attention) over the planned step time x peak. The step is the planned program's: compute at the
profile's efficiency, the pipeline's bubble, and the communication its list schedule leaves exposed
(partitioner/costs/overlap.py).

    python benchmarks/planned_mfu.py                     # every case (several minutes: 3,072 devices take 540 s)
    python benchmarks/planned_mfu.py --cases gpt_40b_64  # one
    python benchmarks/planned_mfu.py --efficiency 0.35   # at a measured compute efficiency
"""
from __future__ import annotations

import argparse
import dataclasses
import time

from gshard_jax import configs
from gshard_jax.planner import hardware, plan

# name -> (experiment, devices, hardware profile, config overrides, MFU target or None)
CASES = {
    "gpt_20b_32": ("gpt_20b", 32, "perlmutter-a100", {}, 0.42),
    "gpt_40b_64": ("gpt_40b", 64, "perlmutter-a100", {}, 0.40),
    "gpt_80b_4096": ("gpt_80b", 4096, "perlmutter-a100", {}, 0.45),
    "mula_100b_3072": ("mula_100b_a7b", 3072, "aurora-pvc", {}, None),  # the file's batch: one sequence per tile
    "gshard_600b_2048": ("gshard_moe_2048e_36l", 2048, "tpu-v3", {}, None),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--verify", type=int, default=5, help="candidates planned by the partitioner (as --top)")
    p.add_argument("--efficiency", type=float, default=None, help="the compute efficiency to plan at instead of "
                   "the profile's (e.g. one `gshard-jax calibrate` measured)")
    a = p.parse_args()
    print(f"{'case':<18} {'#1 (planned)':<52} {'step s':>7} {'compute':>7} {'bubble':>6} {'comm':>6} "
          f"{'exposed':>7} {'MFU':>6} {'target':>6}")
    for name in a.cases:
        exp, devices, hw_name, sets, target = CASES[name]
        cfg = configs.load(f"experiments/{exp}.py")
        for key, value in sets.items():
            section, field = key.split(".")
            cfg[section][field] = value
        hw = hardware.get(hw_name)
        if a.efficiency is not None:
            hw = dataclasses.replace(hw, efficiency=a.efficiency)
        t0 = time.perf_counter()
        best = plan(cfg, devices, hw, top=a.verify, verify=a.verify, worker=True).best
        e = best.estimate
        mfu = best.mfu(plan_shape(cfg), hw, devices)
        print(f"{name:<18} {best.candidate.key:<52} {e.step:7.2f} {e.compute:7.2f} {e.bubble:6.2f} "
              f"{e.comm_total:6.2f} {e.comm_total - e.overlap:7.2f} {mfu:6.1%} "
              f"{'-' if target is None else format(target, '.0%'):>6}  ({time.perf_counter() - t0:.0f} s)")


def plan_shape(cfg):
    from gshard_jax.planner import space
    return space.model_shape(cfg)


if __name__ == "__main__":
    main()
