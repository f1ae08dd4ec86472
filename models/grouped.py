"""Grouped matmul for dropless experts: rows sorted by expert, each group times its expert's weight.

``jax.lax.ragged_dot`` is the API, but only GPU and TPU lower it to a grouped
kernel; elsewhere (XLA:CPU) JAX expands it to a dense matmul of every row with
every expert's weight under a mask, E times the work. ``"blocked"`` does the
same product in blocks of ``b`` rows: each expert's rows are padded to whole
blocks, and a ``lax.scan`` over blocks multiplies each by its one expert's
weight (a custom VJP accumulates the weight gradient one expert slice at a
time) and blocks past the last group are skipped, so the work is the rows
plus under ``E b`` rows of padding, however large the buffer.
``"auto"`` picks ragged_dot where the backend has the kernel, blocked elsewhere.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

IMPLS = ("auto", "ragged_dot", "blocked")
# The name of every expert matmul's output (here and in moe.py's einsums): remat "dots" keeps these, as it keeps
# matmuls without batch dims (the expert dim is a batch dim, and ragged_dot is no dot_general), so the backward
# does not run the experts' FFN again (models/transformer.py's REMAT_POLICIES).
EXPERT_MATMUL = "expert_matmul"
NATIVE_RAGGED_DOT = ("gpu", "tpu")


def grouped_matmul(x_RM: jax.Array, w_EMF: jax.Array, sizes_E: jax.Array, impl: str = "auto") -> jax.Array:
    """Rows [sum(sizes[:e]), sum(sizes[:e+1])) of x_RM times w_EMF[e]; rows past sum(sizes) give 0."""
    if impl not in IMPLS:
        raise ValueError(f"grouped matmul impl={impl!r}; expected one of {IMPLS}")
    if impl == "auto":
        impl = "ragged_dot" if jax.default_backend() in NATIVE_RAGGED_DOT else "blocked"
    if impl == "ragged_dot":
        return checkpoint_name(jax.lax.ragged_dot(x_RM, w_EMF, sizes_E), EXPERT_MATMUL)
    return checkpoint_name(_blocked(x_RM, w_EMF, sizes_E), EXPERT_MATMUL)


def block_rows(rows: int, groups: int) -> int:
    """Rows per block: a power of two near rows / (4 groups), in [16, 512]. Padding costs under a quarter of
    the rows; larger blocks mean fewer loop trips, which cost more than padding on CPU (E 64, k 8: 256-row
    blocks ran fwd+bwd in 0.68 s against 0.81 s for 64-row ones)."""
    target = max(1, rows // (4 * groups))
    return int(min(512, max(16, 1 << (target.bit_length() - 1))))


def _blocked(x_RM: jax.Array, w_EMF: jax.Array, sizes_E: jax.Array) -> jax.Array:
    R, M = x_RM.shape
    E, _, F = w_EMF.shape
    b = block_rows(R, E)
    N = -(-R // b) + E - 1  # blocks: sum_e ceil(s_e / b) <= ceil(R / b) + E - 1
    sizes_E = sizes_E.astype(jnp.int32)
    blocks_E = -(-sizes_E // b)
    first_block_E = jnp.cumsum(blocks_E) - blocks_E
    first_row_E = jnp.cumsum(sizes_E) - sizes_E
    expert_R = jnp.repeat(jnp.arange(E), sizes_E, total_repeat_length=R)
    row_R = jnp.arange(R)
    pos_R = first_block_E[expert_R] * b + row_R - first_row_E[expert_R]
    pos_R = jnp.where(row_R < jnp.sum(sizes_E), pos_R, N * b)  # rows past the groups: nowhere, output 0
    expert_N = jnp.repeat(jnp.arange(E), blocks_E, total_repeat_length=N)
    expert_N = jnp.where(jnp.arange(N) < jnp.sum(blocks_E), expert_N, -1)  # unused blocks: skipped
    x_NbM = jnp.zeros((N * b, M), x_RM.dtype).at[pos_R].set(x_RM, mode="drop").reshape(N, b, M)
    y_NbF = _block_matmul(x_NbM, w_EMF, expert_N)
    return jnp.take(y_NbF.reshape(N * b, F), pos_R, axis=0, mode="fill", fill_value=0)


@jax.custom_vjp
def _block_matmul(x_NbM: jax.Array, w_EMF: jax.Array, expert_N: jax.Array) -> jax.Array:
    def body(_, xe):
        x_bM, e = xe
        y_bF = jax.lax.cond(e >= 0, lambda: x_bM @ w_EMF[e], lambda: jnp.zeros((x_bM.shape[0], w_EMF.shape[-1]),
                                                                             x_bM.dtype))
        return None, y_bF
    return jax.lax.scan(body, None, (x_NbM, expert_N))[1]


def _block_matmul_fwd(x_NbM, w_EMF, expert_N):
    return _block_matmul(x_NbM, w_EMF, expert_N), (x_NbM, w_EMF, expert_N)


def _block_matmul_bwd(res, dy_NbF):
    x_NbM, w_EMF, expert_N = res

    def block(dw_EMF, x_bM, dy_bF, e):
        dw_MF = jax.lax.dynamic_index_in_dim(dw_EMF, e, keepdims=False) + (x_bM.T @ dy_bF).astype(dw_EMF.dtype)
        return jax.lax.dynamic_update_index_in_dim(dw_EMF, dw_MF, e, 0), dy_bF @ w_EMF[e].T

    def body(dw_EMF, xde):
        x_bM, dy_bF, e = xde
        return jax.lax.cond(e >= 0, block, lambda dw, x, *_: (dw, jnp.zeros_like(x)), dw_EMF, x_bM, dy_bF, e)

    dw_EMF, dx_NbM = jax.lax.scan(body, jnp.zeros_like(w_EMF), (x_NbM, dy_NbF, expert_N))
    return dx_NbM.astype(x_NbM.dtype), dw_EMF, None


_block_matmul.defvjp(_block_matmul_fwd, _block_matmul_bwd)
