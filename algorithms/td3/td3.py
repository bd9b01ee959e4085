"""TD3 written once against the msrl API; the distribution policy decides how it runs.

The loop is SAC's (``msrl.algorithms.sac.sac.ContinuousOffPolicy``): transitions with the final observation of a
truncated episode into a replay buffer, then a few updates. The learner's two optimizers (critic, actor) are built with
:meth:`msrl.Learner.chain`, so a policy's gradient transforms apply to both.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from pydantic import Field

import msrl
from msrl.algorithms.sac.sac import ContinuousOffPolicy, OffPolicyConfig, OffPolicyLearner, Transition
from msrl.rl import Dense, TwinQ, action_dim, flat, flatten, mlp, squash_of


class TD3Config(OffPolicyConfig):
    """TD3's keys: the off-policy ones and the target smoothing's (`msrl config algorithm.name=td3`)."""

    name: Literal["td3"] = "td3"
    critic_lr: float = Field(3e-4, gt=0, description="the critics' Adam learning rate")
    tau: float = Field(0.005, gt=0, le=1, description="target <- tau * online + (1 - tau) * target, every "
                       "policy_delay-th update")
    policy_delay: int = Field(2, gt=0, le=msrl.INT32_MAX, description="critic updates per actor (and target) update")
    exploration_noise: float = Field(0.1, ge=0, description="std of the acting noise, in half-ranges of the actions")
    policy_noise: float = Field(0.2, ge=0, description="std of the target policy's smoothing noise (half-ranges)")
    noise_clip: float = Field(0.5, ge=0, description="the smoothing noise is clipped to ± this (half-ranges)")


class Deterministic(nn.Module):
    """The policy: an action in tanh's (-1, 1) per dimension, before scaling onto the action box."""

    action_dim: int
    obs_ndim: int
    hidden: Sequence[int]

    @nn.compact
    def __call__(self, obs):
        return jnp.tanh(Dense(self.action_dim)(mlp(flatten(obs, self.obs_ndim), self.hidden)))


class TD3Actor(msrl.Actor):
    """Uniformly random actions for the first ``learning_starts`` transitions, then the policy's action plus
    Gaussian noise (one key per environment), clipped to the action box."""

    def __init__(self, net: Deterministic, space: msrl.Box, cfg: TD3Config, random_steps: int):
        self.net, self.space, self.cfg, self.random_steps = net, space, cfg, random_steps
        self.scale, self.center = squash_of(space)

    def init(self, key, env_ids):
        return {**super().init(key, env_ids), "calls": jnp.zeros((), jnp.int32)}

    def act(self, state, params, obs):
        keys, use = msrl.split_keys(state["keys"])
        shape = self.space.shape
        # one product scales the noise: (n * 0.1) * scale rounded differently inside fused's program than alone
        noise = jax.vmap(lambda k: jax.random.normal(k, shape))(use) * (self.cfg.exploration_noise * self.scale)
        action = jnp.clip(self.greedy(params, obs) + noise, self.space.low, self.space.high)
        uniform = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, 1), shape, minval=self.space.low,
                                                        maxval=self.space.high))(use)
        explore = state["calls"] < self.random_steps
        return {**state, "keys": keys, "calls": state["calls"] + 1}, msrl.ActOutput(jnp.where(explore, uniform, action))

    def greedy(self, params, obs):
        return self.net.apply(params, obs) * self.scale + self.center


