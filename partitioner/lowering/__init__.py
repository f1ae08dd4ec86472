"""The lowering: the program run equation by equation on local shards inside jax.shard_map.

Holds lower.py (the driver), local_shards.py (reading a value in the sharding an op needs), lower_regions.py
(loops, branches, checkpointed and manual regions) and lower_rows.py (the report's rows). May import every
phase below it."""
