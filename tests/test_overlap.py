"""Which compute each collective overlaps (partitioner/costs/overlap.py): the list schedule as data, and explain()'s
exposed time on real programs."""
from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace as Row

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import gshard_jax as gs
from gshard_jax.partitioner.costs import overlap as OV
from gshard_jax.partitioner.costs.hardware import GENERIC

AR = "all-reduce"  # a collective of 1 s (comm_time below)


def _row(prim, compute, reads=(), writes=(), before=(), after=(), trips=1, calls=None):
    cols = list(before) + list(after)
    return Row(primitive=prim, compute_time=compute, reads=reads, writes=writes, collectives=cols,
               issue=len(before), trips=trips, calls=trips if calls is None else calls)


def _run(rows, overlaps=True):
    return OV.analyse(rows, lambda c: 1.0, lambda r: r.compute_time, overlaps)


# (rows, exposed seconds per row with collectives, per step)
CASES = {
    "a result the next op needs is exposed": (
        [_row("dot", 2, (), ("a",), after=[AR]), _row("tanh", 1, ("a",), ("b",))], 1.0),
    "an independent op hides it": (
        [_row("dot", 2, (), ("a",), after=[AR]), _row("dot", 3, (), ("b",)), _row("add", 1, ("a", "b"), ("c",))],
        0.0),
    "an independent op shorter than it hides part": (
        [_row("dot", 2, (), ("a",), after=[AR]), _row("dot", 0.25, (), ("b",)), _row("add", 1, ("a", "b"), ("c",))],
        0.75),
    "a later independent op runs first when the next one waits": (
        [_row("dot", 2, (), ("a",), after=[AR]), _row("transpose", 0.1, ("a",), ("t",)),
         _row("dot", 3, (), ("b",))], 0.0),
    "an operand's gather waits for its producer": (
        [_row("dot", 2, (), ("w",)), _row("dot", 2, ("w",), ("y",), before=[AR])], 1.0),
    "a body's exposure runs every trip": (
        [_row("scan/dot", 2, (), ("a",), after=[AR], trips=4), _row("scan/tanh", 1, ("a",), ("b",), trips=4),
         _row("scan", 0, (), ("c",))], 4.0),
}


@pytest.mark.parametrize("name", CASES)
def test_list_schedule_as_data(name):
    rows, want = CASES[name]
    timing = _run(rows)
    assert OV.exposed_per_step(timing) == pytest.approx(want)
    assert OV.exposed_per_step(_run(rows, overlaps=False)) == pytest.approx(
        sum(len(r.collectives) * r.trips for r in rows))  # one stream: every collective exposed


def test_the_op_behind_a_collective_is_named():
    rows, _ = CASES["an independent op hides it"]
    (first, *_) = _run(rows)
    assert first.behind == 1 and first.hidden_by_it == pytest.approx(1.0)


def test_a_loop_is_a_barrier_and_takes_its_bodys_span():
    """A collective before a loop that nothing in the loop reads is not hidden by the loop (the runtime does not
    schedule across it); the loop row lasts the body's span times its trips."""
    rows = [_row("dot", 1, (), ("a",), after=[AR]),
            _row("scan/dot", 2, (), ("x",), trips=3), _row("scan", 0, (), ("c",)),
            _row("add", 1, ("a", "c"), ("d",))]
    timing = _run(rows)
    assert timing[0].exposed == pytest.approx(1.0)


