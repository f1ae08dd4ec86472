"""The partitioner pass, its modules in layers (docs/partitioner.md): the program representation, rules and
costs, lowering strategies, the per-primitive registry, and the passes (fold, propagation, lowering)."""
from .cost import Collective
from .hardware import Hardware
from .sharding import Sharding

__all__ = ["Collective", "Hardware", "Sharding"]
