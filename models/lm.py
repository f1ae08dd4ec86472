"""A small functional Transformer LM, annotated once for data, tensor (Megatron) and mixed parallelism.

Used to exercise the partitioner on whole train steps: embedding lookup,
causal attention, MLP, layer norm, softmax cross-entropy and an optax AdamW
update. ``Layout`` names the mesh axes for the batch ("data") and for the
Megatron split of heads, MLP hidden units and vocabulary ("model"); either may
be None. With ``scan=True`` the layers' parameters are stacked and run by
``lax.scan``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp
import optax

import gshard_jax as gs


@dataclasses.dataclass(frozen=True)
class LMConfig:
    vocab: int = 256
    d_model: int = 64
    heads: int = 8
    d_ff: int = 256
    layers: int = 2
    seq: int = 32
    scan: bool = False
    learning_rate: float = 1e-3
    weight_decay: float = 0.1


@dataclasses.dataclass(frozen=True)
class Layout:
    data: Optional[str] = None
    model: Optional[str] = None

    def shard(self, x, *dims: str):
        """Annotate x: per dim "data", "model" or "-" (not split)."""
        spec = tuple(getattr(self, d) if d in ("data", "model") else None for d in dims)
        return gs.shard(x, spec)


def init_params(key: jax.Array, cfg: LMConfig) -> dict:
    ks = iter(jax.random.split(key, 8 + 8 * cfg.layers))
    d, f, h = cfg.d_model, cfg.d_ff, cfg.heads
    normal = lambda shape, scale: jax.random.normal(next(ks), shape, jnp.float32) * scale

    def layer():
        return {"ln1": jnp.ones((d,)), "ln2": jnp.ones((d,)),
                "wq": normal((d, h, d // h), d ** -0.5), "wk": normal((d, h, d // h), d ** -0.5),
                "wv": normal((d, h, d // h), d ** -0.5), "wo": normal((h, d // h, d), d ** -0.5),
                "w1": normal((d, f), d ** -0.5), "w2": normal((f, d), f ** -0.5)}

    layers = [layer() for _ in range(cfg.layers)]
    stack = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *layers) if cfg.scan else layers
    return {"embed": normal((cfg.vocab, d), 1.0), "unembed": normal((d, cfg.vocab), d ** -0.5),
            "pos": normal((cfg.seq, d), 0.02), "ln_f": jnp.ones((d,)), "layers": stack}


def _layer_norm(x, scale):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * scale


def _block(x, p, lo: Layout):
    s = x.shape[1]
    h = _layer_norm(x, p["ln1"])
    q = lo.shard(jnp.einsum("bsd,dhk->bshk", h, lo.shard(p["wq"], "-", "model", "-")), "data", "-", "model", "-")
    k = lo.shard(jnp.einsum("bsd,dhk->bshk", h, lo.shard(p["wk"], "-", "model", "-")), "data", "-", "model", "-")
    v = lo.shard(jnp.einsum("bsd,dhk->bshk", h, lo.shard(p["wv"], "-", "model", "-")), "data", "-", "model", "-")
    logits = jnp.einsum("bqhk,bthk->bhqt", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
    causal = jnp.arange(s)[:, None] >= jnp.arange(s)[None, :]
    probs = jax.nn.softmax(jnp.where(causal, logits, -1e9), axis=-1)
    att = jnp.einsum("bhqt,bthk->bqhk", probs, v)
    x = lo.shard(x + jnp.einsum("bqhk,hkd->bqd", att, lo.shard(p["wo"], "model", "-", "-")), "data", "-", "-")
    h = _layer_norm(x, p["ln2"])
    a = lo.shard(jax.nn.gelu(h @ lo.shard(p["w1"], "-", "model")), "data", "-", "model")
    return lo.shard(x + a @ lo.shard(p["w2"], "model", "-"), "data", "-", "-")


def forward(params: dict, tokens: jax.Array, cfg: LMConfig, lo: Layout) -> jax.Array:
    """Logits [B, S, V], split over vocab on the model axis."""
    tokens = lo.shard(tokens, "data", "-")
    x = jnp.take(lo.shard(params["embed"], "model", "-"), tokens, axis=0) + params["pos"][: tokens.shape[1]]
    x = lo.shard(x, "data", "-", "-")
    if cfg.scan:
        x = jax.lax.scan(lambda c, p: (_block(c, p, lo), None), x, params["layers"])[0]
    else:
        for p in params["layers"]:
            x = _block(x, p, lo)
    x = _layer_norm(x, params["ln_f"])
    return lo.shard(x @ lo.shard(params["unembed"], "-", "model"), "data", "-", "model")


def loss_fn(params: dict, batch: dict, cfg: LMConfig, lo: Layout) -> jax.Array:
    """Mean next-token softmax cross-entropy."""
    logits = forward(params, batch["inputs"], cfg, lo)
    logz = jax.nn.logsumexp(logits, axis=-1)
    target = jnp.take_along_axis(logits, batch["targets"][..., None], axis=-1)[..., 0]
    return jnp.mean(logz - target)


def optimizer(cfg: LMConfig) -> optax.GradientTransformation:
    return optax.adamw(cfg.learning_rate, weight_decay=cfg.weight_decay)


def train_step(params: dict, opt_state: Any, batch: dict, cfg: LMConfig, lo: Layout):
    """One AdamW step: (params, opt_state, loss, grads)."""
    loss, grads = jax.value_and_grad(loss_fn)(params, batch, cfg, lo)
    updates, opt_state = optimizer(cfg).update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, grads


def make_batch(key: jax.Array, batch: int, cfg: LMConfig) -> dict:
    tokens = jax.random.randint(key, (batch, cfg.seq + 1), 0, cfg.vocab)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
