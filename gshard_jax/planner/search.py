"""gs.plan(): enumerate, screen, plan the best for real, rank, and say why.

Every mesh factorisation and training option is screened by formula (estimate.py), over every order of its
axes; what cannot run is rejected with one reason. The `verify` fastest distinct configurations are then
planned by the partitioner on an abstract mesh (predict.py): their communication and argument memory are
the planned program's, and the final ranking is theirs.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import time
from typing import Optional, Sequence

import ml_collections

from . import estimate as E
from . import predict as PR
from . import space as SP
from .hardware import Hardware, scaled

GiB = 1024 ** 3


@dataclasses.dataclass
class Ranked:
    candidate: SP.Candidate
    estimate: E.Estimate
    orders: int = 1  # axis orders tried; the others were slower
    comms: list = dataclasses.field(default_factory=list)  # the partitioner's collectives (planned ones only)
    report: Optional[object] = None  # the partition report of the planned step (planned ones only)

    def to_dict(self) -> dict:
        return {**self.candidate.to_dict(), **self.estimate.to_dict(), "orders_tried": self.orders,
                "overrides": self.candidate.overrides()}


@dataclasses.dataclass
class Plan:
    """The planner's answer: ranked candidates (best first), rejections with one reason each, and why."""
    config: str
    devices: int
    hardware: Hardware
    memory_budget: float  # bytes per device
    shape: SP.ModelShape
    ranked: list[Ranked]
    screened: list[Ranked]  # every feasible candidate by formula, fastest first
    rejections: list[tuple]  # (Candidate or mesh name, kind of reason, reason)
    sensitivity: dict  # bandwidth factor -> the top candidates' keys in their new order
    dominated: int = 0  # candidates not evaluated: a lighter remat or fewer microbatches of theirs fits
    seconds: float = 0.0  # time the search took (not in the JSON: the plan is deterministic)

    @functools.cached_property
    def rejected(self) -> list[tuple[str, str, str]]:
        """(candidate key or mesh, kind of reason, reason) per rejection (keys named when first asked for)."""
        return [(c if isinstance(c, str) else c.key, kind, reason) for c, kind, reason in self.rejections]

    @property
    def best(self) -> Ranked:
        if not self.ranked:
            raise ValueError(f"no configuration of {self.devices} devices runs {self.config} within "
                             f"{self.memory_budget / GiB:.1f} GiB per device; see the rejections")
        return self.ranked[0]

    def why(self) -> list[str]:
        """The largest differences between the best candidate and the runner-up."""
        if len(self.ranked) < 2:
            return ["the only candidate left"]
        a, b = self.ranked[0], self.ranked[1]
        fields = [f"{k}: {v} vs {w}" for k, v, w in (
            ("mesh", a.candidate.key.split()[0], b.candidate.key.split()[0]),
            ("zero", a.candidate.zero_stage, b.candidate.zero_stage),
            ("microbatches", a.candidate.microbatches, b.candidate.microbatches),
            ("schedule", a.candidate.schedule, b.candidate.schedule),
            ("remat", a.candidate.remat, b.candidate.remat)) if v != w]
        parts = {"compute": (a.estimate.compute, b.estimate.compute),
                 "bubble": (a.estimate.bubble, b.estimate.bubble),
                 "overlap": (-a.estimate.overlap, -b.estimate.overlap)}
        for k in set(a.estimate.comm) | set(b.estimate.comm):
            parts[k] = (a.estimate.comm.get(k, 0.0), b.estimate.comm.get(k, 0.0))
        diffs = sorted(((x - y, k) for k, (x, y) in parts.items() if x != y), key=lambda t: (t[0], t[1]))
        lines = [f"vs #2 ({b.candidate.key}): {a.estimate.step * 1e3:.2f} ms against {b.estimate.step * 1e3:.2f} ms"
                 + (f"; differs in {', '.join(fields)}" if fields else "")]
        for d, k in diffs[:3]:
            if d < 0:
                lines.append(f"  {k}: {-d * 1e3:.3f} ms less")
        for d, k in sorted(diffs, key=lambda t: -t[0])[:1]:
            if d > 0:
                lines.append(f"  {k}: {d * 1e3:.3f} ms more (outweighed)")
        ma, mb = a.estimate.memory["total"], b.estimate.memory["total"]
        lines.append(f"  memory: {ma / GiB:.2f} GiB against {mb / GiB:.2f} GiB per device "
                     f"(budget {self.memory_budget / GiB:.1f} GiB)")
        return lines

    def rejection_counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for _, kind, _ in self.rejections:
            out[kind] = out.get(kind, 0) + 1
        return dict(sorted(out.items()))

    def to_dict(self) -> dict:
        return {"config": self.config, "devices": self.devices, "hardware": self.hardware.to_dict(),
                "memory_budget_bytes": self.memory_budget, "model": dataclasses.asdict(self.shape),
                "ranked": [r.to_dict() for r in self.ranked], "why": self.why(),
                "screened": len(self.screened), "rejected": [{"candidate": k, "kind": kind, "reason": r} for k, kind, r in self.rejected],
                "rejection_counts": self.rejection_counts(), "dominated": self.dominated,
                "sensitivity": self.sensitivity}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    def __str__(self) -> str:
        hw, lines = self.hardware, []
        lines.append(f"plan for {self.config} on {self.devices} x {hw.name} ({hw.devices_per_node} per node, "
                     f"{hw.peak_flops / 1e12:.0f} TFLOP/s x {hw.efficiency:.0%}), memory budget "
                     f"{self.memory_budget / GiB:.1f} GiB per device; {len(self.screened)} feasible by formula, "
                     f"{len(self.ranked)} planned by the partitioner, {len(self.rejections)} rejected, {self.dominated} "
                     f"dominated"
                     + (f" ({self.seconds:.1f} s)" if self.seconds else ""))
        for i, r in enumerate(self.ranked, 1):
            e = r.estimate
            lines.append(f"#{i} {r.candidate.key}: step {e.step * 1e3:.2f} ms = compute {e.compute * 1e3:.2f} + "
                         f"bubble {e.bubble * 1e3:.2f} + comm {e.comm_total * 1e3:.2f} - overlap "
                         f"{e.overlap * 1e3:.2f}; memory {e.memory['total'] / GiB:.2f} GiB")
            for k, t in sorted(e.comm.items(), key=lambda kv: -kv[1])[:4]:
                lines.append(f"     {k} {t * 1e3:.3f} ms")
        if self.ranked:
            lines.append("why #1: " + "\n".join(self.why()))
            lines.append("run it: gshard-jax train --config " + self.config + " " + " ".join(self.best.candidate.overrides()))
        for f, keys in self.sensitivity.items():
            moved = "unchanged" if keys == [r.candidate.key for r in self.ranked] else " > ".join(keys[:3])
            lines.append(f"bandwidths x{f}: ranking {moved}")
        lines.append("rejected: " + ", ".join(f"{k} {n}" for k, n in self.rejection_counts().items()))
        near = sorted((x for x in self.rejections if x[1] == "over memory"), key=lambda x: _excess(x[2]))[:3]
        near = [(c if isinstance(c, str) else c.key, kind, reason) for c, kind, reason in near]
        for k, _, reason in near:
            lines.append(f"  {k}: {reason}")
        return "\n".join(lines)


