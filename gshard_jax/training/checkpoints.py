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
"""
from __future__ import annotations

import logging
import os
from typing import Any, Callable, Optional

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as policies

log = logging.getLogger("gshard_jax")


def _manager(path: str, every: int, keep: Optional[int], async_save: bool, name: str) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(
        save_decision_policy=policies.FixedIntervalPolicy(max(1, every)),
        preservation_policy=policies.LatestN(keep) if keep else policies.preservation_policy.PreserveAll(),
        enable_async_checkpointing=async_save, cleanup_tmp_directories=True, create=True,
        # Two series may save the same step at once: their cross-process barriers need distinct names.
        multiprocessing_options=ocp.options.MultiprocessingOptions(barrier_sync_key_prefix=name))
    return ocp.CheckpointManager(os.path.abspath(path), options=options)


class Checkpoints:
    """The run's two checkpoint series."""

    def __init__(self, workdir: str, full_every: int, model_every: int, async_save: bool = True,
                 metadata: Optional[dict] = None):
        self.metadata = dict(metadata or {})  # saved with every checkpoint, handed to adapt() on restore
        self.full = _manager(os.path.join(workdir, "checkpoints"), full_every, 2, async_save, "full")
        self.model = _manager(os.path.join(workdir, "model_checkpoints"), model_every, None, async_save, "model")

    def should_save(self, step: int) -> bool:
        """Whether save(step) writes a checkpoint (full or model-only) by the save policies."""
        return self.full.should_save(step) or self.model.should_save(step)

    def save(self, step: int, state: dict, force: bool = False) -> None:
        """Offer `state` at `step` to both series (each saves when its interval says, or when forced)."""
        meta = self.metadata or None
        self.full.save(step, args=ocp.args.StandardSave(state), force=force, custom_metadata=meta)
        self.model.save(step, args=ocp.args.StandardSave({"params": state["params"]}), force=force,
                        custom_metadata=meta)

    def save_now(self, step: int, state: dict) -> None:
        """A full checkpoint of `step` now (preemption), unless the interval saved it already; then wait."""
        if step not in self.full.all_steps():
            self.full.save(step, args=ocp.args.StandardSave(state), force=True,
                           custom_metadata=self.metadata or None)
        self.wait()

    def restore_latest(self, template: dict, adapt: Optional[Callable] = None) -> Optional[tuple[int, dict]]:
        """(step, state) from the newest full checkpoint that restores, placed like `template` and passed
        through adapt(state, its saved metadata); None if none."""
        abstract = _abstract(template)
        return _newest_restorable([(s, self.full) for s in self.full.all_steps()],
                                  lambda mgr, step: mgr.restore(step, args=ocp.args.StandardRestore(abstract)),
                                  adapt)

    def restore_params(self, template: Any, adapt: Optional[Callable] = None) -> Optional[tuple[int, Any]]:
        """(step, params) from the newest full or model-only checkpoint, placed like `template` and passed
        through adapt({"params": params}, its saved metadata)."""
        abstract = {"params": _abstract(template)}
        args = ocp.args.PyTreeRestore(abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract),
                                      partial_restore=True)
        found = _newest_restorable([(s, m) for m in (self.full, self.model) for s in m.all_steps()],
                                   lambda mgr, step: mgr.restore(step, args=args), adapt)
        return None if found is None else (found[0], found[1]["params"])

    def wait(self) -> None:
        self.full.wait_until_finished()
        self.model.wait_until_finished()

    def close(self) -> None:
        self.full.close()
        self.model.close()


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
