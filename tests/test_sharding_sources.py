"""Every way JAX code states a sharding means what gs.shard means: with_sharding_constraint (a NamedSharding, a
bare PartitionSpec under a mesh context, P.UNCONSTRAINED dims), Flax's logical constraints and logically
partitioned params, flax.linen.partitioning's helpers, flax nnx's sharding metadata, jax.sharding.reshard on
Explicit meshes, device_put inside a function. Each form is checked against the same program written with
gs.shard (the same planned shardings, the same collectives in the compiled HLO) and against jax.jit."""
import contextlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import gshard_jax as gs
from gshard_jax.models.logical import DEFAULT_RULES, for_mesh, mesh_spec
from helpers import assert_close, assert_report_matches_hlo, get_mesh, hlo_stats, load_script

MESH = get_mesh("2x4")
HERE = "tests/test_sharding_sources.py:"  # sources are relative to the working directory (the repository)
X = np.arange(8 * 64, dtype=np.float32).reshape(8, 64) / 100
W = np.linspace(-1, 1, 64 * 32, dtype=np.float32).reshape(64, 32)


def reference(x, w):
    return jnp.tanh(gs.shard(x, ("data", None)) @ gs.shard(w, (None, "model"))).sum(1)


def _layout(report):
    return [str(v.planned) for v in report.inputs + report.outputs]


def same_as_gs(form, want=reference, args=(X, W), mesh=MESH, context=None, **kw):
    """form partitions as `want` (written with gs.shard) does: equal results (and equal to jax.jit), the same
    planned layout, the same collectives in the HLO, and a report equal to the HLO naming the user's line."""
    ref = gs.partition(want, mesh, **kw)
    with context or contextlib.nullcontext():
        f = gs.partition(form, mesh, **kw)
        got, stats = f(*args), hlo_stats(f, *args)
        report = gs.explain(form, mesh, *args, **kw)
        plain = jax.jit(form)(*args) if context is not None else None
    assert_close(got, ref(*args))
    if plain is not None:
        assert_close(got, plain)
    assert stats == hlo_stats(ref, *args)
    assert _layout(report) == _layout(gs.explain(want, mesh, *args, **kw))
    assert_report_matches_hlo(report, stats)
    assert not report.fallbacks
    return report


def test_with_sharding_constraint_named_sharding_is_gs_shard():
    def form(x, w):
        x = jax.lax.with_sharding_constraint(x, NamedSharding(MESH, P("data")))
        return jnp.tanh(x @ jax.lax.with_sharding_constraint(w, NamedSharding(MESH, P(None, "model")))).sum(1)

    report = same_as_gs(form)
    origin = report.inputs[0].origin
    assert origin.startswith("user annotation with_sharding_constraint(P('data',)) at " + HERE + "")


def test_the_crash_from_the_issue_is_a_program():
    mesh = gs.make_mesh({"data": 8})
    f = gs.partition(lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P("data"))) * 2, mesh)
    x = jnp.arange(64.0).reshape(8, 8)
    assert_close(f(x), x * 2)
    assert f(x).sharding.spec == P("data")


def test_bare_partition_spec_under_set_mesh_and_under_partition_alone():
    def form(x, w):
        x = jax.lax.with_sharding_constraint(x, P("data"))
        return jnp.tanh(x @ jax.lax.with_sharding_constraint(w, P(None, "model"))).sum(1)

    same_as_gs(form, context=jax.set_mesh(MESH))
    same_as_gs(form)  # gs.partition traces under its mesh when none is set, as jax.set_mesh would
    with jax.sharding.use_abstract_mesh(MESH.abstract_mesh):  # JAX 0.10's other context (it has no use_mesh)
        assert_close(gs.partition(form, MESH)(X, W), reference(X, W))
    assert not hasattr(jax.sharding, "use_mesh")  # docs/partitioner.md says so of the installed JAX


def test_in_and_out_shardings_in_any_mix():
    """NamedSharding, PartitionSpec and None side by side, as jax.jit takes them."""
    plain = lambda x, w: jnp.tanh(x @ w).sum(1)
    ins = (NamedSharding(MESH, P("data")), P(None, "model"))
    for outs in (None, P("data"), NamedSharding(MESH, P("data"))):
        f = gs.partition(plain, MESH, in_shardings=ins, out_shardings=outs)
        assert_close(f(X, W), reference(X, W))
        assert hlo_stats(f, X, W) == hlo_stats(gs.partition(reference, MESH), X, W)
    assert _layout(gs.explain(plain, MESH, X, W, in_shardings=ins)) == _layout(gs.explain(reference, MESH, X, W))


