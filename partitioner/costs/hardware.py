"""The one model of the machine: compute peak, memory, and bandwidth by level and placement. explain() costs
and decides a program on one (its default: `default_for` the mesh's platform), the planner ranks candidates on
one, and training's MFU divides by its peak.

Communication follows AxoNN's hierarchical model, generalised. Mesh axes are laid out over the devices
outermost first, so an axis's devices are `stride` apart, where `stride` is the product of the sizes of the
axes inside it. A collective over a group of axes stays inside a node when its devices span no more than one
node: it runs at the measured intra-node bandwidth for (inner product, group size) when the profile has a
table, else at `intra_bandwidth`. A group that crosses nodes shares each node's link with the other groups
of that node (AxoNN's eq. 7): beta = inter_bandwidth / min(devices_per_node, inner product).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
from typing import Mapping, Optional, Sequence

from ..representation.subaxes import parent_of

GB = 1e9


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One accelerator type and the network between them (figures per device unless noted)."""

    name: str
    platform: str  # "gpu", "tpu" or "cpu": the wire format of collectives (XLA:CPU sends bf16 as f32)
    devices_per_node: int  # devices sharing a node's fast interconnect (a TPU pod slice's ICI: all of them)
    peak_flops: float  # dense bf16 matmul flop/s of one device
    efficiency: float  # fraction of peak a train step's compute reaches (model flops utilisation at no comm)
    memory_gib: float  # device memory; the default memory budget
    intra_bandwidth: float  # bytes/s a device sends inside a node (where no table entry applies)
    inter_bandwidth: float  # bytes/s one node sends to other nodes (all its NICs together)
    latency: float = 10e-6  # seconds per step of a collective (launch and synchronisation)
    # Whether collectives run asynchronously beside compute (GPU and TPU runtimes with XLA's latency-hiding
    # scheduler). Which collectives a step then hides is the planned program's (partitioner/costs/overlap.py).
    overlap: bool = False
    # Measured intra-node bandwidth in GB/s: rows (ip_min, ip_max, size_min, size_max, GB/s); 0 as a max means
    # no upper bound. The first row that contains (inner product, group size) applies.
    table: tuple = ()
    source: str = ""  # where the figures come from
    host_bandwidth: float = 25 * GB  # bytes/s one device moves to or from host memory (PCIe): offloaded state
    host_memory_gib: float = 0.0  # host memory per device for offloaded optimizer state (0: no offload)
    # Bytes/s of host memory one device's offloaded optimizer update streams through the host's cores (the
    # state read and written, the gradients read): assumed, a share of a two-socket host's DRAM bandwidth.
    host_update_bandwidth: float = 20 * GB
    # Whether device memory is a concern to the partitioner: then a windowed op (convolution, pooling, pad,
    # slice) never gathers a split dim where a halo exchange keeps it split, however much time a gather saves.
    memory_matters: bool = True
    # Lower-case pieces of jax.Device.device_kind that name this profile's device ("h100" in "NVIDIA H100 80GB
    # HBM3"): which peak a run's MFU divides by (`for_device`).
    device_kinds: tuple = ()
    # The mesh the profile is placed on, axes outermost first (`placed`): what bandwidth_of reads placement from.
    order: tuple = ()

    @classmethod
    def uniform(cls, name: str, bandwidth: float, flops: float, latency: float = 5e-6, overlap: bool = True,
                platform: str = "", memory_gib: float = 16.0) -> "Hardware":
        """A one-level machine: every collective at `bandwidth` bytes/s per device, compute at `flops`."""
        return cls(name, platform, devices_per_node=1 << 30, peak_flops=flops, efficiency=1.0,
                   memory_gib=memory_gib, intra_bandwidth=bandwidth, inter_bandwidth=bandwidth, latency=latency,
                   overlap=overlap, source="uniform")

    @property
    def flops(self) -> float:
        """flop/s a device computes at in a step: peak x efficiency (the partitioner's compute time)."""
        return self.peak_flops * self.efficiency

    def placed(self, mesh_shape: Mapping[str, int]) -> "Hardware":
        """This profile with the mesh's axes laid over its devices, outermost first."""
        return dataclasses.replace(self, order=tuple(mesh_shape.items()))

    @functools.cached_property
    def _bandwidths(self) -> dict:
        return {}

    def bandwidth_of(self, axes: Sequence[str]) -> float:
        """bytes/s per device of a collective over `axes` of the placed mesh (a sub-axis "model:(1)2" at its
        axis's placement); a profile placed on no mesh gives its intra-node bandwidth."""
        key = tuple(axes)
        got = self._bandwidths.get(key)
        if got is None:
            got = axes_bandwidth(self, self.order, tuple(dict.fromkeys(parent_of(a) for a in key)))
            got = self._bandwidths[key] = self.intra_bandwidth if got == math.inf else got
        return got

    def table_bandwidth(self, ip: int, size: int) -> Optional[float]:
        """bytes/s the table gives a group of `size` devices `ip` apart, None without an entry."""
        for ip_lo, ip_hi, s_lo, s_hi, gbps in self.table:
            if ip_lo <= ip and (ip_hi == 0 or ip <= ip_hi) and s_lo <= size and (s_hi == 0 or size <= s_hi):
                return gbps * GB
        return None

    def group_bandwidth(self, size: int, ip: int, span: int) -> float:
        """bytes/s per device of a collective over `size` devices, `ip` apart, spanning `span` devices."""
        if span <= self.devices_per_node:
            found = self.table_bandwidth(ip, size)
            return found if found is not None else self.intra_bandwidth
        return self.inter_bandwidth / min(self.devices_per_node, max(ip, 1))

    def to_dict(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "order"}


