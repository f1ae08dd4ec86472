"""Pieces of the training runtime: config overrides, the optimiser recipe, goldfish loss, batch purity."""
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from gshard_jax import configs
from gshard_jax.training import data, optim, overrides


def test_overrides_parse_to_the_fields_types():
    cfg = configs.load(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments",
                                    "tiny_moe_lm.py"))
    rest, found = overrides.split_args(["train", "--config.model.moe.num_experts=16", "--config.train.seed", "3",
                                        "--config.model.scan=true", "--config.train.learning_rate=1e-3",
                                        "--workdir", "w", "--config.model.moe.second_policy=all"])
    assert rest == ["train", "--workdir", "w"]
    overrides.apply(cfg, found)
    assert (cfg.model.moe.num_experts, cfg.train.seed, cfg.model.scan) == (16, 3, True)
    assert cfg.train.learning_rate == 1e-3 and cfg.model.moe.second_policy == "all"
    assert configs.count_params(cfg.model)["total_params"] > 0  # still a valid model
    with pytest.raises(ValueError, match="expected true or false"):
        overrides.apply(cfg, [("model.scan", "maybe")])
    with pytest.raises(ValueError, match="expected a number"):
        overrides.apply(cfg, [("train.learning_rate", "fast")])
    with pytest.raises(ValueError, match="has no value"):
        overrides.split_args(["--config.train.seed"])
    t = ml_collections.ConfigDict({"shape": (1, 2)})
    assert overrides.apply(t, [("shape", "(3, 4)")]).shape == (3, 4)
    with pytest.raises(ValueError, match="tuple literal"):
        overrides.apply(t, [("shape", "[3, 4]")])


def test_schedule_warms_up_then_decays_to_the_floor_and_clips_only_after_warmup():
    t = configs.train_defaults()
    t.update(dict(num_steps=100, warmup_steps=10, learning_rate=1e-3, min_learning_rate=1e-4, clip_norm=1.0))
    lr = optim.schedule(t)
    assert float(lr(0)) == 0.0 and float(lr(5)) == pytest.approx(5e-4) and float(lr(10)) == pytest.approx(1e-3)
    assert float(lr(100)) == pytest.approx(1e-4) and float(lr(55)) == pytest.approx(5.5e-4)  # cosine midpoint
    t.decay_steps = 50  # a schedule that does not move when num_steps does
    assert float(optim.schedule(t)(50)) == pytest.approx(1e-4)
    clip = optim.clip_after(2, 1.0)
    state = clip.init(None)
    big = {"w": jnp.full((4,), 10.0)}  # norm 20
    norms = []
    for _ in range(4):
        out, state = clip.update(big, state)
        norms.append(float(optax_norm(out)))
    assert norms[:2] == [20.0, 20.0] and norms[2:] == pytest.approx([1.0, 1.0])


def optax_norm(tree):
    return jnp.sqrt(sum(jnp.sum(x ** 2) for x in jax.tree.leaves(tree)))


def test_goldfish_drops_about_one_in_k_tokens_decided_by_their_context():
    tokens = jax.random.randint(jax.random.key(0), (8, 512), 0, 2048)
    w = optim.goldfish_weights(tokens, k=2, h=13)
    assert 0.45 < float(1 - jnp.mean(w)) < 0.55
    assert 0.2 < float(1 - jnp.mean(optim.goldfish_weights(tokens, k=4, h=13))) < 0.3
    assert bool(jnp.all(optim.goldfish_weights(tokens, k=1, h=13) == 1))
    # The same 13-token context drops the same token wherever it occurs.
    repeated = jnp.concatenate([tokens[:1, :100], tokens[1:2, :37], tokens[:1, :100]], axis=1)
    wr = optim.goldfish_weights(repeated, k=2, h=13)
    assert bool(jnp.all(wr[0, 12:100] == wr[0, 137 + 12:237]))
    # Changing token 100 can change the decisions at 100..112 (windows holding it) and nowhere else.
    changed = optim.goldfish_weights(tokens.at[:, 100].add(1), k=2, h=13)
    assert bool(jnp.all(changed[:, :100] == w[:, :100])) and bool(jnp.all(changed[:, 113:] == w[:, 113:]))
    assert bool(jnp.any(changed[:, 112] != w[:, 112]))  # the window's oldest token still counts


