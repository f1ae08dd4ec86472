"""A config's train step compiled for a target's devices without them (`gshard-jax compile`): the memory that
target's compiler holds against the device's, the collectives a step executes, and XLA:TPU's estimate of the
step's time. MaxText's train_compile is the model: the executable cannot run here, but what it holds is the
real compiler's (gshard_jax/targets).
"""
from __future__ import annotations

import dataclasses
import os
import re
import time
from typing import Any, Optional

from .. import configs, targets as TG
from ..partitioner.reporting.hlo import collective_stats
from . import fit, train

# JAX's GPU allocator takes this fraction of the device's memory unless XLA_PYTHON_CLIENT_MEM_FRACTION says
# otherwise (or XLA_PYTHON_CLIENT_PREALLOCATE=false): the most a step can hold there.
GPU_MEM_FRACTION = 0.75


@dataclasses.dataclass
class Compiled:
    """What a target's compiler made of a config's train step, per device."""
    target: str
    mesh: dict  # the mesh's axis sizes over the target's devices
    memory: Optional[fit.StepMemory]  # None where the compiler refused the step (`error`)
    limit: Optional[float]  # bytes a device may hold (None: nothing says)
    limit_source: str  # where `limit` comes from
    collectives: dict  # kind -> {"count", "payload_bytes"} one step executes (loops times their trips)
    step_s: Optional[float]  # XLA:TPU's estimate of the step's time (cost_analysis' optimal_seconds)
    compile_s: float
    error: str = ""  # the compiler's refusal (XLA:TPU refuses a step over the chip's memory)
    needed: Optional[float] = None  # with a refusal: the bytes the compiler says the step's temporaries need

    @property
    def fits(self) -> bool:
        if self.error:
            return False
        return self.limit is None or self.memory.total <= self.limit

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["memory"] = self.memory.to_dict() if self.memory is not None else None
        out["fits"] = self.fits
        return out

    def lines(self) -> list[str]:
        """The report `gshard-jax compile` prints."""
        head = f"{self.target}, mesh {self.mesh}: compiled in {self.compile_s:.1f} s"
        if self.error:
            short = "" if self.needed is None or self.limit is None else (
                f" {fit.size(self.needed)} of temporaries in {fit.size(self.limit)}, "
                f"{fit.size(self.needed - self.limit)} over at least;")
            return [head, f"does not fit:{short} the compiler refused the step: {self.error}"]
        m, limit = self.memory, self.limit
        out = [head, f"memory per device: {m.breakdown()}"]
        if limit is None:
            out.append(f"device memory: unknown ({self.limit_source})")
        else:
            over = "" if self.fits else f": {fit.size(m.total - limit)} over"
            out.append(f"{'fits' if self.fits else 'does not fit'} in {fit.size(limit)}{over} ({self.limit_source}; "
                       f"{m.total / limit:.0%} of it)")
        moved = {k: v for k, v in self.collectives.items() if v["count"]}
        out.append("collectives per step: " + (", ".join(
            f"{k} x{v['count']} {fit.size(v['payload_bytes'])}" for k, v in moved.items()) or "none"))
        if self.step_s is not None:
            out.append(f"XLA:TPU's estimate of the step: {self.step_s * 1e3:.3g} ms")
        return out


_SIZE = re.compile(r"\(([\d.]+)([KMGT])\)")


def refused_sizes(error: str) -> tuple[Optional[float], Optional[float]]:
    """(bytes needed, bytes available) from XLA:TPU's refusal of a step over the chip's memory ("... required for
    HLO temporaries (179.33G) exceeds available HBM (15.75G)"); None where the message says no size."""
    found = [float(n) * 1024 ** "KMGT".index(unit) * 1024 for n, unit in _SIZE.findall(error)]
    return (found[0] if found else None), (found[1] if len(found) > 1 else None)


def device_limit(cfg: Any, target: TG.Target, mesh: Any) -> tuple[Optional[float], str]:
    """(bytes a step may hold on one of the target's devices, where that comes from); a CPU target's as `train`
    judges simulated devices (fit.device_limit)."""
    if target.compiler == "cpu":
        return fit.device_limit(cfg, mesh)
    t = cfg.train
    if t.memory_limit_gib:
        return t.memory_limit_gib * fit.GiB, f"train.memory_limit_gib={t.memory_limit_gib:g}"
    if target.compiler == "gpu":
        fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", GPU_MEM_FRACTION))
        return target.memory_bytes * fraction, (f"{fraction:.0%} of the {target.device}'s "
                                                f"{fit.size(target.memory_bytes)}: JAX's GPU allocator "
                                                f"(XLA_PYTHON_CLIENT_MEM_FRACTION)")
    return target.memory_bytes, f"the TPU {target.device}'s HBM per device"


def compile_step(cfg: Any, target: TG.Target) -> Compiled:
    """Compile cfg's train step for `target` (its mesh over the target's devices, as `train` would build it)."""
    devices = target.devices()
    cfg = configs.on_platform(cfg, target.compiler)  # the exchange and kernel a run on the target gets
    mesh = train.mesh_for(cfg, devices)
    trainer = train.Trainer(cfg, "", mesh=mesh)
    state, batch = fit.abstract_inputs(trainer)
    limit, source = device_limit(trainer.cfg, target, mesh)
    start = time.perf_counter()
    try:
        compiled = trainer.step_fn.lower(state, batch).compile()
    except Exception as e:  # XLA:TPU refuses a step over the chip's memory at compile time
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        error = str(e).splitlines()[0][:500]
        needed, available = refused_sizes(error)
        if available is not None and not trainer.cfg.train.memory_limit_gib:
            limit, source = available, f"the HBM XLA:TPU says is available on a {target.device} device"
        return Compiled(str(target), dict(mesh.shape), None, limit, source, {}, None,
                        time.perf_counter() - start, error=error, needed=needed)
    seconds = time.perf_counter() - start
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) and cost else cost
    step_s = (cost or {}).get("optimal_seconds")  # XLA:TPU's; negative where it has no estimate
    stats = {k: {"count": v["count"], "payload_bytes": v["payload_bytes"]}
             for k, v in collective_stats(compiled, per_step=True).items()}
    return Compiled(str(target), dict(mesh.shape), fit.step_memory(trainer, compiled), limit, source, stats,
                    float(step_s) if step_s and step_s > 0 else None, seconds)
