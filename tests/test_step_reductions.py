"""The trainer's steps reduce their gradients once per step (partitioner/strategies/deferral.py): per-step
figures of the microbatch scan and of every pipeline schedule, from explain() and from the compiled HLO."""
from __future__ import annotations

import jax
import pytest
from test_sharded_state import assert_same_run, batches, make, run

import gshard_jax as gs
from helpers import assert_per_step_matches_hlo

SCALAR = 8  # bytes: a per-microbatch loss or metric reduced where it is made


def _report(trainer) -> gs.Report:
    state = jax.eval_shape(trainer.init_state, jax.random.key(0))
    return gs.explain(trainer.train_step, trainer.mesh, state, batches(trainer, 1)[0],
                      in_shardings=(trainer.state_specs, trainer.batch_spec), out_shardings=trainer.step_outs,
                      trace_per_device=False)


def _leaves(tree) -> list:
    return [(jax.tree_util.keystr(k), x) for k, x in jax.tree_util.tree_leaves_with_path(tree)]


def _in_loops(report) -> list:
    """(row, collective) pairs that run more than once per step and reduce more than a scalar over `data` (a
    gradient's reduction; a tensor-parallel layer's activations are reduced over its own axes, per microbatch)."""
    return [(r.source, str(c)) for r in report.rows if r.trips > 1 for c in r.collectives
            if c.kind in ("all-reduce", "reduce-scatter") and c.payload > SCALAR and "data" in c.axes]


@pytest.mark.newest_jax
def test_accumulating_microbatches_moves_the_one_batch_steps_bytes():
    """{data 2, y 4}, dense: microbatches=4 reduces each gradient once, after the scan; per step it moves the
    one-batch step's bytes (the tensor-parallel all-reduces of each microbatch's activations add up to the
    batch's) plus the per-microbatch scalars (loss and metrics), and the compiled program agrees."""
    mesh = dict(data=2, y=4)
    one, four = make(mesh, dense=True), make(mesh, dense=True, microbatches=4)
    a, b = _report(one).totals(dynamic=True), _report(four)
    assert not _in_loops(b), _in_loops(b)
    b_totals = b.totals(dynamic=True)
    extra = b_totals["all-reduce"]["count"] - a["all-reduce"]["count"]
    assert 0 <= b_totals["all-reduce"]["payload_bytes"] - a["all-reduce"]["payload_bytes"] <= SCALAR * extra
    assert all(b_totals[k]["payload_bytes"] == a[k]["payload_bytes"] for k in a if k != "all-reduce")
    assert any("deferred past the loop" in r.strategy for r in b.rows)
    state = jax.eval_shape(four.init_state, jax.random.key(0))
    compiled = four.step_fn.lower(state, batches(four, 1)[0]).compile()
    report = gs.explain(four.train_step, four.mesh, state, batches(four, 1)[0],
                        in_shardings=(four.state_specs, four.batch_spec), out_shardings=four.step_outs)
    assert_per_step_matches_hlo(report, compiled)


SCHEDULES = [("1f1b", 1), ("gpipe", 1), ("circular", 2), ("interleaved_1f1b", 2)]


@pytest.mark.parametrize("schedule,repeats", SCHEDULES)
def test_every_pipeline_schedule_reduces_its_weight_gradients_once(schedule, repeats):
    """{stage 4, data 2}, 8 microbatches: no weight gradient is reduced inside the tick loops; the loops keep
    them partial over `data` and the step reduces each once."""
    trainer = make(dict(stage=4, data=2), dense=True, microbatches=8, model={"num_layers": 4 * repeats},
                   pipeline={"schedule": schedule, "repeats": repeats})
    report = _report(trainer)
    assert not _in_loops(report), _in_loops(report)
    assert any("deferred past the loop" in r.strategy for r in report.rows)


