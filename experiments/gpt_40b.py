"""AxoNN's GPT-40B (seed 003, Table II): 38 layers, hidden 9216, 72 heads, a GELU MLP of 4 x hidden.
Batch and sequence as AxoNN's comm-model check (256 sequences of 2048 tokens; 80B: 8192, our choice).
For the planner: `gshard-jax plan --config experiments/gpt_40b.py
--devices 64 --hardware perlmutter-a100 --comm-model axonn --min-tp 32` ranks its 4D grids as AxoNN's model does."""
from gshard_jax.configs import mula


def get_config():
    cfg = mula(num_layers=38, d_model=9216, num_heads=72, d_ff=4 * 9216)
    cfg.model.update(dict(ffn_activation="gelu", norm="layernorm", head_dim=128))
    cfg.mesh.update(dict(data=-1))
    cfg.train.update(dict(batch_size=256, seq_len=2048))
    return cfg
