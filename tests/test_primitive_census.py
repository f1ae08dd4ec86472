"""Every primitive the installed JAX emits for jax.lax, jax.numpy, jax.nn and jax.random (and their
derivatives) has a rule or a role in the registry, so a primitive a new JAX adds is found here, not by a
user's FALLBACK row. The primitives that have rules for that reason alone are partitioned below against the
unpartitioned function."""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gshard_jax as gs
from gshard_jax.partitioner.representation.jax_compat import NEWEST_TESTED
from gshard_jax.partitioner.strategies import registry as REG
from helpers import get_mesh
from primitive_census import census, public_functions

pytestmark = pytest.mark.newest_jax  # .ci/run runs this file on the newest supported JAX too


# Tokens order effects (infeed, outfeed, callbacks) and hold no data: the partitioner takes no token values, so
# lax.create_token and lax.after_all, which make only tokens, have no rule.
TOKENS = {"create_token", "after_all"}


def _handled(name: str) -> bool:
    op = REG.op_for(name)
    return op is not None and (op.rule is not REG._no_rule or bool(op.form or op.manual or op.checkpoint
                                                                    or op.annotation))


@pytest.mark.slow  # 35-50 s; .ci/run runs it on the newest supported JAX, where new primitives appear
def test_every_primitive_jax_emits_has_a_rule():
    emitted, traced = census()
    # the census traces most public functions (the rest need tokens, axis names or callbacks): a JAX whose
    # functions stopped tracing here would otherwise pass by emitting nothing
    assert len(traced) >= 0.6 * len(public_functions()), (len(traced), len(public_functions()))
    assert {"dot_general", "scan", "while", "sort", "gather", "cumsum", "conv_general_dilated"} <= set(emitted)
    missing = {name: sorted(fns)[:4] for name, fns in emitted.items() if not _handled(name) and name not in TOKENS}
    assert not missing, (f"primitives with no rule in partitioner/strategies/registry.py (and functions emitting "
                         f"them): {missing}")


def _x(shape=(8, 16), lo=0.1, hi=0.9, seed=0):
    return jnp.asarray(np.random.default_rng(seed).uniform(lo, hi, shape), jnp.float32)


def _tanh_grad(x):
    return jax.grad(lambda x: jnp.tanh(x).sum())(x)


def _igamma_grad(x):
    return jax.grad(lambda a: jax.lax.igamma(a + 1.0, x).sum())(x)


def _gamma_per_row(x):
    keys = jax.random.split(jax.random.key(3), x.shape[0])
    return jax.vmap(jax.random.gamma)(keys, x + 1.0)


def _minmax(x):
    return jax.lax.reduce((x, x), (jnp.inf, -jnp.inf),
                          lambda a, b: (jnp.minimum(a[0], b[0]), jnp.maximum(a[1], b[1])), (1,))


def _empty_filled(x):
    return jax.lax.dynamic_update_slice(jnp.empty_like(x), x * 2, (0, 0))


def _sink(x):
    jax.lax.dce_sink(x)
    return x * 2


def _barrier(x):
    a, b = jax.lax.optimization_barrier((x * 2, x.sum(0)))
    return a + b


def _scaled_dot(x):
    return jax.lax.scaled_dot(x, x.T[:, :8] * 0.5, preferred_element_type=jnp.float32)


# primitive -> (function of one [8, 16] float array split over data on its rows, input)
CASES = {
    "bessel_i0e": (jax.lax.bessel_i0e, _x()),
    "bessel_i1e": (jax.lax.bessel_i1e, _x()),
    "dce_sink": (_sink, _x()),
    "empty": (_empty_filled, _x()),
    "empty2/platform_index": (jnp.corrcoef, _x()),
    "igamma_grad_a": (_igamma_grad, _x()),
    "le_to/lt_to": (lambda x: jnp.searchsorted(jnp.linspace(0.0, 1.0, 5), x), _x()),
    "log2": (jnp.log2, _x()),
    "mulhi": (lambda x: jax.lax.mulhi((x * 1e9).astype(jnp.uint32), jnp.uint32(3_000_000_000)), _x()),
    "mulhi (signed)": (lambda x: jax.lax.mulhi(((x - 0.5) * 4e9).astype(jnp.int32),
                                               ((0.5 - x[::-1]) * 4e9).astype(jnp.int32)), _x()),
    "one_minus_square": (_tanh_grad, _x()),
    "optimization_barrier": (_barrier, _x()),
    "polygamma": (lambda x: jax.lax.polygamma(jnp.ones_like(x), x), _x()),
    "polynomial": (lambda x: jnp.polyval(jnp.array([0.5, -1.0, 2.0]), x), _x()),
    "random_gamma (a key per row)": (_gamma_per_row, _x()),
    "random_gamma (one key)": (lambda x: jax.random.gamma(jax.random.key(1), x + 1.0), _x()),
    "reduce": (_minmax, _x()),
    "regularized_incomplete_beta": (lambda x: jax.lax.betainc(x + 1.0, 2.0 - x, x), _x()),
    "scaled_dot": (_scaled_dot, _x((8, 16))),
    "tile": (lambda x: jnp.tile(x, (2, 1)) + jnp.tile(x[:, :4], (1, 4)).sum(), _x()),
    "zeta": (lambda x: jax.lax.zeta(x + 2.0, x + 1.0), _x()),
}


