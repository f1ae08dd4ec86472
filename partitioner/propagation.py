"""Sharding propagation over a Program through the factor rules (DESIGN.md section 6).

Shardings only ever grow: a value's dims gain axes, never lose them, so the
fixed point is reached in a few passes. User shardings (annotations,
in/out shardings) are fixed. Values proposed by several neighbours take the
first proposal, in order: fixed values, then operands on forward passes and
results on backward passes. Backward propagation out of a broadcast is held
back until the other sources are exhausted. Every value records where its
sharding came from, for explain().
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Optional, Sequence

from . import rules as R
from .program import Eqn, Program, Value
from .sharding import Sharding

LATE_BACKWARD = frozenset({"broadcast_in_dim"})


@dataclasses.dataclass
class Plan:
    """A sharding and its provenance for every value, and a rule for every equation."""

    shardings: dict[Value, Sharding]
    origins: dict[Value, str]
    fixed: set[Value]
    rules: dict[Eqn, Optional[R.Rule]]

    def sharding(self, v) -> Sharding:
        if isinstance(v, Value):
            return self.shardings.get(v) or Sharding.replicated(len(v.shape))
        return Sharding.replicated(len(v.shape))


def _merge(cur: Sharding, new: Sharding, shape, mesh_shape) -> Sharding:
    """Extend cur's dims with new's where new continues them with unused axes."""
    dims = list(cur.dims)
    used = set(cur.axes)
    for d, (c, n) in enumerate(zip(cur.dims, new.dims)):
        if len(n) > len(c) and n[: len(c)] == c:
            extra = tuple(a for a in n[len(c):])
            if used & set(extra):
                continue
            tiles = 1
            for a in c + extra:
                tiles *= mesh_shape[a]
            if shape[d] % tiles:
                continue
            dims[d] = c + extra
            used |= set(extra)
    return Sharding(tuple(dims))


def propagate(program: Program, mesh_shape: Mapping[str, int],
              seeds: Mapping[Value, tuple[Sharding, str]], max_passes: int = 50) -> Plan:
    """Propagate from the seeds (value -> (sharding, origin)) to every value of the program."""
    shardings: dict[Value, Sharding] = {}
    origins: dict[Value, str] = {}
    for v, (s, why) in seeds.items():
        shardings[v], origins[v] = s, why
    fixed = set(seeds)
    rules = {e: R.rule_for(e) for e in program.eqns}
    # Annotation outputs are fixed by the user.
    for e in program.eqns:
        if e.name == "sharding_annotation":
            v = e.outvars[0]
            shardings[v] = e.params["sharding"]
            origins[v] = f"user annotation {e.params['what']} at {e.source}"
            fixed.add(v)

    def visit(e: Eqn, forward: bool, late: bool) -> bool:
        rule = rules[e]
        if rule is None:
            return False
        tensors = list(zip(e.invars, rule.operands)) + list(zip(e.outvars, rule.results))
        n_in = len(e.invars)
        order = list(range(len(tensors))) if forward else list(range(n_in, len(tensors))) + list(range(n_in))
        order.sort(key=lambda i: tensors[i][0] not in fixed)
        fs: R.FactorSharding = {}
        used: set[str] = set()
        for i in order:
            v, tf = tensors[i]
            if not isinstance(v, Value) or v not in shardings:
                continue
            for dim_fs in R.tensor_to_factors(tf, shardings[v], rule.sizes, mesh_shape):
                for f, ax in (dim_fs or {}).items():
                    if ax and f not in fs and f not in rule.replicated and not used & set(ax):
                        fs[f] = ax
                        used |= set(ax)
        if not fs:
            return False
        targets = range(n_in, len(tensors)) if forward else range(n_in)
        if not forward and e.name in LATE_BACKWARD and not late:
            return False
        changed = False
        for i in targets:
            v, tf = tensors[i]
            if not isinstance(v, Value) or v in fixed:
                continue
            # Reduction factors only shard operands; results never see them.
            proposal = R.factors_to_tensor(tf, fs, rule.sizes, mesh_shape)
            if proposal is None:
                proposal = Sharding(tuple(R.factors_to_dim(d, fs, rule.sizes, mesh_shape) or ()
                                          for d in tf))
            cur = shardings.get(v, Sharding.replicated(len(tf)))
            new = _merge(cur, proposal, v.shape, mesh_shape)
            if new != cur or v not in shardings:
                if new != cur or not new.is_replicated:
                    shardings[v] = new
                    direction = "forward" if forward else "backward"
                    origins[v] = f"{direction} from {e.name} at {e.source or '?'}"
                    changed = True
        return changed

    for late in (False, True):
        for _ in range(max_passes):
            changed = False
            for e in program.eqns:
                changed |= visit(e, True, late)
            for e in reversed(program.eqns):
                changed |= visit(e, False, late)
            if not changed:
                break

    values: Sequence[Value] = list(program.invars) + [v for v, _ in program.consts] + \
        [v for e in program.eqns for v in e.outvars]
    for v in values:
        if v not in shardings:
            shardings[v] = Sharding.replicated(len(v.shape))
            origins[v] = "replicated: no annotation or sharded neighbour reached it"
    return Plan(shardings, origins, fixed, rules)
