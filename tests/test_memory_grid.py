"""The planner's memory per device against the compiled train step's memory_analysis() (argument + output -
alias + temp), on benchmarks/memory_grid.py's grid of the seeds' options and on its held-out shapes: within
[0.90, 1.15], never under by more than 10% (planner/memory_model.py)."""
import os
import sys

import pytest

from gshard_jax.planner import memory_check as MC

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import memory_grid as G  # noqa: E402

LOW, HIGH = 0.90, 1.15
QUICK = (0, 12, 18)  # dense unrolled, 1F1B, MoE under dots: the default suite's; the rest are slow


def _cases():
    for i in range(len(G.GRID)):
        yield pytest.param(i, False, id=f"grid{i}", marks=() if i in QUICK else pytest.mark.slow)
    for i in range(len(G.HELD_OUT)):
        yield pytest.param(i, True, id=f"held_out{i}", marks=pytest.mark.slow)


@pytest.mark.parametrize("i,held_out", _cases())
def test_the_planners_memory_is_the_compiled_steps(i, held_out):
    cfg, c = G.case(i, held_out)
    predicted = MC.formula(cfg, c)
    compiled = MC.compiled(cfg, c)
    ratio = predicted["total"] / compiled.total
    assert LOW <= ratio <= HIGH, (c.key, ratio, predicted, compiled)


def test_the_grid_covers_the_seeds_options():
    """Dense and MoE (einsum and dropless), every remat policy, ZeRO 0-3 and EPSO off, microbatches, the three
    schedule families, context parallelism, offload, scanned and unrolled stacks."""
    keys = [G.case(i)[1] for i in range(len(G.GRID))]
    cfgs = [G.case(i)[0] for i in range(len(G.GRID))]
    assert len(keys) >= 24
    assert {c.remat for c in keys} == {"none", "dots", "dots_saveable", "full"}
    assert {c.zero_stage for c in keys} == {0, 1, 2, 3} and any(not c.epso for c in keys)
    assert {c.schedule for c in keys} >= {"none", "gpipe", "1f1b", "interleaved_1f1b"}
    assert any(c.microbatches > 1 and c.schedule == "none" for c in keys)
    assert any(c.size("context") > 1 for c in keys) and any(c.offload for c in keys)
    assert any(c.size("y") > 1 for c in keys) and any(c.size("z") > 1 for c in keys)
    kinds = {(bool(f.model.moe.num_experts), f.model.moe.get("dispatch", "einsum")) for f in cfgs}
    assert kinds >= {(False, "einsum"), (True, "einsum"), (True, "dropless")}
    assert {bool(f.model.scan) for f in cfgs} == {True, False}


def test_a_plan_beyond_xla_cpus_devices_compiles_as_its_data_twin():
    """memory_check.twin: data and batch halved until the devices fit, the other axes (the per-device shapes)
    kept; a plan whose data cannot shrink that far is refused with the reason."""
    cfg, _ = G.case(0)
    cfg.train.batch_size = 8192
    c = MC.SP.Candidate((("stage", 2), ("data", 128), ("y", 16)))
    small, c2, f = MC.twin(cfg, c)
    assert f == 2 and c2.sizes["data"] == 64 and c2.sizes["stage"] == 2 and c2.sizes["y"] == 16
    assert small.train.batch_size == 4096 and cfg.train.batch_size == 8192
    assert MC.twin(cfg, MC.SP.Candidate((("data", 8),)))[2] == 1
    with pytest.raises(ValueError, match="divisible"):
        MC.twin(cfg, MC.SP.Candidate((("z", 4096),)))


@pytest.mark.slow
def test_check_memory_compiles_a_plans_candidates_in_a_child_process():
    """`gshard-jax plan --check-memory`'s child: the candidate compiled on as many simulated devices, its
    memory the in-process compile's."""
    cfg, c = G.case(0)
    overrides = [tuple(kv.split("=", 1)) for kv in G.BASE + G.GRID[0][2]] + [("mesh.data", "8")]
    (row,) = MC.check(os.path.join(G.ROOT, "experiments", "tiny_dense_lm.py"), overrides, 8, [c], [1.0], [0.0])
    assert row["total"] == MC.compiled(cfg, c).total and row["predicted"] == 1.0
