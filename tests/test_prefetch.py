"""Weights gathered a trip ahead in scanned layer stacks (partitioner/strategies/prefetch.py): which stacked inputs, the
pipelined loop against jax.jit and the compiled HLO, its structure (no compute of the trip feeds the gather
or reads it) and its memory cost."""
from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import gshard_jax as gs
from gshard_jax.partitioner.costs.hardware import GENERIC
from gshard_jax.partitioner.strategies import prefetch as PF
from helpers import assert_per_step_matches_hlo, assert_report_matches_hlo

L, B, D = 4, 16, 64
Z_SPLIT = (P(None, "z", None), P("z", None))  # FSDP: each layer's weight split over z, the batch too
OUTS = (P(), P(None, "z", None))


def stack(ws, x):
    def body(h, w):
        return jnp.tanh(h @ w), None
    return jnp.sum(jax.lax.scan(body, x, ws)[0] ** 2)


def _args(layers=L):
    r = np.random.default_rng(0)
    return (jnp.asarray(r.standard_normal((layers, D, D)) / 8, jnp.float32),
            jnp.asarray(r.standard_normal((B, D)), jnp.float32))


MESH = gs.make_mesh({"z": 8})


def _partition(fn, ins=Z_SPLIT, outs=OUTS):
    return gs.partition(fn, MESH, in_shardings=ins, out_shardings=outs)


def test_forward_and_gradients_equal_jit():
    fn, args = jax.value_and_grad(stack), _args()
    got, want = _partition(fn)(*args), jax.jit(fn)(*args)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=1e-5, atol=1e-5)


def test_the_report_equals_the_hlo_and_moves_the_unpipelined_bytes():
    args = _args()
    compiled = _partition(stack, outs=P()).lower(*args).compile()
    report = gs.explain(stack, MESH, *args, in_shardings=Z_SPLIT, out_shardings=P())
    assert_report_matches_hlo(report, gs.collective_stats(compiled))
    assert_per_step_matches_hlo(report, compiled)
    ahead = [r for r in report.rows if r.primitive.endswith("prefetch")]
    assert [(r.primitive, r.trips) for r in ahead] == [("prefetch", 1), ("scan/prefetch", L - 1)]
    assert any("gathered a trip ahead" in r.strategy and r.primitive == "scan" for r in report.rows)
    with PF.disabled():
        before = gs.explain(stack, MESH, *args, in_shardings=Z_SPLIT, out_shardings=P())
    assert report.totals(dynamic=True) == before.totals(dynamic=True)  # the same bytes: the last trip is peeled


def _instructions(text: str) -> dict[str, dict]:
    """Per computation: instruction name -> (op text, operand names)."""
    out, name = {}, None
    for line in text.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head:
            name = head.group(1)
            out[name] = {}
            continue
        m = re.match(r"^\s*(?:ROOT )?%([\w.\-]+) = [^=]*?\b([a-z\-]+)\((.*?)\)(.*)$", line)
        if m and name:
            out[name][m.group(1)] = (m.group(2), re.findall(r"%([\w.\-]+)", m.group(3)), line)
    return out


def _dots_around_gathers(compiled) -> list[tuple[bool, bool]]:
    """For each all-gather in a loop body: (a dot feeds it, a dot reads it), within the body."""
    found = []
    for comp, ins in _instructions(compiled.as_text()).items():
        users: dict = {}
        for n, (_, ops, _) in ins.items():
            for o in ops:
                users.setdefault(o, []).append(n)

        def reach(start, step):
            seen, todo = set(), [start]
            while todo:
                for nxt in step(todo.pop()):
                    if nxt in ins and nxt not in seen:
                        seen.add(nxt)
                        todo.append(nxt)
            return seen

        def is_dot(n):
            return "dot_general" in ins[n][2] and ins[n][0] != "all-gather"

        for n, (op, _, line) in ins.items():
            if op == "all-gather" and "while/body" in line:
                above = reach(n, lambda k: ins[k][1])
                below = reach(n, lambda k: users.get(k, ()))
                found.append((any(is_dot(k) for k in above), any(is_dot(k) for k in below)))
    return found


