"""Megatron's sequence parallelism from the rules table alone (models/sharding.py SEQUENCE_PARALLEL): the
residual stream split along its positions over y between tensor-parallel layers, its all-reduces turned into
all-gathers and reduce-scatters by the partitioner, and the planner's twins (planner/search.py)."""
from __future__ import annotations

import pytest
from test_sharded_state import assert_same_run, batches, make, run
from test_step_reductions import _report

from gshard_jax.models.logical import DEFAULT_RULES, mesh_spec, sequence_parallel
from gshard_jax.planner import search, space


def _over_y(report) -> dict:
    """Bytes moved per step over y alone, by collective kind."""
    out: dict = {}
    for r in report.rows:
        for c in r.collectives:
            if tuple(c.axes) == ("y",):
                out[c.kind] = out.get(c.kind, 0) + c.moved * r.trips
    return out


def test_the_table_maps_the_residual_streams_positions_to_y():
    assert mesh_spec(("batch", "seq", "embed"), DEFAULT_RULES, ("data", "y")) == ("data", None, None)
    assert mesh_spec(("batch", "seq", "embed"), sequence_parallel(DEFAULT_RULES), ("data", "y")) == \
        ("data", "y", None)
    # attention inside a layer is untouched: its heads keep y
    assert mesh_spec(("batch", "length", "heads", "kv"), sequence_parallel(DEFAULT_RULES), ("data", "y")) == \
        ("data", None, "y", None)
    older = tuple(e for e in DEFAULT_RULES if e[0] != "seq")  # a table written without `seq`: length's entry
    assert mesh_spec(("batch", "seq"), older, ("data", "y")) == ("data", None)


def test_all_reduces_become_gathers_and_scatters_and_the_step_equals_the_unpartitioned_one():
    """{data 2, y 4}: no activation all-reduce over y is left (what remains are the norms' weight gradients,
    summed over the split positions); the step's loss and new state equal jax.jit's."""
    plain = _over_y(_report(make(dict(data=2, y=4), dense=True)))
    trainer = make(dict(data=2, y=4), dense=True, model={"sequence_parallel": True})
    split = _over_y(_report(trainer))
    assert set(plain) == {"all-reduce"} and split["all-gather"] > 0 and split["reduce-scatter"] > 0
    assert split["all-reduce"] < 0.01 * plain["all-reduce"]
    assert sum(split.values()) <= 1.1 * sum(plain.values())  # docs/models.md: 1.10x on this model
    data = batches(trainer, 1)
    assert_same_run(run(trainer, data=data), run(trainer, partitioned=False, data=data), 1e-5, atol=1e-6)


def test_a_pipelines_permutes_carry_the_split_stream():
    """{stage 2, y 2, data 2}, 1F1B: the state passed between stages is split over y too, half the bytes."""
    def permuted(sp):
        r = _report(make(dict(stage=2, y=2, data=2), dense=True, microbatches=4,
                         model={"num_layers": 4, "sequence_parallel": sp}, pipeline={"schedule": "1f1b"}))
        return sum(c.payload * row.trips for row in r.rows for c in row.collectives
                   if c.kind == "collective-permute" and tuple(c.axes) == ("stage",))
    assert permuted(True) * 2 == permuted(False)


@pytest.mark.slow
def test_an_interleaved_pipeline_under_zero1_with_sequence_parallelism_equals_the_unpartitioned_step():
    trainer = make(dict(stage=2, y=2, data=2), dense=True, microbatches=4,
                   model={"num_layers": 4, "sequence_parallel": True},
                   pipeline={"schedule": "interleaved_1f1b", "repeats": 2}, zero_stage=1)
    data = batches(trainer, 1)
    assert_same_run(run(trainer, data=data), run(trainer, partitioned=False, data=data), 1e-5, atol=1e-6)


def test_the_planner_plans_a_sequence_parallel_twin_where_there_is_a_tensor_axis():
    base = space.Candidate((("data", 2), ("y", 4)), zero_stage=1, microbatches=2)
    assert [t.sequence_parallel for t in search.twins(base)] == [False, True]
    assert search.twins(space.Candidate((("data", 8),))) == [space.Candidate((("data", 8),))]
    twin = search.twins(base)[1]
    assert twin.key.endswith(" sp") and "--config.model.sequence_parallel=True" in twin.overrides()
    assert twin.to_dict()["sequence_parallel"] is True


def test_the_circular_schedules_try_every_repeats_that_divides_a_stages_layers():
    """GPT-80B's 42 layers on 2 stages: 21 per stage, so repeats 3 and 7 (neither a power of two)."""
    from gshard_jax import configs
    shape = space.model_shape(configs.load("experiments/gpt_80b.py"))
    sizes = dict.fromkeys(space.AXES, 1) | {"stage": 2, "data": 2048}
    tried = {(sched, r) for (m, sched, r), reason, _ in space.option_groups(shape, sizes) if reason is None}
    assert {r for s, r in tried if s == "interleaved_1f1b"} == {3, 7}
