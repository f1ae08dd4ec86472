"""The MoE layer (models/moe.py, models/dropless.py): dropless equals capacity routing, and both partition
faithfully with the collectives GShard predicts."""
import dataclasses
import itertools
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gshard_jax as gs
from gshard_jax.models.gating import GatingConfig
from gshard_jax.models.grouped import block_rows, grouped_matmul
from gshard_jax.models.logical import DEFAULT_RULES
from gshard_jax.models.moe import MoeConfig, MoeFFN
from helpers import assert_close, assert_report_matches_hlo, hlo_stats, ragged_all_to_all_emulated_on_cpu

RULES = DEFAULT_RULES  # the models' own table: axes these meshes lack drop out of it
AMPLE = GatingConfig(k=2, capacity_factor=8.0, min_capacity=1, second_policy="all")


def layer(rng_seed=1, shape=(4, 16, 24), **kw):
    cfg = MoeConfig(num_experts=8, d_ff=32, gating=kw.pop("gating", AMPLE), **kw)
    m = MoeFFN(cfg, RULES)
    x = jax.random.normal(jax.random.key(0), shape)
    return m, nn.unbox(m.init(jax.random.key(rng_seed), x)), x


def loss(m):
    def f(params, x):
        y, losses, _ = m.apply(params, x)
        return jnp.sum(y ** 2) + 0.01 * losses["aux_loss"] + 0.001 * losses["z_loss"]
    return f


DROPLESS_CASES = [(k, normalize, activation, matmul) for (k, normalize), activation, matmul in itertools.product(
    ((1, "none"), (2, "before_drop"), (8, "after_drop")), ("relu", "swiglu"), ("blocked", "ragged_dot"))]
# every k, activation and grouped matmul once in the default suite; all of them with -m slow (~8 s each)
DROPLESS_DEFAULT = {(1, "none", "relu", "blocked"), (2, "before_drop", "swiglu", "ragged_dot"),
                    (8, "after_drop", "swiglu", "blocked")}


@pytest.mark.parametrize("k,normalize,activation,matmul", [
    pytest.param(*c, marks=() if c in DROPLESS_DEFAULT else pytest.mark.slow, id="-".join(map(str, c)))
    for c in DROPLESS_CASES])
def test_dropless_equals_capacity_routing_with_ample_capacity(activation, k, normalize, matmul):
    g = GatingConfig(k=k, capacity_factor=8.0, min_capacity=1, second_policy="all", normalize=normalize)
    m, params, x = layer(gating=g, activation=activation)
    md = MoeFFN(dataclasses.replace(m.cfg, dispatch="dropless", grouped_matmul=matmul), RULES)
    y, losses, stats = m.apply(params, x)
    yd, losses_d, stats_d = md.apply(params, x)
    assert float(stats["dropped"]) == 0.0 and float(stats_d["dropped"]) == 0.0
    assert_close(yd, y, rtol=1e-5, atol=1e-5)
    assert_close(losses_d, losses)
    assert_close(jax.grad(loss(md))(params, x), jax.grad(loss(m))(params, x), rtol=1e-4, atol=1e-5)


def test_groups_padded_to_fit_leave_the_result_unchanged():
    """32 tokens in groups of 5 (7 groups, 3 padding tokens): padding takes no slot and no loss share."""
    m, params, x = layer(shape=(2, 16, 24), group_size=5)
    y, losses, _ = m.apply(params, x)
    dropless = MoeFFN(dataclasses.replace(m.cfg, group_size=None, dispatch="dropless"), RULES)
    ref, ref_losses, _ = dropless.apply(params, x)
    assert_close(y, ref)
    np.testing.assert_allclose(losses["z_loss"], ref_losses["z_loss"], rtol=1e-5)


def test_capacity_drops_send_tokens_through_as_zero():
    g = GatingConfig(k=1, capacity_factor=0.25, min_capacity=1, normalize="none")
    m, params, x = layer(gating=g)
    y, _, stats = m.apply(params, x)
    assert float(stats["dropped"]) > 0.3
    zero_rows = np.asarray(jnp.all(y == 0, axis=-1)).mean()
    np.testing.assert_allclose(zero_rows, float(stats["dropped"]), atol=1e-6)


