"""Sharded training state per ZeRO stage (and EPSO), ours against XLA's partitioner on the same annotations.

For each configuration: argument bytes per device by kind (explain()'s prediction), memory_analysis()'s
argument and temp bytes, collectives of the compiled step, and median times of the whole train step and of
the optimizer step alone (``Trainer.update``: gradients in, next state out), each partitioned by our
partitioner and by XLA's, timed alternately in one run, with ratios. Run:

    python benchmarks/sharded_state.py [--config experiments/tiny_moe_lm.py] [--mesh data=2,expert=4]
        [--stages 0,1,2,3] [--dtype float32] [--steps 10] [--set model.num_layers=2 ...]

Every stage is run with EPSO and, where the mesh has an expert axis, without it (the plain sharded
optimizer), so the optimizer-step ratio of the two is seed 001's comparison (1.07-1.36x on Aurora).
"""
from __future__ import annotations

import argparse


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="experiments/tiny_moe_lm.py")
    p.add_argument("--mesh", default="data=2,expert=4", help="axis=size,... (the config's other axes become 1)")
    p.add_argument("--stages", default="0,1,2,3")
    p.add_argument("--dtype", default="float32", help="model.dtype: float32 or bfloat16")
    p.add_argument("--steps", type=int, default=10, help="timed rounds per function")
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices (ignored on accelerators)")
    p.add_argument("--set", nargs="*", default=[], help="config overrides KEY=VALUE (as --config.KEY=VALUE)")
    return p.parse_args(argv)


ARGS = parse_args()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", ARGS.devices)  # only the CPU backend reads it

import functools  # noqa: E402

import numpy as np  # noqa: E402

from gshard_jax import configs  # noqa: E402
from gshard_jax.partitioner.costs.cost import _fmt_bytes  # noqa: E402
from gshard_jax.partitioner.reporting.hlo import collective_stats, summary  # noqa: E402
from gshard_jax.training import overrides, train  # noqa: E402
from gshard_jax.training.timing import median_times  # noqa: E402


def trainer_for(stage: int, epso: bool) -> train.Trainer:
    cfg = configs.load(ARGS.config)
    mesh = dict(kv.split("=") for kv in ARGS.mesh.split(","))
    cfg.mesh.update({k: 1 for k in configs.MeshConfig().sizes()} | {k: int(v) for k, v in mesh.items()})
    overrides.apply(cfg, [tuple(kv.split("=", 1)) for kv in ARGS.set] +
                    [("model.dtype", ARGS.dtype), ("train.zero_stage", str(stage)), ("train.epso", str(epso))])
    return train.Trainer(cfg, "/nonexistent")


def measure(stage: int, epso: bool) -> dict:
    t = trainer_for(stage, epso)
    rng = np.random.default_rng(0)
    toks = rng.integers(0, t.cfg.model.transformer.vocab_size, (t.cfg.train.batch_size, t.cfg.train.seq_len + 1))
    batch = jax.device_put({"inputs": toks[:, :-1].astype(np.int32), "targets": toks[:, 1:].astype(np.int32)},
                           t.batch_sharding)
    state = t.fresh_state()
    grads = jax.jit(lambda s: jax.tree.map(lambda p: p.astype(np.float32) * 1e-3, s["params"]),
                    out_shardings=jax.tree.map(lambda s: jax.sharding.NamedSharding(t.mesh, s),
                                               t.layout.gradients))(state)
    report = t.explain(state, batch)
    fns, out = {}, {"stage": stage, "epso": epso, "memory": report.memory}
    for backend in ("gshard", "xla"):
        step = t.partitioned("train", backend).lower(state, batch).compile()
        update = t.partitioned("update", backend).lower(state, grads).compile()
        fns[f"step/{backend}"] = functools.partial(step, state, batch)
        fns[f"update/{backend}"] = functools.partial(update, state, grads)
        m = step.memory_analysis()
        out[backend] = {"collectives": summary(collective_stats(step)),
                        "bytes": int(sum(v["payload_bytes"] for v in collective_stats(step).values())),
                        "argument": int(m.argument_size_in_bytes), "temp": int(m.temp_size_in_bytes)}
    times = median_times(fns, ARGS.steps, warmup=2)
    for backend in ("gshard", "xla"):
        out[backend].update(step_ms=1e3 * times[f"step/{backend}"], update_ms=1e3 * times[f"update/{backend}"])
    return out


def main() -> None:
    has_expert = "expert=" in ARGS.mesh and "expert=1" not in ARGS.mesh.split(",")
    rows = [measure(int(s), e) for s in ARGS.stages.split(",")
            for e in ((True, False) if has_expert and int(s) else (True,))]
    print(f"{ARGS.config} mesh {ARGS.mesh} dtype {ARGS.dtype} on {jax.device_count()} {jax.default_backend()} devices")
    print(f"{'stage':>5} {'epso':>5} | {'params':>9} {'optim':>9} {'temp':>9} | {'step ms':>8} {'xla':>8} {'ratio':>6}"
          f" | {'update ms':>9} {'xla':>8} {'ratio':>6} | {'bytes':>9} {'xla':>9}")
    for r in rows:
        p, o, x = r["memory"]["predicted"], r["gshard"], r["xla"]
        print(f"{r['stage']:>5} {str(r['epso']):>5} | {_fmt_bytes(p['params']):>9} {_fmt_bytes(p['optimizer']):>9} "
              f"{_fmt_bytes(o['temp']):>9} | {o['step_ms']:>8.2f} {x['step_ms']:>8.2f} "
              f"{o['step_ms'] / x['step_ms']:>6.2f}"
              f" | {o['update_ms']:>9.2f} {x['update_ms']:>8.2f} {o['update_ms'] / x['update_ms']:>6.2f} | "
              f"{_fmt_bytes(o['bytes']):>9} {_fmt_bytes(x['bytes']):>9}")
    for r in rows:
        print(f"stage {r['stage']} epso {r['epso']}: ours {r['gshard']['collectives']}; xla {r['xla']['collectives']}")
    plain = {r["stage"]: r for r in rows if not r["epso"]}
    for r in rows:
        if r["epso"] and r["stage"] in plain:
            q = plain[r["stage"]]["gshard"]
            print(f"EPSO against the plain sharded optimizer, stage {r['stage']}: optimizer step "
                  f"{q['update_ms'] / r['gshard']['update_ms']:.2f}x faster, whole step "
                  f"{q['step_ms'] / r['gshard']['step_ms']:.2f}x")


if __name__ == "__main__":
    main()
