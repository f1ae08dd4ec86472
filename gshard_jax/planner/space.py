"""The configurations a planner ranks, and the reasons one cannot run.

A candidate is a mesh (axis sizes whose product is the device count, laid out outermost first over the
hardware's levels), a ZeRO stage, EPSO, microbatches, a pipeline schedule with its repeats and a remat
policy. Sizes come from every factorisation of the device count over the seven axes, not only powers of
two.
A mesh that cannot run the model (an axis that does not divide what it splits, a batch that does not divide
over its shards, a layer stack that does not divide into stages) is rejected once, with one reason.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import Iterator, Optional, Sequence

import ml_collections

from ..pipelines import schedules as SC

AXES = ("stage", "data", "z", "expert", "context", "y", "x")  # the config's mesh section, outermost first
REMATS = ("none", "dots", "full")
ZERO_STAGES = (0, 1, 2, 3)
MAX_MICROBATCHES = 64
MAX_REPEATS = 8  # the circular schedules' repeats tried: each that divides a stage's layer periods, up to this


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What the planner needs of a config's model and batch (from the config; parameters by kind from shapes)."""

    kind: str  # "decoder_lm" or "encoder_decoder"
    layers: int  # layers of the pipelined stack (an encoder-decoder: of each stack)
    periods: int  # layer periods (a period is moe_every layers, the unit a stage holds)
    d_model: int
    heads: int
    head_dim: int
    d_ff: int
    vocab: int
    experts: int  # 0: dense
    k: int  # experts chosen per token
    capacity_factor: float
    batch: int  # sequences per step
    seq: int  # tokens per sequence
    param_bytes: int  # 2 (bf16) or 4
    expert_params: int  # parameters of expert weights (split over the expert axis)
    layer_params: int  # other parameters of the layer stacks
    vocab_params: int  # embedding and LM head
    active_params: int  # per token
    dropless: bool = False  # experts dispatched by sort + grouped matmul in a manual region (moe.dispatch)
    exchange: str = "all_to_all"  # how dropless tokens reach their experts (moe.exchange, "auto" resolved)
    peer_bound: float = 0.0  # dropless all-to-all buffer per peer, in multiples of rows / peers (0: none)
    ffn_inputs: int = 1  # the FFN's input matrices: 2 under SwiGLU (gate and up), else 1
    fused_attention: bool = False  # attention by a fused kernel (cuDNN's): no [heads, S] scores kept per token
    scan: bool = False  # the layer periods run as one scan: stored split, the next layer's weights are gathered
    # during the current one's (partitioner/strategies/prefetch.py)
    # under a 1F1B schedule the end stages own the embedding and head (configs.end_stages_of): an untied decoder
    # LM with pipeline.owned_ends (a candidate with its optimizer state offloaded keeps them replicated)
    owned_ends: bool = False
    group: int = 0  # tokens per routing group of an einsum-dispatched MoE (models/moe.groups: S of its [G, S, E, C])
    # bytes of an activation the step keeps: the compute dtype's, but 4 where XLA runs bf16 in float32 (XLA:CPU)
    activation_bytes: int = 4
    platform: str = "cpu"  # whose compiler holds the step (partitioner/costs/compilers.py)

    @property
    def total_params(self) -> int:
        return self.expert_params + self.layer_params + self.vocab_params

    @property
    def tokens(self) -> int:
        return self.batch * self.seq


