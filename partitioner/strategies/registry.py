"""One entry per primitive: its factor rule, its hook, what the hook communicates, and how the passes treat it.

Grouped as Shardy's op_sharding_rule_registry groups ops: every pointwise op
is one case (with two variants, a conversion and a copy, that the program
rewrites see through), the rest are listed alphabetically. An entry's rule
(rules/factor_rules.py, windowed.py, reorder.py) says how its dims map to factors and
carries the op's policy as fields (pointwise, late_backward, rings, ...); its
hook (hooks.py, windowed.py, reorder.py) is what the op needs beyond binding
on local shards, and its collectives function is what that hook sends, for
the cost model and the report (with, for hooks that share what they receive
with later ops, the cache entries they fill); its padding says which padding
of an uneven split the op would read, and masked_operands where it is masked.
Its roles say what a pass does with it other than apply the rule: an
annotation seeds propagation, a control-flow form (control_flow.FORMS) links
and runs its bodies, a checkpointed region is re-emitted as a checkpoint, a
manual region runs on its own specs. Its Fold says what the program rewrites
(fold.py) may do with it.

Propagation (propagation/propagate.py), the lowering (lower.py and its parts
local_shards.py, lower_regions.py, lower_rows.py) and the program rewrites
(fold.py) read this table and nothing else about an op: none of them tests an
op's name. A primitive without an entry, or whose entry has no rule, runs
replicated (the fallback) and is flagged in the report. Op names are read
elsewhere, and only there:
- inside an entry's own rule builder or hook when it serves several ops
  (rules/factor_rules.py, windowed.py; hooks.py: reduce_prod's combine, argmax against
  argmin, each cumulative op's combine);
- by control_flow.FORMS, keyed by primitive name: this table's form entries
  point into it, and program.py finds bodies through it (and remat2's, whose
  body aliases the caller's values) when it builds the program view;
- by the deferral of accumulator reductions, which keeps its own tables of
  the ops a chain passes through (deferral.py, read by partial_sums.py and
  prefetch.py; lower.py consults deferral.CHAIN_OPS and THROUGH_RULES to hand
  a chain op to it);
- by manual_regions.py (the shard_map primitive, and the collectives inside a
  manual body), roll.py (the slices it rewrites into a roll) and subaxes.py
  (the ops it rewrites onto sub-axes).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Optional

from ..costs.cost import Collective
from ..representation.factors import Rule
from ..representation.program import Eqn
from ..rules import factor_rules as R, fused_attention as FA, rare_ops as RR
from . import control_flow as CF, hooks as H, reorder as RO, roll as RL, windowed as W

Hook = Callable  # (OpContext, local operands, params, bind) -> local results


def _no_rule(eqn: Eqn) -> None:
    """No factor rule: the op runs replicated unless its entry's role says how a pass treats it instead."""
    return None


@dataclasses.dataclass(frozen=True)
class Fold:
    """What the program rewrites (fold.py) may do with an op, as XLA's simplifier would."""

    pad: bool = False  # a pad (operand 0 padded with scalar operand 1): folds into the op that reads it
    cut: bool = False  # a slice: a stride-1 one folds into a pad that reads it, and absorbs a pad (becoming one)
    # a windowed op that absorbs a pad of its input: eqn -> (the pad value it needs, its padded dims (None: all),
    # the param holding their base dilation, dims the pad must leave alone)
    window: Optional[Callable[[Eqn], tuple]] = None
    static_starts: bool = False  # a dynamic slice: at constant start indices, the slice it is
    spreads_scalar: bool = False  # of one literal scalar, every element holds it (a broadcast)
    generator: bool = False  # with no array operand, a constant (a broadcast literal, an iota)
    keeps_constant: bool = False  # of constants only, a constant (pointwise ops, broadcasts)
    identity: bool = False  # the identity of the global view (annotations, copies): a known constant passes through
    convert: bool = False  # a dtype conversion: a known constant converts with it
    reduce: Optional[Callable[[object, int], object]] = None  # a reduction: (c, n) -> its result over n elements c


@dataclasses.dataclass(frozen=True)
class Op:
    rule: Callable[[Eqn], Optional[Rule]] = _no_rule
    hook: Optional[Hook] = None
    collectives: Optional[Callable[["H.OpContext"], list[Collective]]] = None
    received: Optional[Callable[["H.OpContext"], list[tuple]]] = None  # cache entries the hook fills
    # ctx -> the factors whose padding (an uneven split's) the op reads, and the identity kind that masks it
    padding: Callable[["H.OpContext"], dict] = H.reduced_padding
    masked_operands: Optional[tuple[int, ...]] = None  # the only operands whose padding is masked (None: all)
    # Roles: an op a pass treats other than through its rule and hook.
    annotation: bool = False  # a user's sharding (params sharding, what, open, grad): propagation seeds from it
    form: Optional[CF.Form] = None  # a loop or branch: its bodies' links and lowering (control_flow.py)
    checkpoint: bool = False  # a checkpointed region (remat2): its body re-emitted as one, nothing merged in it
    manual: bool = False  # a manual region (shard_map): propagation fixes its specs, lowering runs its body
    fold: Fold = Fold()


