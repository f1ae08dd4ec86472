"""The GPU figures docs/training.md reports, made in one prepared call on one GPU and checked against their
targets: the plain-JAX anchor (../shared/gpu/anchor_lm.py) beside our Mula-1B step, scanned and unrolled,
remat dots and none; our step's memory planned, explained, compiled and measured on the device; the two
scanned programs traced side by side; the optimizer offloaded to the host at 4 layers and at the whole
model, with and without the delayed update, in 1 and 8 host groups, and over more microbatches; then
`gshard-jax calibrate`.

    python benchmarks/gpu_check.py [--out DIR] [--anchor PATH] [--parts speed,profile,offload] [--budget-s 540]
    python benchmarks/gpu_check.py --report DIR      # DIR's rows against the targets, as markdown tables

The runs are a table (PLAN, by part, with estimated seconds; `command()` makes each one's argv). Each run
writes its own file in --out as it ends, so a call cut short keeps what finished; a run whose estimate would
end it past --budget-s is skipped and named, and so is a run whose `after` failed, so a call ends inside the
device tool's limit. CALLS splits a device session's work into two such calls. `--small` runs every part at
tiny shapes with XLA's attention in place of cuDNN's: a smoke run on a CPU. The report's targets are the
constants under "the report" below.
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
ANCHOR = os.path.join(ROOT, "..", "shared", "gpu", "anchor_lm.py")
PARTS = ("speed", "profile", "offload", "calibrate")
DEFAULT_PARTS = ("speed", "profile", "offload")  # calibrate: benchmarks/profiles/h200_calibrated.json holds one
CALLS = (("speed", "profile"), ("offload",))  # a device session's calls, each within BUDGET_S by the estimates
BUDGET_S = 540.0  # a call's runs end by this (the device tool stops a command at 600 s)
SMALL_SETS = ["model.num_layers=2", "model.d_model=256", "model.num_heads=2", "model.d_ff=512",
              "model.vocab_size=1000", "train.seq_len=128"]
SMALL_ANCHOR = ["--layers", "2", "--d", "256", "--heads", "2", "--ff", "512", "--vocab", "1000", "--seq", "128"]
HOST_BYTES_PER_PARAM = 28  # an offloaded AdamW update on the host: f32 master and 2 moments read and written,
# the bf16 gradient read and the bf16 params written (docs/training.md, "Offload on the H200")


@dataclasses.dataclass(frozen=True)
class Run:
    """One command of the check: its part, the file it writes in --out, and its arguments."""
    part: str
    name: str  # the file in --out: NAME.json (benchmarks/gpu.py rows) or NAME.txt / .jsonl (stdout)
    kind: str  # "ours" (benchmarks/gpu.py), "anchor", "profile", "host" or "calibrate"
    sets: tuple = ()  # config overrides of our step (ours, profile, calibrate)
    options: tuple = ()  # other arguments
    after: str = ""  # a run whose failure makes this one pointless: then it is skipped


def _ours(part: str, name: str, sets: list, steps: int = 10, xla: bool = True, memory: bool = False,
          after: str = "") -> Run:
    options = ("--steps", str(steps), "--backends", "gshard,xla" if xla else "gshard") + ("--memory",) * memory
    return Run(part, name, "ours", tuple(sets), options, after)


def _offload(layers: int, offload: bool, delayed: bool = False, groups: int = 1, micro: int = 1) -> list:
    return [f"model.num_layers={layers}", f"train.offload_optimizer={str(offload).lower()}",
            f"train.delayed_update={str(delayed).lower()}", f"train.host_update_groups={groups}",
            f"train.batch_size={4 * micro}", f"train.microbatches={micro}"]


DOTS, NONE = "model.remat=dots", "model.remat=none"
SCAN, UNROLLED = "model.scan=true", "model.scan=false"
FULL = "offload_16_d0_g1"  # the whole model offloaded, not delayed
# The check as data: (run, estimated seconds on an H200 with its compile). Ours always runs cuDNN's attention.
PLAN = [
    (Run("speed", "anchor", "anchor", (), ("--variants", "cudnn:dots,cudnn:none,cudnn:dots:scan,cudnn:none:scan")), 60),
    (_ours("speed", "ours_dots_scan", [DOTS, SCAN], memory=True), 45),  # the config's default
    (_ours("speed", "ours_dots_unrolled", [DOTS, UNROLLED]), 30),
    (_ours("speed", "ours_none_scan", [NONE, SCAN], xla=False), 20),
    (_ours("speed", "ours_none_unrolled", [NONE, UNROLLED], xla=False), 20),
    (Run("profile", "profile", "profile", (), ("--variants", "cudnn:dots:scan")), 60),
    (Run("offload", "host_update", "host", (), ()), 20),
    (_ours("offload", "offload_4_device", [DOTS, *_offload(4, False)], steps=4), 15),
    (_ours("offload", "offload_4_d0_g1", [DOTS, *_offload(4, True)], steps=4), 20),
    (_ours("offload", "offload_4_d1_g1", [DOTS, *_offload(4, True, True)], steps=4), 20),
    (_ours("offload", "offload_4_d1_g8", [DOTS, *_offload(4, True, True, 8)], steps=4), 20),
    (_ours("offload", "offload_16_device", [DOTS, *_offload(16, False)], steps=4, xla=False), 20),
    (_ours("offload", FULL, [DOTS, *_offload(16, True)], steps=4, xla=False), 25),
    # the whole model's host state may not be pinned where 4 layers' is (docs/training.md): the rest of the
    # whole model's offloaded runs follow its first
    (_ours("offload", "offload_16_d1_g1", [DOTS, *_offload(16, True, True)], 4, False, after=FULL), 25),
    (_ours("offload", "offload_16_d1_g8", [DOTS, *_offload(16, True, True, 8)], 4, False, after=FULL), 25),
    (_ours("offload", "offload_16_device_m2", [DOTS, *_offload(16, False, micro=2)], 3, False, after=FULL), 20),
    (_ours("offload", "offload_16_d1_g8_m2", [DOTS, *_offload(16, True, True, 8, 2)], 3, False, after=FULL), 25),
    (_ours("offload", "offload_16_device_m4", [DOTS, *_offload(16, False, micro=4)], 3, False, after=FULL), 25),
    (_ours("offload", "offload_16_d1_g8_m4", [DOTS, *_offload(16, True, True, 8, 4)], 3, False, after=FULL), 30),
    (Run("calibrate", "calibrate", "calibrate", ("train.batch_size=4", "train.seq_len=2048", NONE),
         ("--check", DOTS)), 60),
]


def plan(parts=DEFAULT_PARTS) -> list[tuple[Run, float]]:
    """PLAN's runs of these parts, in order."""
    return [(r, s) for r, s in PLAN if r.part in parts]


