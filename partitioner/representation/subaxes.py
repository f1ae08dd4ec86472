"""Sub-axes: a mesh axis planned as the product of smaller axes, so a dim may split over part of it.

Grouped-query attention on a 4-device ``model`` axis with 2 k/v heads: the k projection's output dim
(2 heads x D) splits over all of ``model``, but its heads dim can take only 2 of the 4 devices. XLA's
partitioner (Shardy) splits it over a *sub-axis*, ``"model":(1)2``, and gathers D within pairs, where a
sharding over whole axes gathers all of k over ``model``.

The partitioner gets sub-axes without a second kind of axis: it plans on a *refined* mesh, the same devices
with ``model`` reshaped into ``model:(1)2`` x ``model:(2)2`` (Shardy's notation: pre-size, size; major
first). A user's ``model`` becomes the tuple of its parts, so every rule, reshard and collective works
unchanged, and a collective over both parts is one over ``model``. The program enters and leaves on whole
axes, and the report names whole axes wherever a dim holds all parts of one in order.

An axis is refined only where the program asks for it: a reshape whose merged dim the axis splits but whose
major factor it cannot (``factorings``). The caller plans both meshes and keeps the cheaper plan.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Mapping, Optional

import numpy as np
from jax.sharding import AbstractMesh, Mesh

from .program import Program
from .sharding import Sharding

Factoring = Mapping[str, tuple[int, ...]]  # axis -> the sizes of its parts, major first

_PART = re.compile(r"^(?P<parent>.+):\((?P<pre>\d+)\)(?P<size>\d+)$")
# Primitives that name mesh axes themselves (a manual region, a collective in a user's body): refining the mesh
# would rename the axes under them, so a program holding one is planned on the mesh as given.
_NAMES_AXES = ("axis_name", "axes")


def _names_axes(e) -> bool:
    if e.name == "shard_map":
        return True
    for k in _NAMES_AXES:
        v = e.params.get(k)
        if isinstance(v, str) or (isinstance(v, tuple) and any(isinstance(a, str) for a in v)):
            return True
    return False


def part_name(parent: str, pre: int, size: int) -> str:
    """Shardy's name for the sub-axis of `parent` of `size` devices with `pre` devices major to it."""
    return f"{parent}:({pre}){size}"


def parent_of(axis: str) -> str:
    """The mesh axis a (sub-)axis belongs to."""
    m = _PART.match(axis)
    return m.group("parent") if m else axis


def parts(parent: str, sizes: tuple[int, ...]) -> tuple[str, ...]:
    out, pre = [], 1
    for s in sizes:
        out.append(part_name(parent, pre, s))
        pre *= s
    return tuple(out)


def _groups(a: tuple[int, ...], b: tuple[int, ...]):
    """The (dims of a, dims of b) groups a reshape maps onto each other (equal products, minimal)."""
    i = j = 0
    while i < len(a) or j < len(b):
        gi, gj, pa, pb = [i], [j], a[i] if i < len(a) else 1, b[j] if j < len(b) else 1
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                pa *= a[i]
                gi.append(i)
                i += 1
            else:
                pb *= b[j]
                gj.append(j)
                j += 1
        yield [d for d in gi if d < len(a)], [d for d in gj if d < len(b)]


