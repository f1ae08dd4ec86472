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
from typing import Mapping, Optional

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


@dataclasses.dataclass(frozen=True)
class HardwareProfile:
    """Bandwidth (bytes/s) and latency per mesh axis, and compute rate, of the target machine.

    Axes that cross nodes get AxoNN's hierarchical bandwidth: name them in
    ``axis_bandwidth`` with the inter-node figure divided as eq. 7 says.
    """

    name: str = "generic-accelerator"
    bandwidth: float = 100e9
    latency: float = 5e-6
    flops: float = 100e12
    axis_bandwidth: Mapping[str, float] = dataclasses.field(default_factory=dict)
    # Whether a collective runs while a matmul computes (GPU/TPU: separate streams or DMA engines). Only then
    # does a collective matmul's ring hide its permutes behind the matmul's blocks.
    overlap: bool = True
    # Whether device memory is a concern: then a windowed op (convolution, pooling, pad, slice) never gathers
    # a split dim where a halo exchange can keep it split, however few bytes the gather would save time on.
    memory_matters: bool = True
    # The backend whose wire format collectives are counted in on a mesh without devices (an AbstractMesh):
    # "cpu" sends bf16 as f32 (WIDENED_ON); a mesh of devices uses its devices' platform.
    platform: str = ""

    def bandwidth_of(self, axes) -> float:
        """The slowest link among `axes` (a sub-axis "model:(1)2" has its axis's)."""
        from .subaxes import parent_of  # subaxes imports the program view, which needs nothing of this module
        return min((self.axis_bandwidth.get(a, self.axis_bandwidth.get(parent_of(a), self.bandwidth))
                    for a in axes), default=self.bandwidth)


DEFAULT_PROFILE = HardwareProfile()
# Simulated CPU devices: the same figures, but XLA:CPU runs a collective and a matmul one after the other.
CPU_PROFILE = dataclasses.replace(DEFAULT_PROFILE, name="cpu-simulation", overlap=False, platform="cpu")


def platform_of(mesh, profile: Optional[HardwareProfile] = None) -> str:
    """The platform of a mesh's devices; for an AbstractMesh (no devices) the profile's."""
    from jax.sharding import Mesh
    if isinstance(mesh, Mesh):
        return mesh.devices.flat[0].platform
    return profile.platform if profile is not None else ""


def default_profile(platform: str) -> HardwareProfile:
    """The profile a mesh of `platform` devices gets when none is given."""
    return CPU_PROFILE if platform == "cpu" else DEFAULT_PROFILE


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

    @property
    def moved(self) -> float:
        return moved_bytes(self.kind, self.payload, self.group)

    def time(self, profile: Optional[HardwareProfile] = None) -> float:
        """Launch + latency of a tree/recursive-doubling schedule + ring bandwidth term.

        The latency term grows with log2 of the group (what collective
        libraries achieve for small messages); the launch term makes two
        collectives cost more than one with the same bytes.
        """
        profile = profile or DEFAULT_PROFILE
        if self.group <= 1:
            return 0.0
        return latency_steps(self.kind, self.group) * profile.latency + self.moved / profile.bandwidth_of(self.axes)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "axes": list(self.axes), "group": self.group, "payload_bytes": self.payload,
                "moved_bytes": self.moved, "shape": list(self.shape), "dtype": self.dtype, "note": self.note}

    def __str__(self) -> str:
        return f"{self.kind}[{','.join(self.axes)}] {_fmt_bytes(self.payload)}"


# Element types a backend does not exchange natively: XLA:CPU converts bf16 collectives to f32 and back
# (float normalisation), so they carry twice the bytes; GPU and TPU send bf16 as it is.
WIDENED_ON = {"cpu": {"bfloat16": "float32"}}


def on_the_wire(c: Collective, platform: str) -> Collective:
    """The collective as `platform` sends it, so the report's bytes equal the compiled program's."""
    wide = WIDENED_ON.get(platform, {}).get(c.dtype)
    if wide is None:
        return c
    note = f"{c.dtype} sent as {wide} on {platform}"
    return dataclasses.replace(c, payload=c.payload * 2, dtype=wide, note=f"{c.note}; {note}" if c.note else note)


def compute_time(work: float, profile: Optional[HardwareProfile] = None) -> float:
    return work / (profile or DEFAULT_PROFILE).flops


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n}"
