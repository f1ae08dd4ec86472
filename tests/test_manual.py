"""Manual regions (gs.manual, a user's jax.shard_map): one op with fixed specs inside a partitioned function."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import gshard_jax as gs
from gshard_jax.models.moe import expert_einsums
from helpers import assert_close, assert_report_matches_hlo, get_mesh, hlo_stats, randn

G, S, M, E, C, H = 8, 8, 16, 8, 4, 32


def top1_gating(x_GSM, wg_ME):
    """Switch-style top-1 routing with capacity C: dispatch mask and combine weights [G, S, E, C]."""
    x_GSM = gs.split(x_GSM, 0, 8)
    probs_GSE = jax.nn.softmax(jnp.einsum("GSM,ME->GSE", x_GSM, wg_ME), axis=-1)
    onehot_GSE = jax.nn.one_hot(jnp.argmax(probs_GSE, -1), E)
    pos_GSE = ((jnp.cumsum(onehot_GSE, axis=1) - 1) * onehot_GSE).astype(jnp.int32)
    dispatch_GSEC = onehot_GSE[..., None] * jax.nn.one_hot(pos_GSE, C) * (pos_GSE < C)[..., None]
    return dispatch_GSEC, dispatch_GSEC * probs_GSE[..., None]


def _experts_by_hand(x, dispatch, combine, wi, wo):
    """Per device: one group's tokens to every expert and back, with two explicit all-to-alls."""
    e_in = jnp.einsum("GSEC,GSM->EGCM", dispatch, x)                       # [E, 1, C, M]
    e_in = jax.lax.all_to_all(e_in, "expert", split_axis=0, concat_axis=1, tiled=True)  # [1, G, C, M]
    h = jax.nn.relu(jnp.einsum("EGCM,EMH->EGCH", e_in, wi))
    e_out = jnp.einsum("EGCH,EHM->EGCM", h, wo)
    e_out = jax.lax.all_to_all(e_out, "expert", split_axis=1, concat_axis=0, tiled=True)  # [E, 1, C, M]
    return jnp.einsum("GSEC,EGCM->GSM", combine, e_out)


experts = gs.manual(_experts_by_hand, in_specs=(P("expert"),) * 5, out_specs=P("expert"))


def moe_layer(x, wg, wi, wo, region=experts):
    dispatch, combine = top1_gating(x, wg)
    return x + region(x, dispatch, combine, wi, wo)


def moe_reference(x, wg, wi, wo):
    dispatch, combine = top1_gating(x, wg)
    return x + expert_einsums(dispatch, combine, x, wi, wo, 8)


def inputs(rng):
    return randn(rng, G, S, M), randn(rng, M, E), randn(rng, E, M, H) / 4, randn(rng, E, H, M) / 6


def test_hand_written_dispatch_in_a_partitioned_moe_layer(rng):
    mesh = gs.make_mesh({"expert": 8})
    args = inputs(rng)
    f = gs.partition(moe_layer, mesh)
    assert_close(f(*args), moe_reference(*args), rtol=1e-5, atol=1e-5)
    report = gs.explain(moe_layer, mesh, *args)
    assert not report.fallbacks
    (row,) = [r for r in report.rows if r.primitive == "shard_map"]
    assert row.strategy.startswith("manual region over expert") and "2 collectives of its own" in row.strategy
    assert [c.kind for c in row.collectives] == ["all-to-all", "all-to-all"]
    assert [str(o) for o in row.outputs] == ["[expert, -, -]"]
    stats = hlo_stats(f, *args)
    assert stats["all-to-all"]["count"] == 2
    assert_report_matches_hlo(report, stats)


