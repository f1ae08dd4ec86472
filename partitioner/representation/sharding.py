"""The sharding type: mesh axes per tensor dim plus partial-sum axes.

It is PartitionSpec plus "unreduced", as in Shardy. A dim's axes are listed
major to minor; axes that no dim uses are replicated, unless they are
``partial``: then every device holds an unreduced summand of the value.

Uneven splits are padded: a ``padded`` dim is physically stored with
``padded_size(size, mesh)`` elements (the size rounded up to a multiple of
the number of devices), so every split of it is even and all resharding
works unchanged on the physical shape. The padding's contents are
unspecified; ops that could read them (reductions, contractions, scans,
top_k, scatter updates) mask them with their identity. A canonical sharding
(``canonical``) pads exactly its uneven dims.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Iterable, Mapping, Sequence

from jax.sharding import PartitionSpec

Axes = tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Sharding:
    """Per-dim mesh axes (major to minor) and the axes the value is a partial sum over."""

    dims: tuple[Axes, ...]
    partial: frozenset[str] = frozenset()
    padded: frozenset[int] = frozenset()
    # axes: frozenset[str], the axes that split some dim (set in __post_init__)

    def __post_init__(self) -> None:
        dims = self.dims
        if type(dims) is not tuple or not all(type(d) is tuple for d in dims):  # noqa: E721 (exact types)
            dims = tuple(tuple(d) for d in dims)
            object.__setattr__(self, "dims", dims)
        if type(self.partial) is not frozenset:  # noqa: E721
            object.__setattr__(self, "partial", frozenset(self.partial))
        if type(self.padded) is not frozenset:  # noqa: E721
            object.__setattr__(self, "padded", frozenset(self.padded))
        used = [a for d in dims for a in d]
        object.__setattr__(self, "axes", frozenset(used))  # not a field: equality and hash ignore it
        object.__setattr__(self, "_hash", hash((dims, self.partial, self.padded)))
        if len(used) > 1 and len(used) != len(self.axes):
            raise ValueError(f"sharding {dims} uses a mesh axis on more than one dim; "
                             "each mesh axis may split at most one dim of a tensor")
        if self.partial and set(used) & self.partial:
            raise ValueError(f"sharding {dims} is partial over {sorted(self.partial)}, "
                             "an axis it also splits a dim on")

    def __hash__(self) -> int:  # computed once: shardings are dict keys all over the pass
        return self._hash

    @staticmethod
    @functools.lru_cache(maxsize=64)
    def replicated(rank: int) -> "Sharding":
        return Sharding(((),) * rank)

    @staticmethod
    def from_spec(spec: Sequence, rank: int) -> "Sharding":
        """From a PartitionSpec-like sequence (None, a name, or a tuple of names per dim)."""
        spec = tuple(spec) + (None,) * (rank - len(tuple(spec)))
        dims = tuple(() if s is None else ((s,) if isinstance(s, str) else tuple(s)) for s in spec)
        return Sharding(dims)

    @property
    def rank(self) -> int:
        return len(self.dims)

    @property
    def is_replicated(self) -> bool:
        return not self.axes and not self.partial

    def spec(self) -> PartitionSpec:
        return PartitionSpec(*[None if not d else (d[0] if len(d) == 1 else d) for d in self.dims])

    def tiles(self, dim: int, mesh_shape: Mapping[str, int]) -> int:
        return math.prod(mesh_shape[a] for a in self.dims[dim])

    def physical_shape(self, shape: Sequence[int], mesh_shape: Mapping[str, int]) -> tuple[int, ...]:
        """The global shape as stored: padded dims rounded up to a multiple of the device count."""
        return tuple(padded_size(s, mesh_shape) if d in self.padded else s for d, s in enumerate(shape))

    def local_shape(self, shape: Sequence[int], mesh_shape: Mapping[str, int]) -> tuple[int, ...]:
        """The per-device shape of a value of (logical) `shape`."""
        return tuple(s // self.tiles(d, mesh_shape) for d, s in enumerate(self.physical_shape(shape, mesh_shape)))

    def tile_index(self, coord: Mapping[str, int], mesh_shape: Mapping[str, int]) -> tuple[int, ...]:
        """The tile (per dim) held by the device at mesh coordinates `coord`."""
        out = []
        for axes in self.dims:
            i = 0
            for a in axes:
                i = i * mesh_shape[a] + coord[a]
            out.append(i)
        return tuple(out)

    def uneven(self, shape: Sequence[int], mesh_shape: Mapping[str, int]) -> frozenset[int]:
        return frozenset(d for d, s in enumerate(shape) if s % self.tiles(d, mesh_shape))

    def canonical(self, shape: Sequence[int], mesh_shape: Mapping[str, int]) -> "Sharding":
        """This sharding with exactly its uneven dims padded."""
        pad = self.uneven(shape, mesh_shape)
        return self if pad == self.padded else dataclasses.replace(self, padded=pad)

    def without_partial(self) -> "Sharding":
        return Sharding(self.dims, frozenset(), self.padded)

    def with_partial(self, axes: Iterable[str]) -> "Sharding":
        return Sharding(self.dims, self.partial | frozenset(axes), self.padded)

    def __str__(self) -> str:
        body = ", ".join(("*".join(d) if d else "-") + ("(pad)" if i in self.padded else "")
                         for i, d in enumerate(self.dims))
        extra = f" partial({','.join(sorted(self.partial))})" if self.partial else ""
        return f"[{body}]{extra}"



def padded_size(size: int, mesh_shape: Mapping[str, int]) -> int:
    """size rounded up to a multiple of the device count: every split of it is even."""
    n = math.prod(mesh_shape.values())
    return -(-size // n) * n


def splittable(size: int, tiles: int, compound: bool = False) -> bool:
    """Whether a dim (or factor) of `size` may be split into `tiles`: evenly, or padded when simple."""
    return size % tiles == 0 or (not compound and size >= tiles)
