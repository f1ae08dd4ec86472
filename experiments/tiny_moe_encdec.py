"""A tiny GShard encoder-decoder that trains on a CPU: 2 + 2 layers, d 64, every other FFN top-2 MoE of 8
ReLU experts with random second-expert routing; mesh {data 2, expert 4}."""
from gshard_jax.configs import gshard


def get_config():
    cfg = gshard(num_experts=8, num_layers=4)
    cfg.model.update(dict(vocab_size=2048, d_model=64, num_heads=4, head_dim=16, d_ff=256, scan=False,
                          remat="none", dtype="float32"))
    cfg.model.moe.update(dict(d_ff=256, group_size=None, capacity_factor=2.0))
    cfg.mesh.update(dict(data=2, expert=4))
    cfg.train.update(dict(num_steps=300, batch_size=16, seq_len=64, learning_rate=3e-3, min_learning_rate=3e-4,
                          warmup_steps=30, checkpoint_every=100, model_checkpoint_every=300, log_every=10,
                          eval_every=50))
    return cfg