@pytest.mark.parametrize("routing", ["expert_choice", "forced_uniform"])
def test_other_routings_run_in_the_layer(routing):
    g = GatingConfig(k=2, capacity_factor=1.0, min_capacity=1, second_policy="all", routing=routing)
    m, params, x = layer(gating=g)
    y, _, stats = m.apply(params, x)
    assert y.shape == x.shape and bool(jnp.all(jnp.isfinite(y)))
    np.testing.assert_allclose(stats["expert_usage"], np.full(8, 1 / 8), rtol=1e-6)


def test_jitter_and_random_routing_draw_from_the_gating_rng_only_in_training():
    g = GatingConfig(k=2, capacity_factor=8.0, min_capacity=1, second_policy="random")
    m, params, x = layer(gating=g, router_jitter=0.1)
    a = m.apply(params, x, train=True, rngs={"gating": jax.random.key(1)})[0]
    b = m.apply(params, x, train=True, rngs={"gating": jax.random.key(2)})[0]
    assert float(jnp.max(jnp.abs(a - b))) > 0
    e1, e2 = m.apply(params, x)[0], m.apply(params, x)[0]
    np.testing.assert_array_equal(e1, e2)
    with pytest.raises(Exception, match="gating"):
        m.apply(params, x, train=True)


def test_bad_layer_configs_are_named():
    with pytest.raises(ValueError, match="MoeConfig.activation"):
        layer(activation="gelu")
    with pytest.raises(ValueError, match="MoeConfig.exchange"):
        layer(dispatch="dropless", exchange="gossip")
    with pytest.raises(ValueError, match="MoeConfig.grouped_matmul='dense'"):
        layer(dispatch="dropless", grouped_matmul="dense")
    with pytest.raises(ValueError, match="expert_choice"):
        layer(dispatch="dropless", gating=dataclasses.replace(AMPLE, routing="expert_choice"))


# --------------------------------------------------------------------------- partitioned

MESHES = {"e8": {"expert": 8}, "d2e4": {"data": 2, "expert": 4}, "d2e2m2": {"data": 2, "expert": 2, "model": 2}}


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_einsum_layer_partitions_with_exactly_two_all_to_alls(mesh_name):
    """GShard's prediction: G split in, E split between, one all-to-all each way in the forward pass;
    forward and grad equal the unpartitioned layer and explain() equals the compiled HLO."""
    mesh = gs.make_mesh(MESHES[mesh_name])
    g = GatingConfig(k=2, capacity_factor=2.0, min_capacity=1, second_policy="all")
    m, params, x = layer(shape=(8, 16, 24), gating=g)
    fwd = lambda p, x: m.apply(p, x)[0]
    pf = gs.partition(fwd, mesh)
    assert_close(pf(params, x), fwd(params, x))
    stats = hlo_stats(pf, params, x)
    assert stats["all-to-all"]["count"] == 2
    expert_axis = "expert"
    report = gs.explain(fwd, mesh, params, x)
    assert report.fallbacks == []
    assert [c.axes for r in report.rows for c in r.collectives if c.kind == "all-to-all"] == [(expert_axis,)] * 2
    assert_report_matches_hlo(report, stats)
    vg = jax.value_and_grad(loss(m))
    pg = gs.partition(vg, mesh)
    assert_close(pg(params, x), vg(params, x), rtol=1e-4, atol=1e-4)
    assert_report_matches_hlo(gs.explain(vg, mesh, params, x), hlo_stats(pg, params, x))


