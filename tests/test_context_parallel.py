"""Context parallelism in the models: the rules map `length` to the `context` mesh axis, the LM holds its
sequence in zigzag order there, and its self-attention runs as ring attention. The loss and every gradient
equal the unsplit model's; the compiled step moves K/V only by collective-permute."""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

import gshard_jax as gs
from gshard_jax.models import layers, transformer as T
from gshard_jax.models.moe import MoeConfig
from helpers import assert_close, hlo_stats

L = 64  # 2 x 4 zigzag chunks of 8 on context 4


def tiny(**kw) -> T.TransformerConfig:
    return T.TransformerConfig(vocab_size=64, d_model=32, num_heads=4, head_dim=8, d_ff=64, num_layers=2, **kw)


def batch(seed: int = 0, B: int = 4) -> dict:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, 64, (B, L + 1)).astype(np.int32)
    w = (rng.random((B, L)) < 0.8).astype(np.float32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "weights": w}


def step_fns(cfg):
    model = T.DecoderLM(cfg)
    b = batch()
    params = model.init(jax.random.key(0), b["inputs"])
    grad = jax.value_and_grad(lambda p, b: T.loss_fn(model, p, b)[0])
    return grad, params, b


@pytest.mark.parametrize("variant", ["dense_rope", "sinusoid_tied", "moe", "sequence_parallel"])
def test_the_lm_over_a_context_axis_equals_the_unsplit_lm(variant):
    cfg = {"dense_rope": tiny(), "sinusoid_tied": tiny(rope=False, tie_embeddings=True),
           "moe": tiny(moe=MoeConfig(num_experts=4, d_ff=64)), "sequence_parallel": tiny(sequence_parallel=True)
           }[variant]
    mesh = gs.make_mesh({"data": 2, "context": 4} if variant != "sequence_parallel" else
                        {"context": 2, "y": 4})
    grad, params, b = step_fns(cfg)
    want = jax.jit(grad)(params, b)
    got = gs.partition(grad, mesh)(params, b)
    assert_close(got, want, rtol=2e-5, atol=2e-6)


def test_the_step_moves_k_and_v_by_permutes_only():
    """{context 8}: the ring's permutes, and no all-gather of a sequence-long K or V."""
    cfg = tiny()
    grad, params, b = step_fns(cfg)
    mesh = gs.make_mesh({"context": 8})
    f = gs.partition(grad, mesh)
    stats = hlo_stats(f, params, b)
    assert stats["collective-permute"]["count"] > 0
    report = gs.explain(grad, mesh, params, b)
    rings = [r for r in report.rows if r.primitive == "shard_map"]
    assert len(rings) == 2 * cfg.num_layers  # each layer's forward ring and its custom backward
    assert all(c.kind == "collective-permute" for r in rings for c in r.collectives)
    # nothing outside the rings gathers an activation of the whole sequence: [B, L, H, K] or [B, L, D]
    sequence_long = [c for r in report.rows if r.primitive != "shard_map" for c in r.collectives
                     if c.kind == "all-gather" and len(c.shape) >= 3 and L in c.shape]
    assert not sequence_long, sequence_long


def test_the_zigzag_moves_nothing():
    """The tokens, targets and positions in zigzag order cost no communication: the positions are computed
    elementwise from an iota, each device takes its tokens from the sequences it holds. Every permute and
    all-to-all of the step is in a ring."""
    grad, params, b = step_fns(tiny())
    report = gs.explain(grad, gs.make_mesh({"data": 2, "context": 4}), params, b)
    outside = [(r.source, c.kind) for r in report.rows if r.primitive != "shard_map" for c in r.collectives
               if c.kind in ("collective-permute", "all-to-all")]
    assert not outside, outside


def test_zigzag_order_positions_and_errors():
    mesh = gs.make_mesh({"data": 2, "context": 4})
    rules = tiny().rules

    def inside(x):
        assert layers.context_split(rules) == ("context", 4)
        return layers.in_context_order(x, rules), layers.positions(L, rules)

    x = np.arange(2 * L, dtype=np.int32).reshape(2, L)
    got, pos = gs.partition(inside, mesh)(x)
    assert np.array_equal(np.asarray(got)[0], np.asarray(pos))  # the tokens sit at their positions
    assert sorted(np.asarray(pos).tolist()) == list(range(L))
    assert layers.context_split(rules) == (None, 1)  # outside a partition: unsplit
    bad = dataclasses.replace(tiny(), rules=tuple(r if r[0] != "length" else ("length", ("data", "context"))
                                                  for r in tiny().rules))
    grad, params, b = step_fns(bad)
    with pytest.raises(ValueError, match="one mesh axis"):
        gs.partition(grad, gs.make_mesh({"data": 2, "context": 4}))(params, b)


def _cli_losses(tmp_path, name, experiment, seq, mesh, extra=(), steps=3):
    """Per-step losses of `gshard-jax train` on `mesh` (8 CPU devices) at `seq` tokens per sequence."""
    import json
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    workdir = tmp_path / name
    sizes = [f"--config.mesh.{a}={n}" for a, n in {"data": 1, "expert": 1, **mesh}.items()]
    p = subprocess.run([sys.executable, "-m", "gshard_jax.cli", "train", "--config",
                        os.path.join(root, "experiments", experiment), "--cpu-devices", "8", "--workdir",
                        str(workdir), "--no-progress", f"--config.data.dir={tmp_path / 'data'}",
                        "--config.data.max_bytes=1500000", f"--config.train.seq_len={seq}",
                        f"--config.train.num_steps={steps}", "--config.train.log_every=1",
                        "--config.train.eval_every=1000", *sizes, *extra], capture_output=True, text=True, cwd=root,
                       timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    with open(workdir / "metrics.jsonl") as f:
        return [json.loads(line)["loss"] for line in f if '"loss"' in line]


# The MoE routes groups of 256 tokens: a zigzag chunk at 2,048 tokens over context 4, so both runs route the
# same groups, and a group stays on one device (one group per 2,048-token sequence would hold its GSEC
# dispatch tensors on every device of the sequence: 24 GB here).
MOE_GROUPS = ("--config.model.moe.group_size=256",)


@pytest.mark.parametrize("experiment,seq,extra", [
    ("tiny_dense_lm.py", 256, ()),
    pytest.param("tiny_dense_lm.py", 2048, (), marks=pytest.mark.slow),
    pytest.param("tiny_moe_lm.py", 2048, MOE_GROUPS, marks=pytest.mark.slow)])
def test_the_cli_trains_over_a_context_axis_to_the_unsplit_losses(tmp_path, experiment, seq, extra):
    """--config.mesh.context=4: the same losses as the run with each sequence whole on its device."""
    split = _cli_losses(tmp_path, "context", experiment, seq, {"data": 2, "context": 4}, extra)
    whole = _cli_losses(tmp_path, "whole", experiment, seq, {"data": 8}, extra)
    assert len(split) == 3
    assert split == pytest.approx(whole, rel=1e-5)
