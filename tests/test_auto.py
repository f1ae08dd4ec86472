"""Automatic sharding (partition(auto=True)): the partitioner chooses the shardings nobody gave, from its own
costs under a memory budget, keeps what the user gave, and says why. On 8 simulated CPU devices."""
from __future__ import annotations

import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import gshard_jax as gs
from gshard_jax.models.moe import expert_einsums
from gshard_jax.partitioner.auto import graph as auto_graph, search as auto_search, solve as auto_solve
from gshard_jax.partitioner.costs import liveness


def moved(report) -> float:
    """Bytes a device moves per step, every collective of the report (loops times their trips)."""
    return sum(t["moved_bytes"] for t in report.totals(dynamic=True).values())


def close(got, want):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        b = np.asarray(b)
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=1e-5 * max(float(np.abs(b).max()), 1.0))


# ------------------------------------------------------------------ a two-layer MLP's train step
def mlp_step(x, w1, w2):
    def loss(w1, w2):
        return jnp.mean(jnp.tanh(jnp.tanh(x @ w1) @ w2) ** 2)
    value, (g1, g2) = jax.value_and_grad(loss, argnums=(0, 1))(w1, w2)
    return value, w1 - 0.1 * g1, w2 - 0.1 * g2


def mlp_args(batch=1024, d=1024, h=4096):
    r = np.random.default_rng(0)
    return [jnp.asarray(r.standard_normal(s) / np.sqrt(s[0]), jnp.float32) for s in ((batch, d), (d, h), (h, d))]


MESH2 = {"data": 2, "model": 4}


def test_a_two_layer_mlp_with_only_the_batch_given_moves_no_more_than_megatrons_plan():
    """{data 2, model 4}, the batch split over data and nothing else given: the choice moves no more bytes a
    step than Megatron's column-then-row plan, its step (communication and compute) is predicted no slower,
    and it equals the unpartitioned step."""
    mesh, args = gs.make_mesh(MESH2), mlp_args()
    batch_only = (P("data", None), None, None)
    auto = gs.explain(mlp_step, mesh, *args, in_shardings=batch_only, auto=True)
    megatron = gs.explain(mlp_step, mesh, *args, in_shardings=(P("data", None), P(None, "model"), P("model", None)))
    assert moved(auto) <= moved(megatron), (moved(auto), moved(megatron))
    assert auto.comm_time + auto.compute_time <= megatron.comm_time + megatron.compute_time
    estimate = float(re.search(r"predicted ([\d.]+) ms", auto.notes[0]).group(1)) * 1e-3
    assert auto.comm_time + auto.compute_time <= estimate * 1.001  # a reshard's readers charged once each
    assert {v.name: str(v.boundary) for v in auto.inputs}["x"] == "[data, -]"  # what the user gave stays
    close(gs.partition(mlp_step, mesh, in_shardings=batch_only, auto=True)(*args), jax.jit(mlp_step)(*args))


def test_explain_names_the_choice_the_runner_up_and_what_it_costs():
    mesh, args = gs.make_mesh(MESH2), mlp_args()
    report = gs.explain(mlp_step, mesh, *args, in_shardings=(P("data", None), None, None), auto=True)
    notes = "\n".join(report.notes)
    assert re.search(r"automatic sharding: \d+ nodes, \d+ edges, \d+ options; solved in [\d.]+ s", notes)
    for name in ("w1", "w2"):  # the arguments nobody gave, each with its runner-up
        assert re.search(rf"^{name}: \[.*\]; runner-up \[.*\], [+-][\d.]+ ms a step$", notes, re.M), notes
    assert "x:" not in notes  # given: not chosen
    assert "the result of dot_general" in notes  # the largest activations
    assert all(v.origin == "automatic sharding" for v in report.inputs if v.name in ("w1", "w2"))


