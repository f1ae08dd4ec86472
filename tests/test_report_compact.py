"""The compact report stays a screen: a 2-layer LM AdamW train step (63 inputs, 62 outputs, 872 rows)."""
import collections
import json

import jax
import pytest

from gshard_jax.models import lm
from helpers import gs


@pytest.fixture(scope="module")
def report():
    cfg = lm.LMConfig(layers=2)
    params = lm.init_params(jax.random.key(0), cfg)
    args = (params, lm.optimizer(cfg).init(params), lm.make_batch(jax.random.key(1), 16, cfg))
    step = lambda p, s, b: lm.train_step(p, s, b, cfg, lm.Layout("data", "model"))[:3]
    return gs.explain(step, gs.make_mesh({"data": 2, "model": 4}), *args)


def test_compact_view_is_a_screen(report):
    compact = str(report)
    assert len(report.inputs) > 50 and len(report.outputs) > 50
    assert len(compact.splitlines()) < 60
    assert max(len(line) for line in compact.splitlines()) <= 100
    assert len(report.table().splitlines()) > 5 * len(compact.splitlines())  # the full view has every row


def test_compact_view_names_every_row_that_communicates(report):
    compact = str(report)
    shown = [r for r in report.rows if r.collectives or r.fallback]
    assert len(shown) > 10  # enough to be grouped
    for r in shown:
        assert f" {r.index}" in compact and r.source in compact
        for c in r.collectives:
            assert str(c) in compact
    assert f"{len(shown)} of {len(report.rows)} rows communicate" in compact


def test_input_and_output_summaries_count_what_the_plan_says(report):
    compact = str(report)
    for what, values in (("inputs", report.inputs), ("outputs", report.outputs)):
        split = collections.Counter("*".join(dict.fromkeys(a for d in v.planned.dims for a in d))
                                    for v in values if v.planned.axes)
        replicated = sum(1 for v in values if not v.planned.axes)
        line = next(line for line in compact.replace("\n      ", " ").splitlines() if f"{what}: " in line)
        assert f"{what}: {len(values)}: " in line
        for axes, n in split.items():
            assert f"{n} split over {axes}" in line
        assert f"{replicated} replicated (no annotation or sharded neighbour reached it)" in line
    # The full provenance stays in table() and to_json().
    data = json.loads(report.to_json())
    assert len(data["inputs"]) == len(report.inputs) and all(v["origin"] for v in data["inputs"])
    assert all(f"input  {v.name}:" in report.table() for v in report.inputs)


def test_few_values_and_rows_are_listed_one_by_one():
    mesh = gs.make_mesh({"x": 8})

    def f(a, b):
        return gs.shard(gs.shard(a, ("x", None)) @ b, (None, "x"))
    compact = str(gs.explain(f, mesh, jax.ShapeDtypeStruct((64, 32), "float32"),
                             jax.ShapeDtypeStruct((32, 64), "float32")))
    assert "  input  a: float32[64, 32] [x, -]" in compact and "  output out:" in compact
    assert "dot_general ab,bc->ac" in compact  # a communicating row in full, with its strategy
