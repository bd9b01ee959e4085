"""Proximal Policy Optimization (clipped objective, GAE), discrete and continuous actions."""

from msrl.algorithms.ppo.ppo import PPO, PPOConfig, Transition

__all__ = ["PPO", "PPOConfig", "Transition"]
