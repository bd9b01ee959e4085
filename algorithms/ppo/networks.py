"""Actor-critic networks (flax) with distrax policy distributions."""

from __future__ import annotations

from typing import Sequence

import distrax
import flax.linen as nn
import jax.numpy as jnp
import numpy as np


def _dense(features: int, scale: float) -> nn.Dense:
    return nn.Dense(features, kernel_init=nn.initializers.orthogonal(scale), bias_init=nn.initializers.zeros)


def action_dim(spec) -> int:
    """The policy head's width for an env spec's action space: its actions, or its action vector's size."""
    return spec.action_space.n if spec.discrete else spec.action_space.shape[0]


def policy(discrete: bool, head: jnp.ndarray | tuple[jnp.ndarray, jnp.ndarray]) -> distrax.Distribution:
    """The action distribution of a network head: Categorical(logits) or diagonal Gaussian(mean, log_std)."""
    if discrete:
        return distrax.Categorical(logits=head)
    mean, log_std = head
    return distrax.MultivariateNormalDiag(mean, jnp.exp(log_std))


def flatten(x: jnp.ndarray, ndim: int) -> jnp.ndarray:
    """A batch of ``ndim``-dimensional observations as float32 vectors."""
    return x.astype(jnp.float32).reshape(x.shape[: x.ndim - ndim] + (-1,))


class ActorCritic(nn.Module):
    """Separate actor and critic MLPs. Returns ``(head, value)`` where ``head`` parameterizes the policy
    (see :func:`policy`): logits, or a Gaussian mean with a learned state-independent log std."""

    action_dim: int
    discrete: bool
    obs_ndim: int
    hidden: Sequence[int] = (64, 64)
    activation: str = "tanh"

    def inputs(self, obs) -> tuple[jnp.ndarray, jnp.ndarray]:
        """What the actor and the critic see of a batch of observations: both see all of it, flattened."""
        x = flatten(obs, self.obs_ndim)
        return x, x

    @nn.compact
    def __call__(self, obs: jnp.ndarray):
        act = {"tanh": nn.tanh, "relu": nn.relu}[self.activation]
        a, c = self.inputs(obs)
        for h in self.hidden:
            a = act(_dense(h, np.sqrt(2))(a))
        head = _dense(self.action_dim, 0.01)(a)
        if not self.discrete:
            log_std = self.param("log_std", nn.initializers.zeros, (self.action_dim,))
            head = (head, jnp.broadcast_to(log_std, head.shape))
        for h in self.hidden:
            c = act(_dense(h, np.sqrt(2))(c))
        value = _dense(1, 1.0)(c).squeeze(-1)
        return head, value
