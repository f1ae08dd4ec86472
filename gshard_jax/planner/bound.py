"""A floor under the screen: per mesh, a step time no candidate on it beats by formula, whatever its options.

The screen (estimate.py) costs every option of every mesh: millions of candidates on a few thousand devices.
Most meshes cannot come near the best: their tensor, context and expert collectives, or their gradient
reductions, alone cost more than the best candidates' whole step. plan() screens meshes in the order of
their floor and stops where the floor passes the step of the candidates it may plan, so the candidates it
plans, and their order, are the exhaustive screen's (test_planner checks the floor against every candidate).

Each term is one of collectives()'s at the options that make it smallest: no recompute (remat none), the
cheapest ZeRO stage and EPSO choice, and each group of axes at the fastest bandwidth any order of the axes
gives it. A mesh's floor takes one microbatch's latencies and the whole step's bytes (a microbatch's bytes
times the microbatches, or in a pipeline times its forward ticks, at least the step's), the smallest bubble
and no pipeline transfers; an option group's (microbatches, schedule, repeats fixed) takes its own counts,
bubble and transfers over stage. An offloaded update's host transfers count nothing.
"""
from __future__ import annotations

import functools
import math
from typing import Optional, Sequence

from ..partitioner.costs.cost import latency_steps, moved_bytes
from ..partitioner.costs.hardware import Hardware
from . import estimate as E, space as SP
from .space import ModelShape


def floor(shape: ModelShape, sizes: dict[str, int], hw: Hardware, remats: Sequence[str] = SP.REMATS,
          zero_stages: Sequence[int] = SP.ZERO_STAGES, costs: Optional[dict] = None) -> float:
    """Seconds: no candidate on mesh `sizes` (every axis of SP.AXES named) screens faster, whatever its
    microbatches and schedule (module docstring)."""
    frac = 0.0
    if sizes["stage"] > 1:  # the smallest bubble of the schedules that run
        frac = min((E.schedule(sched, sizes["stage"], m, r).bubble for (m, sched, r), reason, _ in
                    SP.option_groups(shape, sizes, remats, zero_stages) if not reason), default=0.0)
    return _floor(shape, sizes, hw, remats, zero_stages, 1, 1.0, frac, None, {} if costs is None else costs)


def group_floor(shape: ModelShape, sizes: dict[str, int], hw: Hardware, m: int, sched: str, r: int,
                remats: Sequence[str] = SP.REMATS, zero_stages: Sequence[int] = SP.ZERO_STAGES,
                costs: Optional[dict] = None) -> float:
    """Seconds: no candidate on mesh `sizes` with m microbatches and schedule `sched` x r repeats screens
    faster, whatever its ZeRO stage, EPSO, remat, sequence parallelism or axis order. costs: a dict kept per
    mesh (its collectives' costs per kind and axes) across calls."""
    costs = {} if costs is None else costs
    if sizes["stage"] == 1:
        return _floor(shape, sizes, hw, remats, zero_stages, m, m, 0.0, None, costs)
    facts = E.schedule(sched, sizes["stage"], m, r)
    return _floor(shape, sizes, hw, remats, zero_stages, m, facts.forward_ticks / r, facts.bubble, (sched, facts),
                  costs)


