"""The partitioner's account of itself (explain()): one row per equation, the program boundary, totals.

Rows hold structured fields (shapes, shardings, origins, collectives);
formatting happens only when printing. ``str(report)`` is the compact view
(what communicates or falls back, then totals by kind) that fits a
100-column terminal; ``report.table()`` lists every row; ``to_json()`` and
``to_html()`` export the structured form. Notation: ``[data, -]`` splits dim 0
over mesh axis ``data`` and keeps dim 1 whole; ``data*model`` splits one dim
over two axes (major first); ``partial(model)`` holds unreduced summands over
``model``; ``(pad)`` marks an uneven dim stored padded; ``a->b`` is a reshard
from what an op has (or makes) to what it needs (or the plan wants).
"""
from __future__ import annotations

import collections
import dataclasses
import html
import json
import math
import textwrap
from typing import Any, Callable, Optional

import numpy as np

from ..costs import overlap as OV
from ..costs.cost import KINDS, Collective, _fmt_bytes
from ..costs.hardware import Hardware
from ..representation.sharding import Sharding

WIDTH = 100


def _sharding_dict(s: Sharding) -> dict:
    return {"dims": [list(d) for d in s.dims], "partial": sorted(s.partial), "padded": sorted(s.padded),
            "text": str(s)}


def _arrow(a: Sharding, b: Sharding) -> str:
    return f"{a}" if a == b else f"{a}->{b}"


@dataclasses.dataclass
class Operand:
    shape: tuple[int, ...]
    dtype: str
    have: Sharding
    need: Sharding

    def __str__(self) -> str:
        return _arrow(self.have, self.need)

    def to_dict(self) -> dict:
        return {"shape": list(self.shape), "dtype": self.dtype, "have": _sharding_dict(self.have),
                "need": _sharding_dict(self.need)}


@dataclasses.dataclass
class Result:
    shape: tuple[int, ...]
    dtype: str
    made: Sharding
    planned: Sharding
    origin: str = ""

    def __str__(self) -> str:
        return _arrow(self.made, self.planned)

    def to_dict(self) -> dict:
        return {"shape": list(self.shape), "dtype": self.dtype, "made": _sharding_dict(self.made),
                "planned": _sharding_dict(self.planned), "origin": self.origin}


@dataclasses.dataclass
class ValueInfo:
    """An input or output of the partitioned function, named by its pytree key path."""
    name: str
    shape: tuple[int, ...]
    dtype: str
    planned: Sharding
    boundary: Sharding  # how it arrives (input) or leaves (output) the per-device program
    origin: str = ""
    host: bool = False  # held in host memory (a pinned_host argument: offloaded optimizer state)

    def __str__(self) -> str:
        cross = "" if self.boundary == self.planned else f" (crosses as {self.boundary})"
        return f"{self.name}: {self.dtype}{list(self.shape)} {self.planned}{cross}  <- {self.origin}"

    def to_dict(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype,
                "planned": _sharding_dict(self.planned), "boundary": _sharding_dict(self.boundary),
                "origin": self.origin, **({"host": True} if self.host else {})}


