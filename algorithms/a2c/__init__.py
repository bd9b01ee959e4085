"""A2C: synchronous n-step advantage actor-critic, one gradient step per rollout (A3C under `async`)."""

from msrl.algorithms.a2c.a2c import A2C, A2CConfig, Transition

__all__ = ["A2C", "A2CConfig", "Transition"]
