"""A Flax lm1b-style train step (tests/lm1b_style.py: dropout, a padding-and-causal mask, a tied embedding,
masked cross-entropy, global-norm clipping and AdamW) partitioned as XLA's partitioner partitions it."""
import jax
import jax.numpy as jnp
import lm1b_style
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import gshard_jax as gs
from helpers import assert_close, assert_report_matches_hlo, get_mesh, hlo_stats


def no_more_than_xla(ours: dict, xla: dict) -> None:
    """Per collective kind, no more collectives and payload bytes per device than XLA's; none more in all."""
    for kind in ours:
        assert ours[kind]["count"] <= xla[kind]["count"], (kind, ours, xla)
        assert ours[kind]["payload_bytes"] <= xla[kind]["payload_bytes"], (kind, ours, xla)
    total = lambda s: sum(v["payload_bytes"] for v in s.values())  # noqa: E731
    assert total(ours) <= total(xla), (total(ours), total(xla))


@pytest.mark.slow  # 16-30 s here (three compiles of the step); the next test covers its cause by default
def test_lm1b_style_train_step_matches_xla():
    """Numbers equal jax.jit's; per collective kind no more collectives and bytes than XLA's partitioner."""
    case = lm1b_style.build()
    mesh = gs.make_mesh(case.mesh_axes)
    kw = {"in_shardings": case.in_shardings, "out_shardings": case.out_shardings}
    report = gs.explain(case.step, mesh, *case.args, **kw)
    assert not report.fallbacks, [(r.primitive, r.source) for r in report.fallbacks]
    ours_fn = gs.partition(case.step, mesh, **kw).lower(*case.args).compile()  # compiled once: run and counted
    xla_fn = gs.partition(case.step, mesh, backend="xla", **kw).lower(*case.args).compile()
    assert_close(ours_fn(*case.args), jax.jit(case.step)(*case.args), rtol=1e-5, atol=1e-5)
    ours, xla = gs.collective_stats(ours_fn), gs.collective_stats(xla_fn)
    assert_report_matches_hlo(report, ours)
    # the dropout key (a typed key<fry> argument) counts as its key data, as XLA counts it
    assert report.argument_bytes()["total"] == ours_fn.memory_analysis().argument_size_in_bytes
    no_more_than_xla(ours, xla)


def test_a_squared_zero_shared_by_two_norms_carries_no_split():
    """optax's norms add each leaf's squared imaginary part, square(broadcast 0), for every leaf. Merged into one
    value for two leaves of a shape, it carried the split of one leaf's gradient (rows over "model") to the
    other's (replicated), which was then gathered to leave the program: lm1b's tied embedding took the split
    of the MLP kernel of its shape. Made for each use, nothing moves that XLA does not move."""
    mesh = get_mesh("2x4")

    def fn(k, e, x):
        def loss(p):
            x_ = gs.shard(x, ("data", None))
            return jnp.sum(jnp.tanh(x_ @ p["e"].T)) + jnp.sum(jnp.tanh(x_ @ p["k"].T))
        g = jax.grad(loss)({"k": k, "e": e})
        n = optax.tree.norm(g)
        return k - g["k"] / n, e - g["e"] / n

    rng = np.random.default_rng(0)
    args = [rng.standard_normal(s).astype(np.float32) for s in ((64, 32), (64, 32), (8, 32))]
    kw = {"in_shardings": (P("model", None), P(), None), "out_shardings": (P("model", None), P())}
    f = gs.partition(fn, mesh, **kw)
    assert_close(f(*args), jax.jit(fn)(*args), rtol=1e-6, atol=1e-6)
    ours, xla = hlo_stats(f, *args), hlo_stats(gs.partition(fn, mesh, backend="xla", **kw), *args)
    assert ours["all-gather"]["count"] == 0, ours
    assert_report_matches_hlo(gs.explain(fn, mesh, *args, **kw), ours)
    no_more_than_xla(ours, xla)
