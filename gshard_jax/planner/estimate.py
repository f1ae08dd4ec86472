"""The analytic screen: a candidate's step time and memory per device from formulas, fast enough for every
candidate. The top ones are then planned by the partitioner itself (predict.py), whose communication
replaces the formula's.

Time = compute / (1 - bubble) + communication - overlap. Compute is the
model's flops (6 x active parameters per token, plus attention; what the remat policy recomputes) over
the devices' peak x efficiency. Communication is a list of collectives (kind, axes, bytes moved per device,
count), each costed alpha-beta at the bandwidth of its axes (hardware.axes_bandwidth). Memory is
memory_model.py's: what the compiled step holds, term by term.
The screen credits no overlap: what a step hides behind compute is the planned program's (predict.py).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple, Optional, Sequence

from .. import configs
from ..partitioner.costs.cost import latency_steps, moved_bytes
from ..partitioner.costs.hardware import Hardware, axes_bandwidth
from ..pipelines import schedules as SC
from .memory_model import HOST_STATE_BYTES, device_total, memory, offloaded  # noqa: F401 (the screen's memory)
from .space import Candidate, ModelShape

GiB = 1024 ** 3


@dataclasses.dataclass(frozen=True)
class ScheduleFacts:
    """What the screen reads of a schedule's table."""
    ticks: int
    stash: int
    bubble: float
    forward_ticks: int  # ticks the forward wave runs (all of them but 1F1B's cooldown): m r + p - 1
    rolls: int  # permutes of the activations (or their gradients) between stages per step


@functools.lru_cache(maxsize=4096)
def schedule(name: str, stages: int, microbatches: int, repeats: int) -> ScheduleFacts:
    """A schedule's table, read once per shape (candidates share them)."""
    sc = SC.make(name, stages, microbatches, repeats)
    warmup, steady, cool = sc.phases
    if sc.backward is None:  # each forward tick's roll, and its transpose in autodiff's backward
        rolls = 2 * sc.ticks
    else:  # a roll per tick and wave; a cooldown of one tick is no loop, and its gradient goes nowhere
        rolls = len(warmup) + 2 * len(steady) + len(cool) - (len(cool) == 1)
    return ScheduleFacts(sc.ticks, sc.stash, sc.bubble, len(warmup) + len(steady), rolls)


class Comm(NamedTuple):
    """Collectives of one kind over one group of axes in a step: `count` of them, `moved` bytes per device.

    (A named tuple: the screen makes millions.)"""
    kind: str
    axes: tuple[str, ...]
    count: float
    moved: float

    def time(self, hw: Hardware, order: Sequence[tuple[str, int]], sizes: Optional[dict] = None) -> float:
        """Alpha-beta as the partitioner's cost model (cost.Collective.time), at the bandwidth of these axes."""
        sizes = sizes if sizes is not None else dict(order)
        group = 1
        for a in self.axes:
            group *= sizes.get(a, 1)
        if group <= 1 or not self.count:
            return 0.0
        return self.count * latency_steps(self.kind, group) * hw.latency + \
            self.moved / _bandwidth(hw, order, self.axes)


_BANDWIDTHS: dict = {}
_KEYS: dict = {}  # (kind, axes) -> "kind[axes]"


def _bandwidth(hw: Hardware, order: tuple, axes: tuple) -> float:
    """axes_bandwidth, memoized by the hardware's identity (hashing its table per call cost a third of a
    screen)."""
    key = (id(hw), order, axes)
    got = _BANDWIDTHS.get(key)
    if got is None or got[0] is not hw:
        got = _BANDWIDTHS[key] = (hw, axes_bandwidth(hw, order, axes))
    return got[1]


