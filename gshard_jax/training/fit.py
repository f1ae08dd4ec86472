"""Whether a run's train step fits its devices' memory, from the compiled step, before the first step runs.

The step is compiled from the state's and batch's shapes and placements alone (nothing allocated), so a run
that cannot fit is refused before its state, data or checkpoints are touched; the compiled executable is the
one the first step then runs (the same placements, so jax.jit's cache holds it). The limit is the device's
own (memory_stats' bytes_limit, where the device reports one), the host's memory over its devices for
simulated CPU devices, or the hardware profile's memory_gib; train.memory_limit_gib overrides all three.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
from typing import Any, Optional

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from ..partitioner.costs import hardware
from . import data

log = logging.getLogger(__name__)
GiB = 1024 ** 3


def size(n: float) -> str:
    """Bytes as GiB, or MiB under one GiB."""
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / 2**20:.2f} MiB"


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """Bytes per device a compiled train step holds in device memory, by part (memory_analysis(): argument +
    output - alias + temp, the arguments split by kind from their placements)."""
    params: int
    optimizer: int  # the optimizer state in device memory (an offloaded one is `host`)
    batch: int  # the batch and the step counter
    outputs: int  # outputs not written into a donated argument's buffer
    gradients: int  # of the temporaries: the gradients in their layout (the rest is activations and scratch)
    temporaries: int  # XLA's temp allocation: gradients, activations, logits and every op's scratch
    host: int = 0  # arguments in host memory (an offloaded optimizer state), not counted in `total`

    @property
    def total(self) -> int:
        return self.params + self.optimizer + self.batch + self.outputs + self.temporaries

    def breakdown(self) -> str:
        """One line: each part in GiB, temporaries split into gradients and the rest."""
        g = size
        text = (f"parameters {g(self.params)}, optimizer state {g(self.optimizer)}, batch {g(self.batch)}, "
                f"outputs {g(self.outputs)}, temporaries {g(self.temporaries)} (gradients {g(self.gradients)}, "
                f"activations and scratch {g(self.temporaries - self.gradients)}) = {g(self.total)}")
        return text + (f"; in host memory {g(self.host)}" if self.host else "")

    def to_dict(self) -> dict:
        return dict(dataclasses.asdict(self), total=self.total)


class DoesNotFit(Exception):
    """A train step that needs more device memory than the limit: its StepMemory, the limit and where the limit
    came from. The CLI adds the options that would fit (planner/fit_options.py)."""

    def __init__(self, memory: StepMemory, limit: float, source: str):
        self.memory, self.limit, self.source = memory, limit, source
        super().__init__(f"the train step needs {size(memory.total)} per device but {source} allows "
                         f"{size(limit)}: {memory.breakdown()}")


def abstract_inputs(trainer: Any) -> tuple[Any, dict]:
    """(state, batch) as ShapeDtypeStructs placed as the run places them: the step compiled from them is the
    one the first step runs."""
    spec = lambda s: s if isinstance(s, NamedSharding) else NamedSharding(trainer.mesh, s)
    shardings = jax.tree.map(spec, trainer.state_specs, is_leaf=lambda x: isinstance(x, (P, NamedSharding)))
    shapes = jax.eval_shape(trainer.init_fn, jax.random.key(0))
    state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings)
    t = trainer.cfg.train
    windows = np.zeros((t.batch_size, trainer.length), np.int32)
    batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=trainer.batch_sharding)
             for k, v in data.model_batch(trainer.cfg.model.kind, windows).items()}
    return state, batch


def local_bytes(x: jax.ShapeDtypeStruct | jax.Array) -> int:
    """Bytes of one device's shard of a placed array (or its shape)."""
    return math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize


def on_host(x: jax.ShapeDtypeStruct | jax.Array) -> bool:
    """Whether a placed array (or its shape) lives in host memory (an offloaded optimizer state)."""
    return getattr(x.sharding, "memory_kind", None) == "pinned_host"


def step_memory(trainer: Any, compiled: Any = None) -> StepMemory:
    """The compiled train step's memory per device (compiled: the step's jax Compiled, else compiled here)."""
    state, batch = abstract_inputs(trainer)
    if compiled is None:
        compiled = trainer.step_fn.lower(state, batch).compile()
    m = compiled.memory_analysis()
    kinds = {"params": 0, "optimizer": 0, "batch": 0}
    host = 0
    parts = (("params", state["params"]), ("optimizer", state["opt_state"]), ("batch", (batch, state["step"])))
    for key, tree in parts:
        for x in jax.tree.leaves(tree):
            if on_host(x):
                host += local_bytes(x)
            else:
                kinds[key] += local_bytes(x)
    gradients = sum(math.prod(NamedSharding(trainer.mesh, s).shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
                    for x, s in zip(jax.tree.leaves(trainer.param_shapes),
                                    jax.tree.leaves(trainer.layout.gradients, is_leaf=lambda v: isinstance(v, P))))
    return StepMemory(**kinds, outputs=int(m.output_size_in_bytes - m.alias_size_in_bytes),
                      gradients=int(min(gradients, m.temp_size_in_bytes)), temporaries=int(m.temp_size_in_bytes),
                      host=host)


def device_limit(cfg: Any, mesh: Any) -> tuple[Optional[float], str]:
    """(bytes one device may hold, where that figure comes from); (None, why) where nothing says."""
    t = cfg.train
    if t.memory_limit_gib:
        return t.memory_limit_gib * GiB, f"train.memory_limit_gib={t.memory_limit_gib:g}"
    # one of this process's devices: another process's reports no memory stats here
    device = next((d for d in mesh.devices.flat if d.process_index == jax.process_index()), mesh.devices.flat[0])
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return float(stats["bytes_limit"]), f"{device.device_kind} device {device.id}'s bytes_limit"
    if device.platform == "cpu":  # simulated devices share the host's memory
        local = max(1, len([d for d in mesh.devices.flat if d.process_index == jax.process_index()]))
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return total / local, f"this host's {total / GiB:.1f} GiB over its {local} simulated CPU devices"
    profile = hardware.get(t.hardware) if t.hardware != "auto" else hardware.for_device(device.device_kind)
    if profile is not None:
        return profile.memory_gib * GiB, f"the {profile.name} profile's memory_gib={profile.memory_gib:g}"
    return None, f"{device.device_kind} reports no memory limit and no hardware profile knows it"


def check(trainer: Any) -> Optional[StepMemory]:
    """Compile the train step and raise DoesNotFit where it needs more than the device limit; the step's
    memory (None where no limit is known: the check is skipped, and logged)."""
    limit, source = device_limit(trainer.cfg, trainer.mesh)
    if limit is not None and not hasattr(trainer.step_fn, "lower"):
        limit, source = None, "the train step is not a function jax can lower (a wrapped step)"
    if limit is None:
        log.info("memory check skipped: %s (set train.memory_limit_gib to check)", source)
        return None
    mem = step_memory(trainer)
    log.info("train step: %s per device, of %s (%s)", mem.breakdown(), size(limit), source)
    if mem.total > limit:
        raise DoesNotFit(mem, limit, source)
    return mem