@pytest.mark.parametrize("exchange", ["all_to_all", "all_gather"])
@pytest.mark.parametrize("mesh_name", ["e8", "d2e2m2"])
def test_dropless_layer_partitions_under_expert_parallelism(exchange, mesh_name):
    mesh = gs.make_mesh(MESHES[mesh_name])
    m, params, x = layer(shape=(8, 16, 24), dispatch="dropless", exchange=exchange,
                         gating=dataclasses.replace(AMPLE, capacity_factor=1.0))
    vg = jax.value_and_grad(loss(m))
    pg = gs.partition(vg, mesh)
    assert_close(pg(params, x), vg(params, x), rtol=1e-4, atol=1e-4)
    stats = hlo_stats(pg, params, x)
    kind = "all-to-all" if exchange == "all_to_all" else "all-gather"
    assert stats[kind]["count"] > 0
    report = gs.explain(vg, mesh, params, x)
    assert report.fallbacks == []
    assert_report_matches_hlo(report, stats)
    # Same numbers under XLA's partitioner.
    assert_close(gs.partition(vg, mesh, backend="xla")(params, x), vg(params, x), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("exchange", ["all_to_all", pytest.param("all_gather", marks=pytest.mark.slow)])
def test_dropless_tokens_stay_as_laid_under_context_parallelism(exchange):
    """Sequences split over context (the activations' [batch, length] layout) and 3 sequences per data shard:
    the region takes the tokens as they lie. Merging the split length into the batch's split would gather
    every token of the layer; instead the layer moves only its exchange over expert, the expert gradients
    reduced once over data and context, and scalars."""
    from gshard_jax.models.logical import constrain
    mesh = gs.make_mesh({"data": 2, "expert": 2, "context": 2})
    m, params, x = layer(shape=(12, 16, 24), dispatch="dropless", exchange=exchange,
                         gating=dataclasses.replace(AMPLE, capacity_factor=1.0))

    def f(params, x):
        x = constrain(x, ("batch", "length", "embed"), RULES)  # as the model's residual stream lies
        y, losses, _ = m.apply(params, x)
        y = constrain(y, ("batch", "length", "embed"), RULES)
        return jnp.sum(y ** 2) + 0.01 * losses["aux_loss"] + 0.001 * losses["z_loss"]
    vg = jax.value_and_grad(f)
    pg = gs.partition(vg, mesh)
    assert_close(pg(params, x), vg(params, x), rtol=1e-4, atol=1e-4)
    report = gs.explain(vg, mesh, params, x)
    assert report.fallbacks == []
    assert_report_matches_hlo(report, hlo_stats(pg, params, x))
    moved = {}
    for r in report.rows:
        for c in r.collectives:
            moved[(c.kind, c.axes)] = moved.get((c.kind, c.axes), 0) + c.moved * r.trips * c.runs
    expert_weights = sum(v.size for k, v in params["params"].items() if k != "router") * 4  # float32
    exchange_kind = "all-to-all" if exchange == "all_to_all" else "all-gather"
    assert moved.pop((exchange_kind, ("expert",))) > 0
    if exchange == "all_gather":
        assert moved.pop(("reduce-scatter", ("expert",))) > 0
    assert moved.pop(("all-reduce", ("data", "context"))) == pytest.approx(expert_weights / 2 * 2 * 3 / 4)
    router = params["params"]["router"]["kernel"].size * 4  # its gradient, summed over every token axis
    assert moved.pop(("all-reduce", ("data", "expert", "context"))) == pytest.approx(router * 2 * 7 / 8, abs=32)
    tokens = x.size * 4 / 8  # one device's block of the layer's input, float32
    assert all(kind == "all-reduce" and v < tokens / 10 for (kind, _), v in moved.items()), moved  # scalars


def test_dropless_peer_bound_counts_what_it_drops():
    """A per-peer buffer smaller than the load drops assignments and says how many; no bound drops none."""
    mesh = gs.make_mesh(MESHES["e8"])
    skewed = GatingConfig(k=1, capacity_factor=1.0, min_capacity=1, normalize="none")
    m, params, x = layer(shape=(8, 16, 24), dispatch="dropless", gating=skewed, peer_bound=0.5)
    params = jax.tree_util.tree_map(lambda a: a, params)
    params["params"]["router"]["kernel"] = params["params"]["router"]["kernel"].at[:, 0].add(5.0)
    f = lambda p, x: m.apply(p, x)[2]["dropped"]
    dropped = float(gs.partition(f, mesh)(params, x))
    assert dropped > 0.3
    unbounded = MoeFFN(dataclasses.replace(m.cfg, peer_bound=None), RULES)
    assert float(gs.partition(lambda p, x: unbounded.apply(p, x)[2]["dropped"], mesh)(params, x)) == 0.0


@pytest.mark.parametrize("mesh_name", ["e8", "d2e2m2"])
def test_dropless_ragged_exchange_offsets_with_an_emulated_collective(mesh_name):
    """The ragged exchange's offsets and sizes (there and back) give the local result, forward and grad, and a
    peer bound drops what overflows; the collective is lowered by an emulation because XLA:CPU has no
    ragged-all-to-all."""
    with ragged_all_to_all_emulated_on_cpu():
        _ragged_exchange_case(mesh_name)


def _ragged_exchange_case(mesh_name):
    mesh = gs.make_mesh(MESHES[mesh_name])
    m, params, x = layer(shape=(8, 16, 24), dispatch="dropless", exchange="ragged",
                         gating=dataclasses.replace(AMPLE, capacity_factor=1.0))
    vg = jax.value_and_grad(loss(m))
    assert_close(gs.partition(vg, mesh)(params, x), vg(params, x), rtol=1e-4, atol=1e-4)
    skewed = GatingConfig(k=1, capacity_factor=1.0, min_capacity=1, normalize="none")
    m, params, x = layer(shape=(8, 16, 24), dispatch="dropless", exchange="ragged", gating=skewed, peer_bound=0.5)
    params["params"]["router"]["kernel"] = params["params"]["router"]["kernel"].at[:, 0].add(5.0)
    bounded = float(gs.partition(lambda p, x: m.apply(p, x)[2]["dropped"], mesh)(params, x))
    ref = MoeFFN(dataclasses.replace(m.cfg, exchange="all_to_all"), RULES)
    assert bounded == float(gs.partition(lambda p, x: ref.apply(p, x)[2]["dropped"], mesh)(params, x)) > 0.3


@pytest.mark.parametrize("spmd", [True, False], ids=["stage_vmap", "plain_vmap"])
def test_ragged_all_to_all_batches_with_unbatched_offsets(spmd):
    """A pipeline's stage vmap over a ragged exchange whose receive offsets come from axis_index (not batched):
    JAX's rule asserted; partitioner/representation/jax_compat.py's broadcasts them, and every batch element
    (one per device under the stage axis, two per device under a plain vmap) swaps its own rows."""
    from jax.sharding import PartitionSpec as P
    mesh = jax.make_mesh((2, 4), ("stage", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 2)  # as the
    # partitioner runs a per-device program (under Explicit axes the emulation's slices of a batched dim fail)

    def body(x_RM):  # each peer gets 2 of my 8 rows: rows 2j, 2j+1 to peer j, written at 2 * my index
        me = jax.lax.axis_index("expert")
        sizes = jnp.full((4,), 2, jnp.int32)
        return jax.lax.ragged_all_to_all(x_RM, jnp.zeros_like(x_RM), jnp.arange(4, dtype=jnp.int32) * 2, sizes,
                                         jnp.full((4,), me * 2, jnp.int32), sizes, axis_name="expert")
    f = jax.shard_map(body, mesh=mesh, in_specs=P("expert"), out_specs=P("expert"))
    vf = jax.vmap(f, spmd_axis_name="stage") if spmd else jax.vmap(f)
    x = np.arange(2 * 32 * 3, dtype=np.float32).reshape(2, 32, 3)
    with ragged_all_to_all_emulated_on_cpu():
        got = np.asarray(jax.jit(vf)(x))
    # device d's block of each batch element: from peer p, p's rows 2d and 2d + 1, at 2p
    want = x.reshape(2, 4, 4, 2, 3).transpose(0, 2, 1, 3, 4).reshape(2, 32, 3)
    np.testing.assert_array_equal(got, want)


def test_the_ragged_exchange_moves_the_routed_rows_and_auto_picks_it_where_the_backend_has_it():
    """explain() counts what each form moves: the dense all-to-all sends each of the 4 peers a buffer of every
    local row (k x tokens / 8 shards), the ragged one each row once (the router's balance: k x tokens / peers
    per peer), and says so; "auto" is ragged on GPU and TPU and the dense form on CPU."""
    from gshard_jax.models import dropless
    assert [dropless.exchange_for("auto", p) for p in ("gpu", "tpu", "cpu")] == ["ragged", "ragged", "all_to_all"]
    assert dropless.exchange_for("all_gather", "gpu") == "all_gather"
    with pytest.raises(ValueError, match="expected one of"):
        dropless.exchange_for("alltoall", "gpu")
    mesh = gs.make_mesh(MESHES["d2e4"])
    moved = {}
    for exchange in ("all_to_all", "ragged"):
        m, params, x = layer(shape=(8, 16, 24), dispatch="dropless", exchange=exchange,
                             gating=dataclasses.replace(AMPLE, capacity_factor=1.0))
        report = gs.explain(lambda p, x: m.apply(p, x)[0], mesh, params, x, trace_per_device=False)
        moved[exchange] = [c for r in report.rows for c in r.collectives
                           if c.kind == "all-to-all" and c.shape[-1:] == (24,)]  # the rows, there and back
    rows = 8 * 16 * 2 // 8  # k x tokens over the 8 token shards
    assert [c.payload for c in moved["all_to_all"]] == [4 * rows * 24 * 4] * 2  # 4 peers x every row, float32
    assert [c.payload for c in moved["ragged"]] == [rows * 24 * 4] * 2
    assert all("ragged" in c.note for c in moved["ragged"])
    assert MoeConfig().exchange == "auto"


@pytest.mark.parametrize("sizes", [[60, 0, 100, 40, 90], [300, 0, 0, 0, 0], [0, 0, 0, 0, 0], [1, 2, 3, 4, 5]])
def test_blocked_grouped_matmul_equals_ragged_dot(sizes):
    """Empty groups, one full group and rows past the groups (which give 0), forward and grad."""
    kx, kw = jax.random.split(jax.random.key(0))
    x, w, s = jax.random.normal(kx, (300, 24)), jax.random.normal(kw, (5, 24, 40)), jnp.array(sizes, jnp.int32)
    f = lambda x, w, impl: jnp.sum(jnp.sin(grouped_matmul(x, w, s, impl)))
    assert_close(grouped_matmul(x, w, s, "blocked"), jax.lax.ragged_dot(x, w, s), rtol=1e-5, atol=1e-5)
    assert_close(jax.grad(f, (0, 1))(x, w, "blocked"), jax.grad(f, (0, 1))(x, w, "ragged_dot"),
                 rtol=1e-4, atol=1e-4)
    assert block_rows(300, 5) == 16 and block_rows(65536, 64) == 256 and block_rows(10 ** 7, 2) == 512


def test_auto_grouped_matmul_uses_ragged_dot_only_where_the_backend_has_the_kernel(monkeypatch):
    """docs/models.md: "auto" is ragged_dot on GPU/TPU, blocked elsewhere; both give the same rows."""
    from gshard_jax.models import grouped
    x, w = jnp.ones((48, 8)), jnp.ones((3, 8, 4))
    sizes = jnp.array([16, 8, 20], jnp.int32)
    calls = []
    real = jax.lax.ragged_dot
    monkeypatch.setattr(jax.lax, "ragged_dot", lambda *a, **k: calls.append(1) or real(*a, **k))
    blocked = grouped.grouped_matmul(x, w, sizes, "auto")
    assert calls == []
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    native = grouped.grouped_matmul(x, w, sizes, "auto")
    assert calls == [1]
    np.testing.assert_array_equal(np.asarray(native), np.asarray(blocked))


def test_a_dropless_model_initialises_where_one_sequence_does_not_split_over_the_batch_shards():
    """A train state is initialised by tracing the model: a dropless layer's region splits its tokens over the
    batch's shards, so init traces a sequence per shard (Mula-100B's 2,048 tokens over 768 shards did not
    divide). The initialised params are those of an unpartitioned init."""
    from gshard_jax import configs
    from gshard_jax.training import train
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = configs.load(os.path.join(root, "experiments", "tiny_moe_lm.py"))
    cfg.model.moe.dispatch = "dropless"
    cfg.mesh.update(dict(data=2, expert=4))
    cfg.train.update(dict(seq_len=4, batch_size=8))  # 4 tokens a sequence, 8 batch shards
    trainer = train.Trainer(cfg, "")
    state = jax.jit(trainer.init_fn)(jax.random.key(0))
    plain = configs.build_model(cfg.model, train=True)
    want = nn.unbox(plain.init(jax.random.key(0), *configs.example_tokens(cfg.model.kind, 1, 4)))
    got = jax.tree.map(np.asarray, state["params"])
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(a, np.asarray(b).astype(a.dtype))