def command(run: Run, out: str, anchor: str, small: bool, flops_per_token: float) -> list[str]:
    """The argv of a run (ours with cuDNN's attention; --small: tiny shapes, XLA's attention)."""
    attention = "xla" if small else "cudnn"
    sets = [f"model.attention={attention}", *SMALL_SETS * small, *run.sets]  # the run's own overrides last
    variants = lambda opts: tuple(o.replace("cudnn", attention) for o in opts)
    py = sys.executable
    if run.kind == "ours":
        return [py, os.path.join(HERE, "gpu.py"), "--cases", "mula_1b", "--flags", "on", *run.options,
                "--json", os.path.join(out, run.name + ".json"), "--set", *sets] + ["--cpu-devices", "1"] * small
    if run.kind == "anchor":
        return [py, anchor, "--flops-per-token", str(flops_per_token), "--batch", "4", *variants(run.options)] + \
            SMALL_ANCHOR * small
    if run.kind == "profile":
        return [py, os.path.join(HERE, "gpu_profile.py"), "--anchor", anchor, *variants(run.options),
                "--out", os.path.join(out, "traces")] + ["--small"] * small
    if run.kind == "host":
        return [py, os.path.join(HERE, "host_update.py"), "--json", os.path.join(out, run.name + ".json")] + \
            ["--params", "1048576", "--repeats", "1"] * small
    if run.kind == "calibrate":
        overrides = [f"model.attention={attention}", *run.sets, *SMALL_SETS * small]
        return [py, "-m", "gshard_jax.cli", "calibrate", "--config", os.path.join(ROOT, "experiments", "mula_1b.py"),
                "--workdir", os.path.join(out, "calibrate_workdir"), "--out", os.path.join(out, "calibrated.json"),
                "--json", *run.options, *(f"--config.{o}" for o in overrides)] + ["--cpu-devices", "1"] * small
    raise ValueError(f"run {run.name}: unknown kind {run.kind!r}")


