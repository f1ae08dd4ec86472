"""The training CLI end to end, in subprocesses: the loss falls, kill -9 and rerun resumes exactly, damaged
checkpoints are skipped, NaN steps never reach a checkpoint, bad overrides fail before any work."""
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import orbax.checkpoint as ocp
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "experiments", "tiny_moe_lm.py")
# A smaller run of the tiny config: 2 layers, short sequences, frequent checkpoints.
SMALL = ["--config.model.num_layers=2", "--config.train.batch_size=8", "--config.train.seq_len=32",
         "--config.train.warmup_steps=4", "--config.train.log_every=1", "--config.train.eval_every=10",
         "--config.train.eval_batches=2", "--config.train.checkpoint_every=4",
         "--config.train.model_checkpoint_every=8"]


def cli(*args, timeout=600, check=True):
    p = subprocess.run([sys.executable, "-m", "gshard_jax.cli", *args], capture_output=True, text=True,
                       timeout=timeout, cwd=ROOT)
    if check and p.returncode != 0:
        raise AssertionError(f"gshard-jax {' '.join(args)} exited {p.returncode}:\n{p.stderr[-3000:]}")
    return p


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("data"))
    cli("prepare-data", "--out", d, "--vocab-size", "512", "--max-bytes", "1500000")
    return d


def train(workdir, data_dir, steps, *extra, check=True):
    return cli("train", "--config", CONFIG, "--cpu-devices", "8", "--workdir", str(workdir), "--no-progress",
               f"--config.data.dir={data_dir}", f"--config.train.num_steps={steps}", *SMALL, *extra, check=check)


