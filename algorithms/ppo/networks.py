"""Actor-critic networks (flax) with distrax policy distributions."""

from __future__ import annotations

from typing import Sequence

import distrax
import flax.linen as nn
import jax.numpy as jnp
import numpy as np


def _dense(features: int, scale: float) -> nn.Dense:
    return nn.Dense(features, kernel_init=nn.initializers.orthogonal(scale), bias_init=nn.initializers.zeros)


def policy(discrete: bool, head: jnp.ndarray | tuple[jnp.ndarray, jnp.ndarray]) -> distrax.Distribution:
    """The action distribution of a network head: Categorical(logits) or diagonal Gaussian(mean, log_std)."""
    if discrete:
        return distrax.Categorical(logits=head)
    mean, log_std = head
    return distrax.MultivariateNormalDiag(mean, jnp.exp(log_std))


class ActorCritic(nn.Module):
    """Separate actor and critic MLPs. Returns ``(head, value)`` where ``head`` parameterizes the policy
    (see :func:`policy`): logits, or a Gaussian mean with a learned state-independent log std."""

    action_dim: int
    discrete: bool
    obs_ndim: int
    hidden: Sequence[int] = (64, 64)
    activation: str = "tanh"

    @nn.compact
    def __call__(self, obs: jnp.ndarray):
        act = {"tanh": nn.tanh, "relu": nn.relu}[self.activation]
        x = obs.astype(jnp.float32)
        x = x.reshape(x.shape[: x.ndim - self.obs_ndim] + (-1,))
        a = x
        for h in self.hidden:
            a = act(_dense(h, np.sqrt(2))(a))
        head = _dense(self.action_dim, 0.01)(a)
        if not self.discrete:
            log_std = self.param("log_std", nn.initializers.zeros, (self.action_dim,))
            head = (head, jnp.broadcast_to(log_std, head.shape))
        c = x
        for h in self.hidden:
            c = act(_dense(h, np.sqrt(2))(c))
        value = _dense(1, 1.0)(c).squeeze(-1)
        return head, value
