"""The automatic sharding (partition(auto=True)) against the plans an expert writes, on 8 simulated CPU devices:
per case, bytes moved per device per step, predicted communication and compute, arguments, outputs and temporaries per
device, and how long the choice took.

    python benchmarks/auto_sharding.py [--scale 1.0]

Cases: a two-layer MLP train step on {data 2, model 4} with only the batch given, against Megatron's
column-then-row plan; GShard's MoE layer on {expert 8} with nothing annotated, against its hand-annotated
two-all-to-all program, unbounded and within that program's memory; the gradient of two 3x3 convolutions
on {data 8} with the images split by height (a small batch and a larger one), against propagation's halo
exchanges and a gathered image.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

from jax.sharding import PartitionSpec as P  # noqa: E402

import gshard_jax as gs  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from test_auto import (  # noqa: E402
    conv_args,
    conv_gathered,
    conv_grad,
    held,
    mlp_args,
    mlp_step,
    moe_annotated,
    moe_args,
    moe_plain,
    moved,
)


def row(case: str, plan: str, report, mesh_shape: dict, seconds: float = 0.0) -> str:
    return (f"| {case} | {plan} | {moved(report) / 2**20:.2f} | {report.comm_time * 1e3:.3f} | "
            f"{report.compute_time * 1e3:.3f} | {held(report, mesh_shape) / 2**20:.1f} | "
            + (f"{seconds:.2f} |" if seconds else "- |"))


def timed(fn, *args, **kw):
    start = time.perf_counter()
    out = fn(*args, **kw)
    return out, time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scale", type=float, default=1.0, help="the MLP's widths and batch times this")
    a = p.parse_args()
    print("| case | plan | moved MiB | comm ms | compute ms | args + outputs + temporaries MiB | explain s |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    mesh = gs.make_mesh({"data": 2, "model": 4})
    s = lambda n: max(8, int(n * a.scale) // 8 * 8)
    args = mlp_args(s(1024), s(1024), s(4096))
    shape = dict(mesh.shape)
    megatron = gs.explain(mlp_step, mesh, *args, in_shardings=(P("data", None), P(None, "model"), P("model", None)))
    auto, took = timed(gs.explain, mlp_step, mesh, *args, in_shardings=(P("data", None), None, None), auto=True)
    print(row("MLP step", "Megatron (hand)", megatron, shape))
    print(row("MLP step", "auto, batch given", auto, shape, took))
    mesh = gs.make_mesh({"expert": 8})
    shape, args = dict(mesh.shape), moe_args()
    hand = gs.explain(moe_annotated, mesh, *args)
    budget = held(hand, shape)
    print(row("GShard MoE", "hand-annotated", hand, shape))
    auto, took = timed(gs.explain, moe_plain, mesh, *args, auto=True)
    print(row("GShard MoE", "auto, no budget", auto, shape, took))
    auto, took = timed(gs.explain, moe_plain, mesh, *args, auto=True, memory_budget=budget)
    print(row("GShard MoE", "auto, the hand program's memory", auto, shape, took))
    mesh = gs.make_mesh({"data": 8})
    ins = (P(None, "data"), None, None)
    for images in ((2, 512, 64, 16), (8, 512, 128, 16)):
        shape, args = dict(mesh.shape), conv_args(images)
        case = f"conv gradient {'x'.join(map(str, images))}"
        print(row(case, "propagated (halo)", gs.explain(conv_grad, mesh, *args, in_shardings=ins), shape))
        print(row(case, "image gathered", gs.explain(conv_gathered, mesh, *args, in_shardings=ins), shape))
        auto, took = timed(gs.explain, conv_grad, mesh, *args, in_shardings=ins, auto=True)
        print(row(case, "auto, image given", auto, shape, took))
    print(f"jax {jax.__version__}, {len(jax.devices())} x {jax.devices()[0].platform}; "
          f"comm and compute on the mesh's default profile; explain s includes the trace and the choice")


if __name__ == "__main__":
    main()