def _floor(shape: ModelShape, s: dict, hw: Hardware, remats, zero_stages, m: int, runs: float, frac: float,
           pipeline, costs: dict) -> float:
    """The floor at m microbatches whose layers run `runs` times a step, idle `frac` of it; `pipeline`:
    (schedule, its facts) for a group's own transfers over stage, None to count none."""
    p, d, z, e, y, x, cx = (s[a] for a in ("stage", "data", "z", "expert", "y", "x", "context"))
    devices = math.prod(s.values())
    b = shape.param_bytes
    tokens = shape.tokens / (d * z * e * cx * m)  # a device's tokens per microbatch
    act = tokens * shape.d_model / x * b  # its residual stream
    stacks = 2 if shape.kind == "encoder_decoder" else 1
    layers, moe_layers = shape.layers * stacks / p * runs, shape.periods * stacks / p * runs
    attn = shape.heads * shape.head_dim

    def t(kind: str, axes: tuple, payload: float, count: float) -> float:
        """`count` collectives of `payload` bytes each (as collectives() adds them)."""
        got = costs.get((kind, axes))
        if got is None:  # (seconds of latency, seconds per byte of payload) at the group's fastest bandwidth
            group = math.prod(s[a] for a in axes)
            got = costs[kind, axes] = (0.0, 0.0) if group <= 1 else (
                latency_steps(kind, group) * hw.latency, moved_bytes(kind, 1.0, group) / _fastest(hw, _key(s, axes)))
        if count <= 0 or payload <= 0:
            return 0.0
        return count * (got[0] + payload * got[1])

    total = t("all-reduce", ("y",), act, 4 * layers) + t("all-reduce", ("y",), act, 2 * m)  # layers; vocabulary
    if shape.experts and not shape.dropless and p == 1:  # (a pipeline's sequence-parallel twin has none)
        total += t("all-reduce", ("y",), act * (shape.k * shape.capacity_factor - 1), 2 * moe_layers)
    if cx > 1:
        kv = tokens * attn / y * b
        total += (t("collective-permute", ("context",), kv, 2 * (cx - 1) * layers)
                  + t("collective-permute", ("context",), kv, 2 * (cx - 2) * layers)
                  + t("collective-permute", ("context",), kv * 4 / b, 2 * cx * layers))
    ffn = (shape.ffn_inputs + 1) * shape.d_ff
    total += t("all-reduce", ("x",), tokens * (4 * attn + ffn) / y * b, layers)
    if shape.experts and not shape.dropless:
        total += t("all-reduce", ("x",), tokens * ffn * (shape.k * shape.capacity_factor - 1) / y * b, moe_layers)
    total += t("all-reduce", ("x",), tokens * shape.vocab / y * b, m)
    if shape.experts and e > 1:
        if not shape.dropless:
            total += t("all-to-all", ("expert",), act * shape.k * shape.capacity_factor, 4 * layers)
        elif shape.exchange == "all_gather":
            total += t("all-gather", ("expert",), act * e, 2 * layers) + t("reduce-scatter", ("expert",), act * e,
                                                                          2 * layers)
        else:
            dense = shape.exchange == "all_to_all"
            per_peer = e if dense and not shape.peer_bound else (min(e, shape.peer_bound) if dense else 1)
            total += t("all-to-all", ("expert",), act * x * shape.k * per_peer, 4 * layers)
    if shape.dropless:
        per_layer = shape.expert_params / max(shape.periods, 1) / (e * y) * b
        total += (t("all-reduce", ("x",), per_layer, moe_layers) + t("all-gather", ("x",), act * x, 2 * moe_layers)
                  + t("all-gather", ("x",), per_layer, 2 * moe_layers)
                  + t("all-reduce", ("x",), act * x, 2 * moe_layers))
    total += min(_weights_at(shape, s, zero, epso, m, t, costs) for zero in zero_stages
                 for epso in ((True, False) if e > 1 else (True,)) if epso or zero)
    if pipeline is not None:  # the sequence-parallel twin's smaller transfers (split over y)
        sched, facts = pipeline
        act_sp = act / y
        own = sched in ("1f1b", "interleaved_1f1b")
        total += t("collective-permute", ("stage",), act_sp, facts.rolls)
        # stage-owned ends send nothing over stage (estimate.collectives, which still counts an offloaded
        # candidate's replicated ends: the floor leaves them out for every candidate, so it stays a floor)
        if not shape.owned_ends:
            total += t("all-reduce", ("stage",), act_sp * m * (4 / b if own else 1), 1)
            head = shape.vocab * shape.d_model / (y * x) * 4
            total += min(t("all-reduce", ("stage",), head / (d if zero else 1), 1) for zero in zero_stages) if own \
                else t("all-reduce", ("stage",), act_sp * m, 1)
    lightest = SP.Candidate(tuple((a, n) for a, n in s.items() if n > 1),
                            remat=min(remats, key=lambda r: E.recomputed_flops_per_token(shape, r)))
    compute = E.compute_time(shape, lightest, hw, devices)
    return (compute / (1 - frac) if frac < 1 else math.inf) + total


def _weights_at(shape: ModelShape, s: dict, zero: int, epso: bool, m: int, t, costs: dict) -> float:
    """_weights at m microbatches from the mesh's costs: its terms run once or (1 or 2) x m times a step, so
    they are a + m b, a and b worked out once per mesh and option."""
    key = ("weights", zero, epso)
    if key not in costs:
        once = _weights(shape, s, zero, epso, 0, t)
        costs[key] = (once, _weights(shape, s, zero, epso, 1, t) - once)
    once, per_microbatch = costs[key]
    return once + m * per_microbatch


def _weights(shape: ModelShape, s: dict, zero: int, epso: bool, m: int, t) -> float:
    """The weight terms of collectives() for one ZeRO stage and EPSO choice, at m microbatches, no recompute."""
    b = shape.param_bytes
    e, y, x, p, z = (s[a] for a in ("expert", "y", "x", "stage", "z"))
    w = {"expert": shape.expert_params / (e * y * x * p), "layer": shape.layer_params / (y * x * p),
         "vocab": shape.vocab_params / (y * x)}
    dp_axes = {"expert": ("data", "context"), "layer": ("data", "expert", "context"),
               "vocab": ("data", "expert", "context")}
    out = 0.0
    for cls, n in w.items():
        gather = ("z",) + (dp_axes[cls] if zero == 3 else ())
        out += t("all-gather", gather, n * b, 2 * m) + t("reduce-scatter", gather, n * b, m)
        if zero == 3:
            continue
        store = n / z
        if zero == 0:
            out += t("all-reduce", dp_axes[cls], store * 4, 1)
        else:
            axes = dp_axes[cls] if epso or cls == "expert" else ("data",)
            out += t("reduce-scatter", axes, store * 4, m if zero == 2 else 1) + t("all-gather", axes, store * b, 1)
    return out


def _key(s: dict, axes: tuple) -> tuple:
    """What the fastest bandwidth of a group of axes depends on: the group's size and the other axes' sizes."""
    group = math.prod(s[a] for a in axes)
    return group, tuple(sorted(n for a, n in s.items() if a not in axes and n > 1))


@functools.lru_cache(maxsize=1 << 16)
def _fastest_cached(hw: Hardware, size: int, others: tuple) -> float:
    products = {1}
    for n in others:
        products |= {q * n for q in products}
    rest = math.prod(others)
    # The group's innermost axis is `inner` apart (a product of other axes inside it); it spans from size x
    # inner devices (nothing else between its axes) to size x all the others: either side of a node.
    return max(hw.group_bandwidth(size, inner, span) for inner in products
               for span in (size * inner, size * rest))


def _fastest(hw: Hardware, key: tuple) -> float:
    """The fastest bytes/s per device any order of the mesh's axes gives a collective over a group of axes."""
    return _fastest_cached(hw, *key)
