"""Every primitive the installed JAX emits for jax.lax, jax.numpy, jax.nn and jax.random (and their
derivatives) has a rule or a role in the registry, so a primitive a new JAX adds is found here, not by a
user's FALLBACK row. The primitives that have rules for that reason alone are partitioned below against the
unpartitioned function."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gshard_jax as gs
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
    "zeta": (lambda x: jax.lax.zeta(x + 2.0, x + 1.0), _x()),
}


if not hasattr(jax.lax, "mulhi"):  # JAX 0.10.0 and 0.10.1 have no lax.mulhi (jax_compat.NOT_IN_EVERY_RELEASE)
    CASES = {k: v for k, v in CASES.items() if not k.startswith("mulhi")}


@pytest.mark.parametrize("name", list(CASES))
def test_the_rare_primitives_partition_without_fallback(name):
    fn, x = CASES[name]
    mesh = get_mesh("2x4")
    f = lambda x: fn(gs.shard(x, ("data", None)))
    report = gs.explain(f, mesh, x)
    assert not report.fallbacks, [(r.primitive, r.source) for r in report.fallbacks]
    want = jax.jit(fn)(x)
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(gs.partition(f, mesh)(x))):
        np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(w, np.float64), rtol=2e-6, atol=2e-6)