def test_batches_are_a_pure_function_of_seed_and_step_split_over_processes(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    (d / "t").mkdir()
    for i in range(4):
        (d / "t" / f"{i}.txt").write_text(" ".join(f"w{(i * 7 + j) % 50}" for j in range(3000)))
    out = str(tmp_path / "out")
    data.prepare(out, 300, src=str(d / "t"), held_out=0.25, seed=1)
    tokens = data.TokenData(out)
    whole = tokens.windows("train", 0, 5, 8, 33)
    parts = np.concatenate([tokens.windows("train", 0, 5, 8, 33, i * 2, i * 2 + 2) for i in range(4)])
    assert whole.shape == (8, 33) and np.array_equal(whole, parts)
    assert np.array_equal(whole, data.TokenData(out).windows("train", 0, 5, 8, 33))
    assert not np.array_equal(whole, tokens.windows("train", 0, 6, 8, 33))
    assert tokens.meta["splits"]["eval"]["files"] == 1 and tokens.meta["splits"]["train"]["files"] == 3
    with pytest.raises(ValueError, match="vocab_size is 10"):
        data.prepare(str(tmp_path / "small"), 10, src=str(d / "t"), tokenizer=f"{out}/tokenizer.json")


def test_held_out_windows_are_the_same_whatever_the_training_seed(tmp_path):
    """A run's train.seed sets its training batches; its eval batches come from data.eval_seed, so runs of
    different seeds (benchmarks/moe_vs_dense.py) are evaluated on the same held-out text."""
    from gshard_jax.training.train import Trainer
    d = tmp_path / "t"
    d.mkdir()
    for i in range(4):
        (d / f"{i}.txt").write_text(" ".join(f"w{(i * 7 + j) % 50}" for j in range(3000)))
    out = str(tmp_path / "data")
    data.prepare(out, 300, src=str(d), held_out=0.25, seed=0)
    tokens = data.TokenData(out)

    def batches(seed, eval_seed=0):
        cfg = configs.load(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments",
                                        "tiny_dense_lm.py"))
        cfg.model.vocab_size = 300
        cfg.train.update(dict(seq_len=32, batch_size=8, seed=seed))
        cfg.data.eval_seed = eval_seed
        trainer = Trainer(cfg, str(tmp_path / f"w{seed}{eval_seed}"))
        return [np.asarray(trainer.batch(tokens, split, 3)["inputs"]) for split in ("train", "eval")]
    (train0, eval0), (train1, eval1), (_, other) = batches(0), batches(1), batches(1, eval_seed=1)
    assert not np.array_equal(train0, train1)
    assert np.array_equal(eval0, eval1) and not np.array_equal(eval0, other)


def test_goldfish_loss_is_the_train_steps_loss_over_the_kept_tokens(tmp_path):
    """train_step with goldfish_k=2 computes the loss over the tokens goldfish_weights keeps."""
    from gshard_jax.models.transformer import loss_fn
    from gshard_jax.training.train import Trainer
    cfg = configs.load(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments",
                                    "tiny_dense_lm.py"))
    cfg.train.update(dict(goldfish_k=2, seq_len=32, batch_size=8))
    trainer = Trainer(cfg, str(tmp_path))
    state = jax.jit(trainer.init_state)(jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (8, 33), 0, cfg.model.vocab_size)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    _, m = jax.jit(trainer.train_step)(state, batch)
    weights = optim.goldfish_weights(batch["inputs"], 2, 13)
    rng = jax.random.fold_in(jax.random.key(cfg.train.seed), 1)
    kept, _ = loss_fn(trainer.model, state["params"], dict(batch, weights=weights), rng)
    full, _ = loss_fn(trainer.model, state["params"], batch, rng)
    assert float(m["loss"]) == pytest.approx(float(kept), rel=1e-5) and float(kept) != pytest.approx(float(full))


