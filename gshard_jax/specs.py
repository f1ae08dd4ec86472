"""in_shardings / out_shardings and input placements, per flat leaf, named by pytree key path.

Every value a user passes or gets back is named the way they would write it
(``params['fc1']['bias']``, ``out[1]``), in the report and in every error.
"""
from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any, Callable, Optional, Sequence

import jax
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from . import annotations as A
from .partitioner.representation.sharding import Sharding
from .sources import describe


def is_spec_tuple(x) -> bool:
    return isinstance(x, tuple) and all(e is None or isinstance(e, str) or
                                        (isinstance(e, tuple) and all(isinstance(a, str) for a in e)) for e in x)


def is_leaf(x) -> bool:
    """A leaf of an in/out shardings pytree: None, a PartitionSpec, NamedSharding, Sharding or spec tuple."""
    return x is None or isinstance(x, (PartitionSpec, NamedSharding, Sharding)) or is_spec_tuple(x)


def check_leaf(leaf, mesh: Mesh, what: str):
    """A spec leaf as a tuple of per-dim entries (or a Sharding), with its axis names checked; None stays None."""
    if leaf is None or isinstance(leaf, Sharding):
        return leaf
    if isinstance(leaf, NamedSharding):
        leaf = leaf.spec
    return A.check_spec(tuple(leaf), mesh, what)


def arg_names(fn: Callable, n: int) -> list[str]:
    """The names of fn's first n positional parameters (args[i] where the signature does not say)."""
    names: list[str] = []
    try:
        for p in inspect.signature(fn).parameters.values():
            if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
                break
            names.append(p.name)
    except (TypeError, ValueError):
        pass
    return [names[i] if i < len(names) else f"args[{i}]" for i in range(n)]


def leaf_names(fn: Callable, args: Sequence, kwargs: Mapping) -> list[str]:
    """One name per flat leaf of (args, kwargs), in tree_flatten order: `params['fc1']['bias']`."""
    names = arg_names(fn, len(args))
    out = []
    for path, _ in jax.tree_util.tree_flatten_with_path((tuple(args), dict(kwargs)))[0]:
        head = names[path[1].idx] if path[0].idx == 0 else str(path[1].key)
        out.append(head + jax.tree_util.keystr(tuple(path[2:])))
    return out


def output_names(out_shape) -> list[str]:
    return ["out" + jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(out_shape)[0]]


def _entries(specs, n: int, what: str, names: Sequence[str]) -> list:
    """Top level of in/out shardings: one entry per argument (or output), or one spec for all of them."""
    if specs is None or isinstance(specs, (PartitionSpec, NamedSharding, Sharding)):
        return [specs] * n
    if not isinstance(specs, (tuple, list)) or len(specs) != n:
        raise ValueError(f"{what} must be None, one PartitionSpec for all, or a tuple with one entry per "
                         f"{'argument' if what == 'in_shardings' else 'output'} ({n}: {', '.join(names)}); "
                         f"got {specs!r}. Write a spec for a single value as PartitionSpec(...) or wrap it: (spec,)")
    return list(specs)


def _broadcast(entry, value, name: str, what: str) -> list:
    """entry (a prefix of value's pytree) broadcast to value's leaves; a mismatch names the key path."""
    if is_leaf(entry):
        return [entry] * len(jax.tree_util.tree_leaves(value))
    if isinstance(entry, Mapping) and isinstance(value, Mapping):
        missing = [k for k in entry if k not in value]
        if missing:
            raise ValueError(f"{what} for {name}: key {missing[0]!r} is not in the value; its keys are "
                             f"{sorted(map(str, value))}. Fix the key, or leave it out to let propagation decide")
        absent = [k for k in value if k not in entry]
        if absent:
            raise ValueError(f"{what} for {name}: the value has key {absent[0]!r} that the shardings lack; "
                             f"give every key (None lets propagation decide)")
        out = []
        for k in _sorted_keys(value):
            out += _broadcast(entry[k], value[k], f"{name}[{k!r}]", what)
        return out
    if isinstance(entry, (list, tuple)) and isinstance(value, (list, tuple)):
        if len(entry) != len(value):
            raise ValueError(f"{what} for {name}: {len(entry)} entries for a sequence of {len(value)}; "
                             f"give one per element")
        out = []
        for i, (e, v) in enumerate(zip(entry, value)):
            out += _broadcast(e, v, f"{name}[{i}]", what)
        return out
    try:
        return jax.tree_util.tree_leaves(jax.tree_util.tree_map(
            lambda e, v: [e] * len(jax.tree_util.tree_leaves(v)), entry, value, is_leaf=is_leaf), is_leaf=is_leaf)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{what} for {name} must be a prefix of that value's pytree with PartitionSpecs, tuples "
                         f"of axis names or None as leaves; got {entry!r}: {e}") from None


