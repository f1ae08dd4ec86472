"""Device meshes from a dict of named axis sizes."""
from __future__ import annotations

import math
from typing import Mapping, Optional, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh


def make_mesh(axes: Mapping[str, int], devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
    """A mesh over all (or the given) devices, e.g. ``make_mesh({"data": 2, "model": 4})``.

    One size may be -1: it takes whatever the others leave. Axes are Auto
    typed, so both backends (ours and XLA's) may place shardings freely.
    """
    if not isinstance(axes, Mapping) or not axes:
        raise ValueError(f"make_mesh expects a non-empty dict of axis name -> size, e.g. "
                         f"{{'data': 2, 'model': 4}}; got {axes!r}")
    devices = list(devices if devices is not None else jax.devices())
    names, sizes = list(axes), [int(axes[n]) if isinstance(axes[n], np.integer) else axes[n] for n in axes]
    for n, s in zip(names, sizes):
        if not isinstance(n, str) or not n:
            raise ValueError(f"make_mesh: axis names must be non-empty strings; got {n!r} in {dict(axes)}")
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or (s < 1 and s != -1):
            raise ValueError(f"make_mesh: axis {n!r} has size {s!r}; expected a positive int (or -1 for one axis)")
    if sizes.count(-1) > 1:
        raise ValueError(f"make_mesh: at most one axis may be -1; got {dict(axes)}")
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if len(devices) % known:
            raise ValueError(f"make_mesh({dict(axes)}): the known sizes multiply to {known}, which does not "
                             f"divide the {len(devices)} devices")
        sizes[sizes.index(-1)] = len(devices) // known
    if math.prod(sizes) != len(devices):
        raise ValueError(
            f"make_mesh({dict(axes)}): axis sizes multiply to {math.prod(sizes)}, but there are "
            f"{len(devices)} devices; expected sizes whose product is {len(devices)} (e.g. "
            f"{{'data': {len(devices)}}}), or pass devices= to use a subset")
    return jax.make_mesh(tuple(sizes), tuple(names), axis_types=(AxisType.Auto,) * len(names),
                         devices=devices)
