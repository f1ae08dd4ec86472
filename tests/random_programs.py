"""The random-program generator: a seeded generator writes a small JAX function (3-8 ops from every op family
the partitioner covers, random sharding annotations between them, random in/out shardings) as Python source,
so a failure prints a runnable reproduction (``generate(seed)[5]``). test_random_programs.py runs them.

Float values are kept bounded (tanh where they could grow) and ops whose result jumps on a tiny change
of their input (floor, comparisons, argmax, argsort, top_k indices, a data-dependent cond) are only
applied to floats that no reduction has touched, so a sum computed in another order cannot flip them.
"""
from __future__ import annotations

import dataclasses
import itertools
import linecache
import math
import random

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import gshard_jax as gs

MESHES = {"8": {"x": 8}, "2x4": {"a": 2, "b": 4}, "4x2": {"a": 4, "b": 2}, "2x2x2": {"a": 2, "b": 2, "c": 2}}
SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12)
MAX_ELEMS = 1024
F, I, B = "f32", "i32", "bool"  # noqa: E741  (the dtypes by their first letter)
JNP_DTYPE = {F: "jnp.float32", I: "jnp.int32", B: "jnp.bool_"}

# --------------------------------------------------------------------------- specs


_SPEC_CACHE: dict = {}


def spec_options(shape, mesh_name: str, small: bool = False) -> list:
    """Every spec tuple splitting `shape` over distinct mesh axes (any order, major to minor), like
    helpers.all_specs(uneven=True): at least one element per tile, or with small=True any non-empty dim
    (a dim smaller than its tile count: the padded tiles past its end are empty)."""
    key = (tuple(shape), mesh_name, small)
    if key in _SPEC_CACHE:
        return _SPEC_CACHE[key]
    sizes = MESHES[mesh_name]
    names = list(sizes)
    out = []
    for targets in itertools.product(range(len(shape) + 1), repeat=len(names)):
        for perm in itertools.permutations(names):
            dims = [tuple(a for a in perm if targets[names.index(a)] == d) for d in range(len(shape))]
            tiles = [math.prod(sizes[a] for a in dims[d]) for d in range(len(shape))]
            if all(shape[d] >= t or (small and t > 1 and shape[d] >= 1) for d, t in enumerate(tiles)):
                spec = tuple(None if not d else (d[0] if len(d) == 1 else d) for d in dims)
                if spec not in out:
                    out.append(spec)
    _SPEC_CACHE[key] = out
    return out


def split_counts(mesh_name: str) -> list[int]:
    sizes = list(MESHES[mesh_name].values())
    return sorted({math.prod(c) for k in range(1, len(sizes) + 1) for c in itertools.combinations(sizes, k)})


# --------------------------------------------------------------------------- the generator


@dataclasses.dataclass
class Var:
    name: str
    shape: tuple
    dtype: str
    scale: float = 1.0      # a bound on |value| (ints: loose)
    exact: bool = True      # no float reduction has touched it (its value does not depend on sum order)

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)


@dataclasses.dataclass
class Arg:
    name: str
    kind: str               # "array", "index" (int32 scalar), "indices" (int32 array, explicit values), "key"
    shape: tuple = ()
    dtype: str = F
    values: object = None


def _shape_str(shape) -> str:
    return "(" + ", ".join(map(str, shape)) + (",)" if len(shape) == 1 else ")")


def _fmt_spec(spec) -> str:
    return "(" + ", ".join(repr(s) for s in spec) + (",)" if len(spec) == 1 else ")")


def _index_expr(rank: int, d: int, item: str) -> str:
    return "[" + ", ".join([":"] * d + [item]) + "]"


def _bcast_index(rank: int, d: int) -> str:
    """[None, :, None] that puts a vector on dim d of a rank-`rank` value."""
    return "[" + ", ".join(":" if k == d else "None" for k in range(rank)) + "]"


