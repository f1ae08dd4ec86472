"""Where a multi-process run finds its peers: the scheduler it runs under, and the hosts it may use.

`train` without ``--coordinator`` joins its peers through jax.distributed's own cluster detection
(``jax.distributed.initialize()`` with no arguments) inside a SLURM step or an Open MPI job. A Kubernetes
indexed Job (or JobSet) gives each pod its index (``JOB_COMPLETION_INDEX``) and nothing else: the manifest
passes the coordinator (the index-0 pod's address) and the process count, and the index is the process id.
Open MPI 5 no longer exports ``OMPI_MCA_orte_hnp_uri``, from which JAX reads the coordinator: there the
coordinator is given and the ranks come from ``OMPI_COMM_WORLD_*``.

A scheduler whose variables are only partly set (some exported by hand, a task started outside its step)
is an error that names what is missing; one fully set is logged with the variables read.

`launch` runs a process per host: hosts come from ``--hosts``, a hostfile, or SLURM's node list
(``SLURM_JOB_NODELIST``, in Slurm's hostlist syntax: ``nid[001-004,010]``).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import re
from typing import Mapping, Optional

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Scheduler:
    name: str
    needs: tuple[str, ...]  # every variable jax.distributed (or we) read under it
    marks: tuple[str, ...]  # any of these set means the process is a task of this scheduler
    count: str  # the variable holding the number of processes
    rank: str  # the variable holding this process's id
    how: str  # how to start tasks so that every variable is set


SLURM = Scheduler("SLURM", ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID"),
                  ("SLURM_STEP_NODELIST", "SLURM_STEP_NUM_NODES"), "SLURM_NTASKS", "SLURM_PROCID",
                  "start each process with srun inside the allocation (srun sets them per task)")
OPEN_MPI = Scheduler("Open MPI", ("OMPI_MCA_orte_hnp_uri", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK",
                                  "OMPI_COMM_WORLD_LOCAL_RANK"),
                     ("OMPI_MCA_orte_hnp_uri", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"),
                     "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "start the processes with mpirun")
KUBERNETES = Scheduler("Kubernetes indexed Job", ("JOB_COMPLETION_INDEX",), ("JOB_COMPLETION_INDEX",), "",
                       "JOB_COMPLETION_INDEX", "run as an Indexed Job (completionMode: Indexed) or a JobSet")
SCHEDULERS = (SLURM, OPEN_MPI, KUBERNETES)
COORDINATOR_ENV = "JAX_COORDINATOR_ADDRESS"  # read by jax.distributed itself when no coordinator is passed


@dataclasses.dataclass(frozen=True)
class Peers:
    """How this process joins its run: `initialize`'s arguments (None: jax.distributed detects it)."""
    scheduler: str  # "SLURM", "Open MPI", "Kubernetes indexed Job", "flags" or "" (one process)
    coordinator: Optional[str]
    num_processes: Optional[int]
    process_id: Optional[int]
    detect: bool  # whether jax.distributed's cluster detection fills in what is None
    read: dict  # the environment variables the choice was made from

    @property
    def multi(self) -> bool:
        return self.scheduler != "" and self.num_processes != 1

    def describe(self) -> str:
        env = ", ".join(f"{k}={v}" for k, v in self.read.items())
        by = "jax.distributed's cluster detection" if self.detect else "the given coordinator"
        return f"{self.scheduler} ({env}): joining through {by}" if env else f"{self.scheduler}: joining through {by}"


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ValueError(f"{name}={env[name]!r} is not an integer") from None


def detect(env: Mapping[str, str], coordinator: str = "", num_processes: Optional[int] = None,
           process_id: Optional[int] = None) -> Peers:
    """The peers of a process with environment `env` and the command line's --coordinator, --num-processes
    and --process-id (None or "": not given). Flags win over the environment."""
    coordinator = coordinator or env.get(COORDINATOR_ENV, "")
    given = (coordinator, num_processes, process_id)
    if coordinator and num_processes is not None and process_id is not None:
        return _checked(Peers("flags", coordinator, num_processes, process_id, False, {}))
    for s in SCHEDULERS:
        present = [v for v in s.needs if v in env]
        if not any(v in env for v in s.marks):
            continue
        read = {v: env[v] for v in present}
        if s is KUBERNETES:
            return _kubernetes(env, read, *given)
        missing = [v for v in s.needs if v not in env]
        if s is OPEN_MPI and missing == ["OMPI_MCA_orte_hnp_uri"] and coordinator:  # Open MPI 5 (PRRTE)
            return _checked(Peers(s.name, coordinator, _int(env, s.count) if num_processes is None else num_processes,
                                  _int(env, s.rank) if process_id is None else process_id, False, read))
        if missing:
            hint = (f"; Open MPI 5 does not export OMPI_MCA_orte_hnp_uri, so pass --coordinator HOST:PORT (rank "
                    f"0's host) or set {COORDINATOR_ENV}") if s is OPEN_MPI and "OMPI_MCA_orte_hnp_uri" in missing \
                else ""
            raise ValueError(f"a half-set {s.name} environment: {', '.join(f'{k}={v}' for k, v in read.items())} "
                             f"are set but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not. "
                             f"{s.how[0].upper() + s.how[1:]}{hint}, or unset them to run one process")
        count = _int(env, s.count) if num_processes is None else num_processes
        if count == 1:
            return Peers(s.name, None, 1, 0, False, read)
        return _checked(Peers(s.name, coordinator or None, num_processes, process_id, True, read))
    if num_processes is not None and num_processes > 1 or coordinator:
        if not coordinator or num_processes is None:
            raise ValueError(f"--num-processes {num_processes} and --coordinator {coordinator or '(none)'}: a "
                             f"multi-process run outside SLURM, Open MPI or a Kubernetes indexed Job needs "
                             f"--coordinator HOST:PORT, --num-processes N and --process-id I")
        if process_id is None:
            raise ValueError(f"--coordinator {coordinator} --num-processes {num_processes} needs --process-id I "
                             f"outside SLURM, Open MPI or a Kubernetes indexed Job")
        return _checked(Peers("flags", coordinator, num_processes, process_id, False, {}))
    return Peers("", None, 1, 0, False, {})


