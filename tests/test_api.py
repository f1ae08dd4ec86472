"""The public API: meshes, annotations, partition/explain arguments, and clear errors on bad input."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from test_collectives import moe_chain, moe_inputs
from test_grad import megatron_mlp

import gshard_jax as gs
from helpers import assert_close, assert_report_matches_hlo, hlo_counts, hlo_stats, randn


def test_make_mesh():
    mesh = gs.make_mesh({"data": 2, "model": 4})
    assert dict(mesh.shape) == {"data": 2, "model": 4}
    assert dict(gs.make_mesh({"data": -1, "model": 2}).shape) == {"data": 4, "model": 2}
    with pytest.raises(ValueError, match="multiply to 6, but there are 8 devices"):
        gs.make_mesh({"data": 2, "model": 3})
    with pytest.raises(ValueError, match="non-empty dict"):
        gs.make_mesh([2, 4])


def test_annotations_are_identity_unpartitioned(rng):
    x = randn(rng, 8, 4)
    assert gs.replicate(x) is x and gs.split(x, 0, 8) is x and gs.shard(x, ("data", None)) is x
    y = jax.jit(lambda v: gs.split(v, 1, 2) * 2)(x)
    assert_close(y, x * 2)
    g = jax.grad(lambda v: jnp.sum(gs.split(v, 0, 8) ** 2))(x)
    assert_close(g, 2 * x)


def test_split_dimension_out_of_range(rng):
    with pytest.raises(ValueError, match=r"split_dimension=2.*out of range.*shape \(8, 4\)"):
        gs.split(randn(rng, 8, 4), 2, 8)


def test_num_partitions_no_axes_give(rng):
    mesh = gs.make_mesh({"data": 2, "model": 4})
    with pytest.raises(ValueError, match=r"sizes multiplying to 3.*one of \[1, 2, 4, 8\]"):
        gs.partition(lambda v: gs.split(v, 0, 3), mesh)(randn(rng, 12, 4))


def test_split_picks_axes(rng):
    mesh = gs.make_mesh({"data": 2, "model": 4})
    x = randn(rng, 8, 8)
    report = gs.explain(lambda v: gs.split(v, 1, 4) + 1.0, mesh, x)
    assert list(map(str, report.rows[0].outputs)) == ["[-, model]"]
    report = gs.explain(lambda v: gs.split(v, 0, 8) + 1.0, mesh, x)
    assert list(map(str, report.rows[0].outputs)) == ["[data*model, -]"]


def test_unknown_mesh_axis(rng):
    mesh = gs.make_mesh({"data": 2, "model": 4})
    with pytest.raises(ValueError, match=r"unknown mesh axis 'expert'.*\('data', 'model'\)"):
        gs.partition(lambda v: gs.shard(v, ("expert", None)), mesh)(randn(rng, 8, 4))
    with pytest.raises(ValueError, match=r"unknown mesh axis 'foo'"):
        gs.partition(lambda v: v + 1, mesh, in_shardings=(("foo",),))(randn(rng, 8, 4))


def test_device_assignment_matches_mesh(rng):
    mesh = gs.make_mesh({"data": 2, "model": 4})
    x = randn(rng, 8, 8)
    ids = np.array([d.id for d in mesh.devices.flat]).reshape(2, 4)
    cases = {
        "[data, model]": ids,                                  # tile (i, j) on device at (data=i, model=j)
        "[model, data]": ids.T,                                # dims swapped
        "[data*model, -]": ids.reshape(8, 1),
        "[data, -]": ids.reshape(2, 1, 4),                     # trailing replication dim
    }
    for want, assignment in cases.items():
        fn = lambda v, a=assignment: gs.shard(v, a) * 2.0
        report = gs.explain(fn, mesh, x)
        assert list(map(str, report.rows[0].outputs)) == [want], (want, report.rows[0].outputs)
        assert_close(gs.partition(fn, mesh)(x), x * 2.0)


def test_device_assignment_the_mesh_cannot_express(rng):
    mesh = gs.make_mesh({"x": 8})
    bad = np.array([0, 2, 1, 3, 4, 5, 6, 7]).reshape(8, 1)
    with pytest.raises(ValueError, match=r"tile\(s\) disagree, e.g. tile \(1, 0\) is assigned devices \[2\]"):
        gs.partition(lambda v: gs.shard(v, bad), mesh)(randn(rng, 8, 8))
    with pytest.raises(ValueError, match="each of the mesh's devices"):
        gs.partition(lambda v: gs.shard(v, np.zeros((8, 1), int)), mesh)(randn(rng, 8, 8))
    with pytest.raises(ValueError, match="rank 3"):
        gs.shard(randn(rng, 8), np.zeros((2, 2, 2), int))


def test_bad_backend_and_mesh(rng):
    with pytest.raises(ValueError, match="backend='tpu'"):
        gs.partition(lambda v: v, gs.make_mesh({"x": 8}), backend="tpu")
    with pytest.raises(ValueError, match="expected a jax.sharding.Mesh"):
        gs.partition(lambda v: v, {"x": 8})


def test_xla_backend_same_numbers(rng):
    mesh = gs.make_mesh({"data": 2, "model": 4})
    x, w1, w2 = randn(rng, 8, 16), randn(rng, 16, 32), randn(rng, 32, 16)
    ours = gs.partition(megatron_mlp, mesh)(x, w1, w2)
    xla = gs.partition(megatron_mlp, mesh, backend="xla")(x, w1, w2)
    assert_close(ours, megatron_mlp(x, w1, w2), rtol=1e-5, atol=1e-4)
    assert_close(xla, megatron_mlp(x, w1, w2), rtol=1e-5, atol=1e-4)


def test_in_out_shardings_and_pytrees(rng):
    mesh = gs.make_mesh({"data": 2, "model": 4})
    params = {"w": randn(rng, 16, 8), "b": randn(rng, 8)}
    x = randn(rng, 8, 16)
    fn = lambda p, x: {"y": x @ p["w"] + p["b"]}
    f = gs.partition(fn, mesh, in_shardings=({"w": (None, "model"), "b": ("model",)}, ("data", None)),
                     out_shardings={"y": ("data", "model")})
    out = f(params, x)
    assert_close(out, fn(params, x))
    assert out["y"].sharding.spec == jax.sharding.PartitionSpec("data", "model")
    assert hlo_counts(f, params, x) == {}


def test_explain_report(rng):
    mesh = gs.make_mesh({"x": 8})
    args = moe_inputs(rng)
    report = gs.explain(moe_chain, mesh, *args)
    full = report.table()
    assert "all-to-all" in full and "dot_general" in full and "user annotation split(dim=0, n=8)" in full
    assert full.count("\n   ") >= len(report.rows)  # every row listed
    compact = str(report)  # only what communicates or falls back, then totals; fits 100 columns
    assert "2 of " in compact and "dot_general" not in compact and compact.count("all-to-all[x]") == 2
    assert max(len(line) for line in compact.splitlines() + full.splitlines()) <= 100
    data = json.loads(report.to_json())
    assert data["totals"]["all-to-all"]["count"] == 2
    assert {"source", "primitive", "operands", "outputs", "strategy", "collectives"} <= set(data["rows"][0])
    out = data["rows"][0]["outputs"][0]  # structured, not pre-formatted
    assert set(out) == {"shape", "dtype", "made", "planned", "origin"} and isinstance(out["shape"], list)
    assert set(out["planned"]) == {"dims", "partial", "padded", "text"}
    assert [v["name"] for v in data["inputs"]] == ["dispatch", "combine", "x", "wi", "wo"]
    page = report.to_html()
    assert page.count("<tr>") == len(report.rows) + 1 + 2 and "all-to-all" in page  # header, rows, totals
    sources = [r["source"] for r in data["rows"] if r["source"]]
    assert sources and all("models/moe.py" in src for src in sources)  # the user's code, not the annotation helpers


PROGRAMS = {
    "megatron_mlp_2x4": ({"data": 2, "model": 4}, megatron_mlp, lambda rng: (randn(rng, 8, 16), randn(rng, 16, 32),
                                                                            randn(rng, 32, 16))),
    "moe_chain_8": ({"x": 8}, moe_chain, moe_inputs),
    "matmul_reduce_scatter": ({"x": 8}, lambda a, b: gs.split(gs.split(a, 1, 8) @ gs.split(b, 0, 8), 0, 8),
                              lambda rng: (randn(rng, 16, 64), randn(rng, 64, 32))),
    "gather_and_permute": ({"a": 2, "b": 4}, lambda a: gs.shard(gs.shard(a, (("a", "b"), None)) * 2,
                                                                 (("b", "a"), None)) + gs.replicate(a).sum(),
                           lambda rng: (randn(rng, 16, 4),)),
}


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_explain_bytes_agree_with_hlo(name, rng):
    axes, fn, make = PROGRAMS[name]
    mesh = gs.make_mesh(axes)
    args = make(rng)
    report = gs.explain(fn, mesh, *args)
    predicted = report.totals()
    actual = hlo_stats(gs.partition(fn, mesh), *args)
    assert_report_matches_hlo(report, actual)
    for kind in predicted:
        assert predicted[kind]["payload_bytes"] == actual[kind]["payload_bytes"], (kind, predicted, actual)
        assert predicted[kind]["moved_bytes"] == pytest.approx(actual[kind]["moved_bytes"]), kind


def test_in_shardings_conventions(rng):
    mesh = gs.make_mesh({"data": 2, "model": 4})
    a, b = randn(rng, 8, 4), randn(rng, 8)
    fn = lambda a, b: a + b[:, None]
    # One entry per argument; (None, None) lets propagation decide both.
    assert_close(gs.partition(fn, mesh, in_shardings=(None, None))(a, b), fn(a, b))
    report = gs.explain(fn, mesh, a, b, in_shardings=(("data", None), None))
    assert (report.inputs[0].shape, str(report.inputs[0].planned)) == ((8, 4), "[data, -]")
    assert (report.inputs[1].shape, str(report.inputs[1].planned)) == ((8,), "[data]")
    assert [v.name for v in report.inputs] == ["a", "b"]
    named = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    assert_close(gs.partition(fn, mesh, in_shardings=(named, named))(a, b), fn(a, b))
    with pytest.raises(ValueError, match=r"one entry per argument \(2: a, b\)"):
        gs.partition(fn, mesh, in_shardings=("data", None, None))(a, b)
    with pytest.raises(ValueError, match="more than one dim"):
        gs.partition(fn, mesh, in_shardings=(("data", "data"), None))


def test_keyword_arguments(rng):
    mesh = gs.make_mesh({"x": 8})
    x = randn(rng, 8, 4)
    fn = lambda x, scale=1.0: gs.split(x, 0, 8) * scale
    assert_close(gs.partition(fn, mesh)(x, scale=3.0), x * 3.0)


def test_spec_as_list_of_lists_and_mesh_sizes(rng):
    mesh = gs.make_mesh({"data": np.int64(2), "model": 4})
    x = randn(rng, 8, 4)
    fn = lambda v: gs.shard(v, [["data", "model"], None]) + 1.0
    assert list(map(str, gs.explain(fn, mesh, x).rows[0].outputs)) == ["[data*model, -]"]
    with pytest.raises(ValueError, match="positive int"):
        gs.make_mesh({"data": True, "model": 8})
    with pytest.raises(ValueError, match="expected an int dim"):
        gs.split(x, 0.0, 8)


def test_an_input_returned_with_another_out_sharding_leaves_resharded(rng):
    """As jax.jit takes it (tests/test_passthrough_outputs.py has more cases)."""
    mesh = gs.make_mesh({"x": 8})
    x = randn(rng, 8)
    assert_close(gs.partition(lambda v: v, mesh, out_shardings=("x",))(x), x)
    y = gs.partition(lambda v: v, mesh, in_shardings=((None,),), out_shardings=("x",))(x)
    assert_close(y, x)
    assert y.sharding.spec == jax.sharding.PartitionSpec("x")


def test_the_stated_reason_for_replication_is_the_real_one():
    mesh = gs.make_mesh({"x": 8})
    x = np.ones((10, 4), np.float32)
    report = gs.explain(lambda v: gs.split(v, 0, 8).reshape(40) * 2, mesh, x)
    (row,) = [r for r in report.rows if r.primitive == "reshape"]
    assert "a reshape" in row.origins[0] and "merges this dim (size 40) from dims of sizes [10, 4]" in row.origins[0]
    assert "10 does not divide by 8 (x)" in row.origins[0] and row.origins[0].startswith("replicated: dim 0 whole")
    report = gs.explain(lambda v: jnp.sort(gs.split(v, 0, 8), axis=0), mesh, x)
    (row,) = [r for r in report.rows if r.primitive == "sort"]
    assert "needs dim 0 whole" in row.origins[0] and "the split over x stops there" in row.origins[0]
    report = gs.explain(lambda v: jnp.tanh(gs.split(v, 0, 8)[:, :2].reshape(20)), mesh, x)
    assert all("no annotation or sharded neighbour reached it" not in r.origins[0]
               for r in report.rows if r.primitive == "reshape")


def test_garbage_collector_paused_only_while_partitioning(rng):
    """The collector is paused while a program is traced and planned, and left as the caller had it."""
    import gc
    mesh = gs.make_mesh({"x": 8})
    seen = []

    def f(v):
        seen.append(gc.isenabled())  # runs while the pass traces it
        return gs.split(v, 0, 8) * 2

    x = randn(rng, 8, 4)
    assert gc.isenabled()
    assert_close(gs.partition(f, mesh)(x), x * 2)
    gs.partition(f, mesh).lower(x)
    assert seen == [False, False] and gc.isenabled()
    with pytest.raises(ValueError):  # an error inside the pass still resumes it
        gs.partition(lambda v: gs.split(v, 0, 3), mesh)(x)
    assert gc.isenabled()
    gc.disable()
    try:
        gs.partition(f, mesh).lower(x)
        assert not gc.isenabled()  # a caller who paused it keeps it paused
    finally:
        gc.enable()


@pytest.mark.parametrize("backend", ["gshard", "xla"])
def test_donated_arguments_become_the_outputs_buffers(rng, backend):
    """donate_argnums as jax.jit's: the compiled program aliases the donated argument to the output of its
    shape (memory_analysis' alias bytes), the call deletes it, and the numbers are the undonated call's."""
    mesh = gs.make_mesh({"data": 2, "model": 4})
    x, w = randn(rng, 16, 32), randn(rng, 32, 32)
    def f(w, x):
        return w - 0.1 * jnp.einsum("bd,bf->df", x, jnp.tanh(x @ w)), jnp.sum(x @ w)
    want = jax.jit(f)(w, x)
    step = gs.partition(f, mesh, in_shardings=(P(None, "model"), P("data")), backend=backend,
                        donate_argnums=0)
    w_dev = jax.device_put(w, jax.sharding.NamedSharding(mesh, P(None, "model")))
    assert step.lower(w_dev, x).compile().memory_analysis().alias_size_in_bytes == w.nbytes // 4  # per device
    got = step(w_dev, x)
    assert w_dev.is_deleted()
    assert_close(got[0], want[0]) and assert_close(got[1], want[1])
    with pytest.raises(ValueError, match=r"donate_argnums='state'.*non-negative int"):
        gs.partition(f, mesh, donate_argnums="state")


def test_a_call_reads_the_arguments_placements_once_per_structure_and_sharding(rng, monkeypatch):
    """Partitioned reads where each argument is committed (one spec per leaf, named for errors) once per
    structure and shardings of its arguments, not on every call: a train step's state has hundreds of leaves.
    A new sharding is read again, and plans again."""
    from gshard_jax import api
    calls = []
    read = api._placements
    monkeypatch.setattr(api, "_placements", lambda *a: calls.append(1) or read(*a))
    mesh = gs.make_mesh({"data": 2, "model": 4})
    f = gs.partition(lambda w, x: jnp.tanh(x @ w), mesh)
    w, x = randn(rng, 32, 32), randn(rng, 16, 32)
    by_model = jax.device_put(w, jax.sharding.NamedSharding(mesh, P(None, "model")))
    for _ in range(3):
        assert_close(f(by_model, x), jnp.tanh(x @ w))
    assert len(calls) == 1
    by_data = jax.device_put(w, jax.sharding.NamedSharding(mesh, P("data", None)))
    assert_close(f(by_data, x), jnp.tanh(x @ w))
    assert len(calls) == 2 and len(f._jits) == 2