def test_a_body_of_one_trip_a_call_joins_the_region_around_it():
    """XLA inlines a loop of one trip: the body's collective runs beside compute outside it, and the body's
    ops wait for the operands their inputs stand for (links), not for the region's start."""
    links = ({"x_in": "a"}, {"c": "y_body"})
    body = [_row("scan/dot", 2, ("x_in",), ("y_body",), after=[AR]), _row("scan", 0, ("a",), ("c",))]
    rows = [_row("dot", 1, (), ("a",))] + body + [_row("dot", 3, (), ("b",)), _row("add", 1, ("c", "b"), ("d",))]
    timing = OV.analyse(rows, lambda c: 1.0, lambda r: r.compute_time, True, links, joined=[(1, 2, 1)])
    assert timing[1].exposed == pytest.approx(0.0)  # hidden behind the independent dot
    assert OV.exposed_per_step(timing) == pytest.approx(0.0)
    # not of one trip (two trips a call, or nothing says so): a region of its own
    twice = list(rows)
    twice[1] = _row("scan/dot", 2, ("x_in",), ("y_body",), after=[AR], trips=2)
    assert OV.analyse(twice, lambda c: 1.0, lambda r: r.compute_time, True, links)[1].exposed == pytest.approx(1.0)
    assert OV.analyse(rows, lambda c: 1.0, lambda r: r.compute_time, True, links)[1].exposed == pytest.approx(1.0)


def test_a_joined_body_first_in_a_loop_body_or_holding_a_loop_still_joins():
    """Which bodies run once a call is said by the report, not inferred from the rows around them: a body of
    one trip whose rows open its enclosing loop's body joins it, and so does one that opens with a loop."""
    rows = [_row("scan/scan/dot", 2, (), ("y",), after=[AR], trips=3), _row("scan/scan", 0, (), ("c",), trips=3),
            _row("scan/dot", 3, (), ("b",), trips=3), _row("scan", 0, (), ("d",))]
    timing = OV.analyse(rows, lambda c: 1.0, lambda r: r.compute_time, True, joined=[(0, 1, 2)])
    assert timing[0].exposed == pytest.approx(0.0)  # beside the outer body's independent dot
    nested = [_row("scan/scan/dot", 2, (), ("y",), after=[AR], trips=4), _row("scan", 0, (), ("c",)),
              _row("dot", 3, (), ("b",))]  # a 4-trip loop opening a one-trip body: the loop stays a barrier
    timing = OV.analyse(nested, lambda c: 1.0, lambda r: r.compute_time, True, joined=[(0, 2, 1)])
    assert OV.exposed_per_step(timing) == pytest.approx(4.0)


def test_the_body_waits_for_its_operands_maker():
    """A joined body's op reads its input, which stands for an operand an earlier op makes: it starts after
    that op, so a collective before it is not hidden by the maker."""
    links = ({"x_in": "a"}, {})
    rows = [_row("dot", 3, (), ("a",)), _row("scan/dot", 1, ("x_in",), ("y",), before=[AR]),
            _row("scan", 0, ("a",), ("c",))]
    timing = OV.analyse(rows, lambda c: 1.0, lambda r: r.compute_time, True, links, joined=[(1, 2, 1)])
    assert timing[1].exposed == pytest.approx(1.0)
    unlinked = OV.analyse(rows, lambda c: 1.0, lambda r: r.compute_time, True, joined=[(1, 2, 1)])  # reads nothing
    assert unlinked[1].exposed == pytest.approx(0.0)


@pytest.mark.parametrize("prim,body", [("scan/checkpoint/dot_general", "scan/"), ("ring/dot_general", ""),
                                       ("while.body/scan/add", "while.body/scan/"), ("dot_general", "")])
def test_regions(prim, body):
    assert OV.region(prim) == body


# ------------------------------------------------------------------ explain() on a real program
GPU_LIKE = dataclasses.replace(GENERIC, name="slow-matmul", peak_flops=1e10, overlap=True)


def _megatron_mlp_grad():
    def loss(x, w1, w2):
        return jnp.sum(jnp.tanh(jnp.tanh(x @ w1) @ w2) ** 2)
    r = np.random.default_rng(0)
    args = [jnp.asarray(r.standard_normal(s), jnp.float32) for s in ((64, 256), (256, 1024), (1024, 256))]
    ins = (P("data", None), P(None, "model"), P("model", None))
    return jax.grad(loss, argnums=(0, 1, 2)), args, ins


