"""Mula-100B-A7B (REFERENCE section B): 48 layers, hidden 3072, 144 SwiGLU experts of 1536, 8 chosen per token."""
from gshard_jax.configs import mula


def get_config():
    cfg = mula(num_layers=48, d_model=3072, num_heads=24, d_ff=1536, num_experts=144)
    cfg.mesh.update(dict(data=-1, expert=8))  # expert parallelism over 8 devices, data parallel beyond
    return cfg
