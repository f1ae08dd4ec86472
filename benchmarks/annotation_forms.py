"""Every way JAX code states a sharding, on one small Flax + optax train step: ours against XLA's partitioner.

The step is a 2-layer Flax MLP (Dense, gelu, LayerNorm, Dense) trained by optax's adamw on cross-entropy,
params Megatron-split over `model` by in_shardings, the batch over `data`; its activations are annotated in
each spelling in turn. Prints, per spelling, the collectives and bytes moved per device and the per-device
flops of the compiled program, ours and XLA's, and checks ours equals jax.jit's result.

    python benchmarks/annotation_forms.py
"""
import jax

jax.config.update("jax_num_cpu_devices", 8)

import contextlib  # noqa: E402

import flax.linen as nn  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import gshard_jax as gs  # noqa: E402

AUTO = gs.make_mesh({"data": 2, "model": 4})
EXPLICIT = jax.make_mesh((2, 4), ("data", "model"))  # JAX 0.10's default: Explicit axes
RULES = (("batch", "data"), ("hidden", "model"), ("feature", None), ("classes", None))
LOGICAL = {("data", None): ("batch", "feature"), ("data", "model"): ("batch", "hidden")}


def _open(spec):
    return P(*(P.UNCONSTRAINED if a is None else a for a in spec))


# spelling -> (annotate(x, spec), mesh, whether the step runs under jax.set_mesh)
FORMS = {
    "gs.shard": (lambda x, s: gs.shard(x, s), AUTO, False),
    "with_sharding_constraint(NamedSharding)":
        (lambda x, s: jax.lax.with_sharding_constraint(x, NamedSharding(AUTO, P(*s))), AUTO, False),
    "with_sharding_constraint(P) under set_mesh": (lambda x, s: jax.lax.with_sharding_constraint(x, P(*s)), AUTO,
                                                   True),
    "P.UNCONSTRAINED dims": (lambda x, s: jax.lax.with_sharding_constraint(x, _open(s)), AUTO, True),
    "nn.with_logical_constraint": (lambda x, s: nn.with_logical_constraint(x, LOGICAL[s]), AUTO, True),
    "device_put(x, NamedSharding)": (lambda x, s: jax.device_put(x, NamedSharding(AUTO, P(*s))), AUTO, False),
    "reshard (Explicit mesh, set_mesh)": (lambda x, s: jax.sharding.reshard(x, P(*s)), EXPLICIT, True),
}


def build(annotate):
    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = annotate(x, ("data", None))
            h = annotate(nn.gelu(nn.Dense(256)(x)), ("data", "model"))
            return nn.Dense(16)(nn.LayerNorm()(h))

    model, opt = MLP(), optax.adamw(1e-3)

    def step(params, opt_state, x, y):
        def loss(p):
            with nn.logical_axis_rules(RULES):
                return optax.softmax_cross_entropy_with_integer_labels(model.apply(p, x), y).mean()
        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return model, opt, step


def main():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 128)).astype(np.float32)
    y = rng.integers(0, 16, 64).astype(np.int32)
    print(f"{'spelling':44s} {'ours: collectives':30s} {'bytes':>9s} {'XLA: collectives':30s} {'bytes':>9s} "
          f"{'bytes':>6s} {'flops':>6s}")
    for name, (annotate, mesh, in_context) in FORMS.items():
        model, opt, step = build(annotate)
        with jax.set_mesh(mesh) if in_context else contextlib.nullcontext():
            params = jax.device_get(model.init(jax.random.key(0), x))
        opt_state = opt.init(params)
        megatron = {"params": {"Dense_0": {"kernel": P(None, "model"), "bias": P("model")},
                               "Dense_1": {"kernel": P("model", None), "bias": None},
                               "LayerNorm_0": {"scale": P("model"), "bias": P("model")}}}
        specs = (megatron, None, None, None)
        with jax.set_mesh(mesh) if in_context else contextlib.nullcontext():
            want = jax.jit(step)(params, opt_state, x, y)
            figures = []
            for backend in ("gshard", "xla"):
                f = gs.partition(step, mesh, in_shardings=specs, backend=backend)
                compiled = f.lower(params, opt_state, x, y).compile()
                stats = gs.collective_stats(compiled)
                counts = ", ".join(f"{k} x{v['count']}" for k, v in stats.items() if v["count"])
                figures.append((counts, sum(v["moved_bytes"] for v in stats.values()),
                                compiled.cost_analysis()["flops"]))
                if backend == "gshard":
                    got = f(params, opt_state, x, y)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-5)
        (oc, ob, of), (xc, xb, xf) = figures
        print(f"{name:44s} {oc:30s} {ob:9,.0f} {xc:30s} {xb:9,.0f} {ob / xb:6.2f} {of / xf:6.2f}")


if __name__ == "__main__":
    main()
