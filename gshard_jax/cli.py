"""The ``gshard-jax`` command line: experiments from ml-collections configs in ``experiments/``.

Every subcommand that takes ``--config FILE`` also takes overrides of the
config's fields, ``--config.model.num_experts=16`` (ml-collections'
config_flags convention); an unknown key or a value of the wrong type is an
error before any work starts. ``--cpu-devices N`` simulates N CPU devices and
``--coordinator/--num-processes/--process-id`` start jax.distributed (under SLURM, Open MPI or a
Kubernetes indexed Job, the scheduler's environment supplies what is not given: training/cluster.py);
both act before JAX starts its backends.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Optional, Sequence

from .training import data, overrides

EXIT_USAGE, EXIT_HALTED, EXIT_MEMORY = 2, 3, 4


def _load(args: argparse.Namespace):
    from . import configs
    cfg = configs.load(args.config)
    return overrides.apply(cfg, args.overrides)


def _setup(args: argparse.Namespace):
    """The typed config (configs.Config) with its overrides, checked before any work; then the devices and
    jax.distributed."""
    from . import configs
    cfg = configs.typed(_load(args))
    from .training.train import init_devices
    init_devices(args.cpu_devices, args.coordinator, args.num_processes, args.process_id,
                 getattr(args, "overlap_flags", True))
    return cfg


def _params(args: argparse.Namespace) -> int:
    from . import configs
    counts = configs.count_params(_load(args).model)
    if args.json:
        print(json.dumps(counts))
    else:
        total, active = counts["total_params"], counts["active_params"]
        print(f"{args.config}: {total:,} parameters ({total / 1e9:.2f}B), {active:,} active per token "
              f"({active / 1e9:.2f}B)")
    return 0


def _plan_overrides(path: str) -> list[tuple[str, str]]:
    """The overrides of a plan file's best candidate (`gshard-jax plan --out`), as (dotted key, value text)."""
    with open(path) as f:
        saved = json.load(f)
    if not saved.get("ranked"):
        raise ValueError(f"plan {path} ranks no candidate (every one was rejected); plan again with a larger "
                         f"--memory-gb or more devices")
    return overrides.split_args(saved["ranked"][0]["overrides"])[1]


def _train(args: argparse.Namespace) -> int:
    if args.plan:  # the plan's choice first: explicit overrides on the command line still win
        args.overrides = _plan_overrides(args.plan) + list(args.overrides)
    cfg = _setup(args)
    from .training import fit, loop, settle
    try:
        summary = loop.train(cfg, args.workdir, progress=not args.no_progress)
    except settle.NonFiniteStep as e:
        print(f"gshard-jax train: halted: {e}", file=sys.stderr)
        return EXIT_HALTED
    except fit.DoesNotFit as e:
        print(f"gshard-jax train: will not fit: {e}\n{_fitting(_load(args), e)}\nnothing was written; rerun "
              f"with the options above, or --config.train.memory_limit_gib=N where the limit is wrong",
              file=sys.stderr)
        return EXIT_MEMORY
    print(json.dumps(summary))
    return 0


def _fitting(cfg, e, target=None) -> str:
    """The planner's options that would fit a step that does not (planner/fit_options.py), on this process's
    devices or a compile target's."""
    import jax

    from .partitioner.costs import hardware
    from .planner import fit_options
    t = cfg.train
    kind, count = (jax.devices()[0], jax.device_count()) if target is None else (target.devices()[0], target.count)
    hw = hardware.get(t.hardware) if t.get("hardware", "auto") != "auto" else (
        hardware.for_device(kind.device_kind) or hardware.default_for(kind.platform))
    return fit_options.suggest(cfg, count, hw, e.limit, e.memory.total)