def test_unconstrained_dims_are_left_to_propagation():
    def form(x, w):  # dim 1 of x open: the contraction keeps it whole, as the gs.shard program does
        x = jax.lax.with_sharding_constraint(x, P("data", P.UNCONSTRAINED))
        return jnp.tanh(x @ jax.lax.with_sharding_constraint(w, P(P.UNCONSTRAINED, "model"))).sum(1)

    same_as_gs(form, context=jax.set_mesh(MESH))

    def opened(x):  # an open dim takes the split its neighbour proposes, the closed one stays as stated
        y = jax.lax.with_sharding_constraint(x * 2, P(None, P.UNCONSTRAINED))
        return gs.shard(y + 1, (None, "model"))

    report = gs.explain(opened, MESH, X)
    assert str(report.inputs[0].planned) == "[-, model]"
    closed = gs.explain(lambda x: gs.shard(jax.lax.with_sharding_constraint(x * 2, P(None, None)) + 1,
                                           (None, "model")), MESH, X)
    assert str(closed.inputs[0].planned) == "[-, -]"


def test_device_put_inside_the_function_is_an_annotation():
    def form(x, w):
        x = jax.device_put(x, NamedSharding(MESH, P("data")))
        return jnp.tanh(x @ jax.device_put(w, NamedSharding(MESH, P(None, "model")))).sum(1)

    same_as_gs(form)

    def both(x, w):  # one device_put of two operands: an annotation each
        x, w = jax.device_put((x, w), (NamedSharding(MESH, P("data")), NamedSharding(MESH, P(None, "model"))))
        return jnp.tanh(x @ w).sum(1)

    same_as_gs(both)
    # to a bare spec it needs the concrete mesh of jax.set_mesh, which cannot be entered inside jit
    bare = lambda x, w: jnp.tanh(jax.device_put(x, P("data")) @ jax.device_put(w, P(None, "model"))).sum(1)
    with pytest.raises(ValueError, match="set_mesh"):
        gs.partition(bare, MESH)(X, W)
    same_as_gs(bare, context=jax.set_mesh(MESH))
    # to no sharding (a plain copy) it states nothing: the split beyond it reaches its operand
    report = gs.explain(lambda x: gs.shard(jax.device_put(x * 2) + 1, (None, "model")), MESH, X)
    assert str(report.inputs[0].planned) == "[-, model]" and "FALLBACK" not in report.table()


def test_reshard_on_an_explicit_mesh_inside_and_outside_set_mesh():
    mesh = jax.make_mesh((2, 4), ("data", "model"))  # Explicit axes: JAX 0.10's default

    def form(x, w):
        return jnp.tanh(jax.sharding.reshard(x, P("data")) @ jax.sharding.reshard(w, P(None, "model"))).sum(1)

    same_as_gs(form, mesh=mesh, context=jax.set_mesh(mesh))
    same_as_gs(form, mesh=mesh)  # partitioned over the Explicit mesh: bare specs resolve against it

    def named(x, w):
        x = jax.sharding.reshard(x, NamedSharding(mesh, P("data")))
        return jnp.tanh(x @ jax.sharding.reshard(w, NamedSharding(mesh, P(None, "model")))).sum(1)

    same_as_gs(named, mesh=mesh)
    with jax.set_mesh(mesh):  # arguments committed in the user's types
        x, w = jax.device_put(X, P("data")), jax.device_put(W, P(None, "model"))
        got = gs.partition(lambda x, w: jnp.tanh(x @ w).sum(1), mesh)(x, w)
        assert_close(got, reference(X, W))