class Gen:
    def __init__(self, seed: int):
        self.seed = seed
        self.r = random.Random(seed)
        self.mesh_name = self.r.choice(list(MESHES))
        self.args: list[Arg] = []
        self.lines: list[str] = []
        self.indent = 4
        self.pool: list[Var] = []         # values visible here (args and earlier results)
        self.counter = itertools.count(1)
        self.depth = 0
        self.key: Var | None = None
        self.ops_used: list[str] = []

    # ----------------------------------------------------------------- emission

    def fresh(self, prefix: str = "v") -> str:
        return f"{prefix}{next(self.counter)}"

    def line(self, text: str) -> None:
        self.lines.append(" " * self.indent + text)

    def emit(self, expr: str, shape, dtype: str, scale: float = 1.0, exact: bool = True) -> Var:
        """name = expr, with floats squashed by tanh (ints wrapped by %) where they could grow."""
        shape = tuple(shape)
        if dtype == F and scale > 6:
            expr, scale = f"jnp.tanh({expr})", 1.0
        elif dtype == I and scale > 1e6:
            expr, scale = f"({expr}) % 11", 11.0
        v = Var(self.fresh(), shape, dtype, scale, exact)
        self.line(f"{v.name} = {expr}")
        self.pool.append(v)
        return v

    def emit_multi(self, expr: str, results: list[tuple]) -> list[Var]:
        vs = [Var(self.fresh(), tuple(s), d, sc, ex) for s, d, sc, ex in results]
        self.line(", ".join(v.name for v in vs) + f" = {expr}")
        self.pool.extend(vs)
        return vs

    # ----------------------------------------------------------------- arguments

    def array_arg(self, shape, dtype: str) -> Var:
        name = f"x{len(self.args)}"
        self.args.append(Arg(name, "array", tuple(shape), dtype))
        return Var(name, tuple(shape), dtype, {F: 4.0, I: 5.0, B: 1.0}[dtype], True)

    def index_arg(self, n: int) -> str:
        """An int32 scalar argument: an index into a dim of size n, sometimes out of range (clamped etc.)."""
        r = self.r
        if r.random() < 0.6:
            value = r.randrange(0, n)
        else:
            value = r.choice([-1, -n, n, n + r.randrange(0, 4), -n - r.randrange(1, 4), 2 * n + 1])
        name = f"i{len(self.args)}"
        self.args.append(Arg(name, "index", (), I, int(value)))
        return name

    def indices_arg(self, shape, n: int, in_range: bool = False, unique: bool = False) -> str:
        r = self.r
        count = math.prod(shape)
        if unique:
            vals = r.sample(range(n), count)
            vals = [v - n if r.random() < 0.3 else v for v in vals]
        elif in_range:
            vals = [r.randrange(-n, n) for _ in range(count)]
        else:
            vals = [r.randrange(0, n) if r.random() < 0.6 else r.randrange(-n - 3, n + 4) for _ in range(count)]
        name = f"x{len(self.args)}"
        self.args.append(Arg(name, "indices", tuple(shape), I, np.asarray(vals, np.int32).reshape(shape)))
        return name

    def key_arg(self) -> str:
        if self.key is None:
            name = f"k{len(self.args)}"
            self.args.append(Arg(name, "key"))
            self.key = Var(name, (), "key")
        return self.key.name

    # ----------------------------------------------------------------- operands

    def literal(self, dtype: str) -> str:
        r = self.r
        return {F: lambda: r.choice(["1.5", "-0.5", "2.0", "0.25"]),
                I: lambda: r.choice(["3", "-2", "1", "5"]),
                B: lambda: r.choice(["True", "False"])}[dtype]()

    def operand(self, shape, dtype: str, broadcast: bool = True, literal: bool = True) -> Var:
        """Another value of `dtype` broadcastable to `shape`: a literal, an earlier value or a new argument."""
        r = self.r
        if literal and r.random() < 0.2:
            return Var(self.literal(dtype), (), dtype, 2.0, True)
        same = [v for v in self.pool if v.dtype == dtype and v.shape == tuple(shape)]
        if same and r.random() < 0.35:
            return r.choice(same)
        shp = list(shape)
        if broadcast and shp and r.random() < 0.5:
            shp = shp[r.randrange(0, len(shp) + 1):] if r.random() < 0.4 else shp
            shp = [1 if r.random() < 0.4 else s for s in shp]
        return self.array_arg(shp, dtype)

    # ----------------------------------------------------------------- annotations

    def annotate(self, v: Var, p: float = 0.6) -> Var:
        r = self.r
        if v.dtype == "key" or r.random() >= p:
            return v
        if v.rank == 0:
            return self.emit(f"gs.replicate({v.name})", v.shape, v.dtype, v.scale, v.exact) if r.random() < 0.3 else v
        roll = r.random()
        if roll < 0.08:
            return self.emit(f"gs.replicate({v.name})", v.shape, v.dtype, v.scale, v.exact)
        if roll < 0.18:
            d = r.randrange(v.rank)
            ns = [n for n in split_counts(self.mesh_name) if n <= v.shape[d]]
            if ns:
                return self.emit(f"gs.split({v.name}, {d}, {r.choice(ns)})", v.shape, v.dtype, v.scale, v.exact)
        spec = self.random_spec(v.shape)
        if spec is None:
            return v
        return self.emit(f"gs.shard({v.name}, {_fmt_spec(spec)})", v.shape, v.dtype, v.scale, v.exact)

    def random_spec(self, shape, allow_none_tail: bool = True):
        r = self.r
        opts = spec_options(shape, self.mesh_name, small=r.random() < 0.15)
        opts = [s for s in opts if any(e is not None for e in s)] or opts
        if not opts:
            return None
        spec = r.choice(opts)
        if r.random() < 0.25:  # a single axis written as a 1-tuple
            spec = tuple((e,) if isinstance(e, str) else e for e in spec)
        if allow_none_tail and r.random() < 0.3:  # a spec shorter than the rank: trailing dims whole
            while spec and spec[-1] is None:
                spec = spec[:-1]
        return spec

    # ----------------------------------------------------------------- program

    def chain(self, v: Var, n_ops: int, ops, annotate_p: float = 0.6) -> Var:
        for _ in range(n_ops):
            for _attempt in range(40):
                name, op, _ = self.r.choices(ops, weights=[w for _, _, w in ops])[0]
                pool_before, lines_before = list(self.pool), len(self.lines)
                out = op(self, v)
                if out is not None:
                    self.ops_used.append(name)
                    v = out
                    break
                # the op did not apply: drop its lines and values (arguments it made stay, unused: a program
                # may have inputs it never reads, with in_shardings, too)
                self.pool, self.lines[lines_before:] = pool_before, []
            v = self.annotate(v, annotate_p)
        return v

    def build(self):
        r = self.r
        rank = r.choice([1, 2, 2, 3, 3, 3])
        while True:
            shape = tuple(r.choice(SIZES) for _ in range(rank))
            if math.prod(shape) <= 600:
                break
        dtype = r.choices([F, I, B], weights=[6, 3, 2])[0]
        x = self.array_arg(shape, dtype)
        self.pool.append(x)
        v = self.annotate(x, 0.5)
        v = self.chain(v, r.randint(3, 8), TOP_OPS)
        outs = [v]
        extra = [u for u in self.pool if u is not v and not any(u.name == a.name for a in self.args)
                 and u.dtype != "key" and u.name.startswith("v")]
        if extra and r.random() < 0.3:
            outs.append(r.choice(extra))
        as_tuple = len(outs) > 1 or r.random() < 0.1
        if as_tuple:
            self.line("return " + ", ".join(o.name for o in outs) + ("," if len(outs) == 1 else ""))
        else:
            self.line(f"return {v.name}")
        in_shardings = self.in_shardings()
        out_shardings = self.out_shardings(outs, as_tuple)
        return outs, as_tuple, in_shardings, out_shardings

    def in_shardings(self):
        r = self.r
        if r.random() < 0.3:
            return None
        entries = []
        for a in self.args:
            if a.kind == "array" and a.shape and r.random() < 0.6:
                spec = self.random_spec(a.shape)
                entries.append(None if spec is None else (P(*spec) if r.random() < 0.2 else spec))
            else:
                entries.append(None)
        return tuple(entries) if any(e is not None for e in entries) else None

    def out_shardings(self, outs, as_tuple: bool):
        r = self.r
        if r.random() < 0.35:
            return None
        entries = [self.random_spec(o.shape) if o.shape and r.random() < 0.75 else None for o in outs]
        if all(e is None for e in entries):
            return None
        if not as_tuple:
            return entries[0]
        return tuple(entries)


# --------------------------------------------------------------------------- op families
# Each op takes (gen, current value) and returns the new current value, or None when it does not apply.


def _fits(shape) -> bool:
    return 0 < math.prod(shape) <= MAX_ELEMS and len(shape) <= 4


UNARY = {
    F: [("jnp.tanh({x})", lambda s: 1.0, True), ("jnp.sin({x})", lambda s: 1.0, True),
        ("jnp.abs({x})", lambda s: s, True), ("-{x}", lambda s: s, True), ("jax.nn.relu({x})", lambda s: s, True),
        ("{x} * 0.5 + 1.0", lambda s: s * 0.5 + 1, True), ("jnp.sqrt(jnp.abs({x}))", lambda s: math.sqrt(s), True),
        ("jax.nn.sigmoid({x})", lambda s: 1.0, True), ("jnp.exp(jnp.tanh({x}))", lambda s: 3.0, True),
        ("{x} ** 2", lambda s: s * s, True), ("jnp.floor({x} * 2.0) * 0.5", lambda s: s + 0.5, False),
        ("jnp.sign({x})", lambda s: 1.0, False), ("jax.lax.stop_gradient({x})", lambda s: s, True)],
    I: [("-{x}", lambda s: s, True), ("jnp.abs({x})", lambda s: s, True), ("{x} * 3 - 1", lambda s: 3 * s + 1, True),
        ("{x} // 2", lambda s: s, True), ("{x} % 5", lambda s: 5.0, True), ("jnp.sign({x})", lambda s: 1.0, True),
        ("jnp.clip({x}, -3, 4)", lambda s: 4.0, True)],
    B: [("~{x}", lambda s: 1.0, True), ("jnp.logical_not({x})", lambda s: 1.0, True)],
}


def op_unary(g: Gen, v: Var):
    opts = [o for o in UNARY[v.dtype] if o[2] or v.exact]
    tmpl, scale, _ = g.r.choice(opts)
    return g.emit(tmpl.format(x=v.name), v.shape, v.dtype, scale(v.scale), v.exact)


def op_cast(g: Gen, v: Var):
    r, x = g.r, v.name
    if v.dtype == F:
        if not v.exact:
            return None
        if r.random() < 0.5:
            return g.emit(f"jnp.round({x} * 2.0).astype(jnp.int32)", v.shape, I, 2 * v.scale + 1)
        return g.emit(r.choice([f"{x} > 0.25", f"{x} <= 0.0"]), v.shape, B)
    if v.dtype == I:
        if r.random() < 0.6:
            src = x if v.scale <= 1000 else f"({x} % 7)"
            return g.emit(f"{src}.astype(jnp.float32)", v.shape, F, min(v.scale, 7.0))
        return g.emit(r.choice([f"{x} % 2 == 0", f"{x} > 0"]), v.shape, B)
    if r.random() < 0.6:
        return g.emit(r.choice([f"{x}.astype(jnp.float32)", f"jnp.where({x}, 1.5, -0.5)"]), v.shape, F, 1.5)
    return g.emit(f"{x}.astype(jnp.int32)", v.shape, I, 1.0)


