"""gs.pipeline: schedule tables as data, equivalence with the unpipelined function, collectives."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gshard_jax as gs
from gshard_jax.partitioner.reporting.hlo import collective_stats
from gshard_jax.pipelines import schedules as S
from helpers import assert_per_step_matches_hlo, assert_report_matches_hlo, hlo_stats

L, D, B = 8, 16, 16


# ------------------------------------------------------------------------------------------ tables as data
def _cases():
    for name in S.SCHEDULES:
        for p in (1, 2, 4, 8):
            for r in ((1,) if name in ("gpipe", "1f1b") else (1, 2, 3)):
                for m in (p, 2 * p, 4 * p, 8 * p) + ((1, 3) if r == 1 else ()):
                    yield name, p, m, r


def _slots(wave, sc):
    got = {}
    for t in range(sc.ticks):
        for s in range(sc.stages):
            if wave.microbatch[t, s] >= 0:
                key = (int(wave.microbatch[t, s]), int(wave.repeat[t, s]), s)
                assert key not in got, f"{key} runs twice"
                got[key] = t
    return got


@pytest.mark.parametrize("name,p,m,r", list(_cases()))
def test_schedule_table_runs_every_chunk_once_in_dependency_order(name, p, m, r):
    sc = S.make(name, p, m, r)
    f = _slots(sc.forward, sc)
    assert len(f) == m * r * p
    for (i, k, s), t in f.items():  # each input is the previous stage's (or repeat's) output, one tick earlier
        if s > 0:
            assert f[(i, k, s - 1)] == t - 1
        elif k > 0:
            assert f[(i, k - 1, p - 1)] == t - 1
    assert sc.bubble == pytest.approx(sc.theory, abs=1e-12)  # (p - 1) / (m r + p - 1)
    if sc.backward is None:
        assert sc.ticks == m * r + p - 1 and sc.stash == 0
        return
    b = _slots(sc.backward, sc)
    assert len(b) == m * r * p
    live = np.zeros((sc.ticks, p), int)
    for (i, k, s), t in b.items():
        assert t >= f[(i, k, s)]
        if s < p - 1:
            assert b[(i, k, s + 1)] == t - 1  # the gradient comes down one stage per tick
        elif k < r - 1:
            assert b[(i, k + 1, 0)] == t - 1
        else:
            assert t == f[(i, k, s)]  # the last virtual stage: forward, loss and backward in one tick
        assert sc.backward.slot[t, s] == sc.forward.slot[f[(i, k, s)], s]  # reads what its forward stashed
        live[f[(i, k, s)]:t + 1, s] += 1
    assert live.max() <= 2 * r * p - 1 == sc.stash  # the stash bound, whatever m is
    warm, steady, cool = sc.phases
    assert (len(warm), len(cool)) == (r * p - 1, r * p - 1) and len(steady) == m * r + p - r * p


def test_one_f_one_b_stash_does_not_grow_with_microbatches():
    assert {S.make("1f1b", 4, m).stash for m in (4, 8, 16, 32)} == {7}
    assert S.make("interleaved_1f1b", 4, 8, 2).bubble == pytest.approx(S.make("1f1b", 4, 8).bubble / 2, rel=0.25)


def test_a_jitted_stage_stashes_only_what_depends_on_the_activation():
    """The schedules jit the stage function (traced once for all its calls), so its residuals leave one jit
    call: a weight's cast and transpose must still be told apart from the activation's residuals, and be
    recomputed at the backward rather than stashed once per microbatch."""
    from gshard_jax.pipelines.residuals import Residuals

    def stage(w, x):
        return jnp.tanh(x @ w["a"].T.astype(jnp.float32)) @ w["b"]

    w = {"a": jax.ShapeDtypeStruct((4, D, D), jnp.bfloat16), "b": jax.ShapeDtypeStruct((4, D, D), jnp.float32)}
    x = jax.ShapeDtypeStruct((4, B, D), jnp.float32)
    plain, jitted = (Residuals(jax.vmap, f, w, x) for f in (stage, jax.jit(stage)))
    assert jitted.on_x == plain.on_x and not all(plain.on_x)
    assert [s.shape for s in jitted.stashed] == [s.shape for s in plain.stashed]
    assert all(s.shape == (B, D) for s in jitted.stashed)  # activations only: no [D, D] weight per microbatch


@pytest.mark.parametrize("args,match", [
    (("zigzag", 4, 8, 1), "expected one of"),
    (("1f1b", 4, 8, 2), "repeats=1"),
    (("circular", 4, 6, 2), "multiple of 4"),
    (("gpipe", 4, 0, 1), "num_microbatches=0"),
])
def test_bad_schedules_say_what_would_work(args, match):
    with pytest.raises(ValueError, match=match):
        S.make(*args)


# ---------------------------------------------------------------------------------- against the reference
def _problem(seed=0, rows=B):
    k = jax.random.split(jax.random.key(seed), 4)
    return (jax.random.normal(k[0], (L, D, D)) / 4, jax.random.normal(k[1], (rows, D)),
            jax.random.normal(k[2], (D, 3)), jax.random.normal(k[3], (rows, 3)))


def _layer(w, h):
    return jnp.tanh(h @ w)


def _stage(w, h):
    for i in range(w.shape[0]):
        h = _layer(w[i], h)
    return h, {"sq": jnp.sum(h ** 2), "count": jnp.float32(1.0)}


def _loss(hp, y, t):
    return jnp.sum((y @ hp - t) ** 2)


def _reference(W, x, H, t, m):
    """The unpipelined model, microbatched as the pipeline microbatches (rows i, i + m, ...)."""
    def objective(W, x, H):
        total = 0.0
        for i in range(m):
            h = x[i::m]
            for w in W:
                h = _layer(w, h)
            total += _loss(H, h, t[i::m])
        return total

    return jax.value_and_grad(objective, argnums=(0, 1, 2))(W, x, H)


def _chunked(W, p, r):
    """[layers, ...] in order -> [p, n, ...] or [r, p, n, ...]: chunk k p + s at [k, s]."""
    n = W.shape[0] // (p * r)
    return W.reshape(p, n, D, D) if r == 1 else W.reshape(r, p, n, D, D)


def _unchunked(g):
    return g.reshape(-1, D, D)


def _piped(schedule, p, r, m, x_spec=None):
    def f(W, x, H, t):
        (loss, aux), (gw, gx, gh) = gs.pipeline_value_and_grad(
            _stage, _chunked(W, p, r), x, _loss, H, t, num_microbatches=m, schedule=schedule, repeats=r,
            has_aux=True, aux_weights={"sq": 0.0, "count": 0.0}, x_spec=x_spec)
        return loss, aux, _unchunked(gw), gx, gh
    return f


@pytest.mark.parametrize("schedule,r", [("gpipe", 1), ("1f1b", 1), ("circular", 2), ("interleaved_1f1b", 2)])
@pytest.mark.parametrize("k", [1, 2, pytest.param(4, marks=pytest.mark.slow)])
def test_every_schedule_equals_the_unpipelined_function(schedule, r, k):
    W, x, H, t = _problem()
    p = 4 if r == 1 else 2
    m = k * p
    loss, aux, gw, gx, gh = _piped(schedule, p, r, m)(W, x, H, t)
    ref_loss, (rw, rx, rh) = _reference(W, x, H, t, m)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for a, b in ((gw, rw), (gx, rx), (gh, rh)):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)
    assert float(aux["count"]) == m * p * r  # one per microbatch and chunk: bubbles add nothing


@pytest.mark.parametrize("schedule,r", [("gpipe", 1), ("1f1b", 1), ("circular", 2), ("interleaved_1f1b", 2)])
def test_a_partitioned_schedule_traces_its_stage_once(schedule, r):
    """The schedules call the stage from several places (the residuals' probe, the aux shapes, each phase's
    loop body); partitioned, JAX traces it once for all of them (a model's stage is most of the trace: the
    planner traces one per candidate). Counted, not timed: it was traced 2 (gpipe) to 4 times."""
    W, x, H, t = _problem()
    W = jnp.concatenate([W, W[::-1]]) if r > 1 else W
    traced = []

    def stage(w, h):
        traced.append(w.shape)
        return _stage(w, h)

    def f(Wc, x, H, t):
        return gs.pipeline_value_and_grad(stage, Wc, x, _loss, H, t, num_microbatches=8, schedule=schedule,
                                          repeats=r, has_aux=True)

    gs.explain(f, gs.make_mesh(MESHES["stage4_data2"]), _chunked(W, 4, r), x, H, t)
    assert len(traced) == 1, traced


def test_forward_pipeline_equals_the_layers_and_sums_aux():
    W, x, _, _ = _problem()
    y, aux = gs.pipeline(_stage, _chunked(W, 2, 2), x, num_microbatches=4, schedule="circular", repeats=2,
                         has_aux=True)
    h = x
    for layer in range(L):
        h = _layer(W[layer], h)
    np.testing.assert_allclose(y, h, atol=1e-6)
    assert float(aux["count"]) == 4 * 4


def test_aux_weights_enter_the_gradient():
    W, x, H, t = _problem()

    def with_aux(W):
        (loss, aux), (gw, _, _) = gs.pipeline_value_and_grad(
            _stage, _chunked(W, 4, 1), x, _loss, H, t, num_microbatches=4, schedule="1f1b", has_aux=True,
            aux_weights={"sq": 0.5, "count": 0.0})
        return loss + 0.5 * aux["sq"], gw

    def plain(W):
        y, aux = gs.pipeline(_stage, _chunked(W, 4, 1), x, num_microbatches=4, has_aux=True)
        ys, ts = y.reshape(B // 4, 4, -1).swapaxes(0, 1), t.reshape(B // 4, 4, -1).swapaxes(0, 1)
        return sum(_loss(H, ys[i], ts[i]) for i in range(4)) + 0.5 * aux["sq"]

    value, gw = with_aux(W)
    ref, rw = jax.value_and_grad(plain)(W)
    np.testing.assert_allclose(value, ref, rtol=1e-5)
    np.testing.assert_allclose(gw, _chunked(rw, 4, 1), atol=1e-4)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_nan_in_bubble_inputs_cannot_leak(schedule, monkeypatch):
    """Bubble slots start from NaN instead of zeros: the loss and gradients are finite and unchanged."""
    from gshard_jax.pipelines import common as PL
    W, x, H, t = _problem()
    clean = _piped(schedule, 4, 1, 4)(W, x, H, t)
    real = PL.Run.state

    def poisoned(self, tree):
        return real(self, jax.tree.map(lambda a: jnp.where(jnp.isfinite(a) & (a == 0), jnp.nan, a), tree))

    monkeypatch.setattr(PL.Run, "state", poisoned)
    dirty = _piped(schedule, 4, 1, 4)(W, x, H, t)
    for a, b in zip(jax.tree.leaves(clean), jax.tree.leaves(dirty)):
        assert np.all(np.isfinite(b))
        np.testing.assert_allclose(a, b, rtol=1e-6)


# ------------------------------------------------------------------------------------------- partitioned
# collective-permutes the compiled step needs: one roll per loop (GPipe: the forward scan and its
# transpose; 1F1B: forward in warmup and steady, backward in steady and cooldown)
PERMUTES = {"gpipe": 2, "circular": 2, "1f1b": 4, "interleaved_1f1b": 4}


def _permutes(schedule, p, r):
    """A cooldown of one tick (1F1B on 2 stages) is no loop, and rolls no gradient (nothing reads it)."""
    return PERMUTES[schedule] - (schedule in S.OWN_BACKWARD and r * p - 1 == 1)


MESHES = {"stage4_data2": {"stage": 4, "data": 2}, "stage8": {"stage": 8},
          "stage2_expert2_data2": {"stage": 2, "expert": 2, "data": 2}}


def _partitioned_cases():
    for schedule, r in (("gpipe", 1), ("1f1b", 1), ("circular", 2), ("interleaved_1f1b", 2)):
        for mesh in MESHES:
            for k in (1, 2, 4):
                fast = mesh == "stage4_data2" and k == 2
                yield pytest.param(schedule, r, mesh, k, marks=() if fast else pytest.mark.slow,
                                   id=f"{schedule}-{mesh}-m{k}p")


@pytest.mark.parametrize("schedule,r,mesh_name,k", list(_partitioned_cases()))
def test_partitioned_pipeline_permutes_and_never_gathers_the_stages(schedule, r, mesh_name, k):
    mesh = gs.make_mesh(MESHES[mesh_name])
    p = mesh.shape["stage"]
    shards = mesh.shape.get("data", 1) * mesh.shape.get("expert", 1)
    W, x, H, t = _problem(rows=max(B, k * p * shards))  # every microbatch splits over the batch axes
    if L % (p * r):
        W = jnp.concatenate([W, W[::-1]])  # 16 layers for 8 stages x 2 repeats
    Win = _chunked(W, p, r)  # as a model stores them: [stages, ...] or [repeats, stages, ...]
    m = k * p
    batch = tuple(("data", "expert") if "expert" in mesh.shape else ("data",) if "data" in mesh.shape else ())
    x_spec = ((batch or None),)

    def f(Wc, x, H, t):
        (loss, _), (gw, gx, gh) = gs.pipeline_value_and_grad(
            lambda w, h: _stage(w, h)[0], Wc, x, _loss, H, t, num_microbatches=m, schedule=schedule, repeats=r,
            x_spec=x_spec)
        return loss, gw, gx, gh

    jitted = gs.partition(f, mesh)
    got = jitted(Win, x, H, t)
    want = f(Win, x, H, t)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)
    stats = hlo_stats(jitted, Win, x, H, t)
    assert stats["collective-permute"]["count"] == _permutes(schedule, p, r)
    assert stats["all-gather"]["count"] == 0  # the stacked parameters stay on their stages
    report = gs.explain(f, mesh, Win, x, H, t)
    assert_report_matches_hlo(report, stats)
    (pl,) = report.pipelines
    assert (pl["schedule"], pl["stages"], pl["microbatches"], pl["repeats"]) == (schedule, p, m, r)
    assert f"pipeline {schedule}: {p} stages" in str(report)
    # no more bytes than XLA's partitioner in what a call executes (a loop's collectives times its trips: a
    # weight gradient's reduction deferred past the tick loop is listed outside it, once, and runs once)
    compiled = jitted.lower(Win, x, H, t).compile()
    ours = collective_stats(compiled, per_step=True)
    xla = collective_stats(gs.partition(f, mesh, backend="xla").lower(Win, x, H, t).compile(), per_step=True)
    assert_per_step_matches_hlo(report, compiled)
    for kind in ("all-reduce", "all-gather", "collective-permute", "all-to-all", "reduce-scatter"):
        assert ours[kind]["payload_bytes"] <= xla[kind]["payload_bytes"], (kind, ours, xla)


def test_roll_of_a_split_dim_is_one_permute_both_ways():
    mesh = gs.make_mesh({"stage": 8})
    x = jnp.arange(16.0 * 3).reshape(16, 3)

    def f(x):
        x = gs.shard(x, ("stage",))
        return gs.shard(jnp.roll(x, 2, axis=0) * 2.0, ("stage",))

    jitted = gs.partition(f, mesh)
    np.testing.assert_array_equal(jitted(x), f(x))
    assert hlo_stats(jitted, x)["collective-permute"]["count"] == 1
    odd = gs.partition(lambda x: gs.shard(jnp.roll(gs.shard(x, ("stage",)), 3, axis=0), ("stage",)), mesh)
    np.testing.assert_array_equal(odd(x), jnp.roll(x, 3, axis=0))
    assert hlo_stats(odd, x)["collective-permute"]["count"] == 2  # a block and a half: two pieces
    g = gs.partition(jax.grad(lambda x: jnp.sum(f(x) * jnp.arange(16.0)[:, None])), mesh)
    np.testing.assert_allclose(g(x), jax.grad(lambda x: jnp.sum(f(x) * jnp.arange(16.0)[:, None]))(x))


def test_docs_schedule_table_is_the_tables():
    import os
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "pipeline.md")
    rows = [line.strip().strip("|").split("|") for line in open(path) if line.startswith("| ") and "%" in line]
    assert len(rows) == 12
    for name, r, m, ticks, bubble, theory, stash in ([c.strip() for c in row] for row in rows):
        sc = S.make(name, 4, int(m), int(r))
        assert (sc.ticks, f"{sc.bubble:.1%}", f"{sc.theory:.1%}", str(sc.stash or "-")) == (int(ticks), bubble, theory,
                                                                                          stash)


@pytest.mark.slow  # 40 s
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_flax_block_with_an_optax_loss_pipelines_like_xla(schedule):
    """Library code as the stage and loss (a Flax linen pre-norm MLP block, optax's cross-entropy): the
    values of the unpipelined loop, explain() equal to the HLO, XLA's bytes and flops within 5%."""
    import flax.linen as nn
    import optax

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            return x + nn.Dense(32)(nn.gelu(nn.Dense(64)(nn.LayerNorm()(x))))

    p, m, block = 4, 8, Block()
    x = jax.random.normal(jax.random.key(0), (32, 32))
    t = jax.random.randint(jax.random.key(1), (32,), 0, 32)
    W = jax.vmap(lambda k: block.init(k, x[:1]))(jax.random.split(jax.random.key(2), p))  # [stages, ...]
    loss = lambda scale, y, t: optax.softmax_cross_entropy_with_integer_labels(y * scale, t).sum()
    mesh = gs.make_mesh({"stage": p, "data": 2})

    def f(W, x, t):
        return gs.pipeline_value_and_grad(block.apply, W, x, loss, jnp.float32(1.0), t, num_microbatches=m,
                                          schedule=schedule, x_spec=(("data",),))

    def reference(W):
        total = 0.0
        for i in range(m):
            h = x[i::m]
            for s in range(p):
                h = block.apply(jax.tree.map(lambda a: a[s], W), h)
            total += loss(1.0, h, t[i::m])
        return total

    ours = gs.partition(f, mesh)
    (value, _), (grads, _, _) = ours(W, x, t)
    want, want_grads = jax.jit(jax.value_and_grad(reference))(W)
    np.testing.assert_allclose(value, want, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)
    stats = hlo_stats(ours, W, x, t)
    assert_report_matches_hlo(gs.explain(f, mesh, W, x, t), stats)
    xla = gs.partition(f, mesh, backend="xla")
    xla_stats = hlo_stats(xla, W, x, t)
    for kind in ("all-reduce", "all-gather", "collective-permute", "all-to-all", "reduce-scatter"):
        assert stats[kind]["payload_bytes"] <= xla_stats[kind]["payload_bytes"], kind

    def flops(fn):
        ca = fn.lower(W, x, t).compile().cost_analysis()
        return (ca[0] if isinstance(ca, list) else ca)["flops"]
    assert flops(ours) <= 1.05 * flops(xla)


@pytest.mark.parametrize("schedule,r", [("1f1b", 1), ("gpipe", 1), pytest.param("circular", 2, marks=pytest.mark.slow),
                                        pytest.param("interleaved_1f1b", 2, marks=pytest.mark.slow)])
def test_owned_ends_keep_the_input_and_head_gradients_on_their_stages(schedule, r):
    """owned_ends: x and the loss params lead with [stages]; stage 0 reads its slice of x and the last stage
    runs the loss on its own outputs with its slice of the head. The loss and the layers' gradients are the
    replicated ends' (the unpipelined function's), d x and d head come back on their owners only, and
    partitioned over {stage 4, data 2} nothing crosses the stage axis but the stages' permutes and the
    scalar loss: the replicated ends' run all-reduces d x and the outputs (GPipe, circular) or d head (1F1B)
    over it."""
    mesh = gs.make_mesh({"stage": 4, "data": 2})
    p, m = 4, 8
    W, x, H, t = _problem(rows=32)
    W = jnp.concatenate([W, W[::-1]]) if L % (p * r) else W
    Win = _chunked(W, p, r)
    poison = jnp.full_like(x, jnp.nan)
    x_p = jnp.stack([x] + [poison] * (p - 1))  # only stage 0's slice may be read
    H_p = jnp.stack([jnp.full_like(H, jnp.nan)] * (p - 1) + [H])  # only the last stage's

    def run(owned):
        def f(Wc, x, H, t):
            (loss, _), (gw, gx, gh) = gs.pipeline_value_and_grad(
                lambda w, h: _stage(w, h)[0], Wc, x, _loss, H, t, num_microbatches=m, schedule=schedule,
                repeats=r, x_spec=(("data",),), owned_ends=owned)
            return loss, gw, gx, gh
        return f

    want = run(False)(Win, x, H, t)
    part = gs.partition(run(True), mesh)
    for got in (run(True)(Win, x_p, H_p, t), part(Win, x_p, H_p, t)):
        np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
        np.testing.assert_allclose(got[1], want[1], atol=1e-4, rtol=1e-4)
        np.testing.assert_allclose(got[2][0], want[2], atol=1e-4, rtol=1e-4)
        np.testing.assert_allclose(got[3][p - 1], want[3], atol=1e-4, rtol=1e-4)
        assert not np.asarray(got[2][1:]).any() and not np.asarray(got[3][:p - 1]).any()

    def over_stage(report, kind):
        return sum(c.payload * c.runs * row.trips for row in report.rows for c in row.collectives
                   if c.kind == kind and "stage" in c.axes)

    owned = gs.explain(run(True), mesh, Win, x_p, H_p, t)
    replicated = gs.explain(run(False), mesh, Win, x, H, t)
    # d x (each device its half of the rows) and, summed over the stages, the outputs (as big: the loss then runs
    # on every stage) or d head and the loss (1F1B runs the loss on the last stage)
    own = schedule in S.OWN_BACKWARD
    ends = x.nbytes // 2 + (H.nbytes + 4 if own else x.nbytes // 2)
    assert over_stage(replicated, "all-reduce") == ends
    assert over_stage(owned, "all-reduce") + over_stage(owned, "reduce-scatter") <= 4  # the loss, a float32 scalar
    assert over_stage(owned, "collective-permute") == over_stage(replicated, "collective-permute")
    assert_report_matches_hlo(owned, hlo_stats(part, Win, x_p, H_p, t))
    with pytest.raises(ValueError, match=r"every leaf of loss_params must lead with the 4 stages"):
        run(True)(Win, x_p, H, t)
