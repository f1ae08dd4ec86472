"""A tiny OLMoE-style MoE LM that trains on a CPU: 4 layers, d 128, 8 SwiGLU experts (top-2) in every layer,
GShard einsum dispatch; mesh {data 2, expert 4}."""
from gshard_jax.configs import mula


def get_config():
    cfg = mula(num_layers=4, d_model=128, num_heads=4, d_ff=256, num_experts=8)
    cfg.model.update(dict(vocab_size=2048, head_dim=32, scan=False, remat="none", dtype="float32"))
    cfg.model.moe.update(dict(k=2, normalize="before_drop", balance="top1", dispatch="einsum",
                              capacity_factor=1.25, eval_capacity_factor=2.0))
    cfg.mesh.update(dict(data=2, expert=4))
    cfg.train.update(dict(num_steps=300, batch_size=16, seq_len=128, learning_rate=3e-3, min_learning_rate=3e-4,
                          warmup_steps=30, checkpoint_every=100, model_checkpoint_every=300, log_every=10,
                          eval_every=50))
    return cfg
