"""Actor-critic networks (flax) with distrax policy distributions."""

from __future__ import annotations

from typing import Sequence

import distrax
import flax.linen as nn
import jax.numpy as jnp
import numpy as np


def _dense(features: int, scale: float) -> nn.Dense:
    return nn.Dense(features, kernel_init=nn.initializers.orthogonal(scale), bias_init=nn.initializers.zeros)


class ActorCritic(nn.Module):
    """Separate actor and critic MLPs. Discrete actions: Categorical over logits. Continuous: diagonal
    Gaussian with a learned, state-independent log standard deviation."""

    action_dim: int
    discrete: bool
    obs_ndim: int
    hidden: Sequence[int] = (64, 64)
    activation: str = "tanh"

    @nn.compact
    def __call__(self, obs: jnp.ndarray) -> tuple[distrax.Distribution, jnp.ndarray]:
        act = {"tanh": nn.tanh, "relu": nn.relu}[self.activation]
        x = obs.astype(jnp.float32)
        x = x.reshape(x.shape[: x.ndim - self.obs_ndim] + (-1,))
        a = x
        for h in self.hidden:
            a = act(_dense(h, np.sqrt(2))(a))
        head = _dense(self.action_dim, 0.01)(a)
        if self.discrete:
            pi = distrax.Categorical(logits=head)
        else:
            log_std = self.param("log_std", nn.initializers.zeros, (self.action_dim,))
            pi = distrax.MultivariateNormalDiag(head, jnp.exp(log_std))
        c = x
        for h in self.hidden:
            c = act(_dense(h, np.sqrt(2))(c))
        value = _dense(1, 1.0)(c).squeeze(-1)
        return pi, value