def _kubernetes(env: Mapping[str, str], read: dict, coordinator: str, num_processes: Optional[int],
                process_id: Optional[int]) -> Peers:
    index = _int(env, "JOB_COMPLETION_INDEX") if process_id is None else process_id
    missing = ([f"--coordinator HOST:PORT (or {COORDINATOR_ENV}): the index-0 pod's address, e.g. "
                f"JOB-0.SERVICE:1234 under a headless service"] * (not coordinator) +
               ["--num-processes N: the Job's completions"] * (num_processes is None))
    if missing:
        raise ValueError(f"a Kubernetes indexed Job (JOB_COMPLETION_INDEX={env['JOB_COMPLETION_INDEX']}) names "
                         f"only this pod's index; the manifest must also pass " + " and ".join(missing))
    return _checked(Peers(KUBERNETES.name, coordinator, num_processes, index, False, read))


def _checked(p: Peers) -> Peers:
    if p.num_processes is not None and p.num_processes < 1:
        raise ValueError(f"{p.num_processes} processes ({p.scheduler}): expected at least 1")
    if p.num_processes is not None and p.process_id is not None and not 0 <= p.process_id < p.num_processes:
        raise ValueError(f"process id {p.process_id} is not in [0, {p.num_processes}) ({p.scheduler}"
                         + (f": {', '.join(f'{k}={v}' for k, v in p.read.items())}" if p.read else "") + ")")
    if p.coordinator and not re.fullmatch(r".+:\d+", p.coordinator):
        raise ValueError(f"coordinator {p.coordinator!r}: expected HOST:PORT")
    return p


# ------------------------------------------------------------------------------------------------ hosts
def expand_hostlist(text: str) -> list[str]:
    """Slurm's hostlist syntax expanded: "nid[001-003,010],login1" -> nid001 nid002 nid003 nid010 login1;
    ranges keep their zero padding, and several bracket groups in one name multiply ("r[1-2]n[1-2]")."""
    hosts: list[str] = []
    for name in _top_level_split(text.strip()):
        if name:
            hosts += _expand_one(name, text)
    return hosts


def _top_level_split(text: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += (ch == "[") - (ch == "]")
        if depth < 0 or depth > 1:
            raise ValueError(f"hostlist {text!r}: unbalanced or nested brackets")
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if depth:
        raise ValueError(f"hostlist {text!r}: a '[' is not closed")
    return parts + [cur]


def _expand_one(name: str, text: str) -> list[str]:
    m = re.search(r"\[([^\]]*)\]", name)
    if m is None:
        return [name]
    values = []
    for part in m.group(1).split(","):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()) or (hi and int(hi) < int(lo)):
            raise ValueError(f"hostlist {text!r}: {part!r} is not a number or an ascending range like 001-004")
        width = len(lo)
        values += [str(i).zfill(width) for i in range(int(lo), int(hi or lo) + 1)]
    head, tail = name[:m.start()], name[m.end():]
    return [head + v + rest for v in values for rest in _expand_one(tail, text)]


def read_hostfile(path: str) -> list[str]:
    """Hosts of a hostfile: one per line, the first word (an MPI hostfile's `slots=` are ignored); # comments."""
    hosts = []
    with open(path) as f:
        for line in f:
            words = line.split("#", 1)[0].split()
            if words:
                hosts.append(words[0])
    if not hosts:
        raise ValueError(f"hostfile {path} lists no host")
    return hosts


def hosts_from(hosts: str = "", hostfile: str = "", env: Optional[Mapping[str, str]] = None) -> tuple[list[str], str]:
    """(hosts, where they came from): --hosts, else --hostfile, else SLURM_JOB_NODELIST; ([], "") if none."""
    env = os.environ if env is None else env
    if hosts and hostfile:
        raise ValueError("--hosts and --hostfile both given; pass one")
    if hosts:
        found, source = expand_hostlist(hosts), "--hosts"
    elif hostfile:
        found, source = read_hostfile(hostfile), f"--hostfile {hostfile}"
    elif env.get("SLURM_JOB_NODELIST"):
        found, source = expand_hostlist(env["SLURM_JOB_NODELIST"]), "SLURM_JOB_NODELIST"
    else:
        return [], ""
    repeated = sorted({h for h in found if found.count(h) > 1})
    if repeated:
        raise ValueError(f"hosts from {source} repeat {repeated}: each host runs one process; list each once")
    return found, source
