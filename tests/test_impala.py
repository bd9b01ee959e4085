"""IMPALA: V-trace against the paper's definition computed directly, its on-policy reductions (n-step returns,
GAE), a learner that uses the recorded behaviour log-probs, fused = single_learner_coarse on threads, learning,
and config errors naming the key."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest
from msrl.algorithms.a2c import A2C, A2CConfig
from msrl.algorithms.a2c import Transition as A2CTransition
from msrl.algorithms.impala import IMPALA, IMPALAConfig, Transition, vtrace
from msrl.rl import gae, policy

import msrl
from msrl.config import load_config
from helpers import final_params, last_quarter_after_60k, max_diff

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "impala_cartpole.yaml"


def _random_trajectory(seed, steps=7, envs=3, spread=0.7):
    rng = np.random.default_rng(seed)
    values = rng.normal(size=(steps, envs)).astype(np.float32)
    bootstrap = rng.normal(size=envs).astype(np.float32)
    rewards = rng.normal(size=(steps, envs)).astype(np.float32)
    done = rng.uniform(size=(steps, envs)) < 0.25
    log_rhos = (spread * rng.normal(size=(steps, envs))).astype(np.float32)  # ratios on both sides of 1
    return values, bootstrap, rewards, done, log_rhos


def _vtrace_by_definition(values, bootstrap, rewards, discounts, log_rhos, rho_bar, c_bar, lam):
    """Espeholt et al. (2018), eq. 1, term by term: v_s = V(x_s) + sum_{t>=s} (prod_{i=s}^{t-1} gamma_i c_i) delta_t,
    and the policy-gradient advantage rho_s (r_s + gamma_s v_{s+1} - V(x_s))."""
    steps = len(values)
    rho = np.exp(log_rhos.astype(np.float64))
    clipped, c = np.minimum(rho_bar, rho), lam * np.minimum(c_bar, rho)
    v_next = np.concatenate([values[1:], bootstrap[None]])
    delta = clipped * (rewards + discounts * v_next - values)
    vs = np.array(values, np.float64)
    for s in range(steps):
        weight = np.ones_like(bootstrap, np.float64)
        for t in range(s, steps):
            vs[s] += weight * delta[t]
            weight = weight * discounts[t] * c[t]
    vs_next = np.concatenate([vs[1:], bootstrap[None]])
    return vs, clipped * (rewards + discounts * vs_next - values)


@pytest.mark.parametrize("rho_bar, c_bar, lam", [(1.0, 1.0, 1.0), (1.0, 0.8, 0.9), (2.0, 1.0, 0.95)])
def test_vtrace_matches_its_definition_off_policy_with_episode_ends(rho_bar, c_bar, lam):
    values, bootstrap, rewards, done, log_rhos = _random_trajectory(seed=int(10 * lam + c_bar))
    assert (np.exp(log_rhos) > max(rho_bar, c_bar)).any() and (np.exp(log_rhos) < 1).any() and done.any()
    discounts = 0.9 * (1.0 - done)
    vs, adv = jax.jit(vtrace, static_argnums=(5, 6, 7))(values, bootstrap, rewards, discounts.astype(np.float32),
                                                       log_rhos, rho_bar, c_bar, lam)
    want_vs, want_adv = _vtrace_by_definition(values, bootstrap, rewards, discounts, log_rhos, rho_bar, c_bar, lam)
    np.testing.assert_allclose(vs, want_vs, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(adv, want_adv, rtol=1e-5, atol=1e-5)


def test_on_policy_vtrace_is_n_step_returns_and_gae():
    values, bootstrap, rewards, done, _ = _random_trajectory(seed=3)
    gamma, zero = 0.95, np.zeros_like(values)
    discounts = (gamma * (1.0 - done)).astype(np.float32)
    vs, adv = vtrace(values, bootstrap, rewards, discounts, zero)  # ratio 1, lambda 1
    returns, g = np.zeros_like(values), bootstrap.astype(np.float64)  # n-step returns, cut at episode ends
    for t in reversed(range(len(values))):
        g = rewards[t] + discounts[t] * g
        returns[t] = g
    np.testing.assert_allclose(vs, returns, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(adv, returns - values, rtol=1e-5, atol=1e-5)
    # with lambda < 1 on-policy V-trace targets are TD(lambda) returns: PPO's GAE targets
    vs, _ = vtrace(values, bootstrap, rewards, discounts, zero, lam=0.9)
    _, targets = gae(rewards, done, values, bootstrap, gamma, 0.9)
    np.testing.assert_allclose(vs, targets, rtol=1e-5, atol=1e-5)


def _learners(**cfg):
    spec = msrl.EnvSpec("CartPole-v1", (4,), np.dtype(np.float32), msrl.Discrete(2))
    ctx = msrl.Context(spec, num_envs=4, total_env_steps=10_000)
    return IMPALA(IMPALAConfig(**cfg), ctx).learner, A2C(A2CConfig(**cfg), ctx).learner


def test_learner_uses_the_recorded_behaviour_log_probs():
    impala, a2c = _learners(hidden=[32], lr=1e-2)
    state = jax.jit(impala.init)(jax.random.PRNGKey(0))
    rng = np.random.default_rng(1)
    obs, last_obs = rng.normal(size=(6, 4, 4)).astype(np.float32), rng.normal(size=(4, 4)).astype(np.float32)
    action = rng.integers(0, 2, (6, 4)).astype(np.int32)
    reward, done = np.ones((6, 4), np.float32), np.zeros((6, 4), bool)
    done[3, 1] = True
    log_pi = jax.jit(lambda p: policy(True, impala.net.apply(p, obs)[0]).log_prob(action))(state["params"])
    learn = jax.jit(impala.learn)

    log_pi = np.asarray(log_pi)
    lag = (0.5 * rng.normal(size=(6, 4))).astype(np.float32)  # the actor acted with another policy
    _, metrics = learn(state, Transition(obs, action, reward, done, log_pi - lag), last_obs)
    assert float(metrics["rho_mean"]) == pytest.approx(float(np.exp(lag).mean()), rel=1e-5)
    assert float(metrics["log_rho_abs"]) == pytest.approx(float(np.abs(lag).mean()), rel=1e-5)

    # on-policy (ratio 1, c_bar = rho_bar = lambda = 1) the update is A2C's with n-step returns
    on_policy, metrics = learn(state, Transition(obs, action, reward, done, log_pi), last_obs)
    assert float(metrics["rho_mean"]) == pytest.approx(1.0, abs=1e-6)
    a2c_state = {"params": state["params"], "opt_state": jax.jit(a2c.tx.init)(state["params"])}
    a2c_new, _ = jax.jit(a2c.learn)(a2c_state, A2CTransition(obs, action, reward, done), last_obs)
    for x, y in zip(jax.tree.leaves(on_policy["params"]), jax.tree.leaves(a2c_new["params"]), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
    off_policy, _ = learn(state, Transition(obs, action, reward, done, log_pi - lag), last_obs)
    assert max(float(np.abs(x - y).max()) for x, y in zip(jax.tree.leaves(off_policy["params"]),
                                                           jax.tree.leaves(on_policy["params"]))) > 1e-4


def test_fused_and_coarse_on_threads_give_the_same_parameters_with_minibatches():
    minibatches = ["algorithm.epochs=2", "algorithm.minibatches=2"]
    fused, rows = final_params(minibatches, 3, EXAMPLE)
    coarse, _ = final_params([*minibatches, "policy.name=single_learner_coarse", "policy.backend=threads",
                              "policy.actors=2"], 3, EXAMPLE)
    assert max_diff(fused, coarse) <= 1e-5
    assert all(abs(r["rho_mean"] - 1) < 0.05 for r in rows)  # later epochs and minibatches are off-policy


def test_impala_cartpole_learns_well_beyond_random(tmp_path):
    last = last_quarter_after_60k(EXAMPLE, tmp_path)  # seeds 0-2: 450, 483, 200
    assert sum(last) / len(last) > 150, last


def test_config_errors_name_the_key():
    with pytest.raises(msrl.ConfigError, match=r"algorithm.minibatches.*3 does not divide the 8 environments"):
        msrl.build(load_config(EXAMPLE, ["algorithm.minibatches=3"]))
    multi = ["algorithm.minibatches=8", "policy.name=multi_learner", "policy.learners=2", "policy.backend=ray"]
    for config, overrides in [(EXAMPLE, []), (EXAMPLE, ["algorithm.name=recurrent_impala"]),
                              (EXAMPLE.parent / "recurrent_ppo_cartpole.yaml", ["env.num_envs=8"])]:
        with pytest.raises(msrl.ConfigError, match=r"algorithm.minibatches.*8 does not divide the 4 environments"):
            msrl.build(load_config(config, [*overrides, *multi]))  # 8 divides 8 envs; 2 learners see 4 each
    with pytest.raises(msrl.ConfigError, match=r"algorithm.name.*3 agents.*IMPALA.*mappo"):
        msrl.build(load_config(EXAMPLE, ["env.id=jaxmarl:MPE_simple_spread_v3"]))
    with pytest.raises(msrl.ConfigError, match=r"algorithm.rho_bar"):
        load_config(EXAMPLE, ["algorithm.rho_bar=0"])
