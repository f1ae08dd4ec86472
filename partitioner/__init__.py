"""The partitioner pass: sharding types, factor rules, propagation, resharding, lowering, cost, HLO."""
from .cost import Collective
from .hardware import Hardware
from .sharding import Sharding

__all__ = ["Collective", "Hardware", "Sharding"]
