"""explain() equals the compiled program: per collective kind, the same count and payload bytes.

The programs here cover what other test files do not already check this way
(the ecosystem catalogue, checkpointed regions, train steps, the program
boundary and GShard's per-op table check it themselves): control flow,
gathers and scatters, uneven splits, sorting and cumulative ops, random bits, bf16 exchanges.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_control_flow import layers, stacked

import gshard_jax as gs
from helpers import assert_report_matches_hlo, get_mesh, hlo_stats, randn


def _while(x):
    x = gs.shard(x, ("data", None))
    return jax.lax.while_loop(lambda c: jnp.sum(c[0]) < 100.0, lambda c: (c[0] * 1.5 + 1.0, c[1] + 1),
                              (jnp.abs(x), 0))


def _cond(x, p):
    x = gs.shard(x, ("data", "model"))
    return jax.lax.cond(p > 0, lambda v: jnp.sum(v, axis=0), lambda v: jnp.max(v, axis=0), x)


def _embedding(table, ids, g):
    table = gs.shard(table, ("model", None))
    out, vjp = jax.vjp(lambda t: jnp.take(t, gs.shard(ids, ("data",)), axis=0), table)
    return out, vjp(g)[0]


def _uneven(x, w):
    h = gs.shard(jnp.tanh(gs.shard(x, (("data", "model"), None)) @ w), (("data", "model"), None))
    return jnp.cumsum(h, axis=0), jnp.sort(h, axis=0), jax.lax.top_k(h.T, 3)


def _random(key, x):
    x = gs.shard(x, ("data", "model"))
    return x * jax.random.uniform(key, x.shape) + jnp.argmax(x, axis=0)


def _scatter(x, idx, upd):
    x = gs.shard(x, (None, "model"))
    return x.at[idx].add(gs.shard(upd, ("data", "model"))), jnp.pad(x, ((1, 1), (0, 0)), mode="edge")


def _bfloat16(x, w):
    """bf16 collectives: XLA:CPU sends them as f32, and the report must say so (small integers: exact in bf16)."""
    x = gs.shard(x.astype(jnp.bfloat16), ("data", "model"))
    h = x @ gs.shard(w.astype(jnp.bfloat16), ("model", None))  # contracting dim split: all-reduce
    return gs.shard(h, (None, "data")).astype(jnp.float32)  # rows to columns: all-to-all


PROGRAMS = {
    "scan_layers": lambda rng: (layers, (randn(rng, 8, 16), stacked(rng))),
    "scan_layers_grad": lambda rng: (jax.grad(lambda x, ws: jnp.sum(layers(x, ws)[0] ** 2), argnums=1),
                                     (randn(rng, 8, 16), stacked(rng))),
    "while": lambda rng: (_while, (randn(rng, 8, 4),)),
    "cond": lambda rng: (_cond, (randn(rng, 8, 8), np.float32(1.0))),
    "embedding_and_grad": lambda rng: (_embedding, (randn(rng, 16, 8), rng.integers(0, 16, 8).astype(np.int32),
                                                    randn(rng, 8, 8))),
    "uneven_cumsum_sort_topk": lambda rng: (_uneven, (randn(rng, 10, 6), randn(rng, 6, 6))),
    "random_bits_argmax": lambda rng: (_random, (jax.random.key(3), randn(rng, 8, 8))),
    "scatter_add_and_edge_pad": lambda rng: (_scatter, (randn(rng, 6, 8), rng.integers(0, 6, 4).astype(np.int32),
                                                        randn(rng, 4, 8))),
    "bfloat16_all_reduce_and_all_to_all": lambda rng: (_bfloat16, (np.round(4 * randn(rng, 8, 8)),
                                                                   np.round(4 * randn(rng, 8, 8)))),
}


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_report_equals_compiled_program(name, rng):
    mesh = get_mesh("2x4")
    fn, args = PROGRAMS[name](rng)
    report = gs.explain(fn, mesh, *args)
    part = gs.partition(fn, mesh)
    want, got = jax.jit(fn)(*args), part(*args)
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        if jnp.issubdtype(jnp.asarray(w).dtype, jax.dtypes.prng_key):
            continue
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
    assert_report_matches_hlo(report, hlo_stats(part, *args))
