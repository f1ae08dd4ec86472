"""The step's temporaries (partitioner/costs/liveness.py): which values are alive at each point of the program, and
explain()'s predicted peak of them per device. On 8 simulated CPU devices."""
from __future__ import annotations

import functools
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import gshard_jax as gs
from gshard_jax.partitioner.costs import lifetimes, liveness
from gshard_jax.partitioner.representation.program import from_jaxpr

B, D, H = 256, 128, 512
F32 = 4


def mlp(x, w1, w2):
    return jnp.tanh(x @ w1) @ w2


def mlp_args():
    r = np.random.default_rng(0)
    return [jnp.asarray(r.standard_normal(s), jnp.float32) for s in ((B, D), (D, H), (H, D))]


def test_a_chains_peak_is_the_two_hidden_activations_it_holds_at_once():
    """x @ w1 (B x H) is alive while tanh makes its result (B x H); the output (B x D) is not a temporary."""
    report = gs.explain(mlp, gs.make_mesh({"data": 8}), *mlp_args(), in_shardings=(P(), P(), P()))
    assert report.temporaries.bytes == 2 * B * H * F32
    assert report.temporaries.op.startswith("tanh at ")
    assert [b for _, b in report.temporaries.largest] == [B * H * F32] * 2


def test_a_split_batch_divides_the_temporaries_by_the_devices_it_is_split_over():
    report = gs.explain(mlp, gs.make_mesh({"data": 8}), *mlp_args(), in_shardings=(P("data"), P(), P()))
    assert report.temporaries.bytes == 2 * B * H * F32 // 8


def test_a_scans_body_holds_one_trips_values_and_its_stacked_results_whole():
    """A scan over 12 layers, each making a B x H activation and stacking a B x D result: the body's values
    count once (its buffers are reused each trip), the stacked result (12 x B x D), made as the loop runs, whole."""
    def f(x, w1s, w2s):
        def body(c, w):
            h = jnp.tanh(c @ w[0])  # (B, H), two values: the dot's and tanh's
            y = h @ w[1]
            return y, y * 2.0
        return jax.lax.scan(body, x, (w1s, w2s))[1].sum(0)

    r = np.random.default_rng(0)
    x, w1s, w2s = (jnp.asarray(r.standard_normal(s), jnp.float32) for s in ((B, D), (12, D, H), (12, H, D)))
    program = from_jaxpr(jax.make_jaxpr(f)(x, w1s, w2s))
    lt = lifetimes.lifetimes(program)
    whole = lambda v: liveness.nbytes(v, v.shape)
    peak = liveness.peak(program, whole, lt)
    stacked = 12 * B * D * F32
    # in the body: the dot's and tanh's results, the next carry (B x D) and its double (B x D), the stacked ys
    assert peak.bytes == 2 * B * H * F32 + stacked + B * D * F32, peak
    assert peak.bytes < 2 * stacked  # not 12 trips of the body's values


def test_a_checkpointed_regions_values_are_the_callers():
    """jax.checkpoint's body runs in the caller's points: its values are alive as the caller's are."""
    f = jax.checkpoint(lambda x, w1, w2: jnp.tanh(x @ w1) @ w2)
    plain = liveness.peak(from_jaxpr(jax.make_jaxpr(mlp)(*mlp_args())), lambda v: liveness.nbytes(v, v.shape))
    remat = liveness.peak(from_jaxpr(jax.make_jaxpr(f)(*mlp_args())), lambda v: liveness.nbytes(v, v.shape))
    assert remat.bytes == plain.bytes == 2 * B * H * F32


def test_the_report_shows_and_exports_the_peak():
    report = gs.explain(mlp, gs.make_mesh({"data": 8}), *mlp_args(), in_shardings=(P("data"), P(), P()))
    assert "temporaries at their peak 128.0KiB (at tanh at" in " ".join(report.table().split())
    out = json.loads(report.to_json())
    assert out["memory"]["predicted_temporaries"] == out["temporaries"]["bytes"] == 2 * B * H * F32 // 8


def test_a_train_steps_predicted_memory_is_at_least_what_it_compiles_to():
    """A tiny_moe_lm train step under its rules table: explain()'s arguments, outputs (the state's in its
    donated buffers; the table of the outputs' pointers) and temporaries (with the collectives' tuple tables)
    are at least what the compiled step holds (memory_analysis()), and not far above it."""
    from test_sharded_state import batches, make

    from gshard_jax.planner.memory_check import outputs_bytes

    trainer = make("d2e4")
    state = trainer.init_fn(jax.random.key(0))
    batch = jax.device_put(batches(trainer, 1)[0], trainer.batch_sharding)
    report = trainer.explain(state, batch)
    m = report.compiled_memory
    compiled = m["argument"] + m["output"] - m["alias"] + m["temp"]
    outputs = outputs_bytes(report, set(range(len(jax.tree.leaves(state)))))
    assert outputs == m["output"] - m["alias"]  # (the metrics, and the outputs' table)
    predicted = report.argument_bytes()["total"] + outputs + report.temporaries.bytes
    assert compiled <= predicted <= 1.5 * compiled, (predicted, compiled)


