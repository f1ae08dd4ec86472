"""Checkpoint bytes written and read per process, with scattered writes and single reads on and off.

Runs N processes of this host (jax.distributed, 8 / N CPU devices each) on a config's train state. Each
saves one full checkpoint and restores it, and reports:
- the bytes it wrote: the files of its own ``ocdbt.process_I`` directory (process 0 also writes the
  checkpoint's metadata, counted apart);
- the bytes it read while restoring: ``rchar`` of /proc/self/io, every byte its read calls returned (the
  page cache included, so a second reader of the same file still counts).
"before" is orbax's GPU default (one writer per shard: replica 0) with every process reading what it holds;
"after" is this runtime's default (train.checkpoint_replica_parallel, train.checkpoint_single_read). The
restored state is compared with the saved one. Run:

    python benchmarks/checkpoint_io.py [--processes 2,4] [--config experiments/tiny_moe_lm.py]
        [--set model.num_layers=2 ...]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile

SETTINGS = {"before": (False, False), "after": (True, True)}  # (replica_parallel, single_read)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="experiments/tiny_moe_lm.py")
    p.add_argument("--processes", default="2,4", help="process counts to run, each with 8 / N devices")
    p.add_argument("--set", nargs="*", default=[], help="config overrides KEY=VALUE (as --config.KEY=VALUE)")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)  # "I,N,PORT,DIR,SETTING" in a child process
    return p.parse_args(argv)


def tree_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def child(args) -> None:
    i, n, port, workdir, setting = args.child.split(",")
    i, n = int(i), int(n)
    from gshard_jax.training import train
    train.init_devices(8 // n, f"127.0.0.1:{port}", n, i)
    import jax
    import numpy as np

    from gshard_jax import configs
    from gshard_jax.training import overrides
    from gshard_jax.training.checkpoints import Checkpoints, bytes_read, host_groups
    cfg = configs.load(args.config)
    overrides.apply(cfg, [tuple(kv.split("=", 1)) for kv in args.set])
    trainer = train.Trainer(cfg, workdir)
    # The train state's tree and shardings, filled with noise: a fresh state's zero moments compress to nothing.
    keys = iter(jax.random.split(jax.random.key(0), len(jax.tree.leaves(trainer.fresh_state()))))
    state = jax.tree.map(lambda x: jax.jit(lambda k: jax.random.normal(k, x.shape, x.dtype), out_shardings=x.sharding)(
        next(keys)) if jax.numpy.issubdtype(x.dtype, jax.numpy.floating) else x, trainer.fresh_state())
    replica_parallel, single_read = SETTINGS[setting]
    ckpt = Checkpoints(workdir, 1, 0, async_save=False, replica_parallel=replica_parallel, single_read=single_read)
    ckpt.save(1, state, force=True)
    ckpt.wait()
    step_dir = os.path.join(workdir, "checkpoints", "1", "default")
    before = bytes_read()
    restored = ckpt.restore_latest(state)[1]
    read = bytes_read() - before
    same = all(np.array_equal(np.asarray(a.data), np.asarray(b.data))
               for x, y in zip(jax.tree.leaves(state), jax.tree.leaves(restored))
               for a, b in zip(x.addressable_shards, y.addressable_shards))
    ckpt.close()
    written = tree_bytes(os.path.join(step_dir, f"ocdbt.process_{i}"))
    meta = tree_bytes(step_dir) - sum(tree_bytes(os.path.join(step_dir, f"ocdbt.process_{p}")) for p in range(n))
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
    print(json.dumps({"process": i, "written": written, "read": read, "same": same, "metadata": meta,
                      "state_bytes": state_bytes, "host_groups": host_groups(trainer.mesh),
                      "mesh": dict(trainer.mesh.shape), "zero_stage": cfg.train.zero_stage}), flush=True)


def run(args, n: int, setting: str) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix=f"ckpt_io_{n}_{setting}_") as workdir:
        return _run(args, n, setting, port, workdir)


def _run(args, n: int, setting: str, port: int, workdir: str) -> list[dict]:
    procs = [subprocess.Popen([sys.executable, __file__, "--config", args.config, "--set", *args.set,
                               "--child", f"{i},{n},{port},{workdir},{setting}"],
                              stdout=open(os.path.join(workdir, f"{i}.out"), "w"), stderr=subprocess.STDOUT,
                              text=True, start_new_session=True)
             for i in range(n)]  # output to files: a full pipe would stall a process and its peers with it
    out = []
    try:
        for i, p in enumerate(procs):
            p.wait(timeout=600)
            with open(os.path.join(workdir, f"{i}.out")) as f:
                text = f.read()
            if p.returncode != 0:
                raise RuntimeError(f"process {i} exited {p.returncode}:\n{text[-3000:]}")
            out.append(json.loads(text.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return sorted(out, key=lambda r: r["process"])


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.child:
        return child(args)
    for n in (int(x) for x in args.processes.split(",")):
        results = {s: run(args, n, s) for s in SETTINGS}
        first = results["after"][0]
        print(f"\n{n} processes x {8 // n} devices, mesh {first['mesh']}, host groups {first['host_groups']}, "
              f"zero_stage {first['zero_stage']}, "
              f"state {first['state_bytes'] / 2**20:.2f} MiB (global)")
        print(f"{'process':>8} {'written before':>15} {'written after':>14} {'read before':>12} {'read after':>11}")
        for b, a in zip(results["before"], results["after"]):
            print(f"{b['process']:>8} {b['written'] / 2**20:>13.2f}Mi {a['written'] / 2**20:>12.2f}Mi "
                  f"{b['read'] / 2**20:>10.2f}Mi {a['read'] / 2**20:>9.2f}Mi")
        for s, rows in results.items():
            w, r = [x["written"] for x in rows], [x["read"] for x in rows]
            print(f"{s:>8}: the busiest writer wrote {max(w) / sum(w):.0%} of {n} processes' writes, total "
                  f"{sum(w) / 2**20:.2f} MiB; read total {sum(r) / 2**20:.2f} MiB; restored equal: "
                  f"{all(x['same'] for x in rows)}")


if __name__ == "__main__":
    main()