def execute(args) -> int:
    """Run the parts' runs in order, each in its own process; print each one's output and the report. -> the
    exit status: 1 where a run failed."""
    import jax
    jax.config.update("jax_platforms", "cpu")  # this process traces the model for its flops: it must not
    # start the GPU's backend, which would take its memory from the runs
    from gshard_jax import configs
    cfg = configs.load(os.path.join(ROOT, "experiments", "mula_1b.py"))
    cfg.train.seq_len = 2048
    flops = configs.model_flops_per_token(cfg)  # the anchor's MFU is then ours
    os.makedirs(args.out, exist_ok=True)
    start, failed, skipped = time.perf_counter(), [], []
    for run, estimate in plan(args.parts.split(",")):
        if run.kind in ("anchor", "profile") and not os.path.exists(args.anchor):
            print(f"== {run.name}: no anchor at {args.anchor} (pass --anchor)", file=sys.stderr)
            failed.append(run.name)
            continue
        elapsed = time.perf_counter() - start
        if run.after in failed:
            print(f"== {run.name}: skipped, {run.after} failed", file=sys.stderr)
            skipped.append(run.name)
            continue
        if elapsed + estimate > args.budget_s:
            skipped.append(run.name)
            continue
        cmd = command(run, args.out, args.anchor, args.small, flops)
        print(f"== {run.name} ({elapsed:.0f} s in, about {estimate:.0f} s): {' '.join(cmd)}", file=sys.stderr)
        t = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        print(f"== {run.name}: exit {done.returncode} after {time.perf_counter() - t:.0f} s", file=sys.stderr)
        if run.kind in ("anchor", "profile", "calibrate"):
            with open(os.path.join(args.out, run.name + (".jsonl" if run.kind == "anchor" else ".txt")), "w") as f:
                f.write(done.stdout)
        print(done.stdout[-4000:])
        if done.returncode:
            print(done.stderr[-4000:], file=sys.stderr)
            failed.append(run.name)
    print(f"ran for {time.perf_counter() - start:.0f} s; failed: {failed or 'none'}; skipped (past --budget-s "
          f"{args.budget_s:.0f}, or after a failed run): {skipped or 'none'}")
    print(report(args.out))
    return 1 if failed else 0


# ------------------------------------------------------------------------------------------------ the report
# The targets (docs/training.md, "The GPU check"): ours against the anchor, (our run, the anchor's variant, at most)
SPEED_TARGETS = [("ours_dots_scan", "cudnn:dots:scan", 1.03), ("ours_dots_scan", "cudnn:dots", 1.05),
                 ("ours_dots_unrolled", "cudnn:dots", 1.03)]
MFU_TARGET = 0.54  # our best configuration
HOST_TARGET = 1.2  # the host's update over its memory-bandwidth bound
DELAYED_TARGET = 1.1  # the delayed offloaded step over max(the on-device step, the host's update)
OFFLOAD_COST = 1.3  # from which microbatches the offloaded step costs less than this over the on-device one
GiB = 2 ** 30


