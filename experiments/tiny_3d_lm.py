"""A tiny dense LM in AxoNN's 3D layout on 8 simulated devices: mesh {x 2, y 2, z 2}; model width over x,
heads / FFN units / vocabulary over y (ordinary and transposed layers alternate, so consecutive layers need
no reshard), the batch and the weights' storage over z (gathered per layer, gradients reduce-scattered)."""
import os

from gshard_jax.configs import load


def get_config():
    cfg = load(os.path.join(os.path.dirname(__file__), "tiny_dense_lm.py"))
    cfg.mesh.update(dict(data=1, expert=1, x=2, y=2, z=2))
    return cfg
