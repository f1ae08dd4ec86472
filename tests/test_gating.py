"""GShard top-2 gating invariants (models/gating.py)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gshard_jax.models.gating import GatingConfig, capacity, top2_gating


def logits(rng, G=4, S=32, E=8, scale=1.0):
    return jnp.asarray(rng.standard_normal((G, S, E)) * scale, jnp.float32)


@pytest.mark.parametrize("policy", ["all", "random", "sampling"])
@pytest.mark.parametrize("normalize", ["before_drop", "after_drop", "none"])
def test_no_expert_over_capacity_and_one_slot_per_assignment(policy, normalize, rng):
    cfg = GatingConfig(capacity_factor=0.5, min_capacity=1, second_policy=policy, normalize=normalize)
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
    cfg = GatingConfig(capacity_factor=cap * 4 / (2 * 16), min_capacity=1, second_policy="all")
    assert capacity(16, 4, cfg) == cap
    combine, dispatch, _, stats = top2_gating(x, cfg)
    first = np.asarray(jnp.any(dispatch[0, np.arange(16), e1], axis=-1))
    assert first.all() and float(stats["dropped_per_choice"][0]) == 0.0


def test_combine_weights_are_the_normalised_gates_when_nothing_is_dropped(rng):
    x = logits(rng)
    cfg = GatingConfig(capacity_factor=8.0, second_policy="all", normalize="before_drop")
    combine, _, _, stats = top2_gating(x, cfg)
    gates = jax.nn.softmax(x, -1)
    top2 = jax.lax.top_k(gates, 2)[0]
    want = top2 / jnp.sum(top2, -1, keepdims=True)
    got = jnp.sort(jnp.sum(combine, -1), -1)[..., ::-1][..., :2]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert float(stats["dropped_per_choice"][0]) == 0.0 and float(stats["dropped_per_choice"][1]) == 0.0


def test_aux_loss_is_one_for_uniform_routing_and_larger_when_collapsed():
    E, S = 8, 64
    uniform = jnp.log(jax.nn.one_hot(jnp.arange(S) % E, E) * 0.9 + 0.1 / E)[None]  # balanced top-1s
    flat = jnp.zeros((1, S, E))  # equal gates: m_e = 1/E
    collapsed = jnp.log(jax.nn.one_hot(jnp.zeros(S, jnp.int32), E) * 0.99 + 0.01 / E)[None]
    cfg = GatingConfig(second_policy="all")
    aux_uniform = float(top2_gating(uniform, cfg)[2])
    assert abs(float(top2_gating(flat, cfg)[2]) - 1.0) < 1e-5  # argmax ties -> expert 0; m_e uniform -> 1.0
    assert abs(aux_uniform - 1.0) < 1e-5
    assert float(top2_gating(collapsed, cfg)[2]) > 5.0


def test_random_routing_keeps_the_second_expert_at_rate_2g2(rng):
    """P(keep) = min(1, 2 g2) with g2 normalised; checked against the binomial bound over 64k tokens."""
    G, S, E = 64, 1024, 8
    x = logits(rng, G, S, E, scale=2.0)
    cfg = GatingConfig(capacity_factor=float(E), second_policy="random")
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
    cfg = GatingConfig(min_capacity=1, second_policy="random", second_threshold=0.5)
    for seed in range(20):
        _, dispatch, _, _ = top2_gating(x, cfg, jax.random.key(seed))
        assert int(jnp.sum(dispatch)) == 1


def test_bad_options_are_errors():
    with pytest.raises(ValueError, match="second_policy"):
        top2_gating(jnp.zeros((1, 4, 2)), GatingConfig(second_policy="best"))
    with pytest.raises(ValueError, match="pass rng"):
        top2_gating(jnp.zeros((1, 4, 2)), GatingConfig(second_policy="random"))


# --------------------------------------------------------------------------- top-k, Switch, expert choice, uniform

from gshard_jax.models.gating import choose, route, z_loss  # noqa: E402


@pytest.mark.parametrize("k,E", [(1, 8), (2, 8), (8, 64)])
def test_topk_capacity_invariants_and_choice_priority(k, E, rng):
    """No expert over capacity, each token in at most k slots, and choice j is dropped only where every
    earlier choice of the same expert already filled it: kept counts never increase with the choice index
    when experts are contended."""
    cfg = GatingConfig(k=k, capacity_factor=0.75, min_capacity=1, second_policy="all", normalize="none")
    x = logits(rng, G=3, S=64, E=E, scale=3.0)
    r = route(x, cfg)
    C = capacity(64, E, cfg)
    assert r.combine_GSEC.shape == (3, 64, E, C)
    assert int(jnp.max(jnp.sum(r.dispatch_GSEC, axis=1))) <= 1
    assert int(jnp.max(jnp.sum(r.dispatch_GSEC, axis=(2, 3)))) <= k
    per_expert = np.asarray(jnp.sum(r.dispatch_GSEC, axis=(1, 3)))
    assert per_expert.max() <= C
    dropped = np.asarray(r.stats["dropped_per_choice"])
    assert dropped.shape == (k,) and np.all(np.diff(dropped) >= -1e-6)
    # Unnormalised gates: a kept assignment's weight is the router probability of that expert.
    probs = np.asarray(jax.nn.softmax(x, -1))
    w = np.asarray(jnp.sum(r.combine_GSEC, -1))
    routed = w > 0
    np.testing.assert_allclose(w[routed], probs[routed], rtol=1e-6)


def test_switch_top1_gate_is_the_router_probability(rng):
    x = logits(rng, G=2, S=32, E=4)
    r = route(x, GatingConfig(k=1, capacity_factor=4.0, normalize="none"))
    probs = jax.nn.softmax(x, -1)
    np.testing.assert_allclose(jnp.sum(r.combine_GSEC, (-1, -2)), jnp.max(probs, -1), rtol=1e-6)
    assert float(r.stats["dropped"]) == 0.0


def test_eval_capacity_factor_is_used_when_not_training():
    cfg = GatingConfig(k=2, capacity_factor=1.0, eval_capacity_factor=2.0, min_capacity=1)
    assert capacity(64, 8, cfg, train=True) == 16 and capacity(64, 8, cfg, train=False) == 32
    r = route(jnp.zeros((1, 64, 8)), dataclasses.replace(cfg, second_policy="all"), train=False)
    assert r.combine_GSEC.shape[-1] == 32


def test_expert_choice_gives_every_expert_exactly_its_capacity(rng):
    cfg = GatingConfig(k=2, capacity_factor=1.0, min_capacity=1, routing="expert_choice")
    x = logits(rng, G=3, S=32, E=8, scale=2.0)
    r = route(x, cfg)
    C = capacity(32, 8, cfg)
    per_expert = np.asarray(jnp.sum(r.dispatch_GSEC, axis=(1, 3)))
    assert (per_expert == C).all()
    assert int(jnp.max(jnp.sum(r.dispatch_GSEC, axis=1))) == 1  # one token per slot
    # Each expert's tokens are its C highest-probability tokens.
    probs = np.asarray(jax.nn.softmax(x, -1))
    took = np.asarray(jnp.any(r.dispatch_GSEC, -1))
    for g in range(3):
        for e in range(8):
            assert set(np.nonzero(took[g, :, e])[0]) == set(np.argsort(-probs[g, :, e])[:C])


def test_forced_uniform_routing_balances_exactly(rng):
    cfg = GatingConfig(k=2, capacity_factor=1.0, min_capacity=1, routing="forced_uniform", second_policy="all")
    r = route(logits(rng, G=2, S=32, E=8, scale=5.0), cfg)
    per_expert = np.asarray(jnp.sum(r.dispatch_GSEC, axis=(1, 3)))
    assert (per_expert == 2 * 32 // 8).all() and float(r.stats["dropped"]) == 0.0
    np.testing.assert_allclose(r.stats["expert_usage"], np.full(8, 1 / 8), rtol=1e-6)


def test_z_loss_is_mean_squared_logsumexp(rng):
    x = logits(rng, scale=4.0)
    want = np.mean(np.log(np.sum(np.exp(np.asarray(x, np.float64)), -1)) ** 2)
    np.testing.assert_allclose(float(z_loss(x)), want, rtol=1e-5)
    assert float(z_loss(x * 0.1)) < float(z_loss(x))


def test_sampling_draws_later_choices_by_gate(rng):
    """Second choice under "sampling" follows the renormalised remaining gates."""
    p = np.array([0.5, 0.3, 0.15, 0.05])
    x = jnp.broadcast_to(jnp.log(jnp.asarray(p, jnp.float32)), (1, 20000, 4))
    c = choose(x, GatingConfig(k=2, second_policy="sampling"), jax.random.key(3))
    assert (np.asarray(c.experts_GSK[..., 0]) == 0).all()
    freq = np.bincount(np.asarray(c.experts_GSK[..., 1]).ravel(), minlength=4) / 20000
    want = np.r_[0, p[1:] / p[1:].sum()]
    assert np.all(np.abs(freq - want) < 5 * np.sqrt(want * (1 - want) / 20000) + 1e-9)


def test_bad_config_fields_are_named():
    with pytest.raises(ValueError, match="GatingConfig.routing"):
        route(jnp.zeros((1, 4, 2)), GatingConfig(routing="hash"))
    with pytest.raises(ValueError, match="k=3 but the router has only 2"):
        route(jnp.zeros((1, 4, 2)), GatingConfig(k=3, second_policy="all"))
