"""Mula-220B-A10B (seed 001; docs/references.md):
64 layers, hidden 3072, 240 SwiGLU experts of 1536, 8 chosen per token."""
from gshard_jax.configs import mula


def get_config():
    cfg = mula(num_layers=64, d_model=3072, num_heads=24, d_ff=1536, num_experts=240)
    # seed 001 on Aurora: 3,072 sequences of 2,048 tokens (configs.mula) over 3,072 tiles, one per tile (its
    # weak-scaling runs from 384 to 12,288 tiles keep that per tile); expert parallelism within a node of 12
    # tiles, data parallel across nodes, ZeRO-1 with its expert-parallel-aware sharded optimizer (non-expert
    # states over data x expert), and the paper's 8 pipeline stages with 1F1B. On 3,072 tiles the batch is 8
    # sequences per data x expert shard (384 of them), so at most 8 microbatches: ours, with a bubble of
    # (p - 1) / (m + p - 1) = 47%
    cfg.mesh.update(dict(stage=8, data=-1, expert=12))
    cfg.train.update(dict(zero_stage=1, epso=True, microbatches=8))
    cfg.pipeline.update(dict(schedule="1f1b"))
    return cfg
