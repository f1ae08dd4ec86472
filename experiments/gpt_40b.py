"""AxoNN's GPT-40B (seed 003, Table II): 38 layers, hidden 9216, 72 heads, a GELU MLP of 4 x hidden; 256 sequences of
2048 tokens (AxoNN's comm-model check inputs). `gshard-jax plan --config experiments/gpt_40b.py
--devices 64 --hardware perlmutter-a100 --comm-model axonn --min-tp 32` ranks its 4D grids as AxoNN's model does."""
from gshard_jax.configs import gpt


def get_config():
    return gpt(num_layers=38, d_model=9216, num_heads=72)
