"""A pipeline stage's jax.vjp residuals, split by what they depend on.

Those that depend on the activation are stashed once per microbatch (per
tick); those that depend on the weights alone (a weight, its cast or
transpose) are recomputed at the backward instead, so no copy of a stage's
weights is held per microbatch.

The residuals are probed under the same vmap over stages as the schedule runs
the stage: a manual region inside a stage (a dropless MoE layer) makes its
residuals split over every manual mesh axis but the vmap's spmd axis, so a
probe outside the vmap would see other shapes (and a different backward).
"""
from __future__ import annotations

from typing import Callable

import jax
from jax.extend import core
from jax.interpreters.partial_eval import dce_jaxpr

from ..partitioner.representation.jax_compat import convert_constvars_jaxpr
from .common import in_context


class Residuals:
    """A stage's jax.vjp residuals, split into those that depend on the activation (stashed per microbatch)
    and those that depend on the weights alone (recomputed at the backward: a weight, its cast or transpose,
    is never stashed once per microbatch).

    vmap: the schedule's vmap over stages; w_shape, x_shape: every stage's weights and input, stage-stacked.
    """

    def __init__(self, vmap: Callable, stage: Callable, w_shape, x_shape):
        def leaves(w, x):
            out, vjp = jax.vjp(stage, w, x)
            flat, self.treedef = jax.tree.flatten(vjp)
            return flat

        closed = jax.make_jaxpr(vmap(leaves))(*(in_context(t) for t in (w_shape, x_shape)))
        jaxpr, self.consts = convert_constvars_jaxpr(closed.jaxpr), list(closed.consts)
        n_w = len(self.consts) + len(jax.tree.leaves(w_shape))
        self.on_x = _depends(jaxpr, n_w)
        weights_only, self.used_in = dce_jaxpr(jaxpr, [not d for d in self.on_x])
        assert not any(self.used_in[n_w:]), "weight-only residuals read the activation"
        self.weights_only = core.ClosedJaxpr(weights_only, [])
        # One stage's view inside the vmap: the stage dim dropped.
        self.stashed = [jax.ShapeDtypeStruct(v.aval.shape[1:], v.aval.dtype)
                        for v, d in zip(jaxpr.outvars, self.on_x) if d]

    def split(self, flat):
        return [f for f, d in zip(flat, self.on_x) if d]

    def recompute(self, w) -> list:
        """The weight-only residuals of every stage (stage-stacked, as w is); outside the vmap."""
        args = [a for a, u in zip(self.consts + jax.tree.leaves(w), self.used_in) if u]
        return list(core.jaxpr_as_fun(self.weights_only)(*args))

    def rebuild(self, recomputed, stashed):
        """The vjp function of one stage (inside the vmap) from its weight-only and stashed residuals."""
        recomputed, stashed = iter(recomputed), iter(stashed)
        flat = [next(stashed) if d else next(recomputed) for d in self.on_x]
        return jax.tree.unflatten(self.treedef, flat)


def _depends(jaxpr, n_w: int) -> list[bool]:
    """For each output of jaxpr, whether it depends on the inputs after the first n_w."""
    return _flow(jaxpr, [i >= n_w for i in range(len(jaxpr.invars))])


def _flow(jaxpr, on_x: list[bool]) -> list[bool]:
    """Which outputs of jaxpr depend on the inputs marked in on_x: through a jit call (the jitted stage's
    residuals leave one call) output by output, through any other equation all outputs alike."""
    dep = dict(zip(jaxpr.invars, on_x))
    for e in jaxpr.eqns:
        ins = [(not isinstance(v, core.Literal)) and dep.get(v, False) for v in e.invars]
        if e.primitive.name in ("pjit", "jit"):
            outs = _flow(e.params["jaxpr"].jaxpr, ins)
        else:
            outs = [any(ins)] * len(e.outvars)
        dep.update(zip(e.outvars, outs))
    return [(not isinstance(v, core.Literal)) and dep.get(v, False) for v in jaxpr.outvars]