# ------------------------------------------------------------------ GShard's MoE layer
def moe_plain(dispatch, combine, x, wi, wo):
    e_in = jnp.einsum("GSEC,GSM->EGCM", dispatch, x)
    h = jax.nn.relu(jnp.einsum("EGCM,EMH->EGCH", e_in, wi))
    return jnp.einsum("GSEC,GECM->GSM", combine, jnp.einsum("EGCH,EHM->GECM", h, wo))


def moe_annotated(dispatch, combine, x, wi, wo):
    return expert_einsums(dispatch, combine, x, wi, wo, 8)


def moe_args():
    rng = np.random.default_rng(0)
    G, S, E, C, M, H = 8, 256, 8, 64, 512, 2048
    dispatch = (rng.random((G, S, E, C)) < 0.1).astype(np.float32)
    combine = dispatch * rng.random((G, S, E, C)).astype(np.float32)
    x = rng.standard_normal((G, S, M)).astype(np.float32)
    wi = rng.standard_normal((E, M, H)).astype(np.float32) / 8
    wo = rng.standard_normal((E, H, M)).astype(np.float32) / 8
    return [jnp.asarray(a) for a in (dispatch, combine, x, wi, wo)]


def held(report, mesh_shape) -> int:
    """Bytes per device of a report's arguments and outputs, as they arrive and leave, and of its temporaries
    at their predicted peak."""
    return int(report.argument_bytes()["total"] + report.temporaries.bytes + sum(
        np.prod(o.boundary.local_shape(o.shape, mesh_shape)) * np.dtype(o.dtype).itemsize for o in report.outputs))


def compiled_peak(fn, *args) -> int:
    """Bytes per device the compiled program holds (memory_analysis(): arguments, outputs, temporaries; a
    donated argument's buffer reused by an output counted once)."""
    m = fn.lower(*args).compile().memory_analysis()
    return m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes


def estimate_of(report) -> tuple[float, float]:
    """The automatic sharding's own prediction, from explain()'s note: (seconds, temporaries' bytes)."""
    note = report.notes[0]
    units = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
    temps = re.search(r"temporaries at their peak ([\d.]+)(B|KiB|MiB|GiB)", note)
    seconds = float(re.search(r"predicted ([\d.]+) ms", note).group(1)) * 1e-3
    return seconds, float(temps.group(1)) * units[temps.group(2)]


def test_gshards_moe_layer_unannotated_within_the_annotated_programs_memory_finds_its_two_all_to_alls():
    """GShard's dispatch and combine einsums on {expert 8}, nothing annotated, within the per-device memory
    of the hand-annotated program (its arguments, outputs and temporaries, as explain() predicts them): the
    choice moves no more bytes than that program's two all-to-alls (it finds the same layout: groups split on
    the way in and out, experts in between), and its compiled program holds no more than the hand-annotated
    one's, by memory_analysis()."""
    mesh, args = gs.make_mesh({"expert": 8}), moe_args()
    hand = gs.explain(moe_annotated, mesh, *args)
    assert {t for t, v in hand.totals(dynamic=True).items() if v["moved_bytes"]} == {"all-to-all"}
    budget = held(hand, dict(mesh.shape))
    auto = gs.explain(moe_plain, mesh, *args, auto=True, memory_budget=budget)
    assert moved(auto) <= moved(hand)
    assert held(auto, dict(mesh.shape)) <= budget
    assert estimate_of(auto)[1] == pytest.approx(auto.temporaries.bytes, rel=1e-3)  # the choice's is explain()'s
    fn = gs.partition(moe_plain, mesh, auto=True, memory_budget=budget)
    assert compiled_peak(fn, *args) <= compiled_peak(gs.partition(moe_annotated, mesh), *args)
    close(fn(*args), moe_plain(*args))
    unbounded = gs.explain(moe_plain, mesh, *args, auto=True)  # without a budget: every expert on every device
    assert moved(unbounded) <= moved(hand) and held(unbounded, dict(mesh.shape)) > budget


