"""Our partitioner against XLA's on a Flax lm1b-style train step (tests/lm1b_style.py), from the compiled HLO.

Prints, per backend, each collective kind's count (combined all-reduces count as their elements; "ar instrs":
the all-reduce instructions), the payload bytes per device of all of them, per-device flops (cost_analysis)
and the largest difference from the unpartitioned step (jax.jit). Run:

    python benchmarks/lm1b_style.py [--devices 8] [--table]

--table also prints our explain() table.
"""
from __future__ import annotations

import argparse
import os
import sys


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices (ignored on accelerators)")
    p.add_argument("--table", action="store_true", help="print our explain() table")
    return p.parse_args(argv)


ARGS = parse_args()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", ARGS.devices)

import numpy as np  # noqa: E402

import gshard_jax as gs  # noqa: E402
from gshard_jax.partitioner.reporting.hlo import collectives  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import lm1b_style  # noqa: E402


def flops(compiled) -> float:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost.get("flops", 0.0))


def main() -> None:
    case = lm1b_style.build()
    mesh = gs.make_mesh(case.mesh_axes)
    kw = {"in_shardings": case.in_shardings, "out_shardings": case.out_shardings}
    want = jax.tree.leaves(jax.jit(case.step)(*case.args))
    print(f"{'backend':8} {'all-reduce':>10} {'ar instrs':>9} {'all-gather':>10} {'red-scat':>9} {'all-to-all':>10} "
          f"{'permute':>8} {'bytes/dev':>10} {'flops/dev':>12} {'max|diff|':>10}")
    for backend in ("gshard", "xla"):
        f = gs.partition(case.step, mesh, backend=backend, **kw)
        compiled = f.lower(*case.args).compile()
        stats = gs.collective_stats(compiled)
        got = jax.tree.leaves(f(*case.args))
        diff = max(float(np.max(np.abs(np.asarray(g, np.float64) - np.asarray(w, np.float64)), initial=0))
                   for g, w in zip(got, want))
        counts = [stats[k]["count"] for k in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                                               "collective-permute")]
        total = sum(v["payload_bytes"] for v in stats.values())
        instrs = sum(c["kind"] == "all-reduce" for c in collectives(compiled))
        print(f"{backend:8} {counts[0]:>10} {instrs:>9} {counts[1]:>10} {counts[2]:>9} {counts[3]:>10} {counts[4]:>8} "
              f"{total:>10,} {flops(compiled):>12,.0f} {diff:>10.2e}")
    if ARGS.table:
        print(gs.explain(case.step, mesh, *case.args, **kw).table())


if __name__ == "__main__":
    main()