def test_a_program_without_ops_has_no_temporaries_and_is_chosen_under_a_budget():
    mesh, x = gs.make_mesh({"data": 8}), jnp.ones((64, 64))
    report = gs.explain(lambda x: x, mesh, x, auto=True, memory_budget=1e6)
    assert report.temporaries.bytes == 0
    assert "arguments and outputs 4.0KiB and temporaries at their peak 0B" in report.notes[0]  # split 8 ways
    np.testing.assert_array_equal(gs.partition(lambda x: x, mesh, auto=True, memory_budget=1e6)(x), x)


def test_a_copy_counts_against_a_budget_of_many_gigabytes():
    """The integer program's copy variables are in MiB: against a 20 GB budget a 500 MB copy is still a
    coefficient the solver keeps, so the pair of options that would copy it over the budget is refused,
    however much cheaper."""
    from gshard_jax.partitioner.auto import memory as auto_memory, solve as auto_solve

    budget, copy = 2e10, 5e8
    copies = [auto_memory.Copy(0, np.arange(2) == t, copy, [auto_memory.Reader(1, np.arange(2) == t, 0, 0)])
              for t in range(2)]  # option t of node 1 needs the value as option t of node 0 makes it
    row = auto_memory.Row({}, budget - copy / 2, copies, point=0)
    picks = [0, 0]
    unary = [np.array([0.0, 1e-3]), np.array([1e-3, 0.0])]  # apart (a copy) is the cheaper pair
    auto_solve._integer_program(unary, {}, [0, 1], [row], budget, None, picks)
    assert picks[0] == picks[1]
    auto_solve._integer_program(unary, {}, [0, 1], [row], budget + copy, None, picks)
    assert picks == [0, 1]  # with room for the copy, the cheaper pair


def _sunk_program(region: bool):
    """A scan over 12 layers reading a constant made outside it: pointwise in the body, or as a dot's operand
    in a manual region the body runs."""
    mesh = jax.make_mesh((8,), ("data",))

    def f(x, ws):
        z = jnp.full((D, D), 0.5)

        def body(c, w):
            h = jnp.tanh(c @ w)
            if region:
                return jax.shard_map(lambda a, b: a @ b, mesh=mesh, in_specs=(P(), P()), out_specs=P())(h, z), None
            return h * z[0], None
        return jax.lax.scan(body, x, ws)[0]

    r = np.random.default_rng(0)
    x, ws = (jnp.asarray(r.standard_normal(s), jnp.float32) for s in ((B, D), (12, D, D)))
    return from_jaxpr(jax.make_jaxpr(f)(x, ws))


@pytest.mark.newest_jax
def test_a_constant_a_loop_reads_is_made_in_its_body_where_it_is_read():
    """XLA sinks a loop's constant operands into its body: the constant is not held outside the loop, and in
    the body it is made where the op that reads it runs."""
    program = _sunk_program(region=False)
    lt = lifetimes.lifetimes(program)
    const = program.eqns[0].outvars[0]  # the broadcast, before the loop
    scan = next(e for e in program.eqns if e.name == "scan")
    inside = scan.subs["body"].invars[0]
    k = next(k for k, v in enumerate(lt.values) if v is const)
    reader = next(e for e in scan.subs["body"].eqns if inside in e.invars)
    assert const.shape == (D, D) and not any(v is inside for v in lt.values)
    assert lt.start[k] == lt.end[k] == lt.spans[reader][0]
    named = liveness.peak(program, lambda v: liveness.nbytes(v, v.shape), named=20).largest  # (by its op)
    assert named and all(isinstance(what, str) for what, _ in named)


@pytest.mark.newest_jax
def test_a_constant_sunk_into_a_manual_region_is_the_regions_own():
    """A constant the loop sinks and a manual region in its body reads with a dot: held by the region while
    it runs (its temporaries), never through the loop."""
    program = _sunk_program(region=True)
    lt = lifetimes.lifetimes(program)
    assert program.eqns[0].outvars[0] not in lt.values
    (_, _, inside, what), = lt.scratch
    assert inside == D * D * F32 and what.startswith("the temporaries of shard_map")


