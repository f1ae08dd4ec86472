"""The factor rule of fused attention: `jax.nn.dot_product_attention(implementation="cudnn")`'s forward and
backward primitives (cuDNN's flash attention; `implementation="xla"` traces to ordinary ops instead).

As GShard partitions attention: batch and heads are elementwise (each device runs the kernel on its own
batch rows and heads, with no communication), so a model split over data and heads calls the fused kernel on
local shapes. GQA's query heads are (kv head, group) major to minor, so heads split over the kv heads' factor
and every device holds whole groups with their shared K/V heads, never repeated. The kernel's softmax runs
over every key and its head dims are contracted inside it, so keys and head dims stay whole: a split there
is gathered, and explain() states that gather. Queries are independent rows unless a causal or sliding
window mask ties a row to its position, so they may split only without one (a causal split sequence runs as
the context ring, models/ring_attention.py). Packed sequences (offsets), paged K/V and dropout have no rule:
they run replicated and the report flags them.
"""
from __future__ import annotations

import math
from typing import Optional

from ..representation.factors import FactorNames, Rule
from ..representation.program import Eqn, shape_of

BTNH = 0  # jax._src.cudnn.fused_attention_stablehlo.AttentionLayout: the layout param's values
BNTH = 1


def _name(value) -> str:
    return getattr(value, "name", str(value))


def _positional(params) -> bool:
    """A causal or sliding-window mask ties a query row to its position in the sequence."""
    return "CAUSAL" in _name(params["mask_type"]) or params.get("sliding_window_length") is not None


def _layout(params) -> int:
    layout = params["layout"]
    return int(getattr(layout, "value", layout))


def _rule(eqn: Eqn, backward: bool) -> Optional[Rule]:
    p = eqn.params
    q, k, v, bias, q_len, kv_len, q_off, kv_off, page_k, page_v = eqn.invars[:10]
    # an absent operand is an empty array: (0,), or (stages, 0) where a pipeline vmapped the kernel over stages
    if any(math.prod(shape_of(x)) for x in (q_off, kv_off, page_k, page_v)) or p.get("dropout_rate"):
        return None
    bnth = _layout(p) == BNTH
    qs, vs = shape_of(q), shape_of(v)
    B, T, N, Hq = (qs[0], qs[2], qs[1], qs[3]) if bnth else qs
    S, K, Hv = (vs[2], vs[1], vs[3]) if bnth else (vs[1], vs[2], vs[3])
    n = FactorNames()
    b, t, s, hq, hv = n.new(B), n.new(T), n.new(S), n.new(Hq), n.new(Hv)
    kv = n.new(K)
    heads = (kv,) if N == K else (kv, n.new(N // K))  # query head = kv head * group + index in the group
    fresh = []

    def new(size):
        fresh.append(n.new(size))
        return (fresh[-1],)

    def lay(bb, tt, hh, dd):  # a [batch, sequence, heads, head dim] tensor in the eqn's layout
        return (bb, hh, tt, dd) if bnth else (bb, tt, hh, dd)

    q_f = lay((b,), (t,), heads, (hq,))
    k_f = lay((b,), (s,), (kv,), (hq,))
    v_f = lay((b,), (s,), (kv,), (hv,))
    out_f = lay((b,), (t,), heads, (hv,))
    stat_f = ((b,), heads, (t,))  # softmax statistics [B, N, T] in every layout
    bias_shape = shape_of(bias)
    if len(bias_shape) == 4:  # [B or 1, N or 1, T, S]: a dim of size 1 broadcasts
        dims = ((b,), heads, (t,), (s,))
        bias_f = tuple(f if size == w and size > 1 else new(size) for size, w, f in zip(bias_shape, (B, N, T, S), dims))
    else:
        bias_f = tuple(new(size) for size in bias_shape)

    def per_example(x):  # sequence lengths: one per batch row
        return ((b,),) if shape_of(x) == (B,) else tuple(new(d) for d in shape_of(x))

    lens = (per_example(q_len), per_example(kv_len))
    rest = tuple(tuple(new(d) for d in shape_of(x)) for x in (q_off, kv_off, page_k, page_v))
    operands = (q_f, k_f, v_f, bias_f) + lens + rest
    whole = {s, hq, hv, *fresh} | ({t} if _positional(p) else set())
    if backward:  # + activation (softmax statistics), forward output, its cotangent -> dq, dk, dv (, dbias)
        operands += (stat_f, out_f, out_f)
        results = (q_f, k_f, v_f, bias_f)[:len(eqn.outvars)]
        name = "fused_attention_bwd"
    else:
        results = (out_f, stat_f)[:len(eqn.outvars)]
        name = "fused_attention_fwd"
    # two matmuls of [T, S] per batch row and head (QK^T and PV); the backward's five are 2.5 times them; a
    # causal mask skips half the blocks
    share = (2.5 if backward else 1.0) * (0.5 if "CAUSAL" in _name(p["mask_type"]) else 1.0)

    def work(local):
        return share * 2 * local[b] * math.prod(local[f] for f in heads) * local[t] * local[s] * (local[hq] + local[hv])
    return Rule(name, operands, results, n.sizes, replicated=frozenset(whole), work=work)


def forward(eqn: Eqn) -> Optional[Rule]:
    return _rule(eqn, backward=False)


def backward(eqn: Eqn) -> Optional[Rule]:
    return _rule(eqn, backward=True)
