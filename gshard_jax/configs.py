"""Experiment configs (ml-collections): the shared skeleton, the model families, and config -> model.

An experiment file in ``experiments/`` defines ``get_config()`` returning a
ConfigDict with ``model``, ``train``, ``mesh``, ``data``, ``pipeline`` and
``debug`` sections; the builders here fill in the parts families share, so each
file states only what makes it that experiment. The ConfigDict is what users
write and override (``--config.a.b=v``); the runtime reads a typed ``Config``
of frozen dataclasses (TrainConfig, MeshConfig, ...; the model section becomes
the models' own TransformerConfig and MoeConfig), made once by ``typed()`` where
a run starts. Each section's fields, defaults and comments are declared once, on
its dataclass. ``model.moe.num_experts = 0`` is a dense model; the
other "off" values are None, which the model dataclasses read as off:
``group_size = None`` one group per sequence, ``peer_bound = None`` no bound,
``router_logit_cap = None`` no cap, ``eval_capacity_factor = None`` the training
factor.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
from typing import Any, Mapping, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from .models.gating import GatingConfig
from .models.moe import MoeConfig
from .models.pipelined import PipelineConfig
from .models.transformer import DecoderLM, EncoderDecoder, TransformerConfig

ConfigDict = ml_collections.ConfigDict
HELD_OUT = 0.05  # default fraction of files held out (data.held_out)
MAX_BYTES = 8 << 20  # default corpus size cap, the standard library sources (data.max_bytes)


# --------------------------------------------------------------------------- the sections, typed
# Each section's fields and defaults are declared once, here; the ConfigDict sections experiments edit are
# built from them (train_defaults() ...), and typed() turns a ConfigDict back into them.

@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The training section (Mula's recipe, seed 001, docs/references.md, at a small scale by default)."""
    num_steps: int = 1000  # optimiser steps
    batch_size: int = 16  # sequences per step (global)
    seq_len: int = 128  # tokens per sequence
    learning_rate: float = 4e-4  # peak, after linear warmup
    min_learning_rate: float = 4e-5  # cosine decay floor
    warmup_steps: int = 100  # linear warmup; gradient clipping starts after it
    decay_steps: int = 0  # step at which the cosine decay reaches min_learning_rate (0: num_steps)
    b1: float = 0.9  # AdamW's first moment decay
    b2: float = 0.99  # AdamW's second moment decay
    eps: float = 1e-8  # AdamW's denominator epsilon
    weight_decay: float = 0.1  # on all params
    clip_norm: float = 1.0  # global gradient norm clip (after warmup)
    checkpoint_every: int = 200  # full checkpoint (params + optimiser), two newest kept
    model_checkpoint_every: int = 1000  # params-only checkpoint, kept for good
    log_every: int = 10  # metrics.jsonl / progress cadence
    eval_every: int = 100  # held-out loss cadence
    eval_batches: int = 4  # batches per held-out evaluation
    seed: int = 0  # params, data order and routing randomness
    nan_policy: str = "halt"  # non-finite loss or grad norm: "halt" or "skip" the step
    async_checkpoints: bool = True  # write checkpoints in the background
    # replicated arrays written 1/R by each of their R replicas (scattered)
    checkpoint_replica_parallel: bool = True
    checkpoint_single_read: bool = True  # arrays replicated over host groups read by group 0 and broadcast
    # the hardware profile (partitioner/costs/hardware.py: a name or a JSON file) whose peak mfu divides by; "auto": the
    # built-in profile of the devices the run has (their device_kind: h100-8 on an H100, cpu-simulation on CPU)
    hardware: str = "auto"
    peak_flops: float = 0.0  # flop/s of one device for the mfu metric (0: the hardware profile's peak_flops)
    goldfish_k: int = 0  # goldfish loss: drop ~1/k of target tokens from the loss (0 or 1: off; AxoNN uses 2)
    goldfish_h: int = 13  # goldfish loss: tokens of context hashed to choose the dropped ones
    # sharded state over the data-parallel axes: 0 none, 1 optimizer state, 2 + gradients, 3 + params
    zero_stage: int = 0
    epso: bool = True  # zero_stage >= 1 with an expert axis: non-expert states over data x expert (seed 001's EPSO)
    microbatches: int = 1  # gradient accumulation: the batch split into this many microbatches, one update
    # AdamW's moments (and bf16's f32 master weights) in pinned_host memory between steps
    offload_optimizer: bool = False
    # with offload_optimizer: a step's update applies the previous step's gradients, so the host's update runs
    # beside the device's forward and backward (ZeRO-Offload's delayed parameter update; one step stale)
    delayed_update: bool = False
    # with offload_optimizer: the host's update as this many host computations over leaves of about equal
    # size, none depending on another, so XLA:GPU may run them at once on its host threads (up to 8); 1: one
    host_update_groups: int = 1
    # before the first step the compiled step's memory is checked against one device's: this many GiB (0: the
    # device's own limit, the host's memory over its simulated CPU devices, or the hardware profile's
    # memory_gib); a run that needs more exits with the breakdown and the options that would fit
    memory_limit_gib: float = 0.0
    memory_check: bool = True  # False: start without the check (a step over the limit fails when it runs)


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """The data section: where tokens come from (see gshard_jax/training/data.py)."""
    dir: str = ""  # prepared token shards ("": WORKDIR/data, prepared on first use)
    source: str = ""  # directory of text files to prepare from ("": the Python standard library's sources)
    tokenizer: str = ""  # tokenizer.json to use ("": train a byte-level BPE of model.vocab_size on the corpus)
    held_out: float = HELD_OUT  # fraction of files held out for eval_loss
    max_bytes: int = MAX_BYTES  # default corpus: at most this many bytes of source
    eval_seed: int = 0  # the held-out windows eval_loss reads, whatever train.seed: runs of any seed, one text


