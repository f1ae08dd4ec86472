"""`gshard-jax launch`: run `gshard-jax train` as N cooperating processes (one per node, jax.distributed)
with K spare nodes, and keep the run alive.

A node is a local process, or a host: hosts come from --hosts, --hostfile or SLURM's node list
(cluster.hosts_from), and `--exec TEMPLATE` starts a process on one (`ssh -tt {host}`, `srun --nodes=1
--ntasks=1 --nodelist={host}`, any prefix; `{host}` is replaced). The coordinator is the first good host
of the attempt; heartbeats, soft-failure reports and launch.jsonl live in the workdir, which every host
shares. A remote process starts in the supervisor's working directory, with the same Python.

The supervisor watches every attempt. An attempt ends when:
- a process exits abnormally;
- a process stops beating for `hang_timeout` seconds (its peers wait forever in a collective), after a
  startup allowance for compilation;
- a step halts on non-finite rows that `train` names by process (a soft failure: it writes
  soft_failure.PROCESS.json beside its heartbeat before exiting). Non-finite rows on every process, or
  the same step failing again on the replacements, are the data or the model, not a node: the run stops.

Every process is then stopped, the failed nodes are marked bad, and the run is relaunched on the remaining
good nodes (a spare takes the failed one's place). `train` resumes from the newest checkpoint. Without a
spare, the run goes on with fewer processes when the config lets the data axis take the rest
(`mesh.data = -1`); the global batch stays. Otherwise it stops with the reason.

Every attempt, failure and replacement goes to WORKDIR/launch.jsonl and is printed. SIGTERM to the
supervisor is passed to every process; they checkpoint at the next step and exit with EXIT_PREEMPTED, and
so does the supervisor.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from typing import Sequence

from .faults import EXIT_PREEMPTED, HEARTBEAT_ENV, NODE_ENV, SOFT_FAILURE, die_with_parent

EXIT_GAVE_UP = 4  # the run failed more times than allowed, or too few nodes are left
EXIT_HALTED = 3  # cli.EXIT_HALTED: a non-finite step; a soft failure when it names processes, else no retry
EXIT_MEMORY = 4  # cli.EXIT_MEMORY: the compiled step does not fit the devices' memory (training/fit.py): no retry
TERMINAL = {2: "a usage error", EXIT_HALTED: "halted on a non-finite step",  # cli.EXIT_USAGE: no retry
            EXIT_MEMORY: "the train step does not fit the devices' memory"}


@dataclasses.dataclass
class Options:
    processes: int  # nodes a run uses
    spares: int  # extra nodes that replace failed ones
    cpu_devices: int  # simulated devices per process (0: the host's)
    hang_timeout: float  # seconds without a heartbeat from a running process that count as a hang
    startup_timeout: float  # seconds allowed before the first heartbeat of an attempt (compilation)
    max_restarts: int  # relaunches before giving up
    shrink: bool  # without spares, go on with fewer processes (the config's data axis takes the rest)
    hosts: tuple[str, ...] = ()  # one node per host (the first `processes` run, the rest are spares); () local
    exec_template: str = ""  # the prefix that starts a process on {host} ("": a local process)
    port: int = 0  # the coordinator's port (0: a free port of this machine, new each attempt)


KILL_GRACE = 10.0  # seconds between SIGTERM and SIGKILL for processes started through --exec (srun, ssh)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Supervisor:
    def __init__(self, opts: Options, train_args: Sequence[str], workdir: str):
        self.opts, self.train_args, self.workdir = opts, list(train_args), workdir
        self.dir = os.path.join(workdir, "launch")
        self.bad: list[int] = []
        self.soft_steps: dict[int, list[int]] = {}  # step -> the nodes a soft failure at that step named
        self.procs: list[subprocess.Popen] = []
        self.term = False

    def hosts(self, nodes: list[int]) -> dict:
        """{"hosts": [...]} for an event about `nodes` when the nodes are hosts, else {}."""
        return {"hosts": [self.opts.hosts[n] for n in nodes]} if self.opts.hosts else {}

    def log(self, event: str, **fields) -> None:
        row = {"time": round(time.time(), 3), "event": event, **fields}
        with open(os.path.join(self.workdir, "launch.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")
        print("gshard-jax launch: " + " ".join(f"{k}={v}" for k, v in row.items() if k != "time"), flush=True)

    def run(self) -> int:
        os.makedirs(self.dir, exist_ok=True)
        previous = signal.signal(signal.SIGTERM, self._on_term)
        try:
            return self._attempts()
        finally:
            self._stop()
            signal.signal(signal.SIGTERM, previous)

    def _on_term(self, signum, frame) -> None:
        self.term = True
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)

    def _attempts(self) -> int:
        o = self.opts
        nodes = list(range(len(o.hosts) or o.processes + o.spares))
        n = o.processes
        for attempt in range(o.max_restarts + 1):
            good = [x for x in nodes if x not in self.bad]
            if len(good) < n:
                if not o.shrink or not good:
                    self.log("stopped", reason=f"{len(good)} good nodes left for {n} processes and no spare; "
                             f"rerun with more --spares, or let the data axis shrink (mesh.data=-1, --shrink)")
                    return EXIT_GAVE_UP
                self.log("shrink", processes=len(good), was=n)
                n = len(good)
            chosen = good[:n]
            port = o.port or _free_port()
            coordinator = f"{o.hosts[chosen[0]] if o.hosts else '127.0.0.1'}:{port}"  # the first good host
            self.log("attempt", attempt=attempt, nodes=chosen, processes=n, **self.hosts(chosen),
                     **({"coordinator": coordinator} if o.hosts else {}))
            failed = self._one(attempt, chosen, coordinator)
            if failed is None:
                self.log("done", attempt=attempt)
                return 0
            if failed == "preempted":
                self.log("preempted", attempt=attempt)
                return EXIT_PREEMPTED
            failed_nodes, kind, detail = failed
            if kind == "terminal":  # the run itself is wrong (a bad config, a NaN under halt): no retry
                self.log("stopped", attempt=attempt, nodes=failed_nodes, reason=f"exit status {detail} "
                         f"({TERMINAL[detail]}); see {self.dir}")
                return detail
            extra = {}
            if kind == "soft":
                step, extra = detail["step"], {"step": detail["step"], "devices": detail["devices"]}
                detail = detail["message"]
                if step in self.soft_steps:  # a spare went non-finite at the same step: not a node's fault
                    self.log("stopped", attempt=attempt, nodes=failed_nodes, reason=f"step {step} went non-finite "
                             f"on nodes {self.soft_steps[step]} and again on {failed_nodes} after they were "
                             f"replaced: the data or the model, not a node; see {self.dir}")
                    return EXIT_HALTED
                self.soft_steps[step] = failed_nodes
            self.bad.extend(failed_nodes)
            self.log("failure", attempt=attempt, nodes=failed_nodes,
                     processes=[chosen.index(x) for x in failed_nodes], kind=kind, detail=detail, **extra,
                     **self.hosts(failed_nodes))
            spare = [x for x in nodes if x not in self.bad and x not in chosen]
            for node, by in zip(failed_nodes, spare):
                self.log("replaced", node=node, by=by, **({"host": o.hosts[node], "by_host": o.hosts[by]}
                                                          if o.hosts else {}))
        self.log("stopped", reason=f"the run failed {o.max_restarts + 1} times; see {self.dir}")
        return EXIT_GAVE_UP

    def _one(self, attempt: int, chosen: list[int], coordinator: str):
        """Run one attempt: None when every process finished, "preempted", or (failed nodes, kind, detail)."""
        o = self.opts
        beats = os.path.join(self.dir, f"heartbeat.{attempt}")
        shutil.rmtree(beats, ignore_errors=True)  # a rerun in the same workdir: no stale beats or reports
        os.makedirs(beats)
        self.procs = []
        for i, node in enumerate(chosen):
            args = [sys.executable, "-m", "gshard_jax.cli", "train", *self.train_args, "--no-progress",
                    "--num-processes", str(len(chosen)), "--process-id", str(i), "--coordinator", coordinator]
            if o.cpu_devices:
                args += ["--cpu-devices", str(o.cpu_devices)]
            marks = {NODE_ENV: str(node), HEARTBEAT_ENV: beats}
            out = open(os.path.join(self.dir, f"attempt{attempt}.node{node}.log"), "w")
            self.procs.append(subprocess.Popen(self._command(args, marks, node), stdout=out,
                                               stderr=subprocess.STDOUT, env=dict(os.environ, **marks),
                                               start_new_session=True, preexec_fn=die_with_parent))
            out.close()
        started = time.time()
        try:
            while True:
                time.sleep(0.2)
                codes = [p.poll() for p in self.procs]
                if all(c == 0 for c in codes):
                    return None
                if self.term and all(c is not None for c in codes):
                    return "preempted"
                for i, c in enumerate(codes):  # a halt first: its peers may die of its exit in the same poll
                    soft = self._soft_failure(beats, i, chosen) if c == EXIT_HALTED else None
                    if soft is not None:
                        return soft
                for node, c in zip(chosen, codes):
                    if c in TERMINAL:
                        return [node], "terminal", c
                    if c not in (None, 0) and not self.term:
                        return [node], "exit", f"exit status {c}"
                if self.term:
                    continue
                hung = self._hung(beats, chosen, started)
                if hung is not None:
                    return hung
        finally:
            self._stop()

    def _command(self, args: list[str], marks: dict, node: int) -> list[str]:
        """The argv that starts `args` on `node`: the args themselves, or the exec template's prefix for its
        host, then a shell that enters this working directory and sets the node's variables (a remote host
        inherits neither). ssh hands a remote shell one command line, so there the command is quoted."""
        o = self.opts
        if not o.exec_template:
            return args
        prefix = shlex.split(o.exec_template.replace("{host}", o.hosts[node]))
        command = ["sh", "-c", 'cd "$1" && shift && exec "$@"', "sh", os.getcwd(), "env",
                   *[f"{k}={v}" for k, v in marks.items()], *args]
        return prefix + ([shlex.join(command)] if os.path.basename(prefix[0]) == "ssh" else command)

    def _soft_failure(self, beats: str, process: int, chosen: list[int]):
        """(nodes, "soft", detail) when process `process` halted on non-finite rows it could name."""
        path = os.path.join(beats, SOFT_FAILURE.format(process))
        if not os.path.exists(path):
            return None
        with open(path) as f:
            found = json.load(f)
        culprits = found["culprits"]
        processes = sorted({p for c in culprits for p in c["processes"]})
        devices = sorted({d for c in culprits for d in c["devices"]})
        if len(processes) == len(chosen):  # every node at once: the data or the model (e.g. a diverged loss)
            return None
        return [chosen[p] for p in processes], "soft", {
            "step": found["step"], "devices": devices,
            "message": f"non-finite rows at step {found['step']} on devices {devices} of processes {processes}"}

    def _hung(self, beats: str, chosen: list[int], started: float):
        """(node, "hang", detail) when the run stopped beating: the node with the oldest step is blamed."""
        o = self.opts
        seen = {}
        for i, node in enumerate(chosen):
            path = os.path.join(beats, f"{i}.step")
            if os.path.exists(path):
                with open(path) as f:
                    text = f.read().strip()
                seen[node] = (int(text or 0), os.path.getmtime(path))
        now = time.time()
        if len(seen) < len(chosen):
            if now - started > o.startup_timeout:
                node = next(x for x in chosen if x not in seen)
                return [node], "hang", f"no heartbeat within --startup-timeout {o.startup_timeout:.0f} s"
            return None
        if now - max(t for _, t in seen.values()) <= o.hang_timeout:
            return None
        node = min(seen, key=lambda x: (seen[x][0], seen[x][1]))
        return [node], "hang", f"no process advanced for {o.hang_timeout:.0f} s; node {node} is at step {seen[node][0]}"

    def _stop(self) -> None:
        """Stop every process of the attempt. Through --exec, SIGTERM first (srun and ssh pass it on to the
        remote process), then SIGKILL after KILL_GRACE seconds."""
        live = [p for p in self.procs if p.poll() is None]
        if self.opts.exec_template and live:
            _signal(live, signal.SIGTERM)
            deadline = time.time() + KILL_GRACE
            while time.time() < deadline and any(p.poll() is None for p in live):
                time.sleep(0.1)
        _signal([p for p in self.procs if p.poll() is None], signal.SIGKILL)
        for p in self.procs:
            p.wait()


def _signal(procs: list, sig: int) -> None:
    for p in procs:
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            pass


def launch(opts: Options, train_args: Sequence[str], workdir: str) -> int:
    """Supervise `gshard-jax train TRAIN_ARGS` (they include --config and --workdir) as opts says."""
    if opts.processes < 1 or opts.spares < 0 or opts.max_restarts < 0:
        raise ValueError(f"--processes {opts.processes}, --spares {opts.spares}, --max-restarts "
                         f"{opts.max_restarts}: expected at least 1 process and no negative counts")
    if opts.hosts and opts.processes + opts.spares != len(opts.hosts):
        raise ValueError(f"--processes {opts.processes} and --spares {opts.spares} on {len(opts.hosts)} hosts "
                         f"{list(opts.hosts)}: every host is a process or a spare; give one of the two counts")
    if opts.exec_template and not opts.hosts:
        raise ValueError(f"--exec {opts.exec_template!r} starts processes on hosts, but no host is given: pass "
                         f"--hosts, --hostfile, or run inside a SLURM allocation (SLURM_JOB_NODELIST)")
    if opts.exec_template and "{host}" not in opts.exec_template:
        raise ValueError(f"--exec {opts.exec_template!r} does not name {{host}}: e.g. 'ssh -tt {{host}}' or "
                         f"'srun --nodes=1 --ntasks=1 --nodelist={{host}}'")
    return Supervisor(opts, train_args, workdir).run()


def read(workdir: str) -> list[dict]:
    """The events of WORKDIR/launch.jsonl."""
    path = os.path.join(workdir, "launch.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