def _excess(reason: str) -> float:
    return float(reason.split("by ")[1].split(" GiB")[0])


def _heuristic_order(c: SP.Candidate, comms) -> tuple:
    """The axes ordered so that those moving the most bytes sit innermost (the fast levels)."""
    moved = {a: 0.0 for a, _ in c.mesh}
    for cm in comms:
        for a in cm.axes:
            if a in moved:
                moved[a] += cm.moved
    return tuple(sorted(c.mesh, key=lambda an: (moved[an[0]], SP.AXES.index(an[0]))))


def _best_order(c: SP.Candidate, comms, compute: float, mem: dict, hw: Hardware,
                orders: Sequence) -> tuple[SP.Candidate, E.Estimate]:
    best = None
    for order in orders:
        cand = dataclasses.replace(c, mesh=order)
        est = E.combine(hw, cand, compute, comms, mem)
        if best is None or est.step < best[1].step - 1e-15:
            best = (cand, est)
    return best


def plan(cfg: ml_collections.ConfigDict, devices: int, hardware: Hardware, memory_gb: Optional[float] = None,
         top: int = 5, verify: Optional[int] = None, remats: Sequence[str] = SP.REMATS,
         zero_stages: Sequence[int] = SP.ZERO_STAGES, config_name: str = "config") -> Plan:
    """Rank the configurations of `devices` devices of `hardware` for config `cfg` (see module docstring)."""
    start = time.perf_counter()
    if devices < 1:
        raise ValueError(f"devices={devices}: expected a positive device count")
    budget = (memory_gb if memory_gb is not None else hardware.memory_gib) * GiB
    shape = SP.model_shape(cfg)
    screened: list[Ranked] = []
    rejected: list[tuple] = []
    dominated = 0
    for sizes in SP.factorizations(devices, SP.AXES):
        mesh_key = ".".join(f"{a}{n}" for a, n in sizes.items() if n > 1) or "one-device"
        reason = SP.mesh_reason(shape, sizes)
        if reason:
            rejected.append((mesh_key, reason.split(":")[0], reason))
            continue
        orders = SP.orders(sizes)
        fit: set = set()  # option groups in which a lighter candidate already fits the budget
        for fields, reason in SP.options(shape, sizes, remats, zero_stages):
            # Dominated, not evaluated: a heavier remat where a lighter one of the same options fits (more
            # compute, no less communication), or without stages more microbatches where fewer fit (no bubble
            # to cut; weights gathered per microbatch).
            same = (fields["zero_stage"], fields["epso"], fields["microbatches"], fields["schedule"],
                    fields["repeats"])
            fewer = (fields["zero_stage"], fields["epso"], fields["remat"]) if sizes["stage"] == 1 else None
            if same in fit or fewer in fit:
                dominated += 1
                continue
            c = SP.Candidate(orders[0], **fields)
            if reason:
                rejected.append((c, reason.split(":")[0], reason))
                continue
            mem = E.memory(shape, c)
            if mem["total"] > budget:
                rejected.append((c, "over memory", f"over memory by {(mem['total'] - budget) / GiB:.2f} GiB "
                                 f"({mem['total'] / GiB:.2f} GiB per device, formula)"))
                continue
            fit.add(same)
            if fewer is not None:
                fit.add(fewer)
            comms = E.collectives(shape, c)
            compute = E.compute_time(shape, c, hardware, devices)
            cand = SP.Candidate(_heuristic_order(c, comms), **fields)
            screened.append(Ranked(cand, E.combine(hardware, cand, compute, comms, mem), 1))
    screened.sort(key=lambda r: (r.estimate.step, r.estimate.memory["total"], r.candidate.order_key))
    ranked = _verify(cfg, shape, screened, max(verify if verify is not None else top, 0), hardware, budget,
                     rejected)
    ranked = ranked[:top] if top else ranked
    sensitivity = {}
    for factor in (0.5, 2.0):
        hw2 = scaled(hardware, factor)
        again = [(E.combine(hw2, r.candidate, r.estimate.compute, r.comms, r.estimate.memory).step, r.candidate.key)
                 for r in ranked]
        sensitivity[str(factor)] = [k for _, k in sorted(again)]
    out = Plan(config_name, devices, hardware, budget, shape, ranked, screened, rejected, sensitivity, dominated)
    out.seconds = time.perf_counter() - start
    return out