def placement(order: Sequence[tuple[str, int]]) -> dict[str, tuple[int, int]]:
    """Per mesh axis (listed outermost first), (size, stride): its devices are `stride` apart."""
    out, stride = {}, 1
    for name, size in reversed(list(order)):
        out[name] = (size, stride)
        stride *= size
    return out


@functools.lru_cache(maxsize=1 << 16)
def axes_bandwidth(hw: Hardware, order: tuple[tuple[str, int], ...], axes: tuple[str, ...]) -> float:
    """bytes/s per device of a collective over `axes` of a mesh laid out in `order` (outermost first)."""
    where = placement(order)
    group = [a for a in axes if where.get(a, (1, 1))[0] > 1]
    if not group:
        return math.inf
    size = math.prod(where[a][0] for a in group)
    inner = min(where[a][1] for a in group)  # devices of one group this far apart at the closest
    span = max(where[a][0] * where[a][1] for a in group)  # devices from a group's first to past its last
    return hw.group_bandwidth(size, inner, span)


# explain()'s profiles when none is given: a generic accelerator's ratios of bandwidth, latency and compute,
# which decide the partition. Simulated CPU devices decide with the same ratios, so tests partition the
# programs an accelerator runs; only overlap differs (XLA:CPU runs a collective between ops).
GENERIC = dataclasses.replace(Hardware.uniform("generic-accelerator", bandwidth=100 * GB, flops=100e12),
                              source="explain()'s default: one level at 100 GB/s, 5 us, 100 TFLOP/s, overlapped")
GENERIC_CPU = dataclasses.replace(GENERIC, name="generic-cpu", platform="cpu", overlap=False,
                                  source="explain()'s default on CPU meshes: the generic ratios, no overlap")


def default_for(platform: str) -> Hardware:
    """The profile a program on `platform` devices is decided and costed on when none is given."""
    return GENERIC_CPU if platform == "cpu" else dataclasses.replace(GENERIC, platform=platform)


