"""Ring attention (context parallelism): attention over a sequence split along a mesh axis, as a gs.manual region.

q, k, v are [batch, length, heads, head_dim] (models/layers.py ``Attention``'s ``BLHK`` layout; k/v may have
fewer heads than q, grouped-query style, as long as they divide q's). Their length dim is split over one mesh
axis (``"context"`` by default). Inside a manual region each device holds one block of q, k and v; the K/V
blocks travel around the ring by ``jax.lax.ppermute`` (collective-permute) for n-1 steps while every device
folds each arriving block into an online (flash-style) softmax: running max, running sum and output
accumulator, in float32. No device ever holds more than two K/V blocks, so memory and bytes per device are
O(S/n), where a sequence-split plain attention gathers the whole K/V (O(S)).

The backward is a ring too (``jax.custom_vjp``): the forward saves only the local q, k, v, output,
log-sum-exp and the first K/V block it received, and the backward sends K/V around the ring together with
their gradient accumulators dK/dV, which arrive back at their owner after n rotations (the flash-attention
backward, block by block). Starting from the saved block, it sends K/V n - 2 times: per device and layer the
ring sends 2(n-1) blocks forward and 2(n-2) + 2n backward.

Causal load balance (``layout="zigzag"``): with contiguous blocks, device 0's queries see only its own block
while device n-1's see all of them. Zigzag order splits the sequence into 2n chunks and gives device i chunks
i and 2n-1-i, so every device computes the same number of (query chunk, key chunk) blocks. The layer takes
its inputs already in zigzag order and returns its output in that order: permute the token ids (and the
positions RoPE uses) once where the model enters context parallelism (``zigzag``, ``zigzag_indices``) and
invert it once where it leaves (``unzigzag``), not per layer. Every position-wise op in between (norms,
FFNs, projections) does not care about the order; attention's causal mask does, and this layer knows it.

``schedule`` is the block schedule as data: which (query chunk, key chunk) pairs each device computes at
each ring step, fully or under a diagonal mask; blocks the causal mask hides entirely are not computed.
The kernel is driven by it and the tests count its work per device from it.
"""
from __future__ import annotations

import functools
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import gshard_jax as gs

LAYOUTS = ("zigzag", "contiguous")
FULL, DIAG = "full", "diag"
BLOCK_SIZE = 512  # the default key tile: a chunk's logits in flight are [heads, chunk, BLOCK_SIZE]
_MASKED = -1e30  # a finite "minus infinity": exp() of it minus any real max is 0, and it never makes a nan


# ----------------------------------------------------------------------------------------------------------
# Layout: the zigzag permutation of the sequence and its inverse.

def zigzag_indices(length: int, n: int) -> jax.Array:
    """Where each position of the zigzag-ordered sequence comes from: chunks 0, 2n-1, 1, 2n-2, ... of 2n.

    ``x[:, zigzag_indices(L, n)]`` puts chunks i and 2n-1-i in device i's block when the result is split
    over n devices; these are also the positions to give RoPE for the permuted tokens.
    """
    if length % (2 * n):
        raise ValueError(f"zigzag: length {length} must divide into 2 x {n} chunks")
    c = length // (2 * n)
    # Elementwise on an iota, not a concatenation of aranges: split over the context axis, each device computes
    # its own positions and nothing moves (a concatenation's pieces would be permuted into place).
    slot = jnp.arange(length)
    device, offset = slot // (2 * c), slot % (2 * c)
    return jnp.where(offset < c, device * c + offset, (2 * n - 1 - device) * c + offset - c)


def zigzag(x: jax.Array, n: int, axis: int = 1) -> jax.Array:
    """x with its `axis` (the sequence) put in zigzag order for n devices."""
    return jnp.take(x, zigzag_indices(x.shape[axis], n), axis=axis)


def unzigzag(x: jax.Array, n: int, axis: int = 1) -> jax.Array:
    """The inverse of ``zigzag``: the sequence back in its natural order."""
    inverse = jnp.argsort(zigzag_indices(x.shape[axis], n))
    return jnp.take(x, inverse, axis=axis)


# ----------------------------------------------------------------------------------------------------------
# The block schedule.

def _slots(causal: bool, layout: str) -> int:
    """How many chunks a device's block holds: 2 under zigzag (chunks i and 2n-1-i), else 1 (masks need no
    finer view without a causal mask)."""
    return 2 if causal and layout == "zigzag" else 1


