"""IMPALA: actor-critic with V-trace off-policy correction from the recorded behaviour log-probs."""

from msrl.algorithms.impala.impala import IMPALA, IMPALAConfig, Transition, vtrace

__all__ = ["IMPALA", "IMPALAConfig", "Transition", "vtrace"]