def test_a_budget_no_sharding_meets_names_the_smallest_found_and_what_holds_it():
    mesh, args = gs.make_mesh({"expert": 8}), moe_args()
    # the least is every array split 8 ways: 80 MiB of arguments and outputs over 8 devices, and 13 MiB a device
    # of temporaries: the hidden activation (32 MiB) and its relu, relaid for the output einsum as XLA:CPU
    # relays it, with wo (one expert a device: a batch of one); its compiled program holds 22.0 MiB
    with pytest.raises(ValueError, match=r"memory_budget=1000 bytes per device: no sharding .* the smallest found "
                                         r"holds 23\.0MiB per device \(10\.0MiB of arguments and outputs, 13\.0MiB of "
                                         r"temporaries\), most of it in wi \(4\.0MiB\), wo \(4\.0MiB\), the result of "
                                         r"max \(4\.0MiB\), an operand of dot_general .* relaid \(4\.0MiB\)"):
        gs.explain(moe_plain, mesh, *args, auto=True, memory_budget=1000)


# ------------------------------------------------------------------ what the user gave is kept
def test_annotations_in_and_out_shardings_are_kept():
    mesh, args = gs.make_mesh(MESH2), mlp_args(256, 256, 1024)

    def annotated(x, w1, w2):
        value, n1, n2 = mlp_step(x, w1, w2)
        return value, jax.lax.with_sharding_constraint(n1, P("model", None)), n2

    report = gs.explain(annotated, mesh, *args, in_shardings=(P("data", None), P(None, "data"), None),
                        out_shardings=(P(), None, P(None, "model")), auto=True)
    ins, outs = {v.name: str(v.boundary) for v in report.inputs}, [str(v.boundary) for v in report.outputs]
    assert ins["x"] == "[data, -]" and ins["w1"] == "[-, data]"
    assert outs[1] == "[model, -]" and outs[2] == "[-, model]"
    fn = gs.partition(annotated, mesh, in_shardings=(P("data", None), P(None, "data"), None),
                      out_shardings=(P(), None, P(None, "model")), auto=True)
    close(fn(*args), jax.jit(mlp_step)(*args))


def test_the_options_are_every_split_the_rule_allows():
    """A tensor's shardings: each mesh axis on one dim or none (3 x 3 on a 2-D tensor over 2 axes, less the
    splits that do not divide); an op's options: its factor shardings, each axis on at most one factor."""
    mesh_shape = {"data": 2, "model": 4}
    got = {str(s) for s in auto_graph.tensor_shardings((8, 8), mesh_shape)}
    assert got == {"[-, -]", "[data, -]", "[-, data]", "[model, -]", "[-, model]", "[data*model, -]",
                   "[-, data*model]", "[data, model]", "[model, data]"}
    assert auto_graph.axis_tuples(mesh_shape) == [("data",), ("model",), ("data", "model")]


@pytest.mark.parametrize("program", ["elementwise", "scan"])
def test_the_outputs_leave_as_chosen_so_the_budget_holds(program):
    """An output's sharding counts toward the budget, so it leaves as chosen: an elementwise op of a whole
    4 MiB argument (its result merged into the argument's node), and a scan's stacked result."""
    mesh = gs.make_mesh(MESH2)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((1024, 1024)), jnp.float32)

    def f(x):
        if program == "scan":
            return jax.lax.scan(lambda c, row: (c + row, jnp.tanh(row) * 2), jnp.zeros(1024), x)[1]
        return jnp.tanh(x) * 2

    # the argument whole (4 MiB), tanh's result as it makes it (4 MiB: an op merged into the argument's node
    # runs in its sharding), and the output split (whole, it would be 4 MiB more)
    budget = 9 * 2**20
    fn = gs.partition(f, mesh, in_shardings=P(), auto=True, memory_budget=budget)
    assert compiled_peak(fn, x) <= budget
    close(fn(x), jax.jit(f)(x))


