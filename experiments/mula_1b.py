"""Mula-1B (seed 001; docs/references.md): the dense member, 16 layers, hidden 2048, FFN 8192."""
from gshard_jax.configs import mula


def get_config():
    # seed 001: 3,072 sequences of 2,048 tokens (configs.mula), data parallel over 3,072 tiles
    return mula(num_layers=16, d_model=2048, num_heads=16, d_ff=8192)
