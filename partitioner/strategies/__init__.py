"""How each op runs on local shards: the lowering's strategies and the per-primitive registry.

Holds resharding, halo exchange and windowed ops, reordering a split dim (reorder, relayout, roll),
collective matmul, manual regions, the op hooks, reductions deferred past loops (deferral, partial sums),
prefetched scans, the control-flow forms' table, and the registry that points every primitive at its
rule and strategy. May import representation/, rules/ and costs/."""
