"""Where a train state lives: per-leaf shardings of params, gradients and optimizer state.

Three specs per parameter, all derived from its logical axes (``nn.with_logical_partitioning``) and the
rules table:

- **compute**: what the model uses (the rules' mapping; ``weight()`` annotates each use with it);
- **stored**: compute plus the storage axes: ``z`` (AxoNN's depth axis: FSDP) always, and the ZeRO axes
  under ``zero_stage=3``; a stored weight is all-gathered where it is used and its gradient reduce-scattered;
- **optimizer**: stored plus the ZeRO axes under ``zero_stage >= 1``: AdamW's moments (and the float32
  master weights of a bf16 model) live there, the gradient arrives reduce-scattered into it and the updated
  parameters are all-gathered back to the stored spec.

The ZeRO axes are the data-parallel axes a parameter is replicated over: ``data``, plus ``expert`` for
non-expert parameters under EPSO (seed 001 section 3.2), whose states would otherwise be held once per
expert shard. Each is placed on the parameter's dim with the most elements per shard that it divides (never
the stacked-layers dim of a scanned stack, which the scan slices), after the axes already there.

Under automatic sharding (``mesh.auto``, the rules table ``AUTO_RULES``) the three specs are None: nothing in
the step constrains the state, and the partitioner chooses where it lives (``gs.chosen_shardings``).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping, Optional, Sequence

import flax.linen as nn
import jax
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import gshard_jax as gs

from ..models.logical import AUTO_RULES, Rules, automatic as automatic_rules, axes_of, end_owner, mesh_spec

ZERO_STAGES = (0, 1, 2, 3)
STORAGE_AXES = ("z",)  # weights are stored split over these and gathered where used (FSDP)
LAYERS = "layers"  # the logical name of a scanned stack's layer dim


def _is_spec(x: Any) -> bool:
    return isinstance(x, P)


def add_axes(spec: tuple, shape: Sequence[int], axes: Sequence[str], mesh: Mapping[str, int],
             avoid: Sequence[int] = ()) -> tuple:
    """`spec` (one entry per dim) with `axes` added where they divide: all on one dim if one takes them,
    else one at a time. Each goes after the axes already on its dim, on the dim with the most elements per
    shard; an axis no dim can take is left out (the leaf stays replicated over it)."""
    dims = [list(axes_of(e)) for e in spec] + [[] for _ in range(len(shape) - len(spec))]
    used = {a for d in dims for a in d}
    new = [a for a in axes if a in mesh and mesh[a] > 1 and a not in used]

    def best(group: list) -> Optional[int]:
        need = math.prod(mesh[a] for a in group)
        fits = [(shape[d] // math.prod(mesh[a] for a in dims[d]), d) for d in range(len(shape))
                if d not in avoid and shape[d] % (math.prod(mesh[a] for a in dims[d]) * need) == 0]
        return max(fits)[1] if fits else None

    groups = [new] if new and best(new) is not None else [[a] for a in new]
    for group in groups:
        d = best(group)
        if d is not None:
            dims[d] += group
    return tuple(None if not d else d[0] if len(d) == 1 else tuple(d) for d in dims)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Per-parameter PartitionSpecs (trees shaped like the params) of one train configuration."""
    compute: Any  # as the model uses each weight (None under automatic sharding: the partitioner's choice)
    stored: Any  # as the state holds it (None: the same)
    optimizer: Any  # moments and master weights; where gradients are reduce-scattered to (stage >= 1; None)
    zero_stage: int
    zero_axes: dict  # parameter path -> the ZeRO axes it was given (for the docs and reports)
    stacked: Any = None  # per parameter, whether its leading dim is a scanned stack's layers (bools)
    ends: Any = None  # per parameter, the end stage owning it ("first", "last"; "" for the others)

    @property
    def gradients(self) -> Any:
        """Where a step's gradient is reduced to: the optimizer's spec from stage 1 on, else the stored one."""
        return self.optimizer if self.zero_stage >= 1 else self.stored


def layout(logical: Any, shapes: Any, rules: Rules, mesh: Mapping[str, int], zero_stage: int = 0,
           epso: bool = True) -> Layout:
    """The Layout of params with these logical specs (``nn.get_partition_spec``) and shapes on `mesh`."""
    if zero_stage not in ZERO_STAGES:
        raise ValueError(f"train.zero_stage={zero_stage!r}; expected one of {ZERO_STAGES} (0: replicated "
                         f"optimizer state, 1: sharded moments, 2: and gradients, 3: and parameters)")
    mesh = {a: s for a, s in mesh.items() if s > 1}
    names = tuple(mesh)
    compute, stored, optimizer, given, stacked, ends = [], [], [], {}, [], []
    flat, tree = jax.tree_util.tree_flatten_with_path(logical, is_leaf=_is_spec)
    shape_leaves = jax.tree_util.tree_leaves(shapes)
    if len(shape_leaves) != len(flat):
        raise ValueError(f"{len(flat)} logical specs for {len(shape_leaves)} parameters; every parameter needs "
                         f"its logical axes (nn.with_logical_partitioning)")
    for (path, spec), leaf in zip(flat, shape_leaves):
        spec = tuple(spec) + (None,) * (leaf.ndim - len(spec))
        c = mesh_spec(spec, rules, names)
        avoid = [d for d, n in enumerate(spec) if n == LAYERS]
        stacked.append(bool(spec) and spec[0] == LAYERS)
        ends.append(end_owner(spec))
        avoid += [0] if ends[-1] else []  # an end's stage dim holds one slice per stage: no ZeRO axes on it
        s = add_axes(c, leaf.shape, STORAGE_AXES, mesh, avoid)
        zero = ["data"] + (["expert"] if epso else [])
        o = add_axes(s, leaf.shape, zero, mesh, avoid) if zero_stage >= 1 else s
        given[jax.tree_util.keystr(path)] = tuple(sorted({a for e in o for a in axes_of(e)}
                                                         - {a for e in s for a in axes_of(e)}))
        if zero_stage >= 3:
            s = o
        compute.append(P(*c))
        stored.append(P(*s))
        optimizer.append(P(*o))

    def un(leaves):
        return jax.tree_util.tree_unflatten(tree, leaves)
    if automatic_rules(rules):
        return Layout(None, None, None, zero_stage, {}, un(stacked), un(ends))
    return Layout(un(compute), un(stored), un(optimizer), zero_stage, given, un(stacked), un(ends))


