"""The automatic sharding of a whole train step (mesh.auto) against the models' rules table and against the
planner's pick, on the same mesh of 8 simulated CPU devices: per step, bytes moved per device, predicted
communication, compute and step time (the generic CPU profile: no overlap), the state's and batch's bytes per
device, and how long the state's choice took.

    python benchmarks/auto_training.py [--configs tiny_moe_lm,tiny_dense_lm] [--layers N] [--scan] [--temps]

Rows per config and mesh:
- the rules table, as the config writes it (ZeRO stage 0);
- the planner's pick on the same mesh (`gshard-jax plan`'s search over ZeRO stage, EPSO, remat, microbatches
  and sequence parallelism with the rules table, planned by the partitioner), costed by the same explain();
- mesh.auto with no budget, and within the rules table's bytes per device (its state, batch, outputs and
  temporaries at their peak, as explain() predicts them).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402

import gshard_jax as gs  # noqa: E402
from gshard_jax import configs  # noqa: E402
from gshard_jax.partitioner.costs import hardware  # noqa: E402
from gshard_jax.planner import predict, search  # noqa: E402
from gshard_jax.training import data, train  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = {  # config -> the meshes it is compared on (its own first)
    "tiny_moe_lm": [dict(data=2, expert=4)],
    "tiny_dense_lm": [dict(data=8), dict(data=2, y=4)],
}


def load(name: str, mesh: dict):
    cfg = configs.load(os.path.join(ROOT, "experiments", f"{name}.py"))
    cfg.mesh.update({a: 1 for a in configs.MeshConfig().sizes()})
    cfg.mesh.update(mesh)
    return cfg


def explain(cfg, temps: bool = False) -> tuple:
    """(the train step's report on the generic CPU profile, seconds the state's choice took or 0, and with
    temps the compiled step's temporaries in bytes per device, from memory_analysis())."""
    start = time.perf_counter()
    trainer = train.Trainer(cfg, "")
    took = time.perf_counter() - start if trainer.auto else 0.0
    state = jax.eval_shape(trainer.init_state, jax.random.key(0))
    windows = np.zeros((cfg.train.batch_size, trainer.length), np.int32)
    batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in data.model_batch(cfg.model.kind, windows).items()}
    report = gs.explain(trainer.train_step, trainer.mesh, state, batch, in_shardings=(trainer.state_specs,
                        trainer.batch_spec), out_shardings=trainer.step_outs, auto=trainer.auto,
                        memory_budget=(cfg.mesh.memory_budget or None) if trainer.auto else None,
                        donate_argnums=0, trace_per_device=False)
    if not temps:
        return report, took, None
    placed = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=trainer.batch_sharding) for k, v in batch.items()}
    return report, took, trainer.step_fn.lower(state, placed).compile().memory_analysis().temp_size_in_bytes


def row(name: str, mesh: dict, plan: str, report, took: float = 0.0, temp=None) -> str:
    moved = sum(t["moved_bytes"] for t in report.totals(dynamic=True).values())
    step = report.comm_time + report.compute_time
    return (f"| {name} | {' '.join(f'{a} {n}' for a, n in mesh.items())} | {plan} | {moved / 2**20:.2f} | "
            f"{report.comm_time * 1e3:.3f} | {report.compute_time * 1e3:.3f} | {step * 1e3:.3f} | "
            f"{report.argument_bytes()['total'] / 2**20:.1f} | " + (f"{took:.1f} |" if took else "- |")
            + f" {report.temporaries.bytes / 2**20:.1f} |" + ("" if temp is None else f" {temp / 2**20:.1f} |"))


def planned(cfg, mesh: dict):
    """The planner's pick on this mesh (its best variant by formula, planned by the partitioner), as a config."""
    p = search.plan(cfg, 8, hardware.GENERIC_CPU, top=1, pin=[mesh])
    full = {a: 1 for a in configs.MeshConfig().sizes() if a != "model"} | mesh
    pick = next(r for sizes, _, r, _ in p.pinned if {a: 1 for a in full} | dict(sizes) == full and r is not None)
    return predict.apply(cfg, pick.candidate), pick.candidate.key


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default=",".join(CASES), help="comma-separated: " + ", ".join(CASES))
    p.add_argument("--layers", type=int, default=0, help="model.num_layers (0: the config's)")
    p.add_argument("--scan", action="store_true", help="model.scan=true: the layers as one scan")
    p.add_argument("--temps", action="store_true", help="compile each step and print its temporaries as "
                   "memory_analysis() counts them, beside explain()'s prediction")
    a = p.parse_args()
    print("| config | mesh | sharding | moved MiB | comm ms | compute ms | step ms | state + batch MiB | "
          "choice s | temporaries MiB, predicted |" + (" temporaries MiB, compiled |" if a.temps else ""))
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |" + (" ---: |" if a.temps else ""))
    for name in a.configs.split(","):
        for mesh in CASES[name]:
            cfg = load(name, mesh)
            if a.layers:
                cfg.model.num_layers = a.layers
            cfg.model.scan = cfg.model.scan or a.scan
            rules, _, temp = explain(cfg, a.temps)
            print(row(name, mesh, "rules table", rules, 0.0, temp), flush=True)
            pick, key = planned(cfg, mesh)
            report, _, temp = explain(pick, a.temps)
            print(row(name, mesh, f"planner's pick ({key})", report, 0.0, temp), flush=True)
            cfg.mesh.auto = True
            print(row(name, mesh, "mesh.auto", *explain(cfg, a.temps)), flush=True)
            shape = dict(rules.mesh)
            metrics = sum(int(np.prod(v.boundary.local_shape(v.shape, shape))) * np.dtype(v.dtype).itemsize
                          for v in rules.outputs if v.name.startswith("out[1]"))  # the state's are donated
            cfg.mesh.memory_budget = float(rules.argument_bytes()["total"] + metrics + rules.temporaries.bytes)
            print(row(name, mesh, "mesh.auto, the rules table's memory", *explain(cfg, a.temps)), flush=True)
    print(f"jax {jax.__version__}, {len(jax.devices())} x {jax.devices()[0].platform}; the generic CPU profile "
          f"(no overlap); step = communication + compute")


if __name__ == "__main__":
    sys.exit(main())
