"""What a run does about failures, besides checkpoints: faults injected for tests and drills
(config.debug), a heartbeat that `gshard-jax launch` watches, and preemption (SIGTERM) turned into a
checkpoint at the next step boundary and a distinct exit status.

A process runs on a *node*: under the supervisor, the node number it was given (GSHARD_JAX_NODE), else its
process index. Faults are injected by node, so the spare that replaces a failed node does not fail again.
"""
from __future__ import annotations

import os
import signal
import time
from typing import Optional

import jax
import ml_collections

EXIT_PREEMPTED = 75  # saved a checkpoint on SIGTERM and stopped: rerun to resume (EX_TEMPFAIL)
EXIT_INJECTED = 13  # debug.fail_process died at debug.fail_at_step, as a node would
NODE_ENV = "GSHARD_JAX_NODE"
HEARTBEAT_ENV = "GSHARD_JAX_HEARTBEAT"  # a directory: each process writes its last dispatched step there


def die_with_parent() -> None:
    """In a child process: on Linux, die when the parent dies, even by SIGKILL (no orphans left behind)."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux: the parent's own cleanup stops its children


def node() -> int:
    return int(os.environ.get(NODE_ENV, jax.process_index()))


class Preempted(RuntimeError):
    """SIGTERM: a full checkpoint of `step` was saved; the rerun resumes there."""

    def __init__(self, step: int):
        self.step = step
        super().__init__(f"preempted (SIGTERM): saved a full checkpoint at step {step}; rerun to resume "
                         f"(exit status {EXIT_PREEMPTED})")


class Faults:
    """Per step: the injected faults of this node, the heartbeat, and whether to stop for preemption."""

    def __init__(self, debug: ml_collections.ConfigDict):
        self.debug, self.node = debug, node()
        beat = os.environ.get(HEARTBEAT_ENV, "")
        self.beat_path = os.path.join(beat, f"{jax.process_index()}.step") if beat else ""
        self.multi = jax.process_count() > 1
        self.term = False
        self.previous: Optional[object] = None
        if not self.multi:  # several processes: jax.distributed's preemption service watches SIGTERM
            self.previous = signal.signal(signal.SIGTERM, self._on_term)

    def _on_term(self, signum, frame) -> None:
        self.term = True

    def close(self) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)

    def before(self, step: int) -> None:
        """At the start of `step`: die or hang if this node is told to; beat."""
        d = self.debug
        if self.node == d.get("fail_process", -1):
            if step == d.get("fail_at_step", -1):
                os._exit(EXIT_INJECTED)  # no cleanup: what a dead node leaves behind
            if step == d.get("hang_at_step", -1):
                while True:  # stops answering: its peers wait in their next collective
                    time.sleep(3600)
        if self.beat_path:
            with open(self.beat_path + ".tmp", "w") as f:
                f.write(str(step))
            os.replace(self.beat_path + ".tmp", self.beat_path)

    def preempted(self, step: int) -> bool:
        """Whether every process stops after `step` (the same answer on all of them)."""
        if self.multi:
            from jax.experimental import multihost_utils
            return multihost_utils.reached_preemption_sync_point(step)
        return self.term