def _pairs(case: int, causal: bool, layout: str) -> tuple[tuple[int, int, str], ...]:
    """The (query slot, key slot, full|diag) blocks a device computes against the K/V block of device j, by
    case = sign(j - i) + 1 (0: j < i, 1: j == i, 2: j > i); pairs the causal mask hides entirely are absent."""
    if not causal:
        return ((0, 0, FULL),)
    if layout == "contiguous":
        return (((0, 0, FULL),), ((0, 0, DIAG),), ())[case]
    # zigzag: my chunks i, 2n-1-i; theirs j, 2n-1-j.
    #   j < i: both my chunks come after chunk j and before 2n-1-j -> my 2 chunks x their first.
    #   j > i: my chunk i precedes both of theirs; 2n-1-i follows both -> my second chunk x their 2.
    return (((0, 0, FULL), (1, 0, FULL)),
            ((0, 0, DIAG), (1, 0, FULL), (1, 1, DIAG)),
            ((1, 0, FULL), (1, 1, FULL)))[case]


def schedule(n: int, *, causal: bool = True, layout: str = "zigzag") -> list[list[tuple[int, int, str]]]:
    """Per device i, per ring step s (holding the K/V block of device (i - s) mod n): the blocks computed,
    as (query chunk, key chunk, "full" | "diag") in global chunk numbers (2n chunks under causal zigzag,
    else n)."""
    _check_layout(layout)
    slots = _slots(causal, layout)

    def chunk(dev, slot):
        return (dev, 2 * n - 1 - dev)[slot] if slots == 2 else dev

    out = []
    for i in range(n):
        steps = []
        for s in range(n):
            j = (i - s) % n
            case = (j > i) - (j < i) + 1
            steps.append([(chunk(i, a), chunk(j, b), kind) for a, b, kind in _pairs(case, causal, layout)])
        out.append(steps)
    return out


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"ring_attention layout={layout!r}; expected one of {LAYOUTS}")


# ----------------------------------------------------------------------------------------------------------
# Per-device kernel (inside the manual region).

def _split(x_BLHD, slots):
    """A block's chunks: a list of `slots` arrays [B, c, ...]."""
    return jnp.split(x_BLHD, slots, axis=1) if slots > 1 else [x_BLHD]


