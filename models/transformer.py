"""MoE Transformers in Flax linen: GShard's encoder-decoder and an OLMoE/Mula-style decoder-only LM.

Every ``moe_every``-th FFN is an MoE layer (GShard: every other one; OLMoE:
all). Layers come in periods of ``moe_every`` blocks (the last one MoE); with
``scan=True`` the periods are one ``nn.scan`` (stacked params, one traced
body), and ``remat`` checkpoints each period with a chosen policy. The MoE
losses (aux, z) and routing statistics are carried through the stack and
returned with the output, summed (losses) and averaged (statistics) over MoE
layers. Sharding is the config's ``rules`` table (logical axis -> mesh axes).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from . import layers
from .moe import MoeConfig, MoeFFN
from .sharding import DEFAULT_RULES, Rules, constrain

REMAT_POLICIES = {
    "none": None,  # no checkpointing
    "full": jax.checkpoint_policies.nothing_saveable,  # recompute the whole period in the backward pass
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # keep matmul outputs, recompute the rest
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
    dtype: str = "float32"  # compute dtype ("bfloat16" for mixed precision; params stay float32)
    rules: Rules = DEFAULT_RULES  # logical axis -> mesh axes table
    aux_loss_weight: float = 0.01  # weight of the summed MoE aux (load-balancing) loss in the training loss
    z_loss_weight: float = 0.001  # weight of the summed router z-loss

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
    bad = [m for m in cfg.remat_modules if m not in REMAT_MODULES]
    if bad or isinstance(cfg.remat_modules, str):
        raise ValueError(f"TransformerConfig.remat_modules={cfg.remat_modules!r}; expected a tuple of any of "
                         f"{REMAT_MODULES}, e.g. ('attention', 'moe')")
    if cfg.moe is not None and cfg.moe_every < 1:
        raise ValueError(f"TransformerConfig.moe_every={cfg.moe_every!r}; expected a positive int")
    counts = [("num_layers", cfg.num_layers)] + ([] if decoder_only else [("num_decoder_layers", cfg.num_decoder_layers)])
    for field, n in counts:
        if n % cfg.period:
            raise ValueError(f"TransformerConfig.{field}={n} is not a multiple of moe_every={cfg.moe_every}; "
                             f"layers come in periods of moe_every blocks (the last one MoE)")


ZERO_METRICS = ("aux_loss", "z_loss", "dropped", "router_confidence", "moe_layers")


def _zeros() -> dict:
    return {k: jnp.zeros((), jnp.float32) for k in ZERO_METRICS}


class Block(nn.Module):
    """Pre-norm residual block: self-attention, optional cross-attention, dense or MoE FFN."""
    cfg: TransformerConfig
    causal: bool
    cross: bool
    moe: bool
    train: bool = False

    @nn.compact
    def __call__(self, x_BLD, acc, enc_BTD=None, enc_mask_BT=None):
        """enc_mask_BT: which source tokens are real; the encoder's self-attention (no `cross`) and the
        decoder's cross-attention read only those."""
        c, r, dt = self.cfg, self.cfg.rules, self.cfg.compute_dtype
        attn = dict(num_heads=c.num_heads, head_dim=c.head_dim, rules=r, dtype=dt)
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
            acc = {"aux_loss": acc["aux_loss"] + losses["aux_loss"], "z_loss": acc["z_loss"] + losses["z_loss"],
                   "dropped": acc["dropped"] + stats["dropped"],
                   "router_confidence": acc["router_confidence"] + stats["router_confidence"],
                   "moe_layers": acc["moe_layers"] + 1.0}
        else:
            y = own(layers.Mlp, "ffn")(c.d_ff, r, c.ffn_activation, dt, name="mlp")(h)
        return constrain(x_BLD + y, ("batch", "length", "embed"), r), acc


class Period(nn.Module):
    """`period` blocks; the last one has the MoE FFN (when the model has one)."""
    cfg: TransformerConfig
    causal: bool
    cross: bool
    train: bool = False

    @nn.compact
    def __call__(self, carry, enc_BTD=None, enc_mask_BT=None):
        x, acc = carry
        for j in range(self.cfg.period):
            moe = self.cfg.moe is not None and j == self.cfg.period - 1
            x, acc = Block(self.cfg, self.causal, self.cross, moe, self.train, name=f"block_{j}")(
                x, acc, enc_BTD, enc_mask_BT)
        return (x, acc), None


