"""SAC and TD3 (built-in): learn Pendulum fused, bootstrap a truncated episode from its final observation and
not a terminated one; their conformance cells: ``python -m msrl.conformance --only sac_builtin td3_builtin``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import msrl
from msrl.algorithms.sac import Transition
from msrl.config import load_config
from msrl.runner import build

from helpers import EXAMPLES, QUICK, assert_reaches, reached

SAC = EXAMPLES / "sac_pendulum.yaml"
SMALL = ["algorithm.hidden=[64,64]", "algorithm.batch_size=128", "env.num_envs=4", "algorithm.updates=2"]


def test_sac_learns_pendulum_fused(tmp_path):
    # two rounds of 4 episodes (Pendulum's are 200 steps, all envs in step) at a mean >= -250; random: ~-1200
    msrl.train(SAC, ["run.seed=0", "run.total_env_steps=24000", *SMALL, *QUICK], run_dir=tmp_path,
               on_iteration=reached(-250, window=400))
    assert_reaches(tmp_path, -250, within=24000, window=400)


def test_the_critic_bootstraps_a_truncated_episode_and_not_a_terminated_one():
    cfg = load_config(SAC, ["algorithm.hidden=[16]"])
    learner = build(cfg).components["learner"]
    state = learner.init(jax.random.PRNGKey(0))
    params = state["params"]
    obs = jnp.zeros((2, 3))
    final = jnp.array([[1.0, 0.0, 0.5], [1.0, 0.0, 0.5]])

    def target(terminated, next_obs):
        t = Transition(obs, jnp.zeros((2, 1)), jnp.array([-1.0, -1.0]), jnp.array(terminated), next_obs)
        return np.asarray(learner.target(params["actor"], state["target"], jnp.float32(0.2), t, jax.random.PRNGKey(1)))

    y = target([True, False], final)
    assert y[0] == -1.0  # terminated: the reward alone
    assert y[1] != -1.0  # truncated: the reward plus the discounted soft value of the final observation
    moved = target([True, False], final + 1.0)
    assert moved[0] == -1.0 and moved[1] != y[1]  # ... which the truncated target reads


TD3 = EXAMPLES / "td3_pendulum.yaml"


def test_td3_learns_pendulum_fused(tmp_path):
    msrl.train(TD3, ["run.seed=0", "run.total_env_steps=32000", *SMALL, *QUICK], run_dir=tmp_path,
               on_iteration=reached(-250, window=400))
    assert_reaches(tmp_path, -250, within=32000, window=400)


def test_td3_bootstraps_a_truncated_episode_and_not_a_terminated_one():
    learner = build(load_config(TD3, ["algorithm.hidden=[16]"])).components["learner"]
    state = learner.init(jax.random.PRNGKey(0))
    obs, final = jnp.zeros((2, 3)), jnp.array([[1.0, 0.0, 0.5], [1.0, 0.0, 0.5]])

    def target(next_obs):
        t = Transition(obs, jnp.zeros((2, 1)), jnp.array([-1.0, -1.0]), jnp.array([True, False]), next_obs)
        return np.asarray(learner.target(state["target"], t, jax.random.PRNGKey(1)))

    y, moved = target(final), target(final + 1.0)
    assert y[0] == moved[0] == -1.0 and y[1] != -1.0 and moved[1] != y[1]


def test_continuous_learners_refuse_discrete_actions():
    import pytest

    for config in (SAC, TD3):
        with pytest.raises(msrl.ConfigError, match="continuous"):
            build(load_config(config, ["env.id=gymnax:CartPole-v1"]))