@pytest.mark.parametrize("kw,message", [
    (dict(memory_budget=10), "memory_budget=10 bounds the automatic sharding's choice: pass auto=True"),
    (dict(auto=True, memory_budget=-1), "memory_budget=-1: expected a positive number of bytes"),
    (dict(auto="yes"), "auto='yes': expected True"),
    (dict(auto=True, backend="xla"), "auto=True is this project's choice of shardings, for backend='gshard'"),
])
def test_bad_options_say_what_was_expected(kw, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        gs.partition(mlp_step, gs.make_mesh(MESH2), **kw)


# ------------------------------------------------------------------ a dense LM train step over the budget
def block_step():
    """A Flax Transformer block's (examples/flax_model.py) AdamW step on 16 x 8 tokens of d_model 256:
    (train_step, its arguments (params, opt_state, x), the state's bytes)."""
    import flax.linen as nn
    import optax
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    from flax_model import Block

    model, opt = Block(), optax.adamw(1e-3)

    def train_step(params, opt_state, x):
        value, grads = jax.value_and_grad(lambda p: jnp.mean(model.apply(p, x) ** 2))(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    x = jax.random.normal(jax.random.key(0), (16, 8, 256))
    params = nn.unbox(model.init(jax.random.key(1), x))
    opt_state = opt.init(params)
    return train_step, (params, opt_state, x), sum(a.size * a.dtype.itemsize
                                                   for a in jax.tree.leaves((params, opt_state)))


@pytest.mark.slow  # about 5 minutes (320 s beside another test run): the choice under a budget, its runner-ups,
def test_a_dense_train_step_over_the_budget_shards_its_state_and_fits(monkeypatch):  # a compile, a run
    """A Flax Transformer block's AdamW step (params and optimizer state given nothing, the batch split over
    data; d_model 256 over 128 tokens, so the state outweighs the activations) within a budget of half the
    state's bytes for its arguments, outputs and temporaries: whole, the arguments and outputs alone would be
    twice the state. The choice shards the state (ZeRO's layout or better) and fits, by the compiled program's
    memory_analysis(); the step equals jax.jit's. Each integer program a solve adds rows for cuts off the
    choice the last one returned (a row it would hold is a wasted solve: a minute of the choice's two here)."""
    programs: list = []  # per solve, (its rows, the choice) per integer program
    real_solve, real_rows = auto_solve.solve, auto_solve._solve_rows

    def solve(*args, **kwargs):
        programs.append([])
        return real_solve(*args, **kwargs)

    def solve_rows(g, memory, rows, budget, *args):
        sol = real_rows(g, memory, rows, budget, *args)
        programs[-1].append((rows, sol.picks, budget))
        return sol

    monkeypatch.setattr(auto_search, "solve", solve)
    monkeypatch.setattr(auto_solve, "_solve_rows", solve_rows)
    train_step, (params, opt_state, x), state = block_step()
    mesh = gs.make_mesh(MESH2)
    budget = state // 2
    ins = (None, None, P("data"))
    report = gs.explain(train_step, mesh, params, opt_state, x, in_shardings=ins, auto=True, memory_budget=budget)
    layout = {v.name: v.boundary for v in report.inputs}
    moments = [n for n in layout if (".mu[" in n or ".nu[" in n) and n.endswith("['kernel']")]
    assert moments and all(len(layout[n].axes) == 2 for n in moments), layout  # over all 8 devices (ZeRO)
    kernel = lambda n: layout[f"params['params']['{n}']['kernel']"]  # as docs/partitioner.md says of it
    assert kernel("wi").axes and kernel("wo").axes, layout  # the largest weights split too
    assert held(report, dict(mesh.shape)) <= budget
    again = [(b, picks) for p in programs for (_, picks, b), (rows, _, _) in zip(p, p[1:])
             if all(r.at(picks) <= b * (1 + 1e-6) for r in rows)]
    assert any(len(p) > 1 for p in programs) and not again, [len(p) for p in programs]
    fn = gs.partition(train_step, mesh, in_shardings=ins, auto=True, memory_budget=budget)
    assert compiled_peak(fn, params, opt_state, x) <= budget < state
    got, want = fn(params, opt_state, x), jax.jit(train_step)(params, opt_state, x)
    close(got[1:], want[1:])  # the loss, and the moments: the gradients' first and second
    # AdamW's first step divides by |g| + eps, so a gradient near zero turns summation-order noise into a
    # visible update: the new params are checked against AdamW's first update from our own moments
    adam = got[1][0]
    close(got[0], jax.tree.map(lambda p, m, v: p - 1e-3 * (m / 0.1 / (jnp.sqrt(v / 0.001) + 1e-8) + 1e-4 * p),
                               params, adam.mu, adam.nu))


def test_a_flax_and_optax_step_on_jax_make_mesh_reports_what_it_compiles():
    """Library code as its authors write it (Flax linen Dense layers, a logical constraint under axis rules,
    optax's adam, a jax.make_mesh mesh of Explicit axes, the batch put on it): the automatic choice's
    explain() bytes equal the compiled program's, it moves no more than XLA's partitioner on the same
    annotations, and it equals jax.jit's step."""
    import flax.linen as nn
    import optax

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.with_logical_constraint(x, ("batch", "embed"))
            return nn.Dense(256, use_bias=False)(nn.relu(nn.Dense(1024, use_bias=False)(x)))

    rules, model, opt = (("batch", "data"), ("embed", None)), MLP(), optax.adam(1e-3)

    def step(params, opt_state, x):
        def loss(p):
            with nn.logical_axis_rules(rules):
                return jnp.mean(model.apply(p, x) ** 2)
        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    mesh = jax.make_mesh((2, 4), ("data", "model"))
    x = jax.device_put(jax.random.normal(jax.random.key(0), (512, 256)), jax.sharding.NamedSharding(mesh, P("data")))
    params = model.init(jax.random.key(1), x)
    opt_state = opt.init(params)
    report = gs.explain(step, mesh, params, opt_state, x, auto=True)
    fn = gs.partition(step, mesh, auto=True)
    compiled = fn.lower(params, opt_state, x).compile()
    hlo = sum(s["moved_bytes"] for s in gs.collective_stats(compiled).values())
    assert moved(report) == hlo
    xla = gs.partition(step, mesh, backend="xla").lower(params, opt_state, x).compile()
    assert hlo <= sum(s["moved_bytes"] for s in gs.collective_stats(xla).values())
    got = fn(params, opt_state, x)
    with jax.set_mesh(mesh):
        close(got, jax.jit(step)(params, opt_state, x))


# ------------------------------------------------------------------ a scanned stack: its body solved once
def stack_step(x, ws):
    """A residual stack of tanh layers, scanned over stacked weights, and its gradient."""
    def loss(ws):
        def layer(h, w):
            return h + jnp.tanh(h @ w), None
        return jnp.mean(jax.lax.scan(layer, x, ws)[0] ** 2)
    value, g = jax.value_and_grad(loss)(ws)
    return value, ws - 0.1 * g


def test_a_scanned_stack_is_chosen_once_whatever_its_depth():
    """A scan's body is in the graph once (its costs at trips times): 4 and 48 layers make graphs of as many
    nodes and edges (the stacked weights' options differ, by which splits divide the depth), and the choice for
    4 runs and equals the unpartitioned step."""
    mesh = gs.make_mesh(MESH2)
    r = np.random.default_rng(0)
    x = jnp.asarray(r.standard_normal((64, 128)), jnp.float32)
    sizes = {}
    for depth in (4, 48):
        ws = jnp.asarray(r.standard_normal((depth, 128, 128)) / 12, jnp.float32)
        report = gs.explain(stack_step, mesh, x, ws, in_shardings=(P("data", None), None), auto=True)
        sizes[depth] = re.search(r"(\d+) nodes, (\d+) edges", report.notes[0]).groups()
    assert sizes[4] == sizes[48]
    ws = jnp.asarray(r.standard_normal((4, 128, 128)) / 12, jnp.float32)
    close(gs.partition(stack_step, mesh, in_shardings=(P("data", None), None), auto=True)(x, ws),
          jax.jit(stack_step)(x, ws))


# ------------------------------------------------------------------ a convolution on a spatial split
def conv(x, w):
    return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))


