"""The sharding type: mesh axes per tensor dim plus partial-sum axes (DESIGN.md section 4).

It is PartitionSpec plus "unreduced", as in Shardy. A dim's axes are listed
major to minor; axes that no dim uses are replicated, unless they are
``partial``: then every device holds an unreduced summand of the value.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Mapping, Sequence

from jax.sharding import PartitionSpec

Axes = tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Sharding:
    """Per-dim mesh axes (major to minor) and the axes the value is a partial sum over."""

    dims: tuple[Axes, ...]
    partial: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        dims = tuple(tuple(d) for d in self.dims)
        object.__setattr__(self, "dims", dims)
        object.__setattr__(self, "partial", frozenset(self.partial))
        used = [a for d in dims for a in d]
        if len(used) != len(set(used)):
            raise ValueError(f"sharding {dims} uses a mesh axis on more than one dim; "
                             "each mesh axis may split at most one dim of a tensor")
        if set(used) & self.partial:
            raise ValueError(f"sharding {dims} is partial over {sorted(self.partial)}, "
                             "an axis it also splits a dim on")

    @staticmethod
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
    def axes(self) -> frozenset[str]:
        """Axes that split some dim."""
        return frozenset(a for d in self.dims for a in d)

    @property
    def is_replicated(self) -> bool:
        return not self.axes and not self.partial

    def spec(self) -> PartitionSpec:
        return PartitionSpec(*[None if not d else (d[0] if len(d) == 1 else d) for d in self.dims])

    def tiles(self, dim: int, mesh_shape: Mapping[str, int]) -> int:
        return math.prod(mesh_shape[a] for a in self.dims[dim])

    def local_shape(self, shape: Sequence[int], mesh_shape: Mapping[str, int]) -> tuple[int, ...]:
        return tuple(s // self.tiles(d, mesh_shape) for d, s in enumerate(shape))

    def divides(self, shape: Sequence[int], mesh_shape: Mapping[str, int]) -> bool:
        return all(s % self.tiles(d, mesh_shape) == 0 for d, s in enumerate(shape))

    def without_partial(self) -> "Sharding":
        return Sharding(self.dims)

    def with_partial(self, axes: Iterable[str]) -> "Sharding":
        return Sharding(self.dims, self.partial | frozenset(axes))

    def __str__(self) -> str:
        body = ", ".join("*".join(d) if d else "-" for d in self.dims)
        extra = f" partial({','.join(sorted(self.partial))})" if self.partial else ""
        return f"[{body}]{extra}"

