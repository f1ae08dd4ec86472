"""Pipeline schedules as tables: which microbatch (and repeat) each stage runs at each tick.

A schedule is data. gs.pipeline's loop reads a row per tick; the tests read
the same tables for the bubble and the stash bound. All schedules run in
lockstep (SPMD): every stage does the same work each tick, bubble slots on
zeros whose results are discarded, and activations move one stage per tick
by a roll of the stage dim.

Forward order (GPipe, r = 1; circular, r > 1; MaxText and Praxis): stage s
at tick t runs virtual index v = t - s; microbatches go in groups of p
through every repeat, so microbatch i = g p + j reaches stage s of repeat k
at tick g p r + k p + j + s, and the last stage's output rolls straight into
stage 0 of the next repeat. m r + p - 1 ticks.

1F1B (r = 1) and interleaved 1F1B (r > 1) add a backward wave running the
other way: the backward of virtual stage u = k p + s (of m.b. i) is at tick
g p r + j + 2(r p - 1) - u, so the last virtual stage runs forward and
backward of a microbatch in the same tick and gradients roll down one stage
per tick. A forward input waits 2(r p - 1 - u) ticks for its backward, so a
ring buffer of 2 r p - 1 slots per stage holds every stash whatever m is.
Ticks split into warmup (forward only), steady (both) and cooldown
(backward only): (m r + p - 1) forward and as many backward ticks, the same
bubble as GPipe's, (p - 1) / (m r + p - 1).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

SCHEDULES = ("gpipe", "circular", "1f1b", "interleaved_1f1b")
OWN_BACKWARD = ("1f1b", "interleaved_1f1b")  # schedules whose backward pass the pipeline runs itself


@dataclasses.dataclass(frozen=True)
class Wave:
    """One direction's table: per tick and stage, the microbatch and repeat run (-1 in bubble slots)."""

    microbatch: np.ndarray  # [T, p] int
    repeat: np.ndarray  # [T, p] int
    slot: np.ndarray  # [T, p] int: the stash slot written (forward) or read (backward)

    @property
    def valid(self) -> np.ndarray:
        return self.microbatch >= 0

    def busy_ticks(self) -> np.ndarray:
        """The ticks at which some stage runs a real microbatch."""
        return np.nonzero(self.valid.any(axis=1))[0]


@dataclasses.dataclass(frozen=True)
class Schedule:
    name: str
    stages: int  # p
    microbatches: int  # m
    repeats: int  # r (layer chunks per stage; 1 unless circular or interleaved)
    forward: Wave
    backward: Optional[Wave]  # None: the backward is autodiff's, through the forward loop
    stash: int  # ring-buffer slots per stage (1F1B family), 0 otherwise

    @property
    def ticks(self) -> int:
        return int(self.forward.microbatch.shape[0])

    @property
    def phases(self) -> tuple[range, range, range]:
        """(warmup, steady, cooldown) tick ranges: forward only, both waves, backward only."""
        if self.backward is None:
            return range(0, self.ticks), range(0), range(0)
        f, b = self.forward.busy_ticks(), self.backward.busy_ticks()
        first_b, last_f = int(b[0]), int(f[-1])
        return range(0, first_b), range(first_b, last_f + 1), range(last_f + 1, self.ticks)

    @property
    def bubble(self) -> float:
        """Idle fraction of stage-ticks, from the table (forward and backward slots counted alike)."""
        waves = [self.forward] + ([self.backward] if self.backward is not None else [])
        slots = sum(len(self._ticks_of(w)) * self.stages for w in waves)
        return 1.0 - sum(int(w.valid.sum()) for w in waves) / slots

    @property
    def theory(self) -> float:
        """The schedule's bubble by formula: (p - 1) / (m r + p - 1)."""
        return (self.stages - 1) / (self.microbatches * self.repeats + self.stages - 1)

    def _ticks_of(self, wave: Wave) -> range:
        warm, steady, cool = self.phases
        if self.backward is None:
            return warm
        return range(warm.start, steady.stop) if wave is self.forward else range(steady.start, cool.stop)

    def summary(self) -> dict:
        """The schedule as explain() reports it."""
        return {"schedule": self.name, "stages": self.stages, "microbatches": self.microbatches,
                "repeats": self.repeats, "ticks": self.ticks, "bubble": self.bubble, "stash": self.stash,
                "text": self.describe()}

    def describe(self) -> str:
        p, m, r = self.stages, self.microbatches, self.repeats
        return (f"{self.name}: {p} stages, {m} microbatches" + (f", {r} repeats" if r > 1 else "")
                + f", {self.ticks} ticks, bubble {self.bubble:.1%}"
                + (f", stash {self.stash} per stage" if self.stash else ""))


def check(name: str, stages: int, microbatches: int, repeats: int) -> None:
    """A ValueError naming the bad argument and what would work."""
    if name not in SCHEDULES:
        raise ValueError(f"pipeline schedule {name!r}: expected one of {SCHEDULES}")
    for what, v in (("stages", stages), ("num_microbatches", microbatches), ("repeats", repeats)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"pipeline {what}={v!r}: expected a positive int")
    if name in ("gpipe", "1f1b") and repeats != 1:
        raise ValueError(f"pipeline schedule {name!r} runs each stage's layers once (repeats=1); got "
                         f"repeats={repeats}: use 'circular' or 'interleaved_1f1b' for repeats > 1")
    if repeats > 1 and microbatches % stages:
        raise ValueError(f"pipeline schedule {name!r} with repeats={repeats} sends microbatches through the "
                         f"stages in groups of {stages}; num_microbatches={microbatches} is not a multiple of "
                         f"{stages}: use {-(-microbatches // stages) * stages}")


def make(name: str, stages: int, microbatches: int, repeats: int = 1) -> Schedule:
    """The table of schedule `name` for p stages, m microbatches and r repeats."""
    check(name, stages, microbatches, repeats)
    p, m, r = int(stages), int(microbatches), int(repeats)
    own = name in OWN_BACKWARD
    span = m * r + p - 1 + (r * p - 1 if own else 0)
    fmb, frep, fslot = (np.full((span, p), -1, np.int32) for _ in range(3))
    stash = 2 * r * p - 1 if own else 0
    for t in range(span):
        for s in range(p):
            v = t - s
            if 0 <= v < m * r:
                g, w = divmod(v, p * r)
                k, j = divmod(w, p)
                fmb[t, s], frep[t, s] = g * p + j, k
                fslot[t, s] = t % stash if own else -1
    backward = None
    if own:
        bmb, brep, bslot = (np.full((span, p), -1, np.int32) for _ in range(3))
        for t in range(span):
            for s in range(p):
                q = t + s - 2 * (r * p - 1) + (r - 1) * p
                if q < 0:
                    continue
                g, rem = divmod(q, p * r)
                back, j = divmod(rem, p)
                i, k = g * p + j, r - 1 - back
                if i < m:
                    u = k * p + s
                    bmb[t, s], brep[t, s] = i, k
                    bslot[t, s] = (t - 2 * (r * p - 1 - u)) % stash
        backward = Wave(bmb, brep, bslot)
    return Schedule(name, p, m, r, Wave(fmb, frep, fslot), backward, stash)
