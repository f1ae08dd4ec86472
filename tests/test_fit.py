"""A run that will not fit says so before its first step (training/fit.py, planner/fit_options.py): the compiled
step's memory against the device's, the breakdown, the options that would fit, and nothing written."""
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from gshard_jax import configs
from gshard_jax.partitioner.costs import hardware
from gshard_jax.planner import fit_options, predict, space as SP
from gshard_jax.training import fit, launch, train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "experiments", "tiny_moe_lm.py")
SMALL = dict(num_layers=2)


def _cfg(**train_fields):
    cfg = configs.load(CONFIG)
    cfg.model.update(SMALL)
    cfg.train.update(dict(dict(batch_size=16, seq_len=64), **train_fields))
    return cfg


def _compiled_total(trainer) -> int:
    state, batch = fit.abstract_inputs(trainer)
    m = trainer.step_fn.lower(state, batch).compile().memory_analysis()
    return m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes, m


def test_the_step_memory_is_the_compiled_programs_split_by_kind():
    trainer = train.Trainer(_cfg(), "")
    mem = fit.step_memory(trainer)
    total, m = _compiled_total(trainer)
    assert mem.total == total
    assert mem.params + mem.optimizer + mem.batch == m.argument_size_in_bytes
    assert 0 <= mem.optimizer - 2 * mem.params < 64  # AdamW's two float32 moments and its step counts
    assert 0 < mem.gradients <= mem.temporaries == m.temp_size_in_bytes
    assert "parameters" in mem.breakdown() and "activations and scratch" in mem.breakdown()


def test_an_offloaded_state_is_counted_in_host_memory_not_the_devices():
    trainer = train.Trainer(_cfg(offload_optimizer=True), "")
    mem = fit.step_memory(trainer)
    assert mem.optimizer == 0 and mem.host > 0
    total, m = _compiled_total(trainer)
    assert mem.total == total - mem.host  # XLA:CPU counts host arguments among its arguments


def test_the_first_step_runs_the_checked_compilation():
    """The check compiles from shapes and placements alone; the first step with real arrays reuses that
    executable (no second compile)."""
    trainer = train.Trainer(_cfg(), "")
    fit.check(trainer)
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, secs, **kw: compiles.append(name) if name == "/jax/core/compile/backend_compile_duration"
        else None)
    state, (_, batch) = trainer.fresh_state(), fit.abstract_inputs(trainer)
    before = len(compiles)
    real = {k: jax.device_put(np.zeros(v.shape, v.dtype), v.sharding) for k, v in batch.items()}
    trainer.step_fn(state, real)
    assert len(compiles) == before


def test_the_limit_comes_from_the_override_else_the_host_over_its_simulated_devices():
    cfg = configs.typed(_cfg(memory_limit_gib=1.5))
    mesh = train.mesh_for(cfg)
    assert fit.device_limit(cfg, mesh) == (1.5 * fit.GiB, "train.memory_limit_gib=1.5")
    limit, source = fit.device_limit(configs.typed(_cfg()), mesh)
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert limit == host / 8 and "8 simulated CPU devices" in source


def test_a_step_over_the_limit_is_refused_and_under_it_passes():
    trainer = train.Trainer(_cfg(), "")
    total = fit.step_memory(trainer).total
    assert fit.check(train.Trainer(_cfg(memory_limit_gib=total / fit.GiB * 1.01), "")).total == total
    with pytest.raises(fit.DoesNotFit) as e:
        fit.check(train.Trainer(_cfg(memory_limit_gib=total / fit.GiB * 0.9), ""))
    assert e.value.memory.total == total and "temporaries" in str(e.value)


def test_the_first_option_the_planner_gives_fits_when_compiled():
    """The planner's options under a limit the run does not fit: the fastest on the same mesh, compiled, holds
    no more than the limit (the formula scaled by the run's own compiled / formula ratio)."""
    cfg = _cfg()
    total = fit.step_memory(train.Trainer(cfg, "")).total
    limit = 0.75 * total
    opts, scale = fit_options.options(cfg, 8, hardware.get("cpu-simulation"), limit, total)
    assert scale >= 1.0 and opts
    first = next(o for o in opts if o.same_mesh)
    chosen = predict.apply(cfg, first.candidate)
    got = fit.step_memory(train.Trainer(chosen, "")).total
    assert got <= limit, (first.candidate.key, got, limit, first.predicted)
    assert got <= first.predicted * 1.15


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "gshard_jax.cli", *args], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)


def test_gshard_jax_train_over_the_limit_exits_before_writing_anything(tmp_path):
    work = tmp_path / "run"
    p = _cli("train", "--config", CONFIG, "--workdir", str(work), "--cpu-devices", "8",
             "--config.model.num_layers=2", "--config.train.memory_limit_gib=0.01")
    assert p.returncode == 4, p.stderr[-3000:]
    assert "will not fit" in p.stderr and "optimizer state" in p.stderr and "temporaries" in p.stderr
    assert "--config.train." in p.stderr.split("options the planner predicts fit")[1]
    assert not work.exists()  # no config, data or checkpoint


@pytest.mark.slow
def test_launch_stops_at_once_on_a_step_that_will_not_fit(tmp_path):
    p = _cli("launch", "--config", CONFIG, "--workdir", str(tmp_path), "--processes", "2", "--cpu-devices", "4",
             "--config.model.num_layers=2", "--config.train.memory_limit_gib=0.01")
    assert p.returncode == launch.EXIT_MEMORY, p.stderr[-3000:]
    events = [json.loads(x) for x in (tmp_path / "launch.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == ["attempt", "stopped"], events
    assert "does not fit" in events[-1]["reason"]
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "data").exists()


def test_a_candidate_is_read_from_a_config():
    cfg = _cfg(zero_stage=1, microbatches=2)
    cfg.model.remat = "dots"
    c = SP.config_candidate(cfg, 8)
    assert (c.sizes["data"], c.sizes["expert"], c.zero_stage, c.microbatches, c.remat) == (2, 4, 1, 2, "dots")
    assert SP.config_candidate(cfg, 16) is None
