"""The dense twin of tiny_moe_lm: the same layers with one SwiGLU FFN of 2 x 256 units, so the same FLOPs per
token as the MoE's two chosen experts of 256."""
import os

from gshard_jax.configs import load


def get_config():
    cfg = load(os.path.join(os.path.dirname(__file__), "tiny_moe_lm.py"))
    cfg.model.moe.num_experts = 0
    cfg.model.d_ff = 2 * cfg.model.moe.d_ff
    cfg.mesh.update(dict(data=8, expert=1))
    return cfg
