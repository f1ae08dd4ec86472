"""Checkpointed regions (jax.checkpoint / nn.remat, primitive remat2) survive partitioning.

The region's body is partitioned with the rest of the program and re-emitted
in the per-device program as a checkpoint with the same policy and
prevent_cse, so XLA still rematerialises instead of keeping activations.
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import checkpoint_name

import gshard_jax as gs
from helpers import assert_close, assert_report_matches_hlo, get_mesh, hlo_stats, randn


class Block(nn.Module):
    """An activation-heavy Megatron MLP block: [B, L, D] -> [B, L, D]."""
    d: int = 32

    @nn.compact
    def __call__(self, x_BLD):
        h_BLF = gs.shard(nn.Dense(4 * self.d, use_bias=False)(x_BLD), ("data", None, "model"))
        h_BLF = jnp.tanh(jax.nn.gelu(h_BLF)) * h_BLF
        return gs.shard(x_BLD + nn.Dense(self.d, use_bias=False)(h_BLF), ("data", None, None))


class Stack(nn.Module):
    n: int = 3
    remat: bool = True
    d: int = 32

    @nn.compact
    def __call__(self, x):
        block = nn.remat(Block) if self.remat else Block
        for i in range(self.n):
            x = block(d=self.d, name=f"b{i}")(x)
        return x


class ScannedStack(nn.Module):
    n: int = 3

    @nn.compact
    def __call__(self, x):
        body = nn.scan(nn.remat(lambda mdl, c, _: (Block()(c), None)), variable_axes={"params": 0},
                       split_rngs={"params": True}, length=self.n)
        return body(self, x, None)[0]


def _regions(jaxpr) -> list:
    """The remat2 equations of a jaxpr, nested ones included."""
    out = []
    for e in jaxpr.eqns:
        if e.primitive.name == "remat2":
            out.append(e)
        for p in e.params.values():
            for sub in (p if isinstance(p, (tuple, list)) else [p]):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    out += _regions(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    out += _regions(sub)
    return out


def _grad_case(model, x):
    params = model.init(jax.random.key(0), x)
    loss = lambda p, x: jnp.mean(model.apply(p, gs.shard(x, ("data", None, None))) ** 2)
    return jax.grad(loss), params


@pytest.mark.newest_jax
@pytest.mark.parametrize("model", [Stack(), ScannedStack()], ids=["nn.remat", "nn.scan(nn.remat)"])
def test_flax_remat_grad_is_partitioned_and_rematerialised(model, rng):
    mesh = get_mesh("2x4")
    x = jnp.asarray(randn(rng, 4, 8, 32))
    g, params = _grad_case(model, x)
    f = gs.partition(g, mesh)
    assert_close(f(params, x), g(params, x), rtol=1e-5, atol=1e-6)
    report = gs.explain(g, mesh, params, x)
    assert not report.fallbacks, [r.primitive for r in report.fallbacks]
    rows = [r for r in report.rows if r.primitive.endswith("remat2")]
    assert rows and all(r.strategy.startswith("checkpoint region") for r in rows)
    # The per-device program still holds checkpoint regions, differentiated, with their policy and prevent_cse.
    regions = _regions(jax.make_jaxpr(f)(params, x).jaxpr)
    assert regions and all(e.params["differentiated"] and e.params["prevent_cse"] for e in regions)
    # No more communication than XLA's partitioner on the same program, and no all-gathers of activations.
    ours, xla = hlo_stats(f, params, x), hlo_stats(gs.partition(g, mesh, backend="xla"), params, x)
    assert_report_matches_hlo(report, ours)
    assert sum(s["moved_bytes"] for s in ours.values()) <= sum(s["moved_bytes"] for s in xla.values())


@pytest.mark.parametrize("policy", ["dots_saveable", "save_only_these_names", "nothing_saveable"])
def test_jax_checkpoint_policies_survive(policy, rng):
    mesh = get_mesh("2x4")
    pol = {"dots_saveable": jax.checkpoint_policies.dots_saveable,
           "save_only_these_names": jax.checkpoint_policies.save_only_these_names("hidden"),
           "nothing_saveable": jax.checkpoint_policies.nothing_saveable}[policy]

    @jax.checkpoint
    def unused(x):  # a second region without policy, to check regions are told apart
        return x

    def layer(x, w1, w2):
        h = checkpoint_name(jnp.sin(gs.shard(x @ w1, ("data", "model"))), "hidden")
        return gs.shard(x + h @ w2, ("data", None))

    def loss(ws, x):
        f = jax.checkpoint(layer, policy=pol)
        for w1, w2 in ws:
            x = f(x, w1, w2)
        return jnp.mean(unused(x) ** 2)

    ws = [(randn(rng, 16, 64) / 4, randn(rng, 64, 16) / 8) for _ in range(2)]
    x = randn(rng, 8, 16)
    g = jax.grad(loss)
    f = gs.partition(g, mesh)
    assert_close(f(ws, x), g(ws, x), rtol=1e-5, atol=1e-6)
    assert not gs.explain(g, mesh, ws, x).fallbacks
    policies = {e.params["policy"] for e in _regions(jax.make_jaxpr(f)(ws, x).jaxpr)}
    assert pol in policies
    if policy == "save_only_these_names":  # the name the policy keys on is still in the program
        assert "name[name=hidden]" in str(jax.make_jaxpr(f)(ws, x))


def test_remat_temp_memory_no_more_than_xla(rng):
    """compiled.memory_analysis(): our partitioned grad of a checkpointed stack uses no more temp than XLA's."""
    mesh = get_mesh("2x4")
    x = jnp.asarray(randn(rng, 16, 64, 64))
    g, params = _grad_case(Stack(n=4, d=64), x)
    ours = gs.partition(g, mesh).lower(params, x).compile().memory_analysis().temp_size_in_bytes
    xla = gs.partition(g, mesh, backend="xla").lower(params, x).compile().memory_analysis().temp_size_in_bytes
    assert ours <= xla, (ours, xla)


def test_grad_of_partitioned_checkpoint(rng):
    """jax.grad outside partition(): the emitted (non-differentiated) region is differentiated by JAX."""
    mesh = get_mesh("8")
    w = randn(rng, 16, 16) / 4
    x = randn(rng, 8, 16)
    fn = lambda w, x: jnp.sum(jax.checkpoint(lambda a: jnp.tanh(gs.split(a, 0, 8) @ w))(x) ** 2)
    assert_close(jax.grad(gs.partition(fn, mesh))(w, x), jax.grad(fn)(w, x), rtol=1e-5, atol=1e-6)
    assert np.isfinite(float(gs.partition(fn, mesh)(w, x)))