@pytest.mark.parametrize("schedule", ["circular", "interleaved_1f1b"])
def test_a_repeated_pipeline_under_zero1_reduces_its_weight_gradients_once(schedule):
    """ZeRO-1 plans the gradients split over `data`; the repeats' chain below their scatter-add (a transpose,
    a mask) still runs on partial sums, aimed at the plan without `data`, with the mask's predicate and zeros
    filled in locally, so the tick loop reduce-scatters nothing and the step reduces each gradient once."""
    trainer = make(dict(stage=4, data=2), dense=True, microbatches=8, model={"num_layers": 8}, zero_stage=1,
                   pipeline={"schedule": schedule, "repeats": 2})
    report = _report(trainer)
    assert not _in_loops(report), _in_loops(report)
    assert any("deferred past the loop" in r.strategy for r in report.rows)
    state = jax.eval_shape(trainer.init_state, jax.random.key(0))
    assert_per_step_matches_hlo(report, trainer.step_fn.lower(state, batches(trainer, 1)[0]).compile())


@pytest.mark.parametrize("schedule,zero", [("circular", 0), pytest.param("interleaved_1f1b", 0, marks=pytest.mark.slow),
                                           pytest.param("interleaved_1f1b", 1, marks=pytest.mark.slow)])
def test_a_repeated_pipelines_deferred_step_equals_the_unpartitioned_step(schedule, zero):
    """The repeats' gradients kept partial through their scatter-add (deferral's `Loose` chain): one step's
    loss and new state equal jax.jit's of the unpartitioned step."""
    trainer = make(dict(stage=4, data=2), dense=True, microbatches=8, model={"num_layers": 8}, zero_stage=zero,
                   pipeline={"schedule": schedule, "repeats": 2})
    data = batches(trainer, 1)
    assert_same_run(run(trainer, data=data), run(trainer, partitioned=False, data=data), 1e-5, atol=1e-6)


@pytest.mark.parametrize("remat", ["dots", "full"])
def test_accumulation_under_remat_reduces_once(remat):
    """model.remat: the weight gradients are made in the checkpointed layers' recomputed backward; the
    microbatch scan still keeps them partial and reduces each once per step."""
    report = _report(make(dict(data=2, y=4), dense=True, microbatches=4, model={"remat": remat}))
    assert not _in_loops(report), _in_loops(report)
    assert any("deferred past the loop" in r.strategy for r in report.rows)


@pytest.mark.parametrize("zero,schedule", [(0, None), pytest.param(1, None, marks=pytest.mark.slow),
                                           pytest.param(0, "1f1b", marks=pytest.mark.slow)])
def test_dropless_expert_gradients_are_reduced_once_per_step(zero, schedule):
    """The dropless layer's expert weights enter its manual region as one copy per token shard, so their
    gradients leave it partial over `data`: the microbatch scan (or the pipeline's tick loop) keeps them so and
    the step reduces them once, by reduce-scatter under ZeRO-1 (EPSO's layout), like every other gradient;
    the compiled program agrees and the step equals the unpartitioned one."""
    mesh = dict(data=2, expert=4) if schedule is None else dict(stage=2, data=2, expert=2)
    kw = {} if schedule is None else dict(pipeline={"schedule": schedule})
    trainer = make(mesh, microbatches=2, zero_stage=zero, model={"moe": {"dispatch": "dropless"}}, **kw)
    report = _report(trainer)
    assert not _in_loops(report), _in_loops(report)
    # the expert-split weights' gradients (wi_gate, wi_up and wo of 2 layers: 3 stacked, or 6), once each
    experts = [c for r in report.rows if r.trips == 1 for c in r.collectives
               if tuple(c.axes) == ("data",) and c.kind in ("all-reduce", "reduce-scatter")]
    assert len(experts) == (6 if schedule is None else 3)
    assert {c.kind for c in experts} == ({"all-reduce"} if zero == 0 else {"reduce-scatter"})
    per_device = sum(x.size for k, x in _leaves(trainer.param_shapes) if "moe" in k and "router" not in k) // 4
    assert sum(c.payload for c in experts) == 4 * per_device  # float32, over expert 4 (or stage 2 x expert 2)
    state = jax.eval_shape(trainer.init_state, jax.random.key(0))
    assert_per_step_matches_hlo(report, trainer.step_fn.lower(state, batches(trainer, 1)[0]).compile())
    data = batches(trainer, 1)
    assert_same_run(run(trainer, data=data), run(trainer, partitioned=False, data=data), 1e-5, atol=1e-6)
