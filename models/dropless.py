"""Dropless expert computation: sort assignments by expert, grouped matmul (``models.grouped``), unsort.

No capacity, so no token is dropped and no compute is spent on empty slots.
Under expert parallelism the experts live on different devices, so this runs
as a manual region (``gs.manual``) that moves tokens to their experts' devices
and back in one of three ways (the ``exchange`` knob):

- ``"all_to_all"``: each device packs its assignments into one buffer per
  peer, padded to a bound, and swaps them with a dense all-to-all (plus the
  expert ids); the bound defaults to the worst case (every assignment to one
  peer), so nothing is ever dropped; a smaller ``peer_bound`` trades
  guaranteed droplessness for smaller buffers (overflow is counted);
- ``"all_gather"``: every device gathers all tokens of its expert group,
  computes its own experts' share and the results are reduce-scattered back
  (seed 001 found this faster on its network);
- ``"ragged"``: ``jax.lax.ragged_all_to_all`` moves exactly the assigned rows
  (GPU/TPU; XLA:CPU cannot compile it);
- ``"auto"`` (default): ragged where the backend has it (GPU, TPU), else the
  dense all-to-all (`exchange_for`).

Expert hidden units split over a model axis are summed with one psum.
"""
from __future__ import annotations

import functools
import math
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import gshard_jax as gs

from .grouped import grouped_matmul

EXCHANGES = ("auto", "all_to_all", "all_gather", "ragged")
RAGGED_PLATFORMS = ("gpu", "tpu")  # backends that compile ragged_all_to_all (XLA:CPU does not)


def exchange_for(choice: str, platform: str) -> str:
    """The exchange `choice` means on `platform` ("gpu", "tpu", "cpu"): "auto" moves only the routed rows
    (ragged) where the backend can, else the dense all-to-all of per-peer buffers."""
    if choice not in EXCHANGES:
        raise ValueError(f"dropless exchange={choice!r}; expected one of {EXCHANGES}")
    if choice != "auto":
        return choice
    return "ragged" if platform in RAGGED_PLATFORMS else "all_to_all"


def expert_ffn(x_RM: jax.Array, ids_R: jax.Array, weights: dict, num_groups: int, *, activation: Callable,
               matmul: str = "auto") -> jax.Array:
    """Each row through the FFN of expert ids_R (ids outside [0, num_groups) give 0), in the rows' order."""
    ids_R = jnp.where((ids_R >= 0) & (ids_R < num_groups), ids_R, num_groups)  # others sort last, as no group
    order_R = jnp.argsort(ids_R, stable=True)
    sizes_E = jnp.bincount(ids_R, length=num_groups).astype(jnp.int32)  # ids out of range are not counted
    xs_RM = jnp.take(x_RM, order_R, axis=0)
    if "wi_gate" in weights:
        h_RF = activation(grouped_matmul(xs_RM, weights["wi_gate"], sizes_E, matmul)) \
            * grouped_matmul(xs_RM, weights["wi_up"], sizes_E, matmul)
    else:
        h_RF = activation(grouped_matmul(xs_RM, weights["wi"], sizes_E, matmul))
    ys_RM = grouped_matmul(h_RF.astype(x_RM.dtype), weights["wo"], sizes_E, matmul)  # rows past the groups: 0
    return jnp.zeros_like(ys_RM).at[order_R].set(ys_RM)


def _combine(y_RM: jax.Array, gates_TK: jax.Array, T: int, dtype) -> jax.Array:
    """Sum each token's k expert outputs weighted by their gates (rows are token-major, k per token)."""
    K = gates_TK.shape[-1]
    return jnp.sum(y_RM.reshape(T, K, -1) * gates_TK[..., None].astype(y_RM.dtype), axis=1).astype(dtype)


def _local(x_TM, experts_TK, gates_TK, weights, ffn, num_experts):
    T, K = experts_TK.shape
    x_RM = jnp.repeat(x_TM, K, axis=0)
    y_RM = ffn(x_RM, experts_TK.reshape(-1), weights, num_experts)
    return _combine(y_RM, gates_TK, T, x_TM.dtype), jnp.zeros((), jnp.float32)


def _all_gather(x_TM, experts_TK, gates_TK, weights, ffn, num_experts, axes, peers):
    """Gather the expert group's tokens, run this device's experts on them, reduce-scatter the results."""
    E_l = num_experts // peers
    first = jax.lax.axis_index(axes) * E_l
    xg_TM = jax.lax.all_gather(x_TM, axes, tiled=True)
    eg_TK = jax.lax.all_gather(experts_TK, axes, tiled=True)
    gg_TK = jax.lax.all_gather(gates_TK, axes, tiled=True)
    T, K = eg_TK.shape
    y_RM = ffn(jnp.repeat(xg_TM, K, axis=0), (eg_TK - first).reshape(-1), weights, E_l)
    y_TM = _combine(y_RM, gg_TK, T, jnp.float32)
    return jax.lax.psum_scatter(y_TM, axes, tiled=True).astype(x_TM.dtype), jnp.zeros((), jnp.float32)