@dataclasses.dataclass(frozen=True)
class ScheduleConfig:
    """The pipeline section: how the layer stack runs over mesh.stage stages (train.microbatches per step);
    with the stage count it becomes the model's PipelineConfig (pipeline_config)."""
    schedule: str = "gpipe"  # "gpipe", "circular", "1f1b" or "interleaved_1f1b" (gshard_jax/pipelines/schedules.py)
    repeats: int = 1  # layer chunks per stage for "circular" and "interleaved_1f1b" (bubble / repeats)
    # "1f1b" and "interleaved_1f1b" on an untied decoder LM: the first stage owns the embedding and the last the
    # final norm and unembedding (Megatron's layout), so their gradients never cross the stage axis; False keeps
    # them replicated over the stages, their gradients all-reduced over it (docs/pipeline.md)
    owned_ends: bool = True


NOT_AXES = ("auto", "memory_budget")  # the mesh section's fields that are not axis sizes


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """The mesh section: axis sizes (one may be -1: the devices the others leave); axes of size 1 are left out
    of the mesh. The models' rules table (model.rules) says what each axis splits."""
    stage: int = 1  # pipeline stages: the layer stack split into this many stages (see the pipeline section)
    data: int = 1  # data parallelism: the batch split, weights replicated (their states sharded under ZeRO)
    z: int = 1  # AxoNN's depth axis: the batch split and weights stored split, gathered per layer (FSDP)
    expert: int = 1  # expert parallelism: experts split, and the batch with them outside MoE layers
    context: int = 1  # context parallelism: each sequence split, its self-attention a ring (ring attention)
    y: int = 1  # tensor axis: heads, FFN units and vocabulary (alone: Megatron's column-then-row layout)
    x: int = 1  # tensor axis: the model width (with y: AxoNN's 3D layout, ordinary and transposed layers)
    model: int = 1  # another name for y, kept for older configs
    # True: the models' rules table is dropped and the partitioner chooses every sharding but the batch's
    # (gs.partition(auto=True)): the params' and optimizer state's too, kept from step to step
    auto: bool = False
    memory_budget: float = 0.0  # with auto: bytes per device the state, batch and outputs may hold (0: no limit)

    def sizes(self) -> dict[str, int]:
        """{axis: size} in name order: the mesh's axis order when mesh_order gives none (the order a
        ConfigDict section iterates in)."""
        return {name: getattr(self, name) for name in sorted(f.name for f in dataclasses.fields(self))
                if name not in NOT_AXES}

    def on(self, devices: int) -> dict[str, int]:
        """sizes() on `devices` devices: the -1 axis (at most one) takes what the others leave, which must
        divide it (the product is checked by the caller)."""
        sizes = self.sizes()
        known = math.prod(s for s in sizes.values() if s != -1)
        return {k: (devices // known if s == -1 else s) for k, s in sizes.items()}


@dataclasses.dataclass(frozen=True)
class DebugConfig:
    """The debug section: faults injected for tests and drills (gshard_jax/training/faults.py)."""
    nan_at_step: int = -1  # poison the loss of this step (1-based) with NaN (-1: never)
    fail_process: int = -1  # the node (process index, or GSHARD_JAX_NODE under `gshard-jax launch`) that fails
    fail_at_step: int = -1  # ... by dying (os._exit, no cleanup) at the start of this step (-1: never)
    hang_at_step: int = -1  # ... by hanging at the start of this step (-1: never)
    soft_fail_process: int = -1  # the node whose rows' backward turns NaN (a soft failure; -1: none) ...
    soft_fail_at_step: int = -1  # ... at this step (-1: never)


def train_defaults() -> ConfigDict:
    """The training section: TrainConfig's defaults."""
    return ConfigDict(dataclasses.asdict(TrainConfig()))


def data_defaults() -> ConfigDict:
    """The data section: DataConfig's defaults."""
    return ConfigDict(dataclasses.asdict(DataConfig()))


def pipeline_defaults() -> ConfigDict:
    """The pipeline section: ScheduleConfig's defaults."""
    return ConfigDict(dataclasses.asdict(ScheduleConfig()))


def mesh_defaults() -> ConfigDict:
    """The mesh section: MeshConfig's defaults (every axis 1)."""
    return ConfigDict(dataclasses.asdict(MeshConfig()))


def skeleton(model: ConfigDict, mesh: dict, **train: Any) -> ConfigDict:
    """A full experiment config around a model section."""
    cfg = ConfigDict()
    cfg.model = model
    cfg.train = train_defaults()
    cfg.train.update(train)
    cfg.mesh = mesh_defaults()
    cfg.mesh.update(mesh)
    cfg.mesh_order = ""  # the mesh axes outermost first, comma-separated ("": the mesh section's order)
    cfg.data = data_defaults()
    cfg.pipeline = pipeline_defaults()
    cfg.debug = ConfigDict(dataclasses.asdict(DebugConfig()))
    return cfg


def moe_section(num_experts: int = 0, d_ff: int = 0, activation: str = "relu", k: int = 2, **kw: Any) -> ConfigDict:
    """model.moe: every field of MoeConfig and of its GatingConfig, flat, with their defaults (one place
    declares each: the dataclasses); num_experts = 0 gives a dense model. None turns an optional field off."""
    fields = {f.name: f.default for f in dataclasses.fields(MoeConfig) if f.name != "gating"}
    fields.update({f.name: f.default for f in dataclasses.fields(GatingConfig)})
    sec = ConfigDict(dict(fields, num_experts=num_experts, d_ff=d_ff, activation=activation, k=k))
    unknown = sorted(set(kw) - set(fields))
    if unknown:
        raise ValueError(f"moe_section: unknown fields {unknown}; MoeConfig and GatingConfig have {sorted(fields)}")
    sec.update(kw)
    return sec


# TransformerConfig fields the model section does not hold: moe is its own subsection, and the run decides the
# pipeline and the ends' stages (build_model, from the mesh and the pipeline section)
NOT_IN_SECTION = ("moe", "pipeline", "end_stages")


def model_section(kind: str, moe: ConfigDict, **kw: Any) -> ConfigDict:
    """model: architecture ("decoder_lm" or "encoder_decoder") and sizes; see TransformerConfig's fields."""
    base = {f.name: f.default for f in dataclasses.fields(TransformerConfig) if f.name not in NOT_IN_SECTION}
    sec = ConfigDict(dict(kind=kind, **base))
    sec.update(kw)
    sec.moe = moe
    return sec


def gshard(num_experts: int, num_layers: int, **kw: Any) -> ConfigDict:
    """GShard's M4 MoE Transformer (GShard; docs/references.md): M 1024, H 8192, 16 heads, L/2 encoder and decoder
    layers, every other FFN top-2 MoE; num_experts = 0 gives the dense T(L)."""
    moe = moe_section(num_experts, 8192, "relu", 2, capacity_factor=2.0, group_size=1024)
    model = model_section("encoder_decoder", moe, vocab_size=32000, d_model=1024, num_heads=16, head_dim=64,
                          d_ff=8192, ffn_activation="relu", num_layers=num_layers // 2,
                          num_decoder_layers=num_layers // 2, moe_every=2, norm="layernorm", rope=False,
                          tie_embeddings=True, scan=True, remat="full", dtype="bfloat16", **kw)
    return skeleton(model, dict(data=1, expert=-1), batch_size=4096, seq_len=1024)


def mula(num_layers: int, d_model: int, num_heads: int, d_ff: int, num_experts: int = 0, **kw: Any) -> ConfigDict:
    """Mula (seed 001; docs/references.md): OLMoE architecture (RMSNorm, RoPE, SwiGLU, untied embeddings, vocabulary
    50304), every layer MoE with 8 of num_experts; num_experts = 0: the dense Mula-1B."""
    moe = moe_section(num_experts, d_ff if num_experts else 0, "swiglu", 8, second_policy="all", normalize="none",
                      balance="all", dispatch="dropless")
    model = model_section("decoder_lm", moe, vocab_size=50304, d_model=d_model, num_heads=num_heads, head_dim=128,
                          d_ff=d_ff, ffn_activation="swiglu", num_layers=num_layers, moe_every=1, norm="rmsnorm",
                          rope=True, tie_embeddings=False, scan=True, remat="dots", dtype="bfloat16", **kw)
    # seed 001 trained every Mula model with a global batch of 6.3M tokens: 3,072 sequences of 2,048 (one per
    # tile of 3,072 Aurora tiles)
    return skeleton(model, dict(data=-1, expert=1), batch_size=3072, seq_len=2048, warmup_steps=2500)


def gpt(num_layers: int, d_model: int, num_heads: int, batch_size: int = 256) -> ConfigDict:
    """AxoNN's GPT (seed 003, Table II shapes): a dense decoder LM with LayerNorm and a GELU MLP of 4 x d_model,
    heads of 128, sequences of 2048 tokens; data parallel over every device by default."""
    cfg = mula(num_layers=num_layers, d_model=d_model, num_heads=num_heads, d_ff=4 * d_model)
    cfg.model.update(dict(ffn_activation="gelu", norm="layernorm", head_dim=128))
    cfg.mesh.update(dict(data=-1))
    cfg.train.update(dict(batch_size=batch_size, seq_len=2048))
    return cfg


# --------------------------------------------------------------------------- config -> model

KINDS = {"decoder_lm": DecoderLM, "encoder_decoder": EncoderDecoder}  # model.kind -> the Flax module


def moe_config(moe: Mapping[str, Any]) -> MoeConfig:
    """The MoeConfig (with its GatingConfig) of a flat model.moe section."""
    gating = {f.name for f in dataclasses.fields(GatingConfig)}
    known = gating | {f.name for f in dataclasses.fields(MoeConfig)} - {"gating"}
    unknown = sorted(set(moe) - known)
    if unknown:
        raise ValueError(f"model.moe has unknown fields {unknown}; MoeConfig and GatingConfig have {sorted(known)}")
    return MoeConfig(gating=GatingConfig(**{k: v for k, v in moe.items() if k in gating}),
                     **{k: v for k, v in moe.items() if k not in gating})


def transformer_config(model: ConfigDict) -> TransformerConfig:
    """The TransformerConfig a config's model section describes."""
    m = model.to_dict() if isinstance(model, ConfigDict) else dict(model)
    moe = m.pop("moe")
    m.pop("kind")
    if "rules" in m:  # a table read back from JSON has lists where the config had tuples
        m["rules"] = tuple((name, tuple(axes) if isinstance(axes, list) else axes) for name, axes in m["rules"])
    known = {f.name for f in dataclasses.fields(TransformerConfig)}
    unknown = sorted(set(m) - known)
    if unknown:
        raise ValueError(f"model config has unknown fields {unknown}; TransformerConfig has {sorted(known)}")
    if isinstance(m.get("remat_modules"), list):
        m["remat_modules"] = tuple(m["remat_modules"])
    return TransformerConfig(moe=moe_config(moe) if moe["num_experts"] else None, **m)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The model section, typed: the architecture and the dataclasses the model modules take."""
    kind: str  # "decoder_lm" or "encoder_decoder" (KINDS)
    transformer: TransformerConfig  # sizes and options; its moe is None for a dense model
    moe: MoeConfig  # the moe section as written, a dense model's too (num_experts = 0, unused)

    def to_dict(self) -> dict:
        """The section as a ConfigDict holds it: kind, TransformerConfig's fields, moe flat (model_section)."""
        out = {"kind": self.kind}
        out.update({f.name: getattr(self.transformer, f.name) for f in dataclasses.fields(TransformerConfig)
                    if f.name not in NOT_IN_SECTION})
        moe = {f.name: getattr(self.moe, f.name) for f in dataclasses.fields(MoeConfig) if f.name != "gating"}
        moe.update(dataclasses.asdict(self.moe.gating))
        return dict(out, moe=moe)


def model_config(model: ModelConfig | ConfigDict) -> ModelConfig:
    """The ModelConfig of a config's model section (a ModelConfig is returned as it is)."""
    if isinstance(model, ModelConfig):
        return model
    if model.kind not in KINDS:
        raise ValueError(f"model.kind={model.kind!r}; expected one of {tuple(KINDS)}")
    return ModelConfig(model.kind, transformer_config(model), moe_config(model.moe))


@dataclasses.dataclass(frozen=True)
class Config:
    """An experiment config, typed: what the runtime reads. Experiments write ConfigDicts (the user-facing
    format, with --config.a.b=v overrides); typed() turns one into a Config once, where a run starts."""
    model: ModelConfig  # the architecture (model_section)
    train: TrainConfig = TrainConfig()  # the optimiser, cadences, ZeRO stage, microbatches, NaN policy
    mesh: MeshConfig = MeshConfig()  # axis sizes
    mesh_order: str = ""  # the mesh axes outermost first, comma-separated ("": MeshConfig.sizes()'s order)
    data: DataConfig = DataConfig()  # where tokens come from
    pipeline: ScheduleConfig = ScheduleConfig()  # the schedule over mesh.stage stages
    debug: DebugConfig = DebugConfig()  # injected faults

    def to_dict(self) -> dict:
        """The config as its ConfigDict holds it (to_dict() of each section, in skeleton()'s order)."""
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            out[f.name] = v.to_dict() if isinstance(v, ModelConfig) else v if isinstance(v, str) else \
                dataclasses.asdict(v)
        return out

    def to_json(self, indent: Optional[int] = None) -> str:
        """The JSON a run records in WORKDIR/config.json (what ConfigDict.to_json writes for its ConfigDict)."""
        return json.dumps(self.to_dict(), indent=indent)


SECTIONS = {"train": TrainConfig, "mesh": MeshConfig, "data": DataConfig, "pipeline": ScheduleConfig,
            "debug": DebugConfig}  # Config's sections besides model, by name


def section(cls: type, name: str, values: Mapping[str, Any]) -> Any:
    """The dataclass `cls` of a config section's values: missing fields take their defaults (configs written
    before the field existed); a field `cls` does not have is a ValueError naming it."""
    if dataclasses.is_dataclass(values):
        return values
    values = values.to_dict() if isinstance(values, ConfigDict) else dict(values)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"{name} has unknown fields {unknown}; {cls.__name__} has {sorted(known)}")
    return cls(**values)


def typed(cfg: Config | ConfigDict) -> Config:
    """The Config of an experiment ConfigDict (a Config is returned as it is): the one conversion, made where
    a run starts, after the --config overrides."""
    if isinstance(cfg, Config):
        return cfg
    unknown = sorted(set(cfg.keys()) - {f.name for f in dataclasses.fields(Config)})
    if unknown:
        raise ValueError(f"the config has unknown entries {unknown}; a config has "
                         f"{[f.name for f in dataclasses.fields(Config)]} (configs.skeleton)")
    parts = {name: section(cls, name, cfg[name]) for name, cls in SECTIONS.items() if name in cfg}
    return Config(model=model_config(cfg.model), mesh_order=cfg.get("mesh_order", ""), **parts)


def build_model(model: ModelConfig | ConfigDict, train: bool = False, pipeline: Optional[PipelineConfig] = None,
                end_stages: int = 1):
    """The Flax module a config's model section describes (its stacks pipelined when `pipeline` is given, its
    ends owned by the end stages when end_stages > 1: end_stages_of)."""
    model = model_config(model)
    cfg = model.transformer
    if pipeline is not None:  # the stage axis splits the scanned stack's stacked params
        cfg = dataclasses.replace(cfg, scan=True)
    return KINDS[model.kind](dataclasses.replace(cfg, pipeline=pipeline, end_stages=end_stages), train=train)


def end_stages_of(cfg: Config | ConfigDict, pipeline: Optional[PipelineConfig]) -> int:
    """The stage count of the model's stage-owned ends: the pipeline's stages where pipeline.owned_ends holds
    and the model allows it (an untied decoder LM), else 1. Not
    with the optimizer state offloaded: a checkpoint takes each end's owner slice, which JAX does not slice
    in host memory."""
    owned = cfg.pipeline.owned_ends if isinstance(cfg, Config) else cfg.pipeline.get("owned_ends", True)
    model = model_config(cfg.model)
    if (pipeline is None or not owned or model.kind != "decoder_lm"
            or model.transformer.tie_embeddings or cfg.train.offload_optimizer):
        return 1
    return pipeline.stages


def pipeline_config(cfg: Config | ConfigDict, stages: int) -> Optional[PipelineConfig]:
    """The model's pipeline from mesh.stage (resolved to `stages`), train.microbatches and the pipeline
    section; None without stages. A pipelined model is scanned whatever model.scan says."""
    if stages == 1:
        return None
    return PipelineConfig(stages=stages, microbatches=cfg.train.microbatches, schedule=cfg.pipeline.schedule,
                          repeats=cfg.pipeline.repeats)


def example_inputs(model: ModelConfig | ConfigDict, batch: int = 1, length: int = 8) -> tuple:
    """Token arrays with the right structure for init (shapes only matter)."""
    return example_tokens(model.kind, batch, length)


def example_tokens(kind: str, batch: int = 1, length: int = 8) -> tuple:
    """example_inputs of a model kind ("decoder_lm" or "encoder_decoder")."""
    tokens = jnp.zeros((batch, length), jnp.int32)
    return (tokens, tokens) if kind == "encoder_decoder" else (tokens,)


EXPERT_WEIGHTS = ("wi", "wi_gate", "wi_up", "wo")


def count_params(model: ModelConfig | ConfigDict) -> dict:
    """Total parameters and parameters active per token, from shapes alone (jax.eval_shape: nothing allocated)."""
    module = build_model(model)
    shapes = nn.unbox(jax.eval_shape(module.init, jax.random.key(0), *example_inputs(model)))
    total = active = 0
    cfg = module.cfg
    for path, leaf in jax.tree_util.tree_flatten_with_path(shapes)[0]:
        keys = [getattr(k, "key", str(k)) for k in path]
        n = int(leaf.size)
        total += n
        if cfg.moe is not None and "moe" in keys and keys[-1] in EXPERT_WEIGHTS:
            n = n * cfg.moe.gating.k // cfg.moe.num_experts
        active += n
    return {"total_params": total, "active_params": active}


def load(path: str) -> ConfigDict:
    """get_config() of the experiment file at `path`."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"config file {path!r} does not exist; experiments live in experiments/*.py")
    spec = importlib.util.spec_from_file_location(f"gshard_jax_experiment_{os.path.basename(path)[:-3]}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    if not hasattr(mod, "get_config"):
        raise ValueError(f"{path} defines no get_config(); an experiment file returns its ConfigDict from it")
    return mod.get_config()


def on_platform(cfg: ConfigDict, platform: str) -> ConfigDict:
    """A copy of cfg with its "auto" choices as they resolve where the step runs (`platform`: "cpu", "gpu",
    "tpu"), not on this process's backend: the dropless exchange, and the attention kernel (cuDNN's on a GPU,
    with heads it takes, where this process has the CUDA plugin to trace it; else einsum's). A step compiled
    for another platform's target, or planned for it, is then the one the run there gets."""
    from .models import dropless, layers
    from .partitioner.representation.jax_compat import cudnn_installed
    if platform == jax.default_backend():  # the model resolves them here as the run does
        return cfg
    if isinstance(cfg, Config):
        return typed(on_platform(ConfigDict(cfg.to_dict()), platform))
    out = cfg.copy_and_resolve_references()
    m = out.model
    if m.moe.num_experts:
        m.moe.exchange = dropless.exchange_for(m.moe.get("exchange", "auto"), platform)
    if m.get("attention", "auto") == "auto":
        cudnn = platform == "gpu" and layers.cudnn_takes(m.dtype, m.head_dim) and cudnn_installed()
        m.attention = "cudnn" if cudnn else "einsum"
    return out


def flops_per_token(active_params: int, layers: int, d_model: int, seq: int) -> float:
    """Model flops per trained token (forward and backward): 6 per active parameter plus attention's
    12 L d S (Narayanan et al.; what MFU divides by peak). layers: every layer (an encoder-decoder's both
    stacks)."""
    return 6 * active_params + 12 * layers * d_model * seq


def model_flops_per_token(cfg: Config | ConfigDict) -> float:
    """flops_per_token of a config's model at its train.seq_len."""
    m = model_config(cfg.model)
    layers = m.transformer.num_layers * (2 if m.kind == "encoder_decoder" else 1)
    return flops_per_token(count_params(m)["active_params"], layers, m.transformer.d_model, cfg.train.seq_len)
