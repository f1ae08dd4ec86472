"""Flax linen's built-in layers and optax's optimizers, partitioned with no fallback.

Each case is a real train step (value_and_grad of a Flax model, an optax
update) under data-parallel or Megatron annotations. It must run with no
fallback row in explain(), give the unpartitioned numbers, and move no more
bytes per device than XLA's partitioner on the same program.
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gshard_jax as gs
from helpers import assert_report_matches_hlo, get_mesh, hlo_stats

B, L, D = 8, 16, 32


class Cell(nn.Module):
    @nn.compact
    def __call__(self, c, _):
        return jnp.tanh(nn.Dense(D)(c)), None


class Case(nn.Module):
    """A Dense ("pre") followed by one library layer, on x_BLD."""
    layer: str

    @nn.compact
    def __call__(self, x_BLD):
        x_BLD = nn.Dense(D, name="pre")(x_BLD)
        k = self.layer
        if k == "Dense":
            return nn.Dense(64)(x_BLD)
        if k == "DenseGeneral":
            return nn.DenseGeneral((4, 8), axis=-1)(x_BLD).reshape(x_BLD.shape)
        if k == "Embed":
            ids_BL = (jnp.abs(x_BLD[..., 0]) * 10).astype(jnp.int32) % 50
            embed = nn.Embed(50, D)
            return embed(ids_BL) + embed.attend(x_BLD)[..., :D]
        if k == "MultiHeadDotProductAttention":
            mask = nn.make_causal_mask(x_BLD[..., 0])
            return nn.MultiHeadDotProductAttention(num_heads=4, qkv_features=D)(x_BLD, x_BLD, mask=mask)
        if k == "split_attention":  # q, k, v = jnp.split(qkv, 3, -1), as many LMs write it
            q, kk, v = jnp.split(nn.Dense(3 * D)(x_BLD), 3, -1)
            heads = lambda t: t.reshape(t.shape[:-1] + (4, D // 4))
            o = nn.dot_product_attention(heads(q), heads(kk), heads(v), mask=nn.make_causal_mask(x_BLD[..., 0]))
            return nn.Dense(D)(o.reshape(x_BLD.shape))
        if k == "LayerNorm":
            return nn.LayerNorm()(x_BLD)
        if k == "RMSNorm":
            return nn.RMSNorm()(x_BLD)
        if k == "GroupNorm":
            return nn.GroupNorm(num_groups=4)(x_BLD)
        if k == "BatchNorm":
            return nn.BatchNorm(use_running_average=False)(x_BLD)
        if k == "Dropout":
            return nn.Dropout(0.5, deterministic=False)(x_BLD)
        if k == "remat":
            return nn.remat(nn.Dense)(D)(x_BLD)
        if k == "scan":
            return nn.scan(Cell, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)()(x_BLD, None)[0]
        raise ValueError(k)


LAYERS = ["Dense", "DenseGeneral", "Embed", "MultiHeadDotProductAttention", "split_attention", "LayerNorm",
          "RMSNorm", "GroupNorm", "BatchNorm", "Dropout", "remat", "scan"]
OPTIMIZERS = {
    "adamw": lambda: optax.adamw(1e-3),
    "adafactor": lambda: optax.adafactor(1e-3),
    "lion": lambda: optax.lion(1e-4),
    "lamb": lambda: optax.lamb(1e-3),
    "sgd_momentum": lambda: optax.sgd(1e-2, momentum=0.9),
    "clip_adam_schedule": lambda: optax.chain(optax.clip_by_global_norm(1.0),
                                              optax.adam(optax.warmup_cosine_decay_schedule(0.0, 1e-3, 10, 100))),
}


def megatron(params):
    """The first Dense column-split, later kernels (and the embedding) row-split over "model"."""
    def spec(path, leaf):
        names = [getattr(k, "key", str(k)) for k in path]
        if leaf.ndim < 2 or not {"kernel", "embedding"} & set(names):
            return None
        if "pre" in names:
            return (None,) * (leaf.ndim - 1) + ("model",)
        return (None,) * (leaf.ndim - 2) + ("model", None) if leaf.shape[-2] % 4 == 0 else None
    return jax.tree_util.tree_map_with_path(spec, params)


def train_step(layer: str, optimizer: str):
    model, opt = Case(layer), OPTIMIZERS[optimizer]()
    x = jnp.asarray(np.random.default_rng(0).standard_normal((B, L, D)), jnp.float32)
    variables = model.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, x)
    params, state = variables["params"], {k: v for k, v in variables.items() if k != "params"}

    def step(params, opt_state, x, rng):
        def loss(p):
            y, _ = model.apply({"params": p, **state}, gs.shard(x, ("data", None, None)), rngs={"dropout": rng},
                               mutable=list(state))
            return jnp.mean(y ** 2)
        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value, grads

    return step, (params, opt.init(params), x, jax.random.key(2))


def check_case(layer: str, optimizer: str, annotation: str):
    mesh = get_mesh("2x4")
    step, args = train_step(layer, optimizer)
    ins = (megatron(args[0]), None, None, None) if annotation == "megatron" else None
    report = gs.explain(step, mesh, *args, in_shardings=ins)
    assert not report.fallbacks, [(r.primitive, r.source) for r in report.fallbacks]
    ours_fn = gs.partition(step, mesh, in_shardings=ins)
    xla_fn = gs.partition(step, mesh, in_shardings=ins, backend="xla")
    want, got, ref = jax.jit(step)(*args), ours_fn(*args), xla_fn(*args)
    for w, g, r in zip(jax.tree.leaves(want), jax.tree.leaves(got), jax.tree.leaves(ref)):
        w, g, r = np.asarray(w, np.float64), np.asarray(g, np.float64), np.asarray(r, np.float64)
        # Adaptive optimizers divide by tiny second moments, so summation order shows in the update;
        # XLA's partitioner deviates from the unpartitioned step by the same amount. Allow no more.
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6 + 2 * np.max(np.abs(r - w), initial=0))
    ours, xla = hlo_stats(ours_fn, *args), hlo_stats(xla_fn, *args)
    assert_report_matches_hlo(report, ours)
    moved = lambda s: sum(v["moved_bytes"] for v in s.values())
    assert moved(ours) <= moved(xla) + 8, (moved(ours), moved(xla))  # +8: a scalar all-reduce's rounding


# Default suite: every layer under both annotations, the optimizers taken in turn.
FAST = [(layer, list(OPTIMIZERS)[i % len(OPTIMIZERS)], ann) for i, layer in enumerate(LAYERS)
        for ann in ("data", "megatron")]


@pytest.mark.parametrize("layer,optimizer,annotation", [  # the scanned and tanh-using layers run on the newest JAX too
    pytest.param(*c, marks=pytest.mark.newest_jax if c[0] in ("scan", "Embed") else ()) for c in FAST],
    ids=["-".join(c) for c in FAST])
def test_library_train_step(layer, optimizer, annotation):
    check_case(layer, optimizer, annotation)


ALL = [(layer, opt, ann) for layer in LAYERS for opt in OPTIMIZERS for ann in ("data", "megatron")
       if (layer, opt, ann) not in FAST]


@pytest.mark.slow
@pytest.mark.parametrize("layer,optimizer,annotation", ALL, ids=["-".join(c) for c in ALL])
def test_library_train_step_every_optimizer(layer, optimizer, annotation):
    check_case(layer, optimizer, annotation)


def test_user_idioms_run_without_fallback():
    """jnp.take(mode=...), jnp.pad(mode="edge"), .at[].add and jnp.roll: no fallback, same numbers."""
    mesh = get_mesh("2x4")
    x = jnp.asarray(np.random.default_rng(1).standard_normal((B, L, D)), jnp.float32)

    def fn(x):
        x = gs.shard(x, ("data", None, "model"))
        ids = (jnp.abs(x[0, :, 0]) * 10).astype(jnp.int32)
        t = jnp.take(x, ids % 40 - 3, axis=1, mode="clip") + jnp.take(x, ids, axis=1, mode="wrap")
        p = jnp.pad(t, ((0, 0), (1, 1), (0, 0)), mode="edge")[:, :-2]
        return p.at[:, 0].add(x[:, -1]) + jnp.roll(x, 1, axis=1)

    assert not gs.explain(fn, mesh, x).fallbacks
    np.testing.assert_allclose(gs.partition(fn, mesh)(x), fn(x), rtol=1e-6, atol=1e-6)


def test_flax_cnn_train_step_partitions(rng):
    """Flax nn.Conv + avg_pool + max_pool + Dense, data-parallel and spatially split, under jax.grad:
    equal numbers, no fallback, no more bytes than XLA's partitioner when data-parallel."""
    mesh = get_mesh("2x4")

    class CNN(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Conv(8, (3, 3))(x))
            x = nn.avg_pool(x, (2, 2), (2, 2))
            x = nn.relu(nn.Conv(8, (3, 3), feature_group_count=2)(x))
            x = nn.max_pool(x, (2, 2), (2, 2))
            return nn.Dense(4)(x.reshape(x.shape[0], -1))

    model = CNN()
    x = jnp.asarray(rng.integers(-2, 3, (8, 32, 32, 4)), jnp.float32)
    params = model.init(jax.random.key(0), x)
    for spec in (("data", None, None, None), ("data", "model", None, None)):
        def loss(p, x, spec=spec):
            return jnp.sum(model.apply(p, gs.shard(x, spec)) ** 2)
        fn = jax.grad(loss)
        report = gs.explain(fn, mesh, params, x)
        assert not report.fallbacks, report
        ours, ref = gs.partition(fn, mesh)(params, x), fn(params, x)
        for a, b in zip(jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(ref)):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * float(jnp.max(jnp.abs(b))))
        mine = hlo_stats(gs.partition(fn, mesh), params, x)
        xla = hlo_stats(gs.partition(fn, mesh, backend="xla"), params, x)
        assert_report_matches_hlo(report, mine)
        if spec[1] is None:  # data parallel: convolutions and pooling move nothing, only the gradients
            assert sum(v["moved_bytes"] for v in mine.values()) <= sum(v["moved_bytes"] for v in xla.values())


def test_key_idioms_run_without_fallback():
    """jax.random.key inside the function (random_seed), jax.random.clone (nn.scan's init uses it), a key per
    row from sharded seeds: no fallback, the same keys and bits, explain() equal to the HLO."""
    mesh = get_mesh("2x4")
    seeds = jnp.arange(16, dtype=jnp.int32)

    def fn(seeds):
        keys = jax.vmap(jax.random.key)(gs.shard(seeds, ("data",)))
        rows = jax.random.key_data(jax.random.clone(keys))
        bits = jax.random.bits(jax.random.clone(jax.random.key(7)), (16, 8))
        return rows, gs.shard(bits, ("data", "model"))

    report = gs.explain(fn, mesh, seeds)
    assert not report.fallbacks, [(r.primitive, r.source) for r in report.fallbacks]
    part = gs.partition(fn, mesh)
    for w, g in zip(fn(seeds), part(seeds)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    assert_report_matches_hlo(report, hlo_stats(part, seeds))