@pytest.mark.newest_jax
def test_a_relayout_of_a_value_loops_read_is_made_where_the_value_is():
    """A loop body's transpose of a value every trip reads unchanged is hoisted out of the loop, and a
    transpose of it after the loop runs where it is made (XLA reads the value in the layout it is made in once,
    with every reader that changes the layout): both alive from the value's op through the loop."""
    def f(x, w):
        v = jnp.tanh(w)

        def body(c, _):
            return jnp.tanh(jnp.einsum("sbd,sde->sbe", c, jnp.transpose(v, (1, 0, 2)))), None
        y = jax.lax.scan(body, x, None, length=3)[0]
        return jnp.einsum("sbd,sde->sbe", y, jnp.transpose(v, (1, 2, 0)))

    program = from_jaxpr(jax.make_jaxpr(f)(jnp.ones((2, 8, D)), jnp.ones((D, 2, D))))
    lt = lifetimes.lifetimes(program)
    tanh, scan, after = (next(e for e in program.eqns if e.name == n) for n in ("tanh", "scan", "transpose"))
    life = {id(v): (a, b) for v, a, b in zip(lt.values, lt.start, lt.end)}
    made = lt.spans[tanh][0]
    inside = next(e for e in scan.subs["body"].eqns if e.name == "transpose").outvars[0]
    assert life[id(inside)] == (made, lt.spans[scan][1])
    assert life[id(after.outvars[0])][0] == made


@pytest.mark.newest_jax
def test_xla_holds_no_constant_a_loop_reads_outside_it():
    """The premise of sinking: a scan reading two 4 MiB constants pointwise compiles to the carry's 4 MiB of
    temporaries (the constants never held); the liveness is not under it."""
    n = 1 << 20

    def f(x):
        z, u = jnp.full((n,), 0.5), jax.lax.broadcasted_iota(jnp.uint32, (n,), 0) + 3
        return jax.lax.scan(lambda c, _: (jnp.tanh(c) * z + u.astype(jnp.float32), None), x, None, length=4)[0]

    x = jnp.ones((n,))
    temp = jax.jit(f).lower(x).compile().memory_analysis().temp_size_in_bytes
    assert temp < 2 * n * F32
    peak = liveness.peak(from_jaxpr(jax.make_jaxpr(f)(x)), lambda v: liveness.nbytes(v, v.shape))
    assert temp <= peak.bytes


def test_a_scans_results_are_buffers_made_where_its_body_starts_each_trips_written_as_made():
    """A scan's stacked results are constants each trip writes into (XLA makes them where the body the scan
    runs in starts: here the program's start, before the op ahead of the scan), and a trip's result is
    written into them as it is made, not held to the trip's end."""
    def f(x, ws):
        h = jnp.tanh(x)

        def body(c, w):
            y = jnp.tanh(c @ w)
            return jnp.sin(c) @ w, y
        return jax.lax.scan(body, h, ws)

    program = from_jaxpr(jax.make_jaxpr(f)(jnp.ones((B, D)), jnp.ones((4, D, D))))
    lt = lifetimes.lifetimes(program)
    scan = next(e for e in program.eqns if e.name == "scan")
    life = {id(v): (a, b) for v, a, b in zip(lt.values, lt.start, lt.end)}
    y = scan.subs["body"].outvars[1]
    assert life[id(y)][0] == life[id(y)][1] < lt.spans[scan][1]  # written as made
    # (the stacked ys are an output here: what the body's next op reads is alive as usual)
    program = from_jaxpr(jax.make_jaxpr(lambda x, ws: f(x, ws)[1].sum(0))(jnp.ones((B, D)), jnp.ones((4, D, D))))
    lt = lifetimes.lifetimes(program)
    scan = next(e for e in program.eqns if e.name == "scan")
    life = {id(v): (a, b) for v, a, b in zip(lt.values, lt.start, lt.end)}
    assert life[id(scan.outvars[1])][0] == 0 < lt.spans[scan][0]


@pytest.mark.newest_jax
def test_a_stacked_input_a_scan_returns_annotated_holds_no_buffer_of_its_own():
    """JAX's partial evaluation saves a weight a layer annotates (with the sharding it has) as a residual: the
    forward scan returns the stacked weights, which the lowered body returns as it got them and JAX's scan
    forwards. Neither the compiled step nor explain() holds a stacked copy."""
    L, N = 8, 256

    def f(ws, x):
        def body(c, w):
            return jnp.tanh(c @ gs.replicate(w)), None
        return jnp.sum(jax.lax.scan(body, x, ws)[0])

    mesh = gs.make_mesh({"data": 8})
    args = (jnp.ones((L, N, N)) / N, jnp.ones((64, N)))
    step, ins = jax.grad(f), (P(), P("data"))
    stack = L * N * N * F32
    temp = gs.partition(step, mesh, in_shardings=ins).lower(*args).compile().memory_analysis().temp_size_in_bytes
    report = gs.explain(step, mesh, *args, in_shardings=ins)
    assert temp < stack / 2 and report.temporaries.bytes < stack / 2, (temp, report.temporaries)


