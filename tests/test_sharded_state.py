"""Sharded training state (gshard_jax/training/layout.py): ZeRO stages 0-3, EPSO, AxoNN's x/y/z layout, gradient
accumulation, bf16 master weights, and memory in explain(), on 8 simulated devices.

Every sharded run is compared with the same train step run unpartitioned (one device, annotations off)."""
import functools
import itertools
import os
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gshard_jax import configs
from gshard_jax.partitioner.reporting.hlo import collectives
from gshard_jax.training import layout as S, steps, train
from gshard_jax.training.checkpoints import Checkpoints
from helpers import assert_report_matches_hlo, hlo_stats

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESHES = {"d8": dict(data=8), "d2e4": dict(data=2, expert=4), "d2z2y2": dict(data=2, z=2, y=2),
          "x2y2z2": dict(x=2, y=2, z=2)}
STEPS = 5


def make(mesh="d8", dense=False, **train_kw):
    """A Trainer of a small tiny_moe_lm (2 layers, vocab 256, 16 x 16 tokens) on one of MESHES."""
    cfg = configs.load(os.path.join(ROOT, "experiments", "tiny_moe_lm.py"))
    cfg.mesh.update({**dict(data=1, expert=1), **(MESHES[mesh] if isinstance(mesh, str) else mesh)})
    cfg.pipeline.update(train_kw.pop("pipeline", {}))
    cfg.debug.update(train_kw.pop("debug", {}))
    dtype = train_kw.pop("dtype", "float32")
    cfg.model.update({**dict(num_layers=2, vocab_size=256, dtype=dtype), **train_kw.pop("model", {})})
    if dense:
        cfg.model.moe.num_experts = 0
    cfg.train.update(dict(batch_size=16, seq_len=16, warmup_steps=2, **train_kw))
    return train.Trainer(cfg, "/nonexistent")


def batches(trainer, n=STEPS):
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        toks = rng.integers(0, 256, (16, 17))
        out.append({"inputs": jnp.asarray(toks[:, :-1], jnp.int32), "targets": jnp.asarray(toks[:, 1:], jnp.int32)})
    return out


def run(trainer, partitioned=True, state=None, data=None):
    """(losses, final state) of STEPS steps, partitioned on the trainer's mesh or unpartitioned."""
    step = trainer.step_fn if partitioned else jax.jit(trainer.train_step)
    if state is None:
        key = jax.random.key(trainer.cfg.train.seed)
        state = trainer.init_fn(key) if partitioned else jax.jit(trainer.init_state)(key)
    losses = []
    for b in data or batches(trainer):
        if partitioned:
            b = jax.device_put(b, trainer.batch_sharding)
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    return losses, state


def assert_same_run(got, want, rtol, atol=None):
    """(losses, state) of two runs agree: losses to rtol, params to rtol and atol (default rtol)."""
    np.testing.assert_allclose(got[0], want[0], rtol=rtol)
    for a, b in zip(jax.tree.leaves(got[1]["params"]), jax.tree.leaves(want[1]["params"])):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=rtol,
                                   atol=rtol if atol is None else atol)


ALL = list(itertools.product(MESHES, (0, 1, 2, 3), (True, False), ("float32", "bfloat16")))
# The rest run with -m slow (12-16 s each); ZeRO-3 on d8 against the unpartitioned run is
# test_zero3_gathers_each_scanned_layer_inside_the_loop's (slow too, tests/slow_cases.txt).
DEFAULT = [("d2e4", 1, True, "float32"), ("x2y2z2", 1, True, "float32"), ("d2e4", 3, True, "bfloat16")]


@pytest.mark.parametrize("mesh,stage,epso,dtype", [
    pytest.param(*c, marks=() if c in DEFAULT else pytest.mark.slow) for c in ALL if c[2] or c[0] == "d2e4"],
    ids=lambda v: str(v))
def test_sharded_state_trains_as_the_unsharded_step(mesh, stage, epso, dtype):
    """Five optimizer steps of every ZeRO stage, with and without EPSO, f32 and bf16, equal the unpartitioned
    step's (f32 to 1e-5; bf16 to its own precision), with microbatches from stage 2 on."""
    trainer = make(mesh, zero_stage=stage, epso=epso, dtype=dtype, microbatches=2 if stage == 2 else 1)
    assert_same_run(run(trainer), run(trainer, partitioned=False), 1e-5 if dtype == "float32" else 2e-2)