@pytest.mark.parametrize("make", ["jax.make_mesh", "gs.make_mesh"])
def test_results_come_back_on_the_users_own_mesh(make):
    """Whatever mesh the user passes, partitioned results carry a sharding on that mesh, axis types included
    (the per-device program runs on its Auto twin; the buffers are relabelled, not copied): arithmetic with a
    jit result under jax.set_mesh works, and a result feeds the partitioned function again."""
    mesh = jax.make_mesh((2, 4), ("data", "model")) if make == "jax.make_mesh" else gs.make_mesh(
        {"data": 2, "model": 4})

    annotate = jax.sharding.reshard if make == "jax.make_mesh" else jax.lax.with_sharding_constraint  # each its
    # authors' form for the mesh's axis types

    def f(x, w1, w2):
        return jax.nn.relu(annotate(x @ w1, P("data", "model"))) @ w2
    keys = jax.random.split(jax.random.key(0), 3)
    shapes = ((8, 16), (16, 32), (32, 16))
    specs = (P("data"), P(None, "model"), P())
    with jax.set_mesh(mesh):
        x, w1, w2 = (jax.device_put(jax.random.normal(k, s), NamedSharding(mesh, p))
                     for k, s, p in zip(keys, shapes, specs))
        pf = gs.partition(f, mesh)
        got = pf(x, w1, w2)
        assert got.sharding.mesh == mesh and got.sharding.mesh.axis_types == mesh.axis_types
        assert float(jnp.max(jnp.abs(got - jax.jit(f)(x, w1, w2)))) < 1e-4
        again = pf(got, w1, w2)
        assert again.sharding.mesh == mesh
        assert_close(again, jax.jit(f)(got, w1, w2))


def test_explicit_out_sharding_of_an_op_is_an_annotation():
    mesh = jax.make_mesh((2, 4), ("data", "model"))

    def form(x, w):
        x, w = jax.sharding.reshard(x, P("data")), jax.sharding.reshard(w, P(None, "model"))
        return jnp.tanh(jnp.einsum("bd,df->bf", x, w, out_sharding=P("data", None))).sum(1)

    report = gs.explain(form, mesh, X, W)
    origins = [o.origin for r in report.rows for o in r.outputs]
    assert any(o.startswith("user annotation dot_general(out_sharding=P('data', None)) at " + HERE + "")
               for o in origins), origins
    with jax.set_mesh(mesh):
        f = gs.partition(form, mesh)
        assert_close(f(X, W), jax.jit(form)(X, W))
        assert_report_matches_hlo(report, hlo_stats(f, X, W))

    def typed(x):  # a sharding JAX fills in from a type is named as one, not as the user's out_sharding
        return jnp.zeros_like(jax.sharding.reshard(x, P("data"))) + 1

    origins = [o.origin for r in gs.explain(typed, mesh, X).rows for o in r.outputs]
    assert any("broadcast_in_dim typed P('data', None)" in o for o in origins), origins
    assert not any("(out_sharding=" in o for o in origins), origins


def test_an_annotation_on_another_mesh_names_both_meshes():
    other = gs.make_mesh({"x": 8})
    f = gs.partition(lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(other, P("x"))) * 2, MESH)
    with pytest.raises(ValueError, match=r"with_sharding_constraint\(P\('x',\)\) at .* is on Mesh\(\{'x': 8\}, "
                                         r"devices \[0, 1, 2, 3, 4, 5, 6, 7\]\), but the function is partitioned "
                                         r"over Mesh\(\{'data': 2, 'model': 4\}.*other axes"):
        f(X)
    flipped = gs.make_mesh({"data": 2, "model": 4}, devices=jax.devices()[::-1])
    g = gs.partition(lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(flipped, P("data"))) * 2, MESH)
    with pytest.raises(ValueError, match=r"devices \[7, 6, 5, 4, 3, 2, 1, 0\]\), but the function is partitioned "
                                         r"over Mesh\(\{'data': 2, 'model': 4\}, devices \[0, 1, 2, 3, 4, 5, 6, "
                                         r"7\]\) \(the same axes over another device order\)"):
        g(X)
    with jax.set_mesh(other), pytest.raises(ValueError, match=r"the context mesh \(jax.set_mesh\) is on "
                                                          r"Mesh\(\{'x': 8\}.*\(other axes\)"):
        gs.partition(lambda x: x * 2, MESH)(X)
    with jax.set_mesh(flipped), pytest.raises(ValueError, match=r"the context mesh \(jax.set_mesh\) is on "
                                                            r"Mesh.*devices \[7, 6, .*another device order"):
        gs.partition(lambda x: x * 2, MESH)(X)
    with jax.sharding.use_abstract_mesh(other.abstract_mesh), pytest.raises(
            ValueError, match=r"the context mesh .* is on AbstractMesh\(\{'x': 8\}\)"):
        gs.partition(lambda x: x * 2, MESH)(X)


