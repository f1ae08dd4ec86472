"""A candidate's memory three ways: the screen's formula (estimate.memory), explain()'s prediction (the planned
program's arguments, outputs not donated and temporaries at their peak: partitioner/liveness.py), and the
compiled train step's memory_analysis() (training/fit.py) on this process's devices. The grid benchmark
(benchmarks/memory_grid.py), its test and `gshard-jax plan --check-memory` read them from here.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import jax
import ml_collections
import numpy as np

from ..partitioner.hardware import Hardware
from . import estimate as E, predict, space as SP

MiB = 2 ** 20


@dataclasses.dataclass(frozen=True)
class Row:
    """One candidate's memory per device, in bytes: predicted by formula and by explain(), and compiled."""
    key: str
    formula: float
    explained: Optional[float]
    compiled: Optional[float]
    parts: dict = dataclasses.field(default_factory=dict)  # the formula's bytes by kind

    def ratio(self, which: str = "formula") -> Optional[float]:
        got = getattr(self, which)
        return None if got is None or not self.compiled else got / self.compiled

    def to_dict(self) -> dict:
        return dict(dataclasses.asdict(self), formula_ratio=self.ratio(), explained_ratio=self.ratio("explained"))


def formula(cfg: ml_collections.ConfigDict, c: SP.Candidate, platform: str = "cpu") -> dict:
    """estimate.memory of candidate c of cfg's model (bytes per device by kind, and "total")."""
    return E.memory(SP.model_shape(cfg, platform), c)


def explained(cfg: ml_collections.ConfigDict, c: SP.Candidate, hw: Hardware) -> int:
    """explain()'s predicted bytes per device of c's train step on an abstract mesh: arguments in device memory,
    outputs not written into the donated state's buffers, and the temporaries' peak."""
    report = predict.explain(cfg, c, hw)
    state_outputs = len(jax.tree.leaves(predict.abstract_state(cfg, c)))  # the new state comes first, donated
    sizes = dict(report.mesh)
    outputs = sum(math.prod(o.boundary.local_shape(o.shape, sizes)) * np.dtype(o.dtype).itemsize
                  for k, o in enumerate(report.outputs) if k >= state_outputs)
    temps = report.temporaries.bytes if report.temporaries is not None else 0
    return int(report.argument_bytes()["total"] + outputs + temps)


def compiled(cfg: ml_collections.ConfigDict, c: SP.Candidate) -> Any:
    """The compiled train step's memory (training/fit.StepMemory) of candidate c, on this process's devices
    (as many as c's mesh has)."""
    from ..training import fit, train
    n = math.prod(c.sizes.values())
    if n != jax.device_count():
        raise ValueError(f"candidate {c.key} needs {n} devices to compile; this process has {jax.device_count()} "
                         f"(run it with --cpu-devices {n})")
    return fit.step_memory(train.Trainer(predict.apply(cfg, c), ""))


def row(cfg: ml_collections.ConfigDict, c: SP.Candidate, hw: Hardware, explain: bool = True) -> Row:
    """c's memory three ways (explain: also explain()'s prediction)."""
    f = formula(cfg, c, hw.platform)
    got = compiled(cfg, c)
    return Row(c.key, f["total"], explained(cfg, c, hw) if explain else None, got.total,
               {k: v for k, v in f.items() if k != "total"})