def test_gradient_accumulation_equals_the_large_batch():
    """train.microbatches=2 and 4 (a scan of gradient sums, one update) gives the one-batch step's losses, and
    its gradient equals the large batch's."""
    whole = make("d2z2y2", dense=True)
    big = run(whole, partitioned=False)
    np.testing.assert_allclose(run(make("d2z2y2", dense=True, microbatches=2, zero_stage=2))[0], big[0], rtol=1e-5)
    np.testing.assert_allclose(run(make("d8", dense=True, microbatches=2))[0], big[0], rtol=1e-5)
    micro = make("d2z2y2", dense=True, microbatches=4)
    params = jax.jit(whole.init_state)(jax.random.key(0))["params"]
    b, one = batches(whole, 1)[0], jnp.ones([], jnp.int32)
    want, got = (jax.jit(functools.partial(steps.gradients, c=t.step_config))(params, b, one)
                 for t in (whole, micro))
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-6)
    for a, c in zip(jax.tree.leaves(got[2]), jax.tree.leaves(want[2])):
        np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-7)


def formula(stage, P, N, dtype):
    """Seed 002's persistent bytes per device (docs/references.md): bf16 params and gradients of 2 bytes,
    K = 12 of float32 master weights and moments; float32 runs have no master copy (4 + 4 + 8)."""
    p = g = 2 if dtype == "bfloat16" else 4
    k = 12 if dtype == "bfloat16" else 8
    return {0: (p + g + k) * P, 1: (p + g) * P + k * P / N, 2: p * P + (g + k) * P / N,
            3: (p + g + k) * P / N}[stage]


@pytest.mark.parametrize("dtype", [pytest.param("bfloat16", marks=pytest.mark.slow), "float32"])  # 20-25 s each
def test_argument_bytes_follow_the_zero_formulas_and_memory_analysis(dtype):
    """Dense model on {data 8}: explain()'s predicted argument bytes equal memory_analysis()'s, and params +
    gradients + optimizer state per device follow 16P, 4P + 12P/N, 2P + 14P/N, 16P/N (bf16)."""
    for stage in (0, 1, 2, 3):
        trainer = make("d8", dense=True, zero_stage=stage, dtype=dtype)
        state = trainer.init_fn(jax.random.key(0))
        batch = jax.device_put(batches(trainer, 1)[0], trainer.batch_sharding)
        report = trainer.explain(state, batch)
        pred = report.memory["predicted"]
        assert pred["total"] == report.memory["compiled"]["argument"], report.memory
        assert pred["batch"] == 2 * 16 * 16 * 4 // 8
        P = sum(x.size for x in jax.tree.leaves(trainer.param_shapes))
        grad_dtype = trainer.model.cfg.compute_dtype
        grads = S.bytes_per_device(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, grad_dtype),
                                                trainer.param_shapes),
                                   trainer.layout.gradients if stage >= 2 else trainer.layout.stored,
                                   dict(trainer.mesh.shape))
        persistent = pred["params"] + pred["optimizer"] + grads
        counters = 3 * 4  # AdamW's and the clip's step counts: replicated int32 scalars
        assert persistent - counters == pytest.approx(formula(stage, P, 8, dtype), rel=1e-9), (stage, pred)
        assert "memory per device: arguments" in str(report) and "compiled argument" in str(report)


def group_bytes(compiled, kind):
    """{group size: payload bytes} of one collective kind in a compiled program."""
    out = Counter()
    for c in collectives(compiled):
        if c["kind"] == kind:
            out[c["group"]] += c["payload_bytes"]
    return out


