"""Everything that differs between the JAX releases the project supports, in one place.

Checked against JAX 0.10.0, 0.10.2, 0.11.2, 0.12.0.1 and 0.12.1 (setup.cfg: jax>=0.10,<0.13); `.ci/run` tests
NEWEST_TESTED on Python 3.12 beside README's install.

Private names: everything else comes from JAX's public API (jax.extend.core for primitives, ClosedJaxpr and
Literal, jax.extend.source_info_util, jax.interpreters); tests/test_layering.py holds every other module to
that.
- `convert_constvars_jaxpr`: a closed jaxpr's constants as leading inputs, for the checkpoints and pipeline
  residuals the partitioner re-emits; jax.interpreters.partial_eval does not export it.
- `clear_compilation_cache`: a benchmark's compile timed again rather than found in JAX's cache.
- `cudnn_installed`: whether JAX's CUDA plugin (with cuDNN) is installed, GPU or not: a GPU compile target traces
  cuDNN's attention deviceless; jax.lib does not say.
- `to_lojax`: JAX 0.12 traces some functions (jnp.searchsorted, jnp.frexp, ...) to high-level primitives
  (`call_hi_primitive`) that JAX itself expands before lowering; the partitioner expands them the same way
  (partial_eval.lower_jaxpr2), so it sees the primitives that 0.10 emits.

Parameters, read by what the equation carries, never by version strings:
- `scan_counts`: a scan's operands are its consts, then its carries, then its stacked inputs. JAX 0.10 says
  how many of each in `num_consts`/`num_carry` (and `linear`); JAX 0.11 replaced them by `ft_in`/`ft_out`,
  flat trees of the (consts, carry, xs) and (carry, ys) groups.

- `bind_on`: an op bound to compute on the host (`jax.experimental.compute_on`). JAX 0.10's compute_on is a
  context (its ops carry `ctx.compute_type`); from 0.11 it is a function transformation that makes a
  `compute_on` primitive with the body as a jaxpr, which program.py inlines as a call. `on_host` calls a
  function there the same way on every release (the offloaded optimizer update).

A fix installed on import:
- `ragged_all_to_all` under `jax.vmap`: JAX's batching rule (0.10 to 0.12) asserts when an offset or size
  operand is not batched while the rows are (a receive offset from `axis_index`, say), which is how a
  pipeline's vmapped stage runs the dropless layer's ragged exchange. The rule installed here broadcasts
  those operands over the batch first (the same values for every batch element, so the same exchange) and
  hands them to JAX's own rule.

Primitive names: `NEWEST_TESTED` is the newest release tested (the census among it); `NOT_IN_EVERY_RELEASE`
lists the registry's entries that some supported release lacks, each with the releases that emit it;
tests/test_registry.py accepts those (and only those) as absent.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

import jax
from jax._src.interpreters import batching as _batching, partial_eval as _pe, pxla as _pxla
from jax._src.interpreters.partial_eval import convert_constvars_jaxpr
from jax._src.lax import parallel as _parallel
from jax.experimental.compute_on import compute_on as _compute_on

__all__ = ["NEWEST_TESTED", "NOT_IN_EVERY_RELEASE", "bind_on", "clear_compilation_cache", "convert_constvars_jaxpr",
           "on_host", "scan_counts", "to_lojax"]

_COMPUTE_ON_TAKES_SPACES = "out_memory_spaces" in inspect.signature(_compute_on).parameters  # JAX 0.11+

# The newest JAX the project is tested on: constraints/newest-jax.txt pins it for .ci/run's second run
# (tests/test_packaging.py holds the two equal); a newer JAX in setup.cfg's range installs, and a primitive it
# adds without a rule runs replicated with a warning (lowering/fallback.py).
NEWEST_TESTED = "0.12.1"

NOT_IN_EVERY_RELEASE = {  # registry entry -> the releases that emit it
    "acospi": "JAX 0.12.1 and later (lax.acospi)",
    "asinpi": "JAX 0.12.1 and later (lax.asinpi)",
    "atan2pi": "JAX 0.12.1 and later (lax.atan2pi)",
    "atanpi": "JAX 0.12.1 and later (lax.atanpi)",
    "cospi": "JAX 0.12.1 and later (lax.cospi)",
    "exp2m1": "JAX 0.12.1 and later (lax.exp2m1)",
    "fma": "JAX 0.12.1 and later (lax.fma: a * b + c rounded once)",
    "fmuladd": "JAX 0.12.1 and later (lax.fmuladd: a * b + c, fused where the backend can)",
    "log2": "JAX 0.11 and later (0.10 emits log and a division)",
    "log2p1": "JAX 0.12.1 and later (lax.log2p1)",
    "mulhi": "JAX 0.10.2 and later (lax.mulhi)",
    "one_minus_square": "JAX 0.11 and later: the derivative of tanh, 1 - x**2, as one pointwise op",
    "polynomial": "JAX 0.11 and later: Horner's rule over scalar coefficients (jnp.polyval, erf's derivative)",
    "random_gamma_grad": "JAX 0.12.1 and later (the derivative of gamma samples, was a composite)",
    "random_poisson": "JAX 0.12.1 and later (jax.random.poisson, was a composite)",
    "sinpi": "JAX 0.12.1 and later (lax.sinpi)",
    "stack": "JAX 0.10.1 and later (jnp.stack)",
    "tanpi": "JAX 0.12.1 and later (lax.tanpi)",
    "unstack": "JAX 0.10.1 and later (jnp.unstack)",
}


def clear_compilation_cache() -> None:
    """Forget compiled executables, so the next compile of the same program is timed, not looked up."""
    _pxla._cached_compilation.cache_clear()


def cudnn_installed() -> bool:
    """Whether this process can trace cuDNN's fused attention (the CUDA plugin is installed)."""
    try:
        from jax._src.lib import cuda_versions
    except ImportError:
        return False
    return cuda_versions is not None


