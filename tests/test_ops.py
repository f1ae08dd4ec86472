"""Every op family, partitioned under many shardings, equals the unpartitioned function."""
import string

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import MESHES
from hypothesis import HealthCheck, given, settings, strategies as st

import gshard_jax as gs
from helpers import assert_close, check, get_mesh, randn

UNARY = [jnp.exp, jnp.tanh, jnp.abs, jnp.negative, jnp.sin, jax.nn.relu, jax.nn.gelu, lambda x: x ** 3,
         lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), jnp.sign, lambda x: jax.lax.stop_gradient(x),
         lambda x: jnp.copy(x), jnp.floor, lambda x: jnp.sqrt(jnp.abs(x)), jax.nn.sigmoid]
BINARY = [jnp.add, jnp.subtract, jnp.multiply, jnp.maximum, jnp.minimum, lambda a, b: a / (jnp.abs(b) + 1),
          lambda a, b: jnp.where(a > b, a, b), lambda a, b: (a < b).astype(jnp.float32), jnp.arctan2,
          lambda a, b: jnp.clip(a, -0.5, b), lambda a, b: a * 2.0 + 1.0]


@pytest.mark.parametrize("i", range(len(UNARY)))
def test_unary(mesh, rng, i):
    check(UNARY[i], [randn(rng, 8, 4, 2)], mesh, seed=i)


@pytest.mark.parametrize("i", range(len(BINARY)))
def test_binary(mesh, rng, i):
    check(BINARY[i], [randn(rng, 8, 4), randn(rng, 8, 4)], mesh, seed=i)


BROADCASTS = [
    lambda x, y: x[:, None, :] * y[None, :, :1],
    lambda x, y: x + y.sum(0),
    lambda x, y: jnp.broadcast_to(x[0], (4, 8, 4)) + 1.0,
    lambda x, y: x + 1.0 + jnp.zeros((8, 4)),
]


@pytest.mark.parametrize("i", range(len(BROADCASTS)))
def test_broadcast(mesh, rng, i):
    check(BROADCASTS[i], [randn(rng, 8, 4), randn(rng, 8, 4)], mesh, seed=i)


RESHAPES = [
    lambda x: x.reshape(64, 4),            # merge
    lambda x: x.reshape(2, 4, 2, 4, 4),    # split
    lambda x: x.reshape(8, 32),            # merge minor
    lambda x: x.reshape(16, 16),           # neither (re-factor)
    lambda x: x.reshape(-1),
    lambda x: x.reshape(8, 8, 4, 1)[..., 0],  # expand then squeeze
    lambda x: jnp.expand_dims(x, 1),
    lambda x: x.T,
    lambda x: jnp.transpose(x, (1, 2, 0)),
    lambda x: jnp.einsum("abc->cab", x).reshape(4, 64),
]


@pytest.mark.parametrize("i", range(len(RESHAPES)))
def test_reshape_transpose(mesh, rng, i):
    check(RESHAPES[i], [randn(rng, 8, 8, 4)], mesh, seed=i)


REDUCTIONS = [
    lambda x: x.sum(0), lambda x: x.sum(1), lambda x: x.sum(), lambda x: x.max(0), lambda x: x.min(1),
    lambda x: jnp.prod(x * 0.5 + 1.0, axis=0), lambda x: jnp.all(x > -1.0, axis=1), lambda x: jnp.any(x > 1.0, axis=0),
    lambda x: jnp.argmax(x, axis=0), lambda x: jnp.argmin(x, axis=1), lambda x: jnp.argmax(x, axis=2),
    lambda x: jax.nn.softmax(x, axis=-1), lambda x: jax.nn.logsumexp(x, axis=0), lambda x: x.mean((0, 2)),
]


@pytest.mark.parametrize("i", range(len(REDUCTIONS)))
def test_reductions(mesh, rng, i):
    check(REDUCTIONS[i], [randn(rng, 8, 8, 4)], mesh, seed=i)


