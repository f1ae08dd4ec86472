"""The replicated fallback: what the lowering does with an equation whose primitive has no rule, and the one
warning that says so.

Such an equation runs on every device as the unpartitioned program would: its operands are gathered whole, each
device computes the whole result and keeps its own block. The result is right but costs an all-gather of every
split operand and the whole computation on each device; explain() marks those rows FALLBACK with what they
send. A primitive appears here when a JAX newer than the one the project is tested on (jax_compat.NEWEST_TESTED,
constraints/newest-jax.txt) adds it; tests/test_primitive_census.py finds each one on the tested JAX.
"""
from __future__ import annotations

import warnings
from typing import Mapping

import jax

from ..representation.jax_compat import NEWEST_TESTED


class NoRuleWarning(UserWarning):
    """Partitioning met primitives without a sharding rule and ran them replicated (correct, not partitioned)."""


def message(unruled: Mapping[str, int]) -> str:
    """The warning's text for {primitive: how many of its equations the program holds}."""
    names = ", ".join(f"{name} ({n} equation{'s' if n > 1 else ''})" for name, n in sorted(unruled.items()))
    newer = (f"; JAX {jax.__version__} is newer than {NEWEST_TESTED}, the newest the project is tested on, and "
             f"may have added them" if _newer(jax.__version__, NEWEST_TESTED) else "")
    return (f"gshard_jax has no sharding rule for {names}{newer}. Each ran replicated: its operands gathered "
            f"whole on every device, each device computing the whole result and keeping its own block, so the "
            f"results are right but these ops are not partitioned. gs.explain() marks their rows FALLBACK with "
            f"the bytes they move; a rule in partitioner/strategies/registry.py would partition them.")


def warn(unruled: Mapping[str, int]) -> None:
    """One NoRuleWarning for a partitioned program, naming every primitive that had no rule (none: silent)."""
    if unruled:
        warnings.warn(message(unruled), NoRuleWarning, stacklevel=2)


def _newer(version: str, than: str) -> bool:
    """Whether release `version` comes after `than` (numeric parts compared; a suffix such as 'dev' ignored)."""
    def parts(v: str) -> tuple:
        return tuple(int("".join(c for c in p if c.isdigit()) or 0) for p in v.split(".")[:4])
    return parts(version) > parts(than)
