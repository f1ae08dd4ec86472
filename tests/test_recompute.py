"""What each remat policy runs again, against the planner's count (estimate.recomputed_flops_per_token): the
matmul flops of the lowered gradient under a policy, over those under remat "none"."""
from __future__ import annotations

import flax.linen as nn
import jax
import pytest
from test_models import experiment

from gshard_jax import configs
from gshard_jax.models.transformer import loss_fn
from gshard_jax.planner import estimate as E, space as SP
from helpers import matmul_flops

BATCH, SEQ = 8, 64


def _cfg(name: str, remat: str, **moe):
    cfg = experiment(name)
    cfg.model.update(num_layers=2, attention="einsum", scan=False, remat=remat)
    if moe:
        cfg.model.moe.update(moe)
    cfg.train.batch_size, cfg.train.seq_len = BATCH, SEQ
    return cfg


def _step_matmul_flops(cfg) -> tuple[int, dict]:
    """The matmul flops of the config's loss gradient on BATCH x SEQ tokens, and its params."""
    model = configs.build_model(cfg.model)
    tokens = jax.random.randint(jax.random.key(0), (BATCH, SEQ + 1), 1, cfg.model.vocab_size)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    params = nn.unbox(model.init(jax.random.key(1), batch["inputs"]))
    grad = jax.jit(jax.value_and_grad(lambda p: loss_fn(model, p, batch)[0]))
    return matmul_flops(grad.lower(params).as_text()), params


@pytest.mark.parametrize("remat", ["dots", "dots_saveable", "full"])
def test_the_planner_counts_the_matmuls_a_dense_models_remat_runs_again(remat):
    """dots: the score and context matmuls (batched over heads); dots_saveable: none; full: the forward but each
    layer's FFN output projection, whose output the backward never reads. Exact, but for the norms' scales:
    the planner's 2 flops per layer parameter counts them (as 6N does) and they are no matmul."""
    base, params = _step_matmul_flops(_cfg("tiny_dense_lm", "none"))
    cfg = _cfg("tiny_dense_lm", remat)
    ran, _ = _step_matmul_flops(cfg)
    shape = SP.model_shape(cfg, "cpu")
    norms = sum(x.size for x in jax.tree_util.tree_leaves(params) if x.ndim == 1)
    expected = E.recomputed_flops_per_token(shape, remat) * shape.tokens
    if remat == "full":
        expected -= 2 * norms * shape.tokens  # the planner's layer params hold every norm, the final one too
    assert ran - base == expected, (ran - base, expected)
    assert (ran > base) == (remat != "dots_saveable")


@pytest.mark.parametrize("dispatch", ["einsum", "dropless"])
def test_remat_dots_runs_no_expert_matmul_again(dispatch):
    """The experts' matmuls are batched over experts (einsum) or no dot_general (dropless's grouped matmul), so
    "dots" keeps them by name: what runs again is attention's, as the planner counts, and under GShard's
    einsum dispatch the gating's one-hot combine weights (batched over groups: far under one expert matmul)."""
    base, _ = _step_matmul_flops(_cfg("tiny_moe_lm", "none", dispatch=dispatch))
    cfg = _cfg("tiny_moe_lm", "dots", dispatch=dispatch)
    ran, _ = _step_matmul_flops(cfg)
    shape = SP.model_shape(cfg, "cpu")
    attention = E.recomputed_flops_per_token(shape, "dots") * shape.tokens
    assert attention == 4 * shape.layers * shape.d_model * SEQ * BATCH * SEQ
    one_expert_matmul = 2 * shape.tokens * shape.k * shape.d_model * shape.d_ff  # the rows' work, no padding
    if dispatch == "dropless":
        assert ran - base == attention
    else:
        assert 0 < ran - base - attention < one_expert_matmul / 50, (ran - base - attention, one_expert_matmul)
