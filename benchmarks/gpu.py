"""The train step on whatever accelerators are present: our partitioner against XLA's, with XLA:GPU's overlap
flags (training.train.OVERLAP_FLAGS) on and off.

    python benchmarks/gpu.py [--steps 10] [--cases tiny_moe_lm,tiny_dense_lm,mula_1b,tiny_moe_lm_dropless,...]
    benchmarks/gpu.sh [STEPS]      # every case, flags on and off

tiny_moe_lm_dropless puts the devices on the expert axis and exchanges tokens with ragged all-to-all (XLA:CPU
cannot compile it); tiny_dense_lm_tp puts them on y (tensor and sequence parallel), where collective matmul
"auto" runs the all-gathers and reduce-scatters beside their matmuls as rings of collective-permutes where the
cost model says they are faster. Each row counts the ragged all-to-alls and collective-permutes in both
compiled steps, so what ran is shown. Both need two or more devices to communicate at all.

Each case runs in a fresh process per flag setting (XLA reads XLA_FLAGS once, when its backend starts). A row:
median step ms of each backend (timed alternately in one process, each stepping its own state, donated as the
trainer's step donates it), ours/xla, tokens/s per device and MFU of our
step (model flops per token, training.timing, over --hardware's peak), the compiled step's memory
(memory_analysis(): arguments + temporaries) and the device's peak bytes in use over the process (both
backends), and |loss ours - loss xla|. The JSON rows also hold our step's memory by part (training/fit.StepMemory)
and its first call's measured peak on the device (memory_stats(): the peak less what the process held beside the
step's arguments); `--memory` adds the planner's formula and explain()'s prediction for the same step.
`--backends gshard` times ours alone (XLA's columns read "-"). A case that fails prints its error and the
script exits 1.
The mesh is the config's where it has as many devices as are present, else every device on `data`. On one
device no collective runs: the flags can then only change the schedule of local work.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
EXPERIMENTS = os.path.join(HERE, "..", "experiments")

def _on(axis: str, most: int) -> dict:
    """Mesh overrides putting the largest divisor of the device count up to `most` on `axis`, the rest on data."""
    def size(n: int) -> int:
        return max(d for d in range(1, min(n, most) + 1) if n % d == 0 and most % d == 0)
    return {"mesh.data": lambda n: n // size(n), f"mesh.{axis}": size, "mesh.expert": lambda n: size(n) if
            axis == "expert" else 1}


# case: (experiment file, config overrides {dotted key: value, or a function of the device count}).
CASES = {
    "tiny_moe_lm": ("tiny_moe_lm.py", {}),
    "tiny_dense_lm": ("tiny_dense_lm.py", {}),
    "tiny_moe_lm_dropless": ("tiny_moe_lm.py", {"model.moe.dispatch": "dropless", "model.moe.exchange": "ragged",
                                                **_on("expert", 8)}),  # 8 experts
    # 4 heads; sequence parallel, so the matmuls' all-gathers and reduce-scatters may run as rings
    "tiny_dense_lm_tp": ("tiny_dense_lm.py", {"model.sequence_parallel": True, **_on("y", 4)}),
    "mula_1b": ("mula_1b.py", {"train.batch_size": lambda n: 4 * n, "train.seq_len": 2048}),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10, help="timed steps per backend (after 2 untimed)")
    p.add_argument("--cases", default="tiny_moe_lm,tiny_dense_lm,mula_1b",
                   help=f"comma-separated, from {sorted(CASES)}")
    p.add_argument("--hardware", default="auto", help="hardware profile (a name or a JSON file, e.g. one "
                   "`gshard-jax calibrate` wrote) whose peak MFU divides by and whose efficiency prices the planned "
                   "compute; auto: the built-in profile of the devices' kind")
    p.add_argument("--flags", default="on,off", help="overlap flag settings to run: on, off or both")
    p.add_argument("--cpu-devices", type=int, default=0, help="simulate N CPU devices (a smoke run without GPUs)")
    p.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                   help="config overrides for every case, e.g. model.scan=false")
    p.add_argument("--backends", default="gshard,xla", help="partitioners to time: gshard (ours) and, for the "
                   "ratio, xla")
    p.add_argument("--memory", action="store_true", help="also the planner's memory for the step: its formula "
                   "and explain()'s prediction (planner/memory_check.py), beside the compiled and measured bytes")
    p.add_argument("--json", default="", help="also write the rows to this file")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def configure(name: str, devices: int, hardware: str, sets: list[str] = ()):
    """The case's config on `devices` devices, with --set overrides last."""
    from gshard_jax import configs
    from gshard_jax.configs import load
    from gshard_jax.training.overrides import parse_value
    path, overrides = CASES[name]
    cfg = load(os.path.join(EXPERIMENTS, path))
    def put(key, value, text: bool):
        *path, field = key.split(".")
        section = cfg
        for part in path:
            section = section[part]
        section[field] = parse_value(key, value, section[field]) if text else value

    for key, value in overrides.items():
        put(key, value(devices) if callable(value) else value, False)
    for kv in sets:
        put(*kv.split("=", 1), True)
    axes = configs.section(configs.MeshConfig, "mesh", cfg.mesh).sizes()
    sizes = {k: v for k, v in axes.items() if v not in (1, -1)}
    product = 1
    for v in sizes.values():
        product *= v
    if product != devices or -1 in axes.values():
        cfg.mesh.update({k: 1 for k in axes})
        cfg.mesh.data = devices
    cfg.train.hardware = hardware
    return cfg