def _verify(cfg, shape, screened: list[Ranked], count: int, hw: Hardware, budget: float, rejected: list) -> list:
    """The `count` fastest screened candidates that the partitioner plans within the budget: communication and
    argument bytes of the planned step. One the model cannot build or the partitioner cannot plan is rejected
    with the error, and the next is taken (at most 3 x count tried)."""
    out = []
    for r in screened[:3 * count]:
        if len(out) == count:
            break
        try:
            report = PR.explain(cfg, r.candidate, hw)
        except (ValueError, TypeError, NotImplementedError) as e:
            rejected.append((r.candidate.key, "partitioner", f"partitioner: {str(e).splitlines()[0][:300]}"))
            continue
        comms = PR.comms(report)
        args = report.argument_bytes()
        mem = dict(r.estimate.memory)
        mem["params"], mem["optimizer"] = args.get("params", 0), args.get("optimizer", 0)
        mem["batch"] = args.get("batch", 0) + args.get("step", 0)  # the rest of the step's arguments
        mem["total"] = sum(v for k, v in mem.items() if k != "total")
        if mem["total"] > budget:
            rejected.append((r.candidate.key, "over memory", f"over memory by {(mem['total'] - budget) / GiB:.2f} GiB "
                                              f"({mem['total'] / GiB:.2f} GiB per device, planned)"))
            continue
        cand, est = _best_order(r.candidate, comms, r.estimate.compute, mem, hw, SP.orders(r.candidate.sizes))
        est.source = "partitioner"
        out.append(Ranked(cand, est, len(SP.orders(r.candidate.sizes)), comms, report))
    out.sort(key=lambda r: (r.estimate.step, r.estimate.memory["total"], r.candidate.order_key))
    return out