def test_annotations_inside_loops_branches_and_checkpoints():
    def form(ws, x):
        def body(h, w):
            h = jax.lax.with_sharding_constraint(h, P("data", None))
            h = jax.checkpoint(lambda h, w: jnp.tanh(jax.lax.with_sharding_constraint(h @ w, P("data", "model"))))(
                h, w)
            h = jax.lax.cond(h.sum() > 0, lambda h: jax.lax.with_sharding_constraint(h, P("data", "model")) * 2,
                             lambda h: h, h)
            return h @ w.T, None
        return jnp.sum(jax.lax.scan(body, x, ws)[0] ** 2)

    def want(ws, x):
        def body(h, w):
            h = gs.shard(h, ("data", None))
            h = jax.checkpoint(lambda h, w: jnp.tanh(gs.shard(h @ w, ("data", "model"))))(h, w)
            h = jax.lax.cond(h.sum() > 0, lambda h: gs.shard(h, ("data", "model")) * 2, lambda h: h, h)
            return h @ w.T, None
        return jnp.sum(jax.lax.scan(body, x, ws)[0] ** 2)

    ws = np.linspace(-0.2, 0.2, 3 * 32 * 64, dtype=np.float32).reshape(3, 32, 64)
    x = np.linspace(-1, 1, 16 * 32, dtype=np.float32).reshape(16, 32)
    same_as_gs(jax.grad(form), jax.grad(want), (ws, x), context=jax.set_mesh(MESH),
               in_shardings=(P(None, None, "model"), None))


def test_the_xla_backend_composes_with_grad_and_jit():
    """backend="xla" is a jax.jit function: on an Auto mesh it differentiates and nests as one; on an Explicit
    mesh it enters jax.set_mesh when called, and under jax.grad or jax.jit (a trace) it keeps the caller's
    context, which Explicit axes need as jax.jit does."""
    loss = lambda x: jnp.tanh(gs.shard(x, ("data", None))).sum()
    xla = gs.partition(loss, MESH, backend="xla")
    assert_close(jax.grad(xla)(X), jax.grad(loss)(X))
    assert_close(jax.jit(xla)(X), loss(X))
    explicit = jax.make_mesh((2, 4), ("data", "model"))
    xla = gs.partition(loss, explicit, backend="xla")
    assert_close(xla(X), loss(X))
    with jax.set_mesh(explicit):
        assert_close(jax.grad(xla)(X), jax.grad(loss)(X))
        assert_close(jax.jit(xla)(X), loss(X))


# --------------------------------------------------------------------------- Flax

def _dense(features, names, name):
    return nn.Dense(features, use_bias=False, name=name,
                    kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), names))