def rows(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def tensorboard_tags(workdir):
    """Scalar tags in WORKDIR/tensorboard's event files (TFRecord framing: length, crc, event, crc)."""
    import struct

    from tensorboardX.proto import event_pb2
    tags = set()
    d = os.path.join(workdir, "tensorboard")
    for name in os.listdir(d):
        with open(os.path.join(d, name), "rb") as f:
            buf = f.read()
        i = 0
        while i < len(buf):
            (n,) = struct.unpack("<Q", buf[i:i + 8])
            event = event_pb2.Event.FromString(buf[i + 12:i + 12 + n])
            tags |= {v.tag for v in event.summary.value}
            i += 12 + n + 4
    return tags


def sigterm_after_3_rows(args, run):
    """Start `args` in a session of its own, SIGTERM it once metrics.jsonl has 3 rows, and wait: (process,
    stdout, stderr). Whatever is left of its session is killed."""
    p = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        deadline = time.time() + 400
        while time.time() < deadline and p.poll() is None and (
                not (run / "metrics.jsonl").exists() or len(rows(run)) < 3):
            time.sleep(0.2)
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    return p, out, err


def steps_saved(workdir, kind="checkpoints"):
    d = os.path.join(workdir, kind)
    return sorted(int(n) for n in os.listdir(d) if n.isdigit()) if os.path.isdir(d) else []


def test_prepared_data_is_deterministic_and_split(data_dir, tmp_path):
    with open(os.path.join(data_dir, "meta.json")) as f:
        meta = json.load(f)
    assert meta["splits"]["train"]["tokens"] > 100_000 and meta["splits"]["eval"]["tokens"] > 1_000
    again = str(tmp_path / "again")
    cli("prepare-data", "--out", again, "--vocab-size", "512", "--max-bytes", "1500000")
    with open(os.path.join(again, "meta.json")) as f:
        assert json.load(f)["splits"] == meta["splits"]  # same files, same tokens (sha256 of each split)
    assert all(len(meta["splits"][s]["sha256"]) == 64 for s in ("train", "eval")) and meta["dtype"] == "uint16"
    files = meta["splits"]["train"]["files"] + meta["splits"]["eval"]["files"]
    assert meta["splits"]["eval"]["files"] == max(1, round(0.05 * files))  # README: holds out 5% of the files


@pytest.fixture(scope="module")
def run24(data_dir, tmp_path_factory):
    """A 24-step run of the small config (its printed summary, its workdir), shared by the tests that read it."""
    run = tmp_path_factory.mktemp("run24")
    p = train(run, data_dir, 24)
    return json.loads(p.stdout.strip().splitlines()[-1]), run


def test_training_lowers_the_loss_and_writes_its_records(data_dir, run24):
    summary, run = run24
    r = rows(run)
    assert [x["step"] for x in r] == list(range(1, 25))
    assert all({"step", "loss", "tokens_per_s", "aux_loss", "dropped", "grad_norm", "learning_rate"} <= set(x)
               for x in r)
    first, last = sum(x["loss"] for x in r[:3]) / 3, sum(x["loss"] for x in r[-3:]) / 3
    assert last < first - 1.0, (first, last)
    evals = [x["eval_loss"] for x in r if "eval_loss" in x]
    assert len(evals) == 3 and evals[-1] < evals[0]
    assert summary["eval_loss"] == evals[-1]
    assert steps_saved(run) == [20, 24]  # two newest full checkpoints
    assert steps_saved(run, "model_checkpoints") == [8, 16, 24]  # model-only ones kept
    assert os.path.getsize(run / "loss.png") > 1000
    assert {"loss", "grad_norm", "learning_rate", "tokens_per_s", "eval_loss", "mfu"} <= tensorboard_tags(run)
    # Utilisation: mfu = model flops per token x tokens/s / (devices x peak), the peak that of the devices
    # present (train.hardware "auto": CPU devices are the cpu-simulation profile's).
    from gshard_jax import configs
    from gshard_jax.planner import hardware
    from gshard_jax.training import overrides, timing as T
    cfg = overrides.apply(configs.load(CONFIG), overrides.split_args(SMALL)[1])
    per_token, peak = T.model_flops_per_token(cfg), hardware.get("cpu-simulation").peak_flops
    assert per_token > 6 * 1e5 and peak == T.peak_flops(cfg)
    for x in r:
        assert x["mfu"] == pytest.approx(per_token * x["tokens_per_s"] / (8 * peak), rel=1e-12)
        assert x["tokens_per_s_per_device"] == pytest.approx(x["tokens_per_s"] / 8, rel=1e-12)
        assert x["step_time_s"] > 0 and x["data_wait_s"] >= 0 and x["checkpoint_s"] >= 0
        assert x["step_time_s"] == pytest.approx(8 * 32 / x["tokens_per_s"], rel=1e-9)
    # eval reads the newest checkpoint and gives the run's final held-out loss.
    out = json.loads(cli("eval", "--config", CONFIG, "--cpu-devices", "8", "--workdir", str(run),
                         f"--config.data.dir={data_dir}", *SMALL).stdout.strip().splitlines()[-1])
    assert out["step"] == 24 and out["eval_loss"] == pytest.approx(evals[-1], rel=1e-6)


@pytest.mark.slow  # 45 s; .ci/run runs it on the newest supported JAX
@pytest.mark.newest_jax
def test_a_scanned_model_trains_and_explains_through_the_cli(data_dir, tmp_path):
    """--config.model.scan=true, the default of the Mula, GPT and GShard configs: the tiny MoE LM's layers under
    nn.scan train (the loss falls) and explain finds no fallback in the scanned step."""
    run = tmp_path / "run"
    train(run, data_dir, 8, "--config.model.scan=true")
    r = rows(run)
    assert len(r) == 8 and all(math.isfinite(x["loss"]) for x in r)
    assert sum(x["loss"] for x in r[-2:]) < sum(x["loss"] for x in r[:2]) - 0.2, [x["loss"] for x in r]
    report = json.loads(cli("explain", "--config", CONFIG, "--cpu-devices", "8", "--workdir", str(tmp_path / "w"),
                            f"--config.data.dir={data_dir}", *SMALL, "--config.model.scan=true",
                            "--json").stdout.strip().splitlines()[-1])
    assert report["fallbacks"] == [] and report["totals"]["all-to-all"]["count"] > 0, report["totals"]


@pytest.mark.slow  # 15 s
def test_metrics_are_read_one_step_late(data_dir, tmp_path, monkeypatch):
    """The host never waits on the device between steps: step N's metrics are read after step N+1 is
    dispatched, except where step N is evaluated or checkpointed (its row comes before its checkpoint, and
    a NaN halts before it is saved)."""
    from gshard_jax import configs
    from gshard_jax.training import loop, overrides, train as T
    cfg = overrides.apply(configs.load(CONFIG), overrides.split_args(
        SMALL + [f"--config.data.dir={data_dir}", "--config.train.num_steps=10"])[1])
    events = []

    class Read(float):  # a metric that records when the host reads it
        def __new__(cls, value, step):
            out = super().__new__(cls, value)
            out.step = step
            return out

        def __float__(self):
            if ("read", self.step) not in events:
                events.append(("read", self.step))
            return super().__float__()

    made = T.Trainer.__post_init__

    def instrumented(self):
        made(self)
        run = self.step_fn

        def step_fn(state, batch):
            step = len([e for e in events if e[0] == "dispatch"]) + 1
            events.append(("dispatch", step))
            state, m = run(state, batch)
            return state, {k: Read(float(v), step) if v.ndim == 0 else v for k, v in m.items()}  # scalars
        self.step_fn = step_fn
    monkeypatch.setattr(T.Trainer, "__post_init__", instrumented)
    loop.train(cfg, str(tmp_path / "run"), progress=False)
    settled_at_once = {4, 8, 10}  # checkpoint_every=4, model_checkpoint_every=8, eval_every=10, the last step
    for n in range(1, 11):
        read = events.index(("read", n))
        last_dispatched = [e for e in events[:read] if e[0] == "dispatch"][-1]
        assert last_dispatched == ("dispatch", n if n in settled_at_once else n + 1), events


@pytest.mark.slow  # 30 s; SIGTERM of a launched run is slow too
def test_sigterm_saves_at_the_next_step_and_exits_preempted(data_dir, tmp_path):
    """A preemption notice (SIGTERM) mid-run: a full checkpoint at the next step boundary, exit status 75
    (not a failure's), and the rerun resumes there with no step lost."""
    from gshard_jax.training.faults import EXIT_PREEMPTED
    run = tmp_path / "run"
    args = [sys.executable, "-m", "gshard_jax.cli", "train", "--config", CONFIG, "--cpu-devices", "8",
            "--workdir", str(run), "--no-progress", f"--config.data.dir={data_dir}", *SMALL]
    p, _, err = sigterm_after_3_rows(args + ["--config.train.num_steps=500"], run)
    assert p.returncode == EXIT_PREEMPTED, err[-2000:]
    last = rows(run)[-1]["step"]
    assert "preempted" in err and last in steps_saved(run) and last < 500
    again = train(run, data_dir, last + 2)
    summary = json.loads(again.stdout.strip().splitlines()[-1])
    assert summary["start_step"] == last
    assert [x["step"] for x in rows(run)] == list(range(1, last + 3))


@pytest.mark.slow  # 35 s; the encoder-decoder's train step is tested partitioned in test_models.py
def test_the_tiny_encoder_decoder_trains_through_the_cli(data_dir, tmp_path):
    """docs/models.md: the tiny encoder-decoder trains on a CPU (it reads the first half of each window and
    predicts the second): its cross-entropy falls below the uniform ln V within 30 steps."""
    run = tmp_path / "encdec"
    cli("train", "--config", os.path.join(ROOT, "experiments", "tiny_moe_encdec.py"), "--cpu-devices", "8",
        "--workdir", str(run), "--no-progress", "--config.data.max_bytes=400000", "--config.model.vocab_size=512",
        "--config.train.num_steps=30", "--config.train.batch_size=8", "--config.train.seq_len=32",
        "--config.train.warmup_steps=4", "--config.train.log_every=1", "--config.train.eval_every=30",
        "--config.train.eval_batches=2", "--config.train.checkpoint_every=30",
        "--config.train.model_checkpoint_every=30")
    r = rows(run)
    first, last = (sum(x["cross_entropy"] for x in part) / 3 for part in (r[:3], r[-3:]))
    assert last < min(first - 0.6, math.log(512)), (first, last)
    # README: with no data.dir a run prepares its corpus in WORKDIR/data and records its config.
    assert (run / "data" / "meta.json").exists()
    with open(run / "config.json") as f:
        assert json.load(f)["train"]["num_steps"] == 30


@pytest.mark.slow  # 50 s; the launch test resumes a killed run to the same losses by default
def test_kill_and_rerun_resumes_to_the_same_losses(data_dir, tmp_path):
    ref = tmp_path / "ref"
    train(ref, data_dir, 16)
    run = tmp_path / "killed"
    cmd = [sys.executable, "-m", "gshard_jax.cli", "train", "--config", CONFIG, "--cpu-devices", "8",
           "--workdir", str(run), "--no-progress", f"--config.data.dir={data_dir}",
           "--config.train.num_steps=16", *SMALL]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 600
    while time.time() < deadline and not steps_saved(run) and proc.poll() is None:  # kill at the first save
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    saved = steps_saved(run)
    assert saved and max(saved) < 16, saved
    p = train(run, data_dir, 16)
    assert json.loads(p.stdout.strip().splitlines()[-1])["start_step"] == max(saved)
    assert f"at step {max(saved)}" in p.stderr
    assert [x["step"] for x in rows(run)] == list(range(1, 17))  # each step once, the crashed run's extra rows dropped
    got, want = {x["step"]: x["loss"] for x in rows(run)}, {x["step"]: x["loss"] for x in rows(ref)}
    for step in range(max(saved) + 1, 17):
        assert got[step] == pytest.approx(want[step], rel=1e-5, abs=1e-6), step


def test_a_damaged_newest_checkpoint_is_skipped_with_a_warning(data_dir, tmp_path):
    run = tmp_path / "run"
    train(run, data_dir, 8)
    assert steps_saved(run) == [4, 8]
    newest = run / "checkpoints" / "8"
    for dirpath, _, files in os.walk(newest):
        for name in files:
            with open(os.path.join(dirpath, name), "wb") as f:
                f.write(b"garbage")
    # A newer write that never finished (orbax writes to a temporary directory and renames it when done).
    partial = run / "checkpoints" / "9.orbax-checkpoint-tmp-1700000000"
    shutil.copytree(run / "checkpoints" / "4", partial)
    p = train(run, data_dir, 10)
    assert json.loads(p.stdout.strip().splitlines()[-1])["start_step"] == 4
    assert "checkpoints/8 is damaged" in p.stderr
    assert not partial.exists() and steps_saved(run) == [8, 10]
    assert [x["step"] for x in rows(run)] == list(range(1, 11))  # the first run's rows 5-8 replaced, not repeated


def test_nan_halts_before_any_checkpoint_and_skip_continues(data_dir, tmp_path):
    run = tmp_path / "halt"
    p = train(run, data_dir, 12, "--config.debug.nan_at_step=8", check=False)  # 8: both series would save
    assert p.returncode == 3
    assert "step 8: non-finite loss" in p.stderr
    # A poisoned loss makes every row's backward non-finite: every shard of the one process is named.
    assert "batch shards [0, 1, 2, 3, 4, 5, 6, 7] (8 rows), held by devices [0, 1, 2, 3, 4, 5, 6, 7] of process 0" \
        in p.stderr
    assert steps_saved(run) == [4] and steps_saved(run, "model_checkpoints") == []
    run = tmp_path / "skip"
    p = train(run, data_dir, 12, "--config.debug.nan_at_step=8", "--config.train.nan_policy=skip")
    r = {x["step"]: x for x in rows(run)}
    assert r[7]["skipped_steps"] == 0 and r[8]["skipped_steps"] == 1 and r[12]["skipped_steps"] == 1
    assert r[8]["nonfinite_processes"] == [0] and "nonfinite_processes" not in r[7]  # whose NaN it was
    assert "step 8: non-finite loss or gradient norm; non-finite rows in batch shards" in p.stderr
    assert all(x["loss"] == x["loss"] for s, x in r.items() if s != 8)  # finite everywhere else
    assert steps_saved(run) == [8, 12]


@pytest.mark.parametrize("override,message", [
    ("--config.model.num_expertz=16", "unknown key 'num_expertz' in model"),
    ("--config.train.num_steps=ten", "--config.train.num_steps='ten': expected an integer"),
    ("--config.train.nan_policy.x=1", "train.nan_policy is a value, not a section"),
    ("--config.model=1", "--config.model is a section"),
])
def test_bad_overrides_fail_before_any_work(tmp_path, override, message):
    run = tmp_path / "run"
    p = cli("train", "--config", CONFIG, "--workdir", str(run), override, check=False)
    assert p.returncode == 2 and message in p.stderr, p.stderr
    assert not run.exists()


def test_a_mesh_larger_than_the_devices_says_how_to_fix_it(tmp_path, data_dir):
    p = cli("train", "--config", CONFIG, "--cpu-devices", "4", "--workdir", str(tmp_path / "w"),
            f"--config.data.dir={data_dir}", check=False)
    assert p.returncode == 2 and "needs 8 devices but 4 are present" in p.stderr and "--cpu-devices 8" in p.stderr
    assert not (tmp_path / "w").exists()


def test_every_subcommand_has_help():
    for sub in ("train", "launch", "eval", "explain", "compare", "compile", "params", "prepare-data", "plot"):
        p = cli(sub, "--help")
        assert "usage: gshard-jax " + sub in p.stdout and len(p.stdout) > 200


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # 40 s; the launch test trains 2 x 4 against 1 x 8 by default
def test_two_processes_train_to_the_same_losses_as_one(data_dir, tmp_path):
    """2 processes x 4 CPU devices (jax.distributed, gloo) against 1 process x 8 devices, same global batches."""
    one = tmp_path / "one"
    train(one, data_dir, 6)
    two = tmp_path / "two"
    port = _free_port()
    procs = [subprocess.Popen(
        [sys.executable, "-m", "gshard_jax.cli", "train", "--config", CONFIG, "--cpu-devices", "4",
         "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i),
         "--workdir", str(two), "--no-progress", f"--config.data.dir={data_dir}", "--config.train.num_steps=6",
         *SMALL], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    got, want = [x["loss"] for x in rows(two)], [x["loss"] for x in rows(one)]
    assert len(got) == len(want) == 6
    assert got == pytest.approx(want, rel=1e-5)
    assert steps_saved(two) == [4, 6] and steps_saved(two, "model_checkpoints") == [6]  # both series save step 6


def _scheduler_env(scheduler, i, port):
    """What SLURM's srun, Open MPI's mpirun or a Kubernetes indexed Job sets for task i of 2 on this host (the
    coordinator's port through JAX_COORDINATOR_PORT, which jax.distributed reads), and the flags the
    Kubernetes manifest passes."""
    if scheduler == "slurm":
        return {"SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "localhost", "SLURM_NTASKS": "2",
                "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i), "JAX_COORDINATOR_PORT": str(port)}, []
    if scheduler == "ompi":
        return {"OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://127.0.0.1:34911", "OMPI_COMM_WORLD_SIZE": "2",
                "OMPI_COMM_WORLD_RANK": str(i), "OMPI_COMM_WORLD_LOCAL_RANK": str(i),
                "JAX_COORDINATOR_PORT": str(port)}, []
    return {"JOB_COMPLETION_INDEX": str(i)}, ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2"]


@pytest.mark.parametrize("scheduler", ["slurm", pytest.param("ompi", marks=pytest.mark.slow),
                                       pytest.param("k8s", marks=pytest.mark.slow)])
def test_train_joins_its_peers_under_a_scheduler(data_dir, tmp_path, run24, scheduler):
    """Two processes x 4 CPU devices started with a scheduler's environment and no --coordinator (nothing in
    JAX patched): each logs what it detected, they join as processes 0 and 1 of 2, and train to the losses
    of the one-process run (the first steps of the 24-step run, on its schedule)."""
    run, port = tmp_path / "run", _free_port()
    procs = []
    for i in range(2):
        env, flags = _scheduler_env(scheduler, i, port)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "gshard_jax.cli", "train", "--config", CONFIG, "--cpu-devices", "4", *flags,
             "--workdir", str(run), "--no-progress", f"--config.data.dir={data_dir}", "--config.train.num_steps=3",
             "--config.train.decay_steps=24", *SMALL], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env=dict(os.environ, **env)))
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    name = {"slurm": "SLURM", "ompi": "Open MPI", "k8s": "Kubernetes indexed Job"}[scheduler]
    for i, (_, err) in enumerate(outs):
        assert f"cluster: {name} (" in err and f"cluster: process {i} of 2, 4 of 8 devices here" in err, err[-2000:]
    assert [x["loss"] for x in rows(run)] == pytest.approx([x["loss"] for x in rows(run24[1])[:3]], rel=1e-5)


def test_a_half_set_scheduler_environment_fails_before_any_work(tmp_path):
    env = dict(os.environ, SLURM_STEP_NODELIST="localhost", SLURM_PROCID="0")
    p = subprocess.run([sys.executable, "-m", "gshard_jax.cli", "train", "--config", CONFIG, "--workdir",
                        str(tmp_path / "w")], cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 2 and "half-set SLURM environment" in p.stderr and "srun" in p.stderr, p.stderr[-2000:]
    assert not (tmp_path / "w").exists()


def launch(workdir, data_dir, steps, *extra, processes=2, spares=1, check=True, hosts=False):
    """`gshard-jax launch` of the small config; hosts=True: on loopback hosts 127.0.0.2, ... through an exec prefix."""
    where = ["--hosts", f"127.0.0.[2-{1 + processes + spares}]", "--exec", "env GSHARD_TEST_HOST={host}"] * hosts
    return cli("launch", "--config", CONFIG, "--workdir", str(workdir), "--processes", str(processes),
               "--spares", str(spares), "--cpu-devices", str(8 // processes), "--hang-timeout", "20",
               "--startup-timeout", "300", f"--config.data.dir={data_dir}",
               f"--config.train.num_steps={steps}", *SMALL, *where, *extra, check=check, timeout=900)


ON_HOSTS = pytest.mark.parametrize("hosts", [False, True], ids=["local", "hosts"])


@pytest.mark.slow  # starts two training processes
def test_a_killed_supervisor_leaves_no_process_behind(data_dir, tmp_path):
    """SIGKILL to `gshard-jax launch` (no cleanup of its own): its training processes die with it."""
    run = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "-m", "gshard_jax.cli", "launch", "--config", CONFIG, "--workdir",
                          str(run), "--processes", "2", "--cpu-devices", "4", f"--config.data.dir={data_dir}",
                          "--config.train.num_steps=500", *SMALL], cwd=ROOT, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True)
    beats = run / "launch" / "heartbeat.0"
    deadline = time.time() + 300
    while time.time() < deadline and not (beats.exists() and len(os.listdir(beats)) >= 2):
        time.sleep(0.2)
    children = [int(x) for x in subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True,
                                               text=True).stdout.split()]
    assert len(children) == 2
    p.kill()
    p.wait()
    deadline = time.time() + 30
    while time.time() < deadline and any(os.path.exists(f"/proc/{c}") and _alive(c) for c in children):
        time.sleep(0.2)
    assert not any(os.path.exists(f"/proc/{c}") and _alive(c) for c in children)