def conv_grad(img, w1, w2):
    return jax.value_and_grad(lambda a, b: jnp.mean(conv(jax.nn.relu(conv(img, a)), b) ** 2), argnums=(0, 1))(w1, w2)


def conv_gathered(img, w1, w2):
    return conv_grad(jax.lax.with_sharding_constraint(img, P()), w1, w2)


def conv_args(shape=(2, 512, 64, 16)):
    r = np.random.default_rng(0)
    img = r.standard_normal(shape)
    w1, w2 = r.standard_normal((3, 3, 16, 32)) / 12, r.standard_normal((3, 3, 32, 32)) / 17  # ~1/sqrt(fan-in)
    return [jnp.asarray(a, jnp.float32) for a in (img, w1, w2)]


def test_a_convolution_split_by_height_exchanges_halos_where_that_is_cheaper_than_gathering():
    """The gradient of two 3x3 convolutions with a batch of images split by height over 8 devices: the choice
    moves no more than propagation's halo exchanges, and far less than gathering the image would; its
    collectives are the halos' permutes, and it equals the unpartitioned gradient."""
    mesh, args = gs.make_mesh({"data": 8}), conv_args((8, 512, 128, 16))
    ins = (P(None, "data"), None, None)
    auto = gs.explain(conv_grad, mesh, *args, in_shardings=ins, auto=True)
    halo, gathered = (gs.explain(f, mesh, *args, in_shardings=ins) for f in (conv_grad, conv_gathered))
    assert moved(auto) <= moved(halo) < moved(gathered) / 20
    assert auto.comm_time + auto.compute_time < gathered.comm_time + gathered.compute_time
    kinds = {k for k, t in auto.totals(dynamic=True).items() if t["moved_bytes"]}
    assert "collective-permute" in kinds and "all-gather" not in kinds, kinds
    close(gs.partition(conv_grad, mesh, in_shardings=ins, auto=True)(*args), jax.jit(conv_grad)(*args))


