"""What gs.plan() returns: each candidate ranked with its estimate, the rejected with their reasons, and how a
plan prints (a table, why the best, JSON)."""
from __future__ import annotations

import dataclasses
import functools
import json
import math
from typing import Optional

from ..partitioner.costs.hardware import Hardware
from . import estimate as E, space as SP

GiB = 1024 ** 3


@dataclasses.dataclass
class Ranked:
    candidate: SP.Candidate
    estimate: E.Estimate
    orders: int = 1  # axis orders tried; the others were slower
    comms: list = dataclasses.field(default_factory=list)  # the partitioner's collectives (planned ones only)
    formula_comm: Optional[float] = None  # the screen's communication seconds for it (planned ones)

    def mfu(self, shape: SP.ModelShape, hw: Hardware, devices: int) -> float:
        """Model flops utilisation of the predicted step: the model's flops (no recompute) over step x peak."""
        return E.model_flops_per_token(shape) * shape.tokens / (self.estimate.step * devices * hw.peak_flops)

    def to_dict(self) -> dict:
        return {**self.candidate.to_dict(), **self.estimate.to_dict(), "orders_tried": self.orders,
                "overrides": self.candidate.overrides(), "formula_comm_s": self.formula_comm,
                "exposed_comm_s": self.estimate.comm_total - self.estimate.overlap}


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
    dominated: int = 0  # candidates not evaluated: a lighter remat, fewer microbatches or data for context fits
    pruned: int = 0  # meshes not costed: their floor (bound.py) passes every configuration that may be planned
    pruned_groups: int = 0  # option groups (microbatches, schedule) of costed meshes not costed, by their floor
    floor_cut: float = math.inf  # the step a mesh's floor passed to be pruned (seconds)
    pinned: list = dataclasses.field(default_factory=list)  # (mesh sizes, formula rank, Ranked or None, why)
    own: Optional[dict] = None  # the config's own mesh section on these devices (pinned), where it resolves
    seconds: float = 0.0  # time the search took (not in the JSON: the plan is deterministic)

    @functools.cached_property
    def rejected(self) -> list[tuple[str, str, str]]:
        """(candidate key or mesh, kind of reason, reason) per rejection (keys named when first asked for)."""
        return [(rejected_key(c), kind, reason) for c, kind, reason in self.rejections]

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
        return self.compare(self.ranked[0], self.ranked[1], "#2")

    def compare(self, a: Ranked, b: Ranked, name: str) -> list[str]:
        """The largest differences between candidate a and candidate b (called `name`)."""
        fields = [f"{k}: {v} vs {w}" for k, v, w in (
            ("mesh", a.candidate.key.split()[0], b.candidate.key.split()[0]),
            ("zero", a.candidate.zero_stage, b.candidate.zero_stage),
            ("microbatches", a.candidate.microbatches, b.candidate.microbatches),
            ("schedule", a.candidate.schedule, b.candidate.schedule),
            ("remat", a.candidate.remat, b.candidate.remat),
            ("sequence parallel", a.candidate.sequence_parallel, b.candidate.sequence_parallel),
            ("offload", a.candidate.offload, b.candidate.offload)) if v != w]
        parts = {"compute": (a.estimate.compute, b.estimate.compute),
                 "bubble": (a.estimate.bubble, b.estimate.bubble),
                 "overlap": (-a.estimate.overlap, -b.estimate.overlap)}
        for k in set(a.estimate.comm) | set(b.estimate.comm):
            parts[k] = (a.estimate.comm.get(k, 0.0), b.estimate.comm.get(k, 0.0))
        diffs = sorted(((x - y, k) for k, (x, y) in parts.items() if x != y), key=lambda t: (t[0], t[1]))
        lines = [f"vs {name} ({b.candidate.key}): {a.estimate.step * 1e3:.2f} ms against {b.estimate.step * 1e3:.2f} ms"
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
        ha, hb = (x.estimate.memory.get("host_optimizer", 0.0) for x in (a, b))
        if ha or hb:
            lines.append(f"  host memory: {ha / GiB:.2f} GiB against {hb / GiB:.2f} GiB per device (offloaded "
                         f"optimizer state; {self.hardware.host_memory_gib:.0f} GiB available)")
        return lines

    def best_against(self, r: Ranked) -> list[str]:
        """Why #1 beats candidate r (or that r would rank first)."""
        a = self.ranked[0]
        if r.candidate == a.candidate:
            return ["it is #1"]
        if r.estimate.step < a.estimate.step:
            return [f"it would rank first: {r.estimate.step * 1e3:.2f} ms against #1's {a.estimate.step * 1e3:.2f}"]
        return ["#1 " + self.compare(a, r, "it")[0]] + self.compare(a, r, "it")[1:]

    def rejection_counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for _, kind, _ in self.rejections:
            out[kind] = out.get(kind, 0) + 1
        return dict(sorted(out.items()))

    def to_dict(self) -> dict:
        return {"config": self.config, "devices": self.devices, "hardware": self.hardware.to_dict(),
                "memory_budget_bytes": self.memory_budget, "model": dataclasses.asdict(self.shape),
                "ranked": [self._ranked_dict(r) for r in self.ranked], "why": self.why(),
                "screened": len(self.screened), **self._rejections_dict(),
                "rejection_counts": self.rejection_counts(), "dominated": self.dominated,
                "pruned_meshes": self.pruned, "pruned_option_groups": self.pruned_groups,
                "floor_cut_s": self.floor_cut if self.pruned or self.pruned_groups else None,
                "pinned": [{"mesh": m, "formula_rank": k, "formula_rank_exact": self._exact(k),
                            "planned": self._ranked_dict(r) if r else None, "why": w,
                            "own": self._is_own(m), "step_ratio_to_best": self._ratio(r)}
                           for m, k, r, w in self.pinned],
                "sensitivity": self.sensitivity}

    def _beyond(self, rank: Optional[int]) -> str:
        """What a pinned mesh's formula rank leaves out: pruned meshes could hold candidates above one slower
        than the cut."""
        return "" if self._exact(rank) else (
            f" or lower (candidates not costed, each slower than {self.floor_cut * 1e3:.2f} ms, may rank above it)")

    def _exact(self, rank: Optional[int]) -> bool:
        """Whether a formula rank among the costed candidates is the rank among all of them."""
        return rank is None or not (self.pruned or self.pruned_groups) or \
            self.screened[rank - 1].estimate.step <= self.floor_cut

    def _is_own(self, sizes: dict) -> bool:
        return self.own is not None and {a: 1 for a in SP.AXES} | dict(sizes) == self.own

    def _ratio(self, r: Optional[Ranked]) -> Optional[float]:
        """A pinned candidate's planned step over #1's."""
        return r.estimate.step / self.ranked[0].estimate.step if r is not None and self.ranked else None

    def _ranked_dict(self, r: Ranked) -> dict:
        return dict(r.to_dict(), mfu=r.mfu(self.shape, self.hardware, self.devices))

    # Rejections a person acts on are listed one by one in the JSON: whole meshes, candidates over the memory
    # budget, candidates the partitioner could not plan. The rest (a microbatch that does not split, a
    # schedule that does not fit: millions on a large machine) are counted per reason.
    LISTED = ("over memory", "partitioner")

    def _rejections_dict(self) -> dict:
        listed, counted = [], {}
        for c, kind, reason in self.rejections:
            if isinstance(c, str) or kind in self.LISTED:
                listed.append({"candidate": rejected_key(c), "kind": kind, "reason": reason})
            else:
                counted[reason] = counted.get(reason, 0) + 1
        return {"rejected": listed, "rejected_by_reason": dict(sorted(counted.items()))}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    def __str__(self) -> str:
        hw, lines = self.hardware, []
        lines.append(f"plan for {self.config} on {self.devices} x {hw.name} ({hw.devices_per_node} per node, "
                     f"{hw.peak_flops / 1e12:.0f} TFLOP/s x {hw.efficiency:.0%}), memory budget "
                     f"{self.memory_budget / GiB:.1f} GiB per device; {len(self.screened)} feasible by formula, "
                     f"{len(self.ranked)} planned by the partitioner, {len(self.rejections)} rejected, "
                     f"{self.dominated} dominated"
                     + (f", {self.pruned} meshes and {self.pruned_groups} option groups not costed (their floor "
                        f"passes {self.floor_cut * 1e3:.2f} ms)" if self.pruned or self.pruned_groups else "")
                     + (f" ({self.seconds:.1f} s)" if self.seconds else ""))
        for i, r in enumerate(self.ranked, 1):
            e = r.estimate
            lines.append(f"#{i} {r.candidate.key}: step {e.step * 1e3:.2f} ms = compute {e.compute * 1e3:.2f} + "
                         f"bubble {e.bubble * 1e3:.2f} + comm {e.comm_total * 1e3:.2f} - overlap "
                         f"{e.overlap * 1e3:.2f}; MFU {r.mfu(self.shape, hw, self.devices):.1%}; memory "
                         f"{e.memory['total'] / GiB:.2f} GiB")
            for k, t in sorted(e.comm.items(), key=lambda kv: -kv[1])[:4]:
                lines.append(f"     {k} {t * 1e3:.3f} ms")
        if self.ranked:
            lines.append("why #1: " + "\n".join(self.why()))
            lines.append("run it: gshard-jax train --config " + self.config + " " +
                         " ".join(self.best.candidate.overrides()))
        for sizes, rank, r, why in self.pinned:
            name = ("the config's own mesh " if self._is_own(sizes) else "pinned ") + ".".join(
                f"{a}{n}" for a, n in sizes.items() if n > 1)
            lines.append(f"{name}: " + "; ".join(why) if r is None else
                         f"{name}: its best variant ranks {rank}{self._beyond(rank)} of {len(self.screened)} by "
                         f"formula; "
                         f"planned {r.candidate.key}: step {r.estimate.step * 1e3:.2f} ms "
                         f"({self._ratio(r):.2f}x #1's), memory {r.estimate.memory['total'] / GiB:.2f} GiB")
            if r is not None and self.ranked:
                lines += ["  " + w for w in self.best_against(r)]
        for f, keys in self.sensitivity.items():
            moved = "unchanged" if keys == [r.candidate.key for r in self.ranked] else " > ".join(keys[:3])
            lines.append(f"bandwidths x{f}: ranking {moved}")
        lines.append("rejected: " + ", ".join(f"{k} {n}" for k, n in self.rejection_counts().items()))
        near = sorted((x for x in self.rejections if x[1] == "over memory"), key=lambda x: _excess(x[2]))[:3]
        near = [(rejected_key(c), kind, reason) for c, kind, reason in near]
        for k, _, reason in near:
            lines.append(f"  {k}: {reason}")
        return "\n".join(lines)


def rejected_key(c) -> str:
    """The key of a rejected candidate: a mesh name, a Candidate, or its fields not yet made one."""
    if isinstance(c, str):
        return c
    if isinstance(c, SP.Candidate):
        return c.key
    mesh, m, sched, r, zero, epso, remat, *offload = c  # (..., True): the same offloaded
    return SP.Candidate(mesh, zero, epso, m, sched, r, remat, offload=bool(offload and offload[0])).key


def _excess(reason: str) -> float:
    return float(reason.split("by ")[1].split(" GiB")[0])