def of_model(model: nn.Module, example: tuple, mesh: Mapping[str, int], zero_stage: int = 0,
             epso: bool = True) -> tuple[Layout, Any]:
    """(Layout, abstract params) of a Flax model whose params carry logical axes."""
    boxed = jax.eval_shape(model.init, jax.random.key(0), *example)
    shapes = nn.unbox(boxed)
    return layout(nn.get_partition_spec(boxed), shapes, model.cfg.rules, mesh, zero_stage, epso), shapes


def optimizer_specs(opt: optax.GradientTransformation, opt_shapes: Any, param_specs: Any) -> Any:
    """PartitionSpecs of an optax state: each params-shaped subtree as `param_specs`, counters replicated."""
    return optax.tree_utils.tree_map_params(opt, lambda _, spec: spec, opt_shapes, param_specs,
                                            transform_non_params=lambda _: P(), is_leaf=_is_spec)


def constrain(tree: Any, specs: Any) -> Any:
    """Annotate every leaf of `tree` with its spec (gs.shard); specs None (automatic sharding): none."""
    if specs is None:
        return tree
    return jax.tree.map(lambda s, x: gs.shard(x, tuple(s) + (None,) * (x.ndim - len(s))), specs, tree,
                        is_leaf=_is_spec)


def bytes_per_device(shapes: Any, specs: Any, mesh: Mapping[str, int]) -> int:
    """Bytes a device holds of arrays with these shapes and specs (uneven dims rounded up, as XLA pads)."""
    total = 0
    for leaf, spec in zip(jax.tree_util.tree_leaves(shapes), jax.tree_util.tree_leaves(specs, is_leaf=_is_spec)):
        local = [math.ceil(n / math.prod(mesh.get(a, 1) for a in axes_of(e)))
                 for n, e in zip(leaf.shape, tuple(spec) + (None,) * (len(leaf.shape) - len(spec)))]
        total += int(np.prod(local, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
    return total


def automatic(cfg: Any, mesh: Mapping[str, int]) -> Any:
    """A typed config (configs.Config) under mesh.auto: the model's rules table dropped (AUTO_RULES: nothing
    annotated), or a ValueError naming the option that needs a table (or the budget without mesh.auto)."""
    if not cfg.mesh.auto:
        raise ValueError(f"mesh.memory_budget={cfg.mesh.memory_budget!r} bounds the automatic sharding's choice, "
                         f"but mesh.auto is False: set --config.mesh.auto=true too, or leave the budget 0")
    t = cfg.model.transformer
    needs = {"mesh.stage > 1 (a pipeline's stages are a rules table's layers axis)": mesh.get("stage", 1) > 1,
             "train.offload_optimizer (the host-memory state is laid out by the rules table)":
                 cfg.train.offload_optimizer,
             "model.sequence_parallel (a rule for the residual stream)": t.sequence_parallel,
             "model.moe.dispatch='dropless' (a manual region over the rules' expert axes)":
                 t.moe is not None and t.moe.dispatch == "dropless"}
    bad = [k for k, v in needs.items() if v]
    if bad:
        raise ValueError(f"mesh.auto=True drops the rules table and lets the partitioner choose, but {bad[0]} "
                         f"needs one: unset it, or leave mesh.auto false")
    if cfg.mesh.memory_budget < 0:
        raise ValueError(f"mesh.memory_budget={cfg.mesh.memory_budget!r}: expected bytes per device (0: no limit), "
                         f"e.g. --config.mesh.memory_budget=8e9")
    model = dataclasses.replace(cfg.model, transformer=dataclasses.replace(t, rules=AUTO_RULES))
    return dataclasses.replace(cfg, model=model)


def chosen(train_step: Callable, init_state: Callable, batch: dict, mesh: Any, batch_spec: P,
           memory_budget: float = 0.0) -> dict:
    """mesh.auto: the state's PartitionSpecs, the automatic sharding's choice for the train step with the batch
    as `batch_spec` says and the state donated (so each leaf leaves as it arrives), within memory_budget bytes
    per device when one is given (0: none). batch: its ShapeDtypeStructs."""
    state = jax.eval_shape(init_state, jax.random.key(0))
    (specs, _), _ = gs.chosen_shardings(train_step, mesh, state, batch, in_shardings=(None, batch_spec),
                                        out_shardings=(None, P()), memory_budget=memory_budget or None,
                                        donate_argnums=0)
    return specs