def flax_stack():
    """A Flax nn.scan over nn.remat blocks (Dense, LayerNorm, gelu) with a with_sharding_constraint on the batch
    and optax's adamw, on a jax.make_mesh mesh: (step, gradients, params, opt_state, x, mesh)."""
    import flax.linen as nn
    import optax

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            h = nn.Dense(512, use_bias=False)(nn.LayerNorm()(x))
            return x + nn.Dense(128, use_bias=False)(nn.gelu(h)), None

    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = jax.lax.with_sharding_constraint(x, P("data"))
            return nn.scan(nn.remat(Block), variable_axes={"params": 0}, split_rngs={"params": True},
                           length=6)()(x, None)[0]

    model, opt = Stack(), optax.adamw(1e-3)

    def gradients(params, x):
        return jax.value_and_grad(lambda p: jnp.mean(model.apply(p, x) ** 2))(params)

    def step(params, opt_state, x):
        value, grads = gradients(params, x)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    mesh = jax.make_mesh((2, 4), ("data", "model"))
    x = jax.device_put(jax.random.normal(jax.random.key(0), (256, 128)), jax.sharding.NamedSharding(mesh, P("data")))
    with jax.set_mesh(mesh):
        params = model.init(jax.random.key(1), x)
    return step, gradients, params, opt.init(params), x, mesh