def test_iota_offsets(mesh, rng):
    check(lambda x: x + jnp.arange(8.0)[:, None] * 10 + jnp.arange(4.0)[None, :], [randn(rng, 8, 4)], mesh, seed=0)
    check(lambda x: x * jax.lax.broadcasted_iota(jnp.float32, (8, 4), 1), [randn(rng, 8, 4)], mesh, seed=1)
    check(lambda x: jnp.where(jnp.arange(8)[:, None] >= jnp.arange(8)[None, :], x, 0.0), [randn(rng, 8, 8)], mesh, 2)


def test_call_like_primitives(mesh, rng):
    @jax.custom_vjp
    def cube(x):
        return x ** 3

    cube.defvjp(lambda x: (x ** 3, x), lambda x, g: (3 * x ** 2 * g,))

    def fn(x, w):
        h = jax.jit(lambda a, b: a @ b)(x, w)
        h = jax.checkpoint(lambda a: jax.nn.relu(a) * 2.0)(h)
        return cube(h) + jax.nn.softplus(h)

    check(fn, [randn(rng, 8, 4), randn(rng, 4, 8)], mesh, seed=3)


STACKS = [
    lambda x, y: jnp.stack([x, y, x * y], axis=-1),
    lambda x, y: jnp.stack([x, y], axis=0).sum(0),
    lambda x, y: jnp.stack(jnp.unstack(x + y, axis=1), axis=0),
    lambda x, y: sum(jnp.unstack(x * y, axis=0)),
]


@pytest.mark.parametrize("i", range(len(STACKS)))
def test_stack_and_unstack_have_rules(mesh, rng, i):
    """jnp.stack / jnp.unstack are the stack / unstack primitives in JAX 0.10: the new axis stays whole,
    the other dims keep their splits, and nothing falls back."""
    args = [randn(rng, 8, 4), randn(rng, 8, 4)]
    check(STACKS[i], args, mesh, seed=i)
    assert gs.explain(STACKS[i], mesh, *args).fallbacks == []


def test_fallback_is_correct_and_reported(rng):
    mesh = get_mesh("8")

    def fn(x):
        x = gs.split(x, 0, 8)
        return gs.split(jnp.fft.fft(x).real, 0, 8)

    x = randn(rng, 16, 8)
    assert_close(gs.partition(fn, mesh)(x), fn(x))
    report = gs.explain(fn, mesh, x)
    assert [r.primitive for r in report.fallbacks] == ["fft"]
    assert "fft" in str(report) and "FALLBACK" in str(report)


# --------------------------------------------------------------------------- einsum property test

@st.composite
def einsum_case(draw, sizes_from=(2, 4, 8)):
    letters = list(string.ascii_lowercase[:6])
    sizes = {c: draw(st.sampled_from(sizes_from)) for c in letters}
    lhs = draw(st.lists(st.sampled_from(letters), min_size=1, max_size=3, unique=True))
    rhs = draw(st.lists(st.sampled_from(letters), min_size=1, max_size=3, unique=True))
    both = set(lhs) | set(rhs)
    out = [c for c in sorted(both) if draw(st.booleans()) or (c in lhs) != (c in rhs)]
    out = draw(st.permutations(out))
    mesh_name = draw(st.sampled_from(list(MESHES)))
    seed = draw(st.integers(0, 2 ** 16))
    return "".join(lhs), "".join(rhs), "".join(out), sizes, mesh_name, seed


def _run_einsum(case, uneven):
    lhs, rhs, out, sizes, mesh_name, seed = case
    rng = np.random.default_rng(seed)
    a = randn(rng, *[sizes[c] for c in lhs])
    b = randn(rng, *[sizes[c] for c in rhs])
    spec = f"{lhs},{rhs}->{out}"
    check(lambda x, y: jnp.einsum(spec, x, y), [a, b], get_mesh(mesh_name), seed=seed, n=2, uneven=uneven)


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(einsum_case())
def test_random_einsums(case):
    _run_einsum(case, uneven=False)


@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(einsum_case(sizes_from=(2, 3, 5, 6, 8, 10)))
def test_random_einsums_uneven(case):
    _run_einsum(case, uneven=True)
