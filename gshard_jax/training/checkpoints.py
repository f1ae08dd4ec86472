"""Checkpoints of a run (orbax-checkpoint): full ones to resume from, model-only ones to keep.

``WORKDIR/checkpoints`` holds full checkpoints (params, optimiser state, step)
every ``checkpoint_every`` steps, the two newest kept (dual checkpointing: a
crash while writing one leaves the other). ``WORKDIR/model_checkpoints`` holds
params every ``model_checkpoint_every`` steps, kept for good. Saves are
asynchronous; orbax writes each to a temporary directory and renames it when
complete, so an interrupted write is never listed. A run resumes from the
newest full checkpoint that restores; a damaged one is skipped for the one
before, with a warning naming it. Restoring places every array as the
caller's template says, so a run may resume on a different mesh. Each save
carries the caller's metadata (the stored order of the layer stack), and a
restore hands it to the caller's ``adapt`` to re-lay what it read.

With several processes, writes are spread over the replicas and reads are left to one host group:
- *Scattered writes*: an array replicated over R devices is written by all R, each a 1/R slice (orbax's
  replica-parallel saving, which orbax turns off by default on GPUs; ``replica_parallel`` sets it on every
  platform). Without it, replica 0 of every shard writes it all.
- *Single reads*: when every process's devices lie at one index of the mesh's first axis (a *host group*:
  the processes of one data-parallel replica), the arrays replicated over that axis are read by host group
  0 alone and broadcast to the others over the devices' collectives (orbax's single-replica restore).
  Arrays split over that axis (ZeRO states) are read once anyway, each part by its holder.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Callable, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as policies

from ..models.logical import axes_of

log = logging.getLogger("gshard_jax")


def _handler(array_handler: Any) -> ocp.PyTreeCheckpointHandler:
    """orbax's pytree handler with `array_handler` for jax.Arrays (its other types as orbax's defaults)."""
    th = ocp.type_handlers
    registry = th.create_type_handler_registry(
        *[(t, th.get_type_handler(t)) for t in (int, float, np.number, np.ndarray, str, type(ocp.PLACEHOLDER))],
        (jax.Array, array_handler))
    return ocp.PyTreeCheckpointHandler(type_handler_registry=registry)


def _manager(path: str, every: int, keep: Optional[int], async_save: bool, name: str,
             replica_parallel: bool) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(
        save_decision_policy=policies.FixedIntervalPolicy(max(1, every)),
        preservation_policy=policies.LatestN(keep) if keep else policies.preservation_policy.PreserveAll(),
        enable_async_checkpointing=async_save, cleanup_tmp_directories=True, create=True,
        # Two series may save the same step at once: their cross-process barriers need distinct names.
        multiprocessing_options=ocp.options.MultiprocessingOptions(barrier_sync_key_prefix=name))
    arrays = ocp.type_handlers.ArrayHandler(use_replica_parallel=replica_parallel)
    return ocp.CheckpointManager(os.path.abspath(path), options=options, item_handlers=_handler(arrays))


def host_groups(mesh: jax.sharding.Mesh) -> Optional[int]:
    """The number of host groups along the mesh's first axis, when every process's devices lie at one index
    of it and there are several such groups (single reads apply); None otherwise."""
    if jax.process_count() == 1 or mesh.devices.shape[0] == 1:
        return None
    index_of = {}
    for i, plane in enumerate(mesh.devices):
        for d in np.ravel(plane):
            if index_of.setdefault(d.process_index, i) != i:
                return None
    return mesh.devices.shape[0]


def _replicated_leaves(abstract: Any) -> Optional[Callable[[Any], bool]]:
    """Which leaves one host group reads and broadcasts (those replicated over the first axis of a mesh with
    host groups), or None when no leaf is."""
    leaves = jax.tree.leaves(abstract)
    mesh = getattr(leaves[0].sharding, "mesh", None) if leaves else None
    if mesh is None or host_groups(mesh) is None:
        return None
    first = mesh.axis_names[0]

    def replicated(x) -> bool:
        spec = getattr(x.sharding, "spec", None)
        return spec is not None and x.sharding.mesh == mesh and all(first not in axes_of(e) for e in spec)
    return replicated if any(replicated(x) for x in leaves) else None


def _omit(tree: Any, keep: Callable[[Any], bool]) -> Any:
    """The nested dicts of `tree` with the leaves `keep` accepts (None when none): a partial restore reads
    exactly the leaves it is given, and ignores PLACEHOLDER."""
    if isinstance(tree, dict):
        kept = {k: _omit(v, keep) for k, v in tree.items()}
        return {k: v for k, v in kept.items() if v is not None} or None
    if isinstance(tree, (list, tuple)):
        raise TypeError(f"a partial single read takes nested dicts, not {type(tree).__name__}")
    return tree if keep(tree) else None


def _merge(a: Any, b: Any) -> Any:
    if a is None or b is None:
        return b if a is None else a
    return {k: _merge(a.get(k), b.get(k)) for k in {**a, **b}}


class Checkpoints:
    """The run's two checkpoint series."""

    def __init__(self, workdir: str, full_every: int, model_every: int, async_save: bool = True,
                 metadata: Optional[dict] = None, replica_parallel: bool = True, single_read: bool = True):
        self.metadata = dict(metadata or {})  # saved with every checkpoint, handed to adapt() on restore
        self.single_read = single_read
        self.full = _manager(os.path.join(workdir, "checkpoints"), full_every, 2, async_save, "full",
                             replica_parallel)
        self.model = _manager(os.path.join(workdir, "model_checkpoints"), model_every, None, async_save, "model",
                              replica_parallel)

    def should_save(self, step: int) -> bool:
        """Whether save(step) writes a checkpoint (full or model-only) by the save policies."""
        return self.full.should_save(step) or self.model.should_save(step)

    def save(self, step: int, state: dict, force: bool = False) -> None:
        """Offer `state` at `step` to both series (each saves when its interval says, or when forced)."""
        meta = self.metadata or None
        self.full.save(step, args=ocp.args.PyTreeSave(state), force=force, custom_metadata=meta)
        self.model.save(step, args=ocp.args.PyTreeSave({"params": state["params"]}), force=force,
                        custom_metadata=meta)

    def save_now(self, step: int, state: dict) -> None:
        """A full checkpoint of `step` now (preemption), unless the interval saved it already; then wait."""
        if step not in self.full.all_steps():
            self.full.save(step, args=ocp.args.PyTreeSave(state), force=True,
                           custom_metadata=self.metadata or None)
        self.wait()

    def restore_latest(self, template: dict, adapt: Optional[Callable] = None) -> Optional[tuple[int, dict]]:
        """(step, state) from the newest full checkpoint that restores, placed like `template` and passed
        through adapt(state, its saved metadata); None if none."""
        abstract = _abstract(template)
        return _newest_restorable([(s, self.full) for s in self.full.all_steps()],
                                  lambda mgr, step: self._restore(mgr, step, abstract), adapt)

    def restore_params(self, template: Any, adapt: Optional[Callable] = None) -> Optional[tuple[int, Any]]:
        """(step, params) from the newest full or model-only checkpoint, placed like `template` and passed
        through adapt({"params": params}, its saved metadata)."""
        abstract = {"params": _abstract(template)}
        found = _newest_restorable([(s, m) for m in (self.full, self.model) for s in m.all_steps()],
                                   lambda mgr, step: self._restore(mgr, step, abstract, partial=True), adapt)
        return None if found is None else (found[0], found[1]["params"])

    def _restore(self, mgr: ocp.CheckpointManager, step: int, abstract: Any, partial: bool = False) -> Any:
        """`abstract`'s arrays from checkpoint `step`: the ones replicated over host groups read by group 0 and
        broadcast (single reads), the rest by their holders. A single read that fails is retried the plain
        way (every process reads what it holds) before the checkpoint counts as damaged."""
        replicated = _replicated_leaves(abstract) if self.single_read else None
        if replicated is not None:
            try:
                return self._single_read(mgr, step, abstract, replicated, partial)
            except Exception as e:
                log.warning("single read of %s failed (%s: %s); every process reads what it holds",
                            os.path.join(str(mgr.directory), str(step)), type(e).__name__, str(e)[:200])
        return mgr.restore(step, args=ocp.args.PyTreeRestore(
            abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract), partial_restore=partial))

    def _single_read(self, mgr: ocp.CheckpointManager, step: int, abstract: Any, replicated: Callable,
                     partial: bool) -> Any:
        """Two reads: the replicated leaves by host group 0 (broadcast), the rest by their holders. A full
        restore masks each read's other leaves with PLACEHOLDER; a partial one leaves them out."""
        th = ocp.type_handlers
        single_args = lambda x: th.SingleReplicaArrayRestoreArgs(sharding=x.sharding, global_shape=x.shape,
                                                                 dtype=x.dtype)
        if partial:
            shared_item, own_item = _omit(abstract, replicated), _omit(abstract, lambda x: not replicated(x))
            shared_args = jax.tree.map(single_args, shared_item)
        else:
            shared_item = jax.tree.map(lambda x: x if replicated(x) else ocp.PLACEHOLDER, abstract)
            own_item = jax.tree.map(lambda x: ocp.PLACEHOLDER if replicated(x) else x, abstract)
            shared_args = jax.tree.map(lambda x: single_args(x) if replicated(x)
                                       else th.ArrayRestoreArgs(sharding=x.sharding), abstract)
        reader = ocp.Checkpointer(_handler(th.SingleReplicaArrayHandler(replica_axis_index=0, primary_replica_id=0)))
        shared = reader.restore(os.path.join(str(mgr.directory), str(step), "default"),
                                args=ocp.args.PyTreeRestore(shared_item, restore_args=shared_args,
                                                            partial_restore=partial))
        own = None
        if own_item is not None:
            own = mgr.restore(step, args=ocp.args.PyTreeRestore(
                own_item, restore_args=ocp.checkpoint_utils.construct_restore_args(own_item if partial else abstract),
                partial_restore=partial))
        if partial:
            return _merge(shared, own)
        return jax.tree.map(lambda a, b: b if a is ocp.PLACEHOLDER else a, shared, own)

    def wait(self) -> None:
        self.full.wait_until_finished()
        self.model.wait_until_finished()

    def close(self) -> None:
        self.full.close()
        self.model.close()


