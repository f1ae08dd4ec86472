"""A candidate's memory three ways: the screen's formula (estimate.memory), explain()'s prediction (the planned
program's arguments, outputs not donated and temporaries at their peak: partitioner/costs/liveness.py), and the
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

from ..partitioner.costs.hardware import Hardware
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
    step: dict = dataclasses.field(default_factory=dict)  # the compiled step's bytes by part (fit.StepMemory)

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
    outputs = outputs_bytes(report, set(range(state_outputs)))
    temps = report.temporaries.bytes if report.temporaries is not None else 0
    return int(report.argument_bytes()["total"] + outputs + temps)


def outputs_bytes(report: Any, donated: set) -> int:
    """Bytes per device of a report's outputs not written into a donated argument's buffer (donated: their
    indices), and the table of their pointers XLA returns several outputs in (8 bytes an output)."""
    sizes = dict(report.mesh)
    table = 8 * len(report.outputs) if len(report.outputs) > 1 else 0
    return table + int(sum(math.prod(o.boundary.local_shape(o.shape, sizes)) * np.dtype(o.dtype).itemsize
                           for k, o in enumerate(report.outputs) if k not in donated))


def compiled(cfg: ml_collections.ConfigDict, c: SP.Candidate, platform: str = "", devices: Optional[list] = None
             ) -> Any:
    """The compiled train step's memory (training/fit.StepMemory) of candidate c, on this process's devices
    (as many as c's mesh has) or the given ones (a compile target's: gshard_jax/targets); platform: the one
    planned for, whose dropless exchange the step takes (as predict.explain does), where it is not this one."""
    from .. import configs
    from ..training import fit, train
    n, have = math.prod(c.sizes.values()), jax.device_count() if devices is None else len(devices)
    if n != have:
        raise ValueError(f"candidate {c.key} needs {n} devices to compile; there are {have} (run it with "
                         f"--cpu-devices {n}, or a target of {n} devices)")
    run = predict.apply(cfg, c)
    if platform:
        run = configs.on_platform(run, platform)
    mesh = None if devices is None else train.mesh_for(run, devices)
    return fit.step_memory(train.Trainer(run, "", mesh=mesh))


def row(cfg: ml_collections.ConfigDict, c: SP.Candidate, hw: Hardware, explain: bool = True,
        devices: Optional[list] = None) -> Row:
    """c's memory three ways (explain: also explain()'s prediction; devices: compiled for a compile target's)."""
    f = formula(cfg, c, hw.platform)
    got = compiled(cfg, c, hw.platform if devices is not None else "", devices)
    return Row(c.key, f["total"], explained(cfg, c, hw) if explain else None, got.total,
               {k: v for k, v in f.items() if k != "total"}, got.to_dict())


# ----------------------------------------------------------------- `gshard-jax plan --check-memory K`
# The per-device program of a candidate on N devices is compiled in a process of N simulated CPU devices: the
# program XLA compiles is the shard_map body at the candidate's own per-device shapes, with its collectives over
# the candidate's own groups, so its memory_analysis() is the candidate's, as XLA:CPU assigns buffers (XLA:GPU's
# buffer assignment and scheduler differ: docs/planner.md). Nothing is allocated: the state and batch are shapes.

def check(config: str, overrides: list, devices: int, candidates: list[SP.Candidate], predicted: list[float],
          arguments: list[float], platform: str = "", timeout: Optional[float] = None,
          target: str = "") -> list[dict]:
    """Compile each candidate of a plan in a child process of `devices` simulated CPU devices (platform: the
    plan's, see compiled()): per candidate {"key", "predicted", "cpu_formula" (the formula as XLA:CPU holds
    the step: activations in float32), "compiled" (StepMemory's dict) or "error", "seconds", "total" (the
    compiled bytes per device)}. Beyond MAX_CPU_DEVICES a candidate compiles as its `twin`, whose outputs and
    temporaries join the candidate's own argument bytes (`arguments`: the plan's, exact from its report).
    target: compile for a compile target's devices instead (`tpu:v3:8x8`; as many as `devices`), no twin."""
    import json
    import subprocess
    import sys
    job = {"config": config, "overrides": overrides, "devices": devices, "platform": platform,
           "candidates": [c.to_dict() for c in candidates], "target": target}
    done = subprocess.run([sys.executable, "-m", __name__], input=json.dumps(job), capture_output=True, text=True,
                          timeout=timeout)
    lines = [x for x in done.stdout.splitlines() if x.startswith("{")]
    if done.returncode != 0 and not lines:
        raise RuntimeError(f"the memory check's process exited {done.returncode}: {done.stderr[-2000:]}")
    rows = [json.loads(x) for x in lines]
    for r, p, a in zip(rows, predicted, arguments):
        r["predicted"] = p
        if "compiled" in r:
            got = r["compiled"]
            r["total"] = (a + got["outputs"] + got["temporaries"]) if "twin" in r else got["total"]
    return rows


