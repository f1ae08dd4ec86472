"""Collective matmul against the plain all-gather / reduce-scatter and against XLA's partitioner, in one run.

Per program: collectives and payload bytes per device from the compiled HLO
(as it lists them: a ring's loop body once), the bytes sent per call (ours:
explain()'s per-call totals, the loop's permutes times its trips; XLA's
programs here have no loops), temp memory from memory_analysis(), max abs difference from the unpartitioned
function, and the median step time (all variants timed alternately) with its
ratio to XLA's. Variants: ours with the ring (bidirectional and
unidirectional), ours without it (collective_matmul="off"), XLA's partitioner,
and on a GPU also XLA with its windowed einsum forced on
(--xla_gpu_threshold_for_windowed_einsum_mib=0
--xla_gpu_multi_streamed_windowed_einsum=true). Run:

    python benchmarks/collective_matmul.py [--d-model 512] [--seq 2048] [--steps 20]

On a CPU host the devices are simulated and no communication overlaps
compute, so the ring is expected to cost more there: the figures that matter
are an accelerator's.
"""
from __future__ import annotations

import argparse
import sys


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices (ignored on accelerators)")
    p.add_argument("--d-model", type=int, default=512, help="model width (the MLP is d -> 4d -> d)")
    p.add_argument("--seq", type=int, default=2048, help="tokens, split over the model axis (sequence parallel)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    p.add_argument("--dtype", default="float32", help="float32 or bfloat16")
    p.add_argument("--only", default=None, help="comma-separated program names")
    return p.parse_args(argv)


ARGS = parse_args()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", ARGS.devices)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import gshard_jax as gs  # noqa: E402
from gshard_jax.partitioner.reporting.hlo import collective_stats  # noqa: E402
from gshard_jax.training.timing import median_times  # noqa: E402

WINDOWED_EINSUM = {"xla_gpu_threshold_for_windowed_einsum_mib": 0, "xla_gpu_multi_streamed_windowed_einsum": True}


def sp_mlp(x, w1, w2):
    """Megatron sequence-parallel MLP: tokens split over model, gathered into the column-parallel matmul and
    reduce-scattered out of the row-parallel one."""
    x = gs.shard(x, ("model", None))
    h = jax.nn.gelu(gs.shard(x @ gs.shard(w1, (None, "model")), (None, "model")))
    return gs.shard(h @ gs.shard(w2, ("model", None)), ("model", None))


def sp_mlp_loss(x, w1, w2):
    return jnp.mean(sp_mlp(x, w1, w2).astype(jnp.float32) ** 2)


def fsdp_matmul(x, w):
    """FSDP: a weight stored split along its input dim over every device, gathered for a batch-split matmul."""
    return gs.shard(gs.shard(x, ("model", None)) @ gs.shard(w, ("model", None)), ("model", None))


def programs():
    rng = np.random.default_rng(0)
    d, s, dt = ARGS.d_model, ARGS.seq, jnp.dtype(ARGS.dtype)
    arr = lambda *shape: jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[0]), dt)
    mlp = (arr(s, d), arr(d, 4 * d), arr(4 * d, d))
    return {
        "sp_mlp fwd": (sp_mlp, mlp),
        "sp_mlp grad": (jax.grad(sp_mlp_loss, argnums=(0, 1, 2)), mlp),
        "fsdp_matmul fwd": (fsdp_matmul, (arr(s, d), arr(d, 4 * d))),
    }


def variants(fn, mesh):
    out = {f"ours {m}": gs.partition(fn, mesh, collective_matmul=m) for m in ("bidirectional", "unidirectional", "off")}
    out["xla"] = gs.partition(fn, mesh, backend="xla")
    return out


def compile_all(fn, mesh, args):
    """{variant: (compiled, payload bytes per call or None where the HLO's static count is the figure)}."""
    compiled = {}
    for name, part in variants(fn, mesh).items():
        per_call = None
        if name.startswith("ours"):
            totals = gs.explain(fn, mesh, *args, collective_matmul=name.split()[1]).totals(dynamic=True)
            per_call = sum(v["payload_bytes"] for v in totals.values())
        compiled[name] = (part.lower(*args).compile(), per_call)
    if jax.default_backend() == "gpu":
        xla = gs.partition(fn, mesh, backend="xla")
        compiled["xla windowed einsum"] = (xla.lower(*args).compile(compiler_options=WINDOWED_EINSUM), None)
    return compiled


def max_diff(a, b):
    return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
               for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))


def main() -> int:
    mesh = gs.make_mesh({"model": len(jax.devices())})
    only = set(ARGS.only.split(",")) if ARGS.only else None
    print(f"# backend={jax.default_backend()} devices={len(jax.devices())} d_model={ARGS.d_model} seq={ARGS.seq} "
          f"dtype={ARGS.dtype} steps={ARGS.steps}")
    print(f"{'program':<16} {'variant':<22} {'collectives (HLO)':<34} {'HLO bytes':>11} {'per call':>11} "
          f"{'temp MiB':>9} {'maxdiff':>8} {'step ms':>9} {'vs xla':>7}")
    for name, (fn, args) in programs().items():
        if only and name not in only:
            continue
        ref = jax.jit(fn)(*args)
        compiled = compile_all(fn, mesh, args)
        med = median_times({k: (lambda c=c: c(*args)) for k, (c, _) in compiled.items()}, ARGS.steps, warmup=2)
        for variant, (c, per_call) in compiled.items():
            stats = collective_stats(c)
            kinds = " ".join(f"{k.replace('collective-permute', 'cp')}:{v['count']}" for k, v in stats.items()
                             if v["count"]) or "none"
            payload = sum(v["payload_bytes"] for v in stats.values())
            temp = c.memory_analysis().temp_size_in_bytes / 2**20
            per_call = payload if per_call is None else per_call
            print(f"{name:<16} {variant:<22} {kinds:<34} {payload:>11,} {per_call:>11,} {temp:>9.2f} "
                  f"{max_diff(c(*args), ref):>8.1e} {med[variant] * 1e3:>9.3f} {med[variant] / med['xla']:>7.2f}",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