def load(out: str) -> dict:
    """Every row in a check's --out: {"anchor": {variant: row}, "host": {...}, run name: our row}."""
    rows: dict = {}
    path = os.path.join(out, "anchor.jsonl")
    if os.path.exists(path):
        with open(path) as f:
            lines = [json.loads(x) for x in f if x.startswith("{")]
        rows["anchor"] = {r["variant"]: r for r in lines if "error" not in r}
    for path in glob.glob(os.path.join(out, "*.json")):
        name = os.path.basename(path)[:-5]
        with open(path) as f:
            got = json.load(f)
        if name == "host_update":
            rows["host"] = got
        elif isinstance(got, list) and got and "error" not in got[0]:
            rows[name] = got[0]
    return rows


def _verdict(met) -> str:
    return "not measured" if met is None else ("met" if met else "**not met**")


def _f(x, form: str) -> str:
    return "-" if x is None else format(x, form)


def _ratio(a, b):
    return None if a is None or not b else a / b


def _target(what: str, got, want: str, ok) -> tuple:
    """A report row: the target, its figure, what is wanted, and whether ok(figure) holds (None: not measured)."""
    return what, got, want, None if got is None else bool(ok(got))


def _setting(row: dict, key: str) -> str:
    """A config override a row of ours ran with (its `sets`)."""
    return dict(s.split("=", 1) for s in row["sets"])[key]


def speed_section(rows: dict) -> tuple[list[str], list[tuple]]:
    """Ours beside the anchor's same layout and its unrolled step; the speed targets."""
    anchor = rows.get("anchor", {})
    lines = ["| step (cuDNN attention) | ours ms | XLA's partitioner ms | anchor ms, same layout | ours / anchor | "
             "anchor unrolled ms | ours / anchor unrolled | our MFU | anchor MFU |", "| --- |" + " ---: |" * 8]
    step = lambda a: a["step_ms"] if a else None
    for name, label in (("ours_dots_scan", "remat dots, scanned (the config's default)"),
                        ("ours_dots_unrolled", "remat dots, unrolled"), ("ours_none_scan", "remat none, scanned"),
                        ("ours_none_unrolled", "remat none, unrolled")):
        r = rows.get(name)
        if r is None:
            lines.append(f"| {label} | not measured |" + " |" * 7)
            continue
        remat, layout = name.split("_")[1:]
        attention = _setting(r, "model.attention")
        same = anchor.get(f"{attention}:{remat}" + (":scan" if layout == "scan" else ""))
        flat = anchor.get(f"{attention}:{remat}")
        mfu = r["flops_per_token"] * same["tokens_per_s"] / r["peak_flops"] if same else None
        lines.append(f"| {label} | {r['ours_ms']:.1f} | {_f(r.get('xla_ms'), '.1f')} | {_f(step(same), '.1f')} | "
                     f"{_f(_ratio(r['ours_ms'], step(same)), '.3f')} | {_f(step(flat), '.1f')} | "
                     f"{_f(_ratio(r['ours_ms'], step(flat)), '.3f')} | {100 * r['mfu']:.1f}% | "
                     f"{_f(mfu and 100 * mfu, '.1f')}{'%' * bool(mfu)} |")
    checks = []
    for name, variant, most in SPEED_TARGETS:
        r = rows.get(name)
        got = _ratio(r["ours_ms"], step(anchor.get(variant.replace("cudnn", _setting(r, "model.attention"))))) \
            if r else None
        checks.append(_target(f"{name} / anchor {variant}", got, f"<= {most}", lambda g: g <= most))
    best = max((r["mfu"] for n, r in rows.items() if n.startswith("ours_")), default=None)
    checks.append(_target("our best MFU", best, f">= {MFU_TARGET}", lambda g: g >= MFU_TARGET))
    for layout in ("scan", "unrolled"):
        got = _ratio(rows.get(f"ours_none_{layout}", {}).get("ours_ms"), rows.get(f"ours_dots_{layout}", {}).get(
            "ours_ms"))
        checks.append(_target(f"remat none / dots, {layout}", got, "<= 1", lambda g: g <= 1.0))
    return lines, checks


