"""Mula-220B-A10B (REFERENCE section B): 64 layers, hidden 3072, 240 SwiGLU experts of 1536, 8 chosen per token."""
from gshard_jax.configs import mula


def get_config():
    cfg = mula(num_layers=64, d_model=3072, num_heads=24, d_ff=1536, num_experts=240)
    # seed 001 on Aurora: expert parallelism within a node of 12 tiles, data parallel across nodes, ZeRO-1 with
    # its expert-parallel-aware sharded optimizer (non-expert states over data x expert); the paper's 8
    # pipeline stages wait for the pipeline (mesh.stage)
    cfg.mesh.update(dict(data=-1, expert=12))
    cfg.train.update(dict(zero_stage=1, epso=True))
    return cfg