def test_a_flax_scanned_remat_stack_with_optax_is_chosen_as_it_compiles():
    """Library code as its authors write it (flax_stack). The choice's estimate is explain()'s report, whose
    bytes are the compiled step's (each collective in the layer loop times its 6 trips); it moves no more
    bytes and computes no more flops per device than XLA's partitioner. Its loss and gradients equal jax.jit's
    (AdamW's first update divides by |g| + eps, so summation-order noise in a gradient near zero shows in the
    update: test_train_step.py checks the update that way too)."""
    step, gradients, params, opt_state, x, mesh = flax_stack()
    report = gs.explain(step, mesh, params, opt_state, x, auto=True)
    estimate = float(re.search(r"predicted ([\d.]+) ms", report.notes[0]).group(1)) * 1e-3
    assert report.comm_time + report.compute_time == pytest.approx(estimate, rel=0.01)
    fn = gs.partition(step, mesh, auto=True)
    ours, xla = (f.lower(params, opt_state, x).compile() for f in (fn, gs.partition(step, mesh, backend="xla")))
    per_step = lambda c: sum(s["moved_bytes"] for s in gs.collective_stats(c, per_step=True).values())
    assert moved(report) == per_step(ours) <= per_step(xla)
    flops = lambda c: (lambda a: a if isinstance(a, dict) else a[0])(c.cost_analysis())["flops"]
    assert flops(ours) <= flops(xla)
    got = gs.partition(gradients, mesh, auto=True)(params, x)
    with jax.set_mesh(mesh):
        close(got, jax.jit(gradients)(params, x))


def test_a_flax_scanned_stack_under_a_budget_holds_its_loops_copies_within_it(monkeypatch):
    """flax_stack with its state uncommitted (the choice may split it) under half the memory the unbudgeted
    choice predicts. A loop's operands resharded at its entry are copies alive through the loop, and one a
    later loop reuses is alive until it runs (the forward scan's gathered weights, read again by the backward
    scan): the choice counts them as explain() does, so its temporaries equal explain()'s, explain()'s
    arguments, outputs and temporaries fit the budget, and the compiled step holds less than the unbudgeted
    one. The compiled step's temporaries are above the prediction by XLA's own buffers (layout copies of the
    gathered weights), measured at 1.09x: the bound below is that, not the budget. explain()'s bytes are the
    compiled step's. (The choice's own count is over explain()'s by one 64 KiB shard where the backward's
    Dense_1 dot is read only by its annotation: it counts the result made split and gathered for it, where
    the lowering plans the result as its one reader needs it, auto._target; and by the annotations that keep
    their operand's sharding, which explain(), knowing the plan, counts as their operands' buffers
    (liveness.merge_identities) and the choice as buffers of their own; never under.)"""
    step, _, params, opt_state, x, mesh = flax_stack()
    params = jax.tree.map(jnp.asarray, jax.device_get(params))
    opt_state = jax.tree.map(jnp.asarray, jax.device_get(opt_state))
    unbudgeted = held(gs.explain(step, mesh, params, opt_state, x, auto=True, trace_per_device=False), dict(mesh.shape))
    budget = unbudgeted / 2
    report = gs.explain(step, mesh, params, opt_state, x, auto=True, memory_budget=budget)
    printed = 0.05 * 2**20  # (the note's rounding)
    with monkeypatch.context() as m:  # the same choice, its annotations each a buffer of its own
        m.setattr(liveness, "merge_identities", lambda program, lt, sharding: lt)
        unmerged = gs.explain(step, mesh, params, opt_state, x, auto=True, memory_budget=budget).temporaries.bytes
    assert report.temporaries.bytes - printed <= estimate_of(report)[1] <= unmerged + 2**16 + printed
    assert held(report, dict(mesh.shape)) <= budget
    fn = gs.partition(step, mesh, auto=True, memory_budget=budget)
    budgeted = compiled_peak(fn, params, opt_state, x)
    assert budgeted <= 1.1 * held(report, dict(mesh.shape))
    # the weights now gathered a trip ahead in the loops (the last trip peeled, its unread carry's ops pruned)
    compiled = fn.lower(params, opt_state, x).compile()
    assert moved(report) == sum(s["moved_bytes"] for s in gs.collective_stats(compiled, per_step=True).values())
    assert budgeted < compiled_peak(gs.partition(step, mesh, auto=True), params, opt_state, x)
