"""A candidate planned by the partitioner itself: its train step explained on an abstract mesh of the
candidate's shape (no devices needed), so the predicted collectives are the ones the compiled step runs.

Each report row's collectives, times the trips of the loop they sit in, become the step's communication;
the report's argument bytes (params, optimizer state, batch as the layout places them) replace the
formula's. A scanned layer stack is planned once per distinct layer, as the partitioner always does.
"""
from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any, Optional

import jax
import ml_collections
import numpy as np
from jax.sharding import AbstractMesh, AxisType

from ..partitioner.costs import overlap as OV
from ..partitioner.costs.hardware import Hardware, default_for
from . import estimate as E, space as SP
from .estimate import Comm
from .space import AXES, Candidate


def apply(cfg: ml_collections.ConfigDict, c: Candidate) -> ml_collections.ConfigDict:
    """A copy of cfg that runs candidate c (mesh sizes and order, ZeRO, EPSO, microbatches, schedule, remat,
    sequence parallelism, optimizer offload)."""
    out = copy.deepcopy(cfg)
    for a in AXES:
        out.mesh[a] = c.size(a)
    out.mesh.model = 1
    out.mesh.auto = False  # the planner ranks configurations of the rules table (mesh.auto: docs/training.md)
    out.mesh_order = ",".join(a for a, _ in c.mesh)
    out.train.zero_stage, out.train.epso, out.train.microbatches = c.zero_stage, c.epso, c.microbatches
    out.model.remat = c.remat
    out.model.sequence_parallel = c.sequence_parallel
    out.train.offload_optimizer = c.offload
    if not c.offload:  # the options of an offloaded update go with it
        out.train.delayed_update, out.train.host_update_groups = False, 1
    if c.schedule != "none":
        out.pipeline.schedule, out.pipeline.repeats = c.schedule, c.repeats
    return out


def abstract_mesh(c: Candidate) -> AbstractMesh:
    names = tuple(a for a, _ in c.mesh) or ("data",)
    sizes = tuple(n for _, n in c.mesh) or (1,)
    return AbstractMesh(sizes, names, axis_types=(AxisType.Auto,) * len(names))


def abstract_batch(cfg: ml_collections.ConfigDict) -> dict:
    from ..training import data
    t = cfg.train
    windows = np.zeros((t.batch_size, data.window_length(cfg.model.kind, t.seq_len)), np.int32)
    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in data.model_batch(cfg.model.kind, windows).items()}


def explain(cfg: ml_collections.ConfigDict, c: Candidate, hw: Hardware, trace_per_device: bool = False,
            state: Any = None) -> Any:
    """The partition report of candidate c's train step on an abstract mesh (gs.Report).

    By default the per-device program is walked, not traced (gs.explain's trace_per_device=False): the
    same report, without the cost of tracing it. state: the abstract train state, when known (its shapes
    depend on the model alone, not on the mesh or the training options, but for stage-owned ends, which are
    stacked here: `abstract_state`)."""
    import gshard_jax as gs

    from .. import configs
    from ..training.train import Trainer, state_kind
    run = configs.on_platform(apply(cfg, c), hw.platform)  # the exchange and kernel the run gets on hw's platform
    trainer = Trainer(run, "", mesh=abstract_mesh(c))
    if state is None:
        state = jax.eval_shape(trainer.init_state, jax.random.key(0))
    elif trainer.end_stages > 1:  # the shared state holds each end once: stacked per stage where they own it
        state = jax.eval_shape(lambda s: trainer.relay(s, trainer.saved_order, trainer.layer_order), state)
    state = trainer.in_memory(state)
    batch = abstract_batch(run)
    # decided on the profile the run itself gets on hw's platform, so the plan's choices are the run's; the
    # planner costs the result on hw (plan_one, exposed)
    report = gs.explain(trainer.train_step, trainer.mesh, state, batch,
                        in_shardings=(trainer.state_specs, trainer.batch_spec),
                        out_shardings=trainer.step_outs, profile=default_for(hw.platform),
                        trace_per_device=trace_per_device, donate_argnums=0)  # the state, as the run donates it
    report.kind_of = state_kind
    return report