@dataclasses.dataclass
class _Counts:
    """What collectives()' formulas read: the candidate's axis sizes and the step's per-device counts, and the
    collectives found so far."""
    shape: ModelShape
    c: Candidate
    out: list = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        shape, c = self.shape, self.c
        s = c.sizes
        p, d, z, e, y, x = (s[a] for a in ("stage", "data", "z", "expert", "y", "x"))
        m, b = c.microbatches, shape.param_bytes
        tokens_mb = shape.tokens / (c.token_shards * m)  # per device, per microbatch
        act = tokens_mb * shape.d_model / x * b  # the residual stream's bytes per device
        layers = shape.layers * (2 if shape.kind == "encoder_decoder" else 1) / p
        fwd = 2 if c.remat == "full" else 1  # forward passes per step (remat full runs it again in the backward)
        # Times a stage runs each of its layers per step, forward and backward alike: m, or in a pipeline every
        # forward tick, bubbles included (m r + p - 1 ticks over r repeats), as a layer's collectives run then.
        runs = schedule(c.schedule, p, m, c.repeats).forward_ticks / c.repeats if p > 1 else m
        moe_layers = shape.periods * (2 if shape.kind == "encoder_decoder" else 1) / p  # a stage's, over its repeats
        self.s, self.m, self.b, self.tokens_mb, self.act, self.layers, self.fwd, self.runs, self.moe_layers = (
            s, m, b, tokens_mb, act, layers, fwd, runs, moe_layers)
        self.p, self.d, self.z, self.e, self.y, self.x = p, d, z, e, y, x

    def add(self, kind, axes, payload, count) -> None:
        group = 1
        for a in axes:
            group *= self.s[a]
        if group > 1 and count:
            self.out.append(Comm(kind, tuple(axes), count, moved_bytes(kind, payload, group) * count))


def collectives(shape: ModelShape, c: Candidate) -> list[Comm]:
    """The step's collectives by formula (per device; bf16 activations, float32 gradient reductions): the
    tensor axes', the context ring's and x's, the experts', the weights', a dropless layer's and the
    pipeline's, in that order."""
    k = _Counts(shape, c)
    for part in (_tensor_comms, _context_and_x_comms, _expert_comms, _weight_comms, _dropless_comms,
                 _pipeline_comms):
        part(k)
    return k.out


def _tensor_comms(k: _Counts) -> None:
    """Over y: the row-parallel outputs' reductions (rings under sequence parallelism), the vocabulary's."""
    shape, c, y, m = k.shape, k.c, k.y, k.m
    act, layers, fwd, runs, moe_layers = k.act, k.layers, k.fwd, k.runs, k.moe_layers
    # Tensor axes. Over y (Megatron's row-parallel outputs, d_model wide, split over x): two all-reduces per
    # layer and pass. Over x (d_model split, AxoNN's column group): what contracts d_model is reduced over it,
    # at its own width split over y: forward the q, k, v and FFN-in projections; backward the input gradients
    # of the FFN-out and attention-out projections.
    if c.sequence_parallel:  # each all-reduce an all-gather and a reduce-scatter (the same bytes), run as
        # collective-matmul rings beside their matmuls: y - 1 steps of a permute each way, each paying a
        # latency. The backward gathers the two column-parallel inputs again for their weight gradients.
        rings = 2 * 2 * (fwd + 1) * layers * runs
        if y > 1:
            k.out.append(Comm("collective-permute", ("y",), rings * 2 * (y - 1),
                              moved_bytes("all-gather", act, y) * rings))
        k.add("all-gather", ("y",), act, 2 * (c.remat != "full") * layers * runs)
    else:
        k.add("all-reduce", ("y",), act, 2 * (fwd + 1) * layers * runs)
        if shape.experts and not shape.dropless:  # an MoE layer's FFN reduces its k x capacity slots per token
            k.add("all-reduce", ("y",), act * (shape.k * shape.capacity_factor - 1), (fwd + 1) * moe_layers * runs)
    # The vocabulary over y: the embedding lookup's output and the head's input gradient, per microbatch.
    k.add("all-reduce", ("y",), act, 2 * m)


