"""Gradient reductions per step: accumulation over microbatches and every pipeline schedule, before and after
deferring reductions past loops (partitioner/strategies/deferral.py), against XLA's partitioner in the same run.

Prints per case: all-reduces (and reduce-scatters) one step executes and their payload bytes per device, from
explain() with deferral off ("before") and on ("after"), and XLA's, from its compiled HLO (a loop's
collectives times its trip count). Run:

    python benchmarks/step_reductions.py [--config experiments/tiny_dense_lm.py] [--devices 8] [--no-xla]
"""
from __future__ import annotations

import argparse


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="experiments/tiny_dense_lm.py")
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices (ignored on accelerators)")
    p.add_argument("--batch", type=int, default=32, help="train.batch_size")
    p.add_argument("--no-xla", action="store_true", help="skip compiling XLA's programs")
    return p.parse_args(argv)


ARGS = parse_args()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", ARGS.devices)

import gshard_jax as gs  # noqa: E402
from gshard_jax import configs  # noqa: E402
from gshard_jax.partitioner.strategies import deferral  # noqa: E402
from gshard_jax.training import train  # noqa: E402

# (name, mesh, train overrides, pipeline overrides, layers multiple)
CASES = [
    ("data, microbatches=1", dict(data=8), dict(microbatches=1), {}, 1),
    ("data, microbatches=4", dict(data=8), dict(microbatches=4), {}, 1),
    ("stage x data, gpipe m8", dict(stage=4, data=2), dict(microbatches=8), dict(schedule="gpipe"), 1),
    ("stage x data, 1f1b m8", dict(stage=4, data=2), dict(microbatches=8), dict(schedule="1f1b"), 1),
    ("stage x data, circular m8 r2", dict(stage=4, data=2), dict(microbatches=8),
     dict(schedule="circular", repeats=2), 2),
    ("stage x data, interleaved_1f1b m8 r2", dict(stage=4, data=2), dict(microbatches=8),
     dict(schedule="interleaved_1f1b", repeats=2), 2),
]


def trainer(mesh: dict, train_kw: dict, pipe: dict, layers: int) -> train.Trainer:
    cfg = configs.load(ARGS.config)
    cfg.mesh.update({**{a: 1 for a in configs.MeshConfig().sizes()}, **mesh})
    cfg.pipeline.update(pipe)
    cfg.model.num_layers = cfg.model.num_layers * layers
    cfg.train.update(dict(batch_size=ARGS.batch, **train_kw))
    return train.Trainer(cfg, "/nonexistent")


def reductions(totals: dict) -> tuple[int, int]:
    kinds = ("all-reduce", "reduce-scatter")
    return sum(totals[k]["count"] for k in kinds), sum(totals[k]["payload_bytes"] for k in kinds)


def main() -> None:
    print(f"{ARGS.config} on {ARGS.devices} devices, batch {ARGS.batch}: gradient reductions per step "
          f"(all-reduce + reduce-scatter count, payload bytes per device)")
    print(f"{'case':38} {'before':>20} {'after':>20} {'xla':>20} {'after/before':>12} {'after/xla':>9}")
    for name, mesh, train_kw, pipe, layers in CASES:
        t = trainer(mesh, train_kw, pipe, layers)
        state = jax.eval_shape(t.init_state, jax.random.key(0))
        batch = {k: jax.ShapeDtypeStruct((ARGS.batch, t.cfg.train.seq_len), "int32") for k in ("inputs", "targets")}
        kw = dict(in_shardings=(t.state_specs, t.batch_spec), out_shardings=t.step_outs, trace_per_device=False)
        with deferral.disabled():
            before = reductions(gs.explain(t.train_step, t.mesh, state, batch, **kw).totals(dynamic=True))
        after = reductions(gs.explain(t.train_step, t.mesh, state, batch, **kw).totals(dynamic=True))
        xla = (0, 0)
        if not ARGS.no_xla:
            compiled = t.partitioned("train", "xla").lower(state, batch).compile()
            xla = reductions(gs.collective_stats(compiled, per_step=True))
        cell = lambda c: f"{c[0]:>5} {c[1]:>14,}"
        ratio = f"{after[1] / xla[1]:9.2f}" if xla[1] else f"{'-':>9}"
        print(f"{name:38} {cell(before)} {cell(after)} {cell(xla)} {after[1] / before[1]:12.2f} {ratio}")


if __name__ == "__main__":
    main()
