"""Scheduler detection and host lists (training/cluster.py), and launch's checks of its hosts; the
multi-process runs themselves are in test_cli_train.py."""
import pytest

from gshard_jax.training import cluster, launch

SLURM = {"SLURM_JOB_ID": "77", "SLURM_STEP_NODELIST": "nid[001-002]", "SLURM_NTASKS": "2", "SLURM_PROCID": "1",
         "SLURM_LOCALID": "0"}
OMPI = {"OMPI_MCA_orte_hnp_uri": "4096.0;tcp://10.0.0.1:4000", "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}


def test_a_full_slurm_or_open_mpi_environment_is_left_to_jax_detection():
    for env, name in ((SLURM, "SLURM"), (OMPI, "Open MPI")):
        p = cluster.detect(env)
        assert (p.scheduler, p.detect, p.multi) == (name, True, True)
        assert (p.coordinator, p.num_processes, p.process_id) == (None, None, None)  # jax.distributed reads them
        assert p.read == env and name in p.describe() and "cluster detection" in p.describe()


def test_flags_win_over_the_scheduler_and_turn_detection_off():
    """launch starts each process with all three flags, through srun: its one-task step is not the run."""
    p = cluster.detect(dict(SLURM, SLURM_NTASKS="1", SLURM_PROCID="0"), "h:1", 4, 2)
    assert (p.scheduler, p.coordinator, p.num_processes, p.process_id, p.detect) == ("flags", "h:1", 4, 2, False)


def test_one_task_runs_alone():
    p = cluster.detect(dict(SLURM, SLURM_NTASKS="1", SLURM_PROCID="0"))
    assert p.scheduler == "SLURM" and not p.multi
    assert not cluster.detect({}).multi and cluster.detect({}).scheduler == ""


@pytest.mark.parametrize("env,missing", [
    ({k: v for k, v in SLURM.items() if k != "SLURM_NTASKS"}, "SLURM_NTASKS is not"),
    ({"SLURM_STEP_NODELIST": "a"}, "SLURM_JOB_ID, SLURM_NTASKS, SLURM_PROCID, SLURM_LOCALID are not"),
    ({k: v for k, v in OMPI.items() if k != "OMPI_COMM_WORLD_RANK"}, "OMPI_COMM_WORLD_RANK is not"),
    ({k: v for k, v in OMPI.items() if k != "OMPI_MCA_orte_hnp_uri"}, "Open MPI 5 does not export"),
])
def test_a_half_set_environment_is_a_clear_error(env, missing):
    with pytest.raises(ValueError, match="half-set") as e:
        cluster.detect(env)
    assert missing in str(e.value) and "unset them" in str(e.value)


def test_open_mpi_5_takes_the_ranks_with_a_given_coordinator():
    env = {k: v for k, v in OMPI.items() if k != "OMPI_MCA_orte_hnp_uri"}
    for p in (cluster.detect(env, "10.0.0.1:4000"), cluster.detect(dict(env, JAX_COORDINATOR_ADDRESS="10.0.0.1:4000"))):
        assert (p.scheduler, p.coordinator, p.num_processes, p.process_id, p.detect) == \
            ("Open MPI", "10.0.0.1:4000", 4, 3, False)


def test_a_kubernetes_indexed_job_takes_its_index_as_the_process_id():
    p = cluster.detect({"JOB_COMPLETION_INDEX": "2"}, "train-0.train:1234", 4)
    assert (p.scheduler, p.coordinator, p.num_processes, p.process_id) == \
        ("Kubernetes indexed Job", "train-0.train:1234", 4, 2)
    with pytest.raises(ValueError, match="--coordinator HOST:PORT .* and --num-processes N"):
        cluster.detect({"JOB_COMPLETION_INDEX": "2"})
    with pytest.raises(ValueError, match=r"process id 4 is not in \[0, 4\)"):
        cluster.detect({"JOB_COMPLETION_INDEX": "4"}, "a:1", 4)


def test_flags_alone_need_all_three():
    with pytest.raises(ValueError, match="needs --coordinator"):
        cluster.detect({}, "", 2)
    with pytest.raises(ValueError, match="needs --process-id"):
        cluster.detect({}, "a:1", 2)
    with pytest.raises(ValueError, match="expected HOST:PORT"):
        cluster.detect({}, "a", 2, 0)


def test_slurm_hostlists_expand():
    assert cluster.expand_hostlist("nid[001-004,010]") == ["nid001", "nid002", "nid003", "nid004", "nid010"]
    assert cluster.expand_hostlist("a1,b[8-10],c") == ["a1", "b8", "b9", "b10", "c"]
    assert cluster.expand_hostlist("r[1-2]n[01-02]") == ["r1n01", "r1n02", "r2n01", "r2n02"]
    assert cluster.expand_hostlist("127.0.0.[2-3]") == ["127.0.0.2", "127.0.0.3"]
    for bad in ("nid[001-", "nid[4-2]", "nid[a-b]", "x[[1]]"):
        with pytest.raises(ValueError, match="hostlist"):
            cluster.expand_hostlist(bad)


def test_hosts_come_from_the_flags_a_hostfile_or_slurm(tmp_path):
    f = tmp_path / "hosts"
    f.write_text("# the nodes\nnode1 slots=8\n\nnode2  # spare\n")
    slurm = {"SLURM_JOB_NODELIST": "nid[1-3]"}
    assert cluster.hosts_from("a,b", "", slurm) == (["a", "b"], "--hosts")
    assert cluster.hosts_from("", str(f), slurm) == (["node1", "node2"], f"--hostfile {f}")
    assert cluster.hosts_from("", "", slurm) == (["nid1", "nid2", "nid3"], "SLURM_JOB_NODELIST")
    assert cluster.hosts_from("", "", {}) == ([], "")
    with pytest.raises(ValueError, match="repeat"):
        cluster.hosts_from("a,b,a", "", {})


def _opts(**kw):
    base = dict(processes=2, spares=1, cpu_devices=0, hang_timeout=1, startup_timeout=1, max_restarts=0,
                shrink=False)
    return launch.Options(**dict(base, **kw))


@pytest.mark.parametrize("kw,message", [
    (dict(hosts=("a", "b")), "every host is a process or a spare"),
    (dict(exec_template="ssh {host}"), "no host is given"),
    (dict(hosts=("a", "b", "c"), exec_template="ssh a"), "does not name {host}"),
])
def test_launch_checks_its_hosts_before_starting_anything(tmp_path, kw, message):
    with pytest.raises(ValueError, match=message):
        launch.launch(_opts(**kw), [], str(tmp_path))
    assert not (tmp_path / "launch.jsonl").exists()


def test_the_exec_template_wraps_the_command_per_host():
    """A prefix gets the command as words; ssh, which hands a remote shell one line, gets it quoted. Either
    enters this working directory and sets the node's variables, which a remote host would not inherit."""
    import os
    import shlex
    srun = launch.Supervisor(_opts(hosts=("n1", "n2", "n3"), exec_template="srun -N1 --nodelist={host}"), [], "w")
    argv = srun._command(["python", "-m", "x", "--a=b c"], {"K": "1"}, 1)
    assert argv[:3] == ["srun", "-N1", "--nodelist=n2"] and argv[-5:] == ["K=1", "python", "-m", "x", "--a=b c"]
    assert os.getcwd() in argv and "env" in argv
    ssh = launch.Supervisor(_opts(hosts=("n1", "n2", "n3"), exec_template="ssh -tt {host}"), [], "w")
    argv = ssh._command(["python", "--a=b c"], {"K": "1"}, 2)
    assert argv[:3] == ["ssh", "-tt", "n3"] and len(argv) == 4
    assert shlex.split(argv[3])[-2:] == ["python", "--a=b c"]
