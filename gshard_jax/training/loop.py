"""The training loop: train from the newest valid checkpoint in a workdir to train.num_steps (the step's
memory checked first, data prepared, metrics settled a step behind, checkpoints and preemption), and the
held-out loss of the newest checkpoint."""
from __future__ import annotations

import logging
import os

import jax
import ml_collections

from .. import configs
from . import checkpoints, fit, metrics, timing
from .checkpoints import Checkpoints
from .faults import Faults, Preempted
from .settle import Settler
from .train import Trainer, prepare_data

log = logging.getLogger("gshard_jax")


def train(cfg: configs.Config | ml_collections.ConfigDict, workdir: str, progress: bool = True) -> dict:
    """Train from the newest valid checkpoint in workdir (or from scratch) to train.num_steps."""
    cfg = configs.typed(cfg)
    t = cfg.train
    trainer = Trainer(cfg, workdir)  # checks the config against the devices before anything is written
    if t.memory_check:  # and the compiled step against their memory (fit.DoesNotFit), before the first step
        fit.check(trainer)
    os.makedirs(workdir, exist_ok=True)
    if jax.process_index() == 0:
        with open(os.path.join(workdir, "config.json"), "w") as f:
            f.write(cfg.to_json(indent=1))
    tokens = prepare_data(cfg, workdir)
    ckpt = Checkpoints(workdir, t.checkpoint_every, t.model_checkpoint_every, async_save=t.async_checkpoints,
                       replica_parallel=t.checkpoint_replica_parallel, single_read=t.checkpoint_single_read,
                       metadata={"layer_order": trainer.saved_order})
    state = trainer.fresh_state()
    read = checkpoints.bytes_read()
    restored = ckpt.restore_latest(trainer.to_checkpoint(state), adapt=trainer.from_checkpoint)
    start = 0
    if restored is not None:
        start, state = restored
        log.info("resumed from %s at step %d (process %d read %d bytes)", ckpt.full.directory, start,
                 jax.process_index(), checkpoints.bytes_read() - read)
    main = jax.process_index() == 0
    writer = metrics.MetricsWriter(workdir, resume_step=start, enabled=main)
    bar = None
    if progress and main:
        from tqdm import tqdm
        bar = tqdm(total=t.num_steps, initial=start, unit="step", dynamic_ncols=True)
    clock = timing.Clock(t, jax.device_count(), timing.peak_flops(cfg), timing.model_flops_per_token(cfg))
    settler = Settler(t, start, writer, clock, bar, lambda params: trainer.evaluate(tokens, params),
                      trainer.batch_sharding, (t.batch_size, trainer.length))
    node_faults = Faults(cfg.debug)
    try:
        for step in range(start + 1, t.num_steps + 1):
            node_faults.before(step)
            with clock.waiting("data_wait_s"):
                batch = trainer.batch(tokens, "train", step)
            state, m = trainer.step_fn(state, batch)
            settler.flush(state["params"])  # the previous step's metrics, while this one runs on the device
            # A step whose state is evaluated or saved is settled first: its metrics are written before its
            # checkpoint (a resume never loses a row) and a NaN halts before it is saved.
            if (step % t.eval_every == 0 or step == t.num_steps or ckpt.should_save(step)):
                settler.settle(step, m, state["params"])
            else:
                settler.defer(step, m)
            with clock.waiting("checkpoint_s"):
                if ckpt.should_save(step) or step == t.num_steps:  # the ends' owner slices only when written
                    ckpt.save(step, trainer.to_checkpoint(state), force=step == t.num_steps)
            if step < t.num_steps and node_faults.preempted(step):
                settler.flush(state["params"])
                ckpt.save_now(step, trainer.to_checkpoint(state))
                raise Preempted(step)
        settler.flush(state["params"])
    finally:
        node_faults.close()
        ckpt.wait()
        ckpt.close()
        writer.close()
        if bar is not None:
            bar.close()
    summary = dict(settler.summary, skipped_steps=settler.skipped)
    if main:
        summary["plot"] = metrics.plot([workdir], os.path.join(workdir, "loss.png"))
    return summary


def evaluate(cfg: configs.Config | ml_collections.ConfigDict, workdir: str) -> dict:
    """Held-out loss of the newest checkpoint (full or model-only) in workdir."""
    cfg = configs.typed(cfg)
    trainer = Trainer(cfg, workdir)  # checks the config against the devices before anything is written
    tokens = prepare_data(cfg, workdir)
    ckpt = Checkpoints(workdir, cfg.train.checkpoint_every, cfg.train.model_checkpoint_every, async_save=False,
                       single_read=cfg.train.checkpoint_single_read)
    restored = ckpt.restore_params(trainer.to_checkpoint({"params": trainer.fresh_state()["params"]})["params"],
                                   adapt=trainer.from_checkpoint)
    ckpt.close()
    if restored is None:
        raise FileNotFoundError(f"no checkpoint in {workdir}/checkpoints or {workdir}/model_checkpoints; train first")
    step, params = restored
    return {"step": step, "eval_loss": trainer.evaluate(tokens, params)}
