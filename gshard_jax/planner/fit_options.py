"""What would fit when a run's compiled step does not: the planner's screen under the device's limit, its
formula scaled by what the run's own compiled step measured against it.

The formula (estimate.memory) is the screen's, fast enough for every candidate; the compiled step of the
configuration that did not fit says how far it is from the program on this model (temporaries XLA holds that
the formula does not count). Each option is predicted at formula x (compiled / formula of the run's own
configuration), so an option is listed only where it fits by that measure: a prediction, not a compiled check
(`gshard-jax plan --check-memory K` compiles them).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import ml_collections

from ..partitioner.costs.hardware import Hardware
from ..training.fit import size
from . import estimate as E, search, space as SP

GiB = 1024 ** 3


@dataclasses.dataclass(frozen=True)
class Option:
    """A configuration predicted to fit: what to change, its predicted bytes per device and step seconds."""
    candidate: SP.Candidate
    changes: tuple[str, ...]  # the --config overrides that differ from the run's
    predicted: float  # bytes per device: the formula x the run's compiled / formula ratio
    step: float  # the formula's step seconds on the hardware profile
    same_mesh: bool


def options(cfg: ml_collections.ConfigDict, devices: int, hw: Hardware, limit: float, compiled: float,
            same_mesh: int = 3, other_meshes: int = 2) -> tuple[list[Option], float]:
    """(the fastest options that fit `limit` bytes per device, by formula scaled; the scale): up to `same_mesh`
    on the run's own mesh (ZeRO stage, remat, microbatches, offload) and `other_meshes` on other meshes.
    compiled: the run's compiled step's bytes per device."""
    own = SP.config_candidate(cfg, devices)
    if own is None:
        raise ValueError(f"the config's mesh does not resolve on {devices} devices")
    shape = SP.model_shape(cfg, hw.platform)
    scale = max(compiled / E.memory(shape, own)["total"], 1.0)  # never below the formula
    plan = search.plan(cfg, devices, hw, memory_gb=limit / scale / GiB, top=0, verify=0)
    given = set(own.overrides())
    out: list[Option] = []
    counts = {True: 0, False: 0}
    wanted = {True: same_mesh, False: other_meshes}
    for r in plan.screened:
        c = r.candidate
        same = c.sizes == own.sizes
        if counts[same] >= wanted[same] or _options_of(c) == _options_of(own) and same:
            continue
        counts[same] += 1
        changes = tuple(o for o in c.overrides() if o not in given and not (same and "mesh_order" in o))
        out.append(Option(c, changes, r.estimate.memory["total"] * scale, r.estimate.step, same))
    return out, scale


def _options_of(c: SP.Candidate) -> tuple:
    return dataclasses.replace(c, mesh=()).order_key


def describe(opts: list[Option], scale: float, limit: float) -> str:
    """The options as lines for the user."""
    if not opts:
        return (f"no configuration of these devices fits {size(limit)} by the planner's formula x "
                f"{scale:.2f} (this step's compiled / formula); more devices, or a smaller batch or model, is needed")
    lines = [f"options the planner predicts fit {size(limit)} (its formula x {scale:.2f}, this step's "
             f"compiled / formula; not compiled), fastest first:"]
    for o in opts:
        where = "this mesh" if o.same_mesh else "another mesh"
        lines.append(f"  {o.candidate.key} ({where}): {size(o.predicted)}, {o.step:.3g} s a step: "
                     + " ".join(o.changes))
    return "\n".join(lines)


def suggest(cfg: Any, devices: int, hw: Hardware, limit: float, compiled: float) -> str:
    """describe(options(...)), or why there are none."""
    try:
        opts, scale = options(cfg, devices, hw, limit, compiled)
    except ValueError as e:
        return f"(no options: {e})"
    return describe(opts, scale, limit)