def _device_bytes(tree) -> int:
    """Bytes of a tree's arrays in one device's memory (an offloaded state's host arrays apart)."""
    import jax

    from gshard_jax.training import fit
    return sum(fit.local_bytes(x) for x in jax.tree.leaves(tree) if not fit.on_host(x))


def _stats() -> dict:
    import jax
    return jax.devices()[0].memory_stats() or {}


def memory_rows(cfg, trainer, compiled, hw, explain: bool) -> dict:
    """Our step's memory per device: the compiled step's (training/fit.StepMemory) and, with `explain`, the
    planner's formula and explain()'s prediction for the config's own candidate (planner/memory_check.py)."""
    import jax

    from gshard_jax.planner import memory_check, space
    from gshard_jax.training import fit
    row = {"ours_step_memory": fit.step_memory(trainer, compiled).to_dict()}
    if explain:
        try:  # the step's times are kept where a prediction fails: the error goes in the row
            c = space.config_candidate(cfg, jax.device_count())
            row["planned_bytes"] = memory_check.formula(cfg, c, hw.platform)["total"]
            row["explained_bytes"] = memory_check.explained(cfg, c, hw)
        except Exception as e:  # noqa: BLE001 (any failure of the planner's side is reported, not raised)
            row["memory_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    return row


def child(args) -> dict:
    """One case under the flag setting in $GSHARD_BENCH_FLAGS: the backends compiled and timed alternately."""
    from gshard_jax.training import train
    train.init_devices(cpu_devices=args.cpu_devices, overlap_flags=os.environ["GSHARD_BENCH_FLAGS"] == "on")
    import jax

    from gshard_jax.planner import calibrate
    from gshard_jax.training.timing import median_times, model_flops_per_token, peak_flops

    cfg = configure(args.child, jax.device_count(), args.hardware, args.set)
    hw = calibrate.base_profile(jax.devices()[0].device_kind, "" if args.hardware == "auto" else args.hardware)
    backends = args.backends.split(",")
    with tempfile.TemporaryDirectory() as workdir:
        trainer, state, batch = train.step_inputs(cfg, workdir)
    compiled, memory, losses, ops, states, measured = {}, {}, {}, {}, {}, {}
    for backend in backends:  # each steps its own copy of the state, the last the state itself
        compiled[backend] = trainer.partitioned("train", backend, donate_argnums=0).lower(state, batch).compile()
        text = compiled[backend].as_text()
        ops[backend] = {op: len(re.findall(rf"\s{op}(?:-start)?\(", text))  # instructions, not their names
                        for op in ("ragged-all-to-all", "collective-permute")}
        m = compiled[backend].memory_analysis()
        memory[backend] = int(m.argument_size_in_bytes + m.temp_size_in_bytes)
        own = state if backend == backends[-1] else jax.tree.map(  # a copy keeps the memory kinds
            lambda x: jax.device_put(x, x.sharding, may_alias=False), state)
        jax.block_until_ready(own)
        # the first call's peak on the device, less what others held (the step's own arguments are its)
        before = _stats()
        held = before.get("bytes_in_use", 0) - _device_bytes((own, batch))
        states[backend], metrics = compiled[backend](own, batch)
        losses[backend] = float(metrics["loss"])
        after = _stats()
        if after.get("peak_bytes_in_use", 0) > before.get("peak_bytes_in_use", 0):
            measured[backend] = int(after["peak_bytes_in_use"] - held)
    del state, own

    def stepper(backend):
        def step():
            states[backend], metrics = compiled[backend](states[backend], batch)
            return metrics["loss"]
        return step
    median_s = median_times({b: stepper(b) for b in compiled}, args.steps, warmup=2)
    stats = _stats()
    n = jax.device_count()
    tokens = cfg.train.batch_size * cfg.train.seq_len
    tokens_per_s_dev = tokens / median_s["gshard"] / n
    row = {"case": args.child, "flags": os.environ["GSHARD_BENCH_FLAGS"], "devices": n,
           "device_kind": jax.devices()[0].device_kind, "jax": jax.__version__, "mesh": dict(trainer.mesh.shape),
           "sets": list(args.set), "tokens_per_step": tokens, "ours_ms": 1e3 * median_s["gshard"],
           "tokens_per_s_per_device": tokens_per_s_dev,
           "mfu": model_flops_per_token(cfg) * tokens_per_s_dev / peak_flops(cfg),
           "flops_per_token": model_flops_per_token(cfg),
           "parameters": sum(x.size for x in jax.tree.leaves(trainer.param_shapes)),
           "ours_memory_bytes": memory["gshard"], "peak_bytes_in_use": int(stats.get("peak_bytes_in_use", 0)),
           # our first step's peak on the device (None where an earlier peak hides it, or no device reports it)
           "ours_measured_peak_bytes": measured.get("gshard"), "peak_flops": peak_flops(cfg),
           "profile": hw.name, "efficiency": hw.efficiency,
           # the planner's compute for this step (model flops over devices x peak x efficiency): on one device
           # the whole planned step
           "planned_compute_ms": 1e3 * calibrate.predicted_step(cfg, hw) / n,
           "ours_ragged_all_to_all": ops["gshard"]["ragged-all-to-all"],
           "ours_permutes": ops["gshard"]["collective-permute"],
           **memory_rows(cfg, trainer, compiled["gshard"], hw, args.memory)}
    if "xla" in compiled:
        row.update({"xla_ms": 1e3 * median_s["xla"], "xla_memory_bytes": memory["xla"],
                    "loss_diff": abs(losses["gshard"] - losses["xla"]),
                    "xla_ragged_all_to_all": ops["xla"]["ragged-all-to-all"],
                    "xla_permutes": ops["xla"]["collective-permute"]})
    return row


def run_case(name: str, flags: str, args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name, "--steps", str(args.steps),
           "--hardware", args.hardware, "--cpu-devices", str(args.cpu_devices), "--backends", args.backends]
    cmd += ["--memory"] * args.memory + ["--set", *args.set] * bool(args.set)
    env = dict(os.environ, GSHARD_BENCH_FLAGS=flags)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    rows = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not rows:
        lines = done.stderr.strip().splitlines()
        # the exception's own line (`SomeError: ...`), not the traceback frame JAX prints after it
        raised = [line for line in lines if re.match(r"[\w.]+(Error|Exception|Interrupt)\b", line)]
        print(done.stderr[-6000:], file=sys.stderr)  # the whole tail goes to the log
        return {"case": name, "flags": flags, "error": (raised or lines or ["no output"])[-1]}
    return json.loads(rows[-1])


def format_rows(rows: list[dict]) -> str:
    lines = [f"{'case':<22} {'flags':<5} {'ours ms':>8} {'xla ms':>8} {'ours/xla':>8} {'planned':>8} {'tok/s/dev':>10} "
             f"{'MFU':>6} {'ours mem':>10} {'xla mem':>10} {'peak mem':>10} {'|dloss|':>8} {'ragged':>7} "
             f"{'permutes':>9}"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['case']:<22} {r['flags']:<5} failed: {r['error']}")
            continue
        x = lambda key, form: format(r[key], form) if key in r else "-"  # XLA's columns: "-" where not timed
        ratio = format(r["ours_ms"] / r["xla_ms"], ".2f") if "xla_ms" in r else "-"
        xla_mib = f"{r['xla_memory_bytes'] / 2**20:.1f}Mi" if "xla_memory_bytes" in r else "-"
        lines.append(f"{r['case']:<22} {r['flags']:<5} {r['ours_ms']:>8.2f} {x('xla_ms', '.2f'):>8} {ratio:>8} "
                     f"{r['planned_compute_ms']:>8.2f} {r['tokens_per_s_per_device']:>10,.0f} "
                     f"{100 * r['mfu']:>5.1f}% {r['ours_memory_bytes'] / 2**20:>8.1f}Mi {xla_mib:>10} "
                     f"{r['peak_bytes_in_use'] / 2**20:>8.1f}Mi {x('loss_diff', '.1e'):>8} "
                     f"{r['ours_ragged_all_to_all']:>3}/{x('xla_ragged_all_to_all', 'd'):<3} "
                     f"{r['ours_permutes']:>4}/{x('xla_permutes', 'd'):<4}")
    ok = [r for r in rows if "error" not in r]
    if ok:
        lines.append(f"{ok[0]['devices']} x {ok[0]['device_kind']}, jax {ok[0]['jax']}, mesh per case as "
                     f"configured or all on data; MFU against the {ok[0]['profile']} profile's peak "
                     f"({ok[0]['peak_flops'] / 1e12:.3g} TFLOP/s); planned: the planner's compute ms at its "
                     f"efficiency {ok[0]['efficiency']:.0%}; ragged and permutes: the ragged "
                     f"all-to-alls and collective-permutes of each compiled step, ours/xla")
    for case in dict.fromkeys(r["case"] for r in ok):
        on = [r for r in ok if r["case"] == case and r["flags"] == "on" and "xla_ms" in r]
        off = [r for r in ok if r["case"] == case and r["flags"] == "off" and "xla_ms" in r]
        if on and off:
            lines.append(f"{case}: flags on/off step time, ours {on[0]['ours_ms'] / off[0]['ours_ms']:.2f}, "
                         f"xla {on[0]['xla_ms'] / off[0]['xla_ms']:.2f}")
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(args)), flush=True)
        return
    unknown = [c for c in args.cases.split(",") if c not in CASES]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; expected some of {sorted(CASES)}")
    backends = args.backends.split(",")
    if backends[0] != "gshard" or not set(backends) <= {"gshard", "xla"} or len(set(backends)) != len(backends):
        raise SystemExit(f"--backends {args.backends}: expected gshard or gshard,xla (ours first, then XLA's "
                         f"partitioner for the ratio)")
    rows = []
    for name in args.cases.split(","):
        for flags in args.flags.split(","):
            rows.append(dict(run_case(name, flags, args), hardware=args.hardware))
            print(json.dumps(rows[-1]), flush=True)
    print(format_rows(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if any("error" in r for r in rows):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