def _sorted_keys(d: Mapping) -> list:
    """Keys in the order jax flattens a dict (sorted) or a Flax FrozenDict."""
    try:
        return sorted(d)
    except TypeError:
        return list(d)


def flat_specs(specs, values: Sequence, mesh: Mesh, what: str, names: Sequence[str], leaf_names_: Sequence[str]):
    """Per flat leaf of `values` (one pytree per argument or output), its spec tuple or None."""
    out = []
    for entry, value, name in zip(_entries(specs, len(values), what, names), values, names):
        out += _broadcast(entry, value, name, what)
    return [check_leaf(leaf, mesh, f"{what} for {n}") for leaf, n in zip(out, leaf_names_)]


def to_sharding(spec, shape: Sequence[int], what: str) -> Optional[Sharding]:
    if spec is None or isinstance(spec, Sharding):
        return spec
    if len(spec) > len(shape):
        raise ValueError(f"{what}: spec {spec} has {len(spec)} entries for a value of shape {tuple(shape)} "
                         f"(rank {len(shape)}); give at most {len(shape)}")
    return Sharding.from_spec(spec, len(shape))


def named(specs, mesh: Mesh, what: str):
    """A pytree of NamedShardings (for jax.jit) from a pytree of specs, checking the axis names."""
    def one(s):  # a NamedSharding's memory kind (pinned_host: offloaded state) is kept
        kind = {"memory_kind": s.memory_kind} if isinstance(s, NamedSharding) and s.memory_kind else {}
        return None if s is None else NamedSharding(mesh, PartitionSpec(*check_leaf(s, mesh, what)), **kind)
    return jax.tree_util.tree_map(one, specs, is_leaf=is_leaf)


# --------------------------------------------------------------------------- meshes and placements

def same_mesh(a, b) -> bool:
    """The same axes, sizes and devices in the same order (axis types aside); an AbstractMesh has no devices, so
    against one the axes and sizes decide."""
    if tuple(a.axis_names) != tuple(b.axis_names):
        return False
    if isinstance(a, AbstractMesh) or isinstance(b, AbstractMesh):
        return tuple(a.axis_sizes) == tuple(b.axis_sizes)
    return (a.devices.shape == b.devices.shape and
            all(x.id == y.id for x, y in zip(a.devices.flat, b.devices.flat)))


def placement(x: Any, mesh: Mesh, name: str) -> Optional[tuple]:
    """The spec an argument is committed to on `mesh`, None if it is not committed (XLA may place it). A
    ShapeDtypeStruct with a NamedSharding stands for an array committed to it (lowering the program an array
    of that placement gets, before one exists).

    An array committed to another mesh or device set is a ValueError naming it and both meshes.
    """
    if isinstance(x, jax.ShapeDtypeStruct) and isinstance(x.sharding, NamedSharding) and same_mesh(x.sharding.mesh,
                                                                                                  mesh):
        return tuple(x.sharding.spec) + (None,) * (len(x.shape) - len(x.sharding.spec))
    if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
        return None
    sharding = x.sharding
    if isinstance(sharding, NamedSharding):
        if same_mesh(sharding.mesh, mesh):
            return tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))
        where = f"NamedSharding on {describe(sharding.mesh)}"
    elif not getattr(x, "committed", False):
        return None
    elif sharding.device_set == set(mesh.devices.flat) and sharding.is_fully_replicated:
        return (None,) * x.ndim
    else:
        where = f"{type(sharding).__name__} on devices {sorted(d.id for d in sharding.device_set)}"
    raise ValueError(f"argument {name} is committed to a {where}, not to the partition mesh {describe(mesh)}. "
                     f"Place it on the partition mesh (jax.device_put(x, NamedSharding(mesh, spec))) or pass an "
                     f"uncommitted array (e.g. np.asarray(x))")