def abstract_state(cfg: ml_collections.ConfigDict, c: Candidate) -> Any:
    """The train state's shapes and dtypes (ShapeDtypeStructs) for cfg, shared by every candidate (each
    stage-owned end once): nothing else,
    so an offloaded candidate's host memory (part of an aval from JAX 0.11) does not reach the others."""
    from ..training.train import Trainer
    trainer = Trainer(apply(cfg, c), "", mesh=abstract_mesh(c))
    # each stage-owned end once, as a checkpoint holds it (explain stacks it where a candidate's stages own it)
    state = jax.eval_shape(lambda key: trainer.to_checkpoint(trainer.init_state(key)), jax.random.key(0))
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=x.weak_type), state)


_STATES: dict = {}  # the abstract train state and ModelShape per platform, of one model config, its stack scanned
# or not (this process's)


def prepare(cfg: ml_collections.ConfigDict, c: Candidate = Candidate(()), state: Any = None) -> tuple:
    """(cfg's abstract train state, its ModelShapes by platform), made once per process and model config (or
    given: `state`, as another process made it). A worker makes it while the screen runs, and hands it over."""
    model = cfg.model.to_json() + cfg.train.to_json()
    key = (model, bool(cfg.model.scan or c.size("stage") > 1))  # a pipeline scans its stack whatever model.scan says
    if key not in _STATES:
        if any(k[0] != model for k in _STATES):
            _STATES.clear()
        _STATES[key] = (state if state is not None else abstract_state(cfg, c)), {}
    return _STATES[key]


ORDERS_SCHEDULED = 3  # axis orders, fastest by communication, whose step is list-scheduled (overlap.py)


def plan_one(cfg: ml_collections.ConfigDict, c: Candidate, hw: Hardware,
             shape: Optional[SP.ModelShape] = None) -> tuple[list[Comm], dict, dict]:
    """Candidate c planned: (its collectives per step, its argument bytes by kind (host_KIND: in host memory),
    the seconds of communication
    its step leaves exposed per axis order). Every order of its axes is costed by its communication; the
    ORDERS_SCHEDULED fastest are list-scheduled on hw. shape: cfg's SP.model_shape on hw's platform, where the
    caller has it (it takes an abstract trace of the model). A top-level function, so a worker process can run
    it for the planner."""
    state, shapes = prepare(cfg, c)
    report = explain(cfg, c, hw, state=state)
    found = comms(report)
    if hw.platform not in shapes:
        shapes[hw.platform] = shape if shape is not None else SP.model_shape(cfg, hw.platform)
    compute = E.compute_time(shapes[hw.platform], c, hw, math.prod(c.sizes.values()))
    by_comm = sorted(SP.orders(c.sizes), key=lambda o: E.combine(
        hw, dataclasses.replace(c, mesh=o), compute, found, {}).comm_total)
    args = dict(report.argument_bytes(), **{f"host_{k}": v for k, v in report.argument_bytes(host=True).items()
                                            if k != "total"})
    return found, args, {o: exposed(report, hw, o, compute) for o in by_comm[:ORDERS_SCHEDULED]}


def exposed(report: Any, hw: Hardware, order: tuple, compute: float) -> float:
    """Seconds of communication a planned step leaves exposed on hw with its axes in `order`: the report's rows
    list-scheduled (partitioner/costs/overlap.py) with each collective at the bandwidth of its axes there and the
    rows' compute scaled to the step's compute seconds."""
    sizes = dict(order)
    total = report.compute_time
    scale = compute / total if total else 0.0

    def comm_time(col) -> float:
        return Comm(col.kind, tuple(col.axes), col.runs, col.moved * col.runs).time(hw, order, sizes)

    timing = report.overlap(comm_time, lambda r: r.compute_time * scale, bool(hw.overlap))
    return OV.exposed_per_step(timing)


def comms(report: Any) -> list[Comm]:
    """The step's collectives from a report: every row's, times its trips (a loop body's runs per step)."""
    out = []
    for r in report.rows:
        for col in r.collectives:
            out.append(Comm(col.kind, tuple(col.axes), r.trips * col.runs, col.moved * r.trips * col.runs))
    return out