def _grouped(q_BLHD, kv_heads):
    """q's heads as [B, L, Hkv, G, D]: query head h uses k/v head h // G (jnp.repeat's order)."""
    B, L, H, D = q_BLHD.shape
    return q_BLHD.reshape(B, L, kv_heads, H // kv_heads, D)


def _logits(q_BLKGD, k_BTKD, kind, scale, offset=0):
    """Scaled logits [B, Hkv, G, L, T] in float32; in a diagonal block (its keys starting at `offset` within
    the query chunk) the keys after each query masked."""
    s = jnp.einsum("BLKGD,BTKD->BKGLT", q_BLKGD, k_BTKD, preferred_element_type=jnp.float32) * scale
    if kind == DIAG:
        L, T = s.shape[-2:]
        s = jnp.where(jnp.arange(L)[:, None] >= offset + jnp.arange(T)[None, :], s, _MASKED)
    return s


def _tiles(fn, carry, k_BTKD, v_BTKD, tile):
    """fn(carry, t, offset, k tile, v tile) over key tiles of `tile` positions: the logits in flight are
    [.., chunk, tile], linear in the chunk."""
    T = k_BTKD.shape[1]
    if T <= tile:
        return fn(carry, 0, 0, k_BTKD, v_BTKD)

    def body(t, carry):
        sl = lambda x: jax.lax.dynamic_slice_in_dim(x, t * tile, tile, axis=1)
        return fn(carry, t, t * tile, sl(k_BTKD), sl(v_BTKD))
    return jax.lax.fori_loop(0, T // tile, body, carry)


def _fold(state, q_BLKGD, k_BTKD, v_BTKD, kind, scale, tile):
    """One block into a query chunk's online softmax: (max, sum [B,K,G,L], acc [B,K,G,L,D]) in float32."""
    return _tiles(lambda st, t, off, k, v: _fold_tile(st, q_BLKGD, k, v, kind, scale, off), state,
                  k_BTKD, v_BTKD, tile)


def _fold_tile(state, q_BLKGD, k_BTKD, v_BTKD, kind, scale, offset):
    m, total, acc = state
    s = _logits(q_BLKGD, k_BTKD, kind, scale, offset)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    p = jnp.exp(s - m_new[..., None])
    alpha = jnp.exp(m - m_new)
    pv = jnp.einsum("BKGLT,BTKD->BKGLD", p.astype(v_BTKD.dtype), v_BTKD, preferred_element_type=jnp.float32)
    return m_new, alpha * total + jnp.sum(p, axis=-1), alpha[..., None] * acc + pv


def _case(i, j):
    return jnp.where(j < i, 0, jnp.where(j == i, 1, 2))


def _branches(fn, causal, layout):
    """One branch per case (as `_pairs`), each folding its pairs with fn(carry, a, b, kind)."""
    def branch(case):
        def run(carry):
            for a, b, kind in _pairs(case, causal, layout):
                carry = fn(carry, a, b, kind)
            return carry
        return run
    return [branch(c) for c in range(3)] if causal else [branch(0)]


def _switch(branches, i, j, carry):
    return branches[0](carry) if len(branches) == 1 else jax.lax.switch(_case(i, j), branches, carry)


def _forward(q_BLHD, k_BLKD, v_BLKD, axis, n, causal, layout, scale, tile):
    """(output [B, L, H, D] in q's dtype, log-sum-exp [B, Hkv, G, L] in float32, the K/V block received
    first) of the local queries."""
    slots, kvh = _slots(causal, layout), k_BLKD.shape[2]
    i = jax.lax.axis_index(axis)
    qs = [_grouped(x, kvh) for x in _split(q_BLHD, slots)]
    B, c, K, G, D = qs[0].shape
    init = tuple((jnp.full((B, K, G, c), _MASKED, jnp.float32), jnp.zeros((B, K, G, c), jnp.float32),
                  jnp.zeros((B, K, G, c, D), jnp.float32)) for _ in range(slots))

    def fold(carry, a, b, kind):
        states, ks, vs = carry
        states = list(states)
        states[a] = _fold(states[a], qs[a], ks[b], vs[b], kind, scale, tile)
        return tuple(states), ks, vs

    branches = _branches(fold, causal, layout)
    ring = [(t, (t + 1) % n) for t in range(n)]

    def step(s, carry):
        states, k, v = carry
        nxt = jax.lax.ppermute((k, v), axis, ring)  # issued before this step's compute, so they may overlap
        states, _, _ = _switch(branches, i, (i - s) % n, (states, _split(k, slots), _split(v, slots)))
        return states, *nxt

    states, k, v = step(0, (init, k_BLKD, v_BLKD))  # peeled: the backward reuses the block it receives
    first = (k, v)
    if n > 2:
        states, k, v = jax.lax.fori_loop(1, n - 1, step, (states, k, v))
    states, _, _ = _switch(branches, i, (i - (n - 1)) % n, (states, _split(k, slots), _split(v, slots)))
    outs, lses = [], []
    for m, total, acc in states:
        outs.append((acc / total[..., None]).transpose(0, 3, 1, 2, 4).reshape(B, c, K * G, D))
        lses.append(m + jnp.log(total))
    return jnp.concatenate(outs, axis=1).astype(q_BLHD.dtype), jnp.concatenate(lses, axis=-1), first


def _backward(q_BLHD, k_BLKD, v_BLKD, o_BLHD, lse, first, do_BLHD, axis, n, causal, layout, scale, tile):
    """(dq, dk, dv) of the local blocks: K/V ride the ring with their dK/dV, which return home after n hops."""
    slots, kvh = _slots(causal, layout), k_BLKD.shape[2]
    i = jax.lax.axis_index(axis)
    qs = [_grouped(x, kvh) for x in _split(q_BLHD, slots)]
    dos = [_grouped(x, kvh) for x in _split(do_BLHD, slots)]
    # delta = rowsum(dO * O): the softmax's backward term, per query row [B, K, G, L]
    delta = jnp.einsum("BLKGD,BLKGD->BKGL", _grouped(do_BLHD, kvh).astype(jnp.float32),
                       _grouped(o_BLHD, kvh).astype(jnp.float32))
    lses, deltas = jnp.split(lse, slots, axis=-1), jnp.split(delta, slots, axis=-1)

    def fold_tile(a, kind):
        def run(carry, t, offset, k_BTKD, v_BTKD):
            dq, dk, dv = carry
            p = jnp.exp(_logits(qs[a], k_BTKD, kind, scale, offset) - lses[a][..., None])  # masked: exactly 0
            dv_t = jnp.einsum("BKGLT,BLKGD->BTKD", p, dos[a].astype(jnp.float32))
            dp = jnp.einsum("BLKGD,BTKD->BKGLT", dos[a], v_BTKD, preferred_element_type=jnp.float32)
            ds = p * (dp - deltas[a][..., None]) * scale
            dq = dq + jnp.einsum("BKGLT,BTKD->BLKGD", ds, k_BTKD.astype(jnp.float32))
            dk_t = jnp.einsum("BKGLT,BLKGD->BTKD", ds, qs[a].astype(jnp.float32))
            T = k_BTKD.shape[1]
            add = lambda acc, x: jax.lax.dynamic_update_slice_in_dim(
                acc, jax.lax.dynamic_slice_in_dim(acc, offset, T, axis=1) + x, offset, axis=1)
            return dq, add(dk, dk_t), add(dv, dv_t)
        return run

    def fold(carry, a, b, kind):
        dqs, ks, vs, dks, dvs = carry
        dqs, dks, dvs = list(dqs), list(dks), list(dvs)
        dqs[a], dks[b], dvs[b] = _tiles(fold_tile(a, kind), (dqs[a], dks[b], dvs[b]), ks[b], vs[b], tile)
        return tuple(dqs), ks, vs, tuple(dks), tuple(dvs)

    branches = _branches(fold, causal, layout)
    ring = [(t, (t + 1) % n) for t in range(n)]
    split32 = lambda x: tuple(_split(x.astype(jnp.float32), slots))

    def compute(s, dq, k, v, dk, dv):
        dqs, _, _, dks, dvs = _switch(branches, i, (i - s) % n,
                                      (dq, _split(k, slots), _split(v, slots), split32(dk), split32(dv)))
        return dqs, jnp.concatenate(dks, axis=1), jnp.concatenate(dvs, axis=1)

    def step(s, carry):
        dq, k, v, dk, dv = carry
        dq, dk, dv = compute(s, dq, k, v, dk, dv)
        return (dq, *jax.lax.ppermute((k, v, dk, dv), axis, ring))

    dq0 = tuple(jnp.zeros(x.shape, jnp.float32) for x in qs)
    zeros = jnp.zeros(k_BLKD.shape, jnp.float32)
    # Step 0 on the local block: its dK/dV set out round the ring, and the K/V it would send along are the
    # block the forward received first (saved), so the backward sends K/V n - 2 times, not n - 1.
    dq, dk, dv = compute(0, dq0, k_BLKD, v_BLKD, zeros, zeros)
    carry = (dq, *first, *jax.lax.ppermute((dk, dv), axis, ring))
    if n > 2:
        carry = jax.lax.fori_loop(1, n - 1, step, carry)
    dq, k, v, dk, dv = carry
    dq, dk, dv = compute(n - 1, dq, k, v, dk, dv)
    dk, dv = jax.lax.ppermute((dk, dv), axis, ring)  # the last hop: every dK/dV block back to its owner
    dq = jnp.concatenate([x.reshape(x.shape[:2] + (-1, x.shape[-1])) for x in dq], axis=1)
    return dq.astype(q_BLHD.dtype), dk.astype(k_BLKD.dtype), dv.astype(v_BLKD.dtype)


@functools.lru_cache(maxsize=None)
def _ring(axis: str, n: int, causal: bool, layout: str, scale: float, tile: int):
    """The per-device ring as a custom_vjp: its residuals are the local q, k, v, output, log-sum-exp and the
    first K/V block the forward received."""
    @jax.custom_vjp
    def ring(q, k, v):
        return _forward(q, k, v, axis, n, causal, layout, scale, tile)[0]

    def fwd(q, k, v):
        o, lse, first = _forward(q, k, v, axis, n, causal, layout, scale, tile)
        return o, (q, k, v, o, lse, first)

    def bwd(res, do):
        return _backward(*res, do, axis, n, causal, layout, scale, tile)

    ring.defvjp(fwd, bwd)
    return ring


# ----------------------------------------------------------------------------------------------------------
# The global-view API.

def reference_attention(q_BLHD: jax.Array, k_BLKD: jax.Array, v_BLKD: jax.Array, *, causal: bool = True,
                        positions_L: Optional[jax.Array] = None) -> jax.Array:
    """Plain softmax attention in float32 (k/v heads repeated to q's): the unsplit answer ring attention
    must equal. positions_L: the tokens' positions for the causal mask (default: the natural order)."""
    H, K = q_BLHD.shape[2], k_BLKD.shape[2]
    k_BLHD, v_BLHD = jnp.repeat(k_BLKD, H // K, axis=2), jnp.repeat(v_BLKD, H // K, axis=2)
    s = jnp.einsum("BLHD,BTHD->BHLT", q_BLHD, k_BLHD, preferred_element_type=jnp.float32)
    s = s * q_BLHD.shape[-1] ** -0.5
    if causal:
        pos = jnp.arange(q_BLHD.shape[1]) if positions_L is None else positions_L
        s = jnp.where(pos[:, None] >= pos[None, :], s, _MASKED)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("BHLT,BTHD->BLHD", p, v_BLHD.astype(jnp.float32)).astype(q_BLHD.dtype)


def ring_attention(q_BLHD: jax.Array, k_BLKD: jax.Array, v_BLKD: jax.Array, *, axis: str = "context",
                   causal: bool = True, layout: str = "zigzag", batch_axes: Sequence[str] = (),
                   head_axes: Sequence[str] = (), block_size: int = BLOCK_SIZE) -> jax.Array:
    """Softmax attention of q over k, v, [B, L, H, D] -> [B, L, H, D], with L split over mesh axis `axis`.

    Call it inside a gs.partition'ed function; q, k, v are resharded to [batch_axes, axis, head_axes, -]
    at the region's edge (keep them there and nothing moves). k/v may have fewer heads than q (grouped
    query attention: q head h uses k/v head h // (H / Hkv)); with head_axes, both head counts must divide.
    layout="zigzag" (causal): the sequence is in ``zigzag`` order for n = the axis's size, and so is the
    output; layout="contiguous": the natural order (causal work then grows with the device index).
    block_size: the key tile each chunk's logits are computed over (a chunk of S/(2n) or S/n keys larger than
    it is folded in tiles), so the logits in flight are [heads, chunk, block_size]: memory linear in S/n.
    Outside a partition, or with a size-1 axis, it is the plain attention of the natural order.
    """
    _check_layout(layout)
    n = context_size(axis)
    if n == 1:
        return reference_attention(q_BLHD, k_BLKD, v_BLKD, causal=causal)
    B, L, H, D = q_BLHD.shape
    if k_BLKD.shape != v_BLKD.shape or k_BLKD.shape[:2] != (B, L) or H % k_BLKD.shape[2]:
        raise ValueError(f"ring_attention: q {q_BLHD.shape}, k {k_BLKD.shape}, v {v_BLKD.shape}: self-attention "
                         f"over one sequence, k/v heads dividing q's")
    pieces = n * _slots(causal, layout)
    if L % pieces:
        raise ValueError(f"ring_attention: length {L} must divide into {pieces} chunks over {axis!r}")
    batch_axes, head_axes = tuple(batch_axes), tuple(head_axes)
    spec = P(batch_axes or None, axis, head_axes or None, None)
    chunk = L // pieces
    tile = min(block_size, chunk)
    if chunk % tile:
        raise ValueError(f"ring_attention: block_size {block_size} must divide the chunk of {chunk} positions")
    ring = _ring(axis, n, causal, layout, float(D ** -0.5), tile)
    return gs.manual(ring, in_specs=(spec, spec, spec), out_specs=spec)(q_BLHD, k_BLKD, v_BLKD)


def context_size(axis: str = "context") -> int:
    """The size of mesh axis `axis` in the partition being traced (1 outside one): the n for ``zigzag``."""
    mesh = gs.annotations.current_mesh()
    return dict(mesh.shape).get(axis, 1) if mesh is not None else 1


__all__ = ["ring_attention", "reference_attention", "zigzag", "unzigzag", "zigzag_indices", "schedule",
           "context_size"]