@pytest.mark.parametrize("stage", [1, 3])
def test_sharded_steps_reduce_scatter_gradients_and_gather_params_over_data(stage):
    """Stage >= 1 on {data 8}: every weight gradient is reduce-scattered over the 8 data ranks, the params
    all-gathered over them, and no gradient-sized all-reduce is left (only the loss and norm scalars)."""
    trainer = make("d8", dense=True, zero_stage=stage)
    state = trainer.init_fn(jax.random.key(0))
    compiled = trainer.step_fn.lower(state, jax.device_put(batches(trainer, 1)[0], trainer.batch_sharding)).compile()
    param_bytes = 4 * sum(x.size for x in jax.tree.leaves(trainer.param_shapes))
    rs, ag, ar = (group_bytes(compiled, k) for k in ("reduce-scatter", "all-gather", "all-reduce"))
    assert rs[8] >= param_bytes, rs  # (stage 3 gathers and scatters again inside the backward pass)
    assert ag[8] >= param_bytes, ag
    assert sum(ar.values()) < 1024, ar


def test_epso_reduces_non_expert_gradients_over_data_times_expert():
    """{data 2, expert 4}, stage 1: with EPSO the non-expert gradients are reduce-scattered over all 8 devices
    and the expert ones over data (2); without it the non-expert states are held once per expert shard."""
    def step(epso):
        trainer = make("d2e4", zero_stage=1, epso=epso)
        state = trainer.init_fn(jax.random.key(0))
        batch = jax.device_put(batches(trainer, 1)[0], trainer.batch_sharding)
        return trainer, trainer.explain(state, batch), trainer.step_fn.lower(state, batch).compile()

    (t1, r1, c1), (_, r0, c0) = step(True), step(False)
    flat = jax.tree_util.tree_flatten_with_path(t1.param_shapes)[0]
    expert = {jax.tree_util.keystr(p) for p, _ in flat if "['moe']['w" in jax.tree_util.keystr(p)}
    assert expert and all(t1.layout.zero_axes[k] == ("data",) for k in expert)
    assert all(t1.layout.zero_axes[jax.tree_util.keystr(p)] == ("data", "expert") for p, _ in flat
               if jax.tree_util.keystr(p) not in expert)
    rs1, rs0 = group_bytes(c1, "reduce-scatter"), group_bytes(c0, "reduce-scatter")
    assert rs1[8] > 0 and rs1[2] > 0 and rs0[8] == 0, (rs1, rs0)
    assert r1.memory["predicted"]["optimizer"] < r0.memory["predicted"]["optimizer"]
    assert r1.memory["predicted"]["params"] == r0.memory["predicted"]["params"]


def test_axonn_3d_layout_gives_algorithm_1s_collectives():
    """{x 2, y 2, z 2}, dense layers with embed on x and heads/mlp on y: each weight is all-gathered over z
    and its gradient reduce-scattered over z; ordinary layers all-reduce their output over x and their input
    gradient over y (transposed ones the other way); nothing is re-laid between layers (no all-to-all or
    permute). explain() equals the compiled program."""
    trainer = make("x2y2z2", dense=True)
    state = trainer.init_fn(jax.random.key(0))
    batch = jax.device_put(batches(trainer, 1)[0], trainer.batch_sharding)
    report = trainer.explain(state, batch)
    assert_report_matches_hlo(report, hlo_stats(trainer.step_fn, state, batch))
    kinds = Counter((c.kind, c.axes) for c in report.collectives)
    assert kinds[("all-gather", ("z",))] >= 8 and kinds[("reduce-scatter", ("z",))] >= 8, kinds
    assert kinds[("all-reduce", ("x",))] >= 4 and kinds[("all-reduce", ("y",))] >= 4, kinds
    assert not any(k in ("all-to-all", "collective-permute") for k, _ in kinds), kinds
    # the FFN's up projection, ordinary: stored as AxoNN's [in: x, out: (y, z)]
    spec = trainer.layout.stored["params"]["decoder"]["period_0"]["block_0"]["mlp"]["wi_gate"]
    assert tuple(spec) == ("x", ("y", "z"))


