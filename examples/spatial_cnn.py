"""One spatially split train step of a 3-D U-Net over 8 (simulated) devices, and its partition report.

The volume's depth is split over every device (models/cnn.py SPATIAL rules):
each convolution and pooling window reads its neighbours' rows by
collective-permute (halo exchange) instead of gathering the volume.

    python examples/spatial_cnn.py [--depth 32] [--resnet]
"""
import argparse
import functools

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402

import gshard_jax as gs  # noqa: E402
from gshard_jax.models import cnn  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--depth", type=int, default=32, help="volume depth (or image height with --resnet)")
    p.add_argument("--resnet", action="store_true", help="a 2-D ResNet-style classifier instead of the U-Net")
    args = p.parse_args(argv)
    mesh = gs.make_mesh({"data": 2, "model": 4})
    cfg = cnn.CNNConfig()
    if args.resnet:
        model, shape, per_voxel = cnn.ResNet(cfg, cnn.SPATIAL), (4, args.depth, 32, 3), False
    else:
        model, shape, per_voxel = cnn.UNet3D(cfg, cnn.SPATIAL), (2, args.depth, 16, 16, 1), True
    images, labels = cnn.example_batch(jax.random.key(0), shape, cfg.classes, per_voxel)
    params = model.init(jax.random.key(1), images)
    opt_state = cnn.optimizer(cfg).init(params)
    step = functools.partial(cnn.train_step, model=model, cfg=cfg)
    new_params, _, loss = gs.partition(step, mesh)(params, opt_state, images, labels)
    ref_params, _, ref_loss = jax.jit(step)(params, opt_state, images, labels)
    diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree_util.tree_leaves(new_params),
                                                                jax.tree_util.tree_leaves(ref_params)))
    print(f"loss {float(loss):.4f} (unpartitioned {float(ref_loss):.4f}); max |params - unpartitioned| = {diff:.1e}")
    print(gs.explain(step, mesh, params, opt_state, images, labels))


if __name__ == "__main__":
    main()
