"""Fit a compiler's memory coefficients (partitioner/costs/compilers.py's Habits) to compiled grids: the
planner's formula against each row's memory_analysis(), by least squares on the log ratio, steep outside
[0.90, 1.15] and drawn gently to the row's current values.

    python benchmarks/memory_grid.py --bf16 --target tpu:v5p:2x2x2 --no-explain --json tpu.json
    python benchmarks/fit_habits.py tpu tpu.json [more.json ...] [--fix pipeline_ticks,moe_ffn | --only scores]
    python benchmarks/fit_habits.py cpu --cases 0,12,18   # XLA:CPU's grid cases, compiled here

Prints each coefficient before and after, the ratios row by row, and the fitted row to paste into the table.
One model's grid cannot tell every term apart (d-model-wide, FFN-wide and L x L values scale together there):
fit on the grid and its held-out shapes together, and read the coefficients before taking them.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys

import numpy as np
from scipy.optimize import least_squares

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import memory_grid as G  # noqa: E402

from gshard_jax.partitioner.costs import compilers  # noqa: E402
from gshard_jax.planner import estimate as E, memory_check as MC, space as SP  # noqa: E402

LOW, HIGH = 0.90, 1.15
TABLES = ("none_values", "dots_values", "working", "loop_working", "microbatch_gradients",  # dicts of numbers
          "dropless_ffn_values")
SCALARS = ("scores", "logit_copies", "pipeline_ticks", "moe_dispatch", "moe_ffn", "moe_d_values",
           "dropless_d_values", "dropless_dots", "dropless_weight_copies")


def names(h: compilers.Habits) -> list[str]:
    """The fitted coefficients' names: table.key(.index) and the scalars."""
    out = []
    for t in TABLES:
        for k, v in getattr(h, t).items():
            out += [f"{t}.{k}.{i}" for i in range(len(v))] if isinstance(v, tuple) else [f"{t}.{k}"]
    return out + list(SCALARS)


def pack(h: compilers.Habits) -> np.ndarray:
    return np.array([x for t in TABLES for v in getattr(h, t).values()
                     for x in (v if isinstance(v, tuple) else (v,))] + [getattr(h, s) for s in SCALARS], float)


def unpack(h: compilers.Habits, v: np.ndarray) -> compilers.Habits:
    it, out = iter(float(x) for x in v), {}
    for t in TABLES:
        out[t] = {k: tuple(next(it) for _ in x) if isinstance(x, tuple) else next(it) for k, x in getattr(h, t).items()}
    out.update({s: next(it) for s in SCALARS})
    return dataclasses.replace(h, **out)


@functools.lru_cache(maxsize=None)
def _shape(case: int, held_out: bool, bf16: bool, long: bool, platform: str, experts: bool = False):
    cfg, c = G.case(case, held_out, bf16, long, experts)
    return SP.model_shape(cfg, platform), c


@functools.lru_cache(maxsize=None)
def _seed(i: int, platform: str):
    cfg, c, _ = G.seed_case(i)
    return SP.model_shape(cfg, platform), c


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("platform", choices=sorted(k for k in compilers.HABITS if k))
    p.add_argument("grids", nargs="*", help="memory_grid.py --json files, compiled by that platform's compiler")
    p.add_argument("--cases", default="", help="grid cases compiled here instead, on 8 simulated CPU devices "
                   "(platform cpu)")
    p.add_argument("--fix", default="", help="comma-separated coefficients held at their current values")
    p.add_argument("--only", default="", help="comma-separated coefficients fitted, every other one held")
    p.add_argument("--bounds", default="", help="name=lo:hi,... where a compiler's dump bounds a coefficient "
                   "(XLA_FLAGS=--xla_dump_to: its memory-usage report lists the buffers at the peak)")
    p.add_argument("--over", type=float, default=30.0, help="weight of a ratio over the band")
    p.add_argument("--under", type=float, default=100.0, help="weight of a ratio under the band")
    p.add_argument("--validate", nargs="*", default=[], help="grids only checked, not fitted")
    p.add_argument("--pull", type=float, default=0.01, help="weight drawing each coefficient to its current value")
    a = p.parse_args()
    def load(paths):
        rows = [r for path in paths for r in json.load(open(path)) if r.get("compiled")]
        return rows, [_seed(r["seed"], a.platform) if "seed" in r else
                      _shape(r["case"], r.get("held_out", False), r.get("bf16", False), r.get("long", False),
                             a.platform, r.get("experts", False)) for r in rows]
    rows, shapes = load(a.grids)
    for i in (int(x) for x in a.cases.split(",") if x):  # compiled by this process's XLA:CPU
        cfg, c = G.case(i)
        rows.append({"case": i, "compiled": MC.compiled(cfg, c).total})
        shapes.append(_shape(i, False, False, False, a.platform))
    if not rows:
        p.error("no rows: give grid JSON files, or --cases")
    checked, checked_shapes = load(a.validate)
    base = compilers.of(a.platform)
    v0, keys = pack(base), names(base)
    lo, hi = np.zeros_like(v0), np.maximum(4 * v0, 40.0)
    only = set(filter(None, a.only.split(",")))
    held = [n for n in keys if n not in only] if only else []
    for n in held + list(filter(None, a.fix.split(","))):
        k = keys.index(n)
        lo[k], hi[k] = v0[k] - 1e-9, v0[k] + 1e-9
    for item in filter(None, a.bounds.split(",")):
        n, span = item.split("=")
        k = keys.index(n)
        lo[k], hi[k] = (float(x) for x in span.split(":"))
    v0 = np.clip(v0, lo, hi)

    def ratios(v, rows=rows, shapes=shapes):
        compilers.HABITS = dict(compilers.HABITS, **{a.platform: unpack(base, v)})
        return np.array([E.memory(s, c)["total"] / r["compiled"] for (s, c), r in zip(shapes, rows)])

    def residuals(v):
        lr = np.log(ratios(v))
        band = (a.over * np.maximum(0, lr - np.log(HIGH - 0.01)) +
                a.under * np.maximum(0, np.log(LOW + 0.02) - lr))  # under is the costlier miss: a plan that fits
        return np.concatenate([band, 0.05 * (lr - np.log(1.02)), a.pull * (v - v0) / np.maximum(v0, 0.5)])

    v = least_squares(residuals, v0, bounds=(lo, hi)).x
    for n, x, y in zip(keys, v0, v):
        print(f"{n:32s} {x:7.2f} -> {y:7.2f}")
    for what, rs, ss in (("fitted", rows, shapes), ("checked", checked, checked_shapes)):
        if not rs:
            continue
        got = ratios(v, rs, ss)
        for r, (s, c), x in zip(rs, ss, got):
            kind = "seed " if "seed" in r else "long " if r.get("long") else "held-out " if r.get("held_out") else \
                "experts " if r.get("experts") else ""
            mark = "" if LOW <= x <= HIGH else "  outside"
            print(f"{kind}{r.get('case', r.get('seed')):3d} {c.key:56s} {x:5.2f}{mark}")
        print(f"{a.platform} {what}: {len(got)} rows, {sum(LOW <= x <= HIGH for x in got)} within [{LOW}, {HIGH}], "
              f"{got.min():.2f}-{got.max():.2f}")
    print(repr(unpack(base, np.round(v, 2))))


if __name__ == "__main__":
    sys.exit(main())
