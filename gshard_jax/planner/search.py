"""gs.plan(): enumerate, screen, plan the best for real, rank, and say why.

Every mesh factorisation and training option is screened by formula (estimate.py), over every order of its
axes; what cannot run is rejected with one reason. The `verify` fastest distinct configurations are then
planned by the partitioner on an abstract mesh (predict.py): their communication and argument memory are
the planned program's, and the final ranking is theirs.
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Optional, Sequence

import ml_collections

from ..api import gc_paused
from ..partitioner.costs.hardware import Hardware, scaled
from . import axonn, estimate as E, space as SP
from .bound import floor, group_floor
from .ranking import GiB, Plan, Ranked, rejected_key
from .workers import Workers


def _heuristic_order(c: SP.Candidate, comms) -> tuple:
    """The axes ordered so that those moving the most bytes sit innermost (the fast levels)."""
    moved = {a: 0.0 for a, _ in c.mesh}
    for cm in comms:
        for a in cm.axes:
            if a in moved:
                moved[a] += cm.moved
    return tuple(sorted(c.mesh, key=lambda an: (moved[an[0]], SP.AXES.index(an[0]))))


def _best_order(c: SP.Candidate, comms, compute: float, mem: dict, hw: Hardware,
                exposed: dict) -> tuple[SP.Candidate, E.Estimate]:
    """The fastest of the list-scheduled orders (exposed: order -> seconds of communication exposed)."""
    best = None
    for order, seconds in exposed.items():
        cand = dataclasses.replace(c, mesh=order)
        est = E.combine(hw, cand, compute, comms, mem, "partitioner", seconds)
        if best is None or est.step < best[1].step - 1e-15:
            best = (cand, est)
    return best


def plan(cfg: ml_collections.ConfigDict, devices: int, hardware: Hardware, memory_gb: Optional[float] = None,
         top: int = 5, verify: Optional[int] = None, remats: Sequence[str] = SP.REMATS,
         zero_stages: Sequence[int] = SP.ZERO_STAGES, config_name: str = "config",
         pin: Sequence[dict] = (), worker: bool = False, own_mesh: bool = False, prune: bool = True) -> Plan:
    """Rank the configurations of `devices` devices of `hardware` for config `cfg` (see module docstring).

    pin: meshes ({axis: size}) to place in the ranking whatever their rank (a paper's own configuration):
    the best variant of each by formula is planned by the partitioner too, and compared with #1.
    own_mesh: pin the config's own mesh section too, where it resolves on `devices` (the CLI does).
    prune: cost meshes in the order of their floors (bound.py) and skip those, and the option groups, whose
    floor passes the last configuration that may be planned: the same plan, from a fraction of the screen.
    worker: plan every second candidate in a spawned process (the same result, sooner on 2+ cores); the
    process imports the caller's __main__, so only a script with an `if __name__ == "__main__"` guard
    should ask (the CLI does).
    """
    start = time.perf_counter()
    if devices < 1:
        raise ValueError(f"devices={devices}: expected a positive device count")
    count = max(verify if verify is not None else top, 0)
    workers = Workers(count, worker, cfg)
    try:
        own = SP.config_mesh(cfg, devices) if own_mesh else None
        full = [{a: 1 for a in SP.AXES} | dict(sizes) for sizes in pin]
        pin = list(pin) + ([own] if own is not None and own not in full else [])
        out = _plan(cfg, devices, hardware, memory_gb, top, count, remats, zero_stages, config_name, pin, workers,
                    start, prune)
        out.own = own
        return out
    finally:
        workers.close()


def _plan(cfg, devices, hardware, memory_gb, top, count, remats, zero_stages, config_name, pin, workers,
          start, prune) -> Plan:
    """plan()'s search (count: candidates to plan with the partitioner)."""
    prune = prune and count > 0  # a screen alone (nothing planned) costs every candidate
    budget = (memory_gb if memory_gb is not None else hardware.memory_gib) * GiB
    shape = SP.model_shape(cfg, hardware.platform)
    pinned = [{a: 1 for a in SP.AXES} | dict(sizes) for sizes in pin]
    with gc_paused():  # the screen makes a million small tuples: no collection need walk them
        screened, rejected, dominated, pruned, pruned_groups, cut = _screen(
            shape, devices, hardware, budget, count, remats, zero_stages, pinned, prune)
    # planned whatever their rank, beside the first: the families the formula may misjudge (kept_meshes), and
    # the pinned meshes' best variants by formula
    families = kept_meshes(shape, devices, hardware) if count else []
    kept = [best for sizes in families + pinned
            if (best := next((r for r in screened if r.candidate.sizes == sizes), None)) is not None]
    # a pinned mesh's best variant of each schedule too: the formula may misjudge one schedule against another
    kept += [r for sizes in pinned for r in _best_per_schedule(screened, sizes)]
    kept = [r for i, r in enumerate(kept) if r not in kept[:i]]
    ranked, also = _verify(cfg, shape, screened, count, hardware, budget, rejected, workers, kept)
    tried = {id(r) for r in kept}
    everything = ranked + also  # all the partitioner planned (the pinned meshes' are looked up here)
    planned = {_shape_key(r.candidate) for r in ranked}
    ranked += [r for r in also if _shape_key(r.candidate) not in planned and r.candidate.sizes in families]
    ranked.sort(key=lambda r: (r.estimate.step, r.estimate.memory["total"], r.candidate.order_key))
    ranked = ranked[:top] if top else ranked
    sensitivity = {}
    for factor in (0.5, 2.0):
        hw2 = scaled(hardware, factor)
        again = []
        for r in ranked:  # the exposed share of the communication kept (the schedule is not redone)
            e = r.estimate
            share = (e.comm_total - e.overlap) / e.comm_total if e.comm_total else 1.0
            comm = E.combine(hw2, r.candidate, e.compute, r.comms, e.memory).comm_total
            again.append((E.combine(hw2, r.candidate, e.compute, r.comms, e.memory, e.source, share * comm).step,
                          r.candidate.key))
        sensitivity[str(factor)] = [k for _, k in sorted(again)]
    out = Plan(config_name, devices, hardware, budget, shape, ranked, screened, rejected, sensitivity, dominated,
               pruned=pruned, pruned_groups=pruned_groups, floor_cut=cut.threshold)
    out.pinned = [_pinned(cfg, out, sizes, hardware, budget, everything, tried) for sizes in pin]
    for _, _, r, _ in out.pinned:  # a pinned candidate that plans faster than #1 ranks where its step puts it
        if r is not None and r not in out.ranked and (not out.ranked or r.estimate.step < out.ranked[-1].estimate.step):
            out.ranked.append(r)
            out.ranked.sort(key=lambda x: (x.estimate.step, x.estimate.memory["total"], x.candidate.order_key))
            out.ranked = out.ranked[:top] if top else out.ranked
    out.seconds = time.perf_counter() - start
    return out


def _screen(shape: SP.ModelShape, devices: int, hardware: Hardware, budget: float, count: int, remats, zero_stages,
            pinned: list[dict], prune: bool) -> tuple:
    """The screen of plan(): every mesh's options costed by formula, in the order of the meshes' floors (see
    plan's `prune`; pinned meshes, every axis named, are costed whatever their floor): (screened, rejected,
    dominated, pruned meshes, pruned option groups, the cut)."""
    screened: list[Ranked] = []
    rejected: list[tuple] = []
    dominated = 0
    forced = pinned + (kept_meshes(shape, devices, hardware) if prune else [])
    meshes = _meshes(shape, devices, hardware, remats, zero_stages, prune, rejected)
    # Once a mesh's floor passes the step of the last configuration _verify may plan (the 3 x count-th
    # distinct one), no candidate left can be planned: the rest are counted, not costed.
    cut = _Best(3 * count if prune else 0)
    pruned = pruned_groups = 0
    for low, _, sizes, costs in meshes:
        if low > cut.threshold and sizes not in forced:
            pruned += 1
            continue
        canonical = tuple((a, sizes[a]) for a in SP.AXES if sizes[a] > 1)  # the screen's order (orders()[0])
        data_twin = None if sizes in pinned else _data_twin(shape, sizes, remats, zero_stages)
        fit: set = set()  # option groups in which a lighter candidate already fits the budget
        staged = sizes["stage"] > 1
        for (m, sched, r), reason, variants in SP.option_groups(shape, sizes, remats, zero_stages):
            if reason:  # each variant is named only if asked for (Plan.rejected): most never are
                # (a variant with fewer microbatches that fits dominates it; none of this group ever fits)
                kept = variants if staged else [v for v in variants if v not in fit]
                dominated += len(variants) - len(kept)
                kind = reason.split(":")[0]
                head = (canonical, m, sched, r)
                rejected.extend([(head + v, kind, reason) for v in kept])
                continue
            if prune and sizes not in forced and group_floor(
                    shape, sizes, hardware, m, sched, r, remats, zero_stages, costs) > cut.threshold:
                pruned_groups += 1  # its microbatches and schedule alone cost more than the cut
                continue
            least = _least_memory(shape, canonical, m, sched, r, variants, bool(hardware.host_memory_gib))
            if least > budget:  # no variant of the group fits, offloaded or not: each rejected uncosted
                over = f"over memory by {(least - budget) / GiB:.2f} GiB or more"
                kept_on, offloaded = f"{over} (its option group's lightest, formula)", \
                    f"{over} of device memory with the optimizer state offloaded (formula)"
            for zero, epso, remat in variants:
                # Dominated, not evaluated: a heavier remat where a lighter one of the same options fits (more
                # compute, no less communication), or without stages more microbatches where fewer fit (no
                # bubble to cut; weights gathered per microbatch).
                same = (zero, epso, m, sched, r)
                fewer = None if staged else (zero, epso, remat)
                if same in fit or fewer in fit:
                    dominated += 1
                    continue
                if least > budget:
                    rejected.append(((canonical, m, sched, r, zero, epso, remat), "over memory", kept_on))
                    if hardware.host_memory_gib:
                        rejected.append(((canonical, m, sched, r, zero, epso, remat, True), "over memory", offloaded))
                    continue
                fields = dict(zero_stage=zero, epso=epso, microbatches=m, schedule=sched, repeats=r, remat=remat)
                # Dominated too: context where data in its place runs and fits (the same tokens per device, the
                # same gradient sums, and no ring to send), with as many microbatches (or, without stages, up to
                # as many: fewer cost nothing there).
                if data_twin is not None:
                    twin_mesh, twin_groups = data_twin
                    twin_m = [tm for tm, ts, tr in twin_groups if (ts, tr) == (sched, r) and (tm <= m if not staged
                                                                                          else tm == m)]
                    if twin_m and E.memory(shape, SP.Candidate(twin_mesh, **dict(fields, microbatches=max(twin_m))))[
                            "total"] <= budget:
                        dominated += 1
                        continue
                c = SP.Candidate(canonical, **fields)
                mem = E.memory(shape, c)
                if mem["total"] > budget:
                    rejected.append((c, "over memory", f"over memory by {(mem['total'] - budget) / GiB:.2f} GiB "
                                     f"({mem['total'] / GiB:.2f} GiB per device, formula)"))
                    c = _offloaded(shape, c, hardware, budget, rejected)  # it may fit with its optimizer on the host
                    if c is None:
                        continue
                    mem = E.memory(shape, c)
                else:
                    fit.add(same)
                    if fewer is not None:
                        fit.add(fewer)
                chosen = _costed(shape, c, hardware, devices, mem, staged)
                screened.append(chosen)
                cut.add(chosen)
    screened.sort(key=lambda r: (r.estimate.step, r.estimate.memory["total"], r.candidate.order_key))
    return screened, rejected, dominated, pruned, pruned_groups, cut


def _least_memory(shape: SP.ModelShape, mesh: tuple, m: int, sched: str, r: int, variants: list,
                  offload: bool) -> float:
    """Device bytes no variant of an option group goes under (by formula): EPSO on and the optimizer state
    offloaded (where the profile has host memory) only take bytes off; ZeRO 1 and 2 hold alike and under 0, and
    ZeRO 3 (which adds a layer's gather) and each remat policy are tried."""
    zeros = {z for z, _, _ in variants}
    reps = {max(z for z in zeros if z < 3)} if any(z < 3 for z in zeros) else set()
    reps |= {3} & zeros
    return min(E.memory(shape, SP.Candidate(mesh, zero_stage=z, epso=True, microbatches=m, schedule=sched,
                                           repeats=r, remat=remat, offload=offload))["total"]
               for z in reps for remat in {v[2] for v in variants})


def _meshes(shape: SP.ModelShape, devices: int, hardware: Hardware, remats, zero_stages, prune: bool,
            rejected: list) -> list[tuple]:
    """Every mesh of the devices a model may take, as (its floor, its index, its sizes, its collectives'
    costs shared by its floor and its option groups' floors), in the order of their floors; the others
    rejected (appended to `rejected`)."""
    meshes = []
    for sizes in SP.factorizations(devices, SP.AXES):
        mesh_key = ".".join(f"{a}{n}" for a, n in sizes.items() if n > 1) or "one-device"
        reason = SP.mesh_reason(shape, sizes)
        if reason:
            rejected.append((mesh_key, reason.split(":")[0], reason))
        else:
            costs: dict = {}
            meshes.append((floor(shape, sizes, hardware, remats, zero_stages, costs) if prune else 0.0, len(meshes),
                           sizes, costs))
    return sorted(meshes, key=lambda t: t[:2])


def _costed(shape: SP.ModelShape, c: SP.Candidate, hardware: Hardware, devices: int, mem: dict,
            staged: bool) -> Ranked:
    """A candidate's formula estimate, screened as the better of its twins where it has stages (both are
    planned); without stages the formula gives the sequence-parallel twin the same bytes at more latency (its
    rings), so it never is."""
    compute = E.compute_time(shape, c, hardware, devices)
    chosen = None
    for twin in twins(c) if staged else [c]:
        comms = E.collectives(shape, twin)
        cand = dataclasses.replace(twin, mesh=_heuristic_order(twin, comms))
        got = Ranked(cand, E.combine(hardware, cand, compute, comms, mem), 1)
        chosen = got if chosen is None or got.estimate.step < chosen.estimate.step else chosen
    return chosen


class _Best:
    """The best formula step of each distinct configuration _verify may plan (`_shape_key`), the `n` fastest:
    `threshold` is the n-th's step (infinite until there are n), the floor a mesh must not pass to be costed."""

    def __init__(self, n: int):
        self.n, self.steps, self.threshold = n, {}, math.inf

    def add(self, r: Ranked) -> None:
        if not self.n or r.estimate.step >= self.threshold:
            return
        key = _shape_key(r.candidate)
        self.steps[key] = min(r.estimate.step, self.steps.get(key, math.inf))
        if len(self.steps) > self.n:
            del self.steps[max(self.steps, key=self.steps.get)]
        if len(self.steps) == self.n:
            self.threshold = max(self.steps.values())


def _offloaded(shape: SP.ModelShape, c: SP.Candidate, hw: Hardware, budget: float, rejected: list):
    """c with its optimizer state in host memory when that fits both memories, else None (rejected)."""
    if not hw.host_memory_gib:
        return None
    off = dataclasses.replace(c, offload=True)
    mem = E.memory(shape, off)
    host = hw.host_memory_gib * GiB
    if mem["total"] > budget or mem["host_optimizer"] > host:
        over = (f"{(mem['total'] - budget) / GiB:.2f} GiB of device memory" if mem["total"] > budget else
                f"{(mem['host_optimizer'] - host) / GiB:.2f} GiB of host memory")
        rejected.append((off, "over memory", f"over memory by {over} with the optimizer state offloaded (formula)"))
        return None
    return off


def kept_meshes(shape: SP.ModelShape, devices: int, hw: Hardware, grids: int = 3) -> list[dict]:
    """Meshes planned whatever their formula rank: all devices on z (FSDP), and AxoNN's `grids` best 4D grids
    by its own model (where the profile has its bandwidth table)."""
    out = [{a: devices if a == "z" else 1 for a in SP.AXES}]
    if hw.table:
        for g in axonn.rank(hw, shape.batch, shape.seq, shape.layers, shape.d_model, devices, top=grids):
            out.append({a: g.mesh().get(a, 1) for a in SP.AXES})
    return [m for i, m in enumerate(out) if m not in out[:i]]


def _shape_key(c: SP.Candidate) -> tuple:
    """What makes two candidates the same configuration to plan (its optimizer options aside)."""
    return (tuple(sorted(c.sizes.items())), c.schedule, c.repeats, c.microbatches)


def _pinned(cfg, out: Plan, sizes: dict, hw: Hardware, budget: float, planned: Sequence = (),
            tried: set = frozenset()) -> tuple:
    """(sizes, formula rank, the planned best variant or None, why) for a pinned mesh. planned: what the
    partitioner planned already; tried: ids of the screened configurations it was asked to plan (their
    rejections, if it could not, are in out.rejections)."""
    full = {a: 1 for a in SP.AXES} | dict(sizes)
    unknown = set(sizes) - set(SP.AXES)
    if unknown or math.prod(full.values()) != out.devices:
        raise ValueError(f"pinned mesh {sizes}: expected sizes of {SP.AXES} multiplying to {out.devices} devices")
    for i, r in enumerate(out.screened, 1):
        if r.candidate.sizes == full:
            # the fastest variant of the mesh the partitioner planned: its best by formula (the better twin, as
            # _verify keeps), another schedule's best (_plan), or one planned for another reason
            same = [x for x in (*out.ranked, *planned) if x.candidate.sizes == full]
            done = sorted(same, key=lambda x: x.estimate.step)[:1]
            keys = {t.key for t in twins(r.candidate)}
            if done or id(r) in tried:
                reasons = [] if done else [reason for c, _, reason in out.rejections
                                           if isinstance(c, str) and c in keys]
            else:
                before = len(out.rejections)
                done = _verify(cfg, out.shape, [r], 1, hw, budget, out.rejections)[0]
                reasons = [reason for _, _, reason in out.rejections[before:]]
            planned = done
            why = [f"its best variant by formula ({r.candidate.key}, rank {i} of {len(out.screened)}) was "
                   f"rejected when planned: {reason}" for reason in reasons]
            return dict(sizes), i, (planned[0] if planned else None), why
    name = ".".join(f"{a}{full[a]}" for a in SP.AXES if full[a] > 1)
    reasons = sorted({kind for c, kind, _ in out.rejections if rejected_key(c).split()[0] == name})
    return dict(sizes), None, None, [f"no variant runs: rejected for {', '.join(reasons) or 'no reason found'}"]


def _best_per_schedule(screened: Sequence, sizes: dict) -> list:
    """The screened candidates of mesh `sizes` best by formula for each schedule but the overall best's."""
    seen, out = set(), []
    for r in screened:
        if r.candidate.sizes == sizes and r.candidate.schedule not in seen:
            if seen:
                out.append(r)
            seen.add(r.candidate.schedule)
    return out


def _options(c: SP.Candidate) -> SP.Candidate:
    """c's options alone: its axis order and sequence-parallel twin aside."""
    return dataclasses.replace(c, mesh=(), sequence_parallel=False)


def _data_twin(shape: SP.ModelShape, sizes: dict, remats, zero_stages) -> Optional[tuple]:
    """For a mesh with a context axis: (the mesh with data x context in place of both, the option groups
    (microbatches, schedule, repeats) that run on it), or None where that mesh cannot run the model."""
    if sizes["context"] == 1:
        return None
    twin = dict(sizes, data=sizes["data"] * sizes["context"], context=1)
    if SP.mesh_reason(shape, twin):
        return None
    groups = {group for group, reason, _ in SP.option_groups(shape, twin, remats, zero_stages) if not reason}
    return tuple((a, twin[a]) for a in SP.AXES if twin[a] > 1), groups


def twins(c: SP.Candidate) -> list[SP.Candidate]:
    """c, and with a tensor axis its sequence-parallel twin: the same bytes by formula and memory split as the
    formula already assumes, so only their planned programs (what each hides) tell them apart."""
    c = dataclasses.replace(c, sequence_parallel=False)
    return [c] + ([dataclasses.replace(c, sequence_parallel=True)] if c.size("y") > 1 else [])


def _verify(cfg, shape, screened: list[Ranked], count: int, hw: Hardware, budget: float, rejected: list,
            workers: Optional[Workers] = None, also: Sequence[Ranked] = ()) -> tuple[list, list]:
    """The `count` fastest screened configurations (mesh, schedule and microbatches; the best-ranked variant of
    each, so the planned ones differ in more than their optimizer options) that the partitioner plans within
    the budget: communication and argument bytes of the planned step. One the model cannot build or the
    partitioner cannot plan is rejected with the error, and the next is taken (at most 3 x count tried).
    The candidates still needed are planned together, here and in the worker process when one helps (each
    takes the next when it is free); the result is the same whichever plans which. also: configurations to plan
    whatever their rank, beside the first ones (those among them are planned once). -> (the planned, in step
    order; those of `also` planned apart from them)."""
    workers = workers or Workers(0)
    out, apart, taken = [], [], set()
    queue = iter(screened)
    tried = 0
    while len(out) < count and tried < 3 * count:
        batch = []
        for r in queue:  # the next distinct configurations, as many as can be planned at once
            shape_key = _shape_key(r.candidate)
            if shape_key in taken:
                continue  # a variant of a configuration taken already: the formula ranks them closely
            taken.add(shape_key)
            batch.append(r)
            if len(batch) == min(count - len(out), 3 * count - tried):
                break
        if not batch:
            break
        tried += len(batch)
        extra = [r for r in also if _shape_key(r.candidate) not in taken]
        also = ()
        jobs = [(r, c) for r in batch + extra for c in twins(r.candidate)]
        found: dict[int, Ranked] = {}
        for (r, c), got in zip(jobs, workers.run(cfg, [c for _, c in jobs], hw, shape)):
            if isinstance(got, Exception):
                rejected.append((c.key, "partitioner", f"partitioner: {str(got).splitlines()[0][:300]}"))
                continue
            comms, args, exposed = got
            mem = E.memory(shape, c) if c != r.candidate else dict(r.estimate.memory)  # the twin's own
            mem["params"], mem["optimizer"] = args.get("params", 0), args.get("optimizer", 0)
            mem["batch"] = args.get("batch", 0) + args.get("step", 0)  # the rest of the step's arguments
            if c.offload:
                E.offloaded(mem, args.get("host_optimizer", 0), shape.param_bytes)
            mem["total"] = E.device_total(mem)
            host = hw.host_memory_gib * GiB
            if mem["total"] > budget or mem.get("host_optimizer", 0) > host:
                over = (f"{(mem['total'] - budget) / GiB:.2f} GiB ({mem['total'] / GiB:.2f} GiB per device" if
                        mem["total"] > budget else f"{(mem['host_optimizer'] - host) / GiB:.2f} GiB of host memory "
                        f"({mem['host_optimizer'] / GiB:.2f} GiB per device")
                rejected.append((c.key, "over memory", f"over memory by {over}, planned)"))
                continue
            cand, est = _best_order(c, comms, r.estimate.compute, mem, hw, exposed)
            # the formula's communication in the order the planned step takes (what it is checked against)
            formula = E.combine(hw, cand, r.estimate.compute, E.collectives(shape, c), mem).comm_total
            planned = Ranked(cand, est, len(SP.orders(c.sizes)), comms, formula)
            if id(r) not in found or est.step < found[id(r)].estimate.step:
                found[id(r)] = planned
        out += [found[id(r)] for r in batch if id(r) in found][:count - len(out)]
        apart += [found[id(r)] for r in extra if id(r) in found]
    out.sort(key=lambda r: (r.estimate.step, r.estimate.memory["total"], r.candidate.order_key))
    return out, apart
