"""Gradients of partitioned functions equal those of the unpartitioned function."""
import jax
import jax.numpy as jnp
import optax
from test_collectives import moe_chain, moe_inputs

import gshard_jax as gs
from helpers import assert_close, hlo_counts, randn


def megatron_mlp(x, w1, w2, data="data", model="model"):
    x = gs.shard(x, (data, None))
    h = jax.nn.gelu(gs.shard(x @ gs.shard(w1, (None, model)), (data, model)))
    return gs.shard(h @ gs.shard(w2, (model, None)), (data, None))


def mlp_loss(params, x, y):
    out = megatron_mlp(x, params["w1"], params["w2"])
    return jnp.mean((out - y) ** 2)


def test_grad_of_partitioned_equals_grad(mesh, rng):
    names = tuple(mesh.axis_names)
    data, model = names[0], (names[1:] if len(names) > 1 else None)
    x, w1, w2 = randn(rng, 8, 16), randn(rng, 16, 32) / 4, randn(rng, 32, 16) / 6

    def loss(x, w1, w2):
        return jnp.mean(megatron_mlp(x, w1, w2, data, model) ** 2)

    want = jax.grad(loss, argnums=(0, 1, 2))(x, w1, w2)
    got = jax.grad(gs.partition(loss, mesh), argnums=(0, 1, 2))(x, w1, w2)
    assert_close(got, want, rtol=1e-4, atol=1e-4)
    got2 = gs.partition(jax.grad(loss, argnums=(0, 1, 2)), mesh)(x, w1, w2)
    assert_close(got2, want, rtol=1e-4, atol=1e-4)


def test_grad_of_moe_chain(rng):
    mesh = gs.make_mesh({"x": 8})
    args = moe_inputs(rng)

    def loss(x, wi, wo):
        return jnp.sum(moe_chain(args[0], args[1], x, wi, wo) ** 2)

    want = jax.grad(loss, argnums=(0, 1, 2))(*args[2:])
    f = gs.partition(jax.grad(loss, argnums=(0, 1, 2)), mesh)
    assert_close(f(*args[2:]), want, rtol=1e-4, atol=1e-4)
    got = jax.grad(gs.partition(loss, mesh), argnums=(0, 1, 2))(*args[2:])
    assert_close(got, want, rtol=1e-4, atol=1e-4)
    # forward 2 all-to-alls, backward 2 more (the cotangents keep the annotations).
    assert hlo_counts(f, *args[2:]).get("all-to-all") == 4


def test_annotation_cotangent_keeps_sharding():
    from gshard_jax.annotations import active, sharding_annotation_p
    mesh = gs.make_mesh({"x": 8})
    with active(mesh, "gshard"):
        jaxpr = jax.make_jaxpr(jax.grad(lambda x: jnp.sum(gs.split(x, 0, 8) ** 2)))(jnp.ones((8, 2)))
    anns = [e for e in jaxpr.eqns if e.primitive is sharding_annotation_p]
    assert len(anns) == 2 and anns[0].params["sharding"] == anns[1].params["sharding"]


def test_mlp_train_step_with_optax(rng):
    mesh = gs.make_mesh({"data": 2, "model": 4})
    opt = optax.adamw(1e-2)
    params = {"w1": randn(rng, 16, 32) * 0.3, "w2": randn(rng, 32, 16) * 0.3}
    x, y = randn(rng, 8, 16), randn(rng, 8, 16)

    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(mlp_loss)(params, x, y)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    ref_p, ref_s = params, opt.init(params)
    got_p, got_s = params, opt.init(params)
    pstep = gs.partition(step, mesh)
    for _ in range(3):
        ref_p, ref_s, ref_loss = jax.jit(step)(ref_p, ref_s, x, y)
        got_p, got_s, got_loss = pstep(got_p, got_s, x, y)
        assert_close(got_loss, ref_loss, rtol=1e-5, atol=1e-6)
        assert_close(got_p, ref_p, rtol=1e-4, atol=1e-5)
    assert float(got_loss) < float(jax.jit(mlp_loss)(params, x, y))
    report = gs.explain(step, mesh, params, opt.init(params), x, y)
    assert not report.fallbacks, [r.primitive for r in report.fallbacks]


def test_plan_is_made_after_dead_code_elimination(rng):
    """grad() drops the forward loss: its all-reduce is neither planned nor reported, as in the HLO."""
    mesh = gs.make_mesh({"data": 2, "model": 4})
    x, w1, w2 = randn(rng, 8, 16), randn(rng, 16, 32), randn(rng, 32, 16)
    g = jax.grad(lambda x, w1, w2: jnp.sum(megatron_mlp(x, w1, w2) ** 2), argnums=(1, 2))
    report = gs.explain(g, mesh, x, w1, w2)
    assert not [r for r in report.rows if r.primitive == "reduce_sum" and r.collectives]
    assert report.totals()["all-reduce"]["count"] == hlo_counts(gs.partition(g, mesh), x, w1, w2)["all-reduce"] == 3
