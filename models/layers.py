"""Transformer building blocks (Flax linen), every weight and activation named with logical axes.

Names: ``batch`` (B), ``length`` (L), ``embed`` (D), ``heads`` (H), ``kv``
(head dim K), ``mlp`` (F), ``vocab`` (V). Weights are our own params so they can
be annotated where they are used; norms are Flax's own ``nn.RMSNorm`` and
``nn.LayerNorm``.
"""
from __future__ import annotations

import math
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

import gshard_jax as gs

from . import ring_attention as RA
from .logical import FIRST_STAGE, LAST_STAGE, Rules, axes_of, constrain, mesh_spec


def _init(fan_in_axes: tuple[int, ...]):
    return nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=fan_in_axes,
                                            out_axis=-1)


def weight(module: nn.Module, name: str, shape: tuple[int, ...], logical: tuple, rules: Rules, dtype,
           fan_in_axes: tuple[int, ...] = (0,)) -> jax.Array:
    """A float32 param (its logical axes recorded for the state's shardings), cast to the compute dtype and
    annotated with its logical axes where it is used."""
    w = module.param(name, nn.with_logical_partitioning(_init(fan_in_axes), logical), shape, jnp.float32)
    return constrain(w.astype(dtype), logical, rules, grad=False)


def norm(kind: str, name: str, dtype, remat: bool = False, stages: int = 1) -> nn.Module:
    """Flax's RMSNorm (OLMo, Mula) or LayerNorm (GShard's Transformer); scale and bias are `embed`-named, so
    where the feature dim is split their statistics are reduced across its shards. stages > 1: the last
    stage's own (a pipeline's stage-owned head): its params lead with [stages], and a call returns each
    stage's result, [stages, ...]."""
    scale = nn.with_logical_partitioning(nn.initializers.ones, ("embed",))
    wrap = nn.remat if remat else (lambda cls: cls)  # remat: recomputed in the backward pass, not stored
    if stages > 1:
        base = wrap
        wrap = lambda cls: nn.vmap(base(cls), variable_axes={"params": 0}, split_rngs={"params": False},
                                   in_axes=None, axis_size=stages, metadata_params={nn.PARTITION_NAME: LAST_STAGE})
    if kind == "rmsnorm":
        return wrap(nn.RMSNorm)(epsilon=1e-6, dtype=dtype, param_dtype=jnp.float32, scale_init=scale, name=name)
    if kind == "layernorm":
        return wrap(nn.LayerNorm)(epsilon=1e-6, dtype=dtype, param_dtype=jnp.float32, scale_init=scale,
                            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)), name=name)
    raise ValueError(f"norm={kind!r}; expected 'rmsnorm' or 'layernorm'")