def _context_and_x_comms(k: _Counts) -> None:
    """The context ring's K and V blocks, and what contracts d_model over x."""
    shape, s, y, m, b = k.shape, k.s, k.y, k.m, k.b
    tokens_mb, layers, fwd, runs, moe_layers = k.tokens_mb, k.layers, k.fwd, k.runs, k.moe_layers
    attn = shape.heads * shape.head_dim
    # Context: each attention layer's K and V blocks go round the ring (ring attention), c - 1 hops each
    # forward; the custom backward, starting from the block the forward received first, sends K, V c - 2 hops
    # and the float32 dK, dV accumulators c hops (home included).
    cx = s["context"]
    if cx > 1:
        kv = tokens_mb * attn / y * b  # one K or V block per device
        k.add("collective-permute", ("context",), kv, 2 * (cx - 1) * fwd * layers * runs)
        k.add("collective-permute", ("context",), kv, 2 * (cx - 2) * layers * runs)
        k.add("collective-permute", ("context",), kv * 4 / b, 2 * cx * layers * runs)
    ffn = fwd * shape.ffn_inputs * shape.d_ff + shape.d_ff  # an FFN's widths reduced over x, both passes
    k.add("all-reduce", ("x",), tokens_mb * (fwd * 3 * attn + attn + ffn) / y * b, layers * runs)
    if shape.experts and not shape.dropless:  # an MoE layer's FFN runs on k x capacity slots per token
        k.add("all-reduce", ("x",), tokens_mb * ffn * (shape.k * shape.capacity_factor - 1) / y * b, moe_layers * runs)
    k.add("all-reduce", ("x",), tokens_mb * shape.vocab / y * b, m)  # the head's logits contract d_model


def _expert_comms(k: _Counts) -> None:
    """The experts' dispatch and combine, per MoE layer and pass."""
    shape, e, x, act, layers, fwd, runs = k.shape, k.e, k.x, k.act, k.layers, k.fwd, k.runs
    # Experts: dispatch and combine all-to-alls per MoE layer and pass. GShard's einsum dispatch sends
    # capacity_factor x k rows per token; a dropless all-to-all sends each peer a buffer that holds every
    # local row (or peer_bound x rows / peers), its all-gather exchange gathers the tokens.
    if shape.experts and e > 1:
        if not shape.dropless:
            k.add("all-to-all", ("expert",), act * shape.k * shape.capacity_factor, 2 * (fwd + 1) * layers * runs)
        else:
            if shape.exchange == "all_gather":
                k.add("all-gather", ("expert",), act * e, (fwd + 1) * layers * runs)
                k.add("reduce-scatter", ("expert",), act * e, (fwd + 1) * layers * runs)
            else:
                rows = act * x * shape.k  # the region holds whole rows: x gathers them
                dense = shape.exchange == "all_to_all"
                per_peer = e if dense and not shape.peer_bound else (min(e, shape.peer_bound) if dense else 1)
                k.add("all-to-all", ("expert",), rows * per_peer, 2 * (fwd + 1) * layers * runs)


def _weight_comms(k: _Counts) -> None:
    """The weights' gathers and their gradients' reductions, per class, as the layout stores them."""
    shape, c, p, z, e, y, x, m, b, fwd = k.shape, k.c, k.p, k.z, k.e, k.y, k.x, k.m, k.b, k.fwd
    # Weights per device as the layout stores them (before the storage axes), per class.
    split_e, split_l, split_v = e * y * x * p, y * x * p, y * x
    w = {"expert": shape.expert_params / split_e, "layer": shape.layer_params / split_l,
         "vocab": shape.vocab_params / split_v}
    # (context splits each sequence: every weight's gradient is summed over it too)
    dp_axes = {"expert": ("data", "context"), "layer": ("data", "expert", "context"),
               "vocab": ("data", "expert", "context")}
    for cls, n in w.items():
        # FSDP (z) and ZeRO-3 gather the weights per microbatch and pass, and reduce-scatter the gradients.
        gather = ("z",) + (dp_axes[cls] if c.zero_stage == 3 else ())
        k.add("all-gather", gather, n * b, (fwd + 1) * m)
        k.add("reduce-scatter", gather, n * b, m)  # the gradients of gathered weights, in their dtype
        if c.zero_stage == 3:
            continue
        store = n / (z if z > 1 else 1)
        if c.zero_stage == 0:
            k.add("all-reduce", dp_axes[cls], store * 4, 1)
        else:
            axes = dp_axes[cls] if c.epso or cls == "expert" else ("data",)
            k.add("reduce-scatter", axes, store * 4, m if c.zero_stage == 2 else 1)
            k.add("all-gather", axes, store * b, 1)


