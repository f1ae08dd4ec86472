"""`pipeline_value_and_grad`: the pipeline with a loss on its output, and its gradients. GPipe and circular
differentiate the forward loop (forward.py); 1F1B and interleaved 1F1B run their own backward
(one_f_one_b.py)."""
from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp

from . import schedules as S
from .common import PyTree, check_owned, f32, gradient_where, microbatches, stage_axis, stages_of, weighted
from .forward import pipeline
from .one_f_one_b import one_f_one_b


def pipeline_value_and_grad(stage_fn: Callable, params: PyTree, x: PyTree, loss_fn: Callable, loss_params: PyTree,
                            targets: PyTree, *, num_microbatches: int, schedule: str = "1f1b", repeats: int = 1,
                            has_aux: bool = False, aux_weights: Optional[PyTree] = None, axis: str = "stage",
                            x_spec: Optional[PyTree] = None, param_specs: Optional[PyTree] = None,
                            unroll: bool = False, owned_ends: bool = False):
    """The pipeline with a loss on its output, and the gradients: ((loss, aux), (d params, d x, d loss_params)).

    loss_fn(loss_params, y_mb, targets_mb) -> scalar is summed over microbatches; with has_aux the stage's
    aux (summed as in `pipeline`) adds sum(aux_weights * aux) to the objective (aux_weights: a pytree like
    aux of weights, 0 for statistics; None: aux is not differentiated). Gradients are float32 for floating
    leaves. GPipe and circular differentiate `pipeline`; 1F1B and interleaved 1F1B run their own backward
    wave, holding per stage at most 2 r p - 1 microbatches' residuals.

    owned_ends: the pipeline's ends are owned by its end stages, as Megatron-LM keeps the embedding on the
    first stage and the head on the last. x and loss_params lead with a [stages] dim split over the stage
    axis; stage 0 reads its slice of x and the last stage runs the loss on its own outputs with its slice of
    loss_params (the other slices' results are never used), and d x and d loss_params come back per stage,
    nonzero on their owner only. Nothing crosses the stage axis for them but the loss: replicated ends need
    the outputs (GPipe, circular) or the head's gradient (1F1B), and the input gradient, summed over it.
    """
    p = stages_of(params, repeats)
    S.check(schedule, p, num_microbatches, repeats)
    if owned_ends:
        check_owned(p, x=x, loss_params=loss_params)
    if schedule not in S.OWN_BACKWARD:
        def objective(params, x, loss_params):
            out = pipeline(stage_fn, params, x, num_microbatches=num_microbatches, schedule=schedule,
                           repeats=repeats, has_aux=has_aux, axis=axis, x_spec=x_spec, param_specs=param_specs,
                           unroll=unroll, owned_ends=owned_ends)
            y, aux = out if has_aux else (out, {})
            if owned_ends:  # each stage runs the loss on its own outputs and head; only the last stage's counts
                def stage_loss(lp, y, ok):  # the other stages' results and gradients are cut off
                    return jnp.where(ok, _summed(loss_fn, gradient_where(ok, lp), y, targets, num_microbatches), 0)
                last = jnp.arange(p) == p - 1
                loss = jax.vmap(stage_loss, spmd_axis_name=stage_axis(axis, p))(loss_params, y, last).sum()
            else:
                loss = _summed(loss_fn, loss_params, y, targets, num_microbatches)
            return loss + weighted(aux, aux_weights), (loss, aux)

        (_, (loss, aux)), grads = jax.value_and_grad(objective, argnums=(0, 1, 2), has_aux=True)(params, x, loss_params)
        return (loss, aux), f32(grads)
    return one_f_one_b(stage_fn, params, x, loss_fn, loss_params, targets, p, num_microbatches, schedule, repeats,
                       has_aux, aux_weights, axis, x_spec, param_specs, unroll, owned_ends)


def _summed(loss_fn: Callable, loss_params: PyTree, y: PyTree, targets: PyTree, m: int) -> jax.Array:
    """loss_fn(loss_params, y_mb, targets_mb) summed over the m microbatches, one at a time."""
    ys, ts = microbatches(y, m), microbatches(targets, m)
    by_microbatch = jax.tree.map(lambda a: jnp.moveaxis(a, 1, 0), (ys, ts))
    return jax.lax.map(lambda yt: loss_fn(loss_params, *yt), by_microbatch).sum()