def bytes_read() -> int:
    """Bytes this process's read calls have returned so far (Linux's rchar; 0 elsewhere)."""
    try:
        with open("/proc/self/io") as f:
            return int(next(line for line in f if line.startswith("rchar")).split()[1])
    except (OSError, StopIteration):
        return 0


def _abstract(template: Any) -> Any:
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, template)


def _saved_metadata(mgr: ocp.CheckpointManager, step: int) -> dict:
    return dict(mgr.metadata(step).custom_metadata or {})


def _newest_restorable(candidates: list, restore, adapt: Optional[Callable] = None) -> Optional[tuple[int, Any]]:
    """(step, restored) from the newest (step, manager) candidate that restores; damaged or partial files
    are skipped for the one before, with a warning naming the checkpoint."""
    for step, mgr in sorted(candidates, key=lambda c: c[0], reverse=True):
        try:
            restored, meta = restore(mgr, step), _saved_metadata(mgr, step)
        except Exception as e:
            log.warning("checkpoint %s is damaged and was skipped (%s: %s); trying the one before",
                        os.path.join(str(mgr.directory), str(step)), type(e).__name__,
                        str(e).splitlines()[0][:200] if str(e) else "")
            continue
        return step, restored if adapt is None else adapt(restored, meta)  # its errors are the caller's
    return None