def test_the_trainers_programs_partition_without_fallback_and_as_reported(tmp_path):
    """init, train and eval steps of the encoder-decoder (optax AdamW chain, bf16 compute, goldfish loss, NaN
    skip): no fallback row, and explain() equal to the compiled HLO (bf16 exchanges counted as XLA:CPU sends
    them)."""
    import gshard_jax as gs
    from gshard_jax.training.train import Trainer
    from helpers import assert_report_matches_hlo, hlo_stats
    cfg = configs.load(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments",
                                    "tiny_moe_encdec.py"))
    cfg.model.update(dict(vocab_size=512, dtype="bfloat16", num_layers=2))
    cfg.train.update(dict(goldfish_k=4, nan_policy="skip", seq_len=16, batch_size=8))
    trainer = Trainer(cfg, str(tmp_path))
    state = trainer.fresh_state()
    windows = np.asarray(jax.random.randint(jax.random.key(1), (8, data.window_length("encoder_decoder", 16)), 1,
                                            512))
    batch = data.model_batch("encoder_decoder", windows)
    for fn, args in ((trainer.init_state, (jax.random.key(0),)), (trainer.train_step, (state, batch)),
                     (trainer.eval_step, (state["params"], batch))):
        report = gs.explain(fn, trainer.mesh, *args)
        assert not report.fallbacks, [(r.primitive, r.source) for r in report.fallbacks]
        assert_report_matches_hlo(report, hlo_stats(gs.partition(fn, trainer.mesh), *args))


def test_metrics_on_resume_keep_each_step_once(tmp_path):
    """A crashed run's rows after the resumed step are dropped; a torn last line is ignored."""
    from gshard_jax.training import metrics
    w = metrics.MetricsWriter(str(tmp_path))
    for step in range(1, 6):
        w.write(step, {"loss": float(step)})
    w.close()
    with open(tmp_path / metrics.METRICS, "a") as f:
        f.write('{"step": 6, "lo')  # killed mid-write
    w = metrics.MetricsWriter(str(tmp_path), resume_step=3)
    w.write(4, {"loss": 0.5})
    w.close()
    assert [(r["step"], r["loss"]) for r in metrics.read(str(tmp_path))] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 0.5)]


def test_mesh_sizes_of_minus_one_take_the_rest_and_size_one_axes_are_dropped():
    """experiments/README.md: mesh axis sizes, -1 = the rest."""
    from gshard_jax.training.train import mesh_for
    cfg = ml_collections.ConfigDict({"mesh": {"data": -1, "expert": 4, "model": 1}})
    assert dict(mesh_for(cfg).shape) == {"data": 2, "expert": 4}
    cfg.mesh.update(dict(data=1, expert=8))
    assert dict(mesh_for(cfg).shape) == {"expert": 8}
    cfg.mesh.update(dict(data=2, expert=2))
    with pytest.raises(ValueError, match="--cpu-devices 4"):
        mesh_for(cfg)


def test_default_optimizer_decays_every_parameter():
    """README: AdamW with weight decay 0.1 on all params (norm scales and biases included)."""
    t = configs.train_defaults()
    assert t.weight_decay == 0.1
    t.update(dict(warmup_steps=0, num_steps=10))
    opt = optim.optimizer(t)
    params = {"norm": {"scale": jnp.ones((4,))}, "dense": {"kernel": jnp.ones((4, 4)), "bias": jnp.ones((4,))}}
    updates, _ = opt.update(jax.tree.map(jnp.zeros_like, params), opt.init(params), params)
    assert all(bool(jnp.all(u < 0)) for u in jax.tree.leaves(updates))  # zero gradient: decay alone shrinks


