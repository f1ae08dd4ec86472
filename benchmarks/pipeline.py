"""Pipeline schedules on 8 simulated devices ({stage 4, data 2}): per schedule and m in {p, 2p, 4p, 8p}
microbatches of a fixed size (the batch grows with m, as a pipeline's does), the step time against the
unpipelined step on the same mesh, collective-permutes per step, per-device flops
(cost_analysis() of the unrolled step) against the ideal share and the schedule's theory m r / (m r + p - 1),
and memory_analysis().temp_size_in_bytes. Prints figures and ratios; asserts nothing about time.

    python benchmarks/pipeline.py [--layers 8] [--width 512] [--micro 32] [--steps 5]
"""
from __future__ import annotations

import argparse
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)  # (an XLA_FLAGS the caller set is not overridden by this)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import gshard_jax as gs  # noqa: E402
from gshard_jax.pipelines import schedules as S  # noqa: E402


def layer(w, h):
    return jnp.tanh(h @ w)


def stage(w, h):
    """A chunk of the stack: w [n, D, D] (a Python loop, so cost_analysis() counts every layer)."""
    for i in range(w.shape[0]):
        h = layer(w[i], h)
    return h


def head_loss(hp, y, t):
    return jnp.sum((y @ hp - t) ** 2)


def flops(compiled) -> float:
    ca = compiled.cost_analysis()
    return float((ca[0] if isinstance(ca, list) else ca)["flops"])


def timed(fn, args, steps: int) -> float:
    jax.block_until_ready(fn(*args))
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        out.append(time.perf_counter() - t0)
    return float(np.median(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--micro", type=int, default=32, help="rows per microbatch")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--schedules", default="gpipe,1f1b,circular,interleaved_1f1b")
    a = ap.parse_args()
    p, L, D = 4, a.layers, a.width
    mesh = gs.make_mesh({"stage": p, "data": 2})
    k = jax.random.split(jax.random.key(0), 4)
    W = jax.random.normal(k[0], (L, D, D)) / np.sqrt(D)
    H = jax.random.normal(k[2], (D, 8))

    def unpipelined(m):
        def f(W, x, H, t):
            def loss(W, x, H):
                total = 0.0
                for i in range(m):
                    h = gs.shard(x[i::m], (("data",), None))
                    total += head_loss(H, stage(W, h), t[i::m])
                return total
            return jax.value_and_grad(loss, argnums=(0, 1, 2))(W, x, H)
        return f

    def pipelined(schedule, r, m, unroll=False):
        def f(Wc, x, H, t):  # Wc: the layers as [stages, ...] or [repeats, stages, ...] chunks
            (loss, _), grads = gs.pipeline_value_and_grad(stage, Wc, x, head_loss, H, t, num_microbatches=m,
                                                          schedule=schedule, repeats=r, x_spec=(("data",),),
                                                          unroll=unroll)
            return loss, grads
        return f

    print(f"mesh {dict(mesh.shape)}; {L} layers of {D}x{D}, microbatches of {a.micro} rows; medians of "
          f"{a.steps} steps")
    print(f"{'schedule':<17} {'m':>3} {'ticks':>5} {'step ms':>8} {'vs unpiped':>10} {'permutes':>8} "
          f"{'per call':>8} {'flops util':>10} {'theory':>7} {'temp KiB':>9}")
    for schedule in a.schedules.split(","):
        r = 2 if schedule in ("circular", "interleaved_1f1b") else 1
        for m in (p, 2 * p, 4 * p, 8 * p):
            B = m * a.micro
            args = (W, jax.random.normal(k[1], (B, D)), H, jax.random.normal(k[3], (B, 8)))
            chunked = (W.reshape(p, L // p, D, D) if r == 1 else W.reshape(r, p, L // (p * r), D, D),) + args[1:]
            sc = S.make(schedule, p, m, r)
            base_fn = gs.partition(unpipelined(m), mesh)
            ideal = flops(jax.jit(unpipelined(m)).lower(*args).compile()) / mesh.size
            fn = gs.partition(pipelined(schedule, r, m), mesh)
            compiled = fn.lower(*chunked).compile()
            unrolled = gs.partition(pipelined(schedule, r, m, unroll=True), mesh).lower(*chunked).compile()
            report = gs.explain(pipelined(schedule, r, m), mesh, *chunked)
            static = report.totals()["collective-permute"]["count"]
            dynamic = report.totals(dynamic=True)["collective-permute"]["count"]
            ms = timed(fn, chunked, a.steps) * 1e3
            base_ms = timed(base_fn, args, a.steps) * 1e3
            util = ideal / flops(unrolled)
            theory = m * r / (m * r + p - 1)
            print(f"{schedule:<17} {m:>3} {sc.ticks:>5} {ms:>8.1f} {ms / base_ms:>10.2f} {static:>8} {dynamic:>8} "
                  f"{util:>10.3f} {theory:>7.3f} {compiled.memory_analysis().temp_size_in_bytes / 1024:>9.0f}")


if __name__ == "__main__":
    main()
