"""The planner: which parallel configuration to run, ranked by predicted step time within a memory budget."""
from ..partitioner import hardware
from ..partitioner.hardware import PROFILES, Hardware
from .search import Plan, plan

__all__ = ["PROFILES", "Hardware", "Plan", "hardware", "plan"]
