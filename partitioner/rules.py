"""Factor rules: one einsum-like description per primitive (DESIGN.md section 5).

A rule names a *factor* for every dim of every operand and result. A dim may
hold several factors (major to minor) when a reshape merged dims. Sharding a
factor over mesh axes shards every dim that holds it; a *reduction* factor
(absent from the results) leaves a partial result, combined by a sum
(lazily, as a psum or reduce-scatter) or by the op's own combine; a
*replicated* factor may not be sharded (the sort dim). Propagation, strategy
choice and costing all read these rules: there is no per-op code path.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Callable, Mapping, Optional

from .program import Const, Eqn
from .sharding import Axes, Sharding

DimFactors = tuple[str, ...]
TensorFactors = tuple[DimFactors, ...]


@dataclasses.dataclass(frozen=True)
class Rule:
    kind: str
    operands: tuple[TensorFactors, ...]
    results: tuple[TensorFactors, ...]
    sizes: Mapping[str, int]
    reductions: Mapping[str, str] = dataclasses.field(default_factory=dict)
    replicated: frozenset[str] = frozenset()

    @property
    def factors(self) -> list[str]:
        return list(self.sizes)

    def signature(self) -> str:
        def t(tf):
            return "".join(f[0] if len(f) == 1 else "(" + "".join(f) + ")" for f in tf)
        return ",".join(t(o) for o in self.operands) + "->" + ",".join(t(r) for r in self.results)


FactorSharding = dict[str, Axes]


def dim_to_factors(dim: DimFactors, axes: Axes, sizes: Mapping[str, int],
                   mesh_shape: Mapping[str, int]) -> Optional[FactorSharding]:
    """Spread a dim's axes over its factors, major first; None if they do not fit."""
    out: FactorSharding = {f: () for f in dim}
    if not axes:
        return out
    if not dim:
        return None
    i, rem = 0, sizes[dim[0]]
    for a in axes:
        n = mesh_shape[a]
        while rem == 1 and i + 1 < len(dim):
            i += 1
            rem = sizes[dim[i]]
        if rem % n:
            return None
        out[dim[i]] += (a,)
        rem //= n
    return out


def factors_to_dim(dim: DimFactors, fs: Mapping[str, Axes], sizes: Mapping[str, int],
                   mesh_shape: Mapping[str, int]) -> Optional[Axes]:
    """The dim's axes given its factors' axes; None if a minor factor is split while a major is not whole."""
    axes: Axes = ()
    whole = True
    for f in dim:
        fa = fs.get(f, ())
        if fa and not whole:
            return None
        if fa and sizes[f] % math.prod(mesh_shape[a] for a in fa):
            return None
        axes += fa
        whole = whole and math.prod(mesh_shape[a] for a in fa) == sizes[f]
    return axes


def tensor_to_factors(tf: TensorFactors, sharding: Sharding, sizes, mesh_shape) -> list[Optional[FactorSharding]]:
    """Per dim, the factor shardings a tensor's sharding implies (None where inexpressible)."""
    return [dim_to_factors(d, ax, sizes, mesh_shape) for d, ax in zip(tf, sharding.dims)]


def factors_to_tensor(tf: TensorFactors, fs: Mapping[str, Axes], sizes, mesh_shape) -> Optional[Sharding]:
    dims = []
    for d in tf:
        ax = factors_to_dim(d, fs, sizes, mesh_shape)
        if ax is None:
            return None
        dims.append(ax)
    return Sharding(tuple(dims))


# --------------------------------------------------------------------------- rule builders

_LETTERS = "abcdefghijklmnopqrstuvwxyz"


