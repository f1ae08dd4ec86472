"""Every private JAX name the project uses, in one place, so a JAX upgrade is checked here and nowhere else.

Checked against JAX 0.10.0 to 0.10.2 (setup.cfg pins jax>=0.10,<0.11). Everything else comes from JAX's
public API: jax.extend.core (primitives, ClosedJaxpr, Literal), jax.extend.source_info_util and
jax.interpreters. tests/test_layering.py holds every other module to that.

- `convert_constvars_jaxpr`: a closed jaxpr's constants as leading inputs, for the checkpoints and pipeline
  residuals the partitioner re-emits; jax.interpreters.partial_eval does not export it.
- `clear_compilation_cache`: a benchmark's compile timed again rather than found in JAX's cache.

JAX 0.11 changes the scan primitive's parameters (`jaxpr, length, reverse, unroll, ft_in, ft_out`; no
`num_consts`/`num_carry`), which partitioner/control_flow.py reads: porting starts there.
"""
from __future__ import annotations

from jax._src.interpreters import pxla as _pxla
from jax._src.interpreters.partial_eval import convert_constvars_jaxpr

__all__ = ["clear_compilation_cache", "convert_constvars_jaxpr"]


def clear_compilation_cache() -> None:
    """Forget compiled executables, so the next compile of the same program is timed, not looked up."""
    _pxla._cached_compilation.cache_clear()
