"""Bring your own model: a Flax linen Transformer block that knows nothing of gshard_jax, annotated only the Flax
way (logically partitioned params, nn.with_logical_constraint on activations), partitioned by gs.partition
under a rules table, one optax AdamW step. Prints the partition report and checks the result against jax.jit.

    python examples/flax_model.py
"""
import jax

jax.config.update("jax_num_cpu_devices", 8)  # simulated devices on a CPU host

import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import gshard_jax as gs  # noqa: E402


def dense(features, names, name):
    init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), names)
    return nn.Dense(features, use_bias=False, kernel_init=init, name=name)


class Block(nn.Module):
    """A pre-LayerNorm Transformer block: causal self-attention and a GELU MLP."""
    heads: int = 4

    @nn.compact
    def __call__(self, x):
        B, L, D = x.shape
        x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
        h = nn.LayerNorm(use_bias=False)(x)
        q, k, v = (dense(D, ("embed", "heads"), n)(h).reshape(B, L, self.heads, -1) for n in "qkv")
        a = nn.dot_product_attention(q, k, v, mask=nn.make_causal_mask(jnp.ones((B, L))))
        a = nn.with_logical_constraint(a, ("batch", "length", "heads", "kv"))
        x = x + dense(D, ("heads", "embed"), "o")(a.reshape(B, L, D))
        h = jax.nn.gelu(dense(4 * D, ("embed", "mlp"), "wi")(nn.LayerNorm(use_bias=False)(x)))
        h = nn.with_logical_constraint(h, ("batch", "length", "mlp"))
        return x + dense(D, ("mlp", "embed"), "wo")(h)


RULES = (("batch", "data"), ("length", None), ("embed", None), ("heads", "model"), ("kv", None),
         ("mlp", "model"))
model, opt = Block(), optax.adamw(1e-3)


def train_step(params, opt_state, x):
    def loss(p):
        with nn.logical_axis_rules(RULES):  # logical names -> mesh axes
            return jnp.mean(model.apply(p, x) ** 2)
    value, grads = jax.value_and_grad(loss)(params)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value


def main():
    mesh = gs.make_mesh({"data": 2, "model": 4})
    x = jax.random.normal(jax.random.key(0), (8, 16, 32))
    boxed = model.init(jax.random.key(1), x)
    specs = nn.logical_to_mesh(nn.get_partition_spec(boxed), RULES)  # the params' layout, from their names
    params = nn.unbox(boxed)
    opt_state = opt.init(params)
    step = gs.partition(train_step, mesh, in_shardings=(specs, None, None))
    report = gs.explain(train_step, mesh, params, opt_state, x, in_shardings=(specs, None, None))
    print(report)
    new_params, _, value = step(params, opt_state, x)
    want = jax.jit(train_step)(params, opt_state, x)
    for a, b in zip(jax.tree.leaves(new_params), jax.tree.leaves(want[0])):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)
    stored = new_params["params"]["wi"]["kernel"].sharding.spec
    print(f"loss {float(value):.6f}, equal to jax.jit's; wi kernel stored {stored}")
    xla = gs.partition(train_step, mesh, in_shardings=(specs, None, None), backend="xla")
    stats = [gs.collective_stats(f.lower(params, opt_state, x).compile()) for f in (step, xla)]
    moved = [sum(s["moved_bytes"] for s in st.values()) for st in stats]
    print(f"bytes moved per device: ours {moved[0]:,.0f}, XLA's partitioner {moved[1]:,.0f}")
    return report, stats


if __name__ == "__main__":
    main()
