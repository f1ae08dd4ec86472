"""Mula-20B-A2B (seed 001; docs/references.md):
32 layers, hidden 2048, 96 SwiGLU experts of 1024, 8 chosen per token."""
from gshard_jax.configs import mula


def get_config():
    cfg = mula(num_layers=32, d_model=2048, num_heads=16, d_ff=1024, num_experts=96)
    # seed 001 on Aurora: 3,072 sequences of 2,048 tokens (configs.mula); expert parallelism within a node of 12
    # tiles, data parallel across nodes, ZeRO-1 with its expert-parallel-aware sharded optimizer (non-expert
    # states over data x expert)
    cfg.mesh.update(dict(data=-1, expert=12))
    cfg.train.update(dict(zero_stage=1, epso=True))
    return cfg
