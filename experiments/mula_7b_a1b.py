"""Mula-7B-A1B (seed 001; docs/references.md): 16 layers, hidden 2048, 64 SwiGLU experts of 1024, 8 chosen per token."""
from gshard_jax.configs import mula


def get_config():
    cfg = mula(num_layers=16, d_model=2048, num_heads=16, d_ff=1024, num_experts=64)
    # seed 001: 3,072 sequences of 2,048 tokens (configs.mula), data parallel over 3,072 tiles (every tile holds
    # all 64 experts)
    cfg.mesh.update(dict(data=-1, expert=1))
    return cfg
