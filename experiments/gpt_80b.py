"""AxoNN's GPT-80B (seed 003, Table II): 42 layers, hidden 12288, 96 heads, a GELU MLP of 4 x hidden.
Batch and sequence as AxoNN's comm-model check (256 sequences of 2048 tokens; 80B: 8192, our choice).
For the planner: `gshard-jax plan --config experiments/gpt_80b.py
--devices 4096 --hardware perlmutter-a100 --comm-model axonn --min-tp 64` ranks its 4D grids as AxoNN's model does."""
from gshard_jax.configs import mula


def get_config():
    cfg = mula(num_layers=42, d_model=12288, num_heads=96, d_ff=4 * 12288)
    cfg.model.update(dict(ffn_activation="gelu", norm="layernorm", head_dim=128))
    cfg.mesh.update(dict(data=-1))
    cfg.train.update(dict(batch_size=8192, seq_len=2048))
    return cfg
