"""Sub-axes (partitioner/representation/subaxes.py): an axis planned in parts where a reshape asks for it.

The naming and the conversions are tested as data; the partitioned programs against jax.jit, the compiled
HLO (explain() equal to it), XLA's partitioner, and the user's mesh on the outputs.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec as P

import gshard_jax as gs
from gshard_jax.partitioner.representation import subaxes as SUB
from gshard_jax.partitioner.representation.program import from_jaxpr
from gshard_jax.partitioner.representation.sharding import Sharding
from helpers import assert_report_matches_hlo, get_mesh

M1, M2 = "model:(1)2", "model:(2)2"
FACTORING = {"model": (2, 2)}
SHAPE = {"data": 2, "model": 4}


def test_names_follow_shardy():
    assert SUB.parts("model", (2, 2)) == (M1, M2)
    assert SUB.parts("x", (2, 3, 2)) == ("x:(1)2", "x:(2)3", "x:(6)2")
    assert SUB.parent_of(M2) == "model" and SUB.parent_of("data") == "data"


# (sharding over the refined mesh, the same named over the user's mesh)
WHOLE = [
    (Sharding(((M1, M2), ())), Sharding((("model",), ()))),
    (Sharding((("data", M1, M2), ())), Sharding((("data", "model"), ()))),
    (Sharding(((M1,), (M2,))), Sharding(((M1,), (M2,)))),  # a part per dim: no whole axis
    (Sharding(((M2, M1), ())), Sharding(((M2, M1), ()))),  # minor before major is not `model`
    (Sharding(((), ()), frozenset({M1, M2})), Sharding(((), ()), frozenset({"model"}))),
    (Sharding(((M1,), ()), frozenset({M2})), Sharding(((M1,), ()), frozenset({M2}))),
]


@pytest.mark.parametrize("refined,named", WHOLE)
def test_whole_names_complete_runs_only(refined, named):
    assert SUB.whole(refined, SHAPE) == named


def test_refine_and_back():
    s = Sharding((("data",), ("model",)), frozenset())
    r = SUB.refine(s, FACTORING)
    assert r == Sharding((("data",), (M1, M2)))
    assert SUB.whole(r, SHAPE) == s
    assert SUB.refine(Sharding(((), ()), frozenset({"model"})), FACTORING).partial == {M1, M2}
    assert SUB.refine(Sharding((("data",),)), FACTORING) == Sharding((("data",),))  # untouched axes


def test_coarse_gathers_lone_parts_at_the_boundary():
    assert SUB.coarse(Sharding((("data",), (M1,), (M2,))), FACTORING) == Sharding((("data",), (), ()))
    assert SUB.coarse(Sharding(((M1, M2), ())), FACTORING) == Sharding(((M1, M2), ()))


def test_refined_mesh_keeps_device_order():
    mesh = get_mesh("2x4")
    r = SUB.refine_mesh(mesh, FACTORING)
    assert r.axis_names == ("data", M1, M2) and dict(r.shape) == {"data": 2, M1: 2, M2: 2}
    np.testing.assert_array_equal(np.asarray(r.devices).reshape(2, 4), np.asarray(mesh.devices))
    a = SUB.refine_mesh(AbstractMesh((2, 4), ("data", "model")), FACTORING)
    assert dict(a.shape) == {"data": 2, M1: 2, M2: 2}


def _program(fn, *args):
    return from_jaxpr(jax.make_jaxpr(fn)(*args))


# (function, argument shape, mesh shape) -> the factoring a reshape asks for
FACTORINGS = [
    (lambda x: x.reshape(4, 2, 8), (4, 16), {"data": 2, "model": 4}, {"model": (2, 2)}),  # 2 heads on 4
    (lambda x: x.reshape(4, 4, 4), (4, 16), {"data": 2, "model": 4}, {}),  # 4 heads on 4: whole
    (lambda x: x.reshape(4, 2, 8), (4, 16), {"data": 8}, {"data": (2, 4)}),
    (lambda x: x.reshape(4, 4, 4), (4, 16), {"data": 8}, {"data": (4, 2)}),
    (lambda x: x.reshape(4, 3, 5), (4, 15), {"model": 4}, {}),  # 4 does not divide 15
    (lambda x: x.reshape(8, 8), (64,), {"model": 4}, {}),  # the major factor takes all 4
    (lambda x: x.reshape(2, 8, 4).reshape(4, 16), (4, 16), {"model": 4}, {"model": (2, 2)}),  # merged back
]


@pytest.mark.parametrize("fn,shape,mesh_shape,want", FACTORINGS)
def test_factorings_as_data(fn, shape, mesh_shape, want):
    assert SUB.factorings(_program(fn, jnp.zeros(shape)), mesh_shape) == want


def test_a_program_that_names_axes_is_not_refined():
    mesh = get_mesh("2x4")

    def body(x):
        return jax.lax.psum(x.reshape(x.shape[0], 2, 8).sum(1), "model")

    def fn(x):
        return jax.shard_map(body, mesh=mesh, in_specs=P("data", None), out_specs=P("data", None))(x)
    assert SUB.factorings(_program(fn, jnp.zeros((4, 16))), SHAPE) == {}


def _gqa(x, wk, wq):
    """k with 2 heads repeated to 8 query heads (heads split over `model` by the q projection)."""
    k = jnp.repeat((x @ wk).reshape(x.shape[0], 2, 8), 4, axis=1)
    q = (x @ wq).reshape(x.shape[0], 8, 8)
    return jnp.einsum("bhd,bhd->bh", q, k)


def _gqa_args():
    """Small integers: every product and sum is exact in float32 (|result| < 2**24), so any order of
    summation, on any machine, gives the same bits and the comparison can be exact."""
    r = np.random.default_rng(0)
    return tuple(jnp.asarray(r.integers(-2, 3, s), jnp.float32) for s in ((8, 32), (32, 16), (32, 64)))


def test_gqa_splits_heads_over_a_sub_axis_like_xla():
    mesh = get_mesh("2x4")
    args = _gqa_args()
    ins, outs = (P("data", None), P(None, "model"), P(None, "model")), P("data", "model")
    report = gs.explain(_gqa, mesh, *args, in_shardings=ins, out_shardings=outs)
    got, stats = {}, {}
    for backend in ("gshard", "xla"):
        f = gs.partition(_gqa, mesh, in_shardings=ins, out_shardings=outs, backend=backend)
        compiled = f.lower(*args).compile()
        got[backend], stats[backend] = compiled(*args), gs.collective_stats(compiled)
    np.testing.assert_array_equal(got["gshard"], jax.jit(_gqa)(*args))
    assert_report_matches_hlo(report, stats["gshard"])
    moved = {b: sum(s["moved_bytes"] for s in stats[b].values()) for b in stats}
    assert moved["gshard"] <= moved["xla"], moved
    # k gathered within pairs of `model` (its minor part), not over all of it; outputs on the user's mesh
    assert [str(c).split()[0] for c in report.collectives] == [f"all-gather[{M2}]"]
    assert got["gshard"].sharding == NamedSharding(mesh, P("data", "model"))
    assert str(report.outputs[0].planned) == "[data, model]"


def test_gqa_explain_on_an_abstract_mesh_equals_the_mesh():
    args = _gqa_args()
    ins, outs = (P("data", None), P(None, "model"), P(None, "model")), P("data", "model")
    text = lambda m: [str(c) for c in gs.explain(_gqa, m, *args, in_shardings=ins, out_shardings=outs,
                                                 trace_per_device=False).collectives]
    assert text(AbstractMesh((2, 4), ("data", "model"))) == text(get_mesh("2x4"))