class _Names:
    def __init__(self) -> None:
        self.sizes: dict[str, int] = {}

    def new(self, size: int) -> str:
        n = len(self.sizes)
        name = _LETTERS[n % 26] + (str(n // 26) if n >= 26 else "")
        self.sizes[name] = int(size)
        return name


def _shape(x) -> tuple[int, ...]:
    return tuple(x.aval.shape) if not isinstance(x, Const) else tuple(x.shape)


ELEMENTWISE = frozenset("""
abs acos acosh add add_any and asin asinh atan atan2 atanh cbrt ceil clamp complex conj convert_element_type
copy copy_p cos cosh digamma div eq erf erf_inv erfc exp exp2 expm1 floor ge gt igamma igammac imag
integer_pow is_finite le lgamma log log1p logistic lt max min mul ne neg nextafter not or pow real
reduce_precision rem round rsqrt select_n shift_left shift_right_arithmetic shift_right_logical sign
sin sinh sqrt square sub tan tanh xor population_count clz stop_gradient sharding_annotation
optimization_barrier_unused
""".split())


def elementwise(eqn: Eqn) -> Optional[Rule]:
    """Same factor for every dim; rank-0 operands and size-1 (implicitly broadcast) dims get their own."""
    out_shape = _shape(eqn.outvars[0])
    n = _Names()
    dims = tuple((n.new(s),) for s in out_shape)
    ops = []
    for x in eqn.invars:
        shape = _shape(x)
        if len(shape) not in (0, len(out_shape)):
            return None
        ops.append(tuple(f if s == out_shape[d] else (n.new(s),) for d, (s, f) in enumerate(zip(shape, dims))))
    return Rule("elementwise", tuple(ops), (dims,) * len(eqn.outvars), n.sizes)


def broadcast_in_dim(eqn: Eqn) -> Rule:
    x = eqn.invars[0]
    shape, bdims = eqn.params["shape"], eqn.params["broadcast_dimensions"]
    n = _Names()
    res = [(n.new(s),) for s in shape]
    op = []
    for i, d in enumerate(bdims):
        op.append(res[d] if _shape(x)[i] == shape[d] else (n.new(_shape(x)[i]),))
    extra = tuple(() for _ in eqn.invars[1:])
    return Rule("broadcast", (tuple(op),) + extra, (tuple(res),), n.sizes)


def reshape(eqn: Eqn) -> Optional[Rule]:
    """Split and merge dims into a common refinement of factors.

    Where the two shapes share no further factor (e.g. [6,4]->[4,6] after the
    leading 2), the remaining dims get factors that must stay replicated.
    """
    if eqn.params.get("dimensions") not in (None, ()):
        return None
    src, dst = list(_shape(eqn.invars[0])), list(eqn.params["new_sizes"])
    n = _Names()
    op: list[list[str]] = [[] for _ in src]
    res: list[list[str]] = [[] for _ in dst]
    rep: set[str] = set()
    rem_a, rem_b = list(src), list(dst)
    i = j = 0
    while i < len(src) and j < len(dst):
        if rem_a[i] == 1:
            if not op[i]:
                op[i].append(n.new(1))
            i += 1
            continue
        if rem_b[j] == 1:
            if not res[j]:
                res[j].append(n.new(1))
            j += 1
            continue
        g = min(rem_a[i], rem_b[j]) if max(rem_a[i], rem_b[j]) % min(rem_a[i], rem_b[j]) == 0 \
            else math.gcd(rem_a[i], rem_b[j])
        if g == 1:
            break
        f = n.new(g)
        op[i].append(f)
        res[j].append(f)
        rem_a[i] //= g
        rem_b[j] //= g
    for dims, rem, start in ((op, rem_a, i), (res, rem_b, j)):
        for d in range(start, len(dims)):
            if rem[d] > 1 or not dims[d]:
                f = n.new(rem[d])
                dims[d].append(f)
                rep.add(f)
    extra = tuple(() for _ in eqn.invars[1:])
    return Rule("reshape", (tuple(map(tuple, op)),) + extra, (tuple(map(tuple, res)),), n.sizes,
                replicated=frozenset(rep))


def transpose(eqn: Eqn) -> Rule:
    n = _Names()
    op = [(n.new(s),) for s in _shape(eqn.invars[0])]
    return Rule("transpose", (tuple(op),), (tuple(op[p] for p in eqn.params["permutation"]),), n.sizes)


def squeeze(eqn: Eqn) -> Rule:
    n = _Names()
    drop = {d % len(_shape(eqn.invars[0])) for d in eqn.params["dimensions"]}
    op = [(n.new(s),) for s in _shape(eqn.invars[0])]
    return Rule("squeeze", (tuple(op),), (tuple(f for d, f in enumerate(op) if d not in drop),), n.sizes)


_REDUCE_KINDS = {"reduce_sum": "sum", "reduce_max": "max", "reduce_min": "min", "reduce_prod": "prod",
                 "reduce_and": "and", "reduce_or": "or", "argmax": "argmax", "argmin": "argmin"}


def reduction(eqn: Eqn) -> Rule:
    n = _Names()
    axes = set(eqn.params["axes"])
    op = [(n.new(s),) for s in _shape(eqn.invars[0])]
    kind = _REDUCE_KINDS[eqn.name]
    return Rule(f"reduce({kind})", (tuple(op),), (tuple(f for d, f in enumerate(op) if d not in axes),),
                n.sizes, reductions={op[d][0]: kind for d in axes})


def dot_general(eqn: Eqn) -> Rule:
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    ls, rs = _shape(eqn.invars[0]), _shape(eqn.invars[1])
    n = _Names()
    lhs = [(n.new(s),) for s in ls]
    rhs: list = [None] * len(rs)
    for a, b in zip(lb, rb):
        rhs[b] = lhs[a]
    for a, b in zip(lc, rc):
        rhs[b] = lhs[a]
    red = {lhs[a][0]: "sum" for a in lc}
    for d, s in enumerate(rs):
        if rhs[d] is None:
            rhs[d] = (n.new(s),)
    lfree = [d for d in range(len(ls)) if d not in lb and d not in lc]
    rfree = [d for d in range(len(rs)) if d not in rb and d not in rc]
    out = tuple(lhs[a] for a in lb) + tuple(lhs[d] for d in lfree) + tuple(rhs[d] for d in rfree)
    return Rule("dot_general", (tuple(lhs), tuple(rhs)), (out,), n.sizes, reductions=red)


def iota(eqn: Eqn) -> Rule:
    n = _Names()
    res = tuple((n.new(s),) for s in eqn.params["shape"])
    return Rule("iota", tuple(() for _ in eqn.invars), (res,), n.sizes)


def along_axis(eqn: Eqn) -> Rule:
    """Ops that need their axis whole (cumulative ops, sort) and pass the other dims through."""
    axis = eqn.params.get("axis", eqn.params.get("dimension"))
    shape = _shape(eqn.invars[0])
    n = _Names()
    dims = tuple((n.new(s),) for s in shape)
    axis %= len(shape)
    return Rule(f"{eqn.name}(axis whole)", (dims,) * len(eqn.invars), (dims,) * len(eqn.outvars), n.sizes,
                replicated=frozenset({dims[axis][0]}))


RULES: dict[str, Callable[[Eqn], Optional[Rule]]] = {
    "broadcast_in_dim": broadcast_in_dim,
    "reshape": reshape,
    "transpose": transpose,
    "squeeze": squeeze,
    "dot_general": dot_general,
    "iota": iota,
    **{name: reduction for name in _REDUCE_KINDS},
    **{name: along_axis for name in ("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp", "sort")},
}


def rule_for(eqn: Eqn) -> Optional[Rule]:
    """The factor rule of an equation, or None when the op has none (it then runs replicated)."""
    if eqn.name in ELEMENTWISE:
        return elementwise(eqn)
    builder = RULES.get(eqn.name)
    return builder(eqn) if builder else None


def candidate_factor_shardings(rule: Rule, proposals: list[FactorSharding], mesh_shape: Mapping[str, int],
                               limit: int = 4096) -> list[FactorSharding]:
    """Every consistent factor sharding built from the proposals' per-factor options.

    A candidate uses each mesh axis for at most one factor, never shards a
    replicated factor, and divides every factor it shards.
    """
    options: dict[str, list[Axes]] = {}
    for f in rule.factors:
        opts: list[Axes] = [()]
        if f not in rule.replicated:
            for p in proposals:
                ax = p.get(f, ())
                if ax and ax not in opts and rule.sizes[f] % math.prod(mesh_shape[a] for a in ax) == 0:
                    opts.append(ax)
        options[f] = opts
    while math.prod(len(o) for o in options.values()) > limit:
        f = max(options, key=lambda k: len(options[k]))
        options[f] = options[f][:-1]
    names = list(options)
    out = []
    for combo in itertools.product(*(options[f] for f in names)):
        used = [a for ax in combo for a in ax]
        if len(used) == len(set(used)):
            out.append(dict(zip(names, combo)))
    return out
