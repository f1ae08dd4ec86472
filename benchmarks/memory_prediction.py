"""explain()'s predicted memory per device against the compiled program's memory_analysis(), on 8 simulated CPU
devices: arguments, outputs and the temporaries' peak (partitioner/costs/liveness.py) against argument + output -
alias + temp.

    python benchmarks/memory_prediction.py [--cases MLP,MoE,Block,scanned,tiny_dense_lm,tiny_moe_lm]
"""
from __future__ import annotations

import argparse
import os
import sys

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import gshard_jax as gs  # noqa: E402
from gshard_jax.planner.memory_check import outputs_bytes  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "tests"), os.path.join(ROOT, "examples")]


def measure(fn, mesh, args, donated_outputs=(), **kw) -> tuple:
    """(predicted MiB: arguments, outputs, temporaries; compiled MiB: argument, output - alias, temp)."""
    report = gs.explain(fn, mesh, *args, **kw)
    m = gs.partition(fn, mesh, **kw).lower(*args).compile().memory_analysis()
    pred = (report.argument_bytes()["total"], outputs_bytes(report, set(donated_outputs)), report.temporaries.bytes)
    comp = (m.argument_size_in_bytes, m.output_size_in_bytes - m.alias_size_in_bytes, m.temp_size_in_bytes)
    return pred, comp


def cases():
    from test_auto import MESH2, mlp_args, mlp_step, moe_annotated, moe_args, moe_plain

    mesh2 = gs.make_mesh(MESH2)
    yield "MLP step, Megatron", lambda: measure(mlp_step, mesh2, mlp_args(),
                                                in_shardings=(P("data", None), P(None, "model"), P("model", None)))
    yield "MLP step, auto", lambda: measure(mlp_step, mesh2, mlp_args(), in_shardings=(P("data", None), None, None),
                                            auto=True)
    mesh8 = gs.make_mesh({"expert": 8})
    yield "GShard MoE layer, hand", lambda: measure(moe_annotated, mesh8, moe_args())
    yield "GShard MoE layer, auto", lambda: measure(moe_plain, mesh8, moe_args(), auto=True)
    yield "Block AdamW step, auto", block
    yield "Flax scanned stack AdamW step, auto", lambda: scanned(False)
    yield "Flax scanned stack AdamW step, auto, half that", lambda: scanned(True)
    yield "tiny_dense_lm step {data 8}", lambda: lm("tiny_dense_lm", dict(data=8))
    yield "tiny_moe_lm step {data 2, expert 4}", lambda: lm("tiny_moe_lm", dict(data=2, expert=4))


def block():
    import flax.linen as nn
    import jax.numpy as jnp
    import optax
    from flax_model import Block

    model, opt = Block(), optax.adamw(1e-3)

    def train_step(params, opt_state, x):
        value, grads = jax.value_and_grad(lambda p: jnp.mean(model.apply(p, x) ** 2))(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    x = jax.random.normal(jax.random.key(0), (16, 8, 256))
    params = nn.unbox(model.init(jax.random.key(1), x))
    return measure(train_step, gs.make_mesh({"data": 2, "model": 4}), (params, opt.init(params), x),
                   in_shardings=(None, None, P("data")), auto=True)


def scanned(budgeted: bool):
    """tests/test_auto.py's Flax nn.scan over nn.remat blocks with AdamW, its state uncommitted; budgeted: within
    half the memory the unbudgeted choice predicts."""
    from test_auto import flax_stack

    step, _, params, opt_state, x, mesh = flax_stack()
    args = jax.tree.map(np.asarray, jax.device_get((params, opt_state))) + (x,)
    kw = dict(auto=True)
    if budgeted:
        kw["memory_budget"] = sum(measure(step, mesh, args, auto=True)[0]) / 2
    return measure(step, mesh, args, **kw)


def lm(name: str, mesh: dict):
    """A config's train step under its rules table, the state donated as the trainer donates it."""
    from gshard_jax import configs
    from gshard_jax.training import data, train

    cfg = configs.load(os.path.join(ROOT, "experiments", f"{name}.py"))
    cfg.mesh.update({a: 1 for a in configs.MeshConfig().sizes()})
    cfg.mesh.update(mesh)
    trainer = train.Trainer(cfg, "")
    state = jax.eval_shape(trainer.init_state, jax.random.key(0))
    windows = np.zeros((cfg.train.batch_size, trainer.length), np.int32)
    batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=trainer.batch_sharding)
             for k, v in data.model_batch(cfg.model.kind, windows).items()}
    report = gs.explain(trainer.train_step, trainer.mesh, state, batch, in_shardings=(trainer.state_specs,
                        trainer.batch_spec), out_shardings=trainer.step_outs, trace_per_device=False,
                        donate_argnums=(0,))
    m = trainer.step_fn.lower(state, batch).compile().memory_analysis()
    n_state = len(jax.tree.leaves(state))  # the new state's outputs come first, in the donated buffers
    pred = (report.argument_bytes()["total"], outputs_bytes(report, set(range(n_state))),
            report.temporaries.bytes)
    comp = (m.argument_size_in_bytes, m.output_size_in_bytes - m.alias_size_in_bytes, m.temp_size_in_bytes)
    return pred, comp


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="", help="comma-separated substrings of the case names (default: all)")
    a = p.parse_args()
    want = [w for w in a.cases.split(",") if w]
    mib = lambda b: f"{b / 2**20:.2f}"
    print("| program | predicted: args, outputs, temporaries MiB | compiled: argument, output - alias, temp MiB | "
          "predicted / compiled |")
    print("| --- | ---: | ---: | ---: |")
    for name, run in cases():
        if want and not any(w in name for w in want):
            continue
        pred, comp = run()
        print(f"| {name} | {', '.join(map(mib, pred))} = {mib(sum(pred))} | {', '.join(map(mib, comp))} = "
              f"{mib(sum(comp))} | {sum(pred) / sum(comp):.2f} |", flush=True)
    print(f"jax {jax.__version__}, {len(jax.devices())} x {jax.devices()[0].platform}")


if __name__ == "__main__":
    sys.exit(main())