class FlaxBlock(nn.Module):
    """A pre-LayerNorm Transformer block as Flax users write one: only Flax's logical names, no gs call."""
    heads: int = 4

    @nn.compact
    def __call__(self, x):
        B, L, D = x.shape
        x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
        scale = nn.with_logical_partitioning(nn.initializers.ones, ("embed",))
        h = nn.LayerNorm(use_bias=False, scale_init=scale)(x)
        q, k, v = (_dense(D, ("embed", "heads"), n)(h).reshape(B, L, self.heads, D // self.heads) for n in "qkv")
        q = nn.with_logical_constraint(q, ("batch", "length", "heads", "kv"))
        a = nn.dot_product_attention(q, k, v, mask=nn.make_causal_mask(jnp.ones((B, L))))
        a = nn.with_logical_constraint(a, ("batch", "length", "heads", "kv"))
        x = nn.with_logical_constraint(x + _dense(D, ("heads", "embed"), "o")(a.reshape(B, L, D)),
                                       ("batch", "length", "embed"))
        h = nn.LayerNorm(use_bias=False, scale_init=scale)(x)
        h = nn.with_logical_constraint(jax.nn.gelu(_dense(4 * D, ("embed", "mlp"), "wi")(h)),
                                       ("batch", "length", "mlp"))
        return nn.with_logical_constraint(x + _dense(D, ("mlp", "embed"), "wo")(h), ("batch", "length", "embed"))


def _flax_block(boxed_params: bool):
    rules = for_mesh(DEFAULT_RULES, MESH.axis_names)
    model = FlaxBlock()
    x = np.asarray(jax.random.normal(jax.random.key(0), (8, 16, 32)))
    boxed = model.init(jax.random.key(1), x)
    names = nn.get_partition_spec(boxed)

    def loss(params, x):
        with nn.logical_axis_rules(rules):
            return jnp.mean(model.apply(params, x) ** 2)

    return rules, names, boxed if boxed_params else nn.unbox(boxed), x, jax.value_and_grad(loss)


def test_flax_block_with_logical_names_gets_the_rules_layout():
    """Params laid out by nn.logical_to_mesh from their logical names (in_shardings), activations by
    nn.with_logical_constraint: each lands where the rules table puts it, as our own models' do."""
    rules, names, params, x, step = _flax_block(False)
    specs = nn.logical_to_mesh(names, rules)
    f = gs.partition(step, MESH, in_shardings=(specs, None))
    want = jax.jit(step)(params, x)
    assert_close(f(params, x), want, rtol=2e-5, atol=2e-5)
    report = gs.explain(step, MESH, params, x, in_shardings=(specs, None))
    planned = {v.name: v.planned for v in report.inputs}
    for path, logical in jax.tree_util.tree_flatten_with_path(names, is_leaf=lambda s: isinstance(s, P))[0]:
        name = "params" + jax.tree_util.keystr(path)
        assert planned[name].spec() == P(*mesh_spec(tuple(logical), DEFAULT_RULES, MESH.axis_names)), name
    assert str(report.inputs[-1].planned) == "[data, -, -]"  # x: ("batch", "length", "embed")
    assert "with_sharding_constraint(P('data', None, None)) at " + HERE + "" in report.inputs[-1].origin
    stats, xla = hlo_stats(f, params, x), hlo_stats(gs.partition(step, MESH, in_shardings=(specs, None),
                                                                 backend="xla"), params, x)
    assert_report_matches_hlo(report, stats)
    assert sum(s["moved_bytes"] for s in stats.values()) <= sum(s["moved_bytes"] for s in xla.values())


def test_boxed_params_are_constrained_where_flax_unboxes_them():
    """LogicallyPartitioned params passed boxed: Flax constrains each where the module reads it, so with no
    in_shardings at all the step gets the same layout and collectives as from in_shardings."""
    rules, names, boxed, x, step = _flax_block(True)
    specs = nn.logical_to_mesh(names, rules)
    plain = nn.unbox(boxed)
    f = gs.partition(step, MESH)
    value, grads = f(boxed, x)
    want_value, want_grads = jax.jit(step)(plain, x)
    assert_close(value, want_value, rtol=2e-5, atol=2e-5)
    assert_close(nn.unbox(grads), want_grads, rtol=2e-5, atol=2e-5)
    ref = gs.partition(step, MESH, in_shardings=(specs, None))
    assert hlo_stats(f, boxed, x) == hlo_stats(ref, plain, x)
    report = gs.explain(step, MESH, boxed, x)
    kernel = [v for v in report.inputs if v.name.endswith("['wi']['kernel'].value")][0]
    assert str(kernel.planned) == "[-, model]"


def test_flax_partitioning_helpers():
    """flax.linen.partitioning's t5x-style helpers: param_with_axes and with_sharding_constraint under
    axis_rules."""
    from flax.linen import partitioning as nnp

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            w = nnp.param_with_axes("w", nn.initializers.lecun_normal(), (64, 32), axes=("embed", "mlp"))
            x = nnp.with_sharding_constraint(x, ("batch", "embed"))
            return jnp.tanh(x @ w).sum(1)

    model = MLP()
    variables = model.init(jax.random.key(0), X)
    rules = for_mesh(DEFAULT_RULES, MESH.axis_names)

    def form(x, w):
        with nnp.axis_rules(rules):
            return model.apply({"params": {"w": gs.shard(w, (None, "model"))}}, x)

    assert variables["params_axes"]["w_axes"].names == ("embed", "mlp")
    same_as_gs(form)


def test_nnx_sharding_metadata():
    """flax nnx: a Linear whose kernel has sharding metadata, created inside the partitioned function (an init
    under jit): the kernel is created where the metadata says."""
    from flax import nnx

    def create(key):
        fc = nnx.Linear(16, 32, kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(),
                                                                   (None, "model")), rngs=nnx.Rngs(key))
        return fc.kernel[...], fc.bias[...]

    key = jax.random.key(0)
    kernel, bias = gs.partition(create, MESH)(key)
    assert kernel.sharding.spec == P(None, "model") and bias.sharding.spec == P()
    with jax.set_mesh(MESH):  # flax requires a mesh context for sharding metadata under jax.jit
        assert_close(kernel, jax.jit(create)(key)[0])
    assert "with_sharding_constraint(P(None, 'model'))" in gs.explain(create, MESH, key).outputs[0].origin


def test_flax_optax_train_step_under_set_mesh_on_an_explicit_mesh():
    """A Flax linen + optax step as JAX 0.10 users run it: jax.make_mesh (Explicit axes), jax.set_mesh, the
    batch resharded onto `data`; ours equals jax.jit's and moves no more than XLA's partitioner."""
    import helpers

    step, abstract = helpers.flax_optax_step(16, 24, 32, 10)
    mesh = jax.make_mesh((2, 4), ("data", "model"))

    def user_step(params, opt_state, x, y):  # the helper's gs.shard of x becomes the user's reshard
        return step(params, opt_state, jax.sharding.reshard(x, P("data", None)), y)

    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: np.asarray(rng.standard_normal(s.shape) * 0.1, np.float32), abstract[0])
    opt_state = optax.adamw(1e-3).init(params)
    x, y = np.asarray(rng.standard_normal((16, 24)), np.float32), rng.integers(0, 10, 16).astype(np.int32)
    with jax.set_mesh(mesh):
        want = jax.jit(user_step)(params, opt_state, x, y)
        ours = gs.partition(user_step, mesh)
        got = ours(params, opt_state, x, y)
        stats = hlo_stats(ours, params, opt_state, x, y)
        xla = hlo_stats(gs.partition(user_step, mesh, backend="xla"), params, opt_state, x, y)
        report = gs.explain(user_step, mesh, params, opt_state, x, y)
    assert_close(got, want, rtol=2e-5, atol=2e-5)
    assert_report_matches_hlo(report, stats)
    assert sum(s["moved_bytes"] for s in stats.values()) <= sum(s["moved_bytes"] for s in xla.values())
    assert any("reshard(P('data', None)) at " + HERE + "" in v.origin for v in report.inputs)


