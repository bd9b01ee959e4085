"""Deep Q-learning: double DQN, n-step returns, target network, optional prioritized replay, Ape-X epsilons."""

from msrl.algorithms.dqn.dqn import DQN, DQNConfig, Transition

__all__ = ["DQN", "DQNConfig", "Transition"]