BINARY = {
    F: [("{a} + {b}", lambda a, b: a + b), ("{a} - {b}", lambda a, b: a + b), ("{a} * {b}", lambda a, b: a * b),
        ("jnp.maximum({a}, {b})", max), ("jnp.minimum({a}, {b})", max),
        ("jnp.where({a} > {b}, {a}, {b})", max), ("{a} / (jnp.abs({b}) + 1.0)", lambda a, b: a),
        ("jnp.arctan2({a}, {b})", lambda a, b: 3.2)],
    I: [("{a} + {b}", lambda a, b: a + b), ("{a} - {b}", lambda a, b: a + b), ("{a} * {b}", lambda a, b: a * b),
        ("jnp.maximum({a}, {b})", max), ("jnp.minimum({a}, {b})", max), ("{a} & {b}", max), ("{a} | {b}", max),
        ("{a} ^ {b}", lambda a, b: 2 * max(a, b))],
    B: [("{a} & {b}", max), ("{a} | {b}", max), ("{a} ^ {b}", max), ("{a} == {b}", max), ("{a} != {b}", max)],
}
COMPARE = ["{a} < {b}", "{a} >= {b}", "{a} == {b}", "{a} != {b}"]


def _bshape(a, b):
    a, b = tuple(a), tuple(b)
    n = max(len(a), len(b))
    a, b = (1,) * (n - len(a)) + a, (1,) * (n - len(b)) + b
    return tuple(max(x, y) for x, y in zip(a, b))


def op_binary(g: Gen, v: Var, compare: bool = False, preserve: bool = False):
    r = g.r
    if v.rank and r.random() < 0.2 and not preserve and 1 in v.shape:
        # both sides broadcast: v's size-1 dims meet bigger dims of the other operand
        shp = [r.choice(SIZES[1:7]) if s == 1 and r.random() < 0.7 else (1 if r.random() < 0.3 else s)
               for s in v.shape]
        o = g.array_arg(shp, v.dtype)
    else:
        o = g.operand(v.shape, v.dtype)
    out_shape = _bshape(v.shape, o.shape)
    if preserve and out_shape != v.shape or not _fits(out_shape):
        return None
    a, b = (v, o) if r.random() < 0.6 else (o, v)
    if compare:
        if v.dtype == F and not (v.exact and o.exact):
            return None
        tmpl = r.choice(COMPARE if v.dtype != F else COMPARE[:2])
        return g.emit(tmpl.format(a=a.name, b=b.name), out_shape, B)
    opts = BINARY[v.dtype]
    if v.dtype == B and preserve:
        opts = opts[:3]
    tmpl, scale = r.choice(opts)
    return g.emit(tmpl.format(a=a.name, b=b.name), out_shape, v.dtype, scale(a.scale, b.scale), a.exact and o.exact)


def op_compare(g: Gen, v: Var):
    return op_binary(g, v, compare=True)


def op_select(g: Gen, v: Var, preserve: bool = False):
    r = g.r
    if v.dtype == B and not preserve:  # v is the condition
        o = g.operand(v.shape, r.choice([F, I]), literal=False)
        out = _bshape(v.shape, o.shape)
        if not _fits(out):
            return None
        other = g.literal(o.dtype)
        return g.emit(f"jnp.where({v.name}, {o.name}, {other})", out, o.dtype, max(o.scale, 2.0), o.exact)
    if v.dtype == F and not v.exact or r.random() < 0.4:
        c = g.operand(v.shape, B, literal=False)
        cond = c.name
    else:
        cond = {F: f"{v.name} > 0.0", I: f"{v.name} % 3 == 0", B: f"~{v.name}"}[v.dtype]
        c = v
    if r.random() < 0.3 and c.shape == v.shape:
        o = g.array_arg(v.shape, v.dtype)
        expr = f"jax.lax.select({cond}, {v.name}, {o.name})" if r.random() < 0.5 else \
            f"jax.lax.select({cond}, {o.name}, {v.name})"
    else:
        o = g.operand(v.shape, v.dtype)
        a, b = (v, o) if r.random() < 0.5 else (o, v)
        expr = f"jnp.where({cond}, {a.name}, {b.name})"
    out = _bshape(_bshape(v.shape, c.shape), o.shape)
    if not _fits(out) or preserve and out != v.shape:
        return None
    return g.emit(expr, out, v.dtype, max(v.scale, o.scale), v.exact and o.exact)


def op_broadcast(g: Gen, v: Var):
    r, x = g.r, v.name
    kind = r.random()
    if kind < 0.25 and 1 in v.shape:
        d = r.choice([i for i, s in enumerate(v.shape) if s == 1])
        if r.random() < 0.5:
            shape = v.shape[:d] + (r.choice(SIZES[1:]),) + v.shape[d + 1:]
            return g.emit(f"jnp.broadcast_to({x}, {_shape_str(shape)})", shape, v.dtype, v.scale, v.exact) \
                if _fits(shape) else None
        return g.emit(f"jnp.squeeze({x}, axis={d})", v.shape[:d] + v.shape[d + 1:], v.dtype, v.scale, v.exact)
    d = r.randrange(v.rank + 1)
    if kind < 0.5:
        shape = v.shape[:d] + (1,) + v.shape[d:]
        return g.emit(f"jnp.expand_dims({x}, {d})", shape, v.dtype, v.scale, v.exact) if _fits(shape) else None
    k = r.choice(SIZES)
    shape = v.shape[:d] + (k,) + v.shape[d:]
    if not _fits(shape):
        return None
    if kind < 0.75:
        dims = tuple(i for i in range(len(shape)) if i != d)
        return g.emit(f"jax.lax.broadcast_in_dim({x}, {_shape_str(shape)}, {_shape_str(dims)})",
                      shape, v.dtype, v.scale, v.exact)
    if d == 0 and r.random() < 0.5:
        return g.emit(f"jnp.broadcast_to({x}, {_shape_str(shape)})", shape, v.dtype, v.scale, v.exact)
    return g.emit(f"jnp.broadcast_to(jnp.expand_dims({x}, {d}), {_shape_str(shape)})", shape, v.dtype, v.scale,
                  v.exact)