# Nominal figures from vendor data sheets and the papers the planner reproduces (seed 001: Aurora; seed 003:
# AxoNN's Perlmutter table; GShard: TPU v3). Measure yours and pass a JSON profile (`from_json`).
PROFILES: dict[str, Hardware] = {h.name: h for h in (
    GENERIC, GENERIC_CPU,
    Hardware("cpu-simulation", "cpu", devices_per_node=8, peak_flops=50e9, efficiency=0.5, memory_gib=2.0,
             intra_bandwidth=10 * GB, inter_bandwidth=10 * GB, latency=20e-6, overlap=False,
             source="this project's simulated CPU devices: one host, collectives run between matmuls",
             host_bandwidth=10 * GB, host_memory_gib=2.0, device_kinds=("cpu",)),
    Hardware("h100-8", "gpu", devices_per_node=8, peak_flops=989e12, efficiency=0.5, memory_gib=80.0,
             intra_bandwidth=450 * GB, inter_bandwidth=400 * GB, latency=10e-6, overlap=True,
             source="8 H100 SXM per node, NVLink 4 (450 GB/s per direction per GPU), 8 x 400 Gb/s InfiniBand; "
                    "PCIe 5 x16 to 2 TB of host memory", host_bandwidth=50 * GB, host_memory_gib=200.0,
             device_kinds=("h100",)),
    Hardware("h200-8", "gpu", devices_per_node=8, peak_flops=989e12, efficiency=0.5, memory_gib=141.0,
             intra_bandwidth=450 * GB, inter_bandwidth=400 * GB, latency=10e-6, overlap=True,
             source="8 H200 SXM per node (an H100's compute with 141 GB of HBM3e), NVLink 4, 8 x 400 Gb/s "
                    "InfiniBand; PCIe 5 x16 to 2 TB of host memory", host_bandwidth=50 * GB, host_memory_gib=200.0,
             device_kinds=("h200",)),
    Hardware("perlmutter-a100", "gpu", devices_per_node=4, peak_flops=312e12, efficiency=0.5, memory_gib=40.0,
             intra_bandwidth=76 * GB, inter_bandwidth=100 * GB, latency=10e-6, overlap=True,
             table=((1, 1, 2, 2, 76.0), (1, 1, 4, 4, 225.0), (1, 1, 8, 0, 80.0), (2, 2, 2, 2, 76.0),
                    (2, 2, 4, 0, 40.0), (4, 0, 1, 0, 20.0)),
             source="Perlmutter: 4 A100 40GB per node, NVLink 3, 4 x 200 Gb/s Slingshot; AxoNN's measured table; "
                    "PCIe 4 x16 to 256 GB of host memory", host_bandwidth=25 * GB, host_memory_gib=60.0,
             device_kinds=("a100",)),
    Hardware("tpu-v3", "tpu", devices_per_node=2048, peak_flops=61.5e12, efficiency=0.5, memory_gib=16.0,
             intra_bandwidth=70 * GB, inter_bandwidth=70 * GB, latency=5e-6, overlap=True,
             source="TPU v3 cores (2 per chip, 123 TFLOP/s bf16 per chip, 16 GiB HBM per core); a pod's 2D "
                    "torus ICI is one level; about 40 GiB of host memory per core over PCIe 3",
             host_bandwidth=10 * GB, host_memory_gib=40.0, device_kinds=("tpu v3",)),
    Hardware("aurora-pvc", "gpu", devices_per_node=12, peak_flops=419e12, efficiency=0.4, memory_gib=64.0,
             intra_bandwidth=100 * GB, inter_bandwidth=200 * GB, latency=10e-6, overlap=True,
             source="Aurora: 6 Max 1550 GPUs of 2 tiles per node (12 tiles, 64 GiB each), Xe Link, "
                    "8 x 200 Gb/s Slingshot; PCIe 5 per GPU shared by its 2 tiles, 1 TB of DDR5 per node",
             host_bandwidth=25 * GB, host_memory_gib=80.0, device_kinds=("max 1550",)),
)}


def for_device(device_kind: str) -> Optional[Hardware]:
    """The built-in profile of a jax.Device.device_kind ("NVIDIA H100 80GB HBM3" -> h100-8), None if none
    names it."""
    kind = device_kind.lower()
    for hw in PROFILES.values():
        if any(piece in kind for piece in hw.device_kinds):
            return hw
    return None


def from_json(path: str) -> Hardware:
    """A user profile: a JSON object with Hardware's fields (name, platform, devices_per_node, ...)."""
    with open(path) as f:
        raw = json.load(f)
    fields = {f.name for f in dataclasses.fields(Hardware)} - {"order"}
    unknown = sorted(set(raw) - fields)
    if unknown:
        raise ValueError(f"hardware profile {path}: unknown fields {unknown}; expected {sorted(fields)}")
    missing = sorted(f.name for f in dataclasses.fields(Hardware)
                     if f.default is dataclasses.MISSING and f.name not in raw)
    if missing:
        raise ValueError(f"hardware profile {path}: missing fields {missing}")
    raw["table"] = tuple(tuple(r) for r in raw.get("table", ()))
    raw["device_kinds"] = tuple(raw.get("device_kinds", ()))
    return Hardware(**raw)


def get(name_or_path: str) -> Hardware:
    """A built-in profile by name, or a JSON file's."""
    if name_or_path in PROFILES:
        return PROFILES[name_or_path]
    if name_or_path.endswith(".json"):
        return from_json(name_or_path)
    raise ValueError(f"hardware profile {name_or_path!r}: expected one of {sorted(PROFILES)} or a .json file "
                     f"with the fields of gshard_jax.partitioner.hardware.Hardware")


def scaled(hw: Hardware, factor: float) -> Hardware:
    """hw with every bandwidth multiplied by `factor` (the sensitivity check)."""
    return dataclasses.replace(hw, intra_bandwidth=hw.intra_bandwidth * factor,
                               inter_bandwidth=hw.inter_bandwidth * factor,
                               table=tuple(r[:4] + (r[4] * factor,) for r in hw.table))


