"""Outputs that are inputs, other outputs or constants, given an out_sharding of their own: resharded on exit,
as jax.jit takes them."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from helpers import assert_report_matches_hlo, gs, hlo_stats, randn


def _spec(arr):
    return tuple(arr.sharding.spec) + (None,) * (arr.ndim - len(arr.sharding.spec))


def _same(got, want, specs, mesh):
    for g, w, spec in zip(got, want, specs):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
        assert g.sharding.is_equivalent_to(NamedSharding(mesh, P(*spec)), g.ndim), (g.sharding, spec)


CASES = {
    # name: (function, in_shardings, out_shardings, argument shapes)
    "input returned with another sharding": (lambda a, b: (a * 2, b), (P("a", "b"), P("a", "b")),
                                             (P("a", None), P("b", "a")), [(8, 8), (8, 8)]),
    "one input returned twice, two shardings": (lambda a: (a, a), (P("a", "b"),), (P("a", "b"), P("b", "a")),
                                                [(8, 16)]),
    "an output that is another output": (lambda a: (a + 1, a + 1), (P(),), (P("a", None), P(None, "b")),
                                         [(8, 16)]),
    "a constant output": (lambda a: (a, jnp.zeros((8, 4), jnp.float32)), (P("a"),), (P("a"), P("b", None)),
                          [(8,)]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_passthrough_output_is_resharded_on_exit(name):
    fn, ins, outs, shapes = CASES[name]
    mesh = gs.make_mesh({"a": 2, "b": 4})
    rng = np.random.default_rng(0)
    args = [randn(rng, *s) for s in shapes]
    f = gs.partition(fn, mesh, in_shardings=ins, out_shardings=outs)
    want = jax.jit(fn, in_shardings=tuple(NamedSharding(mesh, s) for s in ins),
                   out_shardings=tuple(NamedSharding(mesh, s) for s in outs))(*args)
    _same(f(*args), want, outs, mesh)
    report = gs.explain(fn, mesh, *args, in_shardings=ins, out_shardings=outs)
    assert_report_matches_hlo(report, hlo_stats(f, *args))


def test_the_random_program_that_found_it():
    """fn(v0, v1, v2) returning (v15, v1), v1 in_sharding P('a', 'b') and out_sharding ('b', 'a') on {a 2, b 4}."""
    mesh = gs.make_mesh({"a": 2, "b": 4})
    rng = np.random.default_rng(1)
    v0, v1, v2 = randn(rng, 8, 8), randn(rng, 8, 8), randn(rng, 8)

    def fn(v0, v1, v2):
        v15 = jnp.tanh(v0 @ v1) + v2
        return v15, v1

    ins, outs = (P(), P("a", "b"), P()), (P(None, "b"), ("b", "a"))
    f = gs.partition(fn, mesh, in_shardings=ins, out_shardings=outs)
    got = f(v0, v1, v2)
    want = jax.jit(fn)(v0, v1, v2)
    _same(got, want, [(None, "b"), ("b", "a")], mesh)
    stats = hlo_stats(f, v0, v1, v2)
    report = gs.explain(fn, mesh, v0, v1, v2, in_shardings=ins, out_shardings=outs)
    assert_report_matches_hlo(report, stats)
    (row,) = [r for r in report.rows if r.primitive == "output" and r.source == "out[1]"]
    assert row.collectives  # the input leaves resharded from [a, b] to [b, a]
