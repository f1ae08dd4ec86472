"""Propagation: the program folded as XLA would, a sharding for every value, and each op's strategy chosen.

Holds fold.py (common subexpressions, pads), constraints.py (what propagation runs over), propagate.py
(shardings to a fixed point, with provenance) and strategy.py (the cheapest factor sharding per op). May
import every phase below it: representation/, rules/, costs/ and strategies/."""
