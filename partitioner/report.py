"""The partitioner's account of itself: one row per equation, with totals (explain())."""
from __future__ import annotations

import collections
import dataclasses
import html
import json
from typing import Optional

from .cost import Collective, HardwareProfile, KINDS, _fmt_bytes


@dataclasses.dataclass
class Row:
    index: int
    source: str
    primitive: str
    operands: list[str]  # "actual -> required" per operand
    outputs: list[str]  # "produced -> planned" per result
    strategy: str
    collectives: list[Collective]
    origins: list[str]
    fallback: Optional[str] = None
    compute_time: float = 0.0
    comm_time: float = 0.0
    trips: int = 1  # times the row runs per call (a scan body's length); a while body counts once

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["collectives"] = [c.to_dict() for c in self.collectives]
        return d


@dataclasses.dataclass
class Report:
    mesh: dict
    profile: HardwareProfile
    rows: list[Row] = dataclasses.field(default_factory=list)
    inputs: list[str] = dataclasses.field(default_factory=list)
    outputs: list[str] = dataclasses.field(default_factory=list)

    @property
    def collectives(self) -> list[Collective]:
        return [c for r in self.rows for c in r.collectives]

    @property
    def fallbacks(self) -> list[Row]:
        return [r for r in self.rows if r.fallback]

    def totals(self, dynamic: bool = False) -> dict:
        """Per collective kind: count, payload bytes and moved bytes per device.

        Static (default): each collective once, as the compiled HLO lists it.
        dynamic=True: multiplied by the trip count of the scan bodies it is in.
        """
        out = {k: {"count": 0, "payload_bytes": 0, "moved_bytes": 0.0} for k in KINDS}
        for r in self.rows:
            n = r.trips if dynamic else 1
            for c in r.collectives:
                t = out[c.kind]
                t["count"] += n
                t["payload_bytes"] += c.payload * n
                t["moved_bytes"] += c.moved * n
        return out

    @property
    def comm_time(self) -> float:
        return sum(r.comm_time * r.trips for r in self.rows)

    @property
    def compute_time(self) -> float:
        return sum(r.compute_time * r.trips for r in self.rows)

    def to_json(self, **kw) -> str:
        return json.dumps({
            "mesh": self.mesh, "profile": dataclasses.asdict(self.profile), "inputs": self.inputs,
            "outputs": self.outputs, "rows": [r.to_dict() for r in self.rows], "totals": self.totals(),
            "totals_per_call": self.totals(dynamic=True),
            "predicted_comm_time_s": self.comm_time, "predicted_compute_time_s": self.compute_time,
            "fallbacks": [r.index for r in self.fallbacks]}, default=str, **kw)

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
                        f"<td>{esc(' '.join(r.operands))}</td><td>{esc(' '.join(r.outputs))}</td><td>{strategy}</td>"
                        f"<td>{coll}</td><td>{esc('; '.join(r.origins))}</td></tr>")
        totals = "".join(f"<tr><td>{k}</td><td>{t['count']}</td><td>{t['payload_bytes']}</td><td>{t['moved_bytes']:.0f}</td></tr>"
                         for k, t in self.totals().items() if t["count"])
        io = "".join(f"<li>input {i}: {esc(x)}</li>" for i, x in enumerate(self.inputs)) + \
            "".join(f"<li>output {i}: {esc(x)}</li>" for i, x in enumerate(self.outputs))
        return (f"<!doctype html><html><head><meta charset='utf-8'><title>gshard_jax partition report</title>"
                f"<style>table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;padding:2px 6px;"
                f"font:12px monospace;vertical-align:top}}.fallback{{background:#fdd}}</style></head><body>"
                f"<h1>Partition report</h1><p>mesh {esc(str(self.mesh))}, profile {esc(self.profile.name)}</p>"
                f"<ul>{io}</ul><table><tr>{''.join(f'<th>{c}</th>' for c in cells)}</tr>{''.join(rows)}</table>"
                f"<h2>Totals per device</h2><table><tr><th>kind</th><th>count</th><th>payload bytes</th>"
                f"<th>moved bytes</th></tr>{totals}</table><p>predicted communication {self.comm_time * 1e6:.3g}us"
                f" per call; fallbacks: {len(self.fallbacks)}</p></body></html>")

    def __str__(self) -> str:
        lines = [f"gshard_jax partition report  mesh={self.mesh}  profile={self.profile.name}"]
        lines += [f"  input  {i}: {s}" for i, s in enumerate(self.inputs)]
        lines += [f"  output {i}: {s}" for i, s in enumerate(self.outputs)]
        header = f"{'#':>4} {'primitive':<20} {'operands (have -> need)':<44} {'result (made -> planned)':<30} " \
                 f"{'strategy':<34} collectives"
        lines += [header, "-" * len(header)]
        for r in self.rows:
            coll = "; ".join(f"{c} ({c.time(self.profile) * 1e6:.1f}us)" for c in r.collectives) or "-"
            flag = f"  FALLBACK: {r.fallback}" if r.fallback else ""
            lines.append(f"{r.index:>4} {r.primitive:<20} {' '.join(r.operands):<44} {' '.join(r.outputs):<30} "
                         f"{r.strategy:<34} {coll}{flag}")
            lines.append(f"{'':>4}   at {r.source or '?'}; result from: {'; '.join(r.origins)}")
        lines.append("totals per device:")
        counts = collections.Counter()
        for kind, t in self.totals().items():
            if t["count"]:
                counts[kind] = t["count"]
                lines.append(f"  {kind:<20} x{t['count']:<4} payload {_fmt_bytes(t['payload_bytes']):>10}  "
                             f"moved {_fmt_bytes(t['moved_bytes']):>10}")
        if not counts:
            lines.append("  no communication")
        lines.append(f"  predicted communication {self.comm_time * 1e6:.3g}us, compute {self.compute_time * 1e6:.3g}us "
                     f"per call; fallbacks: {len(self.fallbacks)}")
        return "\n".join(lines)
