"""Mula-220B-A10B (REFERENCE section B): 64 layers, hidden 3072, 240 SwiGLU experts of 1536, 8 chosen per token."""
from gshard_jax.configs import mula


def get_config():
    cfg = mula(num_layers=64, d_model=3072, num_heads=24, d_ff=1536, num_experts=240)
    cfg.mesh.update(dict(data=-1, expert=8))  # expert parallelism over 8 devices, data parallel beyond
    return cfg
