"""A candidate's bytes per device by formula: what the compiled train step holds, term by term, fast enough for
every candidate the screen costs. Each term is what the per-device program keeps, as the grid of compiled steps
(benchmarks/memory_grid.py, tests/test_memory_grid.py) measured it on each compiler, whose coefficients are its
habits (partitioner/costs/compilers.py, by the ModelShape's platform):

- params and optimizer state as the layout stores them (ZeRO, EPSO, FSDP / z, tensor, expert and stage splits);
- gradients: float32, at the layout's size before any ZeRO or FSDP split. A step reduces its gradients once,
  after the microbatch loop or the scanned stack (partitioner/strategies/deferral.py), so each device holds the whole
  local gradient (the accumulator of a microbatched step) until then, whatever the ZeRO stage; but a
  prefetched stack (FSDP / ZeRO-3, scanned, one microbatch) reduces each trip's as it writes it;
- activations: each layer's residuals for the backward under the remat policy (per token: d-model-wide
  values, the FFN's widths, attention's scores and probabilities unless a fused kernel keeps only its
  log-sum-exp), times the layers a device runs and the microbatches in flight (a pipeline's stash, or every
  forward tick of a forward schedule, bubbles included). On XLA:CPU an unrolled stack's checkpointed layers
  are counted as remat "none": it runs their recomputation as soon as its inputs exist, so the saving is real
  only in a loop (a scanned stack or a pipeline), where each trip recomputes its own layer; XLA:TPU and
  XLA:GPU recompute them where the backward needs them (Habits.remat_unrolled);
- the backward's working set: one layer's residuals again (the gradients of its activations), and under full
  remat the layer being recomputed too;
- an MoE layer's dispatch: its experts' widths on k x capacity_factor slots per token, the dispatch and combine
  tensors, and a dropless exchange's buffers (every local row for every peer without a peer bound);
- the logits, their probabilities and their gradient (float32);
- a pipeline's ends: every microbatch's residual stream entering the stages, and its float32 gradient;
- the largest transient gather: a layer's weights under FSDP / ZeRO-3 (two in a scanned stack, which gathers
  the next layer's during the current one's).
"""
from __future__ import annotations

import functools

from ..models.ring_attention import BLOCK_SIZE as RING_TILE
from ..partitioner.costs import compilers
from ..pipelines import schedules as SC
from .space import Candidate, ModelShape

HOST_STATE_BYTES = 12  # per parameter of an offloaded optimizer state: float32 master weights and two moments
# The per-compiler coefficients (values kept per token, working set, logits' copies, gradients' copies) are each
# compiler's habits: partitioner/costs/compilers.py, read here through the ModelShape's platform.


def gradient_bytes(where: str, microbatches: int, param_bytes: int, platform: str = "cpu") -> float:
    """Bytes of gradients a step holds at its peak per local parameter (Habits.microbatch_gradients): the
    backward's own in the model's dtype, a bf16 model's converted to float32, and with microbatches float32
    copies beside them: the accumulator and part of a microbatch's own (an unrolled stack), its stacked
    gradients and their partial sums too (a scanned stack), a tick's and the stage's partial sums (a pipeline,
    whose ticks convert as they accumulate)."""
    mixed = param_bytes < 4 and where not in ("ticks", "stash")
    extra = compilers.of(platform).microbatch_gradients[where] if microbatches > 1 else 0.0
    return param_bytes + 4 * (mixed + extra)


@functools.lru_cache(maxsize=4096)
def in_flight(name: str, stages: int, microbatches: int, repeats: int) -> int:
    """Microbatches whose residuals a stage holds at once: the 1F1B family's stash slots, or every forward tick
    of a forward schedule (its scan over ticks stacks them, bubbles included)."""
    sc = SC.make(name, stages, microbatches, repeats)
    if sc.stash:
        return sc.stash
    warmup, steady, _ = sc.phases
    return len(warmup) + len(steady)