def memory_section(rows: dict) -> tuple[list[str], list[tuple]]:
    """The config's default step: the planner's formula, explain()'s prediction and the compiled step against
    the device's measured peak; none may read under it."""
    r = rows.get("ours_dots_scan")
    what = "memory predictions / measured peak (least)"
    if r is None:
        return ["Memory: not measured."], [_target(what, None, ">= 1", None)]
    measured = r.get("ours_measured_peak_bytes")
    figures = (("planned (the screen's formula)", r.get("planned_bytes")),
               ("explained (explain()'s prediction)", r.get("explained_bytes")),
               ("compiled (memory_analysis())", r["ours_step_memory"]["total"]), ("measured peak", measured))
    lines = ["| Mula-1B, remat dots, scanned | GiB per device | / measured |", "| --- | ---: | ---: |"]
    if "memory_error" in r:
        lines.insert(0, f"The planner's predictions failed: {r['memory_error']}")
    lines += [f"| {label} | {_f(b and b / GiB, '.2f')} | {_f(_ratio(b, measured), '.3f')} |" for label, b in figures]
    ratios = [_ratio(b, measured) for _, b in figures[:3]]
    low = None if measured is None or None in ratios else min(ratios)
    return lines, [_target(what, low, ">= 1", lambda g: g >= 1.0)]


def offload_section(rows: dict) -> tuple[list[str], list[tuple]]:
    """The offloaded steps against the on-device one, the host's update against its memory-bandwidth bound,
    and the microbatches from which offload costs under OFFLOAD_COST."""
    lines = ["| layers | optimizer | microbatches | ours ms | XLA's partitioner ms | / on device | device GiB "
             "(compiled) | measured peak GiB | host GiB |", "| ---: | --- | ---: |" + " ---: |" * 6]
    checks = []
    bandwidth = rows.get("host", {}).get("memory_bytes_per_s")
    for layers in (4, 16):
        device = rows.get(f"offload_{layers}_device")
        ours = {n: r for n, r in rows.items() if n.startswith(f"offload_{layers}_")}
        micro = {n: int(_setting(r, "train.microbatches")) for n, r in ours.items()}
        offloaded = {n: _setting(r, "train.offload_optimizer") == "true" for n, r in ours.items()}
        on_device = {micro[n]: r for n, r in ours.items() if not offloaded[n]}
        for name in sorted(ours, key=lambda n: (micro[n], offloaded[n], n)):
            r, base = ours[name], on_device.get(micro[name])
            groups = int(_setting(r, "train.host_update_groups"))
            what = "on the device" if not offloaded[name] else (
                f"offloaded, {'delayed' if _setting(r, 'train.delayed_update') == 'true' else 'not delayed'}, "
                f"{groups} host group{'s' * (groups > 1)}")
            m = r["ours_step_memory"]
            lines.append(f"| {layers} | {what} | {micro[name]} | {r['ours_ms']:.1f} | {_f(r.get('xla_ms'), '.1f')} | "
                         f"{_f(_ratio(r['ours_ms'], base and base['ours_ms']), '.2f')} | {m['total'] / GiB:.2f} | "
                         f"{_f(r.get('ours_measured_peak_bytes') and r['ours_measured_peak_bytes'] / GiB, '.2f')} | "
                         f"{m['host'] / GiB:.2f} |")
        plain, delayed = rows.get(f"offload_{layers}_d0_g1"), [rows.get(f"offload_{layers}_d1_g{g}") for g in (1, 8)]
        host_ms = plain["ours_ms"] - device["ours_ms"] if plain and device else None
        host_ms = host_ms if host_ms and host_ms > 0 else None  # an offloaded step no slower resolves no update
        bound_ms = 1e3 * HOST_BYTES_PER_PARAM * device["parameters"] / bandwidth if device and bandwidth else None
        checks.append(_target(f"{layers} layers: host update ({_f(host_ms, '.0f')} ms: offloaded - on device) / "
                              f"bound ({_f(bound_ms, '.0f')} ms: {HOST_BYTES_PER_PARAM} B a parameter at the host's "
                              f"memory bandwidth)", _ratio(host_ms, bound_ms), f"<= {HOST_TARGET}",
                              lambda g: g <= HOST_TARGET))
        best = min((d["ours_ms"] for d in delayed if d), default=None)
        got = _ratio(best, max(device["ours_ms"], host_ms) if device and host_ms else None)
        checks.append(_target(f"{layers} layers: delayed offloaded step / max(on device, host update)", got,
                              f"<= {DELAYED_TARGET}", lambda g: g <= DELAYED_TARGET))
        if device and plain:
            saved = device["ours_step_memory"]["total"] - plain["ours_step_memory"]["total"]
            checks.append(_target(f"{layers} layers: device memory saved / the optimizer state on the device",
                                  _ratio(saved, device["ours_step_memory"]["optimizer"]), ">= 1", lambda g: g >= 1.0))
    costs = {m: _ratio(rows.get("offload_16_d1_g8" + (f"_m{m}" if m > 1 else ""), {}).get("ours_ms"),
                       rows.get("offload_16_device" + (f"_m{m}" if m > 1 else ""), {}).get("ours_ms"))
             for m in (1, 2, 4)}
    under = [m for m, c in costs.items() if c is not None and c < OFFLOAD_COST]
    checks.append(("delayed offload (8 groups) / on device by microbatches of 4 x 2,048 tokens: " + ", ".join(
        f"{m}: {_f(c, '.2f')}" for m, c in costs.items()), min(under) if under else None,
        f"under {OFFLOAD_COST}x from this many", bool(under) if any(c is not None for c in costs.values()) else None))
    return lines, checks


