"""Each compiler's habits as one table (partitioner/costs/compilers.py), read by the planner's formula, explain()'s
temporaries and the collectives' bytes on the wire: a row changed is what each of them then counts."""
import dataclasses

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh, AxisType, PartitionSpec as P

import gshard_jax as gs
from gshard_jax import configs
from gshard_jax.partitioner.costs import compilers, cost
from gshard_jax.partitioner.costs.hardware import default_for
from gshard_jax.planner import estimate as E, space as SP


def test_the_table_has_a_row_per_compiler_and_says_what_it_knows():
    assert set(compilers.HABITS) == {"cpu", "tpu", "gpu", ""}
    assert compilers.of("cpu").widened == {"bfloat16": "float32"} and compilers.of("cpu").relays_operands
    for p in ("tpu", "gpu", ""):
        h = compilers.of(p)
        assert h.widened == {} and not h.relays_operands and h.tuple_slot == 0 and h.remat_unrolled
    assert compilers.of("cpu").bytes_of("bfloat16", 2) == 4 and compilers.of("tpu").bytes_of("bfloat16", 2) == 2
    with pytest.raises(ValueError, match=r"platform='npu': expected one of \['', 'cpu', 'gpu', 'tpu'\]"):
        compilers.of("npu")


def _shape(platform):
    cfg = configs.load("experiments/tiny_dense_lm.py")
    cfg.model.dtype = "bfloat16"
    return SP.model_shape(cfg, platform)


def test_the_formula_reads_the_platforms_row(monkeypatch):
    """The ModelShape carries its platform; the formula's activations follow that row's coefficients, and only
    that row's."""
    shape, c = _shape("tpu"), SP.Candidate((("data", 8),), remat="dots")
    assert shape.platform == "tpu" and shape.activation_bytes == 2 and _shape("cpu").activation_bytes == 4
    before = E.memory(shape, c)
    tpu = compilers.HABITS["tpu"]
    doubled = {w: (2 * d, 2 * f) for w, (d, f) in tpu.dots_values.items()}
    monkeypatch.setitem(compilers.HABITS, "tpu", dataclasses.replace(tpu, dots_values=doubled))
    after = E.memory(shape, c)
    assert after["activations"] == pytest.approx(2 * before["activations"]) and after["params"] == before["params"]
    assert E.memory(_shape("gpu"), c) == E.memory(_shape("gpu"), c)  # another row: untouched
    monkeypatch.setitem(compilers.HABITS, "tpu", dataclasses.replace(tpu, remat_unrolled=False))
    assert E.memory(shape, c)["activations"] == E.memory(shape, dataclasses.replace(c, remat="none"))["activations"]


def test_explain_holds_and_sends_bf16_as_the_platforms_compiler_does():
    """One bf16 program on an abstract mesh: XLA:CPU's row holds its values and sends its collectives as
    float32, XLA:TPU's as they are."""
    mesh = AbstractMesh((8,), ("data",), axis_types=(AxisType.Auto,))
    x = jax.ShapeDtypeStruct((64, 256), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((256, 256), jnp.bfloat16)

    def f(x, w):
        return jnp.tanh(x @ w) @ w, jnp.max(x, axis=0)  # a bf16 value between the dots; an all-reduce of bf16

    def report(platform):
        return gs.explain(f, mesh, x, w, in_shardings=(P("data"), P()), profile=default_for(platform))

    cpu, tpu = report("cpu"), report("tpu")
    assert cpu.temporaries.bytes >= 2 * tpu.temporaries.bytes > 0
    (sent_cpu,), (sent_tpu,) = cpu.collectives, tpu.collectives
    assert sent_tpu.dtype == "bfloat16" and sent_cpu.dtype == "float32" and sent_cpu.payload == 2 * sent_tpu.payload
    assert cost.on_the_wire(sent_tpu, "gpu") == sent_tpu
