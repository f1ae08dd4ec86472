"""Logical axis names -> mesh axes: the one table that says how a model is split.

Model code names the dims of every weight and activation with logical names
(``batch``, ``length``, ``embed``, ``heads``, ``kv``, ``mlp``, ``expert``,
``vocab``, ...) and calls :func:`constrain`; a config's rules table maps each
logical name to a mesh axis, a tuple of axes, or None (not split). The same
model then runs data-, expert- and model-parallel by changing only the table,
and one table serves every mesh: axes the mesh lacks are dropped from it.
Mapping is Flax's ``nn.logical_to_mesh_axes`` (a mesh axis already used by an
earlier dim is skipped for later ones); the annotation is ``gs.shard``, so it
is a no-op outside ``gs.partition`` and XLA's sharding constraint under
``backend="xla"``.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import flax.linen as nn
import jax
from jax.extend import source_info_util

import gshard_jax as gs

# Report the model line that calls constrain(), not this helper.
source_info_util.register_exclusion(__file__)

MeshAxes = Union[None, str, tuple[str, ...]]
Rules = Sequence[tuple[str, MeshAxes]]

# Logical axis -> mesh axes, in priority order (Flax's convention: the first rule whose mesh axes are all
# still free wins, so "expert" precedes "group" and the dispatched [E, G, C, M] splits G over what E leaves).
# One table serves every layout: axes a mesh lacks (or has of size 1) drop out, so the same entries give data
# and expert parallelism, Megatron (y alone), AxoNN's 3D layout (x, y, z) and any mix (docs/models.md has
# the table of combinations). `model` is another name for `y`. Where weights are *stored* is not here:
# z, and the data axes under ZeRO-3, are storage axes added by gshard_jax/training/layout.py.
DEFAULT_RULES: Rules = (
    # activations
    ("batch", ("data", "z", "expert")),  # the batch: over every data-parallel axis (z is FSDP's depth axis)
    ("expert", "expert"),  # the experts of an MoE layer, and their weights' E dim
    # MoE routing groups before dispatch, split as the tokens are: the batch's axes, then context (a group
    # within one device's block of a sequence)
    ("group", ("data", "z", "expert", "context")),
    ("group", ("data", "z", "context")),  # ... and after dispatch, where E holds the expert axis
    ("length", "context"),  # sequence positions: context parallelism (ring attention, zigzag order)
    ("seq", "context"),  # the residual stream's positions between tensor-parallel layers (SEQUENCE_PARALLEL: y)
    # features: ordinary layers map embed -> heads/mlp/vocab (in over x, out over y), transposed layers the
    # other way, so the residual stream stays [batch, length, embed over x] between layers with no reshard
    ("embed", "x"),  # model width D: activations and weights (AxoNN's x)
    ("heads", ("y", "model")),  # attention heads (Megatron's column split; AxoNN's y)
    ("kv", None),  # per-head dim
    ("mlp", ("y", "model")),  # FFN hidden units
    ("vocab", ("y", "model")),  # vocabulary of the embedding table and the LM head
    ("layers", "stage"),  # the stacked-layers dim of scanned params: split over pipeline stages
)


# Megatron's sequence parallelism: the residual stream (norms, residual adds, the pipeline's state) split along
# its positions over the tensor axis, so each all-reduce of a row-parallel output becomes a reduce-scatter and
# each column-parallel input an all-gather (the same bytes; collective matmul can run both as rings), and those
# activations take 1/y of the memory. TransformerConfig.sequence_parallel applies it.
SEQUENCE_PARALLEL = ("seq", ("context", "y", "model"))


def sequence_parallel(rules: Rules) -> tuple[tuple[str, MeshAxes], ...]:
    """`rules` with the residual stream's positions (`seq`) over the tensor axis."""
    name = SEQUENCE_PARALLEL[0]
    return tuple(SEQUENCE_PARALLEL if n == name else (n, a) for n, a in rules) + \
        ((SEQUENCE_PARALLEL,) if all(n != name for n, _ in rules) else ())


