"""The factor rules: one einsum-like description per primitive of how its dims map to factors.

Holds the rule builders (factor_rules.py), the rarely emitted primitives' rules (rare_ops.py) and fused
attention's (fused_attention.py). May import representation/."""