def rope(x_BLHK: jax.Array, positions_BL: jax.Array, theta: float = 10000.0) -> jax.Array:
    """Rotary position embedding (rotate-half form) in float32."""
    K = x_BLHK.shape[-1]
    freq = theta ** (-jnp.arange(0, K // 2, dtype=jnp.float32) * 2 / K)
    angle_BLk = positions_BL[..., None].astype(jnp.float32) * freq
    sin, cos = jnp.sin(angle_BLk)[:, :, None, :], jnp.cos(angle_BLk)[:, :, None, :]
    x1, x2 = jnp.split(x_BLHK.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x_BLHK.dtype)


def context_split(rules: Rules) -> tuple[Optional[str], int]:
    """The mesh axis the rules split a sequence's positions (`length`) over in the partition being traced,
    and its size: (None, 1) where they are not split. Such a causal sequence runs in zigzag order
    (`in_context_order`) and its self-attention as a ring (models/ring_attention.py)."""
    mesh = gs.annotations.current_mesh()
    if mesh is None:
        return None, 1
    sizes = dict(mesh.shape)
    axes = [a for a in axes_of(mesh_spec(("length",), rules, mesh.axis_names)[0]) if sizes[a] > 1]
    if not axes:
        return None, 1
    if len(axes) > 1:
        raise ValueError(f"the rules split `length` over {axes}; context parallelism runs its ring over one mesh "
                         f"axis: map `length` to one (e.g. 'context')")
    return axes[0], sizes[axes[0]]


def positions(length: int, rules: Rules) -> jax.Array:
    """The positions of a causal sequence's tokens in the order the model holds them (zigzag order where its
    positions are split over a context axis)."""
    _, n = context_split(rules)
    return RA.zigzag_indices(length, n) if n > 1 else jnp.arange(length)


def in_context_order(x_BL: jax.Array, rules: Rules) -> jax.Array:
    """A causal sequence (tokens, targets, loss weights) in the order the model holds it: zigzag where its
    positions are split over a context axis, so every device's ring attention does equal work."""
    _, n = context_split(rules)
    return RA.zigzag(x_BL, n) if n > 1 else x_BL


def sinusoid(length: int, d: int, positions_L: Optional[jax.Array] = None) -> jax.Array:
    """Fixed sinusoidal positions [L, D] (the original Transformer's, used when RoPE is off), at `positions_L`
    (default: 0..L-1)."""
    pos = (jnp.arange(length) if positions_L is None else positions_L).astype(jnp.float32)[:, None]
    inv = 10000.0 ** (-jnp.arange(0, d, 2, dtype=jnp.float32) / d)
    return jnp.concatenate([jnp.sin(pos * inv), jnp.cos(pos * inv)], axis=-1)[:, :d]


class Embed(nn.Module):
    """Token embedding [V, D]; `attend` gives logits against it (tied softmax). stages > 1: the first stage's
    own (a pipeline's stage-owned embedding): the table is [stages, V, D], of which a call reads stage 0's."""
    vocab: int
    d_model: int
    rules: Rules
    dtype: jnp.dtype = jnp.float32
    stages: int = 1

    def setup(self):
        lead, names = ((self.stages,), (FIRST_STAGE,)) if self.stages > 1 else ((), ())
        self.table = self.param("embedding", nn.with_logical_partitioning(nn.initializers.normal(1.0),
                                                                          names + ("vocab", "embed")),
                                lead + (self.vocab, self.d_model), jnp.float32)

    def __call__(self, tokens_BL: jax.Array) -> jax.Array:
        table = self.table[0] if self.stages > 1 else self.table
        table_VD = constrain(table.astype(self.dtype), ("vocab", "embed"), self.rules, grad=False)
        return constrain(jnp.take(table_VD, tokens_BL, axis=0), ("batch", "seq", "embed"), self.rules)

    def per_stage(self, tokens_BL: jax.Array) -> jax.Array:
        """[stages, B, L, D]: each stage's lookup in its own slice of the table (stage-local: a pipeline reads
        stage 0's, and the others' gradients are zeros that never leave their stage)."""
        table_SVD = constrain(self.table.astype(self.dtype), (FIRST_STAGE, "vocab", "embed"), self.rules, grad=False)
        x_SBLD = jax.vmap(lambda t: jnp.take(t, tokens_BL, axis=0))(table_SVD)
        return constrain(x_SBLD, (FIRST_STAGE, "batch", "seq", "embed"), self.rules)

    def attend(self, x_BLD: jax.Array) -> jax.Array:
        """Logits against the table, scaled by 1/sqrt(D) (Mesh TensorFlow / T5): the table's entries have unit
        scale for the input side, so unscaled logits would start with a std of sqrt(D)."""
        table_VD = constrain(self.table.astype(self.dtype), ("vocab", "embed"), self.rules, grad=False)
        return jnp.einsum("BLD,VD->BLV", x_BLD, table_VD) * jnp.asarray(self.d_model ** -0.5, self.dtype)


# TransformerConfig.attention: "einsum" writes scores and softmax as einsums (any platform, any dtype);
# "xla" and "cudnn" are jax.nn.dot_product_attention's implementations (cuDNN's fused flash attention needs
# an NVIDIA GPU and bf16 or fp16); "auto" takes cudnn where it runs and einsum elsewhere.
ATTENTION_IMPLEMENTATIONS = ("auto", "einsum", "xla", "cudnn")


def attention_implementation(choice: str, q_BLHK: jax.Array) -> str:
    """The implementation `choice` means for these queries: "auto" resolves to cudnn on a CUDA GPU with bf16 or
    fp16 heads of a size cuDNN's flash attention takes (a multiple of 8, at most 128), else to einsum."""
    if choice not in ATTENTION_IMPLEMENTATIONS:
        raise ValueError(f"attention={choice!r}; expected one of {ATTENTION_IMPLEMENTATIONS}")
    if choice != "auto":
        return choice
    return "cudnn" if on_nvidia_gpu() and cudnn_takes(q_BLHK.dtype, q_BLHK.shape[-1]) else "einsum"


def cudnn_takes(dtype, head_dim: int) -> bool:
    """Whether cuDNN's flash attention takes heads of this dtype and size (bf16 or fp16, a multiple of 8, at
    most 128): what "auto" asks of the heads, here and in the planner."""
    return jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) and head_dim % 8 == 0 and head_dim <= 128


def on_nvidia_gpu() -> bool:
    """Whether the default backend's devices are NVIDIA GPUs (cuDNN's; a ROCm GPU is "gpu" too)."""
    return jax.default_backend() == "gpu" and "nvidia" in jax.devices()[0].device_kind.lower()


class Attention(nn.Module):
    """Multi-head self- or cross-attention; causal masking and RoPE optional.

    Where the rules split `length` over a mesh axis (`context`), an unmasked self-attention runs as ring
    attention over it; a causal one then takes its sequence in zigzag order (`in_context_order`).
    """
    num_heads: int
    head_dim: int
    rules: Rules
    causal: bool = False
    use_rope: bool = False
    dtype: jnp.dtype = jnp.float32
    attention: str = "einsum"  # how scores are computed where no ring runs: ATTENTION_IMPLEMENTATIONS

    @nn.compact
    def __call__(self, x_BLD: jax.Array, kv_BTD: Optional[jax.Array] = None,
                 kv_mask_BT: Optional[jax.Array] = None) -> jax.Array:
        r, H, K = self.rules, self.num_heads, self.head_dim
        D = x_BLD.shape[-1]
        src_BTD = x_BLD if kv_BTD is None else kv_BTD

        def proj(name, inp):
            w = weight(self, name, (D, H, K), ("embed", "heads", "kv"), r, self.dtype)
            return constrain(jnp.einsum("BLD,DHK->BLHK", inp, w), ("batch", "length", "heads", "kv"), r)

        def project(out_BLHK):  # back to the residual stream (wo made here, after wq, wk, wv: init order)
            out_BLHK = constrain(out_BLHK, ("batch", "length", "heads", "kv"), r)
            wo = weight(self, "wo", (H, K, D), ("heads", "kv", "embed"), r, self.dtype, fan_in_axes=(0, 1))
            return constrain(jnp.einsum("BLHK,HKD->BLD", out_BLHK, wo), ("batch", "seq", "embed"), r)

        q_BLHK, k_BTHK, v_BTHK = proj("wq", x_BLD), proj("wk", src_BTD), proj("wv", src_BTD)
        L, T = x_BLD.shape[1], src_BTD.shape[1]
        axis, n = context_split(r)
        # a causal sequence is held in zigzag order over the context axis; its positions say where each token is
        pos_L = positions(L, r) if self.causal else jnp.arange(L)
        pos_T = pos_L if kv_BTD is None else jnp.arange(T)
        if self.use_rope:
            q_BLHK = rope(q_BLHK, jnp.broadcast_to(pos_L, x_BLD.shape[:2]))
            k_BTHK = rope(k_BTHK, jnp.broadcast_to(pos_T, src_BTD.shape[:2]))
        if n > 1 and kv_BTD is None and kv_mask_BT is None:
            mesh = gs.annotations.current_mesh()
            batch, _, heads, _ = (axes_of(a) for a in mesh_spec(("batch", "length", "heads", "kv"), r, mesh.axis_names))
            # a batch (or heads) its axes do not divide, such as init's one example, runs whole in the region
            divides = lambda axes, size: size % math.prod(dict(mesh.shape)[a] for a in axes) == 0
            batch = batch if divides(batch, x_BLD.shape[0]) else ()
            heads = heads if divides(heads, H) else ()
            out_BLHK = RA.ring_attention(q_BLHK, k_BTHK, v_BTHK, axis=axis, causal=self.causal,
                                         layout="zigzag" if self.causal else "contiguous", batch_axes=batch,
                                         head_axes=heads).astype(self.dtype)
            return project(out_BLHK)
        impl = attention_implementation(self.attention, q_BLHK)
        if impl != "einsum":  # jax.nn.dot_product_attention: the fused kernel (partitioner/rules/fused_attention.py)
            causal_prefix = self.causal and n == 1  # positions 0..L-1 in order: the kernel's own causal mask
            mask_BHLT = None
            if self.causal and not causal_prefix:
                mask_BHLT = (pos_L[:, None] >= pos_T[None, :])[None, None]
            if kv_mask_BT is not None:
                kv_BHLT = kv_mask_BT[:, None, None, :]
                mask_BHLT = kv_BHLT if mask_BHLT is None else mask_BHLT & kv_BHLT
            out_BLHK = jax.nn.dot_product_attention(q_BLHK, k_BTHK, v_BTHK, mask=mask_BHLT, is_causal=causal_prefix,
                                                    scale=K ** -0.5, implementation=impl)
            return project(out_BLHK.astype(self.dtype))
        logits_BHLT = jnp.einsum("BLHK,BTHK->BHLT", q_BLHK, k_BTHK).astype(jnp.float32) * K ** -0.5
        logits_BHLT = constrain(logits_BHLT, ("batch", "heads", "length", None), r)
        allowed = jnp.ones((1, 1, L, T), bool)
        if self.causal:
            allowed = allowed & (pos_L[:, None] >= pos_T[None, :])
        if kv_mask_BT is not None:
            allowed = allowed & kv_mask_BT[:, None, None, :]
        probs = jax.nn.softmax(jnp.where(allowed, logits_BHLT, -1e30), axis=-1).astype(self.dtype)
        return project(jnp.einsum("BHLT,BTHK->BLHK", probs, v_BTHK))


class Mlp(nn.Module):
    """Dense FFN: ReLU/GELU (wi, wo) or SwiGLU (wi_gate, wi_up, wo)."""
    d_ff: int
    rules: Rules
    activation: str = "relu"
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x_BLD: jax.Array) -> jax.Array:
        r, D, F = self.rules, x_BLD.shape[-1], self.d_ff
        names = ("batch", "length", "mlp")
        if self.activation == "swiglu":
            gate = jnp.einsum("BLD,DF->BLF", x_BLD, weight(self, "wi_gate", (D, F), ("embed", "mlp"), r, self.dtype))
            up = jnp.einsum("BLD,DF->BLF", x_BLD, weight(self, "wi_up", (D, F), ("embed", "mlp"), r, self.dtype))
            h_BLF = jax.nn.silu(constrain(gate, names, r)) * constrain(up, names, r)
        elif self.activation in ("relu", "gelu"):
            act = jax.nn.relu if self.activation == "relu" else jax.nn.gelu
            h_BLF = act(constrain(jnp.einsum("BLD,DF->BLF", x_BLD,
                                             weight(self, "wi", (D, F), ("embed", "mlp"), r, self.dtype)), names, r))
        else:
            raise ValueError(f"ffn activation={self.activation!r}; expected 'relu', 'gelu' or 'swiglu'")
        wo = weight(self, "wo", (F, D), ("mlp", "embed"), r, self.dtype)
        return constrain(jnp.einsum("BLF,FD->BLD", h_BLF, wo), ("batch", "seq", "embed"), r)


def cross_entropy(logits_BLV: jax.Array, targets_BL: jax.Array, weights_BL: Optional[jax.Array] = None):
    """Mean next-token cross-entropy over weighted positions."""
    logz = jax.nn.logsumexp(logits_BLV, axis=-1)
    gold = jnp.take_along_axis(logits_BLV, targets_BL[..., None], axis=-1)[..., 0]
    w = jnp.ones_like(logz) if weights_BL is None else weights_BL.astype(logz.dtype)
    return jnp.sum((logz - gold) * w) / jnp.maximum(jnp.sum(w), 1.0)
