"""The buffers the plan's shardings make one: an annotation asking for the sharding its operand has is
that operand (the lowering emits nothing for it), and a scan's stacked result that is its stacked input,
returned unchanged or so annotated, is that input (JAX's scan forwards it). lifetimes.py and liveness.py
apply them where the plan is known (explain(): liveness.merge_identities); the automatic sharding,
choosing the plan, does not."""
from __future__ import annotations

from typing import Any, Callable

from ..representation.jax_compat import scan_counts
from ..representation.program import Eqn, Value


def identity(e: Eqn, sharding: Callable[[Value], Any]) -> bool:
    """An annotation asking for the sharding its operand has: the lowering emits nothing for it."""
    return e.name == "sharding_annotation" and isinstance(e.invars[0], Value) and \
        sharding(e.invars[0]) == sharding(e.outvars[0])


def forwarded(e: Eqn, sharding: Callable[[Value], Any]) -> dict:
    """A scan's stacked results whose per-trip value is the trip's slice of a stacked input, unchanged or
    annotated with its own sharding (JAX's partial evaluation saves a weight a layer annotates as a residual):
    the lowered body returns its input as it got it, and JAX's scan forwards the stacked input in their place,
    so they hold no buffer of their own."""
    body, (nc, nk) = e.subs["body"], scan_counts(e.params)
    xs = {id(b): x for b, x in zip(body.invars[nc + nk:], e.invars[nc + nk:])}
    made = {id(v): q for q in body.eqns for v in q.outvars}
    out = {}
    for y, v in zip(body.outvars[nk:], e.outvars[nk:]):
        while id(y) not in xs and id(y) in made and identity(made[id(y)], sharding):
            y = made[id(y)].invars[0]
        x = xs.get(id(y))
        if isinstance(x, Value) and sharding(v) == sharding(x):
            out[v] = x
    return out
