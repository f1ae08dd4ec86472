"""The optimiser and loss options of a training run.

Mula's recipe (seed 001; docs/references.md) is the default: AdamW with weight decay on
all params, linear warmup to the peak rate and cosine decay to a floor, and
global-norm clipping that starts only after warmup (early gradients are large
and clipping them slows the start). Goldfish loss (AxoNN section VIII) drops a
pseudo-random, context-determined subset of tokens from the loss so the model
cannot memorise a passage verbatim.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from ..configs import TrainConfig


def clip_after(warmup_steps: int, max_norm: float) -> optax.GradientTransformationExtraArgs:
    """Clip to global norm `max_norm` from update `warmup_steps` on (never when max_norm <= 0): the arithmetic
    of optax.clip_by_global_norm under optax.conditionally_transform, and the same state, without its
    lax.cond: a select of the clipped and unclipped gradients fuses into the update, and the step holds no
    control flow that plain JAX's does not (docs/training.md). The
    norm is `global_norm=` when the caller has it: an offloaded update on the host is given the device's, so
    the host never sums the gradients (and never mixes memory spaces doing so)."""
    def init(params):
        del params
        return optax.ConditionallyTransformState(inner_state=optax.EmptyState(), step=jnp.zeros([], jnp.int32))

    def update(updates, state, params=None, *, global_norm=None, **extra_args):
        del params, extra_args
        if max_norm > 0:
            norm = optax.tree.norm(updates) if global_norm is None else global_norm
            keep = jnp.squeeze((norm < max_norm) | (state.step < warmup_steps))
            updates = jax.tree.map(lambda t: jax.lax.select(keep, t, (t / norm.astype(t.dtype)) * max_norm), updates)
        return updates, optax.ConditionallyTransformState(state.inner_state, optax.safe_increment(state.step))
    return optax.GradientTransformationExtraArgs(init, update)


def schedule(train: TrainConfig) -> optax.Schedule:
    """Linear warmup from 0 to learning_rate, cosine decay to min_learning_rate at decay_steps (or num_steps)."""
    end = train.decay_steps or train.num_steps
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=train.learning_rate, warmup_steps=train.warmup_steps,
        decay_steps=max(end, train.warmup_steps + 1), end_value=train.min_learning_rate)


def optimizer(train: TrainConfig) -> optax.GradientTransformation:
    """AdamW (decay on all params) after post-warmup clipping."""
    return optax.chain(
        clip_after(train.warmup_steps, train.clip_norm),
        optax.adamw(schedule(train), b1=train.b1, b2=train.b2, eps=train.eps, weight_decay=train.weight_decay))


def goldfish_weights(tokens_BL: jax.Array, k: int, h: int) -> jax.Array:
    """1.0 where a target token counts in the loss, 0.0 where goldfish loss drops it: a token is dropped
    when a hash of the h tokens ending at it is 0 mod k (about 1/k of tokens; the same context always
    drops the same token). k <= 1 keeps every token."""
    if k <= 1:
        return jnp.ones(tokens_BL.shape, jnp.float32)
    t = tokens_BL.astype(jnp.uint32)
    acc = jnp.zeros_like(t)
    for i in range(h):  # polynomial hash of the window, mixed by a multiply-xorshift
        shifted = jnp.pad(t, ((0, 0), (i, 0)))[:, :t.shape[1]]
        acc = (acc * jnp.uint32(0x01000193)) ^ (shifted + jnp.uint32(i + 1))
    acc = (acc ^ (acc >> 16)) * jnp.uint32(0x45D9F3B)
    acc = acc ^ (acc >> 16)
    return (acc % jnp.uint32(k) != 0).astype(jnp.float32)
