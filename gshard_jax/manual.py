"""gs.manual: a region written per device, inside an otherwise global-view function.

GShard's auto_to_manual / manual_to_auto. The region's function sees local
shards and may call collectives by mesh axis name (``jax.lax.psum``,
``all_gather``, ``all_to_all``, ``ppermute``, ``psum_scatter``, ...). The
partitioner treats the region as one op with fixed shardings: operands are
resharded to ``in_specs``, results leave in ``out_specs``. It is a
``jax.shard_map`` over the partition mesh, so a user's own ``jax.shard_map``
inside a partitioned function is handled the same way.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import jax
from jax.sharding import Mesh, PartitionSpec

from . import annotations as A, specs as S


def _pspecs(specs: Any, mesh: Mesh, what: str):
    """A pytree of PartitionSpecs from PartitionSpecs or tuples of axis names, axis names checked."""
    def one(s):
        if s is None:
            return PartitionSpec()
        return PartitionSpec(*S.check_leaf(s, mesh, what))
    return jax.tree_util.tree_map(one, specs, is_leaf=S.is_leaf)


def manual(fn: Callable, in_specs: Any, out_specs: Any, mesh: Optional[Mesh] = None) -> Callable:
    """`fn` as a manual region: it runs on local shards laid out as in_specs and returns out_specs.

    in_specs / out_specs: a PartitionSpec (or tuple of axis names) per argument /
    output, or a prefix pytree of them, as for jax.shard_map. Inside gs.partition
    (either backend) the region uses the partition mesh; elsewhere pass `mesh`.
    An axis an out_spec leaves out means the result is the same on every
    device along it (fn's promise, as with shard_map's check_vma=False).
    """
    def region(*args):
        ctx = A._ACTIVE.get()
        m = ctx[0] if ctx is not None else mesh
        if m is None:
            raise ValueError("gs.manual: a manual region needs a mesh; call it inside a function given to "
                             "gs.partition, or pass mesh=...")
        return jax.shard_map(fn, mesh=m, in_specs=_pspecs(in_specs, m, "gs.manual in_specs"),
                             out_specs=_pspecs(out_specs, m, "gs.manual out_specs"), check_vma=False)(*args)

    region.__name__ = f"manual({getattr(fn, '__name__', 'fn')})"
    return region
