"""The planner: which parallel configuration to run, ranked by predicted step time within a memory budget."""
from ..partitioner.costs import hardware
from ..partitioner.costs.hardware import PROFILES, Hardware
from .search import Plan, plan

__all__ = ["PROFILES", "Hardware", "Plan", "hardware", "plan"]