def test_a_resume_across_zero_stage_and_mesh_continues_the_same_losses(tmp_path):
    """Checkpoint after 2 steps at stage 0 on {data 2, expert 4}; restore onto stage 3 on {data 8} and run 3
    more: the losses are the uninterrupted run's."""
    data = batches(make(), STEPS)
    first = make("d2e4", zero_stage=0)
    want, _ = run(first, data=data)
    got, state = run(first, data=data[:2])
    ckpt = Checkpoints(str(tmp_path), 1, 100, async_save=False)
    ckpt.save(2, state, force=True)
    second = make("d8", zero_stage=3)
    step, restored = ckpt.restore_latest(second.fresh_state())
    ckpt.close()
    assert step == 2
    table = restored["params"]["params"]["embed"]["embedding"]
    stored = jax.sharding.NamedSharding(second.mesh, second.layout.stored["params"]["embed"]["embedding"])
    assert table.sharding.is_equivalent_to(stored, 2)
    assert "data" in jax.tree.leaves(tuple(table.sharding.spec))  # stage 3: stored split over data
    rest, _ = run(second, state=restored, data=data[2:])
    np.testing.assert_allclose(got + rest, want, rtol=1e-5)


@pytest.mark.parametrize("source,target", [
    ((2, 2), None), pytest.param((4, 2), (2, 2), marks=pytest.mark.slow)], ids=["2x2-to-none", "4x2-to-2x2"])
