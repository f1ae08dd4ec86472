"""The Trainer: an experiment config's models, state layout and steps, partitioned by our partitioner (the
loop that runs them: loop.py).

One train step is one ``gs.partition``-ed function of (state, batch) (steps.train_step, its static
config bound by Trainer): loss and gradients, a finiteness check of the loss and the gradient norm, the
optimiser update. A non-finite step never reaches a checkpoint: with ``nan_policy="halt"``
the run stops before saving and names the step; with ``"skip"`` the step's
update is dropped inside the step (old params and optimiser state kept) and
counted. Steps are numbered from 1: checkpoint N holds the state after N
updates, and ``debug.nan_at_step = N`` poisons the N-th update.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import time
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

import gshard_jax as gs

from .. import configs
from ..models import pipelined
from ..models.logical import DEFAULT_RULES, axes_of, mesh_spec
from . import cluster, data, faults, layout as state_layout, optim, steps

log = logging.getLogger("gshard_jax")
NAN_POLICIES = ("halt", "skip")


# XLA:GPU flags that let a step's collectives run beside its compute, as MaxText sets them: the latency-hiding
# scheduler, a high-priority stream for asynchronous collectives, collectives combined up to these sizes, and
# XLA's own pipelining of all-gathers, reduce-scatters and all-reduces across loop trips. Only GPU compilation
# reads them; partitioner/costs/overlap.py predicts what they hide.
OVERLAP_FLAGS = (
    "--xla_gpu_enable_latency_hiding_scheduler=true",
    "--xla_gpu_enable_highest_priority_async_stream=true",
    "--xla_gpu_all_reduce_combine_threshold_bytes=134217728",
    "--xla_gpu_all_gather_combine_threshold_bytes=134217728",
    "--xla_gpu_reduce_scatter_combine_threshold_bytes=67108864",
    "--xla_gpu_enable_pipelined_all_gather=true",
    "--xla_gpu_enable_pipelined_reduce_scatter=true",
    "--xla_gpu_enable_pipelined_all_reduce=true",
    "--xla_gpu_enable_while_loop_double_buffering=true",
)


def with_overlap_flags(xla_flags: str) -> str:
    """XLA_FLAGS with OVERLAP_FLAGS added, each unless the user already set that flag."""
    given = {f.split("=")[0] for f in xla_flags.split()}
    return " ".join([xla_flags] * bool(xla_flags) + [f for f in OVERLAP_FLAGS if f.split("=")[0] not in given])


def init_devices(cpu_devices: int = 0, coordinator: str = "", num_processes: Optional[int] = None,
                 process_id: Optional[int] = None, overlap_flags: bool = True) -> cluster.Peers:
    """Simulated CPU devices, XLA:GPU's overlap flags (OVERLAP_FLAGS) and the multi-process runtime, joined
    as the flags or the scheduler say (cluster.detect); call before JAX starts its backends."""
    if overlap_flags:
        os.environ["XLA_FLAGS"] = with_overlap_flags(os.environ.get("XLA_FLAGS", ""))
    if cpu_devices:
        jax.config.update("jax_num_cpu_devices", cpu_devices)
    peers = cluster.detect(os.environ, coordinator, num_processes, process_id)
    if peers.scheduler:
        log.info("cluster: %s", peers.describe())
    if peers.multi:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        # Detection fills in what is None; with everything given it is off, so that a process started by
        # `launch` through srun (one task per step) is not taken for a one-task SLURM job.
        jax.distributed.initialize(peers.coordinator, num_processes=peers.num_processes,
                                   process_id=peers.process_id,
                                   cluster_detection_method=None if peers.detect else "deactivate")
        log.info("cluster: process %d of %d, %d of %d devices here", jax.process_index(), jax.process_count(),
                 jax.local_device_count(), jax.device_count())
    return peers


def mesh_for(cfg: configs.Config | ml_collections.ConfigDict,
             devices: Optional[Sequence[jax.Device]] = None) -> jax.sharding.Mesh:
    """The config's mesh over all devices (or the given ones: a compile target's); axes of size 1 are left out
    (at least `data` stays). A ConfigDict needs only its mesh section (and mesh_order)."""
    is_typed = isinstance(cfg, configs.Config)
    mesh = cfg.mesh if is_typed else configs.section(configs.MeshConfig, "mesh", cfg.mesh)
    mesh_order = cfg.mesh_order if is_typed else cfg.get("mesh_order", "")
    sizes = mesh.sizes()
    if sizes.get("model", 1) != 1 and sizes.get("y", 1) != 1:
        raise ValueError(f"mesh.model={sizes['model']} and mesh.y={sizes['y']}: `model` is another name for "
                         f"`y`; set one of them")
    n = jax.device_count() if devices is None else len(devices)
    sizes = mesh.on(n)
    kept = {k: s for k, s in sizes.items() if s != 1} or {"data": 1}
    order = [a for a in mesh_order.split(",") if a]
    if order:
        if sorted(order) != sorted(kept):
            raise ValueError(f"mesh_order={mesh_order!r} must list each mesh axis of size > 1 once; the mesh "
                             f"has {sorted(kept)}")
        kept = {a: kept[a] for a in order}
    if math.prod(kept.values()) != n:
        where = jax.default_backend() if devices is None else f"{devices[0].device_kind}, given"
        raise ValueError(f"mesh {mesh.sizes()} needs {math.prod(kept.values())} devices but {n} are present "
                         f"({where}); pass --cpu-devices {math.prod(kept.values())} to simulate "
                         f"them on a CPU, or override the mesh (e.g. --config.mesh.data={n} "
                         f"--config.mesh.expert=1 --config.mesh.y=1)")
    return gs.make_mesh(kept, devices=devices)


def _check_intervals(t) -> None:
    """train.nan_policy is one the loop knows; log_every and eval_every are positive step counts."""
    if t.nan_policy not in NAN_POLICIES:
        raise ValueError(f"train.nan_policy={t.nan_policy!r}; expected one of {NAN_POLICIES}")
    for name in ("log_every", "eval_every"):
        value = getattr(t, name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"train.{name}={value!r}: expected a positive number of steps (the last step "
                             f"is always logged and evaluated, so --config.train.{name}=<num_steps> does "
                             f"it once)")


@dataclasses.dataclass
class Trainer:
    """A config's model, optimiser, mesh, data and partitioned step functions: what the step functions
    (steps.py) are built from and bound to. `cfg` may be given as a ConfigDict: it is made typed here."""
    cfg: configs.Config
    workdir: str
    # The mesh to run on (default: the config's over all devices). An AbstractMesh builds the step functions
    # for devices this host does not have, to explain them (the planner does).
    mesh: Any = None

    def __post_init__(self):
        cfg = self.cfg = configs.typed(self.cfg)
        t = cfg.train
        _check_intervals(t)
        if self.mesh is None:
            self.mesh = mesh_for(cfg)
        self.auto = bool(cfg.mesh.auto)
        if self.auto or cfg.mesh.memory_budget:
            cfg = self.cfg = state_layout.automatic(cfg, dict(self.mesh.shape))
        layout_model = self._models(cfg)
        self.opt = optim.optimizer(t)
        self.schedule = optim.schedule(t)
        self.length = data.window_length(cfg.model.kind, t.seq_len)
        batch_spec, shards = self._batch(t)
        self._state(t, layout_model)
        self._steps(cfg, t, batch_spec, shards)

    def _models(self, cfg):
        """The train and eval models, the unpipelined one init reads, and the layers' orders; returns the model
        the state's layout is read from (the unpipelined one with the pipeline's end stages)."""
        self.pipeline = configs.pipeline_config(cfg, dict(self.mesh.shape).get("stage", 1))
        ends = self.end_stages = configs.end_stages_of(cfg, self.pipeline)
        self.model = configs.build_model(cfg.model, train=True, pipeline=self.pipeline, end_stages=ends)
        self.eval_model = configs.build_model(cfg.model, train=False, pipeline=self.pipeline, end_stages=ends)
        # The same params with or without a pipeline: init reads the unpipelined model (its ends then stacked
        # once per stage where the end stages own them), the layout the unpipelined model with those ends.
        self.init_model = configs.build_model(cfg.model, train=True, pipeline=self.pipeline)
        self.init_model = self.init_model.clone(cfg=dataclasses.replace(self.init_model.cfg, pipeline=None))
        layout_model = self.init_model.clone(cfg=dataclasses.replace(self.init_model.cfg, end_stages=ends))
        # A stack whose chunks repeat over the stages is stored in the order the stages run it; stage-owned
        # ends lead with [stages]. Checkpoints hold the stack in that order and each end as its owner's slice.
        self.layer_order = pipelined.order_key(self.pipeline, ends)
        self.saved_order = pipelined.order_key(self.pipeline)
        return layout_model

    def _batch(self, t) -> tuple:
        """(the batch's spec, its shards): split over the data-parallel axes, checked against the batch size."""
        # the batch as the input pipeline loads it: split over the data-parallel axes (under mesh.auto too)
        batch_spec = mesh_spec(("batch", None), DEFAULT_RULES if self.auto else self.model.cfg.rules,
                               self.mesh.axis_names)
        self.batch_sharding = NamedSharding(self.mesh, P(*batch_spec))
        shards = math.prod(self.mesh.shape[a] for a in axes_of(batch_spec[0]))
        if t.microbatches < 1 or t.batch_size % t.microbatches:
            raise ValueError(f"train.microbatches={t.microbatches} must be a positive divisor of "
                             f"train.batch_size={t.batch_size}")
        if (t.batch_size // t.microbatches) % shards or t.batch_size % jax.process_count():
            raise ValueError(f"train.batch_size={t.batch_size} over train.microbatches={t.microbatches} must "
                             f"divide by the {shards} batch shards of mesh {dict(self.mesh.shape)}, and the "
                             f"batch by the {jax.process_count()} processes")
        return batch_spec, shards

    def _state(self, t, layout_model) -> None:
        """The state's layout and shardings: the params', and the optimizer state's (master weights, a delayed
        update's pending gradients, offloaded to host memory)."""
        example = configs.example_inputs(self.cfg.model, 1, t.seq_len)
        self.layout, self.param_shapes = state_layout.of_model(layout_model, example, dict(self.mesh.shape),
                                                               t.zero_stage, t.epso)
        # bf16 models keep bf16 params (forward, backward and gradient collectives in bf16) and float32
        # master weights beside AdamW's moments in the optimizer state (seed 001's 16 bytes per parameter);
        # an offloaded update keeps them too, so the host never needs the device's params.
        self.offload = bool(t.offload_optimizer)
        self.master = self.model.cfg.compute_dtype != jnp.float32 or self.offload
        opt_specs = state_layout.optimizer_specs(self.opt, jax.eval_shape(self.opt.init, self.param_shapes),
                                            self.layout.optimizer) if not self.auto else None
        if self.master and not self.auto:
            opt_specs = {"master": self.layout.optimizer, "adam": opt_specs}
        self.delayed = bool(t.delayed_update)
        if self.delayed and not self.offload:
            raise ValueError("train.delayed_update=True delays the host's update of an offloaded optimizer state, "
                             "but train.offload_optimizer is False: set --config.train.offload_optimizer=true "
                             "too, or leave train.delayed_update false")
        if t.host_update_groups < 1 or (t.host_update_groups > 1 and not self.offload):
            raise ValueError(f"train.host_update_groups={t.host_update_groups} splits the host's update of an "
                             "offloaded optimizer state into that many computations: it must be 1 or more, and "
                             "more than 1 only with --config.train.offload_optimizer=true")
        if self.delayed:  # the previous step's gradients, waiting in host memory as the optimizer's slice
            opt_specs["pending"] = {"grads": self.layout.optimizer, "norm": P(), "ok": P()}
        if self.offload:
            check_host_memory(self.mesh)
            opt_specs = jax.tree.map(lambda s: NamedSharding(self.mesh, s, memory_kind=HOST_MEMORY), opt_specs,
                                     is_leaf=lambda x: isinstance(x, P))
        # As partition takes them: PartitionSpecs, and the offloaded optimizer state's NamedShardings in host memory.
        self.state_specs = {"params": self.layout.stored, "opt_state": opt_specs, "step": P()}

    def _steps(self, cfg, t, batch_spec, shards) -> None:
        """The step functions with their static config bound, partitioned on the mesh (mesh.auto: the state's
        shardings chosen first)."""
        self.batch_spec = P(*batch_spec)
        self.shards = shards  # the batch's shards: soft failures are counted per shard
        self.step_config = steps.StepConfig(
            model=self.model, eval_model=self.eval_model, init_model=self.init_model, kind=cfg.model.kind,
            opt=self.opt, schedule=self.schedule, layout=self.layout, layer_order=self.layer_order, train=t,
            nan_at_step=cfg.debug.nan_at_step, pipeline=self.pipeline, shards=shards, master=self.master,
            offload=self.offload, delayed=self.delayed)
        # The step functions with their static config bound: what partition, explain and jit take.
        self.init_state = functools.partial(steps.init_state, c=self.step_config)
        self.train_step = functools.partial(steps.train_step, c=self.step_config)
        self.update = functools.partial(steps.update, c=self.step_config)
        self.eval_step = functools.partial(steps.eval_step, c=self.step_config)
        self.auto_notes: list[str] = []  # mesh.auto: how the state's shardings were chosen
        if self.auto:
            start = time.perf_counter()
            windows = np.zeros((t.batch_size, self.length), np.int32)
            batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in data.model_batch(cfg.model.kind,
                                                                                             windows).items()}
            self.state_specs = state_layout.chosen(self.train_step, self.init_state, batch, self.mesh,
                                                   self.batch_spec, cfg.mesh.memory_budget)
            self.auto_notes.append(f"mesh.auto: the state's shardings chosen in {time.perf_counter() - start:.1f} s")
        self.step_outs = (self.state_specs, P())  # the train step's: the metrics replicated, read by every process
        # The state is donated, as plain JAX's train steps do: its buffers become the next state's, so a step
        # holds one copy of the params and optimizer state, not two. The caller must not read it afterwards.
        self.step_fn = self.partitioned("train", donate_argnums=0)
        self.eval_fn = self.partitioned("eval")
        self.init_fn = self.partitioned("init")

    def partitioned(self, which: str, backend: str = "gshard", **kw):
        """The train, optimizer-update, eval or init step partitioned on the mesh with the state's shardings fixed."""
        fn, ins, outs = {"train": (self.train_step, (self.state_specs, self.batch_spec), self.step_outs),
                         "update": (self.update, (self.state_specs, self.layout.gradients), self.state_specs),
                         "eval": (self.eval_step, (self.state_specs["params"], self.batch_spec), None),
                         "init": (self.init_state, None, self.state_specs)}[which]
        if self.auto and backend == "gshard":  # the values in the step: chosen, with the state's shardings fixed
            kw = dict(kw, auto=True, memory_budget=self.cfg.mesh.memory_budget or None)
        return gs.partition(fn, self.mesh, in_shardings=ins, out_shardings=outs, backend=backend, **kw)

    def explain(self, state: dict, batch: dict, compile: bool = True) -> gs.Report:
        """The train step's partition report, with argument memory by kind (params, optimizer state, batch)
        and, when compiled, XLA's memory_analysis()."""
        ins, outs = (self.state_specs, self.batch_spec), self.step_outs
        report = gs.explain(self.train_step, self.mesh, state, batch, in_shardings=ins, out_shardings=outs,
                            auto=self.auto, memory_budget=(self.cfg.mesh.memory_budget or None) if self.auto else None,
                            donate_argnums=0)
        report.notes = self.auto_notes + report.notes
        report.kind_of = state_kind
        if compile:
            report.attach_compiled(self.step_fn.lower(state, batch).compile())
        return report

    def in_memory(self, state: Any) -> Any:
        """Abstract state (ShapeDtypeStructs, jax.eval_shape's) with the offloaded optimizer state's leaves in
        host memory, as the step receives them."""
        if not self.offload:
            return state
        opt = jax.tree.map(lambda s, x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                           self.state_specs["opt_state"], state["opt_state"],
                           is_leaf=lambda x: isinstance(x, NamedSharding))
        return dict(state, opt_state=opt)

    # ------------------------------------------------------------------ host side
    def batch(self, tokens: data.TokenData, split: str, step: int) -> dict:
        """The global batch of `step`, built from this process's rows (held-out windows drawn by
        data.eval_seed, so runs of different train.seed are evaluated on the same text)."""
        t = self.cfg.train
        per = t.batch_size // jax.process_count()
        me = jax.process_index()
        seed = self.cfg.data.eval_seed if split == "eval" else t.seed
        local = tokens.windows(split, seed, step, t.batch_size, self.length, me * per, (me + 1) * per)
        rows = data.model_batch(self.cfg.model.kind, local)
        fault = faults.fault_rows(self.cfg.debug, step, per) if split == "train" else None
        if fault is not None:
            rows["soft_fail"] = fault[:, None]
        return {k: jax.make_array_from_process_local_data(self.batch_sharding, v, (t.batch_size,) + v.shape[1:])
                for k, v in rows.items()}

    def relay(self, tree: dict, src: dict, dst: dict) -> dict:
        """A state (or {"params": ...}) with its stack and ends moved from storage order src to dst."""
        flags, ends = self.layout.stacked, self.layout.ends

        def move(params_like):
            return pipelined.reorder(params_like, flags, src, dst, ends)

        def move_opt(opt_state):
            return optax.tree_utils.tree_map_params(
                self.opt, lambda leaf, flag, end: pipelined.reorder(leaf, flag, src, dst, end), opt_state, flags,
                ends, transform_non_params=lambda x: x)

        out = dict(tree, params=move(tree["params"]))
        if "opt_state" in tree:
            o = tree["opt_state"]
            out["opt_state"] = {"master": move(o["master"]), "adam": move_opt(o["adam"])} if self.master \
                else move_opt(o)
            if "pending" in o:
                out["opt_state"]["pending"] = dict(o["pending"], grads=move(o["pending"]["grads"]))
        return out

    def from_checkpoint(self, tree: dict, saved: dict) -> dict:
        """A restored state (or {"params": ...}) re-laid from the layer order its checkpoint recorded to this
        run's (a circular pipeline's stack moving to another stage or repeat count, or to none; the ends, saved
        as their owners' slices, stacked once per stage where this run's end stages own them)."""
        src = saved.get("layer_order", pipelined.order_key(None))
        if src == self.layer_order:
            return tree
        specs = self.state_specs if "opt_state" in tree else {"params": self.state_specs["params"]}
        shardings = jax.tree.map(lambda s: s if isinstance(s, NamedSharding) else NamedSharding(self.mesh, s), specs,
                                 is_leaf=lambda x: isinstance(x, (P, NamedSharding)))
        log.info("checkpoint layer order %s re-laid to %s", src, self.layer_order)
        return jax.jit(lambda t: self.relay(t, src, self.layer_order), out_shardings=shardings)(tree)

    def to_checkpoint(self, tree: dict) -> dict:
        """The state (or {"params": ...}) as checkpoints hold it: each stage-owned end as its owner's slice, so
        a checkpoint's shapes do not depend on the stage count (the rest is the state's own arrays)."""
        if self.end_stages == 1:
            return tree
        return self.relay(tree, self.layer_order, self.saved_order)  # the stack's order is the same in both

    def fresh_state(self) -> dict:
        return self.init_fn(jax.random.key(self.cfg.train.seed))

    def evaluate(self, tokens: data.TokenData, params: Any) -> float:
        losses = [self.eval_fn(params, self.batch(tokens, "eval", i)) for i in range(self.cfg.train.eval_batches)]
        return float(np.mean([float(x) for x in losses]))


HOST_MEMORY = "pinned_host"  # the memory kind an offloaded optimizer state lives in


def check_host_memory(mesh) -> None:
    """train.offload_optimizer needs a pinned_host memory on the mesh's devices (an AbstractMesh, which the
    planner explains, has no devices to ask)."""
    if isinstance(mesh, jax.sharding.AbstractMesh):
        return
    device = mesh.devices.flat[0]
    kinds = sorted(m.kind for m in device.addressable_memories())
    if HOST_MEMORY not in kinds:
        raise ValueError(f"train.offload_optimizer=True keeps the optimizer state in {HOST_MEMORY!r} memory, but "
                         f"{device.platform} device {device.id} has only {kinds}; set "
                         f"--config.train.offload_optimizer=false, or shard the state instead (train.zero_stage=1)")


def state_kind(name: str) -> str:
    """The memory kind of a train step's input, by its name: params, optimizer state, batch or step."""
    for key, kind in (("['params']", "params"), ("['opt_state']", "optimizer"), ("['step']", "step")):
        if name.startswith("state" + key):
            return kind
    return "batch" if name.startswith("batch") else name.split("[")[0]


def prepare_data(cfg: configs.Config, workdir: str) -> data.TokenData:
    """The run's token data: cfg.data.dir if given, else WORKDIR/data, prepared on first use (process 0)."""
    d = cfg.data.dir or os.path.join(workdir, "data")
    vocab = cfg.model.transformer.vocab_size
    if not os.path.exists(os.path.join(d, data.META)):
        if jax.process_index() == 0:
            log.info("preparing token data in %s from %s", d, cfg.data.source or "the Python standard library")
            data.prepare(d, vocab, src=cfg.data.source or None, tokenizer=cfg.data.tokenizer or None,
                         held_out=cfg.data.held_out, seed=cfg.train.seed, max_bytes=cfg.data.max_bytes)
        _sync("data prepared")
    tokens = data.TokenData(d)
    if tokens.meta["tokenizer_vocab"] > vocab:
        raise ValueError(f"the data in {d} has {tokens.meta['tokenizer_vocab']} token ids but model.vocab_size is "
                         f"{vocab}")
    return tokens


def step_inputs(cfg: configs.Config | ml_collections.ConfigDict, workdir: str) -> tuple[Trainer, dict, dict]:
    """A trainer with a fresh state and the first train batch: the arguments explain and compare use."""
    cfg = configs.typed(cfg)
    trainer = Trainer(cfg, workdir)
    return trainer, trainer.fresh_state(), trainer.batch(prepare_data(cfg, workdir), "train", 1)


def _sync(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(name)
