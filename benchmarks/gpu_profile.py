"""Where a GPU step's time goes: a few steps of our Mula-1B step (benchmarks/gpu.py's mula_1b case) and of the
plain-JAX anchor traced with jax.profiler, and the device time per step printed by kind of kernel (matmul,
attention, copies, other) with the heaviest kernels of each program; then the kernels a step and the stream's
idle time between them, in launch gaps and in longer waits: where a step spends what its kernels do not.

    python benchmarks/gpu_profile.py --anchor ../shared/gpu/anchor_lm.py --variants cudnn:dots,cudnn:dots:scan \
        [--out DIR]

A variant is ATTENTION:REMAT[:scan] as the anchor takes them: with `:scan` both programs run their layers
stacked under one scan (ours: model.scan=true), without it unrolled (model.scan=false), so the two traces of
a variant are of the same program shape. Each program is traced in a fresh process; the trace
(perfetto JSON) is kept in --out. docs/training.md's GPU breakdown came from this. On a CPU the device rows
are empty (`--small` shrinks both programs for a smoke run there).
"""
from __future__ import annotations

import argparse
import collections
import functools
import glob
import gzip
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS = 3  # traced steps, after 2 untimed
SMALL = "model.num_layers=2 model.d_model=256 model.num_heads=2 model.d_ff=512 model.vocab_size=1000 " \
        "train.seq_len=128"
KINDS = (("attention", ("cudnn", "fmha", "flash", "sdpa")), ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "cublas")),
         ("copies", ("memcpy", "memset")))


def kind(kernel: str) -> str:
    name = kernel.lower()
    return next((k for k, marks in KINDS if any(m in name for m in marks)), "other")


