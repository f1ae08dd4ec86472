"""The training runtime: the trainer and its loop (train), data, checkpoints, metrics, the optimizer and
sharded state, fault handling and the supervisor (faults, launch), and the ours-against-XLA comparison.
The public API (annotations, partition, explain, pipelines) is gshard_jax itself; this package runs it."""
