"""Which primitives the installed JAX emits for the public functions of jax.lax, jax.numpy, jax.nn and
jax.random, and for their derivatives, as the partitioner sees them (its program view, calls inlined).

Each public function is called on the first argument list it accepts from a fixed table of small arrays
(floats, ints, booleans, 1-D and 2-D, an axis, a shape); where it returns floats from float inputs, its
vector-Jacobian product is traced too. Functions that accept none of the lists (collectives outside a mapped
axis, tokens, callbacks) are skipped: nothing they would emit could reach the partitioner from these calls.
"""
from __future__ import annotations

import inspect
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core

from gshard_jax.partitioner.representation import program as P

MODULES = {"jax.lax": jax.lax, "jax.numpy": jnp, "jax.nn": jax.nn, "jax.random": jax.random}


def _arguments() -> list[tuple]:
    """The argument lists tried, in order (the first a function accepts is the one traced)."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.uniform(0.1, 0.9, (4, 8)), jnp.float32)
    y = jnp.asarray(rng.uniform(0.1, 0.9, (4, 8)), jnp.float32)
    v = jnp.asarray(rng.uniform(0.1, 0.9, (8,)), jnp.float32)
    w = jnp.asarray(rng.uniform(0.1, 0.9, (8,)), jnp.float32)
    sq = jnp.asarray(rng.uniform(0.1, 0.9, (4, 4)) + 4 * np.eye(4), jnp.float32)
    i = jnp.asarray(rng.integers(0, 4, (4, 8)), jnp.int32)
    b = jnp.asarray(rng.integers(0, 2, (4, 8)), bool)
    key = jax.random.key(0)
    return [(x,), (x, y), (v,), (v, w), (x, 1), (x, y, x), (v, w, v), (sq,), (sq, sq), (v, 2), (x, (2, 4)),
            (i,), (i, i), (b,), (b, b), (b, x, y), (x, i), (i, x), (x, i, 1), (key,), (key, (4, 8)),
            (key, x), (key, v, w), (key, 2, (4, 8)), ()]


def _jaxprs_of(fn, args: tuple) -> list[core.ClosedJaxpr]:
    """fn's jaxpr on args, and its vector-Jacobian product's where fn maps floats to floats."""
    closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*args)
    out = [closed]
    floats = [k for k, a in enumerate(args) if isinstance(a, jax.Array) and jnp.issubdtype(a.dtype, jnp.floating)]
    leaves = jax.tree.leaves(shapes)
    if floats and leaves and all(jnp.issubdtype(o.dtype, jnp.floating) for o in leaves):
        def vjp(*diff):
            full = list(args)
            for k, d in zip(floats, diff):
                full[k] = d
            outs, pull = jax.vjp(lambda *d: fn(*[d[floats.index(k)] if k in floats else a
                                                 for k, a in enumerate(full)]), *diff)
            return pull(jax.tree.map(jnp.ones_like, outs))
        try:
            out.append(jax.make_jaxpr(vjp)(*[args[k] for k in floats]))
        except Exception:  # not differentiable (integer-valued, or a rule JAX lacks): the forward suffices
            pass
    return out


def _names(program: P.Program) -> set[str]:
    names = set()
    for e in program.eqns:
        names.add(e.name)
        for sub in e.subs.values():
            names |= _names(sub)
    return names


def public_functions() -> dict[str, object]:
    """'module.name' -> function, for every public function of MODULES."""
    out = {}
    for mod_name, mod in MODULES.items():
        for name in sorted(dir(mod)):
            fn = getattr(mod, name)
            if name.startswith("_") or inspect.ismodule(fn) or inspect.isclass(fn) or not callable(fn):
                continue
            out[f"{mod_name}.{name}"] = fn
    return out


def census() -> tuple[dict[str, set[str]], list[str]]:
    """(primitive name -> the functions that emit it as the partitioner sees them, the functions traced)."""
    emitted: dict[str, set[str]] = {}
    traced = []
    candidates = _arguments()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for qual, fn in public_functions().items():
            print(qual, flush=True) if __import__("os").environ.get("CENSUS_TRACE") else None
            for args in candidates:
                try:
                    jaxprs = _jaxprs_of(fn, args)
                except Exception:
                    continue
                traced.append(qual)
                for closed in jaxprs:
                    for name in _names(P.from_jaxpr(closed)):
                        emitted.setdefault(name, set()).add(qual)
                break
    return emitted, traced
