"""Factors: the vocabulary every sharding rule is written in.

A rule names a *factor* for every dim of every operand and result. A dim may
hold several factors (major to minor) when a reshape merged dims. Sharding a
factor over mesh axes shards every dim that holds it; a *reduction* factor
(absent from the results) leaves a partial result, combined by a sum
(lazily, as a psum or reduce-scatter) or by the op's own combine; a
*replicated* factor may not be sharded (the sort dim). This module holds the
Rule type, the conversions between a tensor's sharding and its factors'
axes, and the enumeration of candidate factor shardings; rules/factor_rules.py builds a
rule per primitive.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import Callable, Mapping, Optional

from .sharding import Axes, Sharding, splittable

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
    # follower -> leader: factors of different sizes split together (a windowed op's input rows and the
    # output rows or window rows they feed; the hook exchanges halos). A follower carries its leader's axes.
    ties: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # False: propagation does not carry a split across the ties (slice, pad); the strategy choice still
    # exchanges halos when the operand and the planned result are both split there.
    ties_propagate: bool = True
    # Op policy, as fields (Shardy's factor types and isBlocked): how propagation and lowering treat the op.
    pointwise: bool = False  # an elementwise op: the first propagation phase spreads user shardings through it
    late_backward: bool = False  # propagates backward only once nothing else proposes (a broadcast)
    link: bool = False  # a control-flow identity (carry, body argument): a value linked to a pinned one is pinned
    rings: bool = False  # a collective matmul may replace its all-gather of an operand or reduce-scatter of its result
    # The op's work from its factors' local sizes, where the product of every factor is not it (a fused kernel
    # whose factors are not one loop nest); None: that product (twice, with a reduction).
    work: Optional[Callable[[Mapping[str, int]], float]] = dataclasses.field(default=None, compare=False)
    # Memo of tensor_to_factors / factors_to_tensor: propagation and lowering ask often. A rule belongs to one
    # program on one mesh; the memo starts afresh if asked about another mesh.
    memo: dict = dataclasses.field(default_factory=dict, compare=False, hash=False, repr=False)

    def _memo(self, mesh_shape: Mapping[str, int]) -> dict:
        seen = self.memo.get(None)
        if seen is None or seen[0] is not mesh_shape:
            key = tuple(mesh_shape.items())
            if seen is None or seen[1] != key:
                self.memo.clear()
            self.memo[None] = (mesh_shape, key)
        return self.memo

    def to_factors(self, tf: "TensorFactors", sharding: Sharding, mesh_shape: Mapping[str, int]) -> list:
        memo = self._memo(mesh_shape)
        key = (tf, sharding)
        out = memo.get(key)
        if out is None:
            out = memo[key] = tensor_to_factors(tf, sharding, self.sizes, mesh_shape)
        return out

    def split_factors(self, tf: "TensorFactors", sharding: Sharding, mesh_shape: Mapping[str, int]) -> tuple:
        """The (factor, axes) pairs with axes that the sharding implies (dims it cannot express skipped)."""
        memo = self._memo(mesh_shape)
        key = (tf, sharding, None)
        out = memo.get(key)
        if out is None:
            out = memo[key] = tuple((f, ax) for d in self.to_factors(tf, sharding, mesh_shape) if d
                                    for f, ax in d.items() if ax)
        return out

    def to_tensor(self, tf: "TensorFactors", fs: Mapping[str, "Axes"], mesh_shape: Mapping[str, int]):
        """factors_to_tensor, memoized per (tensor factors, the axes of its factors)."""
        memo = self._memo(mesh_shape)
        key = (tf, tuple([fs.get(f, ()) for d in tf for f in d]))
        if key in memo:
            return memo[key]
        out = memo[key] = factors_to_tensor(tf, fs, self.sizes, mesh_shape)
        return out

    @property
    def key(self) -> tuple:
        """Equal for rules that describe the same computation (sizes fix every tensor's shape)."""
        key = self.memo.get("key")
        if key is None:
            key = self.memo["key"] = (self.kind, self.operands, self.results, tuple(self.sizes.items()),
                                      tuple(self.reductions.items()), self.replicated,
                                      tuple(self.ties.items()), self.ties_propagate, self.pointwise,
                                      self.late_backward, self.link, self.rings)
        return key

    def tie(self, fs: "FactorSharding") -> Optional["FactorSharding"]:
        """fs with every follower carrying its leader's axes (a leader takes its follower's when it has none);
        None if a follower and its leader are split differently."""
        if not self.ties:
            return fs
        out = dict(fs)
        for follower, leader in self.ties.items():
            fa, la = out.get(follower, ()), out.get(leader, ())
            if fa and la and fa != la:
                return None
            out[leader] = out[follower] = la or fa
        return out

    @property
    def factors(self) -> list[str]:
        return list(self.sizes)

    def __str__(self) -> str:
        """The rule as Shardy prints one: ([a, b], [b, c])->([a, c]) {a=2, b=3, c=5} reduction={b} ..."""
        def t(tf):
            return "[" + ", ".join("".join(d) if d else "_" for d in tf) + "]"
        text = f"({', '.join(t(o) for o in self.operands)})->({', '.join(t(r) for r in self.results)}) "
        text += "{" + ", ".join(f"{f}={n}" for f, n in self.sizes.items()) + "}"
        if self.reductions:
            text += " reduction={" + ", ".join(f if k == "sum" else f"{f}:{k}"
                                               for f, k in self.reductions.items()) + "}"
        if self.replicated:
            text += " need_replication={" + ", ".join(f for f in self.sizes if f in self.replicated) + "}"
        if self.ties:
            text += " ties={" + ", ".join(f"{a}~{b}" for a, b in self.ties.items()) + "}"
            text += "" if self.ties_propagate else " (not propagated)"
        flags = [name for name in ("pointwise", "late_backward", "link", "rings") if getattr(self, name)]
        return text + (" " + " ".join(flags) if flags else "")

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
    if len(dim) == 1:  # a simple dim may split unevenly (padded)
        ok = splittable(sizes[dim[0]], math.prod(mesh_shape[a] for a in axes))
        return {dim[0]: tuple(axes)} if ok else None
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
    if len(dim) == 1:
        fa = fs.get(dim[0], ())
        return fa if splittable(sizes[dim[0]], math.prod(mesh_shape[a] for a in fa)) else None
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
    """The canonical sharding (uneven dims padded) of a tensor given its factors' axes."""
    used = tuple((f, fs[f]) for d in tf for f in d if fs.get(f))
    return _factors_to_tensor(tf, used, tuple(sorted(sizes.items())), tuple(sorted(mesh_shape.items())))


@functools.lru_cache(maxsize=65536)
def _factors_to_tensor(tf: TensorFactors, used: tuple, sizes: tuple, mesh: tuple) -> Optional[Sharding]:
    fs, sizes, mesh_shape = dict(used), dict(sizes), dict(mesh)
    dims = []
    for d in tf:
        ax = factors_to_dim(d, fs, sizes, mesh_shape)
        if ax is None:
            return None
        dims.append(ax)
    shape = [math.prod(sizes[f] for f in d) for d in tf]
    return Sharding(tuple(dims)).canonical(shape, mesh_shape)


_LETTERS = "abcdefghijklmnopqrstuvwxyz"


class FactorNames:
    """Fresh factor names (a, b, c, ...) and their sizes, for building one rule."""

    def __init__(self) -> None:
        self.sizes: dict[str, int] = {}

    def new(self, size: int) -> str:
        n = len(self.sizes)
        name = _LETTERS[n % 26] + (str(n // 26) if n >= 26 else "")
        self.sizes[name] = int(size)
        return name


def candidate_factor_shardings(rule: Rule, proposals: list[FactorSharding], mesh_shape: Mapping[str, int],
                               limit: int = 4096) -> list[FactorSharding]:
    """Every consistent factor sharding built from the proposals' per-factor options.

    A candidate uses each mesh axis for at most one factor, never shards a
    replicated factor, and divides every factor it shards that a reshape
    merged with others (simple factors may split unevenly, padded).
    """
    options: dict[str, list[Axes]] = {}
    compound = {f for tf in rule.operands + rule.results for d in tf if len(d) > 1 for f in d}
    followers: dict[str, list[str]] = {}
    for follower, leader in rule.ties.items():
        followers.setdefault(leader, []).append(follower)
    for f in rule.factors:
        if f in rule.ties:
            continue  # a follower takes its leader's option
        group = [f] + followers.get(f, [])
        opts: list[Axes] = [()]
        if not any(g in rule.replicated for g in group):
            for p in proposals:
                for g in group:
                    ax = p.get(g, ())
                    tiles = math.prod(mesh_shape[a] for a in ax)
                    if ax and ax not in opts and all(splittable(rule.sizes[h], tiles, h in compound) for h in group):
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
            fs = dict(zip(names, combo))
            for follower, leader in rule.ties.items():
                fs[follower] = fs[leader]
            out.append(fs)
    return out
