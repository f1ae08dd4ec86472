"""One entry per primitive: its factor rule, its hook, and what the hook communicates.

Grouped as Shardy's op_sharding_rule_registry groups ops: every pointwise op
is one case, the rest are listed alphabetically. An entry's rule (rules.py,
windowed.py, reorder.py) says how its dims map to factors and carries the
op's policy as fields (pointwise, late_backward, rings, ...); its hook
(hooks.py, windowed.py, reorder.py) is what the op needs beyond binding on
local shards, and its collectives function is what that hook sends, for the
cost model and the report (with, for hooks that share what they receive with later ops, the cache
entries they fill). Propagation and lowering read this table and
nothing else about an op; a primitive without an entry runs replicated (the
fallback) and is flagged in the report.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from . import hooks as H, reorder as RO, roll as RL, rules as R, windowed as W
from .cost import Collective
from .factors import Rule
from .program import Eqn

Hook = Callable  # (OpContext, local operands, params, bind) -> local results


@dataclasses.dataclass(frozen=True)
class Op:
    rule: Callable[[Eqn], Optional[Rule]]
    hook: Optional[Hook] = None
    collectives: Optional[Callable[["H.OpContext"], list[Collective]]] = None
    received: Optional[Callable[["H.OpContext"], list[tuple]]] = None  # cache entries the hook fills


POINTWISE = frozenset("""
abs acos acosh add add_any and asin asinh atan atan2 atanh cbrt ceil clamp complex conj convert_element_type
copy cos cosh digamma div eq erf erf_inv erfc exp exp2 expm1 floor ge gt igamma igammac imag
integer_pow is_finite le lgamma log log1p logistic lt max min mul ne neg nextafter not or pow real
reduce_precision rem round rsqrt select_n shift_left shift_right_arithmetic shift_right_logical sign
sin sinh sqrt square sub tan tanh xor population_count clz stop_gradient
""".split())

_POINTWISE = Op(R.elementwise)
_COMBINE = Op(R.reduction, H.combine_hook, H.combine_collectives)
_ARG = Op(R.reduction, H.arg_reduce_hook, H.arg_reduce_collectives)
_CUMULATIVE = Op(R.cumulative, H.cumulative_hook, H.cumulative_collectives)
_KEYS = Op(R.trailing)
_POOL = Op(W.pool_rule, W.pool_hook, W.collectives, W.received_keys)
_SCATTER = Op(R.scatter_rule, H.scatter_hook)

OPS: dict[str, Op] = {
    "argmax": _ARG,
    "argmin": _ARG,
    "bitcast_convert_type": Op(R.bitcast_convert_type),
    "broadcast_in_dim": Op(R.broadcast_in_dim),
    "concatenate": Op(RO.concat_rule, RO.concat_hook, RO.concat_collectives),
    "conv_general_dilated": Op(W.conv_rule, W.conv_hook, W.collectives, W.received_keys),
    "cumlogsumexp": _CUMULATIVE,
    "cummax": _CUMULATIVE,
    "cummin": _CUMULATIVE,
    "cumprod": _CUMULATIVE,
    "cumsum": _CUMULATIVE,
    # a move between device and host memory (gshard_jax/sources.py keeps it; other device_puts are annotations)
    "device_put": _POINTWISE,
    "dot_general": Op(R.dot_general),
    "dynamic_slice": Op(R.dynamic_slice_rule, H.dynamic_slice_hook),
    "dynamic_update_slice": Op(lambda eqn: RO.update_rule(eqn, R.dynamic_update_slice_rule), RO.update_hook),
    "gather": Op(R.gather_rule, H.gather_hook),
    "iota": Op(R.iota, H.iota_hook),
    "name": Op(R.elementwise),  # jax.ad_checkpoint.checkpoint_name: an identity that names a value for remat
    "pad": Op(W.pool_rule, W.pad_hook, W.collectives, W.received_keys),
    "random_bits": Op(R.random_bits_rule, H.random_bits_hook),
    "random_clone": _KEYS,
    "random_fold_in": _KEYS,
    "random_seed": _KEYS,
    "random_split": _KEYS,
    "random_unwrap": _KEYS,
    "random_wrap": _KEYS,
    "reduce_and": _COMBINE,
    "reduce_max": _COMBINE,
    "reduce_min": _COMBINE,
    "reduce_or": _COMBINE,
    "reduce_prod": _COMBINE,
    "reduce_sum": Op(R.reduction),
    "reduce_window": Op(W.generic_pool_rule, W.generic_pool_hook, W.collectives, W.received_keys),
    "reduce_window_max": _POOL,
    "reduce_window_min": _POOL,
    "reduce_window_sum": _POOL,
    "reshape": Op(R.reshape),
    "rev": Op(RO.rev_rule, RO.rev_hook, RO.rev_collectives),
    "roll": Op(RL.roll_rule, RL.roll_hook, RL.roll_collectives),
    "scatter": _SCATTER,
    "scatter-add": _SCATTER,
    "select_and_gather_add": Op(W.select_gather_rule, W.select_gather_hook, W.collectives, W.received_keys),
    "select_and_scatter_add": Op(W.select_scatter_rule, W.select_scatter_hook, W.collectives, W.received_keys),
    # our annotations, and every JAX spelling of one (gshard_jax/sources.py rewrites with_sharding_constraint,
    # reshard, device_put and Explicit out_shardings to it before planning): resolved by the plan
    "sharding_annotation": Op(R.elementwise, H.identity_hook),
    "slice": Op(W.pool_rule, W.slice_hook, W.collectives, W.received_keys),
    "sort": Op(R.along_axis),
    "split": Op(RO.split_rule, RO.split_hook, RO.split_collectives),
    "squeeze": Op(R.squeeze),
    "stack": Op(R.stack_rule),
    "top_k": Op(R.top_k, H.top_k_hook, H.top_k_collectives),
    "transpose": Op(R.transpose),
    "unstack": Op(R.unstack_rule),
}


def op_for(name: str) -> Optional[Op]:
    """The entry of a primitive (None: it has none and runs replicated)."""
    return _POINTWISE if name in POINTWISE else OPS.get(name)


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