# The leading dim of a pipeline's stage-owned ends (TransformerConfig.end_stages): the embedding's owner is the
# first stage, the final norm's and unembedding's the last. Split over the stages as the stacked layers are.
FIRST_STAGE, LAST_STAGE = "first_stage", "last_stage"


def end_owner(spec) -> str:
    """The end stage owning a param with these logical axes: "first", "last", or "" (not a stage-owned end)."""
    return {FIRST_STAGE: "first", LAST_STAGE: "last"}.get(spec[0], "") if spec else ""


# The table under automatic sharding (mesh.auto, gs.partition(auto=True)): every logical name maps to no mesh axis,
# so the model's structure (MoE groups, ring attention, context order) is the unsplit one, and constrain()
# annotates nothing, so every value's sharding is the partitioner's choice. The AUTOMATIC entry marks it.
AUTOMATIC = "automatic"
AUTO_RULES: Rules = tuple((name, None) for name in dict.fromkeys(
    [n for n, _ in DEFAULT_RULES] + [SEQUENCE_PARALLEL[0], FIRST_STAGE, LAST_STAGE])) + ((AUTOMATIC, None),)


def automatic(rules: Rules) -> bool:
    """Whether `rules` is the automatic sharding's table (AUTO_RULES): constrain() then annotates nothing."""
    return any(name == AUTOMATIC for name, _ in rules)


# A logical name a table may lack, and the entry that stands in for it (tables written before `seq` existed, or
# the stage-owned ends).
STANDS_IN = {"seq": "length", FIRST_STAGE: "layers", LAST_STAGE: "layers"}


def for_mesh(rules: Rules, mesh_axes: Optional[Sequence[str]]) -> tuple[tuple[str, MeshAxes], ...]:
    """`rules` with the mesh axes `mesh_axes` lacks removed, so one table serves every mesh shape."""
    if mesh_axes is None:
        return tuple(rules)
    out = []
    for name, axes in rules:
        kept = tuple(a for a in ((axes,) if isinstance(axes, str) else axes or ()) if a in mesh_axes)
        out.append((name, kept[0] if len(kept) == 1 else (kept or None)))
    return tuple(out)


def mesh_spec(names: Sequence[Optional[str]], rules: Rules,
              mesh_axes: Optional[Sequence[str]] = None) -> tuple[MeshAxes, ...]:
    """Per dim, the mesh axes that the logical `names` map to under `rules` (on a mesh with `mesh_axes`)."""
    known = {name for name, _ in rules}
    names = tuple(STANDS_IN.get(n, n) if n not in known else n for n in names)
    unknown = [n for n in names if n is not None and n not in known]
    if unknown:
        raise ValueError(f"logical axis names {unknown} have no entry in the rules table {list(rules)}; "
                         f"add a rule (name, mesh axis or None) for each")
    return tuple(nn.logical_to_mesh_axes(tuple(names), for_mesh(rules, mesh_axes)))


def axes_of(entry: MeshAxes) -> tuple[str, ...]:
    """A spec entry as a tuple of mesh axis names."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def constrain(x: jax.Array, names: Sequence[Optional[str]], rules: Rules, grad: bool = True) -> jax.Array:
    """Annotate `x` (one logical name per dim) with the mesh axes the rules give those names (grad=False:
    the forward value only, as for a weight at its use, whose gradient goes where the weight is stored)."""
    if len(names) != x.ndim:
        raise ValueError(f"constrain: {len(names)} logical names {tuple(names)} for an array of shape "
                         f"{tuple(x.shape)}; expected one name (or None) per dim")
    mesh = gs.annotations.current_mesh()
    if mesh is None or automatic(rules):
        return x
    return gs.shard(x, mesh_spec(names, rules, mesh.axis_names), grad=grad)
