"""The optimizer state in host memory (train.offload_optimizer): AdamW's moments, and bf16's float32 master
weights, live in pinned_host memory between steps and stream through the device in the step. On 8 simulated
CPU devices (XLA:CPU has a pinned_host memory too)."""
import inspect
import re
import types

import jax
import numpy as np
import pytest
from test_sharded_state import batches, make

from gshard_jax.training import train

ITEMSIZE = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s8": 1, "u8": 1, "pred": 1}


def host_param_bytes(compiled) -> int:
    """Bytes per device of the compiled program's parameters in host memory: those whose layout says S(5)."""
    layout = re.search(r"entry_computation_layout=\{\((.*?)\)->", compiled.as_text())[1]
    return sum(int(np.prod([int(d) for d in dims.split(",") if d])) * ITEMSIZE[dtype]
               for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]\{[^}]*S\(5\)", layout))


def kinds(state) -> set:
    return {x.sharding.memory_kind for x in jax.tree.leaves(state)}


@pytest.mark.parametrize("zero_stage", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_offloaded_state_lives_in_host_memory_and_trains_to_the_same_losses(zero_stage):
    base, off = make("d2e4", zero_stage=zero_stage), make("d2e4", zero_stage=zero_stage, offload_optimizer=True)
    data = batches(base, 3)
    got = {}
    for name, t in (("base", base), ("off", off)):
        state = t.init_fn(jax.random.key(0))
        losses = []
        for b in data:
            state, m = t.step_fn(state, jax.device_put(b, t.batch_sharding))
            losses.append(float(m["loss"]))
        got[name] = (losses, state)
    (want, base_state), (losses, state) = got["base"], got["off"]
    assert losses == pytest.approx(want, rel=1e-6)
    assert kinds(state["opt_state"]) == {"pinned_host"} and kinds(state["params"]) == {"device"}
    assert kinds(base_state["opt_state"]) == {"device"}
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(base_state)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.slow)])
def test_the_device_argument_bytes_drop_by_the_optimizers_share(dtype):
    """explain()'s memory: the optimizer state (with bf16's float32 master weights) moves from the device's
    arguments to the host's; the compiled program's host-memory parameters (layout S(5)) hold exactly what
    the report predicts there."""
    reports = {}
    for offload in (False, True):
        t = make("d8", dense=True, zero_stage=1, offload_optimizer=offload, dtype=dtype)
        state = t.init_fn(jax.random.key(0))
        batch = jax.device_put(batches(t, 1)[0], t.batch_sharding)
        reports[offload] = (t.explain(state, batch), t.step_fn.lower(state, batch).compile())
    (r0, _), (r1, compiled) = reports[False], reports[True]
    opt = r0.memory["predicted"]["optimizer"]
    params = sum(x.size for x in jax.tree.leaves(t.param_shapes))
    per_param = 12 if dtype == "bfloat16" else 8  # float32 master weights and two moments, or the moments
    assert opt == pytest.approx(per_param * params / 8, rel=1e-3)  # ZeRO-1 over data 8
    assert opt > 0 and "optimizer" not in r1.memory["predicted"]
    assert r1.memory["predicted"]["total"] == r0.memory["predicted"]["total"] - opt
    assert r1.memory["predicted_host"] == {"optimizer": opt, "total": opt}
    assert host_param_bytes(compiled) == opt
    # XLA:CPU's memory is host memory: its memory_analysis counts the pinned_host arguments with the rest.
    assert r1.memory["compiled"]["argument"] == r1.memory["predicted"]["total"] + opt
    assert "in host memory optimizer" in " ".join(str(r1).split())  # the memory line, unwrapped
    assert '"predicted_host"' in r1.to_json()
    # the step streams the whole optimizer state through the device: in at its start, out at its end
    assert r0.host_transfers() == {"to_host": 0, "to_device": 0}
    assert r1.host_transfers() == {"to_host": opt, "to_device": opt}
    assert "host transfers: to host" in str(r1) and '"host_transfers_per_step"' in r1.to_json()


def test_xlas_partitioner_runs_the_offloaded_step_too():
    t = make("d8", offload_optimizer=True)
    state = t.init_fn(jax.random.key(0))
    b = jax.device_put(batches(t, 1)[0], t.batch_sharding)
    xla = t.partitioned("train", backend="xla")
    new, m = xla(state, b)
    ours, m2 = t.step_fn(state, b)
    assert float(m["loss"]) == pytest.approx(float(m2["loss"]), rel=1e-6)
    assert kinds(new["opt_state"]) == {"pinned_host"}


def test_a_backend_without_host_memory_says_so():
    memories = [types.SimpleNamespace(kind="device")]
    device = types.SimpleNamespace(platform="tpu", id=0, addressable_memories=lambda: memories)
    mesh = types.SimpleNamespace(devices=np.array([device], dtype=object))
    with pytest.raises(ValueError, match=r"'pinned_host' memory, but tpu device 0 has only \['device'\]"):
        train.check_host_memory(mesh)
    train.check_host_memory(jax.make_mesh((8,), ("data",)))  # XLA:CPU has one


def on_host(fn, *args):
    """fn(*args) under jax.experimental.compute_on("device_host"): a context on JAX 0.10, a transformation
    (results in host memory) from 0.11."""
    from jax.experimental.compute_on import compute_on
    if "out_memory_spaces" in inspect.signature(compute_on).parameters:
        return compute_on(compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)(fn)(*args)
    with compute_on("device_host"):
        return fn(*args)


@pytest.mark.newest_jax  # compute_on changed form in JAX 0.11
def test_ops_under_compute_on_host_stay_on_the_host_and_moves_are_counted():
    """jax.experimental.compute_on("device_host"): the partitioned program computes those ops on the host
    too (their local ops carry XLA's host compute type), and explain() counts the bytes moved each way."""
    from jax.sharding import PartitionSpec as P

    import gshard_jax as gs

    def f(m, g):
        m_host, g_host = jax.device_put((m, g * 2), jax.memory.Space.Host)
        y = on_host(lambda a, b: a * 0.9 + b, m_host, g_host)
        return jax.device_put(y, jax.memory.Space.Device)

    mesh = gs.make_mesh({"data": 8})
    x = np.arange(64, dtype=np.float32).reshape(16, 4)
    ins = (P("data"), P("data"))
    part = gs.partition(f, mesh, in_shardings=ins, out_shardings=P("data"))
    np.testing.assert_allclose(part(x, x), jax.jit(f)(x, x))
    host_ops = [line for line in part.lower(x, x).as_text().splitlines() if '_xla_compute_type = "host"' in line]
    assert any("multiply" in line for line in host_ops) and any("add" in line for line in host_ops)
    report = gs.explain(f, mesh, x, x, in_shardings=ins, out_shardings=P("data"))
    local = 2 * 4 * 4  # a [2, 4] float32 shard
    assert report.host_transfers() == {"to_host": 2 * local, "to_device": local}