def test_the_trips_gather_neither_waits_for_nor_feeds_its_compute():
    """In the compiled loop body the weight all-gather reads the stacked weights alone, and no dot of the same
    trip reads its result (it is carried to the next trip); unpipelined, the trip's dot reads it."""
    fn, args = jax.grad(stack), _args()
    outs = P(None, "z", None)
    on = _dots_around_gathers(_partition(fn, outs=outs).lower(*args).compile())
    with PF.disabled():
        off = _dots_around_gathers(_partition(fn, outs=outs).lower(*args).compile())
    assert (False, False) in on
    assert (False, True) in off and (False, False) not in off


@pytest.mark.parametrize("layers", [L, 32])
def test_it_costs_one_layers_weights_of_memory(layers):
    """memory_analysis(): the carried gathered weights add about one layer's (float32 D x D), however many layers
    (the loop reads each trip's slice from the whole stack: a slice of the stack would be a copy of it)."""
    fn, args = jax.grad(stack), _args(layers)
    outs = P(None, "z", None)
    on = _partition(fn, outs=outs).lower(*args).compile().memory_analysis().temp_size_in_bytes
    with PF.disabled():
        off = _partition(fn, outs=outs).lower(*args).compile().memory_analysis().temp_size_in_bytes
    layer = D * D * 4
    assert 0 < on - off <= layer, (on - off, layer)


def test_the_gather_overlaps_the_trips_compute():
    """On a profile with asynchronous collectives, the in-loop gather is hidden behind the trip's matmul
    (overlap.py); the one before the loop is exposed. (Collective matmul off: on such a profile "auto" may run
    the matmul as a ring instead, another way of hiding the gather.)"""
    profile = dataclasses.replace(GENERIC, peak_flops=1e8, overlap=True)
    report = gs.explain(jax.grad(stack), MESH, *_args(), in_shardings=Z_SPLIT, out_shardings=OUTS[1],
                        profile=profile, collective_matmul="off")
    timing = {r.primitive: o for r, o in zip(report.rows, report.overlap()) if r.primitive.endswith("prefetch")}
    assert timing["scan/prefetch"].exposed == pytest.approx(0.0, abs=1e-12) and timing["scan/prefetch"].comm > 0
    assert timing["prefetch"].exposed > 0


@pytest.mark.parametrize("ins,expected", [
    (Z_SPLIT, ["[z, -]->[-, -]"]),  # a layer's slice of the split weight, gathered whole for the forward's matmul
    ((P(), P("z", None)), []),  # replicated weights: nothing to gather
    ((P(None, None, "z"), P()), []),  # split on the output dim: the matmul keeps it split (no gather)
])
def test_which_stacked_inputs_are_gathered_ahead(ins, expected):
    """A stacked input is gathered ahead where its body gathers it (the backward's matmuls here read the split
    weight as it is and gather the activations instead)."""
    report = gs.explain(jax.grad(stack), MESH, *_args(), in_shardings=ins)
    got = [str(r.operands[0]) for r in report.rows if r.primitive == "prefetch"]
    assert got == expected


@pytest.mark.parametrize("remat", ["none", "dots"])
def test_a_trainers_scanned_fsdp_stack_prefetches_and_trains_as_before(remat):
    """tiny dense LM, layers scanned, on {z 8}: the rules table's gathered-weight annotations are issued a trip
    ahead (forward, and the backward's re-gathers under remat); one step equals jax.jit's, and explain() equals
    the compiled step per step."""
    from test_sharded_state import assert_same_run, batches, make, run
    from test_step_reductions import _report
    trainer = make(dict(z=8), dense=True, model={"scan": True, "num_layers": 4, "remat": remat})
    report = _report(trainer)
    assert any(r.primitive == "scan/prefetch" and r.trips == 3 for r in report.rows)
    data = batches(trainer, 1)
    assert_same_run(run(trainer, data=data), run(trainer, partitioned=False, data=data), 1e-5, atol=1e-6)
    abstract = jax.eval_shape(trainer.init_state, jax.random.key(0))
    compiled = trainer.step_fn.lower(abstract, data[0]).compile()
    full = gs.explain(trainer.train_step, trainer.mesh, abstract, data[0],
                      in_shardings=(trainer.state_specs, trainer.batch_spec), out_shardings=trainer.step_outs)
    assert_per_step_matches_hlo(full, compiled)


