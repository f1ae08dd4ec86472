"""Mula-100B-A7B (seed 001; docs/references.md):
48 layers, hidden 3072, 144 SwiGLU experts of 1536, 8 chosen per token."""
from gshard_jax.configs import mula


def get_config():
    cfg = mula(num_layers=48, d_model=3072, num_heads=24, d_ff=1536, num_experts=144)
    # seed 001 on Aurora: 3,072 sequences of 2,048 tokens (configs.mula) over 3,072 tiles; expert parallelism
    # within a node of 12 tiles, data parallel across nodes, ZeRO-1 with its expert-parallel-aware sharded
    # optimizer (non-expert states over data x expert), and the paper's 4 pipeline stages with 1F1B. On 3,072
    # tiles the batch is 4 sequences per data x expert shard (768 of them), so at most 4 microbatches: ours,
    # with a bubble of (p - 1) / (m + p - 1) = 43%
    cfg.mesh.update(dict(stage=4, data=-1, expert=12))
    cfg.train.update(dict(zero_stage=1, epso=True, microbatches=4))
    cfg.pipeline.update(dict(schedule="1f1b"))
    return cfg
