"""explain(trace_per_device=False): the report of Lowering.cost() (no per-device program traced) equals the
report of the traced lowering, row for row, on programs with the lowering's every path: halo exchanges
whose pieces later ops reuse, identity annotations, loops, branches, checkpoints, manual regions, pipelines,
a Flax + optax step and the trainer's MoE train step."""
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import gshard_jax as gs
from gshard_jax import configs
from gshard_jax.planner import hardware, predict as PR, space as SP
from helpers import flax_optax_step

F32 = jnp.float32


def _rows(report):
    return [(r.source, r.primitive, r.strategy, r.trips, r.fallback,
             [(c.kind, tuple(c.axes), c.moved, c.note) for c in r.collectives]) for r in report.rows]


def _same(fn, mesh, *args, **kw):
    traced = gs.explain(fn, mesh, *args, **kw)
    walked = gs.explain(fn, mesh, *args, trace_per_device=False, **kw)
    assert _rows(walked) == _rows(traced)
    assert walked.totals() == traced.totals() and walked.argument_bytes() == traced.argument_bytes()
    assert walked.inputs == traced.inputs and walked.outputs == traced.outputs
    return traced


def test_halo_pieces_reused_by_a_later_op():
    """Two convolutions read the same split activation: the second reuses the first's halo pieces."""
    mesh = gs.make_mesh({"data": 2, "x": 4})

    def fn(x, w1, w2):
        x = gs.shard(x, P("data", "x", None, None))
        conv = lambda w: jax.lax.conv_general_dilated(x, w, (1, 1), "SAME",  # noqa: E731
                                                      dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return gs.shard(conv(w1) + conv(w2), P("data", "x", None, None))

    x, w = jax.ShapeDtypeStruct((4, 32, 16, 8), F32), jax.ShapeDtypeStruct((3, 3, 8, 8), F32)
    report = _same(fn, mesh, x, w, w)
    convs = [r for r in report.rows if r.primitive == "conv_general_dilated"]
    assert [len(r.collectives) for r in convs] == [2, 0]  # halo rows from the left and the right, once


def test_an_annotation_holds_its_operands_local_array():
    """gs.shard of a value is the identity on each device: a gather made for the value serves it too."""
    def fn(x):
        return jnp.sort(x, axis=1) + jnp.sort(gs.shard(x, P("data", "x")), axis=1)

    report = _same(fn, gs.make_mesh({"data": 2, "x": 4}), jax.ShapeDtypeStruct((16, 32), F32),
                   in_shardings=P("data", "x"))
    assert [len(r.collectives) for r in report.rows if r.primitive == "sort"] == [1, 0]


def test_loops_branches_checkpoints_and_manual_regions():
    mesh = gs.make_mesh({"data": 4, "x": 2})

    def inner(a):  # a user's shard_map, with the default check_vma=True
        return jax.lax.psum(a, "x")

    def loss(x, w):
        x = gs.shard(x, P("data", "x"))
        body = jax.checkpoint(lambda c, w: jnp.tanh(c @ w))
        c, _ = jax.lax.scan(lambda c, _: (body(c, w), None), x, None, length=3)
        c = jax.lax.cond(jnp.sum(c) > 0, lambda u: u @ w, lambda u: -u, c)
        m = jax.shard_map(inner, mesh=mesh, in_specs=P("data", "x"), out_specs=P("data", None))(c)
        return jnp.sum(m ** 2)

    def fn(x, w):
        g = jax.grad(loss)(x, w)
        return jax.lax.while_loop(lambda t: t[1] < 2, lambda t: (t[0] @ w * 1.5, t[1] + 1), (g, 0))[0]

    x, w = jax.ShapeDtypeStruct((16, 32), F32), jax.ShapeDtypeStruct((32, 32), F32)
    _same(fn, mesh, x, w)


def test_a_flax_optax_step():
    step, args = flax_optax_step(batch=32, features=16, hidden=64, classes=8)
    _same(step, gs.make_mesh({"data": 4, "x": 2}), *args)


@pytest.mark.parametrize("mesh,schedule", [
    ((("stage", 2), ("data", 2), ("x", 2)), "1f1b"),
    ((("data", 2), ("expert", 4)), "none"),  # the default suite's case (8 s); 1F1B's is in slow_cases.txt
])
def test_the_trainers_moe_step(mesh, schedule):
    """The planner's use: tiny MoE LM train steps on an abstract mesh (dropless experts inside 1F1B)."""
    cfg = configs.load("experiments/tiny_moe_lm.py")
    cfg.model.moe.dispatch = "dropless"
    c = SP.Candidate(mesh, zero_stage=1, epso=True, microbatches=4 if schedule != "none" else 1,
                     schedule=schedule, repeats=1, remat="none")
    hw = hardware.get("cpu-simulation")
    traced = PR.explain(cfg, c, hw, trace_per_device=True)
    walked = PR.explain(cfg, c, hw)
    assert _rows(walked) == _rows(traced)
    assert walked.argument_bytes() == traced.argument_bytes()