def _dropless_comms(k: _Counts) -> None:
    """A dropless MoE layer's manual region along x."""
    shape, e, y, x, b, act, fwd, runs, moe_layers = k.shape, k.e, k.y, k.x, k.b, k.act, k.fwd, k.runs, k.moe_layers
    # A dropless MoE layer is a manual region over the token (data, z), expert and FFN (y) axes, run once per
    # microbatch (per tick in a pipeline, bubbles included). Its expert weights enter as one copy per token
    # shard, so their gradients leave it partial over data and z and are reduced once per step with the
    # others (above); along x it gathers tokens and weights, all-reduces the weights' gradients (in their
    # dtype) and its output.
    if shape.dropless:
        per_layer = shape.expert_params / max(shape.periods, 1) / (e * y)
        k.add("all-reduce", ("x",), per_layer * b, moe_layers * runs)
        k.add("all-gather", ("x",), act * x, (fwd + 1) * moe_layers * runs)
        k.add("all-gather", ("x",), per_layer * b, (fwd + 1) * moe_layers * runs)
        k.add("all-reduce", ("x",), act * x, (fwd + 1) * moe_layers * runs)


def _pipeline_comms(k: _Counts) -> None:
    """The pipeline's permutes per tick, and its ends once per step."""
    shape, c, p, d, y, x, m, b, act = k.shape, k.c, k.p, k.d, k.y, k.x, k.m, k.b, k.act
    # Pipeline: one permute of the activations per tick and direction (split over y too under sequence
    # parallelism, as the residual stream between layers is).
    if p > 1:
        split_v = y * x  # (the vocabulary's weights, as _weight_comms stores them)
        sched = schedule(c.schedule, p, m, c.repeats)
        act = act / y if c.sequence_parallel else act
        k.add("collective-permute", ("stage",), act, sched.rolls)
        # Its ends, once per step: what one stage makes is summed over `stage`. The first stage's input
        # gradient (the step's residual stream; float32 where the 1F1B schedules make it), and the last
        # stage's outputs (GPipe, circular) or its head's float32 gradient (1F1B, which runs the head there).
        # With stage-owned ends (every schedule) the head and loss run on the last stage: nothing crosses.
        own = c.schedule in ("1f1b", "interleaved_1f1b")
        if not (shape.owned_ends and not c.offload):  # an offloaded run keeps its ends replicated
            k.add("all-reduce", ("stage",), act * m * (4 / b if own else 1), 1)
            head = shape.vocab * shape.d_model / split_v * 4 / (d if c.zero_stage else 1)
            k.add("all-reduce", ("stage",), head if own else act * m, 1)


def model_flops_per_token(shape: ModelShape) -> float:
    """configs.flops_per_token of the shape (the formula the training run's mfu uses)."""
    layers = shape.layers * (2 if shape.kind == "encoder_decoder" else 1)
    return configs.flops_per_token(shape.active_params, layers, shape.d_model, shape.seq)


def recomputed_flops_per_token(shape: ModelShape, remat: str) -> float:
    """Flops per token the backward runs again under a remat policy (models/transformer.py's REMAT_POLICIES):
    "full" the layers' forward (2 per active layer parameter, and attention's 4 L d S: a third of
    flops_per_token's 12 L d S) but each period's last matmul where a dense FFN ends it, whose output the
    backward never reads; "dots" attention's forward alone, as it keeps every other matmul (the experts' by
    name) but neither einsum's score and context matmuls (batched over heads) nor a fused kernel (no matmul);
    "dots_saveable" keeps einsum's, so only a fused kernel's forward runs again."""
    layers = shape.layers * (2 if shape.kind == "encoder_decoder" else 1)
    attention = 4 * layers * shape.d_model * shape.seq
    if remat == "full":
        last = 0 if shape.experts else 2 * shape.d_ff * shape.d_model * layers  # a dense model's period: 1 layer
        return 2 * (shape.active_params - shape.vocab_params) + attention - last
    if remat == "dots" or (remat == "dots_saveable" and shape.fused_attention):
        return attention
    return 0.0


