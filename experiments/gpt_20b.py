"""AxoNN's GPT-20B (seed 003, Table II): 32 layers, hidden 7168, 56 heads, a GELU MLP of 4 x hidden.
Batch and sequence as AxoNN's comm-model check (256 sequences of 2048 tokens; 80B: 8192, our choice).
For the planner: `gshard-jax plan --config experiments/gpt_20b.py
--devices 32 --hardware perlmutter-a100 --comm-model axonn --min-tp 16` ranks its 4D grids as AxoNN's model does."""
from gshard_jax.configs import mula


def get_config():
    cfg = mula(num_layers=32, d_model=7168, num_heads=56, d_ff=4 * 7168)
    cfg.model.update(dict(ffn_activation="gelu", norm="layernorm", head_dim=128))
    cfg.mesh.update(dict(data=-1))
    cfg.train.update(dict(batch_size=256, seq_len=2048))
    return cfg
