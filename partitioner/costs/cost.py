"""Alpha-beta cost model of collectives (ring algorithms; AxoNN eqs. 1-7, GShard appendix).

``payload`` is the per-device size of the collective's full buffer: the
gathered result of an all-gather, the unreduced operand of a reduce-scatter,
the (equal) operand/result of an all-reduce, all-to-all or collective-permute.
``moved`` is what a ring algorithm sends per device. Both are computed the same
way from the compiled HLO (partitioner.hlo), so predictions can be checked.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

from . import compilers
from .hardware import GENERIC, Hardware

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")


def moved_bytes(kind: str, payload: int, group: int) -> float:
    """Bytes one device sends for a collective over `group` devices (ring algorithms)."""
    if group <= 1:
        return 0.0
    if kind == "collective-permute":
        return float(payload)
    frac = (group - 1) / group
    if kind == "all-reduce":
        return 2 * frac * payload
    if kind in ("all-gather", "all-to-all", "reduce-scatter"):
        return frac * payload
    raise KeyError(kind)


def platform_of(mesh, profile: Optional[Hardware] = None) -> str:
    """The platform of a mesh's devices; for an AbstractMesh (no devices) the profile's."""
    from jax.sharding import Mesh
    if isinstance(mesh, Mesh):
        return mesh.devices.flat[0].platform
    return profile.platform if profile is not None else ""


def latency_steps(kind: str, group: int) -> int:
    """Latencies one collective over `group` devices pays: a launch, then one step for a permute or log2 of the
    group for a tree/recursive-doubling schedule (what libraries achieve for small messages)."""
    return 1 + (1 if kind == "collective-permute" else math.ceil(math.log2(group)))


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str
    axes: tuple[str, ...]
    group: int
    payload: int
    shape: tuple[int, ...] = ()
    dtype: str = ""
    note: str = ""
    # times it runs per run of its row: a collective inside a scanned loop of a manual region's body (ring
    # attention's fori_loop) runs the loop's length times, where the HLO lists it once
    runs: int = 1

    @property
    def moved(self) -> float:
        return moved_bytes(self.kind, self.payload, self.group)

    def time(self, profile: Optional[Hardware] = None) -> float:
        """Launch + latency of a tree/recursive-doubling schedule + ring bandwidth term.

        The latency term grows with log2 of the group (what collective
        libraries achieve for small messages); the launch term makes two
        collectives cost more than one with the same bytes.
        """
        profile = profile or GENERIC
        if self.group <= 1:
            return 0.0
        one = latency_steps(self.kind, self.group) * profile.latency + self.moved / profile.bandwidth_of(self.axes)
        return self.runs * one

    def to_dict(self) -> dict:
        return {"kind": self.kind, "axes": list(self.axes), "group": self.group, "payload_bytes": self.payload,
                "moved_bytes": self.moved, "shape": list(self.shape), "dtype": self.dtype, "note": self.note,
                "runs": self.runs}

    def __str__(self) -> str:
        runs = f" x{self.runs} in a loop" if self.runs > 1 else ""
        return f"{self.kind}[{','.join(self.axes)}] {_fmt_bytes(self.payload)}{runs}"


def on_the_wire(c: Collective, platform: str) -> Collective:
    """The collective as `platform` sends it, so the report's bytes equal the compiled program's: XLA:CPU
    converts bf16 collectives to f32 and back (compilers.Habits.widened), XLA:GPU and XLA:TPU send them as
    they are."""
    wide = compilers.of(platform).widened.get(c.dtype)
    if wide is None:
        return c
    note = f"{c.dtype} sent as {wide} on {platform}"
    return dataclasses.replace(c, payload=c.payload * 2, dtype=wide, note=f"{c.note}; {note}" if c.note else note)


def compute_time(work: float, profile: Optional[Hardware] = None) -> float:
    return work / (profile or GENERIC).flops


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n}"
