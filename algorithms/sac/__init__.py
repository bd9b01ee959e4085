"""Soft actor-critic: twin Q, Polyak targets, tanh-Gaussian actor, automatic entropy temperature."""

from msrl.algorithms.sac.sac import SAC, SACConfig, Transition

__all__ = ["SAC", "SACConfig", "Transition"]