@dataclasses.dataclass
class Row:
    index: int  # the equation's index in its (sub-)program; -1 for the program boundary
    source: str  # the user's code (and Flax module path), or the boundary value's name
    primitive: str  # prefixed by its region: scan/..., checkpoint/...; "input" / "output" at the boundary
    operands: list[Operand]
    outputs: list[Result]
    strategy: str
    collectives: list[Collective]
    fallback: Optional[str] = None
    compute_time: float = 0.0
    comm_time: float = 0.0
    trips: int = 1  # times the row runs per call (a scan body's length); a while body counts once
    # For overlap.py: the values read and written (ids), how many collectives run before the op computes (the
    # rest wait for its result), and how many times per call its region (loop body) runs.
    reads: tuple = ()
    writes: tuple = ()
    issue: Optional[int] = None
    calls: int = 1
    # Bytes per device this op moves between device and host memory per call: {"to_host": n, "to_device": n}
    # (a device_put of a value to the other memory space: offloaded optimizer state, parameters, gradients).
    host_moves: dict = dataclasses.field(default_factory=dict)

    @property
    def origins(self) -> list[str]:
        return [r.origin for r in self.outputs]

    def to_dict(self) -> dict:
        return {"index": self.index, "source": self.source, "primitive": self.primitive,
                "operands": [o.to_dict() for o in self.operands], "outputs": [r.to_dict() for r in self.outputs],
                "strategy": self.strategy, "collectives": [c.to_dict() for c in self.collectives],
                "fallback": self.fallback, "compute_time_s": self.compute_time, "comm_time_s": self.comm_time,
                "trips": self.trips, **({"host_moves": self.host_moves} if self.host_moves else {})}


def _argument(name: str) -> str:
    """The top-level argument a flat input belongs to: "state['params']['w']" -> "state"."""
    return name.split("[")[0].split(".")[0]


def _itemsize(dtype: str) -> int:
    """Bytes per element of a dtype by name; a typed PRNG key's ("key<fry>") are its key data's."""
    if dtype.startswith("key<"):
        import jax
        for impl in ("threefry2x32", "rbg", "unsafe_rbg"):
            key = jax.eval_shape(lambda: jax.random.key(0, impl=impl)).dtype  # noqa: B023
            if str(key) == dtype:
                return key.itemsize
    return np.dtype(dtype).itemsize


