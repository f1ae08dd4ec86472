"""Every way JAX code states a sharding, read as our annotation.

JAX programs say how a value is laid out in several spellings:
``jax.lax.with_sharding_constraint`` (primitive ``sharding_constraint``; Flax's logical constraints and
logically partitioned params lower to it), ``jax.sharding.reshard`` (``reshard``), ``jax.device_put`` inside
a function (``device_put``), and, on meshes with Explicit axes, an op's ``out_sharding`` (``jnp.einsum(...,
out_sharding=P(...))``, ``jnp.zeros(..., out_sharding=...)``). Each becomes a ``sharding_annotation`` equation
with ``gs.shard``'s meaning and priority, at the user's source line, before anything is planned: one entry
point, many spellings. ``P.UNCONSTRAINED`` dims stay open: propagation may split them (``open`` dims).

A sharding on another mesh, or on the same axes over another device order, is a ValueError naming both.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Optional, Sequence

import jax
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec

from .annotations import check_spec, sharding_annotation_p
from .partitioner.representation.program import Eqn, Program, Value
from .partitioner.representation.sharding import Sharding

# primitive -> the param holding the sharding it imposes on its result(s)
IMPOSED = {"sharding_constraint": "sharding", "reshard": "dst_sharding", "device_put": "devices"}
# params through which an op states its result's sharding (Explicit axes: sharding in types)
STATED = ("out_sharding", "sharding")
_CALLS = {"sharding_constraint": "with_sharding_constraint", "reshard": "reshard", "device_put": "device_put"}


def describe(mesh) -> str:
    """A mesh as an error names it: axes and sizes, and the device order where it has devices."""
    shape = dict(zip(mesh.axis_names, mesh.axis_sizes))
    if isinstance(mesh, AbstractMesh):
        return f"AbstractMesh({shape})"
    return f"Mesh({shape}, devices {[int(d.id) for d in mesh.devices.flat]})"


def check_mesh(other, mesh, what: str) -> None:
    """`other` (a sharding's mesh) is the partition mesh: same axes, sizes and, where both have devices, order."""
    same_axes = (tuple(other.axis_names) == tuple(mesh.axis_names) and
                 tuple(other.axis_sizes) == tuple(mesh.axis_sizes))
    same_devices = (not same_axes or isinstance(other, AbstractMesh) or isinstance(mesh, AbstractMesh) or
                    [d.id for d in other.devices.flat] == [d.id for d in mesh.devices.flat])
    if same_axes and same_devices:
        return
    why = "the same axes over another device order" if same_axes else "other axes"
    raise ValueError(f"{what} is on {describe(other)}, but the function is partitioned over {describe(mesh)} "
                     f"({why}). Annotate with the partition mesh (NamedSharding(mesh, spec), or a bare "
                     f"PartitionSpec under jax.set_mesh(mesh)), or partition over the annotation's mesh")


@contextlib.contextmanager
def tracing_context(mesh):
    """The mesh context the user's function is traced in: theirs if they set one (it must be the partition
    mesh's axes), else `mesh` (the partition mesh as the user gave it), so bare PartitionSpecs and Flax's
    logical constraints (inactive without a mesh) resolve against it, as under jax.set_mesh."""
    current = jax.sharding.get_abstract_mesh()
    if not current.empty:
        check_mesh(current, mesh, "the context mesh (jax.set_mesh / jax.sharding.use_abstract_mesh)")
        yield
        return
    abstract = mesh if isinstance(mesh, AbstractMesh) else mesh.abstract_mesh
    with jax.sharding.use_abstract_mesh(abstract):
        yield


def check_context(mesh) -> None:
    """A concrete mesh the caller set (jax.set_mesh) is the partition mesh, device order included (checked
    outside jit, where the concrete mesh is known; inside, JAX's own error would name a shard_map)."""
    try:
        current = jax.sharding.get_mesh()
    except ValueError:  # inside a trace (jax.grad or jax.jit of the partitioned function): tracing checks it
        return
    if not current.empty:
        check_mesh(current, mesh, "the context mesh (jax.set_mesh)")


def trace_in_context(make: Callable, args: Sequence, mesh):
    """make(*args) under tracing_context(mesh). A jax.shard_map in fn over another mesh fails JAX's own check
    against a context mesh we set; it is traced again without one, so the manual region's check names both
    meshes (partitioner/strategies/manual_regions.py). A context the user set stays: JAX's error is theirs
    under jax.jit too."""
    ours = jax.sharding.get_abstract_mesh().empty
    try:
        with tracing_context(mesh):
            return make(*args)
    except ValueError as e:
        if not (ours and "should match the mesh passed to shard_map" in str(e)):
            raise
    return make(*args)


def _sharding(named, rank: int, mesh, what: str) -> tuple[Sharding, frozenset]:
    """Our sharding of a NamedSharding (or a bare spec resolved in context) and its unconstrained dims."""
    if isinstance(named, NamedSharding):
        check_mesh(named.mesh, mesh, what)
        spec = named.spec
    elif isinstance(named, PartitionSpec):
        spec = named
    else:
        raise ValueError(f"{what}: a {type(named).__name__} cannot be read as a sharding over mesh axes; use a "
                         f"NamedSharding on the partition mesh {describe(mesh)} or a PartitionSpec")
    if getattr(spec, "unreduced", None) or getattr(spec, "reduced", None):
        raise ValueError(f"{what}: {spec} declares unreduced/reduced axes, which annotations do not take; "
                         f"annotate the reduced value instead")
    entries = tuple(spec) + (None,) * (rank - len(spec))
    if len(entries) > rank:
        raise ValueError(f"{what}: {spec} has {len(entries)} entries for a value of rank {rank}")
    open_ = frozenset(d for d, e in enumerate(entries) if e is PartitionSpec.UNCONSTRAINED)
    dims = check_spec(tuple(None if d in open_ else e for d, e in enumerate(entries)), mesh, what)
    return Sharding.from_spec(dims, rank), open_


def _spec_text(named) -> str:
    spec = named.spec if isinstance(named, NamedSharding) else named
    return repr(spec).replace("UNCONSTRAINED", "P.UNCONSTRAINED")


def _annotation(eqn: Eqn, x, out: Value, named, what: str, mesh) -> Eqn:
    """A sharding_annotation equation out = x at eqn's source, imposing `named`."""
    sharding, open_ = _sharding(named, len(out.shape), mesh, f"{what} at {eqn.source}")
    params = {"sharding": sharding, "what": what, "grad": True}
    if open_:
        params["open"] = open_
    return Eqn(sharding_annotation_p, [x], [out], params, eqn.where, eqn.index)


def _imposed(eqn: Eqn, mesh) -> list[Eqn]:
    """The annotations a sharding_constraint, reshard or device_put equation stands for (one per operand);
    device_put to a device or a memory kind states no layout: every dim open."""
    param = eqn.params[IMPOSED[eqn.name]]
    targets = list(param) if eqn.name == "device_put" else [param]
    extra = eqn.params.get("unconstrained_dims") or ()
    out = []
    for i, (x, v, named) in enumerate(zip(eqn.invars, eqn.outvars, targets)):
        space = _memory_move(eqn, i)
        if space is not None:  # the layout is stated on the value the move reads; the move runs per device
            moved, v = v, Value(v.aval, v.name + "'")
        if not isinstance(named, (NamedSharding, PartitionSpec)) or (eqn.name == "reshard" and _auto(named)):
            # a device_put to a device or memory kind states no layout; nor does a reshard on Auto axes, which
            # JAX emits itself under a mesh context (a user's reshard must name Explicit axes)
            named = PartitionSpec(*(PartitionSpec.UNCONSTRAINED,) * len(v.shape))
        if extra and isinstance(named, NamedSharding):  # dims given as P.UNCONSTRAINED, as JAX records them
            spec = tuple(named.spec) + (None,) * (len(v.shape) - len(named.spec))
            named = NamedSharding(named.mesh, PartitionSpec(
                *(PartitionSpec.UNCONSTRAINED if d in extra else e for d, e in enumerate(spec))))
        out.append(_annotation(eqn, x, v, named, f"{_CALLS[eqn.name]}({_spec_text(named)})", mesh))
        if space is not None:
            out.append(Eqn(eqn.prim, [v], [moved], {"devices": (space,), "srcs": (None,),
                                                   "copy_semantics": eqn.params["copy_semantics"][i:i + 1]},
                           eqn.where, eqn.index))
    return out


def _memory_move(eqn: Eqn, i: int):
    """The memory space (jax.memory.Space) operand i of a device_put moves to, None if it stays where it is:
    a move between device and host memory (optimizer state offloaded to pinned_host) is kept, as a
    device_put of the local shard to that space, after the annotation of its layout."""
    if eqn.name != "device_put":
        return None
    before = getattr(getattr(eqn.invars[i], "aval", None), "memory_space", None)  # a constant: None
    after = getattr(eqn.outvars[i].aval, "memory_space", None)
    return None if before == after else after


def _auto(named) -> bool:
    """Whether a sharding's mesh types none of its axes Explicit."""
    types = getattr(named.mesh, "axis_types", ()) if isinstance(named, NamedSharding) else ()
    return all(t != AxisType.Explicit for t in types)


def _stated(eqn: Eqn) -> Optional[tuple[NamedSharding, str]]:
    """The result sharding an op states, and how: `out_sharding` is what the user passed (jnp.einsum(...,
    out_sharding=...)); a `sharding` param is the result's type, which JAX also fills in itself (jnp.zeros_like of
    a typed value), so it is named a type. Only splits count: JAX's autodiff writes the types of the arguments as
    traced (replicated where no array was committed, whatever in_shardings say) as replicated out_shardings of
    the transposes, which would gather what the plan splits."""
    if len(eqn.outvars) != 1:
        return None
    for key, form in zip(STATED, ("{}(out_sharding={})", "{} typed {}")):
        s = eqn.params.get(key)
        if _splits(s):
            return s, form.format(eqn.name, _spec_text(s))
    return None


def _splits(s) -> bool:
    """Whether s is a NamedSharding on a mesh that splits some dim."""
    return (isinstance(s, NamedSharding) and not s.mesh.empty and
            any(e is not None and e is not PartitionSpec.UNCONSTRAINED for e in s.spec))


def annotations(program: Program, mesh) -> Program:
    """The program with every JAX sharding statement as a sharding_annotation equation (in place)."""
    def visit(p: Program) -> None:
        eqns = []
        for e in p.eqns:
            for sub in e.subs.values():
                visit(sub)
            if e.name in IMPOSED:
                eqns += _imposed(e, mesh)
                continue
            eqns.append(e)
            stated = _stated(e)
            # the op's own sharding param is the annotation's now (or states no split): dropped, so equal ops
            # traced with and without a mesh context merge alike (lowering binds with None anyway)
            e.params = {k: None if k in STATED and isinstance(p, NamedSharding) else p for k, p in e.params.items()}
            if stated is not None:  # op -> v becomes op -> v' ; v = annotation(v')
                v = e.outvars[0]
                inner = Value(v.aval, v.name + "'")
                e.outvars = [inner]
                eqns.append(_annotation(e, inner, v, *stated, mesh))
        p.eqns[:] = eqns

    visit(program)
    return program


def typed(aval, mesh) -> Optional[tuple]:
    """The spec an argument's type states (Explicit axes: sharding in types), None where it states no split."""
    s = getattr(aval, "sharding", None)
    if not _splits(s):
        return None
    check_mesh(s.mesh, mesh, f"an argument typed {aval.str_short()}")
    return tuple(s.spec) + (None,) * (len(aval.shape) - len(s.spec))


def partition_context(mesh):
    """The context the per-device program is traced in: the partition mesh's Auto-typed abstract mesh (shard_map
    requires the context mesh to be its own, and a user's Explicit context would make it differ)."""
    return jax.sharding.use_abstract_mesh(mesh if isinstance(mesh, AbstractMesh) else mesh.abstract_mesh)
