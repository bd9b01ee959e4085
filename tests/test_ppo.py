"""PPO learns: CartPole to >= 475 within 300k steps under `fused`; continuous and image observations run."""

from __future__ import annotations

import math

import msrl

from helpers import EXAMPLES, assert_reaches



def test_ppo_cartpole_reaches_475_within_300k_steps(tmp_path):
    summary = msrl.train(EXAMPLES / "ppo_cartpole.yaml", ["run.seed=0", "run.progress=false"], run_dir=tmp_path)
    assert summary["env_steps"] <= 300_000
    assert_reaches(tmp_path, 475, within=300_000)


def test_ppo_continuous_actions_pendulum(tmp_path):
    summary = msrl.train(EXAMPLES / "ppo_pendulum.yaml",
                         ["run.total_env_steps=8192", "run.progress=false", "run.tensorboard=false"],
                         run_dir=tmp_path)
    assert summary["iterations"] >= 1
    assert math.isfinite(summary["episode_return"]) and summary["episode_return"] < 0  # pendulum costs


def test_ppo_image_observations_minatar(tmp_path):
    summary = msrl.train(EXAMPLES / "ppo_cartpole.yaml",
                         ["env.id=gymnax:Breakout-MinAtar", "run.total_env_steps=1024", "algorithm.rollout_len=64",
                          "run.progress=false", "run.tensorboard=false"], run_dir=tmp_path)
    assert summary["iterations"] == 4