def test_a_tensor_parallel_input_gradient_all_reduce_overlaps_the_weight_gradient_matmul():
    """Megatron MLP backward on {data 2, model 4}: the all-reduce[model] of dx does not feed dW1 = x' dh, so on
    a profile with asynchronous collectives it runs beside that matmul; explain's JSON names it."""
    fn, args, ins = _megatron_mlp_grad()
    mesh = gs.make_mesh({"data": 2, "model": 4})
    report = gs.explain(fn, mesh, *args, in_shardings=ins, profile=GPU_LIKE)
    rows = json.loads(report.to_json())["rows"]
    tp = [r for r in rows if any(c["kind"] == "all-reduce" and c["axes"] == ["model"] for c in r["collectives"])]
    forward, backward = [r for r in tp if "transpose" not in r["source"]], [r for r in tp if "transpose" in r["source"]]
    assert forward and backward
    for r in forward:  # tanh reads it at once: exposed
        assert r["exposed_comm_time_s"] > 0.5 * r["comm_time_s"]
    for r in backward:  # mostly hidden, behind an op that does not read its result
        assert r["exposed_comm_time_s"] < 0.5 * r["comm_time_s"]
        behind, row = report.rows[r["overlaps"]["row"]], report.rows[rows.index(r)]
        assert behind.compute_time > 0 and not set(behind.reads) & set(row.writes)
    assert report.exposed_comm_time < 0.5 * report.comm_time
    assert json.loads(report.to_json())["predicted_exposed_comm_time_s"] == pytest.approx(report.exposed_comm_time)


def test_on_cpu_devices_every_collective_is_exposed():
    """XLA:CPU runs a collective between ops: the CPU profile says so, and nothing is hidden."""
    fn, args, ins = _megatron_mlp_grad()
    report = gs.explain(fn, gs.make_mesh({"data": 2, "model": 4}), *args, in_shardings=ins)
    assert report.comm_time > 0 and report.exposed_comm_time == pytest.approx(report.comm_time)
    assert "exposed" in str(report)


def test_the_full_table_says_what_hides_each_collective():
    fn, args, ins = _megatron_mlp_grad()
    report = gs.explain(fn, gs.make_mesh({"data": 2, "model": 4}), *args, in_shardings=ins, profile=GPU_LIKE)
    text = report.table()
    assert "exposed" in text and "behind dot_general at" in text
    cpu = gs.explain(fn, gs.make_mesh({"data": 2, "model": 4}), *args, in_shardings=ins).table()
    assert "behind" not in cpu  # the CPU profile hides nothing: no per-row line


def _one_trip_scan(length):
    """A row-parallel matmul (its all-reduce[model]) in a scan of `length` trips, beside an independent matmul."""
    def f(x, w, v):
        def body(c, _):
            return c, jnp.tanh(c @ w)
        _, y = jax.lax.scan(body, x, None, length=length)
        return jnp.sum(y[-1]) + jnp.sum(jnp.tanh(v @ v))
    r = np.random.default_rng(0)
    args = [jnp.asarray(r.standard_normal(s), jnp.float32) for s in ((64, 512), (512, 256), (512, 512))]
    return f, args, (P("data", "model"), P("model", None), P())


def test_a_scan_of_one_trip_is_inlined_and_its_collective_overlaps_the_code_around_it():
    """XLA compiles a scan of one trip without a loop, so its all-reduce may run beside the independent matmul
    after it; with two trips the loop stands between them and the all-reduce is exposed."""
    mesh = gs.make_mesh({"data": 2, "model": 4})
    exposed = {}
    for length in (1, 2):
        f, args, ins = _one_trip_scan(length)
        report = gs.explain(f, mesh, *args, in_shardings=ins, profile=GPU_LIKE)
        rows = [(r, o) for r, o in zip(report.rows, report.overlap())
                if r.primitive.startswith("scan/") and any(c.kind == "all-reduce" for c in r.collectives)]
        assert rows, [r.primitive for r in report.rows]
        exposed[length] = sum(o.exposed for _, o in rows) / sum(o.comm for _, o in rows)
        hlo = gs.partition(f, mesh, in_shardings=ins).lower(*args).compile().as_text()
        assert (" while(" in hlo) == (length > 1)  # the compiled program has a loop only for two trips
    assert exposed[1] < 0.1 and exposed[2] > 0.9, exposed
