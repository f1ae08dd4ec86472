"""Weights gathered one iteration ahead: a scanned layer stack whose weights are stored sharded (FSDP's z,
ZeRO-3) all-gathers layer i+1's weights in iteration i, beside layer i's compute.

A scan over layers reads each layer's slice of the stacked weights (its xs) and gathers it where a matmul
needs it whole, so every trip starts by waiting for its own gather. Nothing in the trip feeds that gather,
though: it depends on the stacked weights alone. So the loop is software-pipelined, as AxoNN overlaps its
all-gathers (OAG) and XLA's collective pipeliner moves them: the first layer's slice is gathered before the
loop, the carry holds the gathered weights of the current layer, and each trip gathers the next layer's
slice while it computes with the current one. The last trip is peeled off (run once after the loop on the
weights the loop gathered last), so no slice is gathered twice and the bytes moved stay those of the
unpipelined loop. Each trip reads its slices from the whole stack (a slice of the stack would copy it), and
writes its results into the whole stacked results, carried through the loop (the peeled trip's too), as a
scan writes its own: joining the peeled trip's results to the loop's would copy them all. The cost is one
layer's gathered weights held across the trip and the body's program twice (docs/partitioner.md); explain()'s
liveness and the automatic sharding's rows count both layers through the loop (AHEAD_LAYERS).

This module says which stacked inputs a scan body gathers that way (`targets`); control_flow.py's scan
lowering runs the pipelined loop.
"""
from __future__ import annotations

import contextvars

from ..representation.jax_compat import scan_counts
from ..representation.program import Eqn
from ..representation.sharding import Sharding
from . import deferral as DF

ENABLED = contextvars.ContextVar("prefetched_gathers", default=True)
# the gathered slices a pipelined loop holds through its trips: the trip's (its carry) and the next one's
AHEAD_LAYERS = 2
RELAYOUTS = ("sharding_annotation", "copy", "copy_p")  # readers that only re-lay the slice: it is gathered for them


def disabled():
    """Gather each trip's weights in the trip, as without this module (benchmarks compare the two)."""
    return DF.switched_off(ENABLED)


def _readers(body) -> dict:
    """Value -> [(equation, operand index)] of the body's readers (checkpointed regions' bodies inlined)."""
    readers: dict = {}
    for e in DF._flat(body.eqns):
        for i, x in enumerate(e.invars):
            readers.setdefault(x, []).append((e, i))
    return readers


def _gathered(lo, body, b, readers: dict):
    """The sharding every reader of body input b needs it in, where that is an all-gather of b as planned (and
    nothing else); else None."""
    from . import manual_regions as M
    planned = lo.plan.sharding(b)
    if not planned.axes or not len(b.shape) or b in body.outvars:
        return None
    needs = set()
    for e, i in readers.get(b, ()):
        if e.name in RELAYOUTS:  # an annotation asking for the gathered weight (a rules table's FSDP spec)
            needs.add(lo.plan.sharding(e.outvars[0]))
            continue
        rule = lo.plan.rules.get(e)
        if rule is None or e.subs or M.is_region(e) or e.name in DF.CHAIN_OPS:
            return None
        needs.add(lo.choose(e, rule, lo.planned_operands(e)).need[i])
    if len(needs) != 1:
        return None
    (need,) = needs
    steps = lo.reshard_steps(planned, need, b.shape) if need != planned else ()
    if steps and all(st.kind in ("all-gather", "all-slice") for st in steps) and any(
            st.kind == "all-gather" for st in steps):
        return need
    return None


def targets(lo, eqn: "Eqn") -> dict[int, Sharding]:
    """Stacked input j of scan `eqn` -> the sharding every reader in its body needs it in, where that is an
    all-gather of the slice as planned (and nothing else): the gathers a pipelined loop issues a trip ahead."""
    if not ENABLED.get() or eqn.params["length"] < 2:
        return {}
    body = eqn.subs["body"]
    nc, nk = scan_counts(eqn.params)
    readers, made_by = _readers(body), lo.producers()
    out = {}
    for j, b in enumerate(body.invars[nc + nk:]):
        if getattr(made_by.get(eqn.invars[nc + nk + j]), "name", None) in DF.LOOPS:
            continue  # another loop's stacked results (a backward pass's residuals): not weights stored split
        need = _gathered(lo, body, b, readers)
        if need is not None:
            out[j] = need
    return out


def hoisted(lo, eqn: "Eqn") -> dict[int, Sharding]:
    """Invariant input i of scan `eqn` (a const, read unchanged every trip) -> the sharding it is gathered to
    before the loop, where every reader in the body needs it so (loop-invariant code motion, as XLA hoists the
    gather out of the loop; two loops reading one value then share one gather, as XLA's CSE merges them)."""
    body = eqn.subs["body"]
    readers = _readers(body)
    out = {}
    for i, b in enumerate(body.invars[:scan_counts(eqn.params)[0]]):
        need = _gathered(lo, body, b, readers)
        if need is not None:
            out[i] = need
    return out