@pytest.mark.parametrize("experiment,microbatches,mesh", [
    ("tiny_moe_lm.py", 2, {}),  # MoE all-to-all over the batch's own shards, gradient accumulation
    pytest.param("tiny_moe_lm.py", 4, {"stage": 2, "data": 2, "expert": 2, "schedule": "1f1b"},
                 marks=pytest.mark.slow),  # the loss inside the pipeline, its backward its own
])
def test_nonfinite_rows_are_counted_in_their_batch_shards_before_the_reduction(tmp_path, experiment,
                                                                             microbatches, mesh):
    """Two rows' backward turns NaN (debug.soft_fail_process's fault): the loss stays as it was, the gradient
    norm is NaN, and the step counts the two rows in their own batch shards only, whose devices are named."""
    from gshard_jax.training import faults
    from gshard_jax.training.train import Trainer
    cfg = configs.load(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments",
                                    experiment))
    cfg.model.update(dict(vocab_size=512, num_layers=2))
    cfg.train.update(dict(seq_len=16, batch_size=16, microbatches=microbatches))
    if "schedule" in mesh:
        cfg.pipeline.schedule = mesh.pop("schedule")
    cfg.mesh.update(mesh)
    trainer = Trainer(cfg, str(tmp_path))
    state = trainer.fresh_state()
    windows = np.asarray(jax.random.randint(jax.random.key(1), (16, trainer.length), 1, 512))
    rows = data.model_batch(cfg.model.kind, windows)
    fault = np.ones([16, 1], np.float32)
    fault[[5, 12]] = np.nan
    out = {}
    for name, scale in (("clean", np.ones_like(fault)), ("faulty", fault)):
        batch = {k: jax.device_put(v, trainer.batch_sharding) for k, v in dict(rows, soft_fail=scale).items()}
        out[name] = trainer.step_fn(jax.tree.map(jnp.copy, state), batch)[1]  # the step donates its state
    clean, faulty = out["clean"], out["faulty"]
    assert bool(clean["finite"]) and not np.asarray(clean["nonfinite_rows"]).any()
    assert float(faulty["loss"]) == float(clean["loss"]) and not bool(faulty["finite"])
    assert np.isnan(float(faulty["grad_norm"]))
    per = 16 // trainer.shards
    want = np.zeros(trainer.shards, int)
    want[5 // per] += 1
    want[12 // per] += 1
    assert np.asarray(faulty["nonfinite_rows"]).tolist() == want.tolist()
    named = faults.name_shards(np.asarray(faulty["nonfinite_rows"]), trainer.batch_sharding, (16, trainer.length))
    held = trainer.batch_sharding.devices_indices_map((16, trainer.length))
    for c in named:
        assert c["devices"] == sorted(d.id for d, i in held.items() if (i[0].start or 0) == c["shard"] * per)
        assert c["processes"] == [0] and c["rows"] == 1
    assert [c["shard"] for c in named] == [5 // per, 12 // per]


def test_the_supervisor_replaces_soft_failing_nodes_once_and_stops_when_the_fault_follows_the_step(tmp_path):
    """The supervisor's decisions on soft failures, without processes: a report naming some processes marks
    their nodes bad and relaunches on spares; one naming every process, or the same step failing again on
    the replacements, is the data or the model and stops the run with the halt status."""
    import json

    from gshard_jax.training import launch as L
    from gshard_jax.training.faults import SOFT_FAILURE
    beats = tmp_path / "beats"
    beats.mkdir()
    culprits = [{"shard": 1, "rows": 2, "devices": [4, 5], "processes": [1]}]
    (beats / SOFT_FAILURE.format(0)).write_text(json.dumps({"step": 6, "node": 0, "culprits": culprits}))
    opts = L.Options(processes=2, spares=2, cpu_devices=4, hang_timeout=20, startup_timeout=60, max_restarts=5,
                     shrink=False)
    sup = L.Supervisor(opts, [], str(tmp_path))
    nodes, kind, detail = sup._soft_failure(str(beats), 0, [0, 3])
    assert (nodes, kind, detail["step"], detail["devices"]) == ([3], "soft", 6, [4, 5])
    everyone = culprits + [{"shard": 0, "rows": 2, "devices": [0, 1], "processes": [0]}]
    (beats / SOFT_FAILURE.format(0)).write_text(json.dumps({"step": 6, "node": 0, "culprits": everyone}))
    assert sup._soft_failure(str(beats), 0, [0, 3]) is None  # every process: a halt, not a node
    assert sup._soft_failure(str(beats), 1, [0, 3]) is None  # no report from process 1

    attempts = []

    def one(attempt, chosen, coordinator):  # process 1 goes non-finite at step 6 on whichever node runs it
        attempts.append(chosen)
        return [chosen[1]], "soft", {"step": 6, "devices": [4, 5], "message": "non-finite rows at step 6"}
    sup._one = one
    (tmp_path / "launch").mkdir()
    assert sup._attempts() == L.EXIT_HALTED
    assert attempts == [[0, 1], [0, 2]]
    events = L.read(str(tmp_path))
    assert [e["event"] for e in events] == ["attempt", "failure", "replaced", "attempt", "stopped"], events
    assert events[1]["kind"] == "soft" and events[1]["step"] == 6 and events[1]["nodes"] == [1]
    assert "again on [2]" in events[-1]["reason"] and "not a node" in events[-1]["reason"]


def test_non_finite_values_that_no_row_holds_name_no_device():
    from gshard_jax.training import faults
    mesh = jax.make_mesh((8,), ("data",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", None))
    assert faults.name_shards(np.zeros(8, int), sharding, (16, 4)) == []
    assert "names no device" in faults.describe([])
    named = faults.name_shards(np.array([0, 0, 0, 1, 0, 0, 0, 0]), sharding, (16, 4))
    assert named == [{"shard": 3, "rows": 1, "devices": [mesh.devices[3].id], "processes": [0]}]


def _saved_state(tmp_path, monkeypatch):
    """A train-like state (params on a {data 2, x 4} mesh, one split over data; optax's namedtuple state)
    saved at step 7, with one process standing in for two host groups along data: (Checkpoints, state)."""
    import optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from gshard_jax.training import checkpoints
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "x"))
    monkeypatch.setattr(checkpoints, "host_groups", lambda m: 2 if m.shape["data"] == 2 else None)
    put = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))
    params = {"dense": {"kernel": put(jnp.arange(64.0).reshape(8, 8), None, "x"), "bias": put(jnp.arange(8.0))},
              "split": put(jnp.arange(32.0).reshape(8, 4) * 3, "data", None)}
    # optax's state (namedtuples, as in a real run), its moments placed as the params and made nonzero.
    opt_state = jax.tree.map(lambda x: put(x + 1.5, *x.sharding.spec) if isinstance(x.sharding, NamedSharding)
                             else put(x), optax.adam(1e-3).init(params))
    state = {"params": params, "opt_state": opt_state, "step": put(jnp.int32(7))}
    ckpt = checkpoints.Checkpoints(str(tmp_path), 1, 1, async_save=False)
    ckpt.save(7, state, force=True)
    ckpt.wait()
    return ckpt, state


def _assert_restored(ckpt, state):
    step, back = ckpt.restore_latest(state)
    step_p, back_p = ckpt.restore_params(state["params"])
    assert step == step_p == 7
    for want, got in ((state, back), (state["params"], back_p)):
        assert jax.tree.structure(want) == jax.tree.structure(got)
        for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
            assert b.sharding.is_equivalent_to(a.sharding, a.ndim) and np.array_equal(a, b)


def test_single_reads_restore_what_was_saved_full_and_params_only(tmp_path, monkeypatch, caplog):
    """Single reads split a restore in two (arrays replicated over the host groups' axis read by group 0 and
    broadcast, the rest by their holders): a full restore (optax's namedtuples, PLACEHOLDER masks) and a
    params-only one (partial, leaves left out) both give back what was saved, and neither fell back to
    the plain read."""
    import logging

    from gshard_jax.training import checkpoints
    ckpt, state = _saved_state(tmp_path, monkeypatch)
    single_reads = []
    real = checkpoints.Checkpoints._single_read
    monkeypatch.setattr(checkpoints.Checkpoints, "_single_read",
                        lambda self, *a: single_reads.append(a[-1]) or real(self, *a))
    with caplog.at_level(logging.WARNING, logger="gshard_jax"):
        _assert_restored(ckpt, state)
    assert not caplog.records, [r.getMessage() for r in caplog.records]  # no fallback to the plain read
    assert single_reads == [False, True]  # full, then partial
    ckpt.close()


def test_a_failed_single_read_falls_back_to_every_process_reading(tmp_path, monkeypatch, caplog):
    """docs/training.md: a single read that fails is retried the plain way, with a warning, and the
    checkpoint is not counted as damaged."""
    import logging

    from gshard_jax.training import checkpoints
    ckpt, state = _saved_state(tmp_path, monkeypatch)

    def broken(self, *args):
        raise RuntimeError("broadcast out of memory")
    monkeypatch.setattr(checkpoints.Checkpoints, "_single_read", broken)
    with caplog.at_level(logging.WARNING, logger="gshard_jax"):
        _assert_restored(ckpt, state)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2 and all("single read of" in m and "broadcast out of memory" in m for m in messages)
    assert not any("damaged" in m for m in messages)
    ckpt.close()


def test_checkpoint_writes_are_replica_parallel_where_orbax_defaults_them_off(tmp_path, monkeypatch):
    """orbax turns replica-parallel saving off by default on GPUs; the runtime's managers ask for it."""
    import orbax.checkpoint as ocp

    from gshard_jax.training import checkpoints
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    assert ocp.type_handlers.ArrayHandler()._use_replica_parallel is False  # orbax's default there
    made = []
    real = ocp.type_handlers.ArrayHandler
    monkeypatch.setattr(ocp.type_handlers, "ArrayHandler", lambda **kw: made.append(real(**kw)) or made[-1])
    checkpoints.Checkpoints(str(tmp_path), 1, 1, async_save=False).close()
    assert len(made) == 2 and all(h._use_replica_parallel for h in made)  # full and model-only series
    made.clear()
    checkpoints.Checkpoints(str(tmp_path), 1, 1, async_save=False, replica_parallel=False).close()
    assert len(made) == 2 and not any(h._use_replica_parallel for h in made)


def test_row_watch_on_flax_embed_and_optax_names_the_shard_as_xla_does():
    """The soft-failure probe on code nobody here wrote: Flax linen's nn.Embed, Dense and LayerNorm, optax's
    AdamW and softmax cross-entropy. A NaN in row 9's backward is counted in shard 4 of {data 8}, by our
    partitioner and by XLA's, explain() equals the HLO, and bytes and flops equal XLA's."""
    import flax.linen as nn
    import optax
    from jax.sharding import PartitionSpec as P

    import gshard_jax as gs
    from gshard_jax.training import faults
    from helpers import assert_report_matches_hlo, hlo_stats

    class LM(nn.Module):
        @nn.compact
        def __call__(self, t):
            x = nn.Embed(64, 32)(t)
            x = x + nn.Dense(32)(nn.relu(nn.Dense(64)(nn.LayerNorm()(x))))
            return nn.Dense(64)(x)

    model, tx, mesh = LM(), optax.adamw(1e-3), gs.make_mesh({"data": 8})
    tok = jax.random.randint(jax.random.key(0), (16, 8), 0, 64)
    params = model.init(jax.random.key(1), tok)

    def step(params, opt, tok, fault):
        def loss(p, probe):
            with nn.intercept_methods(faults.row_watcher(nn.Embed, probe, fault)):
                logits = model.apply(p, tok)
            return optax.softmax_cross_entropy_with_integer_labels(logits, tok).mean()
        value, (g, rows) = jax.value_and_grad(loss, (0, 1))(params, jnp.zeros([16]))
        updates, opt = tx.update(g, opt, params)
        return optax.apply_updates(params, updates), opt, value, faults.nonfinite_per_shard(rows, 8)

    fault = np.ones(16, np.float32)
    fault[9] = np.nan
    args, kw = (params, tx.init(params), tok, fault), dict(in_shardings=(None, None, P("data", None), P("data")),
                                                           out_shardings=(None, None, P(), P()))
    ours, xla = gs.partition(step, mesh, **kw), gs.partition(step, mesh, backend="xla", **kw)
    for fn in (ours, xla):
        assert np.asarray(fn(*args)[3]).tolist() == [0, 0, 0, 0, 1, 0, 0, 0]
    stats, xla_stats = hlo_stats(ours, *args), hlo_stats(xla, *args)
    assert_report_matches_hlo(gs.explain(step, mesh, *args, **kw), stats)
    assert {k: v["payload_bytes"] for k, v in stats.items()} == {k: v["payload_bytes"] for k, v in xla_stats.items()}
    flops = [fn.lower(*args).compile().cost_analysis()["flops"] for fn in (ours, xla)]
    assert flops[0] <= flops[1], flops


def test_overlap_flags_are_known_to_the_installed_xla_and_the_users_win():
    """Every XLA:GPU flag the runtime adds parses in this jaxlib (an unknown one aborts XLA at start-up), and a
    flag the user set keeps the user's value."""
    import subprocess
    import sys

    from gshard_jax.training.train import OVERLAP_FLAGS, with_overlap_flags
    env = dict(os.environ, XLA_FLAGS=with_overlap_flags(""), JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, "-c", "import jax; print(len(jax.devices()))"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    mine = with_overlap_flags("--xla_gpu_enable_latency_hiding_scheduler=false --foo=1").split()
    assert mine[:2] == ["--xla_gpu_enable_latency_hiding_scheduler=false", "--foo=1"]
    assert len(mine) == len(OVERLAP_FLAGS) + 1 and "--xla_gpu_enable_latency_hiding_scheduler=true" not in mine


@pytest.mark.parametrize("field", ["log_every", "eval_every"])
def test_a_cadence_of_zero_steps_is_a_clear_error(field):
    """--config.train.eval_every=0 used to divide by zero at the first step; it is refused up front."""
    from gshard_jax.training import train
    cfg = configs.load(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments",
                                    "tiny_dense_lm.py"))
    cfg.train[field] = 0
    with pytest.raises(ValueError, match=f"train.{field}=0: expected a positive number of steps"):
        train.Trainer(cfg, "/nonexistent")


def test_the_train_step_is_a_module_level_function_of_state_batch_and_its_static_config(tmp_path):
    """training/steps.py: Trainer binds the StepConfig it built to steps.train_step; the same function with
    that config as a static argument computes the same step."""
    from gshard_jax.training import steps
    from gshard_jax.training.train import Trainer
    cfg = configs.load(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments",
                                    "tiny_dense_lm.py"))
    cfg.train.update(dict(seq_len=16, batch_size=8))
    trainer = Trainer(cfg, str(tmp_path))
    assert isinstance(trainer.cfg, configs.Config) and trainer.step_config.train is trainer.cfg.train
    for name in ("init_state", "train_step", "update", "eval_step"):
        fn = getattr(trainer, name)
        assert fn.func is getattr(steps, name) and fn.keywords == {"c": trainer.step_config}, name
    state = jax.jit(trainer.init_state)(jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (8, 17), 0, cfg.model.vocab_size)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    ours = jax.jit(steps.train_step, static_argnames="c")(state, batch, c=trainer.step_config)[1]["loss"]
    assert float(ours) == float(jax.jit(trainer.train_step)(state, batch)[1]["loss"])


