"""GShard's dense baseline T(96L) (GShard; docs/references.md): 48 encoder + 48 decoder layers, no experts."""
from gshard_jax.configs import gshard


def get_config():
    cfg = gshard(num_experts=0, num_layers=96)
    cfg.mesh.update(dict(data=-1, expert=1))
    return cfg
