"""The GShard MoE einsum chain, partitioned over 8 (simulated) devices, with its report."""
import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import gshard_jax as gs  # noqa: E402
from gshard_jax.models.moe import expert_einsums  # noqa: E402

N = len(jax.devices())


def moe(dispatch, combine, x, wi, wo):
    return expert_einsums(dispatch, combine, x, wi, wo, N)


def main():
    rng = np.random.default_rng(0)
    G, S, E, C, M, H = N, 16, N, 4, 32, 64
    dispatch = (rng.random((G, S, E, C)) < 0.1).astype(np.float32)
    combine = dispatch * rng.random((G, S, E, C)).astype(np.float32)
    x = rng.standard_normal((G, S, M)).astype(np.float32)
    wi = rng.standard_normal((E, M, H)).astype(np.float32) / 8
    wo = rng.standard_normal((E, H, M)).astype(np.float32) / 8
    mesh = gs.make_mesh({"expert": N})
    y = gs.partition(moe, mesh)(dispatch, combine, x, wi, wo)
    ref = moe(dispatch, combine, x, wi, wo)
    print(f"max |partitioned - unpartitioned| = {float(jnp.max(jnp.abs(y - ref))):.2e}")
    print(gs.explain(moe, mesh, dispatch, combine, x, wi, wo))


if __name__ == "__main__":
    main()
