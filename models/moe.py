"""The MoE layer's expert computation as GShard's einsums (paper Algorithm 2), annotated.

Gating (which produces the dispatch mask and combine weights) comes with the
MoE layer; this is the part the partitioner must turn into exactly one
all-to-all before the experts and one after them.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

import gshard_jax as gs


def expert_einsums(dispatch, combine, x, wi, wo, num_partitions: int):
    """dispatch/combine [G, S, E, C], x [G, S, M], wi [E, M, H], wo [E, H, M] -> [G, S, M].

    Groups G are split on the way in and out, experts E in between.
    """
    n = num_partitions
    x = gs.split(x, 0, n)
    dispatch, combine = gs.split(dispatch, 0, n), gs.split(combine, 0, n)
    e_in = gs.split(jnp.einsum("GSEC,GSM->EGCM", dispatch, x), 0, n)
    h = jax.nn.relu(jnp.einsum("EGCM,EMH->EGCH", e_in, gs.split(wi, 0, n)))
    e_out = gs.split(jnp.einsum("EGCH,EHM->GECM", h, gs.split(wo, 0, n)), 0, n)
    return gs.split(jnp.einsum("GSEC,GECM->GSM", combine, e_out), 0, n)