def report(out: str) -> str:
    """The check's rows in --out as markdown: the tables docs/training.md keeps, then every target."""
    rows = load(out)
    first = next((r for n, r in rows.items() if n.startswith(("ours_", "offload_"))), None)
    head = (f"{first['device_kind']}, JAX {first['jax']}; medians; MFU at {first['peak_flops'] / 1e12:.3g} TFLOP/s"
            if first else "no step of ours measured")
    out_lines, checks = [f"GPU check ({out}): {head}", ""], []
    for section in (speed_section, memory_section, offload_section):
        lines, got = section(rows)
        out_lines += lines + [""]
        checks += got
    out_lines += ["| target | measured | wanted | |", "| --- | ---: | --- | --- |"]
    out_lines += [f"| {what} | {_f(v, '.3f') if isinstance(v, float) else _f(v, '')} | {want} | {_verdict(met)} |"
                  for what, v, want, met in checks]
    profile = os.path.join(out, "profile.txt")
    if os.path.exists(profile):
        with open(profile) as f:
            out_lines += ["", "The scanned programs' kernels (benchmarks/gpu_profile.py):", "```", f.read().rstrip(),
                          "```"]
    return "\n".join(out_lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="gpu_check", help="where each run's rows are written")
    p.add_argument("--anchor", default=ANCHOR, help="the plain-JAX anchor (../shared/gpu/anchor_lm.py)")
    p.add_argument("--parts", default=",".join(DEFAULT_PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    p.add_argument("--budget-s", type=float, default=BUDGET_S, help="start no run that would end past this")
    p.add_argument("--small", action="store_true", help="tiny shapes, XLA's attention: a smoke run on a CPU")
    p.add_argument("--report", default="", metavar="DIR", help="only print the report of an earlier call's --out")
    args = p.parse_args(argv)
    if args.report:
        print(report(args.report))
        return
    unknown = set(args.parts.split(",")) - set(PARTS)
    if unknown:
        raise SystemExit(f"--parts {args.parts}: unknown {sorted(unknown)}; expected some of {', '.join(PARTS)}")
    raise SystemExit(execute(args))


if __name__ == "__main__":
    main()