def test_a_circular_pipeline_checkpoint_resumes_on_other_stage_and_repeat_counts(tmp_path, source, target):
    """Interleaved 1F1B over p stages x 2 repeats stores the stack stage-major (stage s holds layer chunks s
    and s + p). Its checkpoint after 2 steps continues on another stage count (stored otherwise) or without a
    pipeline (in layer order): the losses are the unpipelined run's with the same microbatches."""
    kw = dict(dense=True, model=dict(num_layers=2 * source[0], scan=True), microbatches=4)
    plain = make(dict(data=4, y=2), **kw)
    data = batches(plain, 4)
    want, _ = run(plain, data=data)
    piped = dict(schedule="interleaved_1f1b", repeats=2)
    first = make(dict(stage=source[0], data=8 // source[0]), pipeline=piped, **kw)
    got, state = run(first, data=data[:2])
    trainer = plain if target is None else make(dict(stage=target[0], data=8 // target[0]), pipeline=piped, **kw)
    assert first.layer_order != trainer.layer_order
    # as train() does: each stage-owned end saved as its owner's slice, the stack in its stored order
    ckpt = Checkpoints(str(tmp_path), 1, 100, async_save=False, metadata={"layer_order": first.saved_order})
    ckpt.save(2, first.to_checkpoint(state), force=True)
    step, state = ckpt.restore_latest(trainer.to_checkpoint(trainer.fresh_state()), adapt=trainer.from_checkpoint)
    ckpt.close()
    rest, _ = run(trainer, state=state, data=data[step:])
    np.testing.assert_allclose(got + rest, want, rtol=1e-5)


def test_layout_places_zero_axes_where_they_divide():
    """add_axes: new axes go after those on a dim, on the dim with the most elements per shard, never on the
    stacked-layers dim, one at a time when no dim takes them all, and not at all where nothing divides."""
    mesh = {"data": 2, "expert": 4, "x": 2}
    assert S.add_axes(("x", None), (16, 6), ("data",), mesh) == (("x", "data"), None)
    assert S.add_axes(("x", None), (8, 6), ("data",), mesh) == ("x", "data")  # 6 per shard beats 4
    assert S.add_axes((None, None), (4, 64), ("data", "expert"), mesh) == (None, ("data", "expert"))
    assert S.add_axes((None, None), (4, 64), ("data", "expert"), mesh, avoid=(1,)) == ("data", None)
    assert S.add_axes((None, None), (6, 10), ("data", "expert"), mesh) == (None, "data")
    assert S.add_axes((None,), (3,), ("data",), mesh) == (None,)
    with pytest.raises(ValueError, match="zero_stage=4"):
        S.layout({}, {}, (), mesh, zero_stage=4)


def docs_layout_table():
    """{mesh dict: Counter of (kind, axis)} from docs/models.md's table of FFN collectives per layout."""
    import re
    with open(os.path.join(ROOT, "docs", "models.md")) as f:
        text = f.read()
    table = text[text.index("| mesh | layout | FFN collectives per layer |"):].split("\n\n")[0]
    out = {}
    for line in table.splitlines()[2:]:
        mesh_cell, _, cell = [c.strip() for c in line.strip("|").split("|")]
        mesh = {k: int(v) for k, v in re.findall(r"(\w+) (\d+)", mesh_cell)}
        out[tuple(mesh.items())] = Counter({(k, a): int(n) for k, a, n in re.findall(r"([\w-]+) (\w+) ×(\d+)", cell)})
    return out


def test_the_layout_table_in_the_docs_is_what_explain_reports():
    """docs/models.md's table: per mesh, the collectives explain() puts on the rows of a dense SwiGLU FFN
    (one layer of tiny_dense_lm, zero_stage 0)."""
    table = docs_layout_table()
    assert len(table) == 6
    for mesh, want in table.items():
        cfg = configs.load(os.path.join(ROOT, "experiments", "tiny_dense_lm.py"))
        cfg.mesh.update({**{k: 1 for k in configs.MeshConfig().sizes()}, **dict(mesh)})
        cfg.model.update(dict(num_layers=1, vocab_size=256))
        cfg.train.update(dict(batch_size=16, seq_len=16))
        trainer = train.Trainer(cfg, "/nonexistent")
        state = trainer.fresh_state()
        report = trainer.explain(state, jax.device_put(batches(trainer, 1)[0], trainer.batch_sharding),
                                 compile=False)
        got = Counter((c.kind, "*".join(c.axes)) for r in report.rows if "/mlp" in r.source for c in r.collectives)
        assert got == want, (mesh, got, want)


def test_zero3_gathers_each_scanned_layer_inside_the_loop():
    """Stage 3 with scanned, fully rematerialised layers: each stacked weight is all-gathered one layer at a
    time, once in the forward and again in the backward (remat), and its gradient reduce-scattered a layer at a
    time; a layer's weights are gathered a trip ahead (prefetch.py: the first before the loop). Only the
    unstacked ones (embeddings, final norm) are gathered whole. A layer's gathered weights live only while it
    runs: four more layers add less temp memory than their gathered weights (a tiny model's temporaries are
    mostly activations and layout copies, so their total is no measure). The run equals the unpartitioned one."""
    def explained(layers):
        trainer = make("d8", dense=True, zero_stage=3, model=dict(scan=True, remat="full", num_layers=layers))
        state = trainer.fresh_state()
        return trainer, trainer.explain(state, jax.device_put(batches(trainer, 1)[0], trainer.batch_sharding))

    trainer, report = explained(4)
    stacked = [x for x in jax.tree.leaves(trainer.param_shapes["params"]["decoder"])]
    others = len(jax.tree.leaves(trainer.param_shapes)) - len(stacked)
    # Beside them, the step gathers its non-finite row counts, one int32 per batch shard.
    counts = [c for r in report.rows for c in r.collectives if c.kind == "all-gather" and c.dtype == "int32"]
    assert [(c.shape, c.axes) for c in counts] == [((trainer.shards,), ("data",))], counts
    layers = 4
    per_step = Counter()
    for r in report.rows:
        for c in r.collectives:
            if c not in counts:
                per_step[c.kind] += r.trips
    assert per_step["all-gather"] == 2 * layers * len(stacked) + others, per_step
    assert per_step["reduce-scatter"] == layers * len(stacked) + others, per_step
    ahead = [r for r in report.rows if r.primitive == "prefetch"]  # a first layer's slice, before its loop
    layer_shapes = {tuple(x.shape[1:]) for x in stacked}
    assert ahead and all(tuple(c.shape) in layer_shapes for r in ahead for c in r.collectives)
    outside = [c for r in report.rows if not r.primitive.startswith("scan") and r.primitive != "prefetch"
               for c in r.collectives if c not in counts and c.kind in ("all-gather", "reduce-scatter")]
    assert len(outside) == 2 * others, outside
    deeper = explained(8)[1]
    gathered = (deeper.memory["predicted"]["params"] - report.memory["predicted"]["params"]) * 8  # 4 layers, whole
    grown = deeper.memory["compiled"]["temp"] - report.memory["compiled"]["temp"]
    assert 0 < grown < gathered, (grown, gathered)
    assert_same_run(run(trainer), run(trainer, partitioned=False), 1e-5)