def device_kernels(trace_path: str) -> list[tuple[str, float, float]]:
    """(kernel name, start, duration), in microseconds, of every kernel on the busiest device stream of a
    perfetto trace, in the order they ran."""
    with gzip.open(trace_path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    meta = lambda what: {(e["pid"], e.get("tid")) if what == "thread_name" else e["pid"]: e["args"].get("name", "")
                         for e in events if e.get("ph") == "M" and e.get("name") == what}
    process, thread = meta("process_name"), meta("thread_name")
    busy: collections.Counter = collections.Counter()
    kernels = []
    for e in events:
        if e.get("ph") == "X" and "dur" in e and "/device:" in process.get(e["pid"], ""):
            stream = (e["pid"], thread.get((e["pid"], e.get("tid")), ""))
            busy[stream] += e["dur"]
            kernels.append((stream, e["name"], float(e["ts"]), e["dur"]))
    if not busy:
        return []
    stream = busy.most_common(1)[0][0]
    return sorted(((name, ts, dur) for s, name, ts, dur in kernels if s == stream), key=lambda k: k[1])


GAP_US = 50.0  # an idle gap on the stream at least this long is a wait (on the host, a copy, the next call);
# shorter ones are the launch of the next kernel


def summary(kernels: list[tuple[str, float, float]], steps: int = STEPS, top: int = 12) -> dict:
    """ms per step by kind, and the heaviest kernels (numbered fusions merged: fusion.12 -> fusion); kernels a
    step, and the stream's idle time between its first kernel and its last, split into launch gaps (below
    GAP_US) and waits, with the longest waits: what a step takes beyond its kernels."""
    by_kind: collections.Counter = collections.Counter()
    by_name: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    for name, _, dur in kernels:
        by_kind[kind(name)] += dur / 1e3 / steps
        base = re.sub(r"[._]\d+$", "", name)
        by_name[base] += dur / 1e3 / steps
        calls[base] += 1
    gaps = [b[1] - (a[1] + a[2]) for a, b in zip(kernels, kernels[1:])]
    gaps = [g for g in gaps if g > 0]
    launch, waits = [g for g in gaps if g < GAP_US], sorted((g for g in gaps if g >= GAP_US), reverse=True)
    return {"total_ms": sum(by_kind.values()), "by_kind_ms": dict(by_kind.most_common()),
            "top": [(n, ms, calls[n] // steps) for n, ms in by_name.most_common(top)],
            "kernels_per_step": len(kernels) / steps,
            "span_ms": (kernels[-1][1] + kernels[-1][2] - kernels[0][1]) / 1e3 / steps if kernels else 0.0,
            "launch_gaps_ms": sum(launch) / 1e3 / steps, "waits_ms": sum(waits) / 1e3 / steps,
            "longest_waits_ms": [w / 1e3 for w in waits[:5]]}


def _trace(step, args, out_dir: str, tag: str) -> str:
    import jax
    for _ in range(2):
        args = step(*args)
    jax.block_until_ready(args)
    d = tempfile.mkdtemp()
    with jax.profiler.trace(d, create_perfetto_trace=True):
        for _ in range(STEPS):
            args = step(*args)
        jax.block_until_ready(args)
    found = glob.glob(os.path.join(d, "**", "*.trace.json.gz"), recursive=True)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{tag}.trace.json.gz")
    os.replace(found[0], path)
    return path


def child(args) -> dict:
    """One program traced: ours (the gshard partitioner's compiled train step) or the anchor's."""
    attention, remat, *scan = args.child_variant.split(":")
    tag = "_".join([args.child, attention, remat, *scan])
    if args.child == "anchor":
        import jax
        import optax
        spec = importlib.util.spec_from_file_location("anchor_lm", args.anchor)
        A = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(A)
        L, d, h, ff, V, B, S = (2, 256, 2, 512, 1000, 2, 128) if args.small else (16, 2048, 16, 8192, 50304, 4, 2048)
        params = A.init(jax.random.PRNGKey(0), L, d, h, 128, ff, V)
        params = A.stacked(params) if scan else params
        tx = optax.adamw(1e-4, weight_decay=0.1)
        tokens = jax.random.randint(jax.random.PRNGKey(1), (B, S + 1), 0, V)
        attn = A.attn_einsum if attention == "einsum" else functools.partial(A.attn_dpa, attention)

        @functools.partial(jax.jit, donate_argnums=(0, 1))
        def step(params, opt_state):
            _, g = jax.value_and_grad(A.loss_fn)(params, tokens, attn, remat)
            updates, opt_state = tx.update(g, opt_state, params)
            return optax.apply_updates(params, updates), opt_state
        path = _trace(step, (params, tx.init(params)), args.out, tag)
    else:
        sys.path.insert(0, HERE)
        import gpu

        from gshard_jax.training import train
        train.init_devices(overlap_flags=True)
        import jax
        sets = [f"model.attention={attention}", f"model.remat={remat}", f"model.scan={str(bool(scan)).lower()}",
                *args.set] + SMALL.split() * args.small
        cfg = gpu.configure("mula_1b", jax.device_count(), "auto", sets)
        with tempfile.TemporaryDirectory() as workdir:
            trainer, state, batch = train.step_inputs(cfg, workdir)
        compiled = trainer.partitioned("train", "gshard", donate_argnums=0).lower(state, batch).compile()
        path = _trace(lambda s: (compiled(s, batch)[0],), (state,), args.out, tag)
    return dict(program=tag, trace=path, **summary(device_kernels(path)))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--anchor", default=os.path.join(HERE, "..", "..", "shared", "gpu", "anchor_lm.py"),
                   help="the plain-JAX anchor (../shared/gpu/anchor_lm.py)")
    p.add_argument("--variants", default="cudnn:dots", help="ATTENTION:REMAT[:scan], comma-separated")
    p.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                   help="config overrides for our step, e.g. model.vocab_size=32000")
    p.add_argument("--out", default="gpu_traces", help="where the traces are kept")
    p.add_argument("--small", action="store_true", help="tiny shapes: a smoke run on a CPU")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    p.add_argument("--child-variant", default="", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(args)), flush=True)
        return
    bad = [v for v in args.variants.split(",") if len(v.split(":")) not in (2, 3) or v.split(":")[2:] not in ([],
                                                                                                  ["scan"])]
    if bad:
        raise SystemExit(f"--variants {bad}: expected ATTENTION:REMAT or ATTENTION:REMAT:scan, e.g. cudnn:dots:scan")
    failed = False
    programs = ("ours", "anchor") if os.path.exists(args.anchor) else ("ours",)
    if len(programs) == 1:
        print(f"no anchor at {args.anchor}: ours only (pass --anchor ../shared/gpu/anchor_lm.py)")
    for variant in args.variants.split(","):
        for who in programs:
            cmd = [sys.executable, os.path.abspath(__file__), "--child", who, "--child-variant", variant,
                   "--anchor", args.anchor, "--out", args.out] + ["--small"] * args.small
            cmd += ["--set", *args.set] if args.set else []
            done = subprocess.run(cmd, capture_output=True, text=True)
            rows = [line for line in done.stdout.splitlines() if line.startswith("{")]
            if done.returncode or not rows:
                print(f"{who} {variant}: failed\n{done.stderr[-3000:]}")
                failed = True
                continue
            row = json.loads(rows[-1])
            kinds = ", ".join(f"{k} {ms:.2f}" for k, ms in row["by_kind_ms"].items())
            print(f"{row['program']}: {row['total_ms']:.2f} ms of device kernels a step ({kinds}); "
                  f"trace {row['trace']}")
            print(f"  {row['kernels_per_step']:.0f} kernels a step; from the first kernel to the last "
                  f"{row['span_ms']:.2f} ms a step, idle {row['launch_gaps_ms']:.2f} ms in gaps under "
                  f"{GAP_US:.0f} us and {row['waits_ms']:.2f} ms in longer waits (longest "
                  f"{', '.join(f'{w:.2f}' for w in row['longest_waits_ms']) or '-'} ms)")
            for name, ms, n in row["top"]:
                print(f"  {ms:8.2f} ms {n:5d} x  {name[:110]}")
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
