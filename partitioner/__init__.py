"""The partitioner pass, its phases as sub-packages, lowest first (PHASES; docs/partitioner.md): the program
representation, the factor rules, the machine and its costs, the strategies and the registry, propagation,
the report, the lowering and the automatic sharding. A phase imports only from itself and the phases
before it (tests/test_layering.py)."""
from .costs.cost import Collective
from .costs.hardware import Hardware
from .representation.sharding import Sharding

PHASES = ("representation", "rules", "costs", "strategies", "propagation", "reporting", "lowering", "auto")

__all__ = ["Collective", "Hardware", "Sharding"]
