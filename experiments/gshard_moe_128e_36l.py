"""GShard MoE(128E, 36L) (GShard Table 1; docs/references.md): 128 experts per MoE layer, 36 layers."""
from gshard_jax.configs import gshard


def get_config():
    cfg = gshard(num_experts=128, num_layers=36)
    cfg.mesh.update(dict(data=1, expert=-1))  # experts over every device, as in the paper (E = cores)
    return cfg
