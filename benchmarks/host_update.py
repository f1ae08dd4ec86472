"""What the host's cores give an offloaded AdamW update (train.offload_optimizer): XLA:CPU's update of N float32
parameters (state donated, updated in place) as one leaf and as --groups independent leaves in one program,
and the same arithmetic in numpy in place on 1 and on every core (threads over chunks; numpy makes temporaries,
so its rows bound the host's memory bandwidth from below rather than match XLA's work), in ns a parameter; and
the host's memory bandwidth (STREAM's add, c = a + b over float32 arrays, on every core): the rate that bounds
an update's time by the bytes it moves.
XLA:GPU runs a host computation with XLA:CPU's runtime; the first row is what `gshard-jax calibrate` times for
the planner's host-update bandwidth (docs/training.md, "The host's cores").

    python benchmarks/host_update.py [--params 67108864] [--groups 8] [--repeats 5] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np


def _median_s(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def numpy_update_s(n: int, threads: int, repeats: int) -> float:
    """The same moments and decayed step in numpy, in place, chunks spread over `threads` threads."""
    p, m, v = (np.full(n, x, np.float32) for x in (0.1, 0.0, 0.0))
    g = np.full(n, 0.01, np.float32)

    def chunk(sl):
        mm, vv, gg, pp = m[sl], v[sl], g[sl], p[sl]
        mm *= 0.9
        mm += 0.1 * gg
        vv *= 0.999
        vv += 0.001 * gg * gg
        pp -= 1e-4 * (mm / (np.sqrt(vv) + 1e-8) + 0.1 * pp)
    size = -(-n // (threads * 8))
    slices = [slice(i, i + size) for i in range(0, n, size)]
    with ThreadPoolExecutor(threads) as pool:
        return _median_s(lambda: list(pool.map(chunk, slices)), repeats)


def memory_bandwidth(n: int, threads: int, repeats: int) -> float:
    """Bytes a second the host's memory moves for c = a + b over n float32 values (read a and b, write c),
    chunks spread over `threads` threads (numpy releases the GIL in its loops)."""
    a, b, c = (np.full(n, x, np.float32) for x in (1.0, 2.0, 0.0))
    size = -(-n // (threads * 8))
    slices = [slice(i, i + size) for i in range(0, n, size)]
    with ThreadPoolExecutor(threads) as pool:
        s = _median_s(lambda: list(pool.map(lambda sl: np.add(a[sl], b[sl], out=c[sl]), slices)), repeats)
    return 3 * 4 * n / s


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=int, default=64 * 2**20, help="float32 parameters updated")
    ap.add_argument("--groups", type=int, default=8, help="independent leaves of the second XLA row")
    ap.add_argument("--repeats", type=int, default=5, help="timed updates per row (after one untimed)")
    ap.add_argument("--json", default="", help="also write the rows (and the memory bandwidth) to this file")
    a = ap.parse_args(argv)
    cores = os.cpu_count() or 1
    from gshard_jax.planner.calibrate import host_update_s_per_param  # what gshard-jax calibrate times
    rows = [("xla, 1 leaf", a.params * host_update_s_per_param(a.params, 1, a.repeats)),
            (f"xla, {a.groups} leaves", a.params * host_update_s_per_param(a.params, a.groups, a.repeats)),
            ("numpy, 1 thread", numpy_update_s(a.params, 1, a.repeats)),
            (f"numpy, {cores} threads", numpy_update_s(a.params, cores, a.repeats))]
    print(f"AdamW on the host over {a.params:,} float32 params ({cores} cores), median of {a.repeats}")
    print(f"{'update':<22} {'ms':>9} {'ns/param':>9} {'vs xla 1 leaf':>14}")
    for name, s in rows:
        print(f"{name:<22} {1e3 * s:>9.1f} {1e9 * s / a.params:>9.2f} {rows[0][1] / s:>13.2f}x")
    bandwidth = memory_bandwidth(a.params, cores, a.repeats)
    print(f"memory bandwidth (c = a + b, {cores} threads): {bandwidth / 2**30:.1f} GiB/s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"params": a.params, "cores": cores, "memory_bytes_per_s": bandwidth,
                       "s_per_param": {name: s / a.params for name, s in rows}}, f, indent=1)


if __name__ == "__main__":
    main()