def report(config: str, overrides: list, devices: int, result: Any, top: int, target: str = "") -> list[str]:
    """`gshard-jax plan --check-memory`'s lines: the plan's top candidates compiled (check(); for `target`'s
    compiler where given) against its prediction per device."""
    from ..training.fit import size
    ranked = result.ranked[:top]
    where = f"for {target}" if target else f"on {devices} simulated CPU devices (XLA:CPU's buffer assignment)"
    out = [f"\nmemory check: the top {len(ranked)} compiled {where}, against the plan's prediction per device:"]
    memory = [r.estimate.memory for r in ranked]
    rows = check(config, overrides, devices, [r.candidate for r in ranked], [m["total"] for m in memory],
                 [sum(m.get(k, 0.0) for k in ("params", "optimizer", "batch")) for m in memory],
                 result.hardware.platform, target=target)
    for i, r in enumerate(rows, 1):
        if "error" in r:
            out.append(f"  #{i} {r['key']}: not compiled ({r['error']})")
            continue
        got = r["total"]
        if target:
            out.append(f"  #{i} {r['key']}: planned {size(r['predicted'])} on {result.hardware.name}; compiled "
                       f"{size(got)} ({r['predicted'] / got:.2f}x; temporaries {size(r['compiled']['temporaries'])}), "
                       f"{r['seconds']:.0f} s")
            continue
        if "twin" in r:
            out.append(f"  #{i} compiled as its twin {r['twin']['key']} (data and batch / {r['twin']['data_over']}: "
                       f"the same per-device program but ZeRO's data shard; its arguments from the plan)")
        out.append(f"  #{i} {r['key']}: planned {size(r['predicted'])} on {result.hardware.name}; as XLA:CPU holds "
                   f"it (float32 activations) {size(r['cpu_formula'])}, compiled {size(got)} "
                   f"({r['cpu_formula'] / got:.2f}x; temporaries {size(r['compiled']['temporaries'])}), "
                   f"{r['seconds']:.0f} s")
    return out


def _candidate(d: dict) -> SP.Candidate:
    return SP.Candidate(tuple((a, d["mesh"][a]) for a in d["mesh_order"]), d["zero_stage"], d["epso"],
                        d["microbatches"], d["schedule"], d["repeats"], d["remat"], d["sequence_parallel"],
                        d["offload"])


MAX_CPU_DEVICES = 2048  # XLA:CPU compiles for at most this many devices (beyond, it takes them for processes)


def twin(cfg: ml_collections.ConfigDict, c: SP.Candidate, limit: int = MAX_CPU_DEVICES) -> tuple:
    """(cfg, c, f): c with its data axis and cfg's batch divided by f, the least power of two that brings its
    devices to `limit` or fewer (f = 1: c itself). Each device then runs the same program on the same local
    shapes, but for what ZeRO splits over data (the optimizer state, and gradients and params at stages 2-3),
    which is an argument: the caller takes the arguments from the plan. A ValueError where data cannot
    shrink that far."""
    import copy
    devices, f = math.prod(c.sizes.values()), 1
    while devices // f > limit:
        f *= 2
    if f == 1:
        return cfg, c, 1
    data, batch = c.size("data"), cfg.train.batch_size
    if data % f or batch % f:
        raise ValueError(f"{c.key} needs {devices} devices and XLA:CPU compiles for at most {limit}; its twin "
                         f"would need data={data} and batch {batch} divisible by {f}")
    small = copy.deepcopy(cfg)
    small.train.batch_size = batch // f
    mesh = tuple((a, n // f if a == "data" else n) for a, n in c.mesh if (a != "data" or n // f > 1))
    return small, dataclasses.replace(c, mesh=mesh), f


def _child() -> None:
    """The child of check(): a JSON job on stdin, a JSON row per candidate on stdout."""
    import json
    import sys
    import time
    job = json.loads(sys.stdin.read())
    jax.config.update("jax_platforms", "cpu")  # simulated devices, on a GPU host too
    jax.config.update("jax_num_cpu_devices", min(job["devices"], MAX_CPU_DEVICES))
    from .. import configs
    from ..training import overrides
    cfg = overrides.apply(configs.load(job["config"]), [tuple(kv) for kv in job["overrides"]])
    devices = None
    if job.get("target"):
        from .. import targets
        devices = targets.parse(job["target"]).devices()
    for d in job["candidates"]:
        c = _candidate(d)
        start = time.perf_counter()
        try:
            row = {"key": c.key, "cpu_formula": formula(cfg, c, "cpu")["total"]}
            if devices is not None:  # the target's compiler, for as many devices as the plan: no twin
                row["compiled"] = compiled(cfg, c, job.get("platform", ""), devices).to_dict()
                row["seconds"] = time.perf_counter() - start
                print(json.dumps(row), flush=True)
                continue
            small, c2, f = twin(cfg, c)
            if f > 1:  # all but ZeRO's data shard on the twin; the arguments from the plan (check's caller)
                row["twin"] = {"key": c2.key, "data_over": f}
                row["cpu_formula_twin"] = formula(small, c2, "cpu")["total"]
            row["compiled"] = compiled(small, c2, job.get("platform", "")).to_dict()
        except Exception as e:  # a candidate that does not compile is a row that says why
            row = {"key": c.key, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
        row["seconds"] = time.perf_counter() - start
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    _child()