def _alive(pid: int) -> bool:
    """Running (not a zombie left for its parent to reap)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("hosts", [pytest.param(False, marks=pytest.mark.slow), True], ids=["local", "hosts"])
def test_launch_replaces_a_dead_node_with_a_spare_and_loses_nothing(data_dir, tmp_path, run24, hosts):
    """2 processes x 4 devices and a spare; a node dies at step 6 (os._exit): the supervisor stops the
    attempt, puts the spare in its place, and the run resumes from step 4 to the same losses as a 1 x 8 run
    that never failed (the first 8 steps of the 24-step run, on its learning-rate schedule).

    hosts: the nodes are hosts 127.0.0.2-4 (distinct loopback addresses) started through an --exec prefix;
    the first host dies, so the coordinator moves to the next good one."""
    from gshard_jax.training import launch as L
    run = tmp_path / "run"
    dead = 0 if hosts else 1
    started = tmp_path / "started"  # the exec prefix notes each host it starts a process on
    where = ["--hosts", "127.0.0.2,127.0.0.[3-4]", "--exec",
             f"sh -c 'echo {{host}} >> {started}; exec \"$@\"' sh"] if hosts else []
    launch(run, data_dir, 8, f"--config.debug.fail_process={dead}", "--config.debug.fail_at_step=6",
           "--config.train.decay_steps=24", "--config.train.async_checkpoints=false", *where)  # step 4 is saved
    events = L.read(str(run))
    assert [e["event"] for e in events] == ["attempt", "failure", "replaced", "attempt", "done"], events
    survivors = [x for x in (0, 1) if x != dead] + [2]
    assert events[0]["nodes"] == [0, 1] and events[3]["nodes"] == survivors
    assert events[1]["nodes"] == [dead] and events[1]["processes"] == [dead]
    assert events[1]["detail"] == "exit status 13"
    assert events[2]["node"] == dead and events[2]["by"] == 2
    if hosts:  # the events name the hosts; the coordinator is the first good host of each attempt
        assert events[0]["hosts"] == ["127.0.0.2", "127.0.0.3"] and events[0]["coordinator"].startswith("127.0.0.2:")
        assert events[1]["hosts"] == ["127.0.0.2"] and (events[2]["host"], events[2]["by_host"]) == ("127.0.0.2",
                                                                                                     "127.0.0.4")
        assert events[3]["hosts"] == ["127.0.0.3", "127.0.0.4"] and events[3]["coordinator"].startswith("127.0.0.3:")
        assert sorted(started.read_text().split()) == ["127.0.0.2", "127.0.0.3", "127.0.0.3", "127.0.0.4"]
    got = {x["step"]: x["loss"] for x in rows(run)}
    assert sorted(got) == list(range(1, 9))  # every step once: the resume dropped what the failure left
    assert [got[s] for s in range(1, 9)] == pytest.approx([x["loss"] for x in rows(run24[1])[:8]], rel=1e-5)
    # Scattered writes: the replicated state of step 8 was written half by each process.
    written = [sum(f.stat().st_size for f in (run / "checkpoints" / "8" / "default" / f"ocdbt.process_{i}").rglob("*")
                   if f.is_file()) for i in (0, 1)]
    assert 0.8 < written[0] / written[1] < 1.25, written
    # Single reads: on resume, host group 0 (process 0) read the state and broadcast it to process 1.
    logs = [(run / "launch" / f"attempt1.node{n}.log").read_text() for n in survivors]
    assert all('"start_step": 4' in text for text in logs)
    read = [int(re.search(r"resumed from .* at step 4 \(process \d read (\d+) bytes\)", text)[1]) for text in logs]
    assert read[1] < 0.05 * read[0] and read[0] > sum(written), (read, written)


@pytest.mark.slow  # starts three training attempts
@ON_HOSTS
def test_launch_names_a_soft_failure_by_process_and_replaces_its_node(data_dir, tmp_path, run24, hosts):
    """Node 1's backward turns NaN at step 6 (loss finite, gradients not): the step halts naming process 1
    and its devices, the supervisor puts the spare in its place, and the run ends with the losses of the run
    that never failed. The same NaN on every node (a poisoned loss) is not a node's fault: the run stops."""
    from gshard_jax.training import launch as L
    run = tmp_path / "run"
    launch(run, data_dir, 8, "--config.debug.soft_fail_process=1", "--config.debug.soft_fail_at_step=6",
           "--config.train.decay_steps=24", "--config.train.async_checkpoints=false", hosts=hosts)
    events = L.read(str(run))
    assert [e["event"] for e in events] == ["attempt", "failure", "replaced", "attempt", "done"], events
    failure = events[1]
    assert failure["kind"] == "soft" and failure["nodes"] == [1] and failure["processes"] == [1], failure
    # Process 1's 4 devices (JAX numbers a CPU process's devices from 2048 x its index), none of process 0's.
    assert failure["step"] == 6 and failure["devices"] == [2048, 2049, 2050, 2051], failure
    log = (run / "launch" / "attempt0.node0.log").read_text()
    assert "step 6: non-finite loss" in log and "devices [2048, 2049, 2050, 2051] of process 1" in log
    assert "devices [0" not in log  # process 0's shards stayed finite
    assert '"start_step": 4' in (run / "launch" / "attempt1.node0.log").read_text()
    got = {x["step"]: x["loss"] for x in rows(run)}
    assert sorted(got) == list(range(1, 9))
    assert [got[s] for s in range(1, 9)] == pytest.approx([x["loss"] for x in rows(run24[1])[:8]], rel=1e-5)
    everywhere = tmp_path / "everywhere"
    p = launch(everywhere, data_dir, 8, "--config.debug.nan_at_step=6", check=False, hosts=hosts)
    events = L.read(str(everywhere))
    assert p.returncode == 3 and [e["event"] for e in events] == ["attempt", "stopped"], events
    assert "halted on a non-finite step" in events[-1]["reason"]


