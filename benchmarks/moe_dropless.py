"""Dropless (sort + ragged_dot) against capacity (GShard one-hot einsums) MoE routing: forward+backward
throughput of the MoeFFN layer at equal tokens, on one device and on all devices (expert parallel).

    python benchmarks/moe_dropless.py [--devices 8] [--steps 10] [--tokens 8192]

Each row: tokens/s (median step) for the capacity path at --capacity-factor and for dropless (the default
grouped matmul; on CPU also JAX's own ragged_dot, which XLA:CPU runs as E dense matmuls) with each exchange
the backend runs, with worst-case per-peer buffers (never drops) and with buffers of twice the average load
("bound 2", overflow counted in `dropped`), and the ratio to capacity (> 1: dropless faster). All variants are
partitioned by our partitioner in the same process and timed alternately. Simulated CPU devices share the
host's cores, so the expert-parallel rows measure total work, not a network.
"""
from __future__ import annotations

import argparse
import functools
import sys

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--devices", type=int, default=8, help="simulated CPU devices (ignored on accelerators)")
p.add_argument("--steps", type=int, default=10, help="timed steps per variant")
p.add_argument("--tokens", type=int, default=8192, help="tokens per step (batch x length)")
p.add_argument("--capacity-factor", type=float, default=1.25)
ARGS = p.parse_args()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", ARGS.devices)

import jax.numpy as jnp  # noqa: E402

import gshard_jax as gs  # noqa: E402
from gshard_jax.models.gating import GatingConfig  # noqa: E402
from gshard_jax.models.logical import DEFAULT_RULES  # noqa: E402
from gshard_jax.models.moe import MoeConfig, MoeFFN  # noqa: E402
from gshard_jax.training.timing import median_times  # noqa: E402

# (name, experts, k, d_model, expert d_ff, activation): a GShard-like top-2 layer and an OLMoE-like top-8 one.
SHAPES = [("top2 E8", 8, 2, 256, 1024, "relu"), ("top8 E64", 64, 8, 256, 256, "swiglu")]


def step_fn(cfg):
    layer = MoeFFN(cfg, DEFAULT_RULES)
    loss = lambda prm, x: jnp.mean(layer.apply(prm, x, train=False)[0] ** 2)
    return layer, jax.value_and_grad(loss)


def main():
    n = len(jax.devices())
    seq = 256
    batch = ARGS.tokens // seq
    print(f"# backend={jax.default_backend()} devices={n} tokens/step={batch * seq} steps={ARGS.steps} "
          f"capacity_factor={ARGS.capacity_factor}")
    print(f"{'layer':<10} {'mesh':<14} {'variant':<22} {'tokens/s':>10} {'vs capacity':>12} {'dropped':>8}")
    exchanges = ["all_to_all", "all_gather"] + (["ragged"] if jax.default_backend() != "cpu" else [])
    for name, E, k, M, F, act in SHAPES:
        x = jax.random.normal(jax.random.key(0), (batch, seq, M))
        g = GatingConfig(k=k, capacity_factor=ARGS.capacity_factor, second_policy="all", normalize="before_drop")
        for mesh_axes in ({"expert": 1}, {"expert": n}):
            devices = jax.devices()[:1] if mesh_axes["expert"] == 1 else None
            mesh = gs.make_mesh(mesh_axes, devices=devices)
            variants = [("capacity", MoeConfig(E, F, act, g, dispatch="einsum"))]
            dropless = lambda **kw: MoeConfig(E, F, act, g, dispatch="dropless", **kw)
            if mesh_axes["expert"] == 1:
                variants.append(("dropless", dropless()))
                if jax.default_backend() == "cpu":  # JAX's dense expansion of ragged_dot on CPU, for scale
                    variants.append(("dropless ragged_dot", dropless(grouped_matmul="ragged_dot")))
            else:
                for ex in exchanges:
                    variants.append((f"dropless {ex}", dropless(exchange=ex)))
                    if ex != "all_gather":  # per-peer buffers of twice the average load instead of the worst case
                        variants.append((f"dropless {ex} bound 2", dropless(exchange=ex, peer_bound=2.0)))
            compiled = []
            for label, cfg in variants:
                layer, fn = step_fn(cfg)
                params = layer.init(jax.random.key(1), x)
                part = gs.partition(fn, mesh)
                c = part.lower(params, x).compile()
                jax.block_until_ready(c(params, x))
                dropped = float(gs.partition(lambda prm, x: layer.apply(prm, x)[2]["dropped"], mesh)(params, x))
                compiled.append((label, c, params, dropped))
            med_s = median_times({label: functools.partial(c, params, x) for label, c, params, _ in compiled},
                                 ARGS.steps)
            for label, _, _, dropped in compiled:
                med = med_s[label]
                print(f"{name:<10} {str(mesh_axes):<14} {label:<22} {batch * seq / med:>10,.0f} "
                      f"{med_s['capacity'] / med:>11.2f}x {dropped:>8.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