def scan_counts(params: dict) -> tuple[int, int]:
    """(number of consts, number of carries) of a scan equation's params, on every supported JAX."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    if "ft_in" in params:
        consts, carry, _ = params["ft_in"].unpack()
        return len(consts), len(carry)
    raise TypeError(f"a scan with params {sorted(params)}: expected num_consts/num_carry (JAX 0.10) or ft_in "
                    "(JAX 0.11+); this JAX is newer than partitioner/representation/jax_compat.py knows, see "
                    "setup.cfg's range")


def to_lojax(closed):
    """A closed jaxpr with its high-level primitives expanded as JAX expands them before lowering (the same
    jaxpr where it has none, and on releases without them)."""
    jaxpr = getattr(closed, "jaxpr", closed)
    if not getattr(jaxpr, "is_high", False):
        return closed
    return _pe.lower_jaxpr2(jaxpr)


def bind_on(compute_type: str, bind: Callable[..., list], args: Sequence, out_avals: Sequence) -> list:
    """bind(*args) (a list of results) computed where `compute_type` says ("device_host": on the host), its
    results in the memory spaces of `out_avals`."""
    if _COMPUTE_ON_TAKES_SPACES:
        spaces = [a.memory_space for a in out_avals]
        return list(_compute_on(compute_type=compute_type, out_memory_spaces=spaces)(lambda *a: list(bind(*a)))(*args))
    with _compute_on(compute_type):
        return bind(*args)


def on_host(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) computed by the host's cores (compute_on "device_host"), its results in host memory; args
    should already be there (jax.device_put(x, jax.memory.Space.Host)), as JAX requires one memory space
    per op."""
    if _COMPUTE_ON_TAKES_SPACES:
        return _compute_on(compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)(fn)(*args)
    with _compute_on("device_host"):
        return jax.jit(fn)(*args)


def _ragged_all_to_all_batched(rule: Callable) -> Callable:
    """JAX's batching rule for ragged_all_to_all, with unbatched offsets and sizes broadcast first."""
    def batched(axis_data, vals, dims, **params):
        if all(d is None for d in dims):
            return rule(axis_data, vals, dims, **params)
        vals, dims = list(vals), list(dims)
        for i in range(2, len(vals)):  # input_offsets, send_sizes, output_offsets, recv_sizes
            if dims[i] is None:
                vals[i] = jax.numpy.broadcast_to(vals[i][None], (axis_data.size, *vals[i].shape))
                dims[i] = 0
        return rule(axis_data, vals, dims, **params)
    batched.fixes = rule
    return batched


_rule = _batching.fancy_primitive_batchers[_parallel.ragged_all_to_all_p]
if not hasattr(_rule, "fixes"):  # once, however often this module is reloaded
    _batching.fancy_primitive_batchers[_parallel.ragged_all_to_all_p] = _ragged_all_to_all_batched(_rule)
