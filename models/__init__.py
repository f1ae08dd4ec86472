"""Flax MoE Transformer models annotated with gshard_jax (the MoE layer and models come next)."""