def _pack(experts_R, peers, E_l, bound):
    """Per assignment: destination peer and slot in that peer's buffer (slot >= bound: overflow)."""
    peer_R = experts_R // E_l
    one_hot_RP = jax.nn.one_hot(peer_R, peers, dtype=jnp.int32)
    slot_R = jnp.sum((jnp.cumsum(one_hot_RP, axis=0) - one_hot_RP) * one_hot_RP, axis=-1)
    return peer_R, slot_R, slot_R < bound


def _all_to_all(x_TM, experts_TK, gates_TK, weights, ffn, num_experts, axes, peers, bound):
    """Dense all-to-all of per-peer buffers [peers, bound] (rows and expert ids), experts, and back."""
    E_l = num_experts // peers
    T, K = experts_TK.shape
    M = x_TM.shape[-1]
    experts_R = experts_TK.reshape(-1)
    peer_R, slot_R, fits_R = _pack(experts_R, peers, E_l, bound)
    where_R = jnp.where(fits_R, peer_R * bound + slot_R, peers * bound)  # overflow rows land out of range
    x_RM = jnp.repeat(x_TM, K, axis=0)
    send_BM = jnp.zeros((peers * bound, M), x_TM.dtype).at[where_R].set(x_RM, mode="drop")
    send_ids_B = jnp.full((peers * bound,), E_l, jnp.int32).at[where_R].set(experts_R % E_l, mode="drop")
    recv_BM = jax.lax.all_to_all(send_BM, axes, 0, 0, tiled=True)
    recv_ids_B = jax.lax.all_to_all(send_ids_B, axes, 0, 0, tiled=True)
    out_BM = ffn(recv_BM, recv_ids_B, weights, E_l)
    back_BM = jax.lax.all_to_all(out_BM, axes, 0, 0, tiled=True)
    y_RM = jnp.take(back_BM, where_R, axis=0, mode="fill", fill_value=0)
    dropped = jnp.sum(~fits_R).astype(jnp.float32)
    return _combine(y_RM, gates_TK, T, x_TM.dtype), dropped