def _gamma_grad(x):
    return jax.grad(lambda a: jax.random.gamma(jax.random.key(2), a).sum())(x + 1.0)


def _poisson_per_row(x):
    keys = jax.random.split(jax.random.key(4), x.shape[0])
    return jax.vmap(lambda k, lam: jax.random.poisson(k, lam))(keys, 20 * x)


# JAX 0.12.1's primitives (jax_compat.NOT_IN_EVERY_RELEASE): the gamma derivative and Poisson sampling were
# composites before, so those cases run on every release; the pointwise ops only where jax.lax has them
NEW_IN_0_12_1 = {
    "random_gamma_grad": (_gamma_grad, _x()),
    "random_poisson (a key per row)": (_poisson_per_row, _x()),
    "random_poisson (one key)": (lambda x: jax.random.poisson(jax.random.key(5), 20 * x), _x()),
    **{name: (getattr(jax.lax, name), _x(lo=-0.9 if name in ("asinpi", "atanpi", "sinpi", "tanpi") else 0.1))
       for name in ("acospi", "asinpi", "atanpi", "cospi", "exp2m1", "log2p1", "sinpi", "tanpi")
       if hasattr(jax.lax, name)},
    **({"atan2pi": (lambda x: jax.lax.atan2pi(x - 0.5, x[::-1]), _x()),
        "fma": (lambda x: jax.lax.fma(x, x[::-1], 0.5 - x), _x()),
        "fmuladd": (lambda x: jax.lax.fmuladd(x, x[::-1], 0.5 - x), _x())} if hasattr(jax.lax, "fma") else {}),
}
CASES.update(NEW_IN_0_12_1)

if not hasattr(jax.lax, "mulhi"):  # JAX 0.10.0 and 0.10.1 have no lax.mulhi (jax_compat.NOT_IN_EVERY_RELEASE)
    CASES = {k: v for k, v in CASES.items() if not k.startswith("mulhi")}


@pytest.mark.parametrize("name", list(CASES))
def test_the_rare_primitives_partition_without_fallback(name):
    fn, x = CASES[name]
    mesh = get_mesh("2x4")
    f = lambda x: fn(gs.shard(x, ("data", None)))
    report = gs.explain(f, mesh, x)
    assert not report.fallbacks, [(r.primitive, r.source) for r in report.fallbacks]
    if jax.__version__ == NEWEST_TESTED:  # there, each case emits the primitive it is named after
        names = name.split(" ")[0].split("/")
        assert any(r.primitive.split("/")[-1] in names for r in report.rows), [r.primitive for r in report.rows]
    want = jax.jit(fn)(x)
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(gs.partition(f, mesh)(x))):
        np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(w, np.float64), rtol=2e-6, atol=2e-6)


def _unruled_primitive():
    """A primitive no registry entry names (as a newer JAX's would be): x * 3 + 1, pointwise."""
    from jax.extend import core as jcore
    from jax.interpreters import mlir

    prim = jcore.Primitive("census_unruled_op")
    prim.def_impl(lambda x: x * 3 + 1)
    prim.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
    mlir.register_lowering(prim, mlir.lower_fun(lambda x: x * 3 + 1, multiple_results=False))
    return prim


UNRULED = _unruled_primitive()


def test_a_primitive_without_a_rule_runs_replicated_and_partition_says_so_once():
    """Every equation of it falls back (explain() flags each row); partition() says it once, naming it with its
    count, and the results equal jit's."""
    x = _x()
    fn = lambda x: UNRULED.bind(UNRULED.bind(x) * 2) + jnp.sin(x)
    mesh = get_mesh("2x4")
    f = lambda x: fn(gs.shard(x, ("data", None)))
    assert [r.primitive for r in gs.explain(f, mesh, x).fallbacks] == ["census_unruled_op"] * 2
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # every warning given, not only the first of each text
        got = gs.partition(f, mesh)(x)
    said = [w for w in caught if issubclass(w.category, gs.NoRuleWarning)]
    assert len(said) == 1, [str(w.message) for w in said]
    text = str(said[0].message)
    assert "no sharding rule for census_unruled_op (2 equations)" in text and "ran replicated" in text, text
    assert "sin" not in text.split(".")[0], text
    np.testing.assert_allclose(np.asarray(got), np.asarray(jax.jit(fn)(x)), rtol=1e-6)


def test_no_warning_where_every_primitive_has_a_rule():
    fn, x = CASES["polygamma"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gs.partition(lambda x: fn(gs.shard(x, ("data", None))), get_mesh("2x4"))(x)
    assert not [w for w in caught if issubclass(w.category, gs.NoRuleWarning)]


def test_the_warning_names_a_jax_newer_than_the_tested_one(monkeypatch):
    from gshard_jax.partitioner.lowering import fallback
    assert "newer than" not in fallback.message({"op": 1}) or jax.__version__ != fallback.NEWEST_TESTED
    monkeypatch.setattr(fallback, "NEWEST_TESTED", "0.9.2")
    text = fallback.message({"a_op": 1, "b_op": 3})
    assert f"JAX {jax.__version__} is newer than 0.9.2" in text, text
    assert "a_op (1 equation), b_op (3 equations)" in text, text
    assert fallback._newer("0.12.10", "0.12.9") and not fallback._newer("0.12.1", "0.12.1")
    assert not fallback._newer("0.12.0.1", "0.12.1") and fallback._newer("0.13.0.dev20270101", "0.12.1")
