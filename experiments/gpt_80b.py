"""AxoNN's GPT-80B (seed 003, Table II): 42 layers, hidden 12288, 96 heads, a GELU MLP of 4 x hidden; 8192 sequences of
2048 tokens (AxoNN's comm-model check inputs; the batch is our choice). `gshard-jax plan --config experiments/gpt_80b.py
--devices 4096 --hardware perlmutter-a100 --comm-model axonn --min-tp 64` ranks its 4D grids as AxoNN's model does."""
from gshard_jax.configs import gpt


def get_config():
    return gpt(num_layers=42, d_model=12288, num_heads=96, batch_size=8192)
