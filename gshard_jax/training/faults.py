"""What a run does about failures, besides checkpoints: faults injected for tests and drills
(config.debug), a heartbeat that `gshard-jax launch` watches, preemption (SIGTERM) turned into a
checkpoint at the next step boundary and a distinct exit status, and non-finite steps named by the
devices whose rows went non-finite (soft failures).

Soft failures: the global-view step cannot read one device's gradient before the partitioned reduction, but
every device's contribution to the weight gradients is computed from its own batch rows' activations and
cotangents. The train step therefore watches each row where the model embeds it: a zero probe per row is
added there, and the probe's gradient (the row's cotangent summed) is non-finite when the row's
backward signal is, after every layer above has contributed, and when its forward was (the loss's backward
carries a NaN forward value back down the same row). Rows of one MoE routing group share a NaN (dispatch
and combine multiply by one-hot masks, and NaN x 0 is NaN), so a group spanning rows is counted whole.
Rows are counted per batch shard before any reduction; a shard names the devices that hold it, and they
their processes. A non-finite value that first arises inside a reduction (an overflow in the sum itself)
names no shard, and the message says so.

A process runs on a *node*: under the supervisor, the node number it was given (GSHARD_JAX_NODE), else its
process index. Faults are injected by node, so the spare that replaces a failed node does not fail again.
"""
from __future__ import annotations

import json
import os
import signal
import time
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from ..configs import DebugConfig

EXIT_PREEMPTED = 75  # saved a checkpoint on SIGTERM and stopped: rerun to resume (EX_TEMPFAIL)
EXIT_INJECTED = 13  # debug.fail_process died at debug.fail_at_step, as a node would
NODE_ENV = "GSHARD_JAX_NODE"
HEARTBEAT_ENV = "GSHARD_JAX_HEARTBEAT"  # a directory: each process writes its last dispatched step there
SOFT_FAILURE = "soft_failure.{}.json"  # beside the heartbeat: the shards process {} found non-finite, for launch


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

    def __init__(self, debug: DebugConfig):
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
        if self.node == d.fail_process:
            if step == d.fail_at_step:
                os._exit(EXIT_INJECTED)  # no cleanup: what a dead node leaves behind
            if step == d.hang_at_step:
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


# ---------------------------------------------------------------------------------- soft failures, per row
@jax.custom_vjp
def _scale_cotangent(x, scale_B):
    return x


def _scale_fwd(x, scale_B):
    return x, scale_B


def _scale_bwd(scale_B, g):
    return g * _rows(scale_B, g).astype(g.dtype), jnp.zeros_like(scale_B)


_scale_cotangent.defvjp(_scale_fwd, _scale_bwd)


def _rows(v_B: jax.Array, like: jax.Array) -> jax.Array:
    return v_B.reshape(v_B.shape + (1,) * (like.ndim - 1))


def watch_rows(x_B: jax.Array, probe_B: jax.Array, fault_B: Optional[jax.Array] = None) -> jax.Array:
    """x unchanged. The gradient of the zero `probe_B` is each row's cotangent at x, summed; `fault_B`
    (debug.soft_fail_process: 1, or NaN on the failing node's rows) multiplies that cotangent first, as a
    node whose backward went bad would."""
    x_B = x_B + _rows(probe_B, x_B).astype(x_B.dtype)
    return x_B if fault_B is None else _scale_cotangent(x_B, fault_B)


# the methods whose output rows are watched, and the dim the rows are on: the embedding's lookup, and its
# per-stage lookup under a pipeline with stage-owned ends ([stages, B, ...]: each stage's rows)
WATCHED = {"__call__": 0, "per_stage": 1}


def row_watcher(module_type: type, probe_B: jax.Array, fault_B: Optional[jax.Array] = None):
    """A flax method interceptor that watches the rows of every output of `module_type`'s WATCHED methods (the
    embedding: below it every row's whole backward has been computed)."""
    def intercept(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        dim = WATCHED.get(context.method_name) if isinstance(context.module, module_type) else None
        if dim == 0:
            out = watch_rows(out, probe_B, fault_B)
        elif dim is not None:
            out = jax.vmap(lambda x: watch_rows(x, probe_B, fault_B), in_axes=0)(out)
        return out
    return intercept


def nonfinite_per_shard(probe_grad_B: jax.Array, shards: int) -> jax.Array:
    """[shards] count of rows whose probe gradient is non-finite; row b is in shard b // (B / shards), the
    batch's own split, so each device counts only its rows."""
    bad_B = jnp.logical_not(jnp.isfinite(probe_grad_B)).astype(jnp.int32)
    return bad_B.reshape(shards, -1).sum(axis=1)


def fault_rows(debug: DebugConfig, step: int, rows: int) -> Optional[np.ndarray]:
    """This process's rows of the injected soft failure (None when none is configured): NaN on the failing
    node at its step, else 1."""
    if debug.soft_fail_process < 0:
        return None
    bad = node() == debug.soft_fail_process and step == debug.soft_fail_at_step
    return np.full([rows], np.nan if bad else 1.0, np.float32)


def name_shards(bad_S: np.ndarray, sharding: jax.sharding.Sharding, shape: tuple) -> list[dict]:
    """The shards with non-finite rows, each with its devices and their processes (the batch's sharding
    places shard s, rows [s B/S, (s+1) B/S), on the devices named)."""
    per = shape[0] // len(bad_S)
    held: dict[int, list] = {}
    for d, index in sharding.devices_indices_map(shape).items():
        held.setdefault((index[0].start or 0) // per, []).append(d)
    return [{"shard": s, "rows": int(n), "devices": sorted(d.id for d in held[s]),
             "processes": sorted({d.process_index for d in held[s]})}
            for s, n in enumerate(bad_S) if n]


def describe(culprits: list[dict]) -> str:
    if not culprits:
        return ("no batch shard's rows were non-finite: the value arose after them (in a reduction or the "
                "optimizer update), which names no device")
    by: dict[tuple, list[dict]] = {}  # one clause per process group (a shard may span processes)
    for c in culprits:
        by.setdefault(tuple(c["processes"]), []).append(c)
    return "non-finite rows in " + "; ".join(
        f"batch shards {[c['shard'] for c in cs]} ({sum(c['rows'] for c in cs)} rows), held by devices "
        f"{sorted(d for c in cs for d in c['devices'])} of process{'es' if len(ps) > 1 else ''} "
        f"{', '.join(map(str, ps))}" for ps, cs in by.items())


def report_soft_failure(step: int, culprits: list[dict]) -> None:
    """Under `gshard-jax launch`: tell the supervisor which processes went non-finite (it replaces their nodes)."""
    beat = os.environ.get(HEARTBEAT_ENV, "")
    if not beat or not culprits:
        return
    path = os.path.join(beat, SOFT_FAILURE.format(jax.process_index()))
    with open(path + ".tmp", "w") as f:
        json.dump({"step": step, "node": node(), "culprits": culprits}, f)
    os.replace(path + ".tmp", path)
