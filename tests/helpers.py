"""Shared test helpers: random arrays, random shardings, HLO collective counts."""
from __future__ import annotations

import itertools
import math

import jax
import numpy as np

import gshard_jax as gs
from partitioner.hlo import collective_stats, summary


def randn(rng, *shape, dtype=np.float32):
    return np.asarray(rng.standard_normal(shape), dtype)


def all_specs(shape, mesh):
    """Every PartitionSpec-tuple that splits `shape` evenly over distinct axes of `mesh` (axes in any order)."""
    names = list(mesh.axis_names)
    sizes = dict(mesh.shape)
    out = []
    for targets in itertools.product(range(len(shape) + 1), repeat=len(names)):
        for perm in itertools.permutations(names):
            dims = [tuple(a for a in perm if targets[names.index(a)] == d) for d in range(len(shape))]
            if all(shape[d] % math.prod(sizes[a] for a in dims[d]) == 0 for d in range(len(shape))):
                spec = tuple(None if not d else d for d in dims)
                if spec not in out:
                    out.append(spec)
    return out


def hlo_counts(jitted, *args) -> dict:
    return summary(collective_stats(jitted.lower(*args).compile()))


def hlo_stats(jitted, *args) -> dict:
    return collective_stats(jitted.lower(*args).compile())


def assert_close(a, b, rtol=1e-5, atol=1e-5):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


__all__ = ["randn", "all_specs", "hlo_counts", "hlo_stats", "assert_close", "gs"]