POINTWISE = R.POINTWISE  # (rules/factor_rules.py: liveness reads it too)

_POINTWISE = Op(R.elementwise, fold=Fold(keeps_constant=True))
_POINTWISE_FOLDS = {  # pointwise ops the program rewrites see through
    "convert_element_type": dataclasses.replace(_POINTWISE, fold=Fold(keeps_constant=True, convert=True)),
    "copy": dataclasses.replace(_POINTWISE, fold=Fold(keeps_constant=True, identity=True)),
}


def _combine(reduce=None) -> Op:
    return Op(R.reduction, H.combine_hook, H.combine_collectives, fold=Fold(reduce=reduce))


def _same(c, n):
    """max, min, and, or of n elements c: c."""
    return c


def _pool(identity: float) -> Op:
    """A reduce_window_{sum,max,min}: a pad with its identity folds into it, along every dim."""
    return Op(W.pool_rule, W.pool_hook, W.collectives, W.received_keys,
              fold=Fold(window=lambda eqn: (identity, None, "base_dilation", ())))


def _conv_window(eqn: Eqn) -> tuple:
    """A convolution absorbs a zero pad of its input's spatial dims (base dilation: lhs_dilation)."""
    dn = eqn.params["dimension_numbers"]
    return 0.0, tuple(dn.lhs_spec[2:]), "lhs_dilation", tuple(dn.lhs_spec[:2])


_ARG = Op(R.reduction, H.arg_reduce_hook, H.arg_reduce_collectives)


def _cumulative(kind: str) -> Op:
    """A cumulative op; kind: the identity that masks the padding along its axis."""
    return Op(R.cumulative, H.cumulative_hook, H.cumulative_collectives,
              padding=functools.partial(H.scan_padding, kind))


_KEYS = Op(R.trailing)

