"""AxoNN's GPT-20B (seed 003, Table II): 32 layers, hidden 7168, 56 heads, a GELU MLP of 4 x hidden; 256 sequences of
2048 tokens (AxoNN's comm-model check inputs). `gshard-jax plan --config experiments/gpt_20b.py
--devices 32 --hardware perlmutter-a100 --comm-model axonn --min-tp 16` ranks its 4D grids as AxoNN's model does."""
from gshard_jax.configs import gpt


def get_config():
    return gpt(num_layers=32, d_model=7168, num_heads=56)