@pytest.mark.slow  # 2 minutes: the hang is waited out
@ON_HOSTS
def test_launch_finds_a_hung_node_and_replaces_it(data_dir, tmp_path, hosts):
    """Node 1 stops answering at step 6 and node 0 waits in a collective: no heartbeat moves for the
    --hang-timeout, the node with the oldest step is blamed and replaced, and the run finishes."""
    from gshard_jax.training import launch as L
    whole = tmp_path / "whole"
    train(whole, data_dir, 8)
    run = tmp_path / "run"
    launch(run, data_dir, 8, "--config.debug.fail_process=1", "--config.debug.hang_at_step=6", hosts=hosts)
    events = L.read(str(run))
    assert [e["event"] for e in events] == ["attempt", "failure", "replaced", "attempt", "done"], events
    assert events[1]["nodes"] == [1] and events[1]["kind"] == "hang" and "step 5" in events[1]["detail"]
    assert events[1]["time"] - events[0]["time"] < 300  # found within the startup allowance plus the timeout
    got = {x["step"]: x["loss"] for x in rows(run)}
    assert [got[s] for s in range(1, 9)] == pytest.approx([x["loss"] for x in rows(whole)], rel=1e-5)


@pytest.mark.slow  # 2 minutes
@ON_HOSTS
def test_launch_without_a_spare_shrinks_the_data_axis_or_stops(data_dir, tmp_path, hosts):
    """No spare: with mesh.data = -1 the run goes on as one process of 4 devices (the data axis shrinks, the
    global batch stays); with a fixed data axis it stops and says how to go on."""
    from gshard_jax.training import launch as L
    shrunk = tmp_path / "shrunk"
    launch(shrunk, data_dir, 8, "--config.debug.fail_process=1", "--config.debug.fail_at_step=6",
           "--config.mesh.data=-1", spares=0, hosts=hosts)
    events = L.read(str(shrunk))
    assert [e["event"] for e in events] == ["attempt", "failure", "shrink", "attempt", "done"], events
    assert events[3]["processes"] == 1 and sorted({x["step"] for x in rows(shrunk)}) == list(range(1, 9))
    stopped = tmp_path / "stopped"
    p = launch(stopped, data_dir, 8, "--config.debug.fail_process=1", "--config.debug.fail_at_step=6",
               spares=0, check=False, hosts=hosts)
    assert p.returncode == L.EXIT_GAVE_UP
    last = L.read(str(stopped))[-1]
    assert last["event"] == "stopped" and "--spares" in last["reason"]