def _factor_pairs(n: int) -> list[tuple[int, int]]:
    return [(p, n // p) for p in range(2, n) if n % p == 0]


def op_reshape(g: Gen, v: Var):
    r, s = g.r, list(v.shape)
    kind = r.random()
    if v.rank >= 2 and kind < 0.35:
        d = r.randrange(v.rank - 1)
        shape = s[:d] + [s[d] * s[d + 1]] + s[d + 2:]
    elif kind < 0.7 and any(_factor_pairs(n) for n in s):
        d = r.choice([i for i, n in enumerate(s) if _factor_pairs(n)])
        shape = s[:d] + list(r.choice(_factor_pairs(s[d]))) + s[d + 1:]
    elif kind < 0.8:
        shape = s[:]
        shape.insert(r.randrange(len(s) + 1), 1)
    elif kind < 0.9 and v.rank >= 2:
        return g.emit(f"{v.name}.reshape(-1)", (v.size,), v.dtype, v.scale, v.exact)
    else:  # any factorisation of the size
        n, shape = v.size, []
        for _ in range(r.randint(1, 3)):
            ds = [p for p in range(1, n + 1) if n % p == 0]
            p = r.choice(ds)
            shape.append(p)
            n //= p
        shape.append(n)
    if len(shape) > 4 or tuple(shape) == v.shape:
        return None
    return g.emit(f"{v.name}.reshape{_shape_str(shape)}", shape, v.dtype, v.scale, v.exact)


def op_transpose(g: Gen, v: Var):
    r, x = g.r, v.name
    if v.rank < 2:
        return None
    perm = list(range(v.rank))
    while perm == list(range(v.rank)):
        r.shuffle(perm)
    shape = tuple(v.shape[p] for p in perm)
    if v.rank == 2:
        expr = r.choice([f"{x}.T", f"jnp.transpose({x})"])
    elif r.random() < 0.3:
        i, j = r.sample(range(v.rank), 2)
        perm = list(range(v.rank))
        perm[i], perm[j] = perm[j], perm[i]
        shape = tuple(v.shape[p] for p in perm)
        expr = f"jnp.swapaxes({x}, {i}, {j})"
    else:
        expr = f"jnp.transpose({x}, {_shape_str(perm)})"
    return g.emit(expr, shape, v.dtype, v.scale, v.exact)


def op_reduce(g: Gen, v: Var):
    r, x = g.r, v.name
    if v.rank == 0:
        return None
    if r.random() < 0.15:
        axes = tuple(range(v.rank))
        axis = "None"
    else:
        axes = tuple(sorted(r.sample(range(v.rank), r.randint(1, v.rank))))
        axis = str(axes[0]) if len(axes) == 1 and r.random() < 0.7 else _shape_str(axes)
    keep = r.random() < 0.2
    kd = ", keepdims=True" if keep else ""
    shape = tuple(1 if d in axes else s for d, s in enumerate(v.shape)) if keep else \
        tuple(s for d, s in enumerate(v.shape) if d not in axes)
    n = math.prod(v.shape[d] for d in axes)
    one_axis = r.randrange(v.rank)
    arg_shape = tuple(s for d, s in enumerate(v.shape) if d != one_axis)
    if v.dtype == F:
        kind = r.choice(["sum", "mean", "max", "min", "prod", "arg", "lse", "softmax"])
        if kind == "sum":
            return g.emit(f"jnp.sum({x}, axis={axis}{kd}) / {float(n)}", shape, F, v.scale, False)
        if kind == "mean":
            return g.emit(f"jnp.mean({x}, axis={axis}{kd})", shape, F, v.scale, False)
        if kind in ("max", "min"):
            return g.emit(f"jnp.{kind}({x}, axis={axis}{kd})", shape, F, v.scale, v.exact)
        if kind == "prod":
            return g.emit(f"jnp.prod(1.0 + 0.1 * jnp.tanh({x}), axis={axis}{kd})", shape, F, 1.1 ** n, False)
        if kind == "lse":
            return g.emit(f"jax.nn.logsumexp({x}, axis={axis}{kd})", shape, F, v.scale + math.log(n) + 1, False)
        if kind == "softmax":
            return g.emit(f"jax.nn.softmax({x}, axis={one_axis})", v.shape, F, 1.0, False)
        if not v.exact:
            return None
    elif v.dtype == I:
        kind = r.choice(["sum", "max", "min", "prod", "arg"])
        if kind == "sum":
            return g.emit(f"jnp.sum({x}, axis={axis}{kd})", shape, I, v.scale * n)
        if kind in ("max", "min"):
            return g.emit(f"jnp.{kind}({x}, axis={axis}{kd})", shape, I, v.scale)
        if kind == "prod":
            return g.emit(f"jnp.prod({x} % 3, axis={axis}{kd})", shape, I, 2.0 ** n)
    else:
        kind = r.choice(["any", "all", "sum", "max", "arg"])
        if kind in ("any", "all", "max"):
            return g.emit(f"jnp.{kind}({x}, axis={axis}{kd})", shape, B)
        if kind == "sum":
            return g.emit(f"jnp.sum({x}, axis={axis}{kd})", shape, I, float(n))
    fn = r.choice(["argmax", "argmin"])
    if r.random() < 0.15:
        return g.emit(f"jnp.{fn}({x})", (), I, float(v.size))
    return g.emit(f"jnp.{fn}({x}, axis={one_axis})", arg_shape, I, float(v.shape[one_axis]))


def op_einsum(g: Gen, v: Var):
    r = g.r
    if v.dtype == B or v.dtype == I and r.random() < 0.6:
        return None
    letters = iter("abcdefgh")
    vl = [next(letters) for _ in v.shape]
    sizes = dict(zip(vl, v.shape))
    roles = {c: r.choice(["batch", "contract", "contract", "free"]) for c in vl}
    new = [next(letters) for _ in range(r.choice([0, 1, 1, 2]))]
    for c in new:
        sizes[c] = r.choice(SIZES)
    ol = [c for c in vl if roles[c] != "free"] + new
    r.shuffle(ol)
    out = [c for c in vl if roles[c] != "contract"] + new
    r.shuffle(out)
    if not ol:
        return None
    oshape = tuple(sizes[c] for c in ol)
    shape = tuple(sizes[c] for c in out)
    if not _fits(oshape) or math.prod(shape) > MAX_ELEMS or len(shape) > 4:
        return None
    k = math.prod(sizes[c] for c in vl if roles[c] == "contract")
    same = [u for u in g.pool if u.dtype == v.dtype and u.shape == oshape]
    o = r.choice(same) if same and r.random() < 0.3 else g.array_arg(oshape, v.dtype)
    a, b, la, lb = (v, o, vl, ol) if r.random() < 0.6 else (o, v, ol, vl)
    if v.dtype == I:
        return g.emit(f'jnp.einsum("{"".join(la)},{"".join(lb)}->{"".join(out)}", {a.name}, {b.name})', shape, I,
                      v.scale * o.scale * k)
    if r.random() < 0.25 and (len(la), len(lb)) == (2, 2) and la[1] == lb[0] and out == [la[0], lb[1]]:
        expr = f"{a.name} @ {b.name}"
    elif r.random() < 0.2:
        contract = [c for c in la if c in lb and c not in out]
        batch = [c for c in la if c in lb and c in out]
        free_a = [c for c in la if c not in lb]
        free_b = [c for c in lb if c not in la]
        dn = (((tuple(la.index(c) for c in contract)), tuple(lb.index(c) for c in contract)),
              (tuple(la.index(c) for c in batch), tuple(lb.index(c) for c in batch)))
        out = batch + free_a + free_b
        shape = tuple(sizes[c] for c in out)
        expr = f"jax.lax.dot_general({a.name}, {b.name}, {dn})"
    else:
        expr = f'jnp.einsum("{"".join(la)},{"".join(lb)}->{"".join(out)}", {a.name}, {b.name})'
    return g.emit(f"{expr} / {float(k)}" if k > 1 else expr, shape, F, v.scale * o.scale, False)


def op_iota(g: Gen, v: Var, preserve: bool = False):
    r, x = g.r, v.name
    if v.rank == 0:
        return None
    d = r.randrange(v.rank)
    n = v.shape[d]
    idx = _bcast_index(v.rank, d)
    if r.random() < 0.35:
        iota = f"jax.lax.broadcasted_iota(jnp.int32, {_shape_str(v.shape)}, {d})"
    else:
        iota = f"jnp.arange({n}){idx}"
    if v.dtype == F:
        return g.emit(f"{x} + {iota}.astype(jnp.float32) * 0.25", v.shape, F, v.scale + 0.25 * n, v.exact)
    if v.dtype == I:
        expr = r.choice([f"{x} + {iota}", f"{x} * ({iota} % 3)"])
        return g.emit(expr, v.shape, I, v.scale * (n + 3))
    if r.random() < 0.5 and not preserve:
        return g.emit(f"jnp.where({x}, {iota}, -1)", v.shape, I, float(n))
    return g.emit(f"{x} & ({iota} % 2 == 0)", v.shape, B)


def op_cumulative(g: Gen, v: Var, preserve: bool = False):
    r, x = g.r, v.name
    if v.rank == 0:
        return None
    d = r.randrange(v.rank)
    n = v.shape[d]
    rev = r.random() < 0.3
    if v.dtype == F:
        kind = r.choice(["cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"])
        if kind in ("cummax", "cummin"):
            return g.emit(f"jax.lax.{kind}({x}, axis={d}{', reverse=True' if rev else ''})", v.shape, F, v.scale,
                          v.exact)
        if kind == "cumsum":
            expr = f"jax.lax.cumsum({x}, axis={d}, reverse=True)" if rev else f"jnp.cumsum({x}, axis={d})"
            return g.emit(f"{expr} / {float(n)}", v.shape, F, v.scale, False)
        if kind == "cumprod":
            return g.emit(f"jnp.cumprod(1.0 + 0.1 * jnp.tanh({x}), axis={d})", v.shape, F, 1.1 ** n, False)
        return g.emit(f"jax.lax.cumlogsumexp({x}, axis={d}{', reverse=True' if rev else ''})", v.shape, F,
                      v.scale + math.log(n) + 1, False)
    if v.dtype == I:
        kind = r.choice(["cumsum", "cumprod", "cummax", "cummin"])
        if kind == "cumsum":
            expr = f"jax.lax.cumsum({x}, axis={d}, reverse=True)" if rev else f"jnp.cumsum({x}, axis={d})"
            return g.emit(expr, v.shape, I, v.scale * n)
        if kind == "cumprod":
            return g.emit(f"jnp.cumprod({x} % 3, axis={d})", v.shape, I, 2.0 ** n)
        return g.emit(f"jax.lax.{kind}({x}, axis={d}{', reverse=True' if rev else ''})", v.shape, I, v.scale)
    if preserve:
        return None
    return g.emit(f"jnp.cumsum({x}, axis={d})", v.shape, I, float(n))


def op_sort(g: Gen, v: Var, preserve: bool = False):
    r, x = g.r, v.name
    if v.rank == 0:
        return None
    d = r.randrange(v.rank)
    kind = r.random()
    if kind < 0.5 or preserve:
        desc = ", descending=True" if r.random() < 0.2 else ""
        return g.emit(f"jnp.sort({x}, axis={d}{desc})", v.shape, v.dtype, v.scale, v.exact)
    if v.dtype == F and not v.exact:
        return None
    if kind < 0.8:
        return g.emit(f"jnp.argsort({x}, axis={d})", v.shape, I, float(v.shape[d]))
    o = g.array_arg(v.shape, r.choice([F, I]))
    ks, vs = g.emit_multi(f"jax.lax.sort_key_val({x}, {o.name}, dimension={d})",
                          [(v.shape, v.dtype, v.scale, v.exact), (v.shape, o.dtype, o.scale, True)])
    return r.choice([ks, vs])


def op_top_k(g: Gen, v: Var):
    r, x = g.r, v.name
    if v.rank == 0 or v.dtype == B:
        return None
    d = v.rank - 1 if r.random() < 0.7 else r.randrange(v.rank)
    n = v.shape[d]
    k = r.randint(1, min(n, 4))
    shape = v.shape[:d] + (k,) + v.shape[d + 1:]
    axis = "" if d == v.rank - 1 else f", axis={d}"
    vals, idx = g.emit_multi(f"jax.lax.top_k({x}, {k}{axis})",
                             [(shape, v.dtype, v.scale, v.exact), (shape, I, float(n), True)])
    if v.dtype == F and not v.exact:
        g.pool.remove(idx)
        return vals
    return r.choice([vals, idx])


def op_slice(g: Gen, v: Var):
    r, x = g.r, v.name
    if v.rank == 0:
        return None
    items, shape, lax_ok = [], [], True
    start, limit, strides = [], [], []
    for s in v.shape:
        kind = r.random()
        if kind < 0.35 or s == 1:
            items.append(":")
            shape.append(s)
            start.append(0), limit.append(s), strides.append(1)
            continue
        if kind < 0.45:  # an integer index: drops the dim
            i = r.randrange(-s, s)
            items.append(str(i))
            lax_ok = False
            continue
        a = r.randrange(0, s)
        b = r.randrange(a + 1, s + 1)
        st = r.choice([1, 1, 2, 3])
        lo = str(a) if a else ""
        hi = str(b - s) if b < s and r.random() < 0.3 else (str(b) if b < s else "")
        items.append(f"{lo}:{hi}" + (f":{st}" if st > 1 else ""))
        shape.append(len(range(a, b, st)))
        start.append(a), limit.append(b), strides.append(st)
    if all(i == ":" for i in items):
        return None
    if lax_ok and r.random() < 0.3:
        expr = f"jax.lax.slice({x}, {_shape_str(start)}, {_shape_str(limit)}, {_shape_str(strides)})"
    else:
        expr = f"{x}[{', '.join(items)}]"
    return g.emit(expr, shape, v.dtype, v.scale, v.exact)


def op_pad(g: Gen, v: Var):
    r, x = g.r, v.name
    if v.rank == 0:
        return None
    widths = [(r.choice([0, 0, 1, 2, 3]), r.choice([0, 0, 1, 2, 3])) for _ in v.shape]
    if all(w == (0, 0) for w in widths):
        d = r.randrange(v.rank)
        widths[d] = (r.randint(0, 3), r.randint(1, 3))
    shape = tuple(s + lo + hi for s, (lo, hi) in zip(v.shape, widths))
    w = "(" + ", ".join(f"({lo}, {hi})" for lo, hi in widths) + (",)" if len(widths) == 1 else ")")
    kind = r.random()
    if kind < 0.1:  # lax.pad: negative (cutting) low edge and interior padding
        cfg = []
        shape = []
        for s in v.shape:
            lo, hi, it = r.choice([0, 1, -1]), r.choice([0, 2]), r.choice([0, 0, 1])
            if s + lo <= 0:
                lo = 0
            cfg.append((lo, hi, it))
            shape.append(s + lo + hi + max(s - 1, 0) * it)
        if not _fits(shape) or min(shape) < 1:
            return None
        return g.emit(f"jax.lax.pad({x}, {g.literal(v.dtype)}, {cfg})", shape, v.dtype, max(v.scale, 2.0), v.exact)
    if not _fits(shape):
        return None
    if kind < 0.55:
        return g.emit(f"jnp.pad({x}, {w}, constant_values={g.literal(v.dtype)})", shape, v.dtype,
                      max(v.scale, 2.0), v.exact)
    if kind < 0.9:
        return g.emit(f'jnp.pad({x}, {w}, mode="edge")', shape, v.dtype, v.scale, v.exact)
    if all(lo < s and hi < s for s, (lo, hi) in zip(v.shape, widths)):
        return g.emit(f'jnp.pad({x}, {w}, mode="{r.choice(["reflect", "wrap"])}")', shape, v.dtype, v.scale,
                      v.exact)
    return None


def op_concat(g: Gen, v: Var):
    r, x = g.r, v.name
    if v.rank == 0:
        return None
    d = r.randrange(v.rank)
    if r.random() < 0.2:  # stack
        o = g.operand(v.shape, v.dtype, broadcast=False, literal=False)
        shape = v.shape[:d] + (2,) + v.shape[d:]
        parts = [x, o.name] if r.random() < 0.5 else [o.name, x]
        return g.emit(f"jnp.stack([{', '.join(parts)}], axis={d})", shape, v.dtype, max(v.scale, o.scale),
                      v.exact and o.exact) if _fits(shape) else None
    parts, size, scale, exact = [v], v.shape[d], v.scale, v.exact
    for _ in range(r.choice([1, 1, 2])):
        if r.random() < 0.25:
            o = v
        else:
            k = r.choice(SIZES)
            shp = v.shape[:d] + (k,) + v.shape[d + 1:]
            same = [u for u in g.pool if u.dtype == v.dtype and u.shape == shp]
            o = r.choice(same) if same and r.random() < 0.4 else g.array_arg(shp, v.dtype)
        parts.append(o)
        size += o.shape[d]
        scale, exact = max(scale, o.scale), exact and o.exact
    r.shuffle(parts)
    shape = v.shape[:d] + (size,) + v.shape[d + 1:]
    if not _fits(shape):
        return None
    return g.emit(f"jnp.concatenate([{', '.join(p.name for p in parts)}], axis={d})", shape, v.dtype, scale, exact)


def op_split(g: Gen, v: Var):
    r, x = g.r, v.name
    cand = [d for d, s in enumerate(v.shape) if s >= 2]
    if not cand:
        return None
    d = r.choice(cand)
    n = v.shape[d]
    divs = [k for k in range(2, n + 1) if n % k == 0 and k <= 4]
    if divs and r.random() < 0.5:
        k = r.choice(divs)
        sizes = [n // k] * k
        arg = str(k)
    else:
        cuts = sorted(r.sample(range(1, n), min(r.randint(1, 2), n - 1)))
        sizes = [b - a for a, b in zip([0] + cuts, cuts + [n])]
        arg = "[" + ", ".join(map(str, cuts)) + "]"
    outs = g.emit_multi(f"jnp.split({x}, {arg}, axis={d})",
                        [(v.shape[:d] + (s,) + v.shape[d + 1:], v.dtype, v.scale, v.exact) for s in sizes])
    return r.choice(outs)


def op_rev(g: Gen, v: Var, preserve: bool = False):
    r, x = g.r, v.name
    if v.rank == 0:
        return None
    kind = r.random()
    if kind < 0.2:
        expr = f"{x}[::-1]"
    elif kind < 0.35:
        expr = f"jnp.flip({x})"
    else:
        axes = sorted(r.sample(range(v.rank), r.randint(1, v.rank)))
        expr = f"jnp.flip({x}, axis={axes[0] if len(axes) == 1 else _shape_str(axes)})"
    return g.emit(expr, v.shape, v.dtype, v.scale, v.exact)


def op_roll(g: Gen, v: Var, preserve: bool = False):
    r, x = g.r, v.name
    if v.rank == 0:
        return None
    kind = r.random()
    d = r.randrange(v.rank)
    n = v.shape[d]
    if kind < 0.2:
        expr = f"jnp.roll({x}, {g.index_arg(n)}, axis={d})"
    elif kind < 0.35 and v.rank >= 2:
        a, b = r.sample(range(v.rank), 2)
        expr = f"jnp.roll({x}, ({r.randint(-5, 5)}, {r.randint(-5, 5)}), axis=({a}, {b}))"
    elif kind < 0.45:
        expr = f"jnp.roll({x}, {r.randint(-7, 7)})"
    else:
        expr = f"jnp.roll({x}, {r.randint(-n - 2, n + 2)}, axis={d})"
    return g.emit(expr, v.shape, v.dtype, v.scale, v.exact)


def _start(g: Gen, n: int, k: int) -> str:
    """A start index into a dim of size n for a window of k: a constant (maybe clamped) or a traced one."""
    r = g.r
    kind = r.random()
    if kind < 0.3:
        return str(r.choice([0, r.randrange(0, n - k + 1), n - k + 1 + r.randrange(0, 3), -r.randrange(1, 3)]))
    i = g.index_arg(n)
    if kind < 0.8:
        return i
    return r.choice([f"{i} + 1", f"2 * {i}", f"{i} - 2"])


def op_dynamic_slice(g: Gen, v: Var):
    r, x = g.r, v.name
    if v.rank == 0:
        return None
    if r.random() < 0.25:
        d = r.randrange(v.rank)
        n = v.shape[d]
        if r.random() < 0.4:
            return g.emit(f"jax.lax.dynamic_index_in_dim({x}, {_start(g, n, 1)}, axis={d}, keepdims=False)",
                          v.shape[:d] + v.shape[d + 1:], v.dtype, v.scale, v.exact)
        k = r.randint(1, n)
        return g.emit(f"jax.lax.dynamic_slice_in_dim({x}, {_start(g, n, k)}, {k}, axis={d})",
                      v.shape[:d] + (k,) + v.shape[d + 1:], v.dtype, v.scale, v.exact)
    sizes = [r.randint(1, s) if r.random() < 0.7 else s for s in v.shape]
    starts = [_start(g, s, k) for s, k in zip(v.shape, sizes)]
    return g.emit(f"jax.lax.dynamic_slice({x}, ({', '.join(starts)}{',' if v.rank == 1 else ''}), "
                  f"{_shape_str(sizes)})", sizes, v.dtype, v.scale, v.exact)


def op_dynamic_update_slice(g: Gen, v: Var, preserve: bool = False):
    r, x = g.r, v.name
    if v.rank == 0:
        return None
    sizes = tuple(r.randint(1, s) if r.random() < 0.8 else s for s in v.shape)
    same = [u for u in g.pool if u.dtype == v.dtype and u.shape == sizes and u is not v]
    u = r.choice(same) if same and r.random() < 0.4 else g.array_arg(sizes, v.dtype)
    starts = [_start(g, s, k) for s, k in zip(v.shape, sizes)]
    return g.emit(f"jax.lax.dynamic_update_slice({x}, {u.name}, ({', '.join(starts)}{',' if v.rank == 1 else ''}))",
                  v.shape, v.dtype, max(v.scale, u.scale), v.exact and u.exact)


def op_take(g: Gen, v: Var):
    r, x = g.r, v.name
    if v.rank == 0:
        return None
    d = r.randrange(v.rank)
    n = v.shape[d]
    mode = r.choice(["clip", "wrap", "fill"])
    kind = r.random()
    if kind < 0.15:  # numpy-style indexing, indices in range
        shp = (r.randint(1, 6),)
        idx = g.indices_arg(shp, n, in_range=True)
        shape = v.shape[:d] + shp + v.shape[d + 1:]
        return g.emit(f"{x}{_index_expr(v.rank, d, idx)}", shape, v.dtype, v.scale, v.exact)
    if kind < 0.25:  # take_along_axis
        shp = v.shape[:d] + (r.randint(1, 6),) + v.shape[d + 1:]
        if not _fits(shp):
            return None
        idx = g.indices_arg(shp, n, in_range=True)
        return g.emit(f"jnp.take_along_axis({x}, {idx}, axis={d})", shp, v.dtype, v.scale, v.exact)
    if kind < 0.5:
        ishape = ()
        idx = g.index_arg(n) if r.random() < 0.7 else str(r.randrange(-n - 2, n + 2))
    else:
        ishape = (r.randint(1, 6),) if r.random() < 0.8 else (r.randint(1, 3), r.randint(1, 3))
        idx = g.indices_arg(ishape, n)
    shape = v.shape[:d] + ishape + v.shape[d + 1:]
    if not _fits(shape):
        return None
    fill, scale = "", v.scale
    if mode == "fill":
        if v.dtype == F or r.random() < 0.5:
            lit = g.literal(v.dtype)
            fill, scale = f", fill_value={lit}", max(v.scale, 2.0)
        elif v.dtype == I:
            scale = 2.0 ** 31
    return g.emit(f'jnp.take({x}, {idx}, axis={d}, mode="{mode}"{fill})', shape, v.dtype, scale, v.exact)


def op_at(g: Gen, v: Var, preserve: bool = False):
    r, x = g.r, v.name
    if v.rank == 0:
        return None
    d = r.randrange(v.rank) if r.random() < 0.4 else 0
    n = v.shape[d]
    method = r.choice(["add", "set"] if v.dtype != B else ["set"])
    if r.random() < 0.1:
        method = r.choice(["max", "min"]) if v.dtype != B else method
    kind = r.random()
    if kind < 0.45:
        idx = g.index_arg(n) if r.random() < 0.7 else str(r.randrange(-n, n))
        ushape = v.shape[:d] + v.shape[d + 1:]
    elif kind < 0.75:
        k = r.randint(1, min(n, 4))
        idx = g.indices_arg((k,), n, unique=method == "set" or r.random() < 0.3)
        ushape = v.shape[:d] + (k,) + v.shape[d + 1:]
    else:
        a = r.randrange(0, n)
        b = r.randrange(a + 1, n + 1)
        idx = f"{a}:{b}"
        ushape = v.shape[:d] + (b - a,) + v.shape[d + 1:]
    if r.random() < 0.35:
        u = Var(g.literal(v.dtype), (), v.dtype, 2.0, True)
    else:
        shp = list(ushape)
        if shp and r.random() < 0.3:
            shp = shp[r.randrange(len(shp) + 1):]
        u = g.array_arg(shp, v.dtype)
    scale = v.scale + u.scale if method == "add" else max(v.scale, u.scale)
    return g.emit(f"{x}.at{_index_expr(v.rank, d, idx)}.{method}({u.name})", v.shape, v.dtype, scale,
                  v.exact and u.exact)


def op_random(g: Gen, v: Var, preserve: bool = False):
    r, x = g.r, v.name
    k = g.key_arg()
    kexpr = r.choice([k, k, f"jax.random.fold_in({k}, {r.randint(0, 9)})", f"jax.random.split({k})[1]"])
    s = _shape_str(v.shape)
    if v.dtype == F:
        expr = r.choice([f"{x} + jax.random.uniform({kexpr}, {s})",
                         f"{x} * jax.random.uniform({kexpr}, {s}, minval=-1.0, maxval=1.0)",
                         f"{x} + jax.random.normal({kexpr}, {s})"])
        return g.emit(expr, v.shape, F, v.scale + 5, v.exact)
    if v.dtype == I:
        return g.emit(f"{x} + jax.random.randint({kexpr}, {s}, 0, 5)", v.shape, I, v.scale + 5)
    return g.emit(f"{x} ^ jax.random.bernoulli({kexpr}, 0.5, {s})", v.shape, B)


# ----------------------------------------------------------------- control flow


def _preserving_ops():
    """Ops whose result has the operand's shape and dtype (loop carries, cond branches)."""
    return [
        ("unary", op_unary, 3), ("binary", lambda g, v: op_binary(g, v, preserve=True), 3),
        ("select", lambda g, v: op_select(g, v, preserve=True), 1),
        ("iota", lambda g, v: op_iota(g, v, preserve=True), 1),
        ("cumulative", lambda g, v: op_cumulative(g, v, preserve=True), 1),
        ("sort", lambda g, v: op_sort(g, v, preserve=True), 1), ("rev", op_rev, 1), ("roll", op_roll, 1),
        ("dynamic_update_slice", op_dynamic_update_slice, 1), ("at", op_at, 1), ("random", op_random, 0.5),
    ]


def _bound(g: Gen, c: Var) -> Var:
    """A loop body's last step: keep the carry bounded, whatever ran how many times."""
    if c.dtype == F:
        return g.emit(f"jnp.tanh({c.name})", c.shape, F, 1.0, False)
    if c.dtype == I:
        return g.emit(f"{c.name} % 13", c.shape, I, 13.0)
    return c


class _Scope:
    """A nested def: its lines are collected apart, its values are not visible after it."""

    def __init__(self, g: Gen, params: list[Var]):
        self.g, self.params = g, params

    def __enter__(self):
        g = self.g
        self.saved = (g.lines, g.indent, list(g.pool))
        g.lines, g.indent = [], g.indent + 4
        g.pool = g.pool + self.params
        g.depth += 1
        return self

    def __exit__(self, *exc):
        g = self.g
        self.body = g.lines
        g.lines, g.indent, g.pool = self.saved
        g.depth -= 1
        return False


def _def(g: Gen, name: str, params: str, scope: _Scope) -> None:
    g.line(f"def {name}({params}):")
    g.lines.extend(scope.body)


def _inner(g: Gen, c: Var, lo: int, hi: int, ops=None) -> Var:
    return g.chain(c, g.r.randint(lo, hi), ops or _preserving_ops(), annotate_p=0.4)


def op_scan(g: Gen, v: Var):
    r = g.r
    if g.depth or v.dtype == "key":
        return None
    fname = g.fresh("body")
    if v.rank >= 1 and v.shape[0] <= 12 and r.random() < 0.6:
        s = v.shape[1:]
        scale = max(v.scale, 13.0 if v.dtype == I else 1.0)
        c, xs = Var(g.fresh("c"), s, v.dtype, scale, v.dtype != F), Var(g.fresh("xs"), s, v.dtype, v.scale, v.exact)
        with _Scope(g, [c, xs]) as sc:
            t = _inner(g, c, 0, 2)
            comb = {F: "{t} * 0.5 + {x}", I: "{t} + {x}", B: "{t} ^ {x}"}[v.dtype]
            t = g.emit(comb.format(t=t.name, x=xs.name), s, v.dtype, t.scale + xs.scale, False)
            t = g.annotate(_bound(g, t), 0.4)
            y = r.choice([t, c]) if r.random() < 0.8 else None
            g.line(f"return {t.name}, {y.name if y else 'None'}")
        _def(g, fname, f"{c.name}, {xs.name}", sc)
        init = r.choice([f"{v.name}[0]", f"jnp.zeros_like({v.name}[0])", "arg"])
        if init == "arg":
            init = g.array_arg(s, v.dtype).name
        rev = ", reverse=True" if r.random() < 0.3 else ""
        if y is None:
            return g.emit(f"jax.lax.scan({fname}, {init}, {v.name}{rev})[0]", s, v.dtype, scale, False)
        return r.choice(g.emit_multi(f"jax.lax.scan({fname}, {init}, {v.name}{rev})",
                                     [(s, v.dtype, scale, False), (v.shape, v.dtype, scale, False)]))
    length = r.randint(1, 4)
    c = Var(g.fresh("c"), v.shape, v.dtype, max(v.scale, 13.0 if v.dtype == I else 1.0), v.dtype != F)
    with _Scope(g, [c]) as sc:
        t = g.annotate(_bound(g, _inner(g, c, 1, 2)), 0.4)
        g.line(f"return {t.name}, None")
    _def(g, fname, f"{c.name}, _", sc)
    return g.emit(f"jax.lax.scan({fname}, {v.name}, None, length={length})[0]", v.shape, v.dtype, c.scale, False)


def op_while(g: Gen, v: Var):
    r = g.r
    if g.depth or v.dtype == "key":
        return None
    trips = r.randint(1, 3)
    cname, bname = g.fresh("cond"), g.fresh("body")
    g.line(f"def {cname}(s):")
    g.line(f"    return s[0] < {trips}")
    c = Var(g.fresh("c"), v.shape, v.dtype, max(v.scale, 13.0 if v.dtype == I else 1.0), v.dtype != F)
    with _Scope(g, [c]) as sc:
        t = _inner(g, c, 1, 2)
        if v.dtype != B and r.random() < 0.3:
            t = g.emit(f"{t.name} + i.astype({JNP_DTYPE[v.dtype]})", v.shape, v.dtype, t.scale + 3, False)
        t = g.annotate(_bound(g, t), 0.4)
        g.line(f"return i + 1, {t.name}")
    g.line(f"def {bname}(s):")
    g.line(f"    i, {c.name} = s")
    g.lines.extend(sc.body)
    return g.emit(f"jax.lax.while_loop({cname}, {bname}, (jnp.int32(0), {v.name}))[1]", v.shape, v.dtype,
                  c.scale, False)


def op_cond(g: Gen, v: Var):
    r = g.r
    if g.depth or v.dtype == "key":
        return None
    nb = 3 if r.random() < 0.2 else 2
    names, results = [], []
    for _ in range(nb):
        a = Var(g.fresh("a"), v.shape, v.dtype, v.scale, v.exact)
        with _Scope(g, [a]) as sc:
            t = g.annotate(_inner(g, a, 0, 2), 0.4)
            g.line(f"return {t.name}")
        names.append(g.fresh("branch"))
        results.append(t)
        _def(g, names[-1], a.name, sc)
    scale = max(t.scale for t in results)
    exact = all(t.exact for t in results)
    if nb == 3:
        return g.emit(f"jax.lax.switch({g.index_arg(3)}, [{', '.join(names)}], {v.name})", v.shape, v.dtype, scale,
                      exact)
    x = v.name
    preds = {F: [f"jnp.max({x}) > 0.5"] if v.exact else [],
             I: [f"jnp.sum({x}) % 2 == 0", f"jnp.max({x}) > 2"], B: [f"jnp.any({x})", f"jnp.all({x})"]}[v.dtype]
    pred = r.choice(preds) if v.rank and preds and r.random() < 0.7 else f"{g.index_arg(4)} > 1"
    return g.emit(f"jax.lax.cond({pred}, {names[0]}, {names[1]}, {x})", v.shape, v.dtype, scale, exact)


def op_checkpoint(g: Gen, v: Var):
    r = g.r
    if g.depth or v.dtype == "key":
        return None
    fname = g.fresh("ck")
    a = Var(g.fresh("a"), v.shape, v.dtype, v.scale, v.exact)
    with _Scope(g, [a]) as sc:
        t = g.annotate(_inner(g, a, 1, 2, BASIC_OPS), 0.4)
        g.line(f"return {t.name}")
    _def(g, fname, a.name, sc)
    policy = r.choice(["", "", ", policy=jax.checkpoint_policies.nothing_saveable",
                       ", policy=jax.checkpoint_policies.dots_saveable"])
    return g.emit(f"jax.checkpoint({fname}{policy})({v.name})", t.shape, t.dtype, t.scale, t.exact)


BASIC_OPS = [
    ("unary", op_unary, 3), ("cast", op_cast, 1.5), ("binary", op_binary, 4), ("compare", op_compare, 1),
    ("select", op_select, 1.5), ("broadcast", op_broadcast, 2), ("reshape", op_reshape, 2.5),
    ("transpose", op_transpose, 2), ("reduce", op_reduce, 3), ("einsum", op_einsum, 3), ("iota", op_iota, 1),
    ("cumulative", op_cumulative, 1.5), ("sort", op_sort, 1), ("top_k", op_top_k, 1), ("slice", op_slice, 2),
    ("pad", op_pad, 2), ("concat", op_concat, 1.5), ("split", op_split, 1), ("rev", op_rev, 1),
    ("roll", op_roll, 1.5), ("dynamic_slice", op_dynamic_slice, 2),
    ("dynamic_update_slice", op_dynamic_update_slice, 1.5),
    ("take", op_take, 2.5), ("at", op_at, 2), ("random", op_random, 1),
]
TOP_OPS = BASIC_OPS + [("scan", op_scan, 1.2), ("while", op_while, 0.8), ("cond", op_cond, 1),
                       ("checkpoint", op_checkpoint, 1)]


# --------------------------------------------------------------------------- programs


@dataclasses.dataclass
class Program:
    seed: int
    fn: object
    args: tuple
    mesh_name: str
    in_shardings: object
    out_shardings: object
    description: str
    ops: list
    out_avals: list


def _arg_line(a: Arg) -> str:
    if a.kind == "array":
        s = _shape_str(a.shape)
        return {F: f"{a.name} = rng.standard_normal({s}).astype(np.float32)",
                I: f"{a.name} = rng.integers(-5, 6, size={s}).astype(np.int32)",
                B: f"{a.name} = rng.random({s}) < 0.5"}[a.dtype]
    if a.kind == "index":
        return f"{a.name} = np.int32({a.values})"
    if a.kind == "indices":
        return f"{a.name} = np.array({a.values.tolist()}, np.int32)"
    return f"{a.name} = jax.random.key(0)"


def _fmt_entry(e) -> str:
    if e is None:
        return "None"
    if isinstance(e, P):
        return "P" + _fmt_spec(tuple(e))
    return _fmt_spec(e)


def _fmt_per_value(s) -> str:
    """in_shardings / a tuple of out_shardings: one entry per argument (output)."""
    if s is None:
        return "None"
    return "(" + ", ".join(_fmt_entry(e) for e in s) + (",)" if len(s) == 1 else ")")


def generate(seed: int):
    """(fn, args, mesh_name, in_shardings, out_shardings, description) for a seeded random program.

    The description is a runnable script that rebuilds exactly this program and compares the results.
    """
    p = generate_program(seed)
    return p.fn, p.args, p.mesh_name, p.in_shardings, p.out_shardings, p.description


def generate_program(seed: int) -> Program:
    g = Gen(seed)
    outs, as_tuple, in_sh, out_sh = g.build()
    params = ", ".join(a.name for a in g.args)
    src = f"def fn({params}):\n" + "\n".join(g.lines) + "\n"
    arg_src = "rng = np.random.default_rng(%d)\n" % seed + "\n".join(_arg_line(a) for a in g.args) + \
        f"\nargs = ({params}{',' if len(g.args) == 1 else ''})\n"
    filename = f"<random program {seed}>"
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
    ns = {"jax": jax, "jnp": jnp, "np": np, "gs": gs, "P": P}
    exec(compile(src, filename, "exec"), ns)
    exec(arg_src, ns)
    in_txt = _fmt_per_value(in_sh)
    out_txt = _fmt_per_value(out_sh) if as_tuple or out_sh is None else _fmt_entry(out_sh)
    description = (
        f"# random program {seed} ({len(g.ops_used)} ops: {', '.join(g.ops_used)})\n"
        "import jax\njax.config.update('jax_num_cpu_devices', 8)\n"
        "import jax.numpy as jnp, numpy as np\nimport gshard_jax as gs\nfrom jax.sharding import PartitionSpec as P\n"
        f"mesh = gs.make_mesh({MESHES[g.mesh_name]})\n"
        f"{src}{arg_src}"
        f"f = gs.partition(fn, mesh, in_shardings={in_txt}, out_shardings={out_txt})\n"
        "want, got = jax.jit(fn)(*args), f(*args)\n"
        "for w, o in zip(jax.tree.leaves(want), jax.tree.leaves(got)):\n"
        "    print(w.dtype, o.dtype, w.shape, o.shape); np.testing.assert_allclose(o, w, rtol=1e-5, atol=1e-5)\n")
    return Program(seed, ns["fn"], ns["args"], g.mesh_name, in_sh, out_sh, description, g.ops_used,
                   [(o.shape, o.dtype) for o in outs])
