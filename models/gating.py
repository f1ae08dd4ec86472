"""GShard top-2 gating (paper Algorithm 1; REFERENCE section A), with the knobs implementations differ on.

Tokens come in local groups (`G` groups of `S` tokens); each expert takes at
most `capacity` tokens per group. Every top-1 assignment has priority over
every top-2 assignment; the second expert is kept for all tokens ("all"),
with probability proportional to its gate ("random", GShard's default: kept
when `2 * g2 > max(threshold, u)` for uniform u, so threshold 0 is the
paper's rule and a positive one drops weak second choices outright), or by
sampling it from the remaining gates ("sampling"). Gates are renormalised
over the two choices before or after capacity drops, or not at all. The
router runs in float32.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Top2Config:
    capacity_factor: float = 2.0  # capacity = ceil(2 * S * capacity_factor / E), at least min_capacity
    min_capacity: int = 4  # floor on the per-group expert capacity
    second_policy: str = "random"  # "all" | "random" | "sampling"
    second_threshold: float = 0.0  # "random": keep the 2nd expert only if 2 * g2 > max(threshold, u)
    normalize: str = "before_drop"  # renormalise g1, g2 over the two choices: "before_drop" | "after_drop" | "none"


def capacity(tokens_per_group: int, experts: int, cfg: Top2Config) -> int:
    """Per-group expert capacity C = ceil(2 S cf / E), at least min_capacity (and at most S)."""
    c = -(-int(2 * tokens_per_group * cfg.capacity_factor) // experts)
    return int(min(max(c, cfg.min_capacity), tokens_per_group))


def top2_gating(logits_GSE: jax.Array, cfg: Top2Config, rng: Optional[jax.Array] = None) -> tuple:
    """(combine_GSEC, dispatch_GSEC, aux_loss, stats) for router logits [G, S, E].

    aux_loss is GShard's mean_e(c_e / S * m_e) scaled by E^2, so perfectly uniform routing gives 1.0.
    stats: fraction of tokens dropped per choice, expert usage (fraction of kept assignments per expert),
    and router confidence (mean top-1 gate).
    """
    if cfg.second_policy not in ("all", "random", "sampling"):
        raise ValueError(f"second_policy={cfg.second_policy!r}; expected 'all', 'random' or 'sampling'")
    if cfg.normalize not in ("before_drop", "after_drop", "none"):
        raise ValueError(f"normalize={cfg.normalize!r}; expected 'before_drop', 'after_drop' or 'none'")
    if cfg.second_policy != "all" and rng is None:
        raise ValueError(f"second_policy={cfg.second_policy!r} draws random numbers: pass rng")
    G, S, E = logits_GSE.shape
    C = capacity(S, E, cfg)
    gates_GSE = jax.nn.softmax(logits_GSE.astype(jnp.float32), axis=-1)

    e1_GS = jnp.argmax(gates_GSE, axis=-1)
    mask1_GSE = jax.nn.one_hot(e1_GS, E, dtype=jnp.float32)
    g1_GS = jnp.sum(gates_GSE * mask1_GSE, axis=-1)
    rest_GSE = gates_GSE * (1.0 - mask1_GSE)
    if cfg.second_policy == "sampling":
        e2_GS = jax.random.categorical(rng, jnp.log(jnp.maximum(rest_GSE, 1e-30)), axis=-1)
    else:
        e2_GS = jnp.argmax(rest_GSE, axis=-1)
    mask2_GSE = jax.nn.one_hot(e2_GS, E, dtype=jnp.float32)
    g2_GS = jnp.sum(gates_GSE * mask2_GSE, axis=-1)

    # Aux loss from the top-1 assignment (before any drop), scaled so uniform routing gives 1.0.
    density_GE = jnp.mean(mask1_GSE, axis=1)
    proxy_GE = jnp.mean(gates_GSE, axis=1)
    aux_loss = jnp.mean(density_GE * proxy_GE) * E * E

    if cfg.normalize == "before_drop":
        total = g1_GS + g2_GS
        g1_GS, g2_GS = g1_GS / total, g2_GS / total
    if cfg.second_policy == "random":
        u_GS = jax.random.uniform(rng, g2_GS.shape)
        mask2_GSE = mask2_GSE * (2.0 * g2_GS > jnp.maximum(cfg.second_threshold, u_GS))[..., None]

    # Positions in each expert's buffer: exclusive cumsum over S; top-2 positions start after all top-1s.
    pos1_GSE = jnp.cumsum(mask1_GSE, axis=1) - mask1_GSE
    keep1_GSE = mask1_GSE * (pos1_GSE < C)
    count1_GE = jnp.sum(keep1_GSE, axis=1)
    pos2_GSE = jnp.cumsum(mask2_GSE, axis=1) - mask2_GSE + count1_GE[:, None, :]
    keep2_GSE = mask2_GSE * (pos2_GSE < C)

    kept1_GS, kept2_GS = jnp.sum(keep1_GSE, axis=-1), jnp.sum(keep2_GSE, axis=-1)
    g1_GS, g2_GS = g1_GS * kept1_GS, g2_GS * kept2_GS
    if cfg.normalize == "after_drop":
        total = jnp.where(g1_GS + g2_GS > 0, g1_GS + g2_GS, 1.0)
        g1_GS, g2_GS = g1_GS / total, g2_GS / total

    slot1_GSC = jax.nn.one_hot(jnp.sum(pos1_GSE * keep1_GSE, axis=-1).astype(jnp.int32), C)
    slot2_GSC = jax.nn.one_hot(jnp.sum(pos2_GSE * keep2_GSE, axis=-1).astype(jnp.int32), C)
    combine_GSEC = (g1_GS[..., None, None] * keep1_GSE[..., None] * slot1_GSC[:, :, None, :]
                    + g2_GS[..., None, None] * keep2_GSE[..., None] * slot2_GSC[:, :, None, :])
    dispatch_GSEC = combine_GSEC > 0
    kept_GE = jnp.sum(keep1_GSE + keep2_GSE, axis=1)
    stats = {
        "dropped_top1": 1.0 - jnp.mean(kept1_GS),
        "dropped_top2": 1.0 - jnp.sum(keep2_GSE) / jnp.maximum(jnp.sum(mask2_GSE), 1.0),
        "expert_usage": jnp.sum(kept_GE, axis=0) / jnp.maximum(jnp.sum(kept_GE), 1.0),
        "router_confidence": jnp.mean(jnp.max(gates_GSE, axis=-1)),
    }
    return combine_GSEC, dispatch_GSEC, aux_loss, stats