@pytest.mark.slow  # 1-2 minutes
@pytest.mark.parametrize("hosts", [[], ["--hosts", "127.0.0.[2-3]", "--exec", "env GSHARD_TEST_HOST={host}"]],
                         ids=["local", "hosts"])
def test_sigterm_to_the_supervisor_preempts_every_process(data_dir, tmp_path, hosts):
    """SIGTERM to `gshard-jax launch`: its processes agree on a step (JAX's preemption sync point), save a
    full checkpoint there and exit 75; so does the supervisor, and launch.jsonl says so. The same with
    processes on hosts started through an --exec prefix."""
    from gshard_jax.training import launch as L
    from gshard_jax.training.faults import EXIT_PREEMPTED
    run = tmp_path / "run"
    p, out, err = sigterm_after_3_rows([sys.executable, "-m", "gshard_jax.cli", "launch", "--config", CONFIG,
                                        "--workdir", str(run), "--processes", "2", "--cpu-devices", "4",
                                        f"--config.data.dir={data_dir}", "--config.train.num_steps=500", *SMALL,
                                        *hosts], run)
    assert p.returncode == EXIT_PREEMPTED, (out[-2000:], err[-2000:])
    assert L.read(str(run))[-1]["event"] == "preempted"
    assert rows(run)[-1]["step"] in steps_saved(run)


