"""The partitioner pass: sharding types, factor rules, propagation, resharding, lowering, cost, HLO."""
from .cost import Collective, HardwareProfile
from .sharding import Sharding

__all__ = ["Collective", "HardwareProfile", "Sharding"]