def test_readme_bring_your_own_model(capsys):
    """README's section is examples/flax_model.py: its code lines are the example's, its printed lines what
    the example prints, and the example moves no more than XLA's partitioner."""
    import os
    import re

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    readme = open(os.path.join(root, "README.md")).read()
    section = readme[readme.index("## Bring your own model"):readme.index("## Reading the report")]
    code, printed = re.findall(r"```(?:python)?\n(.*?)```", section, re.S)
    path = os.path.join(root, "examples", "flax_model.py")
    source = open(path).read()
    for line in code.splitlines():
        assert line.strip() == "..." or line in source, line
    report, (ours, xla) = load_script("examples", "flax_model.py").main()
    out = capsys.readouterr().out
    for line in printed.splitlines():
        assert line.strip() == "..." or line in out.splitlines(), line
    assert_report_matches_hlo(report, ours)
    assert sum(s["moved_bytes"] for s in ours.values()) <= sum(s["moved_bytes"] for s in xla.values())


@pytest.mark.slow  # two partitions and compiles of a 4-layer LM (~30 s on 2 cores)
def test_our_own_model_spelled_the_flax_way_partitions_the_same(monkeypatch):
    """models/ annotates with gs.shard through models.logical.constrain; spelled instead with Flax's
    nn.with_logical_constraint under nn.logical_axis_rules of the same table, the LM's train step (params in
    and gradients out in the table's layout, as the trainer gives them) has the same collectives and values."""
    import os

    from gshard_jax import configs
    from gshard_jax.models import layers, moe, transformer

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = configs.load(os.path.join(root, "experiments", "tiny_dense_lm.py"))
    model = configs.build_model(cfg.model)
    tokens = jax.random.randint(jax.random.key(0), (8, 17), 1, cfg.model.vocab_size)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    boxed = model.init(jax.random.key(2), batch["inputs"])
    params = nn.unbox(boxed)
    specs = nn.logical_to_mesh(nn.get_partition_spec(boxed), for_mesh(DEFAULT_RULES, MESH.axis_names))
    step = jax.value_and_grad(lambda p, b: transformer.loss_fn(model, p, b)[0])
    ours = gs.partition(step, MESH, in_shardings=(specs, None), out_shardings=(P(), specs))
    want, stats = ours(params, batch), hlo_stats(ours, params, batch)

    def flax_constrain(x, names, rules, grad=True):
        with nn.logical_axis_rules(for_mesh(rules, MESH.axis_names)):
            return nn.with_logical_constraint(x, tuple(names))

    for module in (layers, moe, transformer):
        monkeypatch.setattr(module, "constrain", flax_constrain)
    flax_spelled = gs.partition(step, MESH, in_shardings=(specs, None), out_shardings=(P(), specs))
    assert_close(flax_spelled(params, batch), want, rtol=1e-5, atol=1e-6)
    assert hlo_stats(flax_spelled, params, batch) == stats
    report = gs.explain(step, MESH, params, batch, in_shardings=(specs, None), out_shardings=(P(), specs))
    assert "with_sharding_constraint(" in report.table() and not report.fallbacks