def model_shape(cfg: ml_collections.ConfigDict, platform: str = "") -> ModelShape:
    """The ModelShape of a config (its parameters counted from shapes with jax.eval_shape: nothing allocated) on
    a profile's `platform`, which decides what model.attention="auto" runs (models/layers.py)."""
    import flax.linen as nn
    import jax

    from .. import configs
    from ..models import dropless
    from ..models.moe import groups as moe_groups
    from ..partitioner.costs import compilers
    m, t = cfg.model, cfg.train
    counted = m.copy_and_resolve_references()
    if "attention" in counted:  # parameters do not depend on it; cuDNN's kernel only traces where it runs
        counted.attention = "einsum"
    module = configs.build_model(counted)
    boxed = jax.eval_shape(module.init, jax.random.key(0), *configs.example_inputs(m))
    specs = jax.tree_util.tree_leaves(nn.get_partition_spec(boxed), is_leaf=lambda x: isinstance(x, tuple))
    shapes = jax.tree_util.tree_leaves(nn.unbox(boxed))
    expert = layer = vocab = 0
    for spec, leaf in zip(specs, shapes):
        names = set(spec or ())
        if "expert" in names:
            expert += leaf.size
        elif "vocab" in names:
            vocab += leaf.size
        else:
            layer += leaf.size
    moe = m.moe
    k = moe.k if moe.num_experts else 0
    active = layer + vocab + (expert * k // moe.num_experts if moe.num_experts else 0)
    period = max(1, m.moe_every) if moe.num_experts else 1
    param_bytes = 2 if m.dtype == "bfloat16" else 4
    return ModelShape(kind=m.kind, layers=m.num_layers, periods=m.num_layers // period, d_model=m.d_model,
                      heads=m.num_heads, head_dim=m.head_dim, d_ff=m.d_ff if not moe.num_experts else moe.d_ff,
                      vocab=m.vocab_size, experts=moe.num_experts, k=k,
                      capacity_factor=float(moe.capacity_factor) if moe.num_experts else 1.0,
                      batch=t.batch_size, seq=t.seq_len, param_bytes=param_bytes,
                      expert_params=int(expert), layer_params=int(layer), vocab_params=int(vocab),
                      active_params=int(active),
                      dropless=bool(moe.num_experts) and moe.get("dispatch", "einsum") == "dropless",
                      exchange=dropless.exchange_for(moe.get("exchange", "auto"), platform or "cpu"),
                      peer_bound=float(moe.get("peer_bound") or 0.0),
                      ffn_inputs=2 if (moe.activation if moe.num_experts else m.ffn_activation) == "swiglu" else 1,
                      fused_attention=fused_attention(m, platform), scan=bool(m.get("scan", False)),
                      owned_ends=(m.kind == "decoder_lm" and not m.get("tie_embeddings", False)
                                  and cfg.get("pipeline", {}).get("owned_ends", True)),
                      activation_bytes=compilers.of(platform or "cpu").bytes_of(m.dtype, param_bytes),
                      platform=platform or "cpu",
                      group=moe_groups(t.batch_size * t.seq_len, t.batch_size, configs.moe_config(moe))[1]
                      if moe.num_experts else 0)


def config_mesh(cfg: ml_collections.ConfigDict, devices: int) -> Optional[dict]:
    """The config's own mesh section on `devices` devices ({axis: size} over AXES; its -1 axis takes what the
    others leave; `model` is y's other name), or None where it does not resolve to exactly that many."""
    from .. import configs
    mesh = configs.section(configs.MeshConfig, "mesh", cfg.mesh)
    given = mesh.sizes()
    if list(given.values()).count(-1) > 1:
        return None
    sizes = mesh.on(devices)
    if math.prod(sizes.values()) != devices:
        return None
    model = sizes.pop("model")
    return {a: sizes[a] * model if a == "y" else sizes[a] for a in AXES}


def fused_attention(m: ml_collections.ConfigDict, platform: str) -> bool:
    """Whether the model's attention runs cuDNN's fused kernel on `platform`: model.attention="cudnn", or
    "auto" on a GPU with the heads cuDNN takes (layers.attention_implementation's test, by the config)."""
    from ..models import layers
    choice = m.get("attention", "auto")
    if choice == "auto":
        return platform == "gpu" and layers.cudnn_takes(m.dtype, m.head_dim)
    return choice == "cudnn"


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One configuration: mesh axes of size > 1 outermost first, and the training options."""

    mesh: tuple[tuple[str, int], ...]
    zero_stage: int = 0
    epso: bool = True
    microbatches: int = 1
    schedule: str = "none"  # "none" without a stage axis, else one of schedules.SCHEDULES
    repeats: int = 1
    remat: str = "none"
    sequence_parallel: bool = False  # the residual stream split over y between its layers (planned as a twin)
    offload: bool = False  # optimizer state in host memory (tried where the candidate does not fit without it)

    def __post_init__(self):  # sizes are read for every candidate screened: computed once
        sizes = dict.fromkeys(AXES, 1)
        sizes.update(self.mesh)
        object.__setattr__(self, "_sizes", sizes)

    def size(self, axis: str) -> int:
        return self._sizes[axis]

    @property
    def sizes(self) -> dict[str, int]:
        return dict(self._sizes)

    @property
    def order_key(self) -> tuple:
        """A total order of candidates (ties in the ranking are broken by it: deterministic)."""
        return (self.mesh, self.zero_stage, self.epso, self.microbatches, self.schedule, self.repeats, self.remat,
                self.sequence_parallel, self.offload)

    @property
    def batch_shards(self) -> int:
        return self.size("data") * self.size("z") * self.size("expert")

    @property
    def token_shards(self) -> int:
        """Devices a step's tokens are spread over: the batch's shards, each sequence split over context."""
        return self.batch_shards * self.size("context")

    @property
    def key(self) -> str:
        """A short unique name, e.g. "stage4.data8.expert16 zero1 epso m16 1f1b remat=dots"."""
        mesh = ".".join(f"{a}{n}" for a, n in self.mesh) or "one-device"
        parts = [mesh, f"zero{self.zero_stage}"]
        if self.zero_stage and self.size("expert") > 1:
            parts.append("epso" if self.epso else "no-epso")
        parts.append(f"m{self.microbatches}")
        if self.schedule != "none":
            parts.append(self.schedule + (f"x{self.repeats}" if self.repeats > 1 else ""))
        parts.append(f"remat={self.remat}")
        if self.sequence_parallel:
            parts.append("sp")
        if self.offload:
            parts.append("offload")
        return " ".join(parts)

    def overrides(self) -> list[str]:
        """The `gshard-jax train` overrides that run this candidate."""
        out = [f"--config.mesh.{a}={self.size(a)}" for a in AXES]
        out += ["--config.mesh.model=1", f"--config.mesh_order={','.join(a for a, _ in self.mesh)}",
                f"--config.train.zero_stage={self.zero_stage}", f"--config.train.epso={self.epso}",
                f"--config.train.microbatches={self.microbatches}", f"--config.model.remat={self.remat}",
                f"--config.model.sequence_parallel={self.sequence_parallel}",
                f"--config.train.offload_optimizer={self.offload}"]
        if not self.offload:  # the options of an offloaded update go with it
            out += ["--config.train.delayed_update=False", "--config.train.host_update_groups=1"]
        if self.schedule != "none":
            out += [f"--config.pipeline.schedule={self.schedule}", f"--config.pipeline.repeats={self.repeats}"]
        return out

    def to_dict(self) -> dict:
        return {"key": self.key, "mesh": dict(self.mesh), "mesh_order": [a for a, _ in self.mesh],
                "zero_stage": self.zero_stage, "epso": self.epso, "microbatches": self.microbatches,
                "schedule": self.schedule, "repeats": self.repeats, "remat": self.remat,
                "sequence_parallel": self.sequence_parallel, "offload": self.offload}


@functools.lru_cache(maxsize=1024)
def divisors(n: int) -> tuple[int, ...]:
    return tuple(d for d in range(1, n + 1) if n % d == 0)


def factorizations(n: int, axes: Sequence[str]) -> Iterator[dict[str, int]]:
    """Every assignment of sizes to `axes` whose product is n (in a fixed order: deterministic)."""
    if len(axes) == 1:
        yield {axes[0]: n}
        return
    for d in divisors(n):
        for rest in factorizations(n // d, axes[1:]):
            yield {axes[0]: d, **rest}


def mesh_reason(shape: ModelShape, sizes: dict[str, int]) -> Optional[str]:
    """Why a mesh cannot run the model (one reason), or None."""
    e, y, x, z, p, cx = (sizes[a] for a in ("expert", "y", "x", "z", "stage", "context"))
    if e > 1 and not shape.experts:
        return f"experts: a dense model has no experts for expert={e} (its batch split is data's)"
    if e > 1 and shape.experts % e:
        return f"experts: expert={e} does not divide the {shape.experts} experts"
    for what, n in (("heads", shape.heads), ("FFN units", shape.d_ff), ("vocabulary", shape.vocab)):
        if y > 1 and n % y:
            return f"indivisible: y={y} does not divide the {n} {what}"
    if x > 1 and shape.d_model % x:
        return f"indivisible: x={x} does not divide d_model {shape.d_model}"
    if cx > 1 and shape.kind != "decoder_lm":
        return (f"context: context={cx} runs the decoder-only LM's self-attention as a ring; the "
                f"encoder-decoder's masked attention would gather K/V")
    if cx > 1 and shape.seq % (2 * cx):
        return f"context: {shape.seq} tokens per sequence do not split into 2 x context = {2 * cx} zigzag chunks"
    shards = sizes["data"] * z * e
    if shape.batch % shards:
        return f"batch: {shape.batch} sequences do not split over data x z x expert = {shards}"
    if p > 1 and shape.periods % p:
        return f"layers per stage: {shape.periods} layer periods do not split into {p} stages"
    return None


def option_groups(shape: ModelShape, sizes: dict[str, int], remats: Sequence[str] = REMATS,
                  zero_stages: Sequence[int] = ZERO_STAGES) -> Iterator[tuple[tuple, Optional[str], list]]:
    """The training options on a mesh that runs the model, grouped by what decides whether they run:
    ((microbatches, schedule, repeats), reason they cannot run or None, [(zero_stage, epso, remat), ...]).
    Microbatches ascend and remat policies are innermost, lightest first (the order dominance reads)."""
    p, shards = sizes["stage"], sizes["data"] * sizes["z"] * sizes["expert"]
    micro = [m for m in divisors(shape.batch) if m <= MAX_MICROBATCHES and m & (m - 1) == 0]
    if p > 1:
        per_stage = shape.periods // p
        repeats = [r for r in range(2, MAX_REPEATS + 1) if per_stage % r == 0] or [2]  # [2]: named, rejected
        schedules = [(s, r) for s in SC.SCHEDULES for r in ((1,) if s in ("gpipe", "1f1b") else repeats)]
    else:
        schedules = [("none", 1)]
    variants = [(zero, epso, remat) for zero, epso, remat in itertools.product(
        zero_stages, (True, False) if sizes["expert"] > 1 else (True,), remats)
        if epso or zero]  # EPSO shapes only sharded states
    for m, (sched, r) in itertools.product(micro, schedules):
        reason = None
        if (shape.batch // m) % shards:
            reason = f"batch: {shape.batch // m} sequences per microbatch do not split over {shards} batch shards"
        elif p > 1 and shape.periods % (p * r):
            reason = f"layers per stage: {shape.periods} periods do not split into {p} stages x {r} repeats"
        elif p > 1 and r > 1 and m % p:
            reason = f"schedule: {sched} with repeats needs microbatches a multiple of the {p} stages"
        elif p > 1 and m < p:
            reason = f"schedule: {m} microbatches leave stages idle for all but {m} of {p} ticks; use m >= {p}"
        elif p > 1 and shape.kind == "encoder_decoder" and sched in SC.OWN_BACKWARD:
            reason = f"schedule: {sched} is built for decoder-only LMs"
        yield (m, sched, r), reason, variants


def options(shape: ModelShape, sizes: dict[str, int], remats: Sequence[str] = REMATS,
            zero_stages: Sequence[int] = ZERO_STAGES) -> Iterator[tuple[dict, Optional[str]]]:
    """The training options on a mesh that runs the model: (fields, reason it cannot run or None)."""
    for (m, sched, r), reason, variants in option_groups(shape, sizes, remats, zero_stages):
        for zero, epso, remat in variants:
            yield dict(zero_stage=zero, epso=epso, microbatches=m, schedule=sched, repeats=r, remat=remat), reason


def orders(sizes: dict[str, int]) -> list[tuple[tuple[str, int], ...]]:
    """Every order (outermost first) of the axes of size > 1."""
    live = [(a, sizes[a]) for a in AXES if sizes[a] > 1]
    return [tuple(o) for o in itertools.permutations(live)] or [()]


def config_candidate(cfg: ml_collections.ConfigDict, devices: int) -> Optional[Candidate]:
    """The candidate a config runs on `devices` devices (its mesh section and training options), or None where
    its mesh does not resolve to that many."""
    sizes = config_mesh(cfg, devices)
    if sizes is None:
        return None
    t, m = cfg.train, cfg.model
    staged = sizes["stage"] > 1
    pipeline = cfg.get("pipeline", ml_collections.ConfigDict())
    schedule = pipeline.get("schedule", "gpipe") if staged else "none"
    repeats = pipeline.get("repeats", 1) if schedule in ("circular", "interleaved_1f1b") else 1
    return Candidate(tuple((a, sizes[a]) for a in AXES if sizes[a] > 1), zero_stage=t.get("zero_stage", 0),
                     epso=t.get("epso", True), microbatches=t.get("microbatches", 1), schedule=schedule,
                     repeats=repeats, remat=m.get("remat", "none"),
                     sequence_parallel=bool(m.get("sequence_parallel", False)),
                     offload=bool(t.get("offload_optimizer", False)))