@dataclasses.dataclass
class Report:
    mesh: dict
    profile: Hardware
    rows: list[Row] = dataclasses.field(default_factory=list)
    inputs: list[ValueInfo] = dataclasses.field(default_factory=list)
    outputs: list[ValueInfo] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    kind_of: Callable[[str], str] = _argument  # groups inputs into kinds for memory (default: the argument)
    compiled_memory: Optional[dict] = None  # XLA's memory_analysis() of the compiled program (attach_compiled)
    temporaries: Optional[Any] = None  # liveness.Peak: the predicted peak of the step's temporaries per device
    pipelines: list[dict] = dataclasses.field(default_factory=list)  # gs.pipeline schedules traced (Schedule.summary)
    # For overlap.py, by value id: a scan body's input -> the operand it stands for, and a scan's result -> the
    # body's value it stands for (a body run once a call is inlined into the code around it)
    links: tuple[dict, dict] = dataclasses.field(default_factory=lambda: ({}, {}))
    # (first row, end row, level) of each scan body of one trip a call, which XLA inlines (overlap.py joins it)
    one_trip: list = dataclasses.field(default_factory=list)
    _overlap: Optional[list] = dataclasses.field(default=None, repr=False, compare=False)  # overlap() at the profile

    def argument_bytes(self, host: bool = False) -> dict:
        """Predicted bytes per device of the program's arguments in device memory (host=True: in host memory),
        by kind (and "total"), from the shardings they arrive in: what ``memory_analysis()`` counts as
        ``argument_size_in_bytes`` (``host_argument_size_in_bytes``; XLA:CPU counts both as the first)."""
        out: dict = collections.Counter()
        for v in self.inputs:
            if v.host != host:
                continue
            local = [-(-n // math.prod(self.mesh.get(a, 1) for a in axes))
                     for n, axes in zip(v.shape, v.boundary.dims + ((),) * (len(v.shape) - len(v.boundary.dims)))]
            out[self.kind_of(v.name)] += math.prod(local) * _itemsize(v.dtype)
        return dict(out, total=sum(out.values()))

    def attach_compiled(self, compiled: Any) -> "Report":
        """Record XLA's memory_analysis() of the compiled program this report describes."""
        m = compiled.memory_analysis()
        self.compiled_memory = {k: int(getattr(m, f"{k}_size_in_bytes")) for k in MEMORY_FIELDS}
        self.compiled_memory.update({k: v for k in HOST_MEMORY_FIELDS if (v := int(getattr(m, f"{k}_size_in_bytes")))})
        return self

    @property
    def memory(self) -> dict:
        """{"predicted": device argument bytes per device by kind, "predicted_host": the same in host memory,
        "predicted_temporaries": the temporaries' peak per device (liveness.py; None: not predicted),
        "compiled": memory_analysis() (or None)}."""
        return {"predicted": self.argument_bytes(), "predicted_host": self.argument_bytes(host=True),
                "predicted_temporaries": None if self.temporaries is None else self.temporaries.bytes,
                "compiled": self.compiled_memory}

    def _memory_line(self, where: bool = False) -> str:
        """where: name the op at the temporaries' peak (the full table; the compact view names no op that does
        not communicate)."""
        pred, host = self.argument_bytes(), self.argument_bytes(host=True)
        text = "memory per device: arguments " + ", ".join(
            f"{k} {_fmt_bytes(v)}" for k, v in pred.items() if k != "total") + f" = {_fmt_bytes(pred['total'])}"
        if host["total"]:
            text += "; in host memory " + ", ".join(
                f"{k} {_fmt_bytes(v)}" for k, v in host.items() if k != "total") + f" = {_fmt_bytes(host['total'])}"
        if self.temporaries is not None and self.temporaries.bytes:
            text += f"; temporaries at their peak {_fmt_bytes(self.temporaries.bytes)}" + (
                f" (at {self.temporaries.op})" if where else "")
        if self.compiled_memory:
            text += "; compiled " + ", ".join(f"{k} {_fmt_bytes(v)}" for k, v in self.compiled_memory.items())
        return text

    @property
    def collectives(self) -> list[Collective]:
        return [c for r in self.rows for c in r.collectives]

    @property
    def fallbacks(self) -> list[Row]:
        return [r for r in self.rows if r.fallback]

    def totals(self, dynamic: bool = False) -> dict:
        """Per collective kind: count, payload bytes and moved bytes per device.

        Static (default): each collective once, as the compiled HLO lists it.
        dynamic=True: multiplied by the trip count of the scan bodies it is in (its row's, and its own runs
        inside a manual region's loop).
        """
        out = {k: {"count": 0, "payload_bytes": 0, "moved_bytes": 0.0} for k in KINDS}
        for r in self.rows:
            for c in r.collectives:
                t, n = out[c.kind], (r.trips * c.runs if dynamic else 1)
                t["count"] += n
                t["payload_bytes"] += c.payload * n
                t["moved_bytes"] += c.moved * n
        return out

    def host_transfers(self) -> dict:
        """Bytes per device a step moves between device and host memory: {"to_host": n, "to_device": n}, each
        move as many times as its row runs."""
        out = {"to_host": 0, "to_device": 0}
        for r in self.rows:
            for way, n in r.host_moves.items():
                out[way] += n * r.trips
        return out

    @property
    def comm_time(self) -> float:
        return sum(r.comm_time * r.trips for r in self.rows)

    @property
    def compute_time(self) -> float:
        return sum(r.compute_time * r.trips for r in self.rows)

    def overlap(self, comm_time: Optional[Callable] = None, compute_time: Optional[Callable] = None,
                overlaps: Optional[bool] = None) -> list:
        """Per row, its collectives' time, exposed time and the op that hides the most of them (overlap.py), at
        the profile's figures unless other durations are given (the planner's hardware)."""
        if comm_time is None and compute_time is None and overlaps is None and self._overlap is not None:
            return self._overlap
        got = OV.analyse(self.rows, comm_time or (lambda c: c.time(self.profile)),
                         compute_time or (lambda r: r.compute_time),
                         self.profile.overlap if overlaps is None else overlaps, self.links, self.one_trip)
        if comm_time is None and compute_time is None and overlaps is None:
            self._overlap = got
        return got

    @property
    def exposed_comm_time(self) -> float:
        """Seconds of communication per step that no independent compute hides (overlap.py)."""
        return OV.exposed_per_step(self.overlap())

    def to_json(self, **kw) -> str:
        return json.dumps({
            "mesh": self.mesh, "profile": self.profile.to_dict(),
            "inputs": [v.to_dict() for v in self.inputs], "outputs": [v.to_dict() for v in self.outputs],
            "notes": self.notes, "rows": [dict(r.to_dict(), **self._overlap_dict(o)) for r, o in
                                          zip(self.rows, self.overlap())], "totals": self.totals(),
            "memory": self.memory, "pipelines": self.pipelines,
            "temporaries": None if self.temporaries is None else self.temporaries.to_dict(),
            "totals_per_call": self.totals(dynamic=True),  # per step: a loop's collectives times its trips
            "predicted_comm_time_s": self.comm_time, "predicted_compute_time_s": self.compute_time,
            "predicted_exposed_comm_time_s": self.exposed_comm_time,
            "host_transfers_per_step": self.host_transfers(),
            "fallbacks": [r.index for r in self.fallbacks]}, default=str, **kw)

    def _overlap_dict(self, o) -> dict:
        """A row's overlap in the JSON: exposed seconds per step and the op hiding most of the rest."""
        if not o.comm:
            return {}
        behind = self.rows[o.behind] if o.behind is not None else None
        return {"exposed_comm_time_s": o.exposed * o.calls, "overlaps": None if behind is None else
                {"row": o.behind, "primitive": behind.primitive, "source": behind.source,
                 "hidden_s": o.hidden_by_it * o.calls}}

    def to_html(self) -> str:
        """A self-contained HTML page: inputs, outputs, one table row per op (fallbacks highlighted), totals."""
        esc = html.escape
        cells = ("#", "source", "primitive", "operands (have -> need)", "result (made -> planned)", "strategy",
                 "collectives", "sharding from")
        rows = []
        for r in self.rows:
            coll = "<br>".join(esc(f"{c} ({c.time(self.profile) * 1e6:.3g}us)") for c in r.collectives) or "-"
            style = ' class="fallback"' if r.fallback else ""
            strategy = esc(r.strategy) + (f"<br><b>FALLBACK</b>: {esc(r.fallback)}" if r.fallback else "")
            rows.append(f"<tr{style}><td>{r.index}</td><td>{esc(r.source)}</td><td>{esc(r.primitive)}</td>"
                        f"<td>{esc(' '.join(map(str, r.operands)))}</td><td>{esc(' '.join(map(str, r.outputs)))}</td>"
                        f"<td>{strategy}</td><td>{coll}</td><td>{esc('; '.join(r.origins))}</td></tr>")
        totals = "".join(f"<tr><td>{k}</td><td>{t['count']}</td><td>{t['payload_bytes']}</td>"
                         f"<td>{t['moved_bytes']:.0f}</td></tr>"
                         for k, t in self.totals(dynamic=True).items() if t["count"])
        io = "".join(f"<li>input {esc(str(x))}</li>" for x in self.inputs) + \
            "".join(f"<li>output {esc(str(x))}</li>" for x in self.outputs) + \
            "".join(f"<li>note: {esc(n)}</li>" for n in self.notes)
        return (f"<!doctype html><html><head><meta charset='utf-8'><title>gshard_jax partition report</title>"
                f"<style>table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;padding:2px 6px;"
                f"font:12px monospace;vertical-align:top}}.fallback{{background:#fdd}}</style></head><body>"
                f"<h1>Partition report</h1><p>mesh {esc(str(self.mesh))}, profile {esc(self.profile.name)}</p>"
                f"<ul>{io}</ul><table><tr>{''.join(f'<th>{c}</th>' for c in cells)}</tr>{''.join(rows)}</table>"
                f"<h2>Totals per device per step</h2><table><tr><th>kind</th><th>count</th><th>payload bytes</th>"
                f"<th>moved bytes</th></tr>{totals}</table><p>predicted communication {self.comm_time * 1e6:.3g}us"
                f" per step; fallbacks: {len(self.fallbacks)}</p></body></html>")

    # ------------------------------------------------------------------ text
    def _row_lines(self, r: Row) -> list[str]:
        head = f"{r.index if r.index >= 0 else '':>4} {r.primitive} at {r.source or '?'}"
        if r.trips > 1:
            head += f" (x{r.trips} per call)"
        body = [f"{' '.join(map(str, r.operands)) or '-'} => {' '.join(map(str, r.outputs)) or '-'}",
                f"{r.strategy}"]
        body += [f"{c} moves {_fmt_bytes(c.moved)} ({c.time(self.profile) * 1e6:.3g}us)" for c in r.collectives]
        if r.fallback:
            body.append(f"FALLBACK: {r.fallback}")
        return [_fit(head, 0)] + [_fit(b, 7) for b in body]

    def _totals_lines(self, where: bool = False) -> list[str]:
        """Per step first (a loop's collectives times its trips, as one call executes them); then, where loops
        make them differ, each collective once, as the HLO lists it."""
        lines = ["totals per device per step:"]
        per_step, static = self.totals(dynamic=True), self.totals()
        for kind, t in per_step.items():
            if t["count"]:
                lines.append(f"  {kind:<20} x{t['count']:<4} payload {_fmt_bytes(t['payload_bytes']):>10}  "
                             f"moved {_fmt_bytes(t['moved_bytes']):>10}")
        if not any(t["count"] for t in per_step.values()):
            lines.append("  no communication")
        if static != per_step:
            listed = ", ".join(f"{k} x{t['count']} {_fmt_bytes(t['payload_bytes'])}" for k, t in static.items()
                               if t["count"])
            lines.append(_fit(f"  as the HLO lists them (a loop body once): {listed}", 4))
        lines.append(f"  predicted communication {self.comm_time * 1e6:.3g}us ({self.exposed_comm_time * 1e6:.3g}us "
                     f"exposed), compute {self.compute_time * 1e6:.3g}us per step; fallbacks: {len(self.fallbacks)}")
        host = self.host_transfers()
        if any(host.values()):
            lines.append(f"  host transfers: to host {_fmt_bytes(host['to_host'])}, to device "
                         f"{_fmt_bytes(host['to_device'])} per step")
        if self.inputs:
            lines.append(_fit(self._memory_line(where), 2))
        return lines

    def _header(self) -> list[str]:
        lines = [f"gshard_jax partition report  mesh={self.mesh}  profile={self.profile.name}"]
        lines += [_fit(f"input  {x}", 2) for x in self.inputs]
        lines += [_fit(f"output {x}", 2) for x in self.outputs]
        lines += [_fit(f"note: {n}", 2) for n in self.notes]
        return lines + self._pipeline_lines()

    def _pipeline_lines(self) -> list[str]:
        return [_fit(f"pipeline {p['text']}", 2) for p in self.pipelines]

    def table(self) -> str:
        """Every row, with the origin of each result's sharding (and, where the profile runs collectives beside
        compute, each row's exposed time and the op that hides the most of the rest)."""
        lines = self._header()
        timing = self.overlap() if self.profile.overlap else [None] * len(self.rows)
        for r, o in zip(self.rows, timing):
            lines += self._row_lines(r)
            if o is not None and o.comm:
                behind = self.rows[o.behind] if o.behind is not None else None
                lines.append(_fit(f"exposed {o.exposed * 1e6:.3g}us of {o.comm * 1e6:.3g}us" + (
                    f"; {o.hidden_by_it * 1e6:.3g}us behind {behind.primitive} at {behind.source or '?'}"
                    if behind is not None else ""), 7))
            lines.append(_fit(f"result from: {'; '.join(r.origins)}", 7))
        return "\n".join(lines + self._totals_lines(where=True))

    def __str__(self) -> str:
        """The compact view, a screen whatever the program's size: the inputs and outputs (each one when there
        are few, else summarised by sharding), the rows that communicate or fall back (in full when there are
        few, else one line per source and collectives), then totals by kind."""
        shown = [r for r in self.rows if r.collectives or r.fallback]
        lines = [self._header()[0]]
        for what, values in (("inputs", self.inputs), ("outputs", self.outputs)):
            if len(values) <= FEW_VALUES:
                lines += [_fit(f"{what[:-1]:<6} {x}", 2) for x in values]
            elif values:
                lines.append(_fit(f"{what}: {_summary(values)}", 2))
        lines += [_fit(f"note: {n}", 2) for n in self.notes]
        lines += self._pipeline_lines()
        lines.append(f"{len(shown)} of {len(self.rows)} rows communicate or fall back "
                     f"(report.table() lists all):")
        if len(shown) <= FEW_ROWS:
            for r in shown:
                lines += self._row_lines(r)
        else:
            groups: dict = {}
            for r in shown:
                key = (r.primitive, r.source, tuple((c.kind, c.axes, c.payload) for c in r.collectives), r.fallback)
                groups.setdefault(key, []).append(r)
            for rs in groups.values():
                r = rs[0]
                what = ", ".join(str(c) for c in r.collectives) + (f"; FALLBACK: {r.fallback}" if r.fallback else "")
                times = f" (x{len(rs)}: rows {', '.join(str(x.index) for x in rs)})" if len(rs) > 1 else ""
                lines.append(_fit(f"{r.index if r.index >= 0 else '':>4} {r.primitive} at {r.source or '?'}{times}: "
                                  f"{what}", 0))
        return "\n".join(lines + self._totals_lines())


MEMORY_FIELDS = ("argument", "output", "temp", "alias", "generated_code")  # memory_analysis()'s *_size_in_bytes
HOST_MEMORY_FIELDS = ("host_argument", "host_output", "host_temp")  # recorded where XLA reports them (not zero)
FEW_VALUES = 12  # more inputs (or outputs) than this are summarised by sharding in the compact view
FEW_ROWS = 10  # more communicating rows than this get a line per source and collectives in the compact view


def _summary(values: list[ValueInfo]) -> str:
    """"63: 40 split over model, 23 replicated (no annotation or sharded neighbour reached it)", with the values
    that cross the program boundary in another sharding named."""
    split: collections.Counter = collections.Counter()
    why: collections.Counter = collections.Counter()
    for v in values:
        axes = [a for d in v.planned.dims for a in d]
        if axes:
            split["*".join(dict.fromkeys(axes))] += 1
        else:
            reason = v.origin.removeprefix("replicated: ").split(" at ")[0] if v.origin else "replicated"
            why[reason] += 1
    parts = [f"{n} split over {axes}" for axes, n in split.most_common()]
    if why:
        parts.append(f"{sum(why.values())} replicated (" + "; ".join(
            f"{n}: {reason}" if len(why) > 1 else reason for reason, n in why.most_common()) + ")")
    crossing = [v.name for v in values if v.boundary != v.planned]
    text = f"{len(values)}: " + ", ".join(parts)
    if crossing:
        text += f"; {len(crossing)} cross the boundary in another sharding: " + ", ".join(crossing[:4]) + \
            (", ..." if len(crossing) > 4 else "")
    return text


def _fit(text: str, indent: int) -> str:
    """text wrapped to WIDTH columns, continuation lines indented."""
    return "\n".join(textwrap.wrap(text, WIDTH, initial_indent=" " * indent, subsequent_indent=" " * (indent + 4),
                                   break_long_words=True, break_on_hyphens=False)) or " " * indent
