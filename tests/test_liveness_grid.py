"""explain()'s predicted memory per device (arguments in device memory, outputs not donated, the temporaries'
peak: partitioner/liveness.py) against the compiled train step's memory_analysis() (argument + output - alias +
temp), on the steps of benchmarks/memory_grid.py whose liveness models XLA's buffers: a pipeline's carries in
one buffer per loop, an unrolled checkpoint's recomputation made as early as its operands, a dropless layer's
manual region, bfloat16 on a CPU. Within [0.90, 1.15], never under by more than 10%."""
import os
import sys

import pytest

from gshard_jax.partitioner.hardware import default_for
from gshard_jax.planner import memory_check as MC

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import memory_grid as G  # noqa: E402

LOW, HIGH = 0.90, 1.15
D, M = G.D, G.M
STAGED = G.STAGED
# (config, mesh, overrides) as the grid writes them: found by what they are, so rows added to it keep these
STEPS = {
    "1f1b": (D, "stage=2,data=4", STAGED + ["pipeline.schedule=1f1b", "train.microbatches=4"]),
    "interleaved": (D, "stage=2,data=4", STAGED + ["pipeline.schedule=interleaved_1f1b", "pipeline.repeats=2",
                                                   "train.microbatches=4"]),
    "moe_1f1b": (M, "stage=2,data=2,expert=2", STAGED + ["pipeline.schedule=1f1b", "train.microbatches=4"]),
    "unrolled_dots": (D, "data=8", ["model.remat=dots"]),
    "unrolled_full": (D, "data=8", ["model.remat=full"]),
    "moe_dots": (M, "data=2,expert=4", ["model.remat=dots"]),
    "moe_full": (M, "data=2,expert=4", ["model.remat=full"]),
    "moe_zero1_m2_dots": (M, "data=2,expert=4", ["train.zero_stage=1", "train.microbatches=2", "model.remat=dots"]),
    "zero1_m4_dots": (D, "data=8", ["train.zero_stage=1", "train.microbatches=4", "model.remat=dots"]),
    "dropless_unrolled": (M, "data=2,expert=4", G.DROPLESS + ["model.remat=none"]),
    # XLA:CPU keeps bfloat16 values in float32 (lower.py counts them so on a CPU)
    "bf16_scanned_dots": (D, "data=8", ["model.dtype=bfloat16", "model.scan=true", "model.remat=dots"]),
    "moe_bf16_zero1_m2": (M, "data=2,expert=4", ["model.dtype=bfloat16", "train.zero_stage=1",
                                                 "train.microbatches=2"]),
}


def _index(step) -> int:
    rows = [i for i, row in enumerate(G.GRID) if row == step]
    if not rows:
        pytest.fail(f"benchmarks/memory_grid.py has no row {step}")
    return rows[0]


@pytest.mark.slow
@pytest.mark.parametrize("step", sorted(STEPS))
def test_explains_memory_is_the_compiled_steps(step):
    cfg, c = G.case(_index(STEPS[step]))
    predicted = MC.explained(cfg, c, default_for("cpu"))
    compiled = MC.compiled(cfg, c)
    ratio = predicted / compiled.total
    assert LOW <= ratio <= HIGH, (c.key, ratio, predicted, compiled)
