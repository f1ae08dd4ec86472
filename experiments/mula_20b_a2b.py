"""Mula-20B-A2B (REFERENCE section B): 32 layers, hidden 2048, 96 SwiGLU experts of 1024, 8 chosen per token."""
from gshard_jax.configs import mula


def get_config():
    cfg = mula(num_layers=32, d_model=2048, num_heads=16, d_ff=1024, num_experts=96)
    cfg.mesh.update(dict(data=-1, expert=8))  # expert parallelism over 8 devices, data parallel beyond
    return cfg
