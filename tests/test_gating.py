"""GShard top-2 gating invariants (models/gating.py)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gshard_jax.models.gating import Top2Config, capacity, top2_gating


def logits(rng, G=4, S=32, E=8, scale=1.0):
    return jnp.asarray(rng.standard_normal((G, S, E)) * scale, jnp.float32)


@pytest.mark.parametrize("policy", ["all", "random", "sampling"])
@pytest.mark.parametrize("normalize", ["before_drop", "after_drop", "none"])
def test_no_expert_over_capacity_and_one_slot_per_assignment(policy, normalize, rng):
    cfg = Top2Config(capacity_factor=0.5, min_capacity=1, second_policy=policy, normalize=normalize)
    combine, dispatch, _, _ = top2_gating(logits(rng), cfg, jax.random.key(0))
    C = capacity(32, 8, cfg)
    assert combine.shape == (4, 32, 8, C)
    assert int(jnp.max(jnp.sum(dispatch, axis=1))) <= 1  # each (expert, slot) holds at most one token
    assert int(jnp.max(jnp.sum(dispatch, axis=(2, 3)))) <= 2  # a token goes to at most two experts


def test_top1_assignments_have_priority_over_top2(rng):
    """With capacity for exactly the top-1 load, every token keeps its first choice and second choices only
    fill what is left."""
    x = logits(rng, G=1, S=16, E=4)
    e1 = np.asarray(jnp.argmax(x, -1))[0]
    cap = int(np.bincount(e1, minlength=4).max())
    cfg = Top2Config(capacity_factor=cap * 4 / (2 * 16), min_capacity=1, second_policy="all")
    assert capacity(16, 4, cfg) == cap
    combine, dispatch, _, stats = top2_gating(x, cfg)
    first = np.asarray(jnp.any(dispatch[0, np.arange(16), e1], axis=-1))
    assert first.all() and float(stats["dropped_top1"]) == 0.0


def test_combine_weights_are_the_normalised_gates_when_nothing_is_dropped(rng):
    x = logits(rng)
    cfg = Top2Config(capacity_factor=8.0, second_policy="all", normalize="before_drop")
    combine, _, _, stats = top2_gating(x, cfg)
    gates = jax.nn.softmax(x, -1)
    top2 = jax.lax.top_k(gates, 2)[0]
    want = top2 / jnp.sum(top2, -1, keepdims=True)
    got = jnp.sort(jnp.sum(combine, -1), -1)[..., ::-1][..., :2]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert float(stats["dropped_top1"]) == 0.0 and float(stats["dropped_top2"]) == 0.0


def test_aux_loss_is_one_for_uniform_routing_and_larger_when_collapsed():
    E, S = 8, 64
    uniform = jnp.log(jax.nn.one_hot(jnp.arange(S) % E, E) * 0.9 + 0.1 / E)[None]  # balanced top-1s
    flat = jnp.zeros((1, S, E))  # equal gates: m_e = 1/E
    collapsed = jnp.log(jax.nn.one_hot(jnp.zeros(S, jnp.int32), E) * 0.99 + 0.01 / E)[None]
    cfg = Top2Config(second_policy="all")
    aux_uniform = float(top2_gating(uniform, cfg)[2])
    assert abs(float(top2_gating(flat, cfg)[2]) - 1.0) < 1e-5  # argmax ties -> expert 0; m_e uniform -> 1.0
    assert abs(aux_uniform - 1.0) < 1e-5
    assert float(top2_gating(collapsed, cfg)[2]) > 5.0


def test_random_routing_keeps_the_second_expert_at_rate_2g2(rng):
    """P(keep) = min(1, 2 g2) with g2 normalised; checked against the binomial bound over 64k tokens."""
    G, S, E = 64, 1024, 8
    x = logits(rng, G, S, E, scale=2.0)
    cfg = Top2Config(capacity_factor=float(E), second_policy="random")
    _, dispatch, _, _ = top2_gating(x, cfg, jax.random.key(1))
    gates = jax.nn.softmax(x, -1)
    top2 = jax.lax.top_k(gates, 2)[0]
    g2 = top2[..., 1] / jnp.sum(top2, -1)
    p = np.asarray(jnp.minimum(1.0, 2 * g2)).ravel()
    kept = np.asarray(jnp.sum(dispatch, axis=(2, 3)) == 2).ravel()
    n = p.size
    assert abs(kept.mean() - p.mean()) < 5 * np.sqrt(np.sum(p * (1 - p))) / n


def test_threshold_drops_weak_second_choices():
    x = jnp.log(jnp.asarray([[[0.7, 0.2, 0.1]]], jnp.float32))  # g2 normalised = 2/9: 2*g2 = 0.44
    cfg = Top2Config(min_capacity=1, second_policy="random", second_threshold=0.5)
    for seed in range(20):
        _, dispatch, _, _ = top2_gating(x, cfg, jax.random.key(seed))
        assert int(jnp.sum(dispatch)) == 1


def test_bad_options_are_errors():
    with pytest.raises(ValueError, match="second_policy"):
        top2_gating(jnp.zeros((1, 4, 2)), Top2Config(second_policy="best"))
    with pytest.raises(ValueError, match="pass rng"):
        top2_gating(jnp.zeros((1, 4, 2)), Top2Config(second_policy="random"))