def test_explain_compare_and_plot_subcommands(data_dir, tmp_path):
    common = ["--config", CONFIG, "--cpu-devices", "8", "--workdir", str(tmp_path / "w"),
              f"--config.data.dir={data_dir}", *SMALL]
    short = cli("explain", *common).stdout
    assert "all-to-all" in short
    assert len(cli("explain", *common, "--table").stdout.splitlines()) > len(short.splitlines())  # every op
    report = json.loads(cli("explain", *common, "--json").stdout.strip().splitlines()[-1])
    assert report["fallbacks"] == [] and report["totals"]["all-to-all"]["count"] > 0, report["totals"]
    memory = report["memory"]  # argument bytes per device by kind, predicted and from memory_analysis()
    assert {"params", "optimizer", "batch", "total"} <= set(memory["predicted"])
    assert memory["predicted"]["total"] == memory["compiled"]["argument"] and memory["compiled"]["temp"] > 0
    rows_ = json.loads(cli("compare", *common, "--steps", "2", "--json").stdout.strip().splitlines()[-1])
    ours, xla = rows_
    assert (ours["backend"], xla["backend"]) == ("gshard", "xla")
    assert ours["collectives_per_step"]["all-to-all"] > 0
    assert ours["bytes_per_step"] <= xla["bytes_per_step"] and ours["bytes_static"] <= ours["bytes_per_step"]
    assert ours["loss_diff"] < 1e-4 and xla["loss_diff"] < 1e-4
    a, b = tmp_path / "a", tmp_path / "b"
    for d, steps in ((a, 3), (b, 4)):
        os.makedirs(d)
        with open(d / "metrics.jsonl", "w") as f:
            f.writelines(json.dumps({"step": s, "loss": 5.0 - s, "eval_loss": 5.5 - s}) + "\n" for s in range(1, steps))
    out = tmp_path / "both.png"
    cli("plot", str(a), str(b), "--out", str(out), "--labels", "moe,dense")
    assert out.stat().st_size > 1000
    p = cli("plot", str(tmp_path / "missing"), "--out", str(out), check=False)
    assert p.returncode == 2 and "has no metrics.jsonl" in p.stderr


