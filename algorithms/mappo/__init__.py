"""Multi-agent PPO (parameter-shared actor, centralized critic) for environments whose agents share a reward."""

from msrl.algorithms.mappo.mappo import MAPPO, MAPPOConfig

__all__ = ["MAPPO", "MAPPOConfig"]
