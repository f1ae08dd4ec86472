"""Which temporaries XLA keeps in an output's buffer before the output is made.

XLA's buffer assignment takes the buffers largest first and puts each in an allocation it already has where
the buffer fits and no buffer there is alive at the same time, at offset 0: an output's allocation (one not
written into a donated argument's) holds the step's earlier temporaries, one at a time, until the output is
written (measured: a train step's forward activations live in its new weights' buffers). The bytes so held
are in the outputs' figure, not the temporaries'. liveness.peak (explain()) and auto_memory.Temporaries (the
automatic sharding's check of a choice) both take them off with `held_in_outputs`.
"""
from __future__ import annotations

import bisect
from typing import Sequence

import numpy as np


def held_in_outputs(items: Sequence[tuple[float, int, int]], outputs: Sequence[tuple[float, int]]) -> list[int]:
    """The indices of the items (bytes, first point, last point) an output's buffer holds: largest first, each
    into the smallest output (bytes, the point it is made at; its buffer is taken from there) that is at least
    its size, made after its last point, and holds no other item at once."""
    if not outputs:
        return []
    buffers = sorted(((float(n), int(made), []) for n, made in outputs if n > 0), key=lambda t: t[0])
    sizes = [n for n, _, _ in buffers]
    latest = max((made for _, made, _ in buffers), default=-1)
    held = []
    for k in sorted(range(len(items)), key=lambda k: -items[k][0]):
        n, a, b = items[k]
        if n <= 0 or b >= latest:
            continue
        for _, made, taken in buffers[bisect.bisect_left(sizes, n):]:
            if made > b and all(q < a or p > b for p, q in taken):
                taken.append((a, b))
                held.append(k)
                break
    return held


def less_held(at: np.ndarray, items: Sequence[tuple[float, int, int]], outputs: Sequence[tuple[float, int]]
              ) -> tuple[np.ndarray, set]:
    """(per point, the bytes alive less those the outputs' buffers hold, the indices of the items held)."""
    held = held_in_outputs(items, outputs)
    if not held:
        return at, set()
    at = at.copy()
    for k in held:
        n, a, b = items[k]
        at[a: b + 1] -= n
    return at, set(held)
