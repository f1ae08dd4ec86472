"""Each XLA compiler's habits in holding and moving a step's values, as data: one row per platform, read by
explain()'s temporaries (lowering/lower.py), the automatic sharding's budget (auto/), the collectives' bytes on
the wire (cost.py) and the planner's memory formula (gshard_jax/planner/memory_model.py), and so by `train`'s
and `plan`'s options.

XLA:CPU, XLA:TPU and XLA:GPU compile the same partitioned step to different buffers: XLA:CPU computes and keeps
bfloat16 in float32 and copies a dot's operands into its own layout; XLA:TPU and XLA:GPU keep bfloat16 as it is,
recompute an unrolled stack's checkpointed layers where the backward needs them (XLA:CPU runs them as soon as
their inputs exist, so remat saves nothing there), and schedule for memory. The formula's coefficients are
read off each compiler's `memory_analysis()` on benchmarks/memory_grid.py's grids (XLA:CPU's float32 grid by
hand; XLA:TPU's and XLA:GPU's bfloat16 ones at three shapes, by benchmarks/fit_habits.py) and held there by
tests/test_memory_grid.py. The accelerators' rows count values in the compute dtype's bytes: a float32 value
a bf16 model keeps (its softmax, its rotary embedding) counts as two, so they are bf16 training's rows.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping


@dataclasses.dataclass(frozen=True, eq=False)
class Habits:
    """How one compiler holds a train step's values, as the formula and explain() count them. Equal only to
    itself (its tables are dicts), so a row can key a cache: a replaced row is another key."""
    compiler: str  # the compiler's name, as reports print it
    widened: Mapping[str, str]  # element types it computes, keeps and sends wider (XLA:CPU's float normalisation)
    relays_operands: bool  # copies a dot's operands into its own layout and stores broadcasts several ops read
    tuple_slot: int  # bytes its temporaries hold per collective for the tuple of the result's pointers
    remat_unrolled: bool  # an unrolled stack's checkpointed layers are recomputed late, so remat saves memory
    # the logits' buffers are free before the layers' backward peaks (a memory-aware schedule reuses them for
    # the working set), so the step holds the larger of the two, not both
    logits_apart: bool
    # (d-model-wide, FFN-wide) values a layer keeps per token under remat none and under "dots", by where they
    # are kept: an unrolled stack's, a scan's stacked residuals, a forward pipeline's ticks, a 1F1B stash's
    none_values: Mapping[str, tuple]
    dots_values: Mapping[str, tuple]
    scores: float  # einsum attention's values per head and key kept (scores, probabilities)
    working: Mapping[str, float]  # layers' residuals an unrolled stack's backward holds at once, by remat policy
    loop_working: Mapping[str, float]  # the same in a loop (a scanned stack, a pipeline's stage)
    logit_copies: float  # the logits' float32 copies alive at once (logits, probabilities, their gradient)
    # a step's float32 gradient copies per local parameter beside its own with microbatches, by where the
    # layers run (memory_model.gradient_bytes)
    microbatch_gradients: Mapping[str, float]
    # a dropless MoE layer's values per received row: FFN-wide (grouped matmuls, their sorts) and d-wide (the
    # exchange's buffers both ways, their copies); of those, what remat "dots" keeps in a loop (the experts'
    # matmul outputs, saved by name)
    # (by where the layers run, as none_values: a forward schedule's ticks, not measured, as a loop's)
    dropless_ffn_values: Mapping[str, float] = dataclasses.field(
        default_factory=lambda: {"unrolled": 8.0, "loop": 8.0, "ticks": 8.0, "stash": 8.0})
    dropless_d_values: float = 6
    dropless_dots: float = 0.4
    # float32 copies of each local expert's weights (and one group more: the rows routed nowhere) a dropless
    # layer's grouped matmuls hold in the backward: the weights per group and their gradient
    dropless_weight_copies: float = 2.0
    # an einsum-dispatched MoE layer's dispatch and combine tensors ([G, S, E, C]) kept per token, slot and token
    # of its group: they grow with the group (a sequence, by default), so at long sequences they outweigh the rest
    moe_dispatch: float = 0.0
    moe_ffn: float = 1.5  # an MoE layer's FFN-wide values per slot over a dense layer's per token
    moe_d_values: float = 3  # d-wide values per slot: dispatched tokens, expert output, combined output
    pipeline_ticks: float = 1.3  # microbatches' residuals a pipelined stage holds beyond its stash

    def bytes_of(self, dtype: str, itemsize: int) -> int:
        """Bytes an element of `dtype` (itemsize bytes) takes as this compiler holds it."""
        return 4 if dtype in self.widened else itemsize


CPU = Habits(
    compiler="XLA:CPU", widened={"bfloat16": "float32"}, relays_operands=True, tuple_slot=64, remat_unrolled=False,
    logits_apart=False,
    none_values={"unrolled": (12, 3), "loop": (10, 6), "ticks": (10, 6), "stash": (16, 10)},
    dots_values={"unrolled": (8, 3), "loop": (8, 3), "ticks": (8, 3), "stash": (10, 4)},
    scores=2, working={"none": 0.5, "dots": 0.6, "dots_saveable": 0.6, "full": 1.5},
    loop_working={"none": 0.5, "dots": 0.6, "dots_saveable": 0.6, "full": 1.5}, logit_copies=3,
    microbatch_gradients={"unrolled": 0.5, "loop": 1.5, "ticks": 2.0, "stash": 2.0},
    dropless_ffn_values={"unrolled": 9.26, "loop": 9.26, "ticks": 9.26, "stash": 9.26}, dropless_d_values=6.36,
    dropless_weight_copies=2.69)

# XLA:TPU (v5p, and GShard's MoE(128E, 12L) on 128 v3 cores) and XLA:GPU (H100, cuDNN's attention): fitted by
# benchmarks/fit_habits.py to 54 and 56 bf16 steps (memory_grid.py --bf16, and --held-out at twice the width and
# at sequence 2,048; --experts: dropless MoE at 32-64 experts over 2-8 peers; --seeds, and Mula-100B on 3,072
# H100s), weighted hardest against predicting a step under what it compiles to, with what the compiler's buffer
# assignment shows held to it (--bounds); docs/targets.md has the table and the commands
TPU = Habits(
    compiler="XLA:TPU", widened={}, relays_operands=False, tuple_slot=0, remat_unrolled=True, logits_apart=True,
    none_values={"unrolled": (7.07, 6.0), "loop": (31.4, 6.0), "ticks": (10.29, 5.08), "stash": (13.46, 7.88)},
    dots_values={"unrolled": (8.35, 0.0), "loop": (1.78, 1.78), "ticks": (8.0, 3.0), "stash": (0.27, 2.27)},
    # read off its buffer assignment (tiny_dense_lm on v5p, GShard's MoE(128E) on v3): attention's scores in
    # float32 and probabilities in bf16 per head and key; the logits in float32 and in bf16
    scores=2.9, logit_copies=1.55,
    working={"none": 0.5, "dots": 0.99, "dots_saveable": 0.6, "full": 1.11},
    loop_working={"none": 0.0, "dots": 1.63, "dots_saveable": 0.6, "full": 1.1},
    microbatch_gradients={"unrolled": 2.21, "loop": 1.17, "ticks": 5.86, "stash": 0.0},
    dropless_ffn_values={"unrolled": 2.63, "loop": 12.54, "ticks": 12.54, "stash": 7.98}, dropless_d_values=7.18,
    dropless_dots=0.24, dropless_weight_copies=3.95, moe_dispatch=4.51, moe_ffn=0.5,
    moe_d_values=6.0, pipeline_ticks=3.0)

GPU = Habits(
    compiler="XLA:GPU", widened={}, relays_operands=False, tuple_slot=0, remat_unrolled=True, logits_apart=False,
    none_values={"unrolled": (5.94, 2.01), "loop": (0.0, 11.44), "ticks": (11.54, 8.68), "stash": (0.0, 15.06)},
    dots_values={"unrolled": (0.0, 3.72), "loop": (5.7, 2.31), "ticks": (8.0, 3.0), "stash": (8.58, 3.09)},
    scores=2.5, working={"none": 2.07, "dots": 0.79, "dots_saveable": 0.62, "full": 3.71},
    loop_working={"none": 0.82, "dots": 0.54, "dots_saveable": 0.6, "full": 0.72}, logit_copies=1.7,
    microbatch_gradients={"unrolled": 0.0, "loop": 0.59, "ticks": 5.62, "stash": 0.0},
    dropless_ffn_values={"unrolled": 4.9, "loop": 16.87, "ticks": 16.87, "stash": 10.29}, dropless_d_values=6.04,
    dropless_dots=0.17, dropless_weight_copies=2.35, moe_dispatch=1.21, moe_ffn=1.24,
    moe_d_values=1.0, pipeline_ticks=0.5)

# "": a platform nobody named (an abstract mesh explained without a profile: the generic accelerator's)
HABITS: Mapping[str, Habits] = {"cpu": CPU, "tpu": TPU, "gpu": GPU, "": dataclasses.replace(TPU, compiler="XLA")}


def of(platform: str) -> Habits:
    """The habits of the compiler for `platform` ("cpu", "tpu", "gpu", or "": an accelerator's)."""
    try:
        return HABITS[platform]
    except KeyError:
        raise ValueError(f"platform={platform!r}: expected one of {sorted(HABITS)}") from None