def _launch(args: argparse.Namespace) -> int:
    from .training import cluster, launch
    cfg = _load(args)  # checked before any process starts
    hosts, source = cluster.hosts_from(args.hosts, args.hostfile, os.environ if args.exec_template else {})
    if hosts and not args.exec_template:
        raise ValueError(f"{len(hosts)} hosts from {source} but no --exec TEMPLATE to start a process on one: "
                         f"e.g. --exec 'ssh -tt {{host}}' or --exec 'srun --nodes=1 --ntasks=1 --nodelist={{host}}'")
    processes, spares = args.processes, args.spares
    if hosts:  # every host is a node: one count gives the other
        processes = len(hosts) - (spares or 0) if processes is None else processes
        spares = len(hosts) - processes if spares is None else spares
        print(f"gshard-jax launch: {len(hosts)} hosts from {source}: {processes} processes, {spares} spares",
              flush=True)
    opts = launch.Options(2 if processes is None else processes, spares or 0, args.cpu_devices, args.hang_timeout,
                          args.startup_timeout, args.max_restarts, shrink=cfg.mesh.get("data", 1) == -1,
                          hosts=tuple(hosts), exec_template=args.exec_template, port=args.port)
    os.makedirs(args.workdir, exist_ok=True)
    train_args = ["--config", os.path.abspath(args.config), "--workdir", os.path.abspath(args.workdir)]
    train_args += [f"--config.{k}={v}" for k, v in args.overrides]
    return launch.launch(opts, train_args, args.workdir)


def _eval(args: argparse.Namespace) -> int:
    cfg = _setup(args)
    from .training import loop
    print(json.dumps(loop.evaluate(cfg, args.workdir)))
    return 0


def _explain(args: argparse.Namespace) -> int:
    cfg = _setup(args)
    from .training import train
    trainer, state, batch = train.step_inputs(cfg, args.workdir)
    report = trainer.explain(state, batch)
    print(report.to_json() if args.json else (report.table() if args.table else report))
    return 0


def _compare(args: argparse.Namespace) -> int:
    cfg = _setup(args)
    from .training import compare
    rows = compare.train_step(cfg, args.workdir, steps=args.steps)
    print(json.dumps(rows) if args.json else compare.format_rows(rows))
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    _setup(args)  # the devices; the config as written (a ConfigDict) is what calibrate reads
    cfg = _load(args)
    from .planner import calibrate
    check = None
    if args.check:
        check = overrides.apply(_load(args), overrides.split_args([f"--config.{kv}" for kv in args.check])[1])
    result = calibrate.run(cfg, args.workdir, args.out, args.config, base=args.base, steps=args.steps, check=check,
                           host_params=calibrate.HOST_UPDATE_PARAMS if args.host_params is None else args.host_params)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{result['device_kind']}: step {result['step_s'] * 1e3:.1f} ms, {result['flops'] / 1e12:.3g} TFLOP "
          f"-> efficiency {result['efficiency']:.1%} of {result['peak_flops'] / 1e12:.3g} TFLOP/s; host update "
          f"{result['host_update_bandwidth'] / 1e9:.3g} GB/s "
          f"({'measured' if result.get('host_update_s_per_param') else 'assumed'}); wrote {args.out}")
    if check is not None:
        c = result["check"]
        print(f"check ({', '.join(args.check)}): measured {c['measured_step_s'] * 1e3:.1f} ms, planned "
              f"{c['predicted_step_s'] * 1e3:.1f} ms ({c['predicted_over_measured']:.2f}x)")
    return 0


