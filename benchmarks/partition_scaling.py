"""How partitioning scales with program size: the unrolled train step of models/lm.py, ours against XLA's.

For each layer count: the partition step (trace, propagate, plan, lower to
StableHLO: `.lower()`), XLA's compile of the result, and the number of HLO
instructions in the compiled per-device program, for our partitioner and
for XLA's on the same annotations, with ours/XLA ratios. Run:

    python benchmarks/partition_scaling.py [--layers 2,8,24,48] [--repeats 3] [--compile-repeats 1]
                                           [--no-compile] [--json out.json]

Partition times are medians over --repeats fresh lowerings per backend (ours and XLA's alternating);
compile times are medians over --compile-repeats compiles of fresh lowerings,
ours and XLA's alternating (compiles of big programs take minutes; one each
by default). Equations counts the program's jaxpr equations.
"""
from __future__ import annotations

import argparse
import functools
import json
import re
import statistics
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", default="2,8,24", help="comma-separated layer counts")
    p.add_argument("--repeats", type=int, default=3, help="lowerings timed per backend (median)")
    p.add_argument("--compile-repeats", type=int, default=1, help="compiles timed per backend (median)")
    p.add_argument("--no-compile", action="store_true", help="time lowering only")
    p.add_argument("--json", default=None, help="also write the rows as JSON here")
    return p.parse_args(argv)


ARGS = parse_args()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import gshard_jax as gs  # noqa: E402
from gshard_jax.models import lm  # noqa: E402
from gshard_jax.partitioner.representation.jax_compat import clear_compilation_cache  # noqa: E402

_INSTR = re.compile(r"^\s*(ROOT\s+)?%[\w.\-]+ = ", re.M)


def instructions(hlo: str) -> int:
    return len(_INSTR.findall(hlo))


def measure(layers: int) -> dict:
    cfg = lm.LMConfig(layers=layers)
    params = lm.init_params(jax.random.key(0), cfg)
    state = lm.optimizer(cfg).init(params)
    batch = lm.make_batch(jax.random.key(1), 8, cfg)
    mesh = gs.make_mesh({"data": 2, "model": 4})
    step = functools.partial(lm.train_step, cfg=cfg, lo=lm.Layout("data", "model"))
    row = {"layers": layers, "equations": len(jax.make_jaxpr(step)(params, state, batch).eqns)}
    lowers: dict = {"gshard": [], "xla": []}
    for _ in range(ARGS.repeats):  # ours and XLA's alternate, so both see the same host
        for backend in lowers:
            f = gs.partition(step, mesh, backend=backend)  # a fresh function: nothing cached
            t = time.perf_counter()
            f.lower(params, state, batch)
            lowers[backend].append(time.perf_counter() - t)
    for backend, times in lowers.items():
        row[f"{backend}_partition_s"] = statistics.median(times)
    if not ARGS.no_compile:
        compiles: dict = {"gshard": [], "xla": []}
        for _ in range(ARGS.compile_repeats):
            for backend in compiles:
                lowered = gs.partition(step, mesh, backend=backend).lower(params, state, batch)
                clear_compilation_cache()  # compile again, not a cache hit
                t = time.perf_counter()
                compiled = lowered.compile()
                compiles[backend].append(time.perf_counter() - t)
                row[f"{backend}_hlo_ops"] = instructions(compiled.as_text())
        for backend, times in compiles.items():
            row[f"{backend}_compile_s"] = statistics.median(times)
    for key in ("partition_s", "compile_s", "hlo_ops"):
        if f"xla_{key}" in row:
            row[f"ratio_{key}"] = row[f"gshard_{key}"] / row[f"xla_{key}"]
    return row


def main() -> None:
    rows = []
    print(f"{'layers':>6} {'eqns':>6} | {'partition s ours/XLA':>22} {'ratio':>6} | {'compile s ours/XLA':>20} "
          f"{'ratio':>6} | {'HLO ops ours/XLA':>18} {'ratio':>6}", flush=True)
    for n in [int(x) for x in ARGS.layers.split(",")]:
        r = measure(n)
        rows.append(r)
        comp = (f"{r['gshard_compile_s']:9.1f} / {r['xla_compile_s']:<8.1f} {r['ratio_compile_s']:6.2f} | "
                f"{r['gshard_hlo_ops']:8d} / {r['xla_hlo_ops']:<7d} {r['ratio_hlo_ops']:6.2f}"
                if "xla_compile_s" in r else "-")
        print(f"{n:>6} {r['equations']:>6} | {r['gshard_partition_s']:10.2f} / {r['xla_partition_s']:<9.2f} "
              f"{r['ratio_partition_s']:6.2f} | {comp}", flush=True)
    if ARGS.json:
        with open(ARGS.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