class _Writer:
    def __init__(self):
        self.rows = []

    def write(self, step, row):
        self.rows.append((step, row))


class _Clock:
    def step_done(self, timed):
        pass

    def pause(self):
        pass

    def window(self):
        return {"tokens_per_s": 1.0, "mfu": 0.5}


def _metrics(loss: float, bad_rows: list[int]) -> dict:
    return {"loss": loss, "grad_norm": 1.0, "finite": np.isfinite(loss), "nonfinite_rows": np.array(bad_rows),
            "aux_loss": 0.0, "dropped": 0.0}


def test_the_settler_logs_skips_and_halts_on_the_host():
    """training/settle.py: a deferred step settles at the next flush; a non-finite step is skipped and named
    (nan_policy="skip") or halts the run (NonFiniteStep); the summary is the last logged row's."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from gshard_jax.training.settle import NonFiniteStep, Settler
    sharding = NamedSharding(jax.make_mesh((8,), ("data",)), P("data"))
    t = configs.TrainConfig(num_steps=4, log_every=2, eval_every=4, nan_policy="skip")
    writer = _Writer()
    s = Settler(t, 0, writer, _Clock(), None, lambda params: params, sharding, (8, 4))
    s.defer(1, _metrics(2.0, [0] * 8))
    assert s.pending is not None and not writer.rows
    s.flush(params=None)
    s.settle(2, _metrics(float("nan"), [0, 0, 0, 1] + [0] * 4), params=None)
    s.settle(3, _metrics(1.5, [0] * 8), params=None)
    s.settle(4, _metrics(1.0, [0] * 8), params=0.25)
    assert [step for step, _ in writer.rows] == [2, 4] and writer.rows[0][1]["nonfinite_processes"] == [0]
    assert s.summary == {"start_step": 0, "step": 4, "loss": 1.0, "eval_loss": 0.25} and s.skipped == 1
    halting = Settler(configs.TrainConfig(num_steps=4), 0, _Writer(), _Clock(), None, float, sharding, (8, 4))
    with pytest.raises(NonFiniteStep, match="step 3: non-finite loss nan"):
        halting.settle(3, _metrics(float("nan"), [1] + [0] * 7), params=None)


@pytest.mark.parametrize("backend", ["gshard", pytest.param("xla", marks=pytest.mark.slow)])
def test_an_unrolled_train_step_compiles_to_straight_line_code(tmp_path, backend):
    """An unrolled dense LM step with post-warmup clipping and NaN skipping, one microbatch, data parallel,
    compiles with no conditional or loop under both partitioners, as plain JAX's step does: clipping selects
    rather than branches (docs/training.md)."""
    import re

    from gshard_jax.training.train import Trainer
    cfg = configs.load(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments",
                                    "mula_1b.py"))
    cfg.model.update(dict(num_layers=2, d_model=128, num_heads=2, head_dim=64, d_ff=256, vocab_size=512,
                          scan=False, attention="xla"))
    cfg.train.update(dict(seq_len=16, batch_size=8, nan_policy="skip", warmup_steps=2))
    cfg.mesh.update({k: 1 for k in configs.MeshConfig().sizes()})
    cfg.mesh.data = 8
    trainer = Trainer(cfg, str(tmp_path))
    state = trainer.fresh_state()
    batch = data.model_batch("decoder_lm", np.asarray(jax.random.randint(
        jax.random.key(1), (8, data.window_length("decoder_lm", 16)), 1, 512)))
    hlo = trainer.partitioned("train", backend).lower(state, batch).compile().as_text()
    assert re.findall(r"\s(conditional|while)\(", hlo) == []


def test_the_trainers_step_donates_its_state(tmp_path):
    """Trainer.step_fn reuses the state's buffers for the next state, as plain JAX's steps do: the compiled
    step aliases every byte of the state a device holds, and the call deletes the state it was given."""
    from gshard_jax.training.train import Trainer
    cfg = configs.load(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments",
                                    "tiny_dense_lm.py"))
    cfg.model.update(dict(vocab_size=512, num_layers=2))
    cfg.train.update(dict(seq_len=16, batch_size=16, zero_stage=1))
    trainer = Trainer(cfg, str(tmp_path))
    state = trainer.fresh_state()
    batch = jax.device_put(data.model_batch(cfg.model.kind, np.asarray(jax.random.randint(
        jax.random.key(1), (16, trainer.length), 1, 512))), trainer.batch_sharding)
    held = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state))
    assert trainer.step_fn.lower(state, batch).compile().memory_analysis().alias_size_in_bytes == held
    new, _ = trainer.step_fn(state, batch)
    assert all(x.is_deleted() for x in jax.tree.leaves(state)) and int(new["step"]) == 1
