"""Ring attention against the gathered form and XLA's partitioner: per-device memory and bytes of a gradient step.

One program per variant, each the forward and the gradient w.r.t. q, k, v (``jax.vjp`` with a fixed
cotangent) of causal attention over [batch, S, heads, head_dim] with S split over `context`:

- ``ring, tile t``: models/ring_attention.py (a gs.manual region: K/V rotate by collective-permute, online
  softmax, custom_vjp ring backward) with key tiles of t positions (``block_size``; a chunk of S/2n no larger
  than t is one tile), the sequence in zigzag order (permuted on the host, as a model does once);
- ``gathered``: plain attention (``reference_attention``) with q, k, v and the results annotated split on
  `context`, partitioned by ours (gs.partition);
- ``xla``: the same annotated function through XLA's SPMD partitioner (``backend="xla"``).

Per variant: per-device temp memory (``compiled.memory_analysis().temp_size_in_bytes``), the collectives'
bytes per device per call (gs.collective_stats(per_step=True): loops times their trips; "payload" is the
arrays' size as the HLO lists them, an all-gather's result and a reduce-scatter's operand, "sent" what a device
sends, (n-1)/n of those for a ring-algorithm gather or scatter, all of a permute's), their kinds and counts,
and the max |difference| of the output and of the gradients from the unsplit function (jax.jit on one device,
the natural order). Run:

    python benchmarks/ring_attention.py [--seq 8192] [--heads 4] [--head-dim 32] [--batch 1] [--devices 8]
        [--block-sizes 512,128] [--non-causal]
"""
from __future__ import annotations

import argparse


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices: the context axis's size")
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--non-causal", action="store_true", help="full attention (default: causal)")
    p.add_argument("--block-sizes", default="512,128", help="ring variants: comma-separated key tiles")
    return p.parse_args(argv)


ARGS = parse_args()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", ARGS.devices)

import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import gshard_jax as gs  # noqa: E402
from gshard_jax.models import ring_attention as R  # noqa: E402

SPLIT = P(None, "context", None, None)


def step_of(attn):
    """(output, dq, dk, dv) of attn at q, k, v for the cotangent w."""
    def step(q, k, v, w):
        out, vjp = jax.vjp(attn, q, k, v)
        return (out, *vjp(w))
    return step


def annotated(causal):
    def attn(q, k, v):
        q, k, v = (gs.shard(x, SPLIT) for x in (q, k, v))
        return gs.shard(R.reference_attention(q, k, v, causal=causal), SPLIT)
    return attn


def figures(name, fn, args, want, unperm):
    compiled = fn.lower(*args).compile()
    stats = gs.collective_stats(compiled, per_step=True)
    got = [unperm(np.asarray(x)) for x in fn(*args)]
    return {"variant": name, "temp": compiled.memory_analysis().temp_size_in_bytes,
            "bytes": sum(s["payload_bytes"] for s in stats.values()),
            "moved": sum(s["moved_bytes"] for s in stats.values()),
            "kinds": ", ".join(f"{k} x{s['count']}" for k, s in stats.items() if s["count"]) or "-",
            "out": float(np.max(np.abs(got[0] - want[0]))),
            "grads": max(float(np.max(np.abs(g - w))) for g, w in zip(got[1:], want[1:]))}


def main():
    n, causal = ARGS.devices, not ARGS.non_causal
    mesh = gs.make_mesh({"context": n})
    rng = np.random.default_rng(0)
    shape = (ARGS.batch, ARGS.seq, ARGS.heads, ARGS.head_dim)
    q, k, v, w = (np.asarray(rng.standard_normal(shape), np.float32) for _ in range(4))
    want = [np.asarray(x) for x in jax.jit(step_of(lambda *a: R.reference_attention(*a, causal=causal)))(q, k, v, w)]
    zz = lambda x: np.asarray(R.zigzag(x, n)) if causal else x
    unzz = lambda x: np.asarray(R.unzigzag(x, n)) if causal else x
    layout = "zigzag" if causal else "contiguous"
    rows = []
    for tile in map(int, ARGS.block_sizes.split(",")):
        attn = lambda *a, tile=tile: R.ring_attention(*a, causal=causal, layout=layout, block_size=tile)
        ring = gs.partition(step_of(attn), mesh, in_shardings=SPLIT, out_shardings=SPLIT)
        rows.append(figures(f"ring, tile {tile}", ring, [zz(x) for x in (q, k, v, w)], want, unzz))
    for name, backend in (("gathered", "gshard"), ("xla", "xla")):
        fn = gs.partition(step_of(annotated(causal)), mesh, in_shardings=SPLIT, out_shardings=SPLIT,
                          backend=backend)
        rows.append(figures(name, fn, [q, k, v, w], want, lambda x: x))
    base = rows[0]
    print(f"{'causal' if causal else 'full'} attention, S={ARGS.seq}, batch {ARGS.batch}, {ARGS.heads} heads x "
          f"{ARGS.head_dim}, float32, {n} devices on `context`; forward + gradient w.r.t. q, k, v, per device")
    print("| variant | temp MiB | x ring | payload KiB | sent KiB | x ring | collectives | max abs diff out | "
          "max abs diff grads |")
    print("|---|---:|---:|---:|---:|---:|---|---:|---:|")
    for r in rows:
        print(f"| {r['variant']} | {r['temp'] / 2**20:.1f} | {r['temp'] / base['temp']:.1f} | "
              f"{r['bytes'] / 2**10:.0f} | {r['moved'] / 2**10:.0f} | {r['moved'] / max(base['moved'], 1):.2f} | "
              f"{r['kinds']} | "
              f"{r['out']:.1e} | {r['grads']:.1e} |")


if __name__ == "__main__":
    main()