def test_an_annotation_asking_for_the_sharding_its_operand_has_is_the_operands_buffer():
    """The lowering emits nothing for it: a value annotated so and read beside its annotation is one buffer,
    and an annotated argument is the argument."""
    N = 256

    def f(a, b):
        x = jnp.tanh(a)
        return jnp.sum(x @ gs.replicate(x) @ gs.replicate(b))

    mesh = gs.make_mesh({"data": 8})
    report = gs.explain(f, mesh, jnp.ones((N, N)), jnp.ones((N, N)), in_shardings=(P(), P()))
    # tanh's result and the first product, alive while the second is made (no copy of x or b)
    assert report.temporaries.bytes == 2 * N * N * F32, report.temporaries


@pytest.mark.newest_jax
def test_xla_cpu_copies_a_dot_operand_contracted_over_its_leading_dim_and_explain_counts_it():
    """A weight's gradient x^T dy contracts x over its leading (batch, length) dims: XLA:CPU transposes x into
    a buffer of its own before the dot (its dots take (batch, free, contracting) on the left), as it does a
    weight a backward pass contracts over two dims, and an operand with two free dims before its contracting
    one (GShard's expert output einsum). A lone matrix read transposed (x^T dy over one dim, dy w^T, a batched
    matrix) its GEMM reads in place, unless the dot is a batch of one whose other operand is copied.
    explain() counts exactly those copies."""
    mesh, ins = gs.make_mesh({"data": 8}), (P(), P())
    cases = [("bld,blf->df", (8, 64, 512), (8, 64, 256), 8 * 64 * 512 * F32),  # x copied
             ("blhk,dhk->bld", (8, 64, 4, 32), (128, 4, 32), 128 * 4 * 32 * F32),  # the weight copied
             # the tokens copied, and the dot's result before its transpose
             ("egch,ehm->gecm", (4, 4, 16, 256), (4, 256, 64), (4 * 4 * 16 * 256 + 4 * 4 * 16 * 64) * F32),
             ("bd,bf->df", (512, 512), (512, 512), 0),
             ("blf,df->bld", (8, 64, 512), (128, 512), 0),
             ("bji,bjk->bik", (8, 256, 128), (8, 256, 64), 0),
             ("bji,bjk->bik", (1, 256, 128), (1, 256, 64), 0),
             # a batch of one whose other operand is copied: both copied (XLA:CPU does so from 1,024 contracted
             # elements on; explain() counts it under that too: over), and the dot's result before its transpose
             ("egch,ehm->gecm", (1, 8, 64, 1024), (1, 1024, 128), (8 * 64 * 1024 + 1024 * 128 + 8 * 64 * 128) * F32)]
    for spec, a, b, copied in cases:
        f = functools.partial(jnp.einsum, spec)
        args = (jnp.ones(a), jnp.ones(b))
        temp = gs.partition(f, mesh, in_shardings=ins).lower(*args).compile().memory_analysis().temp_size_in_bytes
        report = gs.explain(f, mesh, *args, in_shardings=ins)
        assert report.temporaries.bytes == copied == temp, (spec, temp, report.temporaries)


class _NormBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(128, use_bias=False)(nn.RMSNorm(param_dtype=jnp.float32)(x))


class _NormStack(nn.Module):
    @nn.compact
    def __call__(self, x):
        for _ in range(4):
            x = _NormBlock()(x)
        return jnp.sum(jnp.tanh(x))


def test_an_rmsnorms_broadcasts_are_stored_from_its_forward_to_its_backward(monkeypatch):
    """Flax's RMSNorm multiplies its rsqrt [B, L, 1] by its scale [D]; the backward reads both again, each
    summed by a reduction. XLA:CPU shares one broadcast of each to [B, L, D] between the two passes and keeps
    it from the forward to the backward, and duplicates the product into its readers
    (liveness.broadcast_copies, fusion._outer). explain() predicts the compiled temporaries of a 4-block
    stack's gradient (data parallel) within 2% with them, and not within 40% without."""
    mesh, ins = gs.make_mesh({"data": 8}), (None, P("data"))
    x = jnp.ones((32, 64, 128))
    model = _NormStack()
    params = model.init(jax.random.key(0), x)
    step = jax.grad(lambda p, x: model.apply(p, x))
    temp = gs.partition(step, mesh, in_shardings=ins).lower(params, x).compile().memory_analysis().temp_size_in_bytes
    ratio = gs.explain(step, mesh, params, x, in_shardings=ins).temporaries.bytes / temp
    assert 0.98 <= ratio <= 1.02, ratio
    monkeypatch.setattr(liveness, "broadcast_copies", lambda *a: [])
    assert gs.explain(step, mesh, params, x, in_shardings=ins).temporaries.bytes / temp < 0.6