def factorings(program: Program, mesh_shape: Mapping[str, int]) -> dict[str, tuple[int, int]]:
    """Per axis, the two parts (major, minor) a reshape of the program could use; {} when none or when the
    program names mesh axes itself.

    A reshape merges dims (or splits one) whose product the axis divides while their major factor takes
    only gcd(factor, axis) of its devices: that many devices are the major part."""
    out: dict[str, tuple[int, int]] = {}
    for e in program.all_eqns():
        if _names_axes(e):
            return {}
        if e.name != "reshape":
            continue
        a, b = tuple(e.invars[0].aval.shape), tuple(e.outvars[0].shape)
        if 0 in a or 0 in b:
            continue
        for ga, gb in _groups(a, b):
            if len(ga) == 1 and len(gb) == 1:
                continue
            total = math.prod(a[d] for d in ga)
            for split in (ga, gb):
                major = next((s for s in ((a if split is ga else b)[d] for d in split) if s > 1), 1)
                for axis, n in mesh_shape.items():
                    g = math.gcd(major, n)
                    if axis not in out and total % n == 0 and 1 < g < n and major % n:
                        out[axis] = (g, n // g)
    return out


def refine_mesh(mesh, factoring: Factoring):
    """The same devices with each factored axis reshaped into its parts (Auto typed, as the partitioner's)."""
    names, sizes = [], []
    for a, n in zip(mesh.axis_names, mesh.axis_sizes):
        split = factoring.get(a, (n,))
        names += parts(a, split) if a in factoring else [a]
        sizes += split
    if isinstance(mesh, AbstractMesh):
        return AbstractMesh(tuple(sizes), tuple(names))
    return Mesh(np.asarray(mesh.devices).reshape(sizes), tuple(names))


def refine(s: Optional[Sharding], factoring: Factoring) -> Optional[Sharding]:
    """A sharding over whole axes, over the refined mesh's axes."""
    if s is None or not factoring or not (s.axes | s.partial) & factoring.keys():
        return s
    expand = lambda axes: tuple(p for a in axes for p in (parts(a, factoring[a]) if a in factoring else (a,)))
    return Sharding(tuple(expand(d) for d in s.dims), frozenset(expand(sorted(s.partial))), s.padded)


def _merge(axes: tuple[str, ...], mesh_shape: Mapping[str, int]) -> tuple[str, ...]:
    """Runs of parts that make up a whole axis of `mesh_shape` (in order) as that axis."""
    out: list[str] = []
    for a in axes:
        m = _PART.match(a)
        out.append(a)
        if m is None:
            continue
        parent, run, product = m.group("parent"), [], 1
        for b in reversed(out):
            mb = _PART.match(b)
            if mb is None or mb.group("parent") != parent:
                break
            run.append(mb)
            product *= int(mb.group("size"))
        run.reverse()
        ok = int(run[0].group("pre")) == 1 and product == mesh_shape.get(parent) and all(
            int(y.group("pre")) == int(x.group("pre")) * int(x.group("size")) for x, y in zip(run, run[1:]))
        if ok:
            del out[len(out) - len(run):]
            out.append(parent)
    return tuple(out)


def whole(s: Sharding, mesh_shape: Mapping[str, int]) -> Sharding:
    """s named over the given mesh: all parts of an axis, in order, as the axis (a lone part stays a part)."""
    if not any(_PART.match(a) for a in s.axes | s.partial):
        return s
    order = lambda a: (parent_of(a), int(_PART.match(a).group("pre")) if _PART.match(a) else 0)
    partial = set(_merge(tuple(sorted(s.partial, key=order)), mesh_shape))
    return Sharding(tuple(_merge(d, mesh_shape) for d in s.dims), frozenset(partial), s.padded)


def coarse(s: Sharding, factoring: Factoring) -> Sharding:
    """s (over the refined mesh) with its lone parts dropped (gathered): how a value crosses the program
    boundary, where only whole axes exist."""
    w = whole(s, {a: math.prod(f) for a, f in factoring.items()})
    if w is s:
        return s
    keep = lambda axes: tuple(a for a in axes if not _PART.match(a))
    return refine(Sharding(tuple(keep(d) for d in w.dims), frozenset(keep(tuple(w.partial))), s.padded), factoring)


def refine_program(program: Program, factoring: Factoring) -> Program:
    """The program with its annotations over the refined mesh (a copy where they change; values shared)."""
    def visit(p: Program) -> Program:
        eqns, changed = [], False
        for e in p.eqns:
            new = e
            if e.subs:
                subs = {k: visit(sub) for k, sub in e.subs.items()}
                if any(subs[k] is not e.subs[k] for k in subs):
                    new = dataclasses.replace(e, subs=subs)
            if e.name == "sharding_annotation":
                s = refine(e.params["sharding"], factoring)
                if s is not e.params["sharding"]:
                    new = dataclasses.replace(new, params={**e.params, "sharding": s})
            changed |= new is not e
            eqns.append(new)
        return dataclasses.replace(p, eqns=eqns) if changed else p

    return visit(program)


def name_whole_axes(report) -> None:
    """The report's shardings and collectives named over its (the user's) mesh, in place (see `whole`)."""
    shape = report.mesh
    fix = lambda x: whole(x, shape) if isinstance(x, Sharding) else x
    renamed = lambda obj: dataclasses.replace(obj, **{f.name: fix(getattr(obj, f.name))
                                                      for f in dataclasses.fields(obj)})
    runs = re.compile(r"[\w.\-]+:\(\d+\)\d+(?:\*[\w.\-]+:\(\d+\)\d+)+")
    for r in report.rows:
        r.strategy = runs.sub(lambda m: "*".join(_merge(tuple(m.group(0).split("*")), shape)), r.strategy)
        r.operands = [renamed(o) for o in r.operands]
        r.outputs = [renamed(o) for o in r.outputs]
        r.collectives = [dataclasses.replace(c, axes=_merge(c.axes, shape)) for c in r.collectives]
    report.inputs = [renamed(v) for v in report.inputs]
    report.outputs = [renamed(v) for v in report.outputs]