def residuals(shape: ModelShape, c: Candidate, remat: str, where: str = "unrolled") -> float:
    """Values a layer keeps per token (and per slot of its MoE FFN) for the backward, per device, where it keeps
    them (NONE_VALUES' keys). Under sequence parallelism the d-model-wide ones are split over y too."""
    s = c.sizes
    y, x = s["y"], s["x"] * (s["y"] if c.sequence_parallel else 1)
    cx = s["context"]
    seq = shape.seq if cx == 1 else min(RING_TILE, shape.seq // (2 * cx))  # a ring's query chunk x key tile
    h = compilers.of(shape.platform)
    scores = 4 / shape.activation_bytes if shape.fused_attention else h.scores * seq  # a fused kernel's log-sum-exp
    d_values, ffn_values = (h.none_values if remat == "none" else h.dots_values)[where]
    ffn = ffn_values * shape.d_ff
    if shape.experts:  # on k x capacity_factor slots a token, with the dispatched tokens and expert outputs
        slots = shape.k * shape.capacity_factor
        ffn = 0.0 if shape.dropless else h.moe_ffn * ffn * slots + h.moe_d_values * shape.d_model * slots
        if remat == "none" and not shape.dropless:  # the dispatch and combine tensors, E x C = slots x S a token
            ffn += h.moe_dispatch * slots * shape.group
    if remat == "full":
        return shape.d_model / x  # the layer's input
    kept = shape.heads * scores / y if remat in ("none", "dots_saveable") else 0.0
    return d_values * shape.d_model / x + ffn / y + kept


def received_rows(shape: ModelShape, c: Candidate, tokens: float) -> float:
    """Rows one dropless MoE layer's experts run on per device: its receive buffers (models/dropless.py), whose
    rows are allocated whole whatever the routing: every local row from every peer (the dense and the ragged
    all-to-all, without a peer bound), peer_bound x rows with one, every peer's rows gathered."""
    e = c.size("expert")
    rows = tokens * shape.k  # assignments made here
    if e == 1:
        return rows
    if shape.exchange == "all_gather":
        return rows * e
    return rows * (min(e, shape.peer_bound) if shape.peer_bound else e)


def dropless_buffers(shape: ModelShape, c: Candidate, tokens: float, where: str = "unrolled") -> float:
    """Bytes one dropless MoE layer keeps for the backward where it runs (residuals' `where`): its exchange's
    send and receive buffers (rows x d_model) and its experts' widths on the received rows."""
    h = compilers.of(shape.platform)
    return received_rows(shape, c, tokens) * (h.dropless_ffn_values[where] * shape.d_ff / c.size("y") +
                                              h.dropless_d_values * shape.d_model) * shape.activation_bytes


def memory(shape: ModelShape, c: Candidate) -> dict[str, float]:
    """Bytes per device by kind: params, gradients, optimizer, activations, working, transient, logits;
    offloaded, the optimizer's (with float32 master weights) are host_optimizer's (`offloaded`)."""
    size = c.size
    p, d, z, e, y, x = size("stage"), size("data"), size("z"), size("expert"), size("y"), size("x")
    b, m, zs = shape.param_bytes, c.microbatches, c.zero_stage
    per_param = gradient_bytes(_where(c.schedule, p, shape.scan), m, b, shape.platform)
    # a prefetched stack (prefetch.py: scanned, stored split over z or ZeRO-3, a loop of two trips or more)
    # writes each trip's gradient into its stacked result reduced: the stack's gradients are held as stored,
    # and one layer's whole
    prefetched = shape.scan and p == 1 and m == 1 and shape.periods >= 2 and (z > 1 or zs == 3)
    state = 8 + 4 * (b == 2 or c.offload)  # optimizer bytes a parameter: two moments, and master weights
    params = gradients = optimizer = 0.0
    ep = e if c.epso else 1
    # (parameters, split before the storage axes, the ZeRO split): expert weights, the layers' others, vocab
    for n, split, zero, stacked in ((shape.expert_params, e * y * x * p, d, True),
                                    (shape.layer_params, y * x * p, d * ep, True),
                                    (shape.vocab_params, y * x, d * ep, False)):
        local = n / split
        stored = local / z
        params += stored * b / (zero if zs == 3 else 1)
        # whole until the step's one reduction (module docstring); with microbatches, the accumulator and part of
        # the microbatch's own
        reduced = z * (zero if zs == 3 else 1) if prefetched and stacked else 1
        gradients += local / reduced * per_param
        optimizer += stored * state / (zero if zs >= 1 else 1)
    kept, working, logits, ends = _step_values(shape, compilers.of(shape.platform), c.mesh, m, c.schedule,
                                               c.repeats, c.remat, c.sequence_parallel)
    out = {"params": params, "gradients": gradients, "optimizer": optimizer, "activations": kept,
           "working": working, "transient": 0.0, "logits": logits}
    if prefetched:
        out["gradients"] += (shape.layer_params + shape.expert_params / e) / (shape.layers * y * x) * per_param
    if z > 1 or zs == 3:  # a layer's weights gathered at a time; a scan gathers the next one's beside
        per = (shape.layer_params + shape.expert_params / e) / (shape.layers * y * x)
        ahead = shape.scan and shape.periods / p >= 2  # prefetch.py: a loop of two trips or more
        out["transient"] = per * b * (2 if ahead else 1)
    if p > 1:
        out["pipeline_ends"] = ends
    if c.offload:
        offloaded(out, out.pop("optimizer"), b)
    out["total"] = device_total(out)
    return out


def _where(schedule: str, stages: int, scan: bool) -> str:
    """Where a step's layers keep their residuals (the keys of Habits.none_values)."""
    looped = scan or stages > 1
    return "stash" if schedule in SC.OWN_BACKWARD else "ticks" if stages > 1 else "loop" if looped else "unrolled"


@functools.lru_cache(maxsize=1 << 16)
def _step_values(shape: ModelShape, h: compilers.Habits, mesh: tuple, m: int, schedule: str, repeats: int, remat: str,
                 sequence_parallel: bool) -> tuple[float, float, float, float]:
    """(activations, working, logits, pipeline_ends) bytes of a step: what its layers keep and run on, which
    the ZeRO stage, EPSO and offload leave alone (so the screen's variants of them share it), by the habits h of
    the compiler that holds it (a cache key: equal only to itself)."""
    c = Candidate(mesh, microbatches=m, schedule=schedule, repeats=repeats, remat=remat,
                  sequence_parallel=sequence_parallel)
    s = c.sizes
    p, e, y, x = (s[a] for a in ("stage", "expert", "y", "x"))
    a, b = shape.activation_bytes, shape.param_bytes
    looped = shape.scan or p > 1  # a scanned stack or a pipeline: each trip recomputes its own layer
    where = _where(schedule, p, shape.scan)
    tokens = shape.tokens / (c.token_shards * m)  # per device and microbatch
    stacks = 2 if shape.kind == "encoder_decoder" else 1
    layers = shape.layers * stacks / p  # a stage's
    remat = remat if looped or h.remat_unrolled else "none"
    flight = 1
    if schedule != "none":  # each microbatch in flight holds a chunk: a stage's layers over its repeats
        flight = (in_flight(schedule, p, m, repeats) + h.pipeline_ticks) / repeats
    # a dropless layer's FFN residuals are its exchange's buffers
    buffers = dropless_buffers(shape, c, tokens, where) if shape.dropless else 0.0
    kept_buffers = buffers * {"none": 1.0, "dots": h.dropless_dots, "dots_saveable": h.dropless_dots,
                              "full": 0.0}[remat]
    kept = layers * (residuals(shape, c, remat, where) * a * tokens + kept_buffers)
    working = 0.0
    if shape.dropless:  # per group: every local expert and the overflow's
        per_expert = shape.expert_params / (shape.periods * shape.experts * y)
        held = 1 if p == 1 and shape.scan else layers  # a scan's trip holds its own layer's; a stage all its
        working += held * h.dropless_weight_copies * (shape.experts // e + 1) * per_expert * 4
    one = dropless_buffers(shape, c, tokens) if shape.dropless else 0.0  # a layer's, as residuals' "none"
    working += (h.loop_working if looped else h.working)[remat] * (residuals(shape, c, "none") * a * tokens + one)
    logits = h.logit_copies * tokens * shape.vocab / y * 4
    if h.logits_apart:  # the working set reuses the logits' buffers: only its excess over them is more
        working = max(0.0, working - logits)
    # the pipeline's ends: every microbatch's input to the first stage and its gradient (float32)
    ends = m * tokens * shape.d_model / (x * (y if sequence_parallel else 1)) * (4 + b) if p > 1 else 0.0
    return kept * flight, working, logits, ends


def offloaded(mem: dict, host_bytes: float, param_bytes: int) -> None:
    """mem (bytes per device by kind) with the optimizer state in host memory (`host_optimizer`), updated
    there: the device holds none of it, and a step moves only its slice of the gradients down and of the
    params up, in the params' dtype (`host_exchange` bytes each way)."""
    mem["optimizer"] = 0.0
    mem["host_optimizer"] = host_bytes
    mem["host_exchange"] = host_bytes / HOST_STATE_BYTES * param_bytes


def device_total(mem: dict) -> float:
    """Device bytes of a memory dict: every kind but the total and those in host memory."""
    return sum(v for k, v in mem.items() if k != "total" and not k.startswith("host_"))