def test_a_trips_weight_gradient_reduce_scatter_hides_behind_its_input_gradient_matmul():
    """The backward trip reduce-scatters layer i's weight gradient while it computes the gradient of layer i's
    input, which does not read it (AxoNN's overlapped reduce-scatter, from the program's dependencies)."""
    profile = dataclasses.replace(GENERIC, peak_flops=1e8, overlap=True)
    report = gs.explain(jax.grad(stack), MESH, *_args(), in_shardings=Z_SPLIT, out_shardings=OUTS[1],
                        profile=profile, collective_matmul="off")
    (row, o), = [(r, o) for r, o in zip(report.rows, report.overlap())
                 if r.primitive == "scan/dot_general" and any(c.kind == "reduce-scatter" for c in r.collectives)]
    behind = report.rows[o.behind]
    assert o.comm > 0 and o.exposed == pytest.approx(0.0, abs=1e-12)
    assert behind.primitive == "scan/dot_general" and not set(behind.reads) & set(row.writes)


def _flax_fsdp_step(layers: int, d: int = 64, f: int = 256):
    """A Flax linen nn.scan stack of `layers` MLP blocks, weights split by MaxText's FSDP logical rules, and an
    optax adamw step, on a jax.make_mesh mesh with Auto axes: (step, mesh, (params, opt, x), in_shardings)."""
    import flax.linen as nn
    import optax
    from jax.sharding import AxisType, NamedSharding
    rules = (("batch", "fsdp"), ("embed", "fsdp"), ("mlp", None), ("layers", None), ("length", None))

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            init = nn.initializers.lecun_normal()
            wi = self.param("wi", nn.with_logical_partitioning(init, ("embed", "mlp")), (d, f))
            wo = self.param("wo", nn.with_logical_partitioning(init, ("mlp", "embed")), (f, d))
            h = nn.with_logical_constraint(jax.nn.gelu(x @ wi), ("batch", "length", "mlp"))
            return nn.with_logical_constraint(x + h @ wo, ("batch", "length", "embed")), None

    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x):
            scan = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=layers,
                           metadata_params={nn.PARTITION_NAME: "layers"})
            return scan(name="layers")(x, None)[0]

    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))
    model, tx = Stack(), optax.adamw(1e-3)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((16, 8, d)), jnp.float32)
    specs = nn.logical_to_mesh(nn.get_partition_spec(jax.eval_shape(model.init, jax.random.key(0), x)), rules)
    params = jax.device_put(nn.unbox(model.init(jax.random.key(0), x)),
                            jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
    x = jax.device_put(x, NamedSharding(mesh, P("fsdp")))
    opt = tx.init(params)

    def step(params, opt, x):
        def loss(p):
            with nn.logical_axis_rules(rules):
                return jnp.mean(model.apply(p, x) ** 2)
        value, g = jax.value_and_grad(loss)(params)
        updates, opt = tx.update(g, opt, params)
        return optax.apply_updates(params, updates), opt, value

    return step, mesh, (params, opt, x), (specs, None, P("fsdp"))


def _moved(compiled) -> float:
    return sum(v["moved_bytes"] for v in gs.collective_stats(compiled, per_step=True).values())


def test_a_flax_scanned_stack_with_fsdp_rules_and_optax_prefetches_as_the_hlo_says():
    """Library code as its authors write it: a Flax linen nn.scan stack, weights split by logical axis rules
    (MaxText's FSDP), an optax adamw step, on a jax.make_mesh mesh with Auto axes. The weights are gathered
    ahead; the step equals jax.jit's, explain() equals the compiled program per step, it moves no more
    bytes than XLA's partitioner, and the per-step compute is the unpipelined loop's, less the peeled trip's
    unread carry."""
    layers = 4
    step, mesh, (params, opt, x), ins = _flax_fsdp_step(layers)
    compiled = gs.partition(step, mesh, in_shardings=ins).lower(params, opt, x).compile()
    report = gs.explain(step, mesh, params, opt, x, in_shardings=ins)
    assert any(r.primitive == "scan/prefetch" for r in report.rows)
    got, want = compiled(params, opt, x), jax.jit(step)(params, opt, x)
    np.testing.assert_allclose(float(got[2]), float(want[2]), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got[0]), jax.tree.leaves(want[0])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    assert_report_matches_hlo(report, gs.collective_stats(compiled))
    assert_per_step_matches_hlo(report, compiled)
    xla = gs.partition(step, mesh, in_shardings=ins, backend="xla").lower(params, opt, x).compile()
    assert _moved(compiled) <= _moved(xla)
    with PF.disabled():
        before = gs.explain(step, mesh, params, opt, x, in_shardings=ins)
    # The unpipelined loop's compute, less what the peeled last trip of the backward loop leaves out: the
    # gradient of the stack's input, which nothing reads (XLA removes it from the unrolled trip as well).
    assert 0 < before.compute_time - report.compute_time < before.compute_time / layers


@pytest.mark.slow
def test_a_flax_scanned_stacks_prefetch_holds_xlas_temporaries_and_one_layer_at_any_depth():
    """memory_analysis() of the Flax FSDP adamw step at 4 and 16 layers, ours against XLA's partitioner: the
    loop's stacked results (saved activations, weight gradients) are written in place, trip by trip and the peeled
    trip's too, so a layer more costs what it costs XLA's program; the prefetch adds one layer's gathered weights
    (within it at 4 layers), moves no more bytes than XLA's, and the step equals jax.jit's."""
    temps, layer = {}, 0
    for layers in (4, 16):
        step, mesh, args, ins = _flax_fsdp_step(layers)
        ours = gs.partition(step, mesh, in_shardings=ins).lower(*args).compile()
        xla = gs.partition(step, mesh, in_shardings=ins, backend="xla").lower(*args).compile()
        temps[layers] = [c.memory_analysis().temp_size_in_bytes for c in (ours, xla)]
        assert _moved(ours) <= _moved(xla)
        got, want = ours(*args), jax.jit(step)(*args)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
        layer = sum(int(np.prod(w.shape[1:])) * w.dtype.itemsize for w in jax.tree.leaves(args[0]))  # gathered
    (ours4, xla4), (ours16, xla16) = temps[4], temps[16]
    assert ours4 <= xla4 + layer, (ours4, xla4, layer)
    # Twelve layers more cost ours what they cost XLA's, within less than one layer's weights (joining the peeled
    # trip's results to the loop's copied them all: 12 layers' saved activations and gradients more).
    assert (ours16 - ours4) - (xla16 - xla4) < layer, temps


def _invariant_loops(w, x):
    """Every trip scales the batch-split carry by the same w (a scan const): its gradient's loop reads w again."""
    def body(h, _):
        return jnp.tanh(h * w), None
    return jnp.sum(jax.lax.scan(body, x, None, length=L)[0] ** 2)


def test_an_invariant_gathered_by_every_trip_is_gathered_once_before_the_loops():
    """A scan const every trip needs gathered is gathered before the loop (as XLA's loop-invariant code motion
    hoists it), and the backward loop reads the same gather (as XLA's CSE merges them): one all-gather in the
    step, counted by explain() where the HLO has it, the numbers those of jax.jit."""
    r = np.random.default_rng(1)
    w, x = jnp.asarray(r.standard_normal(D), jnp.float32), jnp.asarray(r.standard_normal((B, D)), jnp.float32)
    fn, ins, outs = jax.value_and_grad(_invariant_loops), (P("z"), P("z", None)), (P(), P("z"))
    got, want = gs.partition(fn, MESH, in_shardings=ins, out_shardings=outs)(w, x), jax.jit(fn)(w, x)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=1e-5, atol=1e-5)
    compiled = gs.partition(fn, MESH, in_shardings=ins, out_shardings=outs).lower(w, x).compile()
    report = gs.explain(fn, MESH, w, x, in_shardings=ins, out_shardings=outs)
    assert_report_matches_hlo(report, gs.collective_stats(compiled))
    assert_per_step_matches_hlo(report, compiled)
    gathers = [(r.primitive, r.trips, c.shape) for r in report.rows for c in r.collectives
               if c.kind == "all-gather"]
    assert gathers == [("scan", 1, (1, D))], gathers  # (w as broadcast against the carry)