OPS: dict[str, Op] = {
    "argmax": _ARG,
    "argmin": _ARG,
    "bitcast_convert_type": Op(R.bitcast_convert_type),
    "broadcast_in_dim": Op(R.broadcast_in_dim, fold=Fold(spreads_scalar=True, generator=True, keeps_constant=True)),
    "concatenate": Op(RO.concat_rule, RO.concat_hook, RO.concat_collectives),
    "cond": Op(form=CF.FORMS["cond"]),
    "conv_general_dilated": Op(W.conv_rule, W.conv_hook, W.collectives, W.received_keys,
                               fold=Fold(window=_conv_window)),
    "cumlogsumexp": _cumulative("cumlogsumexp"),
    "cummax": _cumulative("cummax"),
    "cummin": _cumulative("cummin"),
    "cumprod": _cumulative("prod"),
    "cumsum": _cumulative("sum"),
    # a move between device and host memory (gshard_jax/sources.py keeps it; other device_puts are annotations)
    "dce_sink": Op(RR.each_operand),
    "device_put": Op(R.elementwise),
    "dot_general": Op(R.dot_general),
    # jax.nn.dot_product_attention(implementation="cudnn"): the fused kernel on each device's batch and heads
    "dot_product_attention_bwd_wrapper": Op(FA.backward),
    "dot_product_attention_fwd_wrapper": Op(FA.forward),
    "dynamic_slice": Op(R.dynamic_slice_rule, H.dynamic_slice_hook, fold=Fold(static_starts=True)),
    "dynamic_update_slice": Op(lambda eqn: RO.update_rule(eqn, R.dynamic_update_slice_rule), RO.update_hook),
    "empty": Op(RR.generator),  # jnp.empty: each device makes its block
    "empty2": Op(RR.generator),
    "gather": Op(R.gather_rule, H.gather_hook, padding=H.no_padding),  # only valid rows are ever indexed
    "iota": Op(R.iota, H.iota_hook, fold=Fold(generator=True)),
    "mulhi": Op(R.elementwise, RR.mulhi_hook),  # pointwise, computed from limbs in a manual region
    "name": Op(R.elementwise),  # jax.ad_checkpoint.checkpoint_name: an identity that names a value for remat
    "optimization_barrier": Op(RR.each_operand),
    "pad": Op(W.pool_rule, W.pad_hook, W.collectives, W.received_keys, fold=Fold(pad=True)),
    "platform_index": Op(RR.generator),  # lax.platform_dependent's branch index: a scalar each device computes
    "random_bits": Op(R.random_bits_rule, H.random_bits_hook),
    "random_clone": _KEYS,
    "random_fold_in": _KEYS,
    "random_gamma": Op(RR.keyed_sampler),
    "random_poisson": Op(RR.keyed_sampler),  # jax.random.poisson (JAX 0.12.1 and later)
    "random_seed": _KEYS,
    "random_split": _KEYS,
    "random_unwrap": _KEYS,
    "random_wrap": _KEYS,
    "reduce": Op(RR.variadic_reduce),
    "reduce_and": _combine(_same),
    "reduce_max": _combine(_same),
    "reduce_min": _combine(_same),
    "reduce_or": _combine(_same),
    "reduce_prod": _combine(),
    "reduce_sum": Op(R.reduction, fold=Fold(reduce=lambda c, n: c * n)),
    "reduce_window": Op(W.generic_pool_rule, W.generic_pool_hook, W.collectives, W.received_keys),
    "reduce_window_max": _pool(-math.inf),
    "reduce_window_min": _pool(math.inf),
    "reduce_window_sum": _pool(0.0),
    "remat2": Op(checkpoint=True),
    "reshape": Op(R.reshape),
    # jax.sharding.reshard (gshard_jax/sources.py rewrites it to an annotation before planning)
    "reshard": Op(fold=Fold(identity=True)),
    "rev": Op(RO.rev_rule, RO.rev_hook, RO.rev_collectives),
    "roll": Op(RL.roll_rule, RL.roll_hook, RL.roll_collectives),
    "scaled_dot": Op(RR.scaled_dot),
    "scan": Op(form=CF.FORMS["scan"]),
    "scatter": Op(R.scatter_rule, H.scatter_hook),
    "scatter-add": Op(R.scatter_rule, H.scatter_hook, masked_operands=(2,)),  # the updates: indices then add zeros
    # x.at[i].min / .max / .multiply: each device applies the updates that land in its block (as scatter)
    "scatter-max": Op(R.scatter_rule, H.scatter_hook),
    "scatter-min": Op(R.scatter_rule, H.scatter_hook),
    "scatter-mul": Op(R.scatter_rule, H.scatter_hook),
    "select_and_gather_add": Op(W.select_gather_rule, W.select_gather_hook, W.collectives, W.received_keys),
    "select_and_scatter_add": Op(W.select_scatter_rule, W.select_scatter_hook, W.collectives, W.received_keys),
    "shard_map": Op(manual=True),
    # our annotations, and every JAX spelling of one (gshard_jax/sources.py rewrites with_sharding_constraint,
    # reshard, device_put and Explicit out_shardings to it before planning): resolved by the plan
    "sharding_annotation": Op(R.elementwise, H.identity_hook, annotation=True, fold=Fold(identity=True)),
    "slice": Op(W.pool_rule, W.slice_hook, W.collectives, W.received_keys, fold=Fold(cut=True)),
    "sort": Op(R.along_axis),
    "split": Op(RO.split_rule, RO.split_hook, RO.split_collectives),
    "squeeze": Op(R.squeeze),
    "stack": Op(R.stack_rule),
    "tile": Op(RR.tile),
    "top_k": Op(R.top_k, H.top_k_hook, H.top_k_collectives),
    "transpose": Op(R.transpose),
    "unstack": Op(R.unstack_rule),
    "while": Op(form=CF.FORMS["while"]),
}


def op_for(name: str) -> Optional[Op]:
    """The entry of a primitive (None: it has none and runs replicated)."""
    return _POINTWISE_FOLDS.get(name, _POINTWISE) if name in POINTWISE else OPS.get(name)


def rule_for(eqn: Eqn) -> Optional[Rule]:
    """The factor rule of an equation, or None when the op has none (it then runs replicated)."""
    op = op_for(eqn.name)
    return op.rule(eqn) if op is not None else None


def collectives(ctx: "H.OpContext") -> list[Collective]:
    """What the hook of ctx's primitive communicates under ctx's factor sharding."""
    op = op_for(ctx.eqn.name)
    return op.collectives(ctx) if op is not None and op.collectives is not None else []


def received(ctx: "H.OpContext") -> list[tuple]:
    """The cache entries the hook of ctx's primitive fills (values it receives that later ops reuse)."""
    op = op_for(ctx.eqn.name)
    return op.received(ctx) if op is not None and op.received is not None else []


def hook(name: str) -> Optional[Hook]:
    op = op_for(name)
    return op.hook if op is not None else None


NEVER_MERGED = ("callback", "print", "rng_uniform", "random_seed")  # words of names: effects or fresh randomness


def mergeable(name: str) -> bool:
    """Whether two equal equations of this primitive compute one value (fold.merge_common may merge them): not
    an op with effects or fresh randomness (any primitive whose name holds a word of NEVER_MERGED)."""
    return not any(word in name for word in NEVER_MERGED)