def test_gradients_flow_through_a_manual_region(rng):
    mesh = gs.make_mesh({"expert": 8})
    args = inputs(rng)
    loss = lambda *a: jnp.mean(moe_layer(*a) ** 2)
    want = jax.grad(lambda *a: jnp.mean(moe_reference(*a) ** 2), argnums=(0, 1, 2, 3))(*args)
    g = jax.grad(loss, argnums=(0, 1, 2, 3))
    assert_close(gs.partition(g, mesh)(*args), want, rtol=1e-4, atol=1e-6)
    assert_close(jax.grad(gs.partition(loss, mesh), argnums=(0, 1, 2, 3))(*args), want, rtol=1e-4, atol=1e-6)
    report = gs.explain(g, mesh, *args)
    assert not report.fallbacks and len([r for r in report.rows if r.primitive == "shard_map"]) == 2
    assert_report_matches_hlo(report, hlo_stats(gs.partition(g, mesh), *args))


def test_resharding_into_and_out_of_the_region(rng):
    """Operands arriving otherwise are resharded to in_specs; the row shows have->need."""
    mesh = get_mesh("2x4")
    x = randn(rng, 8, 16)
    rowsum = gs.manual(lambda v: jax.lax.psum(jnp.sum(v, axis=1), "model"), in_specs=P("data", "model"),
                       out_specs=P("data"))
    fn = lambda x: rowsum(gs.shard(x * 2.0, ("model", None))) + 1.0
    f = gs.partition(fn, mesh)
    assert_close(f(x), np.sum(x * 2.0, axis=1) + 1.0)
    report = gs.explain(fn, mesh, x)
    (row,) = [r for r in report.rows if r.primitive == "shard_map"]
    assert str(row.operands[0]) == "[model, -]->[data, model]"
    # In: model moves from dim 0 to dim 1 (all-to-all), data is sliced locally; inside: the psum.
    assert [c.kind for c in row.collectives] == ["all-to-all", "all-reduce"]
    assert row.collectives[1].note == "inside the manual region"
    assert_report_matches_hlo(report, hlo_stats(f, x))


def test_users_own_shard_map_is_a_manual_region(rng):
    mesh = gs.make_mesh({"expert": 8})
    args = inputs(rng)
    own = lambda *a: jax.shard_map(_experts_by_hand, mesh=mesh, in_specs=(P("expert"),) * 5,
                                   out_specs=P("expert"), check_vma=False)(*a)
    fn = lambda *a: moe_layer(*a, region=own)
    assert_close(gs.partition(fn, mesh)(*args), moe_reference(*args), rtol=1e-5, atol=1e-5)
    assert not gs.explain(fn, mesh, *args).fallbacks
    assert_close(gs.partition(fn, mesh, backend="xla")(*args), moe_reference(*args), rtol=1e-5, atol=1e-5)


def test_manual_region_errors(rng):
    x = randn(rng, 8, 4)
    with pytest.raises(ValueError, match="a manual region needs a mesh"):
        gs.manual(lambda v: v, P("x"), P("x"))(x)
    mesh = gs.make_mesh({"x": 8})
    with pytest.raises(ValueError, match="unknown mesh axis 'y'"):
        gs.partition(lambda v: gs.manual(lambda a: a, P("y"), P("y"))(v), mesh)(x)
    other = gs.make_mesh({"a": 2, "b": 4})
    foreign = lambda v: jax.shard_map(lambda a: a, mesh=other, in_specs=P("a"), out_specs=P("a"))(v)
    with pytest.raises(ValueError, match=r"its mesh \{'a': 2, 'b': 4\} is not the partition mesh \{'x': 8\}"):
        gs.partition(foreign, mesh)(x)
    mesh2 = get_mesh("2x4")
    partial = lambda v: jax.shard_map(lambda a: a * 2, mesh=mesh2, in_specs=P("data"), out_specs=P("data"),
                                      axis_names={"data"})(v)
    # A partial-manual region runs whole along its automatic axes (tests/test_user_shard_map.py has more).
    assert_close(gs.partition(partial, mesh2)(x), jax.jit(partial)(x))
    # With a mesh, a manual region also runs outside partition().
    assert_close(gs.manual(lambda v: v * 2, P("x"), P("x"), mesh=mesh)(x), x * 2)
