"""AxoNN's published communication model (`--comm-model axonn`), for comparing its rankings with ours.

The 4D grid is Gc (innermost: our x), Gr (y), Gd (depth: z) and Gdata (data), each a power of two, kept
when Gc Gr Gd >= min_tp and the batch divides over Gdata Gd. Per layer, four GEMMs (QKV: K = 3, ordinary;
attention output: K = 1, transposed; MLP up: K = 4, ordinary; MLP down: K = 4, transposed) each cost

  data  4 (Gdata-1)/Gdata K H^2 / (Gc Gr Gd) x 2 bytes
  depth 3/2 x 2 (Gd-1)/Gd K H^2 / (Gc Gr) x 2 bytes x (gradient-accumulation steps)
  row   ordinary 2 (Gr-1)/Gr B/(Gdata Gd) S H/Gc x 2 bytes; transposed 4 (Gr-1)/Gr B/(Gdata Gd) S K H/Gc x 2
  col   ordinary 4 (Gc-1)/Gc B/(Gdata Gd) S K H/Gr x 2 bytes; transposed 2 (Gc-1)/Gc B/(Gdata Gd) S H/Gr x 2

in GiB, each over the bandwidth (GB/s) of its group, looked up by (product of the groups inside it, its size)
in the order Gc, Gr, Gd, Gdata; a group of one costs nothing. A grid whose lookup has no entry is dropped.
Configurations are ranked by the per-layer time, ascending (ties keep enumeration order: Gc, Gr, Gd, Gdata
nested outermost to innermost); the time printed is per layer x layers.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from ..partitioner.costs.hardware import GB, Hardware

GEMMS = ((3, False), (1, True), (4, False), (4, True))  # (K, transposed) of QKV, attention out, MLP up, down


@dataclasses.dataclass(frozen=True)
class Grid:
    gr: int
    gc: int
    gd: int
    gdata: int
    seconds: float  # the model's communication time of a step (all layers)

    def to_dict(self) -> dict:
        return {"Gr": self.gr, "Gc": self.gc, "Gd": self.gd, "Gdata": self.gdata, "comm_time_s": self.seconds}

    def mesh(self) -> dict[str, int]:
        """The same grid as this project's mesh axes (x = Gc, y = Gr, z = Gd, data = Gdata)."""
        return {"data": self.gdata, "z": self.gd, "y": self.gr, "x": self.gc}


def _gbps(hw: Hardware, ip: int, size: int) -> Optional[float]:
    found = hw.table_bandwidth(ip, size)
    return None if found is None else found / GB


def gemm_time(hw: Hardware, B: int, S: int, K: int, H: int, gd: int, gr: int, gc: int, gdata: int,
              transposed: bool, grad_acc: int = 1) -> Optional[float]:
    """Seconds of one GEMM's communication, None where the table has no bandwidth for a group."""
    gib = 1024 ** 3
    tokens = B / gdata / gd * S
    terms = {
        "data": 4 * (gdata - 1) / gdata * K * H * H / (gc * gr * gd) * 2 / gib,
        "depth": 3 / 2 * 2 * (gd - 1) / gd * K * H * H / (gc * gr) * 2 / gib * grad_acc,
        "row": (4 * (gr - 1) / gr * tokens * K * H / gc if transposed else 2 * (gr - 1) / gr * tokens * H / gc)
        * 2 / gib,
        "col": (2 * (gc - 1) / gc * tokens * H / gr if transposed else 4 * (gc - 1) / gc * tokens * K * H / gr)
        * 2 / gib,
    }
    total, ip = 0.0, 1
    for name, size in (("col", gc), ("row", gr), ("depth", gd), ("data", gdata)):
        if size > 1:
            bw = _gbps(hw, ip, size)
            if bw is None:
                return None
            total += terms[name] / bw
        ip *= size
    return total


def rank(hw: Hardware, batch: int, seq: int, layers: int, hidden: int, gpus: int, min_tp: int = 1,
         grad_acc: int = 1, top: int = 0) -> list[Grid]:
    """AxoNN's ranking of the (Gr, Gc, Gd, Gdata) grids of `gpus` GPUs, fastest first (top 0: all)."""
    powers = [1 << i for i in range(gpus.bit_length()) if 1 << i <= gpus]
    found = []
    for gc in powers:
        for gr in powers:
            for gd in powers:
                for gdata in powers:
                    if gc * gr * gd * gdata != gpus or gc * gr * gd < min_tp or batch % (gdata * gd):
                        continue
                    times = [gemm_time(hw, batch, seq, k, hidden, gd, gr, gc, gdata, t, grad_acc) for k, t in GEMMS]
                    if any(t is None for t in times):
                        continue
                    found.append(((gc, gr, gd, gdata), sum(times)))
    found.sort(key=lambda kv: kv[1])  # stable: ties keep enumeration order
    out = [Grid(gr, gc, gd, gdata, t * layers) for (gc, gr, gd, gdata), t in found]
    return out[:top] if top else out
