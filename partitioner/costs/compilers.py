"""Each XLA compiler's habits in holding and moving a step's values, as data: one row per platform, read by
explain()'s temporaries (lowering/lower.py), the automatic sharding's budget (auto/), the collectives' bytes on
the wire (cost.py) and the planner's memory formula (gshard_jax/planner/memory_model.py), and so by `train`'s
and `plan`'s options.

XLA:CPU, XLA:TPU and XLA:GPU compile the same partitioned step to different buffers: XLA:CPU computes and keeps
bfloat16 in float32 and copies a dot's operands into its own layout; XLA:TPU and XLA:GPU keep bfloat16 as it is,
recompute an unrolled stack's checkpointed layers where the backward needs them (XLA:CPU runs them as soon as
their inputs exist, so remat saves nothing there), and schedule for memory. The formula's coefficients are
read off each compiler's `memory_analysis()` on benchmarks/memory_grid.py's grid (XLA:CPU's float32 grid,
XLA:TPU's and XLA:GPU's bfloat16 one at sequence 512) and held there by tests/test_memory_grid.py.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping


@dataclasses.dataclass(frozen=True)
class Habits:
    """How one compiler holds a train step's values, as the formula and explain() count them."""
    compiler: str  # the compiler's name, as reports print it
    widened: Mapping[str, str]  # element types it computes, keeps and sends wider (XLA:CPU's float normalisation)
    relays_operands: bool  # copies a dot's operands into its own layout and stores broadcasts several ops read
    tuple_slot: int  # bytes its temporaries hold per collective for the tuple of the result's pointers
    remat_unrolled: bool  # an unrolled stack's checkpointed layers are recomputed late, so remat saves memory
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
    dropless_ffn_values: float = 8
    dropless_d_values: float = 6
    dropless_dots: float = 0.4
    moe_ffn: float = 1.5  # an MoE layer's FFN-wide values per slot over a dense layer's per token
    moe_d_values: float = 3  # d-wide values per slot: dispatched tokens, expert output, combined output
    pipeline_ticks: float = 1.3  # microbatches' residuals a pipelined stage holds beyond its stash

    def bytes_of(self, dtype: str, itemsize: int) -> int:
        """Bytes an element of `dtype` (itemsize bytes) takes as this compiler holds it."""
        return 4 if dtype in self.widened else itemsize


CPU = Habits(
    compiler="XLA:CPU", widened={"bfloat16": "float32"}, relays_operands=True, tuple_slot=64, remat_unrolled=False,
    none_values={"unrolled": (12, 3), "loop": (10, 6), "ticks": (10, 6), "stash": (16, 10)},
    dots_values={"unrolled": (8, 3), "loop": (8, 3), "ticks": (8, 3), "stash": (10, 4)},
    scores=2, working={"none": 0.5, "dots": 0.6, "dots_saveable": 0.6, "full": 1.5},
    loop_working={"none": 0.5, "dots": 0.6, "dots_saveable": 0.6, "full": 1.5}, logit_copies=3,
    microbatch_gradients={"unrolled": 0.5, "loop": 1.5, "ticks": 2.0, "stash": 2.0})

TPU = dataclasses.replace(CPU, compiler="XLA:TPU", widened={}, relays_operands=False, tuple_slot=0,
                          remat_unrolled=True)

GPU = dataclasses.replace(TPU, compiler="XLA:GPU")

# "": a platform nobody named (an abstract mesh explained without a profile: the generic accelerator's)
HABITS: Mapping[str, Habits] = {"cpu": CPU, "tpu": TPU, "gpu": GPU, "": dataclasses.replace(TPU, compiler="XLA")}


def of(platform: str) -> Habits:
    """The habits of the compiler for `platform` ("cpu", "tpu", "gpu", or "": an accelerator's)."""
    try:
        return HABITS[platform]
    except KeyError:
        raise ValueError(f"platform={platform!r}: expected one of {sorted(HABITS)}") from None
