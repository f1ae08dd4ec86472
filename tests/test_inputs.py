"""Inputs and meshes as users have them: committed arrays, Explicit meshes, pytrees named by key path."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import gshard_jax as gs
from helpers import assert_close, get_mesh, hlo_stats, randn


def _mlp(params, x):
    h = jnp.tanh(x @ params["fc1"]["kernel"] + params["fc1"]["bias"])
    return h @ params["fc2"]["kernel"]


def _params(rng):
    return {"fc1": {"kernel": randn(rng, 16, 32), "bias": randn(rng, 32)}, "fc2": {"kernel": randn(rng, 32, 8)}}


def test_committed_arrays_seed_propagation_and_their_collectives_are_reported(rng):
    mesh = get_mesh("2x4")
    x = jax.device_put(randn(rng, 8, 16), NamedSharding(mesh, P("data", "model")))
    w = jax.device_put(randn(rng, 16, 16), NamedSharding(mesh, P("model", None)))
    fn = lambda x, w: jnp.tanh(x @ w)
    report = gs.explain(fn, mesh, x, w)
    assert [str(v.planned) for v in report.inputs] == ["[data, model]", "[model, -]"]
    assert all("placement of" in v.origin for v in report.inputs)
    f = gs.partition(fn, mesh)
    assert_close(f(x, w), fn(np.asarray(x), np.asarray(w)))
    predicted, actual = report.totals(), hlo_stats(f, x, w)
    assert sum(t["count"] for t in actual.values()) > 0
    for kind in predicted:
        assert (predicted[kind]["count"], predicted[kind]["payload_bytes"]) == \
            (actual[kind]["count"], actual[kind]["payload_bytes"]), kind


def test_in_shardings_win_over_placement_and_the_move_is_reported(rng):
    mesh = get_mesh("2x4")
    x = jax.device_put(randn(rng, 8, 16), NamedSharding(mesh, P(None, "model")))
    f = lambda x: x * 2.0
    report = gs.explain(f, mesh, x, in_shardings=(P("data"),))
    assert str(report.inputs[0].planned) == "[data, -]" and str(report.inputs[0].boundary) == "[-, model]"
    assert report.notes and "x: in_shardings [data, -] wins over the array's placement [-, model]" in report.notes[0]
    entry = [r for r in report.rows if r.primitive == "input"]
    assert entry and entry[0].source == "x" and entry[0].collectives  # the reshard on entry is a collective
    part = gs.partition(f, mesh, in_shardings=(P("data"),))
    assert_close(part(x), np.asarray(x) * 2.0)
    actual = hlo_stats(part, x)
    assert report.totals()["all-gather"]["count"] == actual["all-gather"]["count"] == 1  # the model axis, gathered
    for kind, t in report.totals().items():
        assert (t["count"], t["payload_bytes"]) == (actual[kind]["count"], actual[kind]["payload_bytes"]), kind


def test_array_on_another_mesh_names_the_argument_and_both_meshes(rng):
    mesh = get_mesh("2x4")
    other = gs.make_mesh({"x": 8})
    params = _params(rng)
    params["fc1"]["bias"] = jax.device_put(params["fc1"]["bias"], NamedSharding(other, P("x")))
    with pytest.raises(ValueError, match=r"params\['fc1'\]\['bias'\] is committed to a NamedSharding on "
                                         r"Mesh\(\{'x': 8\}.*not to the partition mesh "
                                         r"Mesh\(\{'data': 2, 'model': 4\}"):
        gs.partition(_mlp, mesh)(params, randn(rng, 4, 16))
    one = jax.device_put(randn(rng, 4, 16), jax.devices()[3])
    with pytest.raises(ValueError, match=r"argument x is committed to a SingleDeviceSharding on devices \[3\]"):
        gs.partition(_mlp, mesh)(_params(rng), one)


def test_explicit_mesh_works(rng):
    mesh = jax.make_mesh((2, 4), ("data", "model"))  # Explicit axis types by default
    assert all(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)
    x = randn(rng, 8, 16)
    fn = lambda v: jnp.sum(gs.shard(v, ("data", None)) ** 2, axis=1)
    assert_close(gs.partition(fn, mesh)(x), fn(x))
    placed = jax.device_put(x, NamedSharding(mesh, P("data", "model")))
    assert_close(gs.partition(fn, mesh)(placed), fn(x))
    assert_close(gs.partition(fn, mesh, backend="xla")(x), fn(x))
    assert str(gs.explain(fn, mesh, placed).inputs[0].planned) == "[data, model]"


def test_misspelled_key_in_in_shardings_names_the_key(rng):
    mesh = get_mesh("2x4")
    specs = ({"fc1": {"kernel": P(None, "model"), "bais": P("model")}, "fc2": None}, None)
    with pytest.raises(ValueError, match=r"in_shardings for params\['fc1'\]: key 'bais' is not in the value; "
                                         r"its keys are \['bias', 'kernel'\]"):
        gs.partition(_mlp, mesh, in_shardings=specs)(_params(rng), randn(rng, 4, 16))
    bad_rank = ({"fc1": {"kernel": P(None, "model"), "bias": P("model", None)}, "fc2": None}, None)
    with pytest.raises(ValueError, match=r"in_shardings for params\['fc1'\]\['bias'\]: spec \('model', None\) has "
                                         r"2 entries for a value of shape \(32,\)"):
        gs.partition(_mlp, mesh, in_shardings=bad_rank)(_params(rng), randn(rng, 4, 16))


def test_report_names_values_by_key_path(rng):
    mesh = get_mesh("2x4")
    report = gs.explain(lambda params, x: {"y": _mlp(params, x)}, mesh, _params(rng), randn(rng, 4, 16))
    assert [v.name for v in report.inputs] == ["params['fc1']['bias']", "params['fc1']['kernel']",
                                               "params['fc2']['kernel']", "x"]
    assert [v.name for v in report.outputs] == ["out['y']"]
    assert "params['fc1']['bias']" in str(report)


def test_per_output_spec_tuples():
    """out_shardings=(("x",), ("x",)) is one spec per output, as documented; likewise in_shardings."""
    mesh = gs.make_mesh({"x": 8})
    a, b = np.arange(16.0), np.arange(8.0)
    f = gs.partition(lambda a, b: (a * 2, b + 1), mesh, in_shardings=(("x",), ("x",)),
                     out_shardings=(("x",), ("x",)))
    ya, yb = f(a, b)
    assert_close((ya, yb), (a * 2, b + 1))
    assert ya.sharding.spec == P("x") and yb.sharding.spec == P("x")


def test_uneven_inputs_and_outputs_pad_and_cut_inside_and_in_the_report(rng):
    mesh = get_mesh("8")
    x = randn(rng, 10, 4)
    fn = lambda v: gs.split(v, 0, 8) * 2.0
    report = gs.explain(fn, mesh, x)
    boundary = {r.primitive: r for r in report.rows if r.index < 0}
    assert "padded" in boundary["input"].strategy and not boundary["input"].collectives
    assert "cut" in boundary["output"].strategy and boundary["output"].collectives[0].kind == "all-gather"
    f = gs.partition(fn, mesh)
    assert_close(f(x), x * 2.0)
    actual = hlo_stats(f, x)
    for kind, t in report.totals().items():
        assert (t["count"], t["payload_bytes"]) == (actual[kind]["count"], actual[kind]["payload_bytes"]), kind


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(8, name="proj")(gs.shard(x, ("data", None)))


def test_sources_are_user_code_with_the_flax_module_path(rng):
    mesh = get_mesh("2x4")
    model = _Block()
    x = randn(rng, 8, 16)
    params = model.init(jax.random.key(0), x)
    report = gs.explain(lambda p, x: model.apply(p, x), mesh, params, x)
    dots = [r for r in report.rows if r.primitive == "dot_general"]
    assert dots and dots[0].source.startswith("tests/test_inputs.py:") and "[_Block/proj]" in dots[0].source
    assert not [r for r in report.rows if "site-packages" in r.source]
