"""MoE Transformers in Flax linen: GShard's encoder-decoder and an OLMoE/Mula-style decoder-only LM.

Every ``moe_every``-th FFN is an MoE layer (GShard: every other one; OLMoE:
all). Layers come in periods of ``moe_every`` blocks (the last one MoE); with
``scan=True`` the periods are one ``nn.scan`` (stacked params, one traced
body), and ``remat`` checkpoints each period with a chosen policy. Each block
returns its MoE losses (aux, z) and routing statistics as outputs (a scan's
per-period outputs, a pipeline's aux), summed (losses) and averaged
(statistics) over MoE layers. With ``pipeline`` set, the periods are split
over the ``stage`` mesh axis (models/pipelined.py). Sharding is the config's ``rules`` table (logical axis
-> mesh axes).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from . import layers
from .grouped import EXPERT_MATMUL
from .layers import cross_entropy
from .logical import DEFAULT_RULES, LAST_STAGE, Rules, constrain, sequence_parallel
from .moe import MoeConfig, MoeFFN
from .pipelined import PipelineConfig, loss_in_pipeline, pipelined, pipelined_loss

REMAT_POLICIES = {
    "none": None,  # no checkpointing
    "full": jax.checkpoint_policies.nothing_saveable,  # recompute the whole period in the backward pass
    # keep matmul outputs but attention's [heads, S, S] ones (batched over heads): the matmuls without batch dims
    # and the experts' (named: their expert or group dim is a batch dim), recompute the rest
    "dots": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_only_these_names(EXPERT_MATMUL)),
    "dots_saveable": jax.checkpoint_policies.dots_saveable,  # keep every matmul output
}


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    vocab_size: int = 256  # V (GShard: a shared sentencepiece vocabulary; OLMoE: 50304)
    d_model: int = 64  # D
    num_heads: int = 4  # H
    head_dim: int = 16  # K (per head)
    d_ff: int = 256  # dense FFN hidden units F
    ffn_activation: str = "relu"  # dense FFN: "relu" (GShard), "gelu" or "swiglu" (OLMo)
    num_layers: int = 2  # decoder-only: layers; encoder-decoder: encoder layers
    num_decoder_layers: int = 2  # encoder-decoder only: decoder layers
    moe: Optional[MoeConfig] = None  # the MoE FFN (None: dense model)
    moe_every: int = 2  # every k-th FFN is MoE (1: all, as in OLMoE)
    norm: str = "rmsnorm"  # "rmsnorm" (OLMo) or "layernorm" (GShard)
    rope: bool = True  # rotary positions; False: fixed sinusoidal positions added to the embeddings
    tie_embeddings: bool = False  # logits from the input embedding (True) or an untied unembedding (OLMo)
    scan: bool = False  # run the layer periods as one nn.scan
    remat: str = "none"  # checkpoint policy per period: "none" | "full" | "dots" | "dots_saveable"
    remat_modules: tuple = ()  # modules checkpointed each on its own (seed 001): any of REMAT_MODULES
    attention: str = "auto"  # "auto" (cudnn on a GPU, else einsum) | "einsum" | "xla" | "cudnn" (layers.py)
    dtype: str = "float32"  # compute dtype ("bfloat16" for mixed precision; params stay float32)
    rules: Rules = DEFAULT_RULES  # logical axis -> mesh axes table
    sequence_parallel: bool = False  # the residual stream split along its positions over y (sharding.py)
    pipeline: Optional[PipelineConfig] = None  # periods split over the `stage` mesh axis (None: no pipeline)
    # > 1: stage-owned ends (Megatron's layout, untied decoder LMs under a pipeline): the embedding, final
    # norm and unembedding lead with [end_stages], split over the stages; the first stage reads its slice of the
    # embedding and the last its slice of the head, so their gradients never cross the stage axis
    end_stages: int = 1
    aux_loss_weight: float = 0.01  # weight of the summed MoE aux (load-balancing) loss in the training loss
    z_loss_weight: float = 0.001  # weight of the summed router z-loss

    def __post_init__(self):
        if self.sequence_parallel:
            object.__setattr__(self, "rules", sequence_parallel(self.rules))

    @property
    def period(self) -> int:
        return self.moe_every if self.moe is not None else 1

    @property
    def compute_dtype(self):
        return jnp.dtype(self.dtype)


REMAT_MODULES = ("norm", "attention", "ffn", "moe")  # selective activation checkpointing by module


def check(cfg: TransformerConfig, decoder_only: bool) -> None:
    """A ValueError naming the first bad field of `cfg`."""
    if cfg.remat not in REMAT_POLICIES:
        raise ValueError(f"TransformerConfig.remat={cfg.remat!r}; expected one of {tuple(REMAT_POLICIES)}")
    if cfg.attention not in layers.ATTENTION_IMPLEMENTATIONS:
        raise ValueError(f"TransformerConfig.attention={cfg.attention!r}; expected one of "
                         f"{layers.ATTENTION_IMPLEMENTATIONS} (auto: cuDNN's fused attention on a GPU, else einsum)")
    bad = [m for m in cfg.remat_modules if m not in REMAT_MODULES]
    if bad or isinstance(cfg.remat_modules, str):
        raise ValueError(f"TransformerConfig.remat_modules={cfg.remat_modules!r}; expected a tuple of any of "
                         f"{REMAT_MODULES}, e.g. ('attention', 'moe')")
    if cfg.moe is not None and cfg.moe_every < 1:
        raise ValueError(f"TransformerConfig.moe_every={cfg.moe_every!r}; expected a positive int")
    if cfg.end_stages > 1:
        pc = cfg.pipeline
        if not decoder_only or cfg.tie_embeddings or (pc is not None and pc.stages != cfg.end_stages):
            raise ValueError(f"TransformerConfig.end_stages={cfg.end_stages}: stage-owned ends need an untied "
                             f"decoder-only LM (tie_embeddings={cfg.tie_embeddings}) and, with a pipeline, as "
                             f"many stages (pipeline={pc}); set end_stages=1 to keep the ends replicated over "
                             f"the stages")
    counts = [("num_layers", cfg.num_layers)]
    counts += [] if decoder_only else [("num_decoder_layers", cfg.num_decoder_layers)]
    for field, n in counts:
        if n % cfg.period:
            raise ValueError(f"TransformerConfig.{field}={n} is not a multiple of moe_every={cfg.moe_every}; "
                             f"layers come in periods of moe_every blocks (the last one MoE)")


MOE_LOSSES = ("aux_loss", "z_loss")  # summed over MoE layers (and microbatches, stages) into the training loss
MOE_STATS = ("dropped", "router_confidence")  # routing statistics, averaged over MoE layers
MOE_METRICS = MOE_LOSSES + MOE_STATS


def _sum(*trees: dict) -> dict:
    """Metrics dicts added key by key (a dense block's is empty)."""
    out: dict = {}
    for t in trees:
        for k, v in t.items():
            out[k] = out[k] + v if k in out else v
    return out


def _metrics(*parts: dict) -> dict:
    """The model's MoE metrics from the stacks' summed layer outputs: losses summed, statistics averaged."""
    total = _sum(*parts)
    layers_ = jnp.maximum(total.pop("moe_layers", 0.0), 1.0)
    return {k: jnp.asarray(total.get(k, 0.0), jnp.float32) / (1.0 if k in MOE_LOSSES else layers_)
            for k in MOE_METRICS}


class Block(nn.Module):
    """Pre-norm residual block: self-attention, optional cross-attention, dense or MoE FFN."""
    cfg: TransformerConfig
    causal: bool
    cross: bool
    moe: bool
    train: bool = False

    @nn.compact
    def __call__(self, x_BLD, enc_BTD=None, enc_mask_BT=None):
        """-> (x, metrics: the MoE layer's losses and statistics, {} for a dense block). enc_mask_BT: which
        source tokens are real; the encoder's self-attention (no `cross`) and the decoder's cross-attention
        read only those."""
        c, r, dt = self.cfg, self.cfg.rules, self.cfg.compute_dtype
        attn = dict(num_heads=c.num_heads, head_dim=c.head_dim, rules=r, dtype=dt, attention=c.attention)
        own = lambda cls, module: nn.remat(cls, static_argnums=(2,) if module == "moe" else ()) \
            if module in c.remat_modules else cls  # checkpointed on its own: recomputed in the backward pass
        norm = lambda name: layers.norm(c.norm, name, dt, remat="norm" in c.remat_modules)
        Attention = own(layers.Attention, "attention")
        h = norm("pre_attention_norm")(x_BLD)
        self_mask_BT = None if self.cross else enc_mask_BT
        x_BLD = x_BLD + Attention(causal=self.causal, use_rope=c.rope, name="attention", **attn)(
            h, None, self_mask_BT)
        if self.cross:
            h = norm("pre_cross_norm")(x_BLD)
            x_BLD = x_BLD + Attention(name="cross_attention", **attn)(h, enc_BTD, enc_mask_BT)
        h = norm("pre_ffn_norm")(x_BLD)
        if self.moe:
            y, losses, stats = own(MoeFFN, "moe")(c.moe, r, dt, name="moe")(h, self.train)
            metrics = {**losses, **{k: stats[k] for k in MOE_STATS}, "moe_layers": jnp.float32(1.0)}
        else:
            y = own(layers.Mlp, "ffn")(c.d_ff, r, c.ffn_activation, dt, name="mlp")(h)
            metrics = {}
        return constrain(x_BLD + y, ("batch", "seq", "embed"), r), metrics


class Period(nn.Module):
    """`period` blocks; the last one has the MoE FFN (when the model has one)."""
    cfg: TransformerConfig
    causal: bool
    cross: bool
    train: bool = False

    @nn.compact
    def __call__(self, x, enc_BTD=None, enc_mask_BT=None):
        """-> (x, the period's metrics): x is the scan carry, the metrics its per-period output."""
        metrics = []
        for j in range(self.cfg.period):
            moe = self.cfg.moe is not None and j == self.cfg.period - 1
            x, m = Block(self.cfg, self.causal, self.cross, moe, self.train, name=f"block_{j}")(
                x, enc_BTD, enc_mask_BT)
            metrics.append(m)
        return x, _sum(*metrics)


def _period_body(cfg: TransformerConfig):
    """Period, checkpointed as cfg.remat says."""
    if cfg.remat == "none":
        return Period
    return nn.remat(Period, policy=REMAT_POLICIES[cfg.remat], prevent_cse=not cfg.scan)


def scanned_periods(cfg: TransformerConfig, length: int):
    """`length` periods as one nn.scan: params stacked on a leading "layers" dim, metrics summed."""
    return nn.scan(_period_body(cfg), variable_axes={"params": 0}, split_rngs={"params": True, "gating": True},
                   in_axes=(nn.broadcast, nn.broadcast), length=length,
                   metadata_params={nn.PARTITION_NAME: "layers"})


def _looped(stack: "Stack", n: int, x, enc, mask):
    body = _period_body(stack.cfg)
    outs = [None] * n
    for i in range(n):
        x, outs[i] = body(stack.cfg, stack.causal, stack.cross, stack.train, name=f"period_{i}")(x, enc, mask)
    return x, _sum(*outs)


def _scanned(stack: "Stack", n: int, x, enc, mask):
    x, ys = scanned_periods(stack.cfg, n)(stack.cfg, stack.causal, stack.cross, stack.train, name="layers")(
        x, enc, mask)
    return x, jax.tree.map(lambda a: a.sum(0), ys)


# How a Stack runs its periods (MaxText's decoders.py swaps its pipeline in the same way): each takes the
# Stack, the period count and (x, encoder output, encoder mask) and returns (x, summed metrics).
def _pipelined(stack: "Stack", n: int, x, enc, mask):
    return pipelined(stack, n, x, enc, mask, periods=scanned_periods)


PERIOD_FACTORIES = {"loop": _looped, "scan": _scanned, "pipeline": _pipelined}


class Stack(nn.Module):
    """num_layers blocks as num_layers / period periods, looped, scanned or pipelined as configured."""
    cfg: TransformerConfig
    num_layers: int
    causal: bool
    cross: bool
    train: bool = False

    @nn.compact
    def __call__(self, x_BLD, enc_BTD=None, enc_mask_BT=None, head=None):
        """-> (x, metrics), or with head = (head_fn, head params, targets, aux weights) under a pipeline that
        runs the loss (pipelined.loss_in_pipeline), (loss, metrics) from models/pipelined.py's pipelined_loss."""
        c = self.cfg
        if head is not None:
            return pipelined_loss(self, self.num_layers // c.period, x_BLD, *head, periods=scanned_periods)
        how = "pipeline" if c.pipeline is not None else "scan" if c.scan else "loop"
        return PERIOD_FACTORIES[how](self, self.num_layers // c.period, x_BLD, enc_BTD, enc_mask_BT)


class DecoderLM(nn.Module):
    """Decoder-only LM (OLMo/OLMoE style): tokens [B, L] -> (logits [B, L, V], moe metrics)."""
    cfg: TransformerConfig
    train: bool = False

    @nn.compact
    def __call__(self, tokens_BL, targets_BL=None, weights_BL=None):
        """-> (logits, metrics); under a pipeline schedule that owns its backward pass (1F1B) or with stage-owned
        ends, the loss is computed inside the pipeline: (tokens, targets[, weights]) -> (training loss, metrics)."""
        c, r, dt = self.cfg, self.cfg.rules, self.cfg.compute_dtype
        check(c, decoder_only=True)
        E = c.end_stages
        embed = layers.Embed(c.vocab_size, c.d_model, r, dt, stages=E, name="embed")
        # over a context axis the sequence is held in zigzag order from here on: the logits too (loss_fn)
        tokens_BL = constrain(layers.in_context_order(tokens_BL, r), ("batch", "length"), r)
        owned = E > 1 and c.pipeline is not None  # the pipeline's stage 0 reads its own slice of x
        x = embed.per_stage(tokens_BL) if owned else embed(tokens_BL)
        L = tokens_BL.shape[1]
        if not c.rope:
            x = x + layers.sinusoid(L, c.d_model, layers.positions(L, r)).astype(dt)
        if loss_in_pipeline(c.pipeline, E):
            order = lambda t: None if t is None else layers.in_context_order(t, r)
            return self._loss_in_pipeline(embed, x, order(targets_BL), order(weights_BL))
        x, metrics = Stack(c, c.num_layers, causal=True, cross=False, train=self.train, name="decoder")(x)
        x = layers.norm(c.norm, "final_norm", dt, stages=E)(x)
        x = x[-1] if E > 1 else x  # stage-owned ends outside a pipeline: the last stage's head
        if c.tie_embeddings:
            logits = embed.attend(x)
        else:
            logits = jnp.einsum("BLD,DV->BLV", x, self._unembed()[-1] if E > 1 else self._unembed())
        return constrain(logits.astype(jnp.float32), ("batch", "length", "vocab"), r), _metrics(metrics)

    def _unembed(self) -> jax.Array:
        """The head's [D, V] weight, or [end_stages, D, V] owned by the last stage."""
        c = self.cfg
        if c.end_stages > 1:
            return layers.weight(self, "unembed", (c.end_stages, c.d_model, c.vocab_size),
                                 (LAST_STAGE, "embed", "vocab"), c.rules, c.compute_dtype, fan_in_axes=(1,))
        return layers.weight(self, "unembed", (c.d_model, c.vocab_size), ("embed", "vocab"), c.rules,
                             c.compute_dtype)

    def _loss_in_pipeline(self, embed, x_BLD, targets_BL, weights_BL):
        """The head and the loss run per microbatch at the last stage (the same params as __call__'s)."""
        c, r, dt = self.cfg, self.cfg.rules, self.cfg.compute_dtype
        if targets_BL is None:
            raise ValueError(f"pipeline schedule {c.pipeline.schedule!r} computes the loss inside the pipeline: "
                             f"call the model with (tokens, targets[, weights]), as loss_fn does")
        norm = layers.norm(c.norm, "final_norm", dt, stages=c.end_stages)
        norm(jnp.zeros((1, 1, c.d_model), dt))  # makes its params at init; the value is not used
        head_params = {"norm": norm.variables["params"]}  # stage-owned: each leaf leads with [stages]
        if c.tie_embeddings:
            head_params["embedding"] = embed.variables["params"]["embedding"]
        else:
            head_params["unembed"] = self._unembed()

        def head(hp, y_BLD, t):
            h = layers.norm(c.norm, "final_norm", dt).apply({"params": hp["norm"]}, y_BLD)
            if c.tie_embeddings:
                logits = layers.Embed(c.vocab_size, c.d_model, r, dt).apply(
                    {"params": {"embedding": hp["embedding"]}}, h, method="attend")
            else:
                logits = jnp.einsum("BLD,DV->BLV", h, hp["unembed"])
            logits = constrain(logits.astype(jnp.float32), ("batch", "length", "vocab"), r)
            return cross_entropy(logits, t["targets"], t.get("weights"))

        targets = {"targets": targets_BL} if weights_BL is None else {"targets": targets_BL, "weights": weights_BL}
        weights = {"aux_loss": c.aux_loss_weight, "z_loss": c.z_loss_weight}
        stack = Stack(c, c.num_layers, causal=True, cross=False, train=self.train, name="decoder")
        loss, metrics = stack(x_BLD, head=(head, head_params, targets, weights))
        return loss, dict(_metrics(metrics), cross_entropy=metrics["cross_entropy"])


class EncoderDecoder(nn.Module):
    """GShard's encoder-decoder: (source [B, T], target inputs [B, L]) -> (logits [B, L, V], moe metrics).

    Source and target share one vocabulary and embedding; `num_layers` encoder and `num_decoder_layers`
    decoder layers. Source token 0 is padding (masked out of cross-attention and encoder self-attention).
    """
    cfg: TransformerConfig
    train: bool = False

    @nn.compact
    def __call__(self, source_BT, target_BL):
        c, r, dt = self.cfg, self.cfg.rules, self.cfg.compute_dtype
        check(c, decoder_only=False)
        embed = layers.Embed(c.vocab_size, c.d_model, r, dt, name="embed")
        src_mask_BT = constrain(source_BT, ("batch", "length"), r) != 0

        def embedded(tokens, positions_L=None):
            x = embed(constrain(tokens, ("batch", "length"), r))
            return x if c.rope else x + layers.sinusoid(tokens.shape[1], c.d_model, positions_L).astype(dt)

        enc, enc_metrics = Stack(c, c.num_layers, causal=False, cross=False, train=self.train, name="encoder")(
            embedded(source_BT), None, src_mask_BT)
        # the decoder's causal sequence in zigzag order over a context axis (the encoder's in its own order)
        target_BL = layers.in_context_order(target_BL, r)
        enc = layers.norm(c.norm, "encoder_norm", dt)(enc)
        x, dec_metrics = Stack(c, c.num_decoder_layers, causal=True, cross=True, train=self.train, name="decoder")(
            embedded(target_BL, layers.positions(target_BL.shape[1], r)), enc, src_mask_BT)
        x = layers.norm(c.norm, "decoder_norm", dt)(x)
        if c.tie_embeddings:
            logits = embed.attend(x)
        else:
            logits = jnp.einsum("BLD,DV->BLV", x, layers.weight(self, "unembed", (c.d_model, c.vocab_size),
                                                                 ("embed", "vocab"), r, dt))
        logits = constrain(logits.astype(jnp.float32), ("batch", "length", "vocab"), r)
        return logits, _metrics(enc_metrics, dec_metrics)


def loss_fn(model: nn.Module, params, batch: dict, rng: Optional[jax.Array] = None):
    """(training loss, metrics): cross-entropy + aux_loss_weight * aux + z_loss_weight * z.

    batch: decoder-only {"inputs", "targets", optional "weights"}; encoder-decoder also "source".
    rng feeds the "gating" stream (random routing, jitter) when the model is training.
    """
    rngs = {"gating": rng} if rng is not None else {}
    c = model.cfg
    if loss_in_pipeline(c.pipeline, c.end_stages):
        if isinstance(model, EncoderDecoder):
            raise ValueError(f"pipeline schedule {c.pipeline.schedule!r} (the loss inside the pipeline) is built "
                             f"for the decoder-only LM; train the encoder-decoder with 'gpipe' or 'circular'")
        return model.apply(params, batch["inputs"], batch["targets"], batch.get("weights"), rngs=rngs)
    if isinstance(model, EncoderDecoder):
        logits, m = model.apply(params, batch["source"], batch["inputs"], rngs=rngs)
    else:
        logits, m = model.apply(params, batch["inputs"], rngs=rngs)
    # the logits are in the model's order: zigzag over a context axis (layers.in_context_order)
    weights = batch.get("weights")
    ce = cross_entropy(logits, layers.in_context_order(batch["targets"], c.rules),
                       None if weights is None else layers.in_context_order(weights, c.rules))
    loss = ce + c.aux_loss_weight * m["aux_loss"] + c.z_loss_weight * m["z_loss"]
    return loss, dict(m, cross_entropy=ce)