@pytest.mark.slow  # 40 s; the trainer's ZeRO x EPSO matrix is in test_sharded_state.py
def test_zero_stage_1_with_epso_trains_to_stage_0s_losses(data_dir, tmp_path):
    """The tiny MoE LM on {data 2, expert 4} with sharded optimizer state (EPSO: non-expert states over all 8
    devices) trains to the losses of the replicated optimizer."""
    train(tmp_path / "zero0", data_dir, 4)
    train(tmp_path / "zero1", data_dir, 4, "--config.train.zero_stage=1", "--config.train.epso=true")
    got, want = rows(tmp_path / "zero1"), rows(tmp_path / "zero0")
    assert [x["loss"] for x in got] == pytest.approx([x["loss"] for x in want], rel=1e-5)


@pytest.mark.slow  # 35 s: three training runs
def test_a_run_resumes_on_a_different_mesh(data_dir, tmp_path):
    """Checkpoints written on {data 2, expert 4} restore onto {data 8}: the run continues where it stopped and
    its losses follow the run that stayed on the first mesh."""
    stay, moved = tmp_path / "stay", tmp_path / "moved"
    schedule = "--config.train.decay_steps=10"  # the same learning rates whether a run stops at 8 or 10
    train(stay, data_dir, 10, schedule)
    train(moved, data_dir, 8, schedule)
    p = train(moved, data_dir, 10, schedule, "--config.mesh.data=8", "--config.mesh.expert=1")
    assert json.loads(p.stdout.strip().splitlines()[-1])["start_step"] == 8
    got, want = {x["step"]: x["loss"] for x in rows(moved)}, {x["step"]: x["loss"] for x in rows(stay)}
    for step in (9, 10):
        assert got[step] == pytest.approx(want[step], rel=1e-4), step


def test_the_tiny_3d_layout_lm_trains_through_the_cli(data_dir, tmp_path):
    """experiments/tiny_3d_lm.py (AxoNN's x/y/z layout on 8 simulated devices) trains: its loss falls."""
    run = tmp_path / "run"
    cli("train", "--config", os.path.join(ROOT, "experiments", "tiny_3d_lm.py"), "--cpu-devices", "8",
        "--workdir", str(run), "--no-progress", f"--config.data.dir={data_dir}", "--config.train.num_steps=12",
        *SMALL)
    r = rows(run)
    assert len(r) == 12 and r[-1]["loss"] < r[0]["loss"] - 0.5, [x["loss"] for x in r]


# A pipelined run of the tiny MoE LM (4 layers over 4 stages, 4 microbatches) and the unpipelined run it must
# equal: the same microbatches by gradient accumulation, on a mesh of the same data parallelism.
PIPELINED = ["--config.model.num_layers=4", "--config.mesh.stage=4", "--config.mesh.data=2",
             "--config.mesh.expert=1", "--config.train.microbatches=4"]