class Stack(nn.Module):
    """num_layers blocks as num_layers / period periods, scanned and checkpointed as configured."""
    cfg: TransformerConfig
    num_layers: int
    causal: bool
    cross: bool
    train: bool = False

    @nn.compact
    def __call__(self, x_BLD, enc_BTD=None, enc_mask_BT=None):
        c = self.cfg
        body = Period
        policy = REMAT_POLICIES[c.remat]
        if c.remat != "none":
            body = nn.remat(Period, policy=policy, prevent_cse=not c.scan)
        carry = (x_BLD, _zeros())
        n = self.num_layers // c.period
        if c.scan:
            scanned = nn.scan(body, variable_axes={"params": 0}, split_rngs={"params": True, "gating": True},
                              in_axes=(nn.broadcast, nn.broadcast), length=n,
                              metadata_params={nn.PARTITION_NAME: "layers"})
            carry, _ = scanned(c, self.causal, self.cross, self.train, name="layers")(carry, enc_BTD, enc_mask_BT)
        else:
            for i in range(n):
                carry, _ = body(c, self.causal, self.cross, self.train, name=f"period_{i}")(carry, enc_BTD, enc_mask_BT)
        return carry


def _metrics(*accs: dict) -> dict:
    total = {k: sum(a[k] for a in accs) for k in ZERO_METRICS}
    layers_ = jnp.maximum(total["moe_layers"], 1.0)
    return {"aux_loss": total["aux_loss"], "z_loss": total["z_loss"], "dropped": total["dropped"] / layers_,
            "router_confidence": total["router_confidence"] / layers_}


class DecoderLM(nn.Module):
    """Decoder-only LM (OLMo/OLMoE style): tokens [B, L] -> (logits [B, L, V], moe metrics)."""
    cfg: TransformerConfig
    train: bool = False

    @nn.compact
    def __call__(self, tokens_BL):
        c, r, dt = self.cfg, self.cfg.rules, self.cfg.compute_dtype
        check(c, decoder_only=True)
        embed = layers.Embed(c.vocab_size, c.d_model, r, dt, name="embed")
        x = embed(constrain(tokens_BL, ("batch", "length"), r))
        if not c.rope:
            x = x + layers.sinusoid(tokens_BL.shape[1], c.d_model).astype(dt)
        x, acc = Stack(c, c.num_layers, causal=True, cross=False, train=self.train, name="decoder")(x)
        x = layers.norm(c.norm, "final_norm", dt)(x)
        if c.tie_embeddings:
            logits = embed.attend(x)
        else:
            logits = jnp.einsum("BLD,DV->BLV", x, layers.weight(self, "unembed", (c.d_model, c.vocab_size),
                                                                 ("embed", "vocab"), r, dt))
        return constrain(logits.astype(jnp.float32), ("batch", "length", "vocab"), r), _metrics(acc)


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

        def embedded(tokens):
            x = embed(constrain(tokens, ("batch", "length"), r))
            return x if c.rope else x + layers.sinusoid(tokens.shape[1], c.d_model).astype(dt)

        enc, enc_acc = Stack(c, c.num_layers, causal=False, cross=False, train=self.train, name="encoder")(
            embedded(source_BT), None, src_mask_BT)
        enc = layers.norm(c.norm, "encoder_norm", dt)(enc)
        x, dec_acc = Stack(c, c.num_decoder_layers, causal=True, cross=True, train=self.train, name="decoder")(
            embedded(target_BL), enc, src_mask_BT)
        x = layers.norm(c.norm, "decoder_norm", dt)(x)
        if c.tie_embeddings:
            logits = embed.attend(x)
        else:
            logits = jnp.einsum("BLD,DV->BLV", x, layers.weight(self, "unembed", (c.d_model, c.vocab_size),
                                                                 ("embed", "vocab"), r, dt))
        return constrain(logits.astype(jnp.float32), ("batch", "length", "vocab"), r), _metrics(enc_acc, dec_acc)


def cross_entropy(logits_BLV: jax.Array, targets_BL: jax.Array, weights_BL: Optional[jax.Array] = None):
    """Mean next-token cross-entropy over weighted positions."""
    logz = jax.nn.logsumexp(logits_BLV, axis=-1)
    gold = jnp.take_along_axis(logits_BLV, targets_BL[..., None], axis=-1)[..., 0]
    w = jnp.ones_like(logz) if weights_BL is None else weights_BL.astype(logz.dtype)
    return jnp.sum((logz - gold) * w) / jnp.maximum(jnp.sum(w), 1.0)


def loss_fn(model: nn.Module, params, batch: dict, rng: Optional[jax.Array] = None):
    """(training loss, metrics): cross-entropy + aux_loss_weight * aux + z_loss_weight * z.

    batch: decoder-only {"inputs", "targets", optional "weights"}; encoder-decoder also "source".
    rng feeds the "gating" stream (random routing, jitter) when the model is training.
    """
    rngs = {"gating": rng} if rng is not None else {}
    if isinstance(model, EncoderDecoder):
        logits, m = model.apply(params, batch["source"], batch["inputs"], rngs=rngs)
    else:
        logits, m = model.apply(params, batch["inputs"], rngs=rngs)
    ce = cross_entropy(logits, batch["targets"], batch.get("weights"))
    c = model.cfg
    loss = ce + c.aux_loss_weight * m["aux_loss"] + c.z_loss_weight * m["z_loss"]
    return loss, dict(m, cross_entropy=ce)
