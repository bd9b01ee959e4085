"""Twin delayed DDPG: clipped double-Q, target policy smoothing, delayed actor and target updates."""

from msrl.algorithms.td3.td3 import TD3, TD3Config

__all__ = ["TD3", "TD3Config"]