def _plan(args: argparse.Namespace) -> int:
    from .planner import axonn, hardware, search
    cfg = _load(args)
    if args.target:
        from . import targets
        count = targets.parse(args.target).count
        if not args.check_memory or count != args.devices:
            raise ValueError(f"--target {args.target} compiles the plan's top candidates: it needs --check-memory K "
                             f"and --devices {count} (the target's devices; got {args.devices})")
    hw = hardware.get(args.hardware)
    if args.comm_model == "axonn":
        t, m = cfg.train, cfg.model
        if not hw.table:
            raise ValueError(f"--comm-model axonn looks bandwidths up in a measured table; profile {hw.name} has "
                             f"none (perlmutter-a100 has AxoNN's)")
        grids = axonn.rank(hw, t.batch_size, t.seq_len, m.num_layers, m.d_model, args.devices, args.min_tp,
                           max(1, t.microbatches), top=args.top)
        rows = [g.to_dict() for g in grids]
        text = json.dumps({"comm_model": "axonn", "config": args.config, "devices": args.devices,
                           "hardware": hw.name, "ranked": rows}, indent=1, sort_keys=True)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")
        if args.json:
            print(text)
        else:
            print(f"AxoNN's comm model: {args.config} on {args.devices} x {hw.name}, min_tp {args.min_tp}")
            print(f"{'#':>3} {'Gr':>5} {'Gc':>5} {'Gd':>5} {'Gdata':>6} {'comm s':>10}")
            for i, g in enumerate(grids, 1):
                print(f"{i:>3} {g.gr:>5} {g.gc:>5} {g.gd:>5} {g.gdata:>6} {g.seconds:>10.4f}")
        return 0
    result = search.plan(cfg, args.devices, hw, memory_gb=args.memory_gb, top=args.top, verify=args.verify,
                         config_name=args.config, pin=[_mesh_arg(m) for m in args.rank_of], worker=True,
                         own_mesh=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(result.to_json() + "\n")
    print(result.to_json() if args.json else result)
    if args.check_memory and result.ranked:
        _check_memory(args, result)
    return 0 if result.ranked else EXIT_HALTED


def _check_memory(args: argparse.Namespace, result) -> None:
    """The top --check-memory candidates compiled on as many simulated CPU devices as the plan has."""
    from .planner import memory_check
    for line in memory_check.report(os.path.abspath(args.config), list(args.overrides), args.devices, result,
                                    args.check_memory, args.target):
        print(line, flush=True)


def _compile(args: argparse.Namespace) -> int:
    from . import targets
    from .training import aot
    target = targets.parse(args.target)
    cfg = _setup(args) if target.compiler == "cpu" else _load(args)
    try:
        result = aot.compile_step(cfg, target)
    except targets.MissingCompiler as e:
        print(f"gshard-jax compile: {e}", file=sys.stderr)
        return EXIT_USAGE
    print(json.dumps(result.to_dict()) if args.json else "\n".join(result.lines()))
    if not result.fits:
        from .training import fit
        memory = result.memory or (result.needed and fit.StepMemory(0, 0, 0, 0, 0, int(result.needed)))
        options = "" if not memory or result.limit is None else "\n" + _fitting(
            _load(args), fit.DoesNotFit(memory, result.limit, result.limit_source), target)
        print(f"gshard-jax compile: will not fit on {target}{options}", file=sys.stderr)
        return EXIT_MEMORY
    return 0


def _mesh_arg(text: str) -> dict[str, int]:
    """"data=256,expert=12" -> {"data": 256, "expert": 12}."""
    try:
        return {k.strip(): int(v) for k, v in (part.split("=") for part in text.split(","))}
    except ValueError:
        raise ValueError(f"--rank-of {text!r}: expected axis=size pairs separated by commas, e.g. "
                         f"data=256,expert=12") from None


def _prepare(args: argparse.Namespace) -> int:
    meta = data.prepare(args.out, args.vocab_size, src=args.source, tokenizer=args.tokenizer,
                        held_out=args.held_out, seed=args.seed, max_bytes=args.max_bytes)
    print(json.dumps({s: {k: v for k, v in m.items() if k != "shards"} for s, m in meta["splits"].items()}))
    return 0


def _plot(args: argparse.Namespace) -> int:
    from .training import metrics
    print(metrics.plot(args.workdirs, args.out, labels=args.labels.split(",") if args.labels else None))
    return 0


def _config_arg(q: argparse.ArgumentParser) -> None:
    q.add_argument("--config", required=True, help="experiment file, e.g. experiments/tiny_moe_lm.py; "
                   "override fields with --config.SECTION.FIELD=VALUE")


def _run_args(q: argparse.ArgumentParser) -> None:
    _config_arg(q)
    q.add_argument("--workdir", required=True, help="directory holding everything the run writes "
                   "(data, checkpoints, metrics.jsonl, tensorboard/, loss.png)")
    q.add_argument("--cpu-devices", type=int, default=0, metavar="N", help="simulate N CPU devices")
    q.add_argument("--coordinator", default="", metavar="HOST:PORT", help="jax.distributed coordinator "
                   "(process 0's address). Without it, a process inside a SLURM step or an Open MPI job joins "
                   "its peers through jax.distributed's cluster detection; in a Kubernetes indexed Job pass "
                   "--coordinator and --num-processes, and JOB_COMPLETION_INDEX is the process id")
    q.add_argument("--num-processes", type=int, default=None, metavar="N", help="processes in a multi-process "
                   "run (default: the scheduler's, else 1)")
    q.add_argument("--process-id", type=int, default=None, metavar="I", help="this process's index (default: "
                   "the scheduler's)")
    q.add_argument("--no-overlap-flags", dest="overlap_flags", action="store_false", help="leave XLA_FLAGS as "
                   "they are (by default XLA:GPU's latency-hiding scheduler and collective pipelining are added)")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gshard-jax", description="GShard-style MoE Transformers on JAX: "
                                "experiments from ml-collections configs in experiments/.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    q = sub.add_parser("train", help="train a config's model, resuming from WORKDIR's newest checkpoint",
                       description="Train the config's model with our partitioner on the config's mesh: a "
                       "progress bar, WORKDIR/metrics.jsonl, TensorBoard events, checkpoints and a loss plot. "
                       "Rerun the same command to resume after a crash.")
    _run_args(q)
    q.add_argument("--no-progress", action="store_true", help="no progress bar")
    q.add_argument("--plan", default="", metavar="PLAN.json", help="run the best candidate of a `gshard-jax plan "
                   "--out` file (its mesh, order, ZeRO stage, microbatches, schedule, remat); --config.* "
                   "overrides given here still win")
    q.set_defaults(run=_train)

    q = sub.add_parser("launch", help="train as N processes with spare nodes, surviving failures",
                       description="Run `train` as --processes cooperating processes (jax.distributed), one per "
                       "node, with --spares spare nodes. A process that exits abnormally or stops beating for "
                       "--hang-timeout seconds ends the attempt: all are stopped, its node is marked bad, and "
                       "the run resumes from its newest checkpoint with a spare in its place (with none left, "
                       "on fewer processes when mesh.data is -1). Nodes are local processes, or hosts (--hosts, "
                       "--hostfile or SLURM_JOB_NODELIST) started through --exec; the workdir must be shared. "
                       "WORKDIR/launch.jsonl logs every attempt. "
                       "Exits 0 when the run finishes, 75 when preempted (SIGTERM), 4 when it gives up.")
    _config_arg(q)
    q.add_argument("--workdir", required=True, help="the run's directory (as for train)")
    q.add_argument("--processes", type=int, default=None, metavar="N", help="processes (nodes) the run uses "
                   "(default: 2, or on hosts every host that is not a spare)")
    q.add_argument("--spares", type=int, default=None, metavar="K", help="spare nodes (default: 0, or on hosts "
                   "every host beyond --processes)")
    q.add_argument("--hosts", default="", metavar="H1,H2,...", help="run on these hosts, one process each, in "
                   "order (Slurm hostlist ranges allowed: nid[001-004]); needs --exec")
    q.add_argument("--hostfile", default="", metavar="FILE", help="hosts, one per line (the first word; # comments)")
    q.add_argument("--exec", dest="exec_template", default="", metavar="TEMPLATE", help="the command prefix that "
                   "starts a process on {host}: 'ssh -tt {host}', 'srun --nodes=1 --ntasks=1 --nodelist={host}' or "
                   "any prefix. Inside a SLURM allocation without --hosts/--hostfile, the hosts are "
                   "SLURM_JOB_NODELIST's")
    q.add_argument("--port", type=int, default=0, metavar="P", help="the coordinator's port on the first host "
                   "(default: a port free on this machine, new each attempt)")
    q.add_argument("--cpu-devices", type=int, default=0, metavar="D", help="simulated CPU devices per process")
    q.add_argument("--hang-timeout", type=float, default=300.0, metavar="S", help="seconds without progress "
                   "that count as a hang")
    q.add_argument("--startup-timeout", type=float, default=900.0, metavar="S", help="seconds allowed before "
                   "the first step of an attempt (compilation)")
    q.add_argument("--max-restarts", type=int, default=3, metavar="R", help="relaunches before giving up")
    q.set_defaults(run=_launch)

    q = sub.add_parser("eval", help="held-out loss of WORKDIR's newest checkpoint",
                       description="Print the held-out loss of the newest full or model-only checkpoint as JSON.")
    _run_args(q)
    q.set_defaults(run=_eval)

    q = sub.add_parser("explain", help="the partition report of the config's train step",
                       description="Print gs.explain() of the config's train step on its mesh: every "
                       "sharding decision and collective, with bytes and cost.")
    _run_args(q)
    q.add_argument("--table", action="store_true", help="every op, not only those that communicate")
    q.add_argument("--json", action="store_true", help="the report as JSON")
    q.set_defaults(run=_explain)

    q = sub.add_parser("compare", help="our partitioner against XLA's on the config's train step",
                       description="Partition the config's train step with ours and with XLA's partitioner "
                       "and print collectives, bytes moved per device and median step times.")
    _run_args(q)
    q.add_argument("--steps", type=int, default=5, help="timed steps per backend")
    q.add_argument("--json", action="store_true", help="print JSON")
    q.set_defaults(run=_compare)

    q = sub.add_parser("calibrate", help="measure the compute efficiency of a config's step on the device "
                       "present and write a hardware profile for plan --hardware",
                       description="Time the config's train step on one device (no communication) and write "
                       "the device's profile with the efficiency measured: plan --hardware OUT ranks on it.")
    _run_args(q)
    q.add_argument("--out", required=True, metavar="PROFILE.json", help="the hardware profile to write")
    q.add_argument("--base", default="", metavar="PROFILE", help="the profile whose figures the new one keeps "
                   "(default: the built-in profile of the device's kind)")
    q.add_argument("--steps", type=int, default=10, help="timed steps (after 2 untimed)")
    q.add_argument("--check", action="append", default=[], metavar="SECTION.FIELD=VALUE", help="also time the "
                   "config with this override (repeatable) and compare the planner's prediction for it")
    q.add_argument("--host-params", type=int, default=None, metavar="N", help="parameters of the offloaded "
                   "update timed on the host for the profile's host_update_bandwidth (default 2**25; 0: keep the "
                   "base profile's)")
    q.add_argument("--json", action="store_true", help="print JSON")
    q.set_defaults(run=_calibrate)

    q = sub.add_parser("plan", help="rank parallel configurations of N devices for a config",
                       description="Enumerate mesh factorisations (and axis orders), ZeRO stages, EPSO, "
                       "microbatches, pipeline schedules and remat policies; reject what cannot run with one "
                       "reason; screen the rest by formula and plan the fastest with the partitioner on an "
                       "abstract mesh; print the ranking, why the best wins, and how it moves if bandwidths are "
                       "off by 2x. Exits 3 when nothing fits the memory budget.")
    _config_arg(q)
    q.add_argument("--devices", type=int, required=True, metavar="N", help="devices to plan for")
    q.add_argument("--hardware", default="cpu-simulation", metavar="PROFILE", help="a built-in profile (cpu-"
                   "simulation, h100-8, perlmutter-a100, tpu-v3, aurora-pvc) or a JSON file of "
                   "gshard_jax.partitioner.costs.hardware.Hardware's fields")
    q.add_argument("--memory-gb", type=float, default=None, metavar="M", help="memory budget per device in GiB "
                   "(default: the profile's device memory)")
    q.add_argument("--top", type=int, default=5, metavar="K", help="candidates to show")
    q.add_argument("--verify", type=int, default=None, metavar="V", help="candidates planned by the "
                   "partitioner (default: --top)")
    q.add_argument("--comm-model", choices=("ours", "axonn"), default="ours", help="axonn: AxoNN's published "
                   "communication model over its 4D grids (powers of two, x/y/z/data), for comparison")
    q.add_argument("--min-tp", type=int, default=1, metavar="T", help="--comm-model axonn: the least Gc Gr Gd")
    q.add_argument("--rank-of", action="append", default=[], metavar="AXIS=N,...", help="a mesh to place in "
                   "the ranking whatever its rank (a paper's own configuration): its best variant is planned by "
                   "the partitioner too and compared with #1 (repeatable). The config's own mesh section is "
                   "always, where it resolves on --devices")
    q.add_argument("--json", action="store_true", help="print the plan as JSON")
    q.add_argument("--out", default="", metavar="PLAN.json", help="write the plan as JSON (for train --plan)")
    q.add_argument("--check-memory", type=int, default=0, metavar="K", help="compile the top K candidates' train "
                   "steps on as many simulated CPU devices as --devices (or for --target's), in a child "
                   "process, and print their compiled memory per device against the plan's")
    q.add_argument("--target", default="", metavar="T", help="with --check-memory: compile for this target "
                   "(gshard-jax compile's: tpu:v3:8x8, gpu:a100-40:1x16x4, ...) of --devices devices")
    q.set_defaults(run=_plan)

    q = sub.add_parser("compile", help="compile a config's train step for a TPU, GPU or CPU target, without it",
                       description="Compile the config's train step with our partitioner for a target's devices "
                       "(XLA:TPU and XLA:GPU compile here without the devices: gshard_jax/targets) and print "
                       "the memory per device that compiler holds against the device's (fits, or by how much "
                       "not, with the breakdown and the planner's options), the collectives per step, and "
                       "XLA:TPU's estimate of the step's time. Exits 4 when the step does not fit.")
    _config_arg(q)
    q.add_argument("--target", required=True, metavar="T", help="tpu:GEN:TOPOLOGY (tpu:v5p:2x2x2; GEN v3, v4, "
                   "v5e, v5p or v6e), gpu:GPU:SLICESxHOSTSxGPUS (gpu:h100:1x1x8; GPU h100, h200, a100-40, "
                   "a100-80 or b200) or cpu:N (N simulated CPU devices)")
    q.add_argument("--cpu-devices", type=int, default=0, metavar="N", help="with a cpu target: simulate N CPU "
                   "devices (default: the target's)")
    q.add_argument("--json", action="store_true", help="print the result as one JSON object")
    q.set_defaults(run=_compile, coordinator="", num_processes=None, process_id=None)

    q = sub.add_parser("params", help="count a config's parameters (total and active per token)",
                       description="Print the total parameters and the parameters active per token of the "
                       "config's model, computed from shapes with jax.eval_shape (nothing is allocated).")
    _config_arg(q)
    q.add_argument("--json", action="store_true", help='print one JSON object {"total_params": N, '
                   '"active_params": N}')
    q.set_defaults(run=_params)

    q = sub.add_parser("prepare-data", help="tokenise a directory of text files into token shards",
                       description="Train a byte-level BPE on the files (or use --tokenizer), hold out a "
                       "fraction of the files, and write .npy token shards read back by mmap. With no "
                       "--source, the corpus is the Python standard library's sources.")
    q.add_argument("--out", required=True, help="output directory")
    q.add_argument("--source", default=None, help="directory of text files (default: Python's stdlib sources)")
    q.add_argument("--vocab-size", type=int, default=2048, help="BPE vocabulary size (<= the model's)")
    q.add_argument("--tokenizer", default=None, help="a tokenizers JSON file to use instead of training one")
    q.add_argument("--held-out", type=float, default=data.HELD_OUT, help="fraction of files held out")
    q.add_argument("--seed", type=int, default=0, help="shuffle seed for the held-out split")
    q.add_argument("--max-bytes", type=int, default=data.MAX_BYTES, help="default corpus: at most this many bytes")
    q.set_defaults(run=_prepare)

    q = sub.add_parser("plot", help="plot the loss curves of one or more runs",
                       description="Training and held-out loss against step for each WORKDIR, on one PNG.")
    q.add_argument("workdirs", nargs="+", metavar="WORKDIR")
    q.add_argument("--out", default="loss.png", help="PNG to write")
    q.add_argument("--labels", default="", help="comma-separated legend labels (default: directory names)")
    q.set_defaults(run=_plot)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = parser()
    try:
        rest, found = overrides.split_args(argv)
    except ValueError as e:
        p.error(str(e))
    args = p.parse_args(rest)
    args.overrides = found
    if found and not hasattr(args, "config"):
        p.error(f"{args.command} takes no --config overrides")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("absl", "jax", "matplotlib", "orbax"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from .training.faults import EXIT_PREEMPTED, Preempted
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"gshard-jax {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except Preempted as e:
        print(f"gshard-jax {args.command}: {e}", file=sys.stderr)
        return EXIT_PREEMPTED


if __name__ == "__main__":
    sys.exit(main())
