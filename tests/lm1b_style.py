"""A train step in the style of Flax's lm1b example, Megatron-split by parameter name (tests and benchmarks).

The model follows examples/lm1b/models.py: inputs shifted right, a tied nn.Embed, a learned positional
param, pre-LayerNorm blocks of self-attention and an MLP with dropout active, a final LayerNorm and logits
by `attend`. The step is value_and_grad of the masked cross-entropy and one optax update (global-norm
clipping, AdamW on a warmup-cosine schedule). build() returns everything a caller partitions.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import gshard_jax as gs

VOCAB, WIDTH, HEADS, MLP, LAYERS, DROPOUT = 64, 32, 4, 64, 2, 0.1


class MlpBlock(nn.Module):
    @nn.compact
    def __call__(self, x, deterministic: bool):
        y = nn.relu(nn.Dense(MLP)(x))
        y = nn.Dropout(DROPOUT)(y, deterministic=deterministic)
        y = nn.Dense(WIDTH)(y)
        return nn.Dropout(DROPOUT)(y, deterministic=deterministic)


class DecoderBlock(nn.Module):
    @nn.compact
    def __call__(self, x, mask, deterministic: bool):
        y = nn.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=WIDTH, use_bias=False,
                                            dropout_rate=DROPOUT, deterministic=deterministic)(
            nn.LayerNorm()(x), mask=mask)
        x = x + nn.Dropout(DROPOUT)(y, deterministic=deterministic)
        return x + MlpBlock()(nn.LayerNorm()(x), deterministic)


class Decoder(nn.Module):
    @nn.compact
    def __call__(self, ids, deterministic: bool = False):
        mask = nn.combine_masks(nn.make_attention_mask(ids > 0, ids > 0), nn.make_causal_mask(ids))
        emb = nn.Embed(VOCAB, WIDTH, embedding_init=nn.initializers.normal(1.0))
        y = emb(jnp.pad(ids, ((0, 0), (1, 0)))[:, :-1])  # shift right
        y = y + self.param("pos_embedding", nn.initializers.normal(0.02), (1, ids.shape[1], WIDTH))
        y = nn.Dropout(DROPOUT)(y, deterministic=deterministic)
        for _ in range(LAYERS):
            y = DecoderBlock()(y, mask, deterministic)
        y = nn.LayerNorm()(y)
        return emb.attend(y) / jnp.sqrt(y.shape[-1])


def megatron_spec(path) -> Any:
    """Heads and the MLP's hidden units split over "model" (by the parameter's name); the rest replicated."""
    names = [getattr(k, "key", str(k)) for k in path]
    if {"query", "key", "value"} & set(names) and names[-1] == "kernel":
        return P(None, "model", None)
    if "out" in names and names[-1] == "kernel":
        return P("model", None, None)
    if "MlpBlock_0" in names and names[-2] == "Dense_0":
        return P(None, "model") if names[-1] == "kernel" else P("model")
    if "MlpBlock_0" in names and names[-2] == "Dense_1" and names[-1] == "kernel":
        return P("model", None)
    return P()


@dataclasses.dataclass
class Lm1bStep:
    step: Callable  # step(params, opt_state, ids, rng) -> (params, opt_state, loss)
    args: tuple  # concrete (params, opt_state, ids, rng)
    in_shardings: tuple
    out_shardings: tuple
    mesh_axes: dict


def build(batch: int = 16, length: int = 16, padding: int = 3, seed: int = 0) -> Lm1bStep:
    """The step, its arguments and shardings for mesh {data: 2, model: 4}: ids batch-split over "data"
    inside the step; params and the optimizer's mu/nu by megatron_spec, the rest replicated."""
    model = Decoder()
    opt = optax.chain(optax.clip_by_global_norm(1.0),
                      optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 1e-3, 10, 100), weight_decay=0.1))
    ids = np.random.default_rng(seed).integers(1, VOCAB, (batch, length)).astype(np.int32)
    ids[:, length - padding:] = 0  # the last tokens of every row are padding
    ids = jnp.asarray(ids)
    init = jax.jit(lambda rngs, ids: model.init(rngs, ids)["params"])  # one compile, not hundreds of eager ops
    params = init({"params": jax.random.key(seed), "dropout": jax.random.key(seed + 1)}, ids)
    opt_state = jax.jit(opt.init)(params)

    def step(params, opt_state, ids, rng):
        ids = gs.shard(ids, ("data", None))

        def loss_fn(p):
            logits = model.apply({"params": p}, ids, deterministic=False, rngs={"dropout": rng})
            weights = (ids > 0).astype(jnp.float32)
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, ids)
            return jnp.sum(ce * weights) / jnp.sum(weights)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    param_specs = jax.tree_util.tree_map_with_path(lambda path, _: megatron_spec(path), params)
    state_specs = optax.tree_map_params(opt, lambda _, spec: spec, opt_state, param_specs,
                                        transform_non_params=lambda _: P(),
                                        is_leaf=lambda x: isinstance(x, P))
    return Lm1bStep(step, (params, opt_state, ids, jax.random.key(seed + 2)),
                    (param_specs, state_specs, None, None), (param_specs, state_specs, P()),
                    {"data": 2, "model": 4})