def _ragged(x_TM, experts_TK, gates_TK, weights, ffn, num_experts, axes, peers, bound):
    """ragged_all_to_all: only the assigned rows travel (sorted by peer), into receive buffers of `bound`
    rows per peer."""
    E_l = num_experts // peers
    T, K = experts_TK.shape
    M = x_TM.shape[-1]
    experts_R = experts_TK.reshape(-1)
    order_R = jnp.argsort(experts_R, stable=True)
    sorted_e = experts_R[order_R]
    x_RM = jnp.take(jnp.repeat(x_TM, K, axis=0), order_R, axis=0)
    send_sizes = jnp.minimum(jnp.bincount(sorted_e // E_l, length=peers), bound).astype(jnp.int32)
    all_sizes = jnp.bincount(sorted_e // E_l, length=peers).astype(jnp.int32)
    input_offsets = (jnp.cumsum(all_sizes) - all_sizes).astype(jnp.int32)
    recv_sizes = jax.lax.all_to_all(send_sizes, axes, 0, 0, tiled=True)
    # Peer p writes into my buffer at p * bound; I write into peer q's buffer at my_index * bound.
    me = jax.lax.axis_index(axes)
    output_offsets = jnp.full((peers,), me * bound, jnp.int32)
    recv_BM = jax.lax.ragged_all_to_all(x_RM, jnp.zeros((peers * bound, M), x_TM.dtype), input_offsets,
                                        send_sizes, output_offsets, recv_sizes, axis_name=axes)
    ids_R = sorted_e % E_l
    rows_B = jnp.arange(peers * bound)
    src_B, at_B = rows_B // bound, rows_B % bound
    # The expert ids arrive the same way.
    recv_ids = jax.lax.ragged_all_to_all(ids_R, jnp.zeros((peers * bound,), jnp.int32), input_offsets,
                                         send_sizes, output_offsets, recv_sizes, axis_name=axes)
    recv_ids = jnp.where(at_B < recv_sizes[src_B], recv_ids, E_l)
    out_BM = ffn(recv_BM, recv_ids, weights, E_l)
    # Return trip: each peer sends back the rows it received from me, to where they came from.
    back_offsets = jax.lax.all_to_all(input_offsets, axes, 0, 0, tiled=True)
    back_RM = jax.lax.ragged_all_to_all(out_BM, jnp.zeros_like(x_RM), (jnp.arange(peers) * bound).astype(jnp.int32),
                                        recv_sizes, back_offsets, send_sizes, axis_name=axes)
    y_RM = jnp.zeros_like(back_RM).at[order_R].set(back_RM)
    dropped = jnp.sum(all_sizes - send_sizes).astype(jnp.float32)
    return _combine(y_RM, gates_TK, T, x_TM.dtype), dropped


def dropless(x_TM: jax.Array, experts_TK: jax.Array, gates_TK: jax.Array, weights: dict,
             activation: Callable, *, num_experts: int, token_axes: Sequence[str] = (),
             expert_axes: Sequence[str] = (), model_axes: Sequence[str] = (), exchange: str = "auto",
             peer_bound: Optional[float] = None, matmul: str = "auto",
             length_axes: Sequence[str] = ()) -> tuple[jax.Array, jax.Array]:
    """(y_TM, dropped fraction) for tokens x_TM routed to experts_TK with weights gates_TK.

    Outside a partition (or with no mesh axes) everything runs on one device. Inside, it is a manual
    region: tokens split over token_axes (which must include expert_axes), experts over expert_axes,
    expert hidden units over model_axes. Tokens may also come as [B, L, M] (experts and gates [B, L, K]),
    B split over token_axes and L over length_axes (context parallelism): the region takes them as they lie
    and flattens each device's block, where merging a split L into B's split would gather them.
    """
    exchange = exchange_for(exchange, jax.default_backend())
    ffn = functools.partial(expert_ffn, activation=activation, matmul=matmul)
    mesh = gs.annotations.current_mesh()
    lead, K = experts_TK.shape[:-1], experts_TK.shape[-1]
    T = math.prod(lead)
    if mesh is None or not (token_axes or expert_axes or model_axes or length_axes):
        y, _ = _local(x_TM.reshape(T, -1), experts_TK.reshape(T, K), gates_TK.reshape(T, K), weights, ffn,
                      num_experts)
        return y.reshape(x_TM.shape), jnp.zeros((), jnp.float32)
    token_axes, expert_axes, model_axes = tuple(token_axes), tuple(expert_axes), tuple(model_axes)
    length_axes = tuple(length_axes)
    if length_axes and len(lead) != 2:
        raise ValueError(f"dropless: length_axes {length_axes} split the L of tokens [B, L, M]; got tokens of "
                         f"shape {tuple(x_TM.shape)}")
    every = token_axes + length_axes  # the axes a device's tokens are split over
    missing = [a for a in expert_axes if a not in token_axes]
    if missing:
        raise ValueError(f"dropless: expert axes {missing} must also split the tokens (token axes {token_axes})")
    size = dict(mesh.shape)
    peers = math.prod(size[a] for a in expert_axes)
    shards = math.prod(size[a] for a in every)
    if num_experts % peers or T % shards:
        raise ValueError(f"dropless: {num_experts} experts over {peers} devices and {T} tokens over {shards} "
                         f"devices must divide evenly")
    rows = (T // shards) * K
    bound = rows if peer_bound is None else max(1, min(rows, math.ceil(peer_bound * rows / peers)))

    # The expert weights are whole over the token axes that are not expert axes (data, ...), so their
    # gradients are summed over those axes. Entering as a broadcast copy per device (no data moves) makes the
    # region return each device's partial gradient; the sum is then the broadcast's transpose outside it,
    # which the partitioner reduces once per step after the microbatch and pipeline loops, like every other
    # gradient, rather than inside each layer's backward.
    copies = tuple(a for a in every if a not in expert_axes)
    n_copies = math.prod(size[a] for a in copies)
    if copies:
        weights = {n: jnp.broadcast_to(w, (n_copies, *w.shape)) for n, w in weights.items()}

    def body(x, e, g, w):
        shape = x.shape
        x, e, g = x.reshape(-1, shape[-1]), e.reshape(-1, K), g.reshape(-1, K)  # this device's block of tokens
        if copies:
            w = {n: v[0] for n, v in w.items()}
        if peers == 1:
            y, dropped = _local(x, e, g, w, ffn, num_experts)
        elif exchange == "all_gather":
            y, dropped = _all_gather(x, e, g, w, ffn, num_experts, expert_axes, peers)
        elif exchange == "ragged":
            y, dropped = _ragged(x, e, g, w, ffn, num_experts, expert_axes, peers, bound)
        else:
            y, dropped = _all_to_all(x, e, g, w, ffn, num_experts, expert_axes, peers, bound)
        if model_axes:
            y = jax.lax.psum(y, model_axes)
        return y.reshape(shape), jax.lax.psum(dropped, every) / (T * K)

    tok = P(token_axes or None, *([length_axes or None] if len(lead) == 2 else []), None)
    exp = expert_axes or None
    mod = model_axes or None
    lead_w = (copies,) if copies else ()
    w_specs = {n: P(*lead_w, exp, None, mod) if n != "wo" else P(*lead_w, exp, mod, None) for n in weights}
    return gs.manual(body, in_specs=(tok, tok, tok, w_specs), out_specs=(tok, P()))(
        x_TM, experts_TK, gates_TK, weights)