UNPIPELINED = ["--config.model.num_layers=4", "--config.model.scan=true", "--config.mesh.data=2",
               "--config.mesh.expert=1", "--config.mesh.y=4", "--config.train.microbatches=4"]


@pytest.mark.slow  # 35 s; by default test_pipeline_models checks 1F1B against the unpipelined loss in-process
def test_a_1f1b_pipelined_run_equals_the_unpipelined_run(data_dir, tmp_path):
    train(tmp_path / "plain", data_dir, 4, *UNPIPELINED)
    train(tmp_path / "piped", data_dir, 4, *PIPELINED, "--config.pipeline.schedule=1f1b")
    got, want = rows(tmp_path / "piped"), rows(tmp_path / "plain")
    assert [x["loss"] for x in got] == pytest.approx([x["loss"] for x in want], rel=1e-4)


@pytest.mark.slow  # about 3 minutes: six runs, explain and compare
def test_pipelined_runs_match_resume_after_kill_and_across_stage_counts(data_dir, tmp_path):
    """20 pipelined steps (GPipe, interleaved 1F1B) reach the unpipelined run's losses, and so does 1F1B with
    ZeRO-3 and remat; a kill -9 resumes; a checkpoint written with 4 stages continues on 2 stages; explain and
    compare read the pipelined step."""
    train(tmp_path / "plain", data_dir, 20, *UNPIPELINED)
    want = {x["step"]: x["loss"] for x in rows(tmp_path / "plain")}
    for name, extra in (("gpipe", []), ("interleaved", ["--config.model.num_layers=8",
                                                        "--config.pipeline.schedule=interleaved_1f1b",
                                                        "--config.pipeline.repeats=2"])):
        if extra:  # 8 layers: the plain run to compare with has 8 too
            train(tmp_path / "plain8", data_dir, 20, *UNPIPELINED, "--config.model.num_layers=8")
            want = {x["step"]: x["loss"] for x in rows(tmp_path / "plain8")}
        train(tmp_path / name, data_dir, 20, *PIPELINED, *extra)
        got = {x["step"]: x["loss"] for x in rows(tmp_path / name)}
        assert [got[s] for s in range(1, 21)] == pytest.approx([want[s] for s in range(1, 21)], rel=1e-4), name
    # the interleaved run's checkpoints record the stage-major order its stack is stored in
    saved = ocp.CheckpointManager(str(tmp_path / "interleaved" / "checkpoints"))
    assert saved.metadata(saved.latest_step()).custom_metadata == {"layer_order": {"stages": 4, "repeats": 2}}
    saved.close()
    want = {x["step"]: x["loss"] for x in rows(tmp_path / "plain")}
    # with ZeRO-3 and every period rematerialised inside the stages: the same losses
    train(tmp_path / "zero3", data_dir, 6, *PIPELINED, "--config.pipeline.schedule=1f1b",
          "--config.train.zero_stage=3", "--config.model.remat=full")
    got = {x["step"]: x["loss"] for x in rows(tmp_path / "zero3")}
    assert [got[s] for s in range(1, 7)] == pytest.approx([want[s] for s in range(1, 7)], rel=1e-4)
    # kill -9 at the first checkpoint, then rerun on 2 stages: it resumes there with the same losses
    run = tmp_path / "killed"
    cmd = [sys.executable, "-m", "gshard_jax.cli", "train", "--config", CONFIG, "--cpu-devices", "8",
           "--workdir", str(run), "--no-progress", f"--config.data.dir={data_dir}",
           "--config.train.num_steps=12", *SMALL, *PIPELINED, "--config.pipeline.schedule=1f1b",
           "--config.train.decay_steps=20"]  # the 20-step reference's learning rates
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 600
    while time.time() < deadline and not steps_saved(run) and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    saved = steps_saved(run)
    assert saved and max(saved) < 12, saved
    p = train(run, data_dir, 12, *PIPELINED, "--config.mesh.stage=2", "--config.mesh.y=2",
              "--config.pipeline.schedule=1f1b", "--config.train.decay_steps=20")
    assert json.loads(p.stdout.strip().splitlines()[-1])["start_step"] == max(saved)
    got = {x["step"]: x["loss"] for x in rows(run)}
    for step in range(max(saved) + 1, 13):
        assert got[step] == pytest.approx(want[step], rel=1e-4), step
    p = cli("explain", "--config", CONFIG, "--cpu-devices", "8", "--workdir", str(run), f"--config.data.dir={data_dir}",
            *SMALL, *PIPELINED, "--config.pipeline.schedule=1f1b", "--json")
    report = json.loads(p.stdout)
    assert report["pipelines"][0]["schedule"] == "1f1b" and report["pipelines"][0]["stages"] == 4
    p = cli("compare", "--config", CONFIG, "--cpu-devices", "8", "--workdir", str(run),
            f"--config.data.dir={data_dir}", *SMALL, *PIPELINED, "--steps", "2", "--json")
    ours, xla = json.loads(p.stdout)
    assert ours["loss_diff"] < 1e-4 and ours["bytes_per_step"] <= xla["bytes_per_step"]
    assert ours["collectives_static"]["collective-permute"] == 2  # GPipe: the forward loop and its transpose
    ticks = 4 + 4 - 1  # stages + microbatches - 1: the trips of each loop
    assert ours["collectives_per_step"]["collective-permute"] == 2 * ticks
