"""Count the collectives in compiled HLO, by kind, with payload and moved bytes per device.

Payload follows partitioner.cost: the result buffer of an all-gather,
all-reduce, all-to-all or collective-permute, the operand (result x group)
of a reduce-scatter. Async ``-start`` forms are included (XLA:GPU's all-to-all-start among them, its operands
then its result) and ``-done`` halves not counted twice.
`count` is the number of collectives performed: XLA's combiners merge
several all-reduces (all-gathers, reduce-scatters) into one tuple-shaped
instruction, which counts as its elements; a tuple-shaped all-to-all is one
all-to-all in chunks and counts once.

Static counts list each instruction once, as the HLO text does. ``per_step=True`` counts what one call
executes: an instruction in a while loop's body (or condition) times the loop's known trip count
(``known_trip_count``, nested loops multiplied); a loop whose trip count XLA does not know counts once.
"""
from __future__ import annotations

import re
from typing import Any

import numpy as np

from ..costs.cost import KINDS, moved_bytes

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
                "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1,
                "s4": 1, "u4": 1}
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<shape>.+?)\s+(?P<op>all-gather-start|all-gather|"
                    r"all-reduce-start|all-reduce|reduce-scatter|all-to-all-start|all-to-all|"
                    r"collective-permute-start|collective-permute)\((?P<rest>.*)$")
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")


def _arrays(shape: str) -> list[int]:
    """Byte sizes of the arrays in an HLO shape (a tuple gives several)."""
    out = []
    for dtype, dims in _ARRAY.findall(shape):
        if dtype not in _DTYPE_BYTES:
            continue
        n = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
        out.append(n * _DTYPE_BYTES[dtype])
    return out


_MESH_GROUPS = re.compile(r"replica_groups=mesh\[(?P<mesh>[^\]]*)\][^{]*\{(?P<axes>[^}]*)\}")
_MESH_AXIS = re.compile(r"'([^']+)'\s*=\s*(\d+)")
_GROUP_AXIS = re.compile(r"'([^']+)'(?::\((\d+)\)(\d+))?")


def _group_size(rest: str) -> int:
    m = _MESH_GROUPS.search(rest)
    if m:  # newer syntax: replica_groups=mesh['a'=2,'b'=4] {'a'}, maybe with device_ids=(...) before the axes
        sizes = {name: int(n) for name, n in _MESH_AXIS.findall(m.group("mesh"))}
        group = 1
        for name, _, sub in _GROUP_AXIS.findall(m.group("axes")):
            group *= int(sub) if sub else sizes[name]
        return group
    m = re.search(r"replica_groups=\{(\{[\d,]*\})", rest)
    if m:
        return len([x for x in m.group(1).strip("{}").split(",") if x])
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]", rest)
    if m:
        return int(m.group(2))
    m = re.search(r"source_target_pairs=\{(.*?)\}\}", rest)
    if m:
        return len(re.findall(r"\{\d+,\d+", m.group(0)))
    return 1


_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s+\(.*->.*\{\s*$")
_CALLED = re.compile(r"(?P<key>body|condition|calls|to_apply|true_computation|false_computation)=%?(?P<name>[\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{(?P<names>[^}]*)\}")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def trips(text: str) -> dict[str, int]:
    """Times one call runs each computation's instructions: a while body and condition run the loop's known
    trip count times its caller's (1 where unknown); the entry computation once."""
    calls: dict[str, list[tuple[str, int]]] = {}
    current, entry = None, None
    for line in text.splitlines():
        m = _COMPUTATION.match(line)
        if m:
            current = m.group("name")
            calls.setdefault(current, [])
            if line.lstrip().startswith("ENTRY"):
                entry = current
            continue
        if current is None or "=" not in line:
            continue
        n = _TRIPS.search(line)
        times = int(n.group(1)) if n and " while(" in line else 1
        for c in _CALLED.finditer(line):
            calls[current].append((c.group("name"), times if c.group("key") in ("body", "condition") else 1))
        b = _BRANCHES.search(line)
        if b:
            calls[current] += [(x.strip().lstrip("%"), 1) for x in b.group("names").split(",") if x.strip()]
    out: dict[str, int] = {}

    def visit(name: str, times: int) -> None:
        out[name] = out.get(name, 0) + times
        for callee, k in calls.get(name, ()):
            visit(callee, times * k)

    if entry is not None:
        visit(entry, 1)
    return out


def collectives(compiled: Any, per_step: bool = False) -> list[dict]:
    """Every collective instruction of a compiled function (or its HLO text): kind, payload bytes per device
    (a reduce-scatter's input, an all-gather's output), group size, arrays (a combined one holds several), and
    `times` it runs per call (1 unless per_step: see the module docstring)."""
    text = compiled if isinstance(compiled, str) else compiled.as_text()
    runs = trips(text) if per_step else {}
    out = []
    current = None
    for line in text.splitlines():
        c = _COMPUTATION.match(line)
        if c:
            current = c.group("name")
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        op, rest = m.group("op"), m.group("rest")
        kind = op.removesuffix("-start")
        sizes = _arrays(m.group("shape"))
        if op.endswith("-start") and kind in ("all-gather", "collective-permute", "all-to-all"):
            # (operands..., results..., [sync flags]): keep the results.
            big = [s for s in sizes if s > 4] or sizes
            sizes = big[len(big) // 2:]
        group = _group_size(rest)
        if kind == "collective-permute":
            group = max(group, 2)
        out.append({"kind": kind, "payload_bytes": sum(sizes) * (group if kind == "reduce-scatter" else 1),
                    "group": group, "arrays": 1 if kind == "all-to-all" else len(sizes),
                    "times": runs.get(current, 1) if per_step else 1})
    return out


def collective_stats(compiled: Any, per_step: bool = False) -> dict:
    """Per collective kind: count, payload_bytes, moved_bytes (per device) in a compiled function or HLO text;
    per_step=True: what one call executes (loops times their trip counts), else each instruction once.

    `compiled` may be the result of ``jax.jit(f).lower(...).compile()``, or its ``as_text()``.
    """
    out = {k: {"count": 0, "payload_bytes": 0, "moved_bytes": 0.0} for k in KINDS}
    for c in collectives(compiled, per_step):
        t, n = out[c["kind"]], c["times"]
        t["count"] += c["arrays"] * n
        t["payload_bytes"] += c["payload_bytes"] * n
        t["moved_bytes"] += moved_bytes(c["kind"], c["payload_bytes"], c["group"]) * n
    return out


def summary(stats: dict) -> dict:
    """Only the kinds that occur: {kind: count}."""
    return {k: v["count"] for k, v in stats.items() if v["count"]}
