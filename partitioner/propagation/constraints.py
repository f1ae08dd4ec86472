"""The constraints propagation runs over: each op's factor rule with its operands and results, the links
between a control-flow form's caller and its bodies, and which broadcasts wait for their readers."""
from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Optional

from ..representation import factors as F
from ..representation.program import Eqn, Program, Value
from ..representation.sharding import Sharding, splittable
from ..strategies import registry as REG


@dataclasses.dataclass(eq=False)
class Constraint:
    rule: F.Rule
    ins: list
    outs: list
    name: str
    where: object  # the equation it comes from, or a description; see `source`

    def __post_init__(self) -> None:
        # (value, its factors) for the operands, then the results
        self.tensors = list(zip(self.ins, self.rule.operands)) + list(zip(self.outs, self.rule.results))

    @property
    def source(self) -> str:
        """Where the user wrote the op (formatted only when a message names it)."""
        return self.where.source if isinstance(self.where, Eqn) else str(self.where)


def link(a, b, name: str, where: object, stacked: int = 0, stacked_b: bool = False) -> Constraint:
    """a and b share every dim, and values flow from a to b; with stacked=1, a (b if stacked_b) has an
    extra leading dim (the scan dim) kept whole."""
    names = F.FactorNames()
    big, small = (b, a) if stacked_b else (a, b)
    dims = tuple((names.new(s),) for s in small.shape)
    lead = tuple((names.new(big.shape[0]),) for _ in range(stacked))
    rep = frozenset(f for (f,) in lead)
    ops = (dims, lead + dims) if stacked_b else (lead + dims, dims)
    rule = F.Rule("link", (ops[0],), (ops[1],), names.sizes, replicated=rep, link=True)
    return Constraint(rule, [a], [b], name, where)


def control_flow_links(e: Eqn) -> tuple[list[Constraint], list[Constraint]]:
    """Links into the bodies (before them in propagation order) and out of them (after); see control_flow.py."""
    op = REG.op_for(e.name)
    form = op.form if op is not None else None
    into, out = form.links(e) if form else ([], [])  # a checkpointed region is aliased: nothing to link
    return ([link(a, b, tag, e, st, sb) for a, b, tag, st, sb in into],
            [link(a, b, tag, e, st, sb) for a, b, tag, st, sb in out])


def constraints(program: Program, rules: Mapping[Eqn, Optional[F.Rule]]) -> list[Constraint]:
    out: list[Constraint] = []
    for e in program.eqns:
        if e.subs:
            into, after = control_flow_links(e)
            out += into
            for sub in e.subs.values():
                out += constraints(sub, rules)
            out += after
        elif rules.get(e) is not None:
            out.append(Constraint(rules[e], e.invars, e.outvars, e.name, e))
    return out


def merge(cur: Sharding, new: Sharding, shape, mesh_shape, blocked: Optional[dict] = None,
           by: Callable[[], str] = str) -> Sharding:
    """Extend cur's dims with new's where new continues them with unused axes (blocked[d]: why not, by() names
    the proposer)."""
    if new.dims == cur.dims or all(len(n) <= len(c) for c, n in zip(cur.dims, new.dims)):
        return cur  # new extends no dim (the common case once propagation has settled)
    dims = list(cur.dims)
    used = set(cur.axes)
    blocked = {} if blocked is None else blocked
    for d, (c, n) in enumerate(zip(cur.dims, new.dims)):
        if len(n) > len(c) and n[: len(c)] == c:
            extra = tuple(a for a in n[len(c):])
            if used & set(extra):
                blocked[d] = (f"{by()} would split it over {'*'.join(extra)}, which already splits another "
                              f"dim of this value")
                continue
            tiles = 1
            for a in c + extra:
                tiles *= mesh_shape[a]
            if not splittable(shape[d], tiles):
                blocked[d] = f"{by()} would split it over {'*'.join(c + extra)}: {shape[d]} rows for {tiles} tiles"
                continue
            dims[d] = c + extra
            used |= set(extra)
    return Sharding(tuple(dims)).canonical(shape, mesh_shape)


def repeats(c: Constraint, readers: dict) -> bool:
    """Whether c is a broadcast whose new dim every reader merges into a neighbour by a reshape (jnp.repeat of
    k/v heads in grouped-query attention). Its operand's splits then reach the repeated value only once its
    readers have proposed theirs (the attention's head split), so the repeat is not laid out before them."""
    if c.rule.kind != "broadcast" or not c.outs or not isinstance(c.outs[0], Value):
        return False
    operand_factors = {f for d in c.rule.operands[0] for f in d}
    new = [d for d, fd in enumerate(c.rule.results[0])
           if not operand_factors.intersection(fd) and c.rule.sizes[fd[0]] > 1]
    users = readers.get(c.outs[0], [])
    return bool(new and users) and all(
        r.rule.kind == "reshape" and len(r.rule.results[0]) < len(r.rule.operands[0]) for r in users)