def flops(shape: ModelShape, c: Candidate) -> float:
    """Flops of a step: the model's, and what its remat policy computes again."""
    return (model_flops_per_token(shape) + recomputed_flops_per_token(shape, c.remat)) * shape.tokens


def bubble(c: Candidate) -> float:
    """Idle fraction of the pipeline's ticks (schedules.py's table); 0 without stages."""
    if c.schedule == "none":
        return 0.0
    return schedule(c.schedule, c.size("stage"), c.microbatches, c.repeats).bubble


def host_transfer_s(hw: Hardware, c: Candidate, mem: dict) -> float:
    """Seconds a step spends on an offloaded update (counted exposed): the exchange both ways over the host
    link, and the host's cores reading and writing the state and reading the gradients."""
    if not c.offload:
        return 0.0
    exchange = mem.get("host_exchange", 0.0)
    return 2 * exchange / hw.host_bandwidth + (2 * mem.get("host_optimizer", 0.0) + exchange) / hw.host_update_bandwidth


@dataclasses.dataclass
class Estimate:
    """A candidate's predicted step: seconds by part and by (kind, axes), bytes per device by kind."""
    compute: float
    bubble: float  # seconds idle in the pipeline's bubble
    comm: dict  # "kind[axes]" -> seconds
    overlap: float  # seconds of communication hidden behind compute
    memory: dict
    source: str = "formula"  # or "partitioner": the communication is the planned program's

    @property
    def comm_total(self) -> float:
        return sum(self.comm.values())

    @property
    def step(self) -> float:
        return self.compute + self.bubble + self.comm_total - self.overlap

    def to_dict(self) -> dict:
        return {"step_s": self.step, "compute_s": self.compute, "bubble_s": self.bubble,
                "comm_s": self.comm_total, "overlap_s": self.overlap, "comm_by_collective_s": self.comm,
                "memory_bytes": self.memory, "comm_source": self.source}


def compute_time(shape: ModelShape, c: Candidate, hw: Hardware, devices: int) -> float:
    return flops(shape, c) / (devices * hw.peak_flops * hw.efficiency)


def combine(hw: Hardware, c: Candidate, compute: float, comms: Sequence[Comm], mem: dict,
            source: str = "formula", exposed: Optional[float] = None) -> Estimate:
    """An Estimate from compute seconds, the step's collectives and memory, on `c`'s axis order. exposed: the
    seconds of communication the planned program leaves exposed (partitioner/costs/overlap.py); None (the screen):
    all of it."""
    by: dict = {}
    sizes = c.sizes
    for cm in comms:
        t = cm.time(hw, c.mesh, sizes)
        if t:
            key = _KEYS.get(cm[:2])
            if key is None:
                key = _KEYS[cm[:2]] = f"{cm.kind}[{','.join(cm.axes)}]"
            by[key] = by.get(key, 0.0) + t
    host = host_transfer_s(hw, c, mem)
    if host:
        by["host-transfer[optimizer]"] = host
        exposed = None if exposed is None else exposed + host
    frac = bubble(c)
    idle = compute * frac / (1 - frac) if frac < 1 else math.inf
    total = sum(by.values())
    return Estimate(compute, idle, by, 0.0 if exposed is None else max(total - exposed, 0.0), mem, source)


def estimate(shape: ModelShape, c: Candidate, hw: Hardware, devices: int) -> Estimate:
    return combine(hw, c, compute_time(shape, c, hw, devices), collectives(shape, c), memory(shape, c))
