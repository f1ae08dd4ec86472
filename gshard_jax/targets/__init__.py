"""Compile targets: the compiler a step is compiled by and the devices it is compiled for, without them.

XLA's TPU and GPU compilers run on a machine that has neither device (deviceless ahead-of-time compilation): a
mesh over a topology's compile-only devices lowers and compiles like any other; the executable cannot run, but
its memory_analysis(), cost_analysis() and HLO are that compiler's. A target names the compiler, the device and
the topology, written `compiler:device:topology`:

    tpu:v5p:2x2x2     XLA:TPU on a TPU topology by its name (v3, v4, v5e, v5p, v6e; a v3 chip is two devices)
    gpu:h100:1x1x8    XLA:GPU on slices x hosts x GPUs per host of one GPU (h100, h200, a100-40, a100-80, b200),
                      described by the data files in gpu/ (XLA's published specs)
    cpu:8             XLA:CPU on the first 8 CPU devices (simulated: jax_num_cpu_devices)

XLA:TPU needs libtpu and XLA:GPU JAX's CUDA plugin, at the installed JAX's version (README: the `tpu` and
`cuda12` extras); without them a target says which to install.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
from typing import Mapping, Optional

import jax
from jax.sharding import Mesh

GPU_SPECS = {  # the name a target uses -> its description in gpu/ (XLA's spec of the same name)
    "h100": "h100_sxm", "h200": "h200", "a100-40": "a100_sxm_40", "a100-80": "a100_sxm_80", "b200": "b200"}
# HBM per device, GiB (a v3 chip's two cores are two devices of 16 GiB each)
TPU_MEMORY_GIB = {"v3": 16.0, "v4": 32.0, "v5e": 16.0, "v5p": 95.0, "v6e": 32.0}
COMPILERS = ("tpu", "gpu", "cpu")
_HERE = os.path.dirname(os.path.abspath(__file__))


class MissingCompiler(RuntimeError):
    """The target's compiler is not installed (its message says what to install)."""


@dataclasses.dataclass(frozen=True)
class Target:
    """A compiler and the devices it compiles for (module docstring)."""

    compiler: str  # "tpu", "gpu" or "cpu"
    device: str  # a TPU generation ("v5p"), a GPU of GPU_SPECS ("h100") or "cpu"
    topology: str  # TPU: the topology's shape ("2x2x2"); GPU: slices x hosts x GPUs ("1x1x8"); CPU: a count

    def __str__(self) -> str:
        return f"{self.compiler}:{self.topology}" if self.compiler == "cpu" else \
            f"{self.compiler}:{self.device}:{self.topology}"

    @property
    def count(self) -> int:
        """How many devices the topology holds (a v3 chip counts two)."""
        n = math.prod(int(s) for s in self.topology.split("x"))
        return 2 * n if self.device == "v3" else n

    @property
    def memory_bytes(self) -> Optional[int]:
        """One device's memory (None on CPU: the host's)."""
        if self.compiler == "tpu":
            return int(TPU_MEMORY_GIB[self.device] * 2**30)
        if self.compiler == "gpu":
            for line in gpu_spec(self.device).splitlines():
                if line.strip().startswith("device_memory_size:"):
                    return int(line.split(":")[1])
        return None

    def devices(self) -> list:
        """The target's devices: compile-only for TPU and GPU."""
        if self.compiler == "cpu":
            cpus = jax.devices("cpu")
            if len(cpus) < self.count:
                raise ValueError(f"target {self}: this process has {len(cpus)} CPU devices; set "
                                 f"jax.config.update('jax_num_cpu_devices', {self.count}) before JAX starts "
                                 f"(or `--cpu-devices {self.count}`)")
            return cpus[: self.count]
        from jax.experimental import topologies
        _require(self.compiler)
        if self.compiler == "tpu":
            os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # no metadata server to ask
            # compile-only: another process (a test run, a plan's memory check) may hold libtpu at once
            os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
            desc = topologies.get_topology_desc(platform="tpu", topology_name=f"{self.device}:{self.topology}")
        else:
            os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # no driver to check
            desc = topologies.get_topology_desc(platform="cuda", topology_name=str(self),
                                                target_config=gpu_spec(self.device), topology=self.topology)
        return list(desc.devices)

    def mesh(self, axes: Mapping[str, int]) -> Mesh:
        """A mesh of named axes over the target's devices (gs.make_mesh's rules)."""
        from .mesh import make_mesh
        return make_mesh(axes, devices=self.devices())


def parse(text: str) -> Target:
    """A target from `compiler:device:topology` (or `cpu:N`), with an error that says what was expected."""
    parts = str(text).strip().split(":")
    example = "tpu:v5p:2x2x2, gpu:h100:1x1x8 or cpu:8"
    compiler = parts[0].lower()
    if compiler not in COMPILERS:
        raise ValueError(f"target {text!r}: expected a compiler of {list(COMPILERS)} first, as in {example}")
    if compiler == "cpu":
        if len(parts) != 2 or not parts[1].isdigit() or int(parts[1]) < 1:
            raise ValueError(f"target {text!r}: expected cpu:N, N the number of CPU devices (cpu:8)")
        return Target("cpu", "cpu", parts[1])
    if len(parts) != 3:
        raise ValueError(f"target {text!r}: expected {compiler}:DEVICE:TOPOLOGY, as in {example}")
    device, topology = parts[1].lower(), parts[2].lower()
    known = list(TPU_MEMORY_GIB) if compiler == "tpu" else list(GPU_SPECS)
    if device not in known:
        raise ValueError(f"target {text!r}: no {compiler.upper()} named {device!r}; expected one of {known}")
    dims = topology.split("x")
    if not all(d.isdigit() and int(d) > 0 for d in dims) or (compiler == "gpu" and len(dims) != 3):
        shape = "SLICESxHOSTSxGPUS, as 1x1x8" if compiler == "gpu" else "the topology's shape, as 2x2x2 or 4x4"
        raise ValueError(f"target {text!r}: expected {shape}; got {topology!r}")
    return Target(compiler, device, topology)


def gpu_spec(device: str) -> str:
    """The GpuTargetConfig text of a GPU of GPU_SPECS (gpu/NAME.txtpb)."""
    with open(os.path.join(_HERE, "gpu", GPU_SPECS[device] + ".txtpb")) as f:
        return f.read()


def _require(compiler: str) -> None:
    """A MissingCompiler naming the package to install, where the target's compiler is absent."""
    version = jax.__version__
    if compiler == "tpu" and importlib.util.find_spec("libtpu") is None:
        raise MissingCompiler(f"compiling for a TPU target needs XLA:TPU (libtpu), which is not installed: "
                              f"pip install \"jax[tpu]=={version}\" (or this project's `.[tpu]` extra)")
    if compiler == "gpu" and not any(importlib.util.find_spec(f"jax_cuda{v}_plugin") for v in (12, 13)):
        raise MissingCompiler(f"compiling for a GPU target needs XLA:GPU (JAX's CUDA plugin), which is not "
                              f"installed: pip install \"jax[cuda12]=={version}\" (or this project's `.[cuda12]` "
                              f"extra; about 3-4 GB)")