class TD3Learner(OffPolicyLearner):
    def __init__(self, actor: Deterministic, critic: TwinQ, cfg: TD3Config, space: msrl.Box, example_obs):
        self.actor, self.critic, self.cfg, self.space, self.obs = actor, critic, cfg, space, example_obs
        self.scale, self.center = squash_of(space)

    @property
    def txs(self) -> dict[str, optax.GradientTransformation]:
        return {"actor": self.chain(flat(optax.adam(self.cfg.actor_lr))),
                "critic": self.chain(flat(optax.adam(self.cfg.critic_lr)))}

    def init(self, key):
        k_actor, k_critic, key = jax.random.split(key, 3)
        params = {"actor": self.actor.init(k_actor, self.obs),
                  "critic": self.critic.init(k_critic, self.obs, jnp.zeros(self.space.shape, jnp.float32))}
        return {"params": params, "target": params, "key": key, "updates": jnp.zeros((), jnp.int32),
                "opt_state": {k: tx.init(params[k]) for k, tx in self.txs.items()}, **self.normalization_state()}

    def target(self, target, t: Transition, key):
        """The reward plus (unless terminated) the discounted smaller target Q of the next observation, at the
        target policy's action with clipped noise."""
        cfg = self.cfg
        noise = jnp.clip(jax.random.normal(key, t.action.shape) * cfg.policy_noise, -cfg.noise_clip, cfg.noise_clip)
        smoothed = jnp.clip(self.actor.apply(target["actor"], t.next_obs) + noise, -1.0, 1.0)
        q1, q2 = self.critic.apply(target["critic"], t.next_obs, smoothed * self.scale + self.center)
        return t.reward + cfg.gamma * (1.0 - t.terminated.astype(jnp.float32)) * jnp.minimum(q1, q2)

    def _critic_loss(self, critic, y, t: Transition):
        q1, q2 = self.critic.apply(critic, t.obs, t.action)
        loss = jnp.mean((q1 - y) ** 2) + jnp.mean((q2 - y) ** 2)
        return loss, {"critic_loss": loss, "q": jnp.mean(q1)}

    def _actor_loss(self, actor, critic, obs):
        q1, _ = self.critic.apply(critic, obs, self.actor.apply(actor, obs) * self.scale + self.center)
        return -jnp.mean(q1), {"actor_loss": -jnp.mean(q1)}

    def update(self, state, sample: msrl.Sample):
        """A critic update once the buffer holds learning_starts transitions; every policy_delay-th one also
        updates the actor (on the new critic) and moves the targets."""
        cfg, t, params = self.cfg, sample.item, state["params"]
        key, k_target = jax.random.split(state["key"])
        y = jax.lax.stop_gradient(self.target(state["target"], t, k_target))
        params_new, opt_c, m_c = self.step_part("critic", self._critic_loss, state, params, y, t)
        params_new, opt_a, m_a = self.step_part("actor", self._actor_loss, state, params_new, params_new["critic"],
                                                t.obs)
        count = state["updates"] + 1
        delayed = count % cfg.policy_delay == 0
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(delayed, a, b), new, old)  # noqa: E731
        params_new["actor"] = keep(params_new["actor"], params["actor"])
        new = {"params": params_new, "key": key, "updates": count,
               "target": keep(optax.incremental_update(params_new, state["target"], cfg.tau), state["target"]),
               "opt_state": {"critic": opt_c, "actor": keep(opt_a, state["opt_state"]["actor"])}}
        ready = sample.size >= max(cfg.learning_starts, 1)
        new = jax.tree.map(lambda a, b: jnp.where(ready, a, b), new, {**state, "key": key})
        return new, {**m_c, **m_a, "learning": ready.astype(jnp.float32)}


class TD3(ContinuousOffPolicy):
    """Twin delayed DDPG for Box actions: a deterministic actor with Gaussian exploration, twin critics,
    target policy smoothing and delayed actor updates."""

    Config = TD3Config

    def __init__(self, cfg: TD3Config, ctx: msrl.Context):
        super().__init__(cfg, ctx)
        spec = ctx.env_spec
        space, hidden = spec.action_space, tuple(cfg.hidden)
        actor = Deterministic(action_dim(spec), len(spec.obs_shape), hidden)
        self.actor = self.normalized(TD3Actor(actor, space, cfg, self.random_steps))
        self.learner = TD3Learner(actor, TwinQ(len(spec.obs_shape), hidden), cfg, space, spec.example_obs())
