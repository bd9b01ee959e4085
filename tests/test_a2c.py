"""A2C: learns CartPole under `fused`; fused and single_learner_coarse on threads give the same parameters;
its one gradient step goes through the learner's optax chain (grad_transforms); config errors name the key."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from msrl.algorithms.a2c import A2C, A2CConfig, Transition

import msrl
from msrl.config import load_config
from helpers import assert_pendulum_run, final_params, last_quarter_after_60k, max_diff, short_run

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "a2c_cartpole.yaml"


def test_a2c_cartpole_learns_well_beyond_random(tmp_path):
    last = last_quarter_after_60k(EXAMPLE, tmp_path)  # seeds 0-2: 305, 265, 164
    assert sum(last) / len(last) > 150, last


def test_fused_and_coarse_on_threads_give_the_same_parameters():
    fused, fused_rows = final_params([], 3, EXAMPLE)
    coarse, coarse_rows = final_params(["policy.name=single_learner_coarse", "policy.backend=threads",
                                        "policy.actors=2"], 3, EXAMPLE)
    assert max_diff(fused, coarse) <= 1e-5
    assert max_diff(fused, jax.tree.map(np.zeros_like, fused)) > 1e-3  # they are not all zero
    assert len(fused_rows) == len(coarse_rows) == 3
    for f, c in zip(fused_rows, coarse_rows):
        assert f["loss"] == pytest.approx(c["loss"], rel=1e-4, abs=1e-6)


CARTPOLE_SPEC = msrl.EnvSpec("CartPole-v1", (4,), np.dtype(np.float32), msrl.Discrete(2))


def _algorithm(**overrides) -> A2C:
    return A2C(A2CConfig(**overrides), msrl.Context(CARTPOLE_SPEC, num_envs=4, total_env_steps=10_000))


def _batch(seed, steps=5, envs=4):
    rng = np.random.default_rng(seed)
    return (Transition(obs=rng.normal(size=(steps, envs, 4)).astype(np.float32),
                       action=rng.integers(0, 2, (steps, envs)).astype(np.int32),
                       reward=np.ones((steps, envs), np.float32),
                       done=rng.uniform(size=(steps, envs)) < 0.2),
            np.zeros((envs, 4), np.float32))


def test_one_gradient_step_through_grad_transforms_on_n_step_returns():
    learner = _algorithm(gamma=0.9).learner
    state = jax.jit(learner.init)(jax.random.PRNGKey(0))
    batch, last_obs = _batch(1)
    plain, metrics = jax.jit(learner.learn)(state, batch, last_obs)
    assert max_diff(plain["params"], state["params"]) > 1e-4

    # the value regresses toward n-step returns bootstrapped from the last observation, cut at episode ends
    value, g = jax.jit(lambda p: (learner.net.apply(p, batch.obs)[1], learner.net.apply(p, last_obs)[1]))(
        state["params"])
    reward, done, g = np.asarray(batch.reward), np.asarray(batch.done), np.asarray(g)
    returns = np.zeros(reward.shape, np.float32)
    for t in reversed(range(len(returns))):
        g = reward[t] + 0.9 * (1.0 - done[t]) * g
        returns[t] = g
    assert float(metrics["value_loss"]) == pytest.approx(float(0.5 * np.mean((returns - value) ** 2)), rel=1e-5)

    # a transform a distribution policy puts before the optimizer sees the whole gradient of the loss
    keep = optax.GradientTransformation(lambda params: jax.tree.map(jnp.zeros_like, params),
                                        lambda grads, _, params=None: (grads, grads))  # passes on, remembers
    learner.grad_transforms = (keep,)
    state = jax.jit(learner.init)(jax.random.PRNGKey(0))
    kept, _ = jax.jit(learner.learn)(state, batch, last_obs)
    assert max_diff(kept["params"], plain["params"]) <= 1e-7
    grads, _ = jax.jit(jax.grad(learner._loss, has_aux=True))(state["params"], batch, last_obs)
    assert max_diff(kept["opt_state"][0], grads) <= 1e-6


def test_continuous_actions_run():
    """Gaussian actions on Pendulum: 40 iterations of 2 envs x 5 steps, so each env finishes one 200-step
    episode, in the last iteration."""
    before, after, rows, _ = short_run(EXAMPLE, ["env.id=gymnax:Pendulum-v1", "env.num_envs=2",
                                                 "run.total_env_steps=400"], 40)
    assert rows[-1]["env_steps"] == 400 and [r["episodes"] for r in rows] == [0] * 39 + [2]
    assert_pendulum_run(before, after, rows, episodes=2)
    assert all(np.isfinite(r["grad_norm"]) and r["grad_norm"] > 0 for r in rows)


def test_config_errors_name_the_key():
    with pytest.raises(msrl.ConfigError, match=r"algorithm.name.*3 agents.*A2C.*mappo"):
        msrl.build(load_config(EXAMPLE, ["env.id=jaxmarl:MPE_simple_spread_v3"]))
    with pytest.raises(msrl.ConfigError, match=r"algorithm.optimizer"):
        load_config(EXAMPLE, ["algorithm.optimizer=sgd"])
    with pytest.raises(msrl.ConfigError, match=r"algorithm.gae_lambda"):
        load_config(EXAMPLE, ["algorithm.gae_lambda=1.5"])
    with pytest.raises(msrl.ConfigError, match=r"algorithm.clip_eps.*unknown key"):
        load_config(EXAMPLE, ["algorithm.clip_eps=0.2"])
