"""SAC written once against the msrl API; the distribution policy decides how it runs.

The loop steps the environments, inserts every transition (with the true final observation of a truncated
episode, and ``terminated`` alone cutting the bootstrap) into a replay buffer, then makes a few updates.
The learner has three optimizers (critic, actor, temperature); each is built with :meth:`msrl.Learner.chain`,
so a policy's gradient transforms (multi_learner's all-reduce) apply to every part.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Literal, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from pydantic import Field

import msrl
from msrl.rl import (Dense, NormalizedActor, TwinQ, action_dim, flat, flatten, mlp, normalization_state, normalize,
                     scale_reward, several_updates, squash_of, update_stats, with_obs_stats)

LOG_STD_MIN, LOG_STD_MAX = -5.0, 2.0


class OffPolicyConfig(msrl.AlgorithmConfig):
    """The keys SAC and TD3 share."""

    rollout_len: int = Field(1, gt=0, le=msrl.INT32_MAX, description="environment steps per iteration, per env")
    updates: int = Field(1, gt=0, le=msrl.INT32_MAX, description="gradient updates per iteration")
    batch_size: int = Field(256, gt=0, le=msrl.INT32_MAX, description="transitions per update")
    buffer_size: int = Field(100_000, gt=0, le=msrl.INT32_MAX, description="replay capacity, in transitions (per "
                             "learner under multi_learner; split over replay_server's shards)")
    learning_starts: int = Field(1_000, ge=0, le=msrl.INT32_MAX, description="transitions (all envs; a learner's "
                                 "share under multi_learner) of uniformly random actions; updates start once a "
                                 "learner's buffer holds this many")
    actor_lr: float = Field(3e-4, gt=0, description="the actor's Adam learning rate")
    critic_lr: float = Field(1e-3, gt=0, description="the critics' Adam learning rate")
    gamma: float = Field(0.99, gt=0, le=1, description="discount factor")
    tau: float = Field(0.005, gt=0, le=1, description="target <- tau * online + (1 - tau) * target, every update")
    hidden: list[Annotated[int, Field(gt=0)]] = Field(default_factory=lambda: [256, 256], min_length=1,
                                                      description="widths of the hidden layers")
    normalize_obs: bool = Field(False, description="act and learn on observations standardized by running "
                                "statistics of the observations the learner samples")
    normalize_reward: bool = Field(False, description="divide rewards by the running std of the rewards the "
                                   "learner samples")


class SACConfig(OffPolicyConfig):
    """SAC's keys: the off-policy ones and the temperature's (`msrl config algorithm.name=sac`)."""

    name: Literal["sac"] = "sac"
    alpha_lr: float = Field(3e-4, gt=0, description="the temperature's Adam learning rate (alpha learned when alpha "
                            "is null)")
    alpha: float | None = Field(None, gt=0, description="a fixed entropy temperature (null: learned)")
    target_entropy: float | None = Field(None, description="the entropy the learned temperature aims for (null: "
                                         "minus the action size)")

    def inert(self) -> dict[str, str]:
        learned = "a learned temperature (algorithm.alpha=null)"
        return {} if self.alpha is None else {"alpha_lr": learned, "target_entropy": learned}


class Transition(NamedTuple):
    obs: jax.Array
    action: jax.Array
    reward: jax.Array
    terminated: jax.Array  # a terminal state: no bootstrap (a truncated episode is bootstrapped)
    next_obs: jax.Array  # the observation after the action (the final one where the episode ended)


class TanhGaussian(nn.Module):
    """The policy: a Gaussian in an unbounded space squashed by tanh into the action box."""

    action_dim: int
    obs_ndim: int
    hidden: Sequence[int]

    @nn.compact
    def __call__(self, obs):
        x = mlp(flatten(obs, self.obs_ndim), self.hidden)
        mean = Dense(self.action_dim)(x)
        log_std = jnp.tanh(Dense(self.action_dim)(x))
        return mean, LOG_STD_MIN + 0.5 * (LOG_STD_MAX - LOG_STD_MIN) * (log_std + 1)


class Squash(NamedTuple):
    """Maps tanh's (-1, 1) onto the action box."""

    scale: jax.Array
    center: jax.Array

    def sample(self, net: TanhGaussian, params, obs, key):
        """An action for every observation (one key for the batch) and its log-probability."""
        mean, log_std = net.apply(params, obs)
        u = mean + jnp.exp(log_std) * jax.random.normal(key, mean.shape)
        return self.squashed(mean, log_std, u)

    def squashed(self, mean, log_std, u):
        action = jnp.tanh(u)
        gauss = -0.5 * (((u - mean) / jnp.exp(log_std)) ** 2 + 2 * log_std + jnp.log(2 * jnp.pi))
        # log |d tanh(u) / du| = 2 (log 2 - u - softplus(-2u)), stable for large |u|
        log_det = 2 * (jnp.log(2.0) - u - jax.nn.softplus(-2 * u)) + jnp.log(self.scale)
        return action * self.scale + self.center, jnp.sum(gauss - log_det, axis=-1)


class SACActor(msrl.Actor):
    """Uniformly random actions for the first ``learning_starts`` transitions, then the policy's samples (one
    key per environment)."""

    def __init__(self, net: TanhGaussian, squash: Squash, space: msrl.Box, random_steps: int):
        self.net, self.squash, self.space, self.random_steps = net, squash, space, random_steps

    def init(self, key, env_ids):
        return {**super().init(key, env_ids), "calls": jnp.zeros((), jnp.int32)}

    def act(self, state, params, obs):
        keys, use = msrl.split_keys(state["keys"])
        mean, log_std = self.net.apply(params, obs)
        noise = jax.vmap(lambda k: jax.random.normal(k, mean.shape[1:]))(use)
        action, _ = self.squash.squashed(mean, log_std, mean + jnp.exp(log_std) * noise)
        uniform = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, 1), mean.shape[1:],
                                                        minval=self.space.low, maxval=self.space.high))(use)
        explore = state["calls"] < self.random_steps
        return {**state, "keys": keys, "calls": state["calls"] + 1}, msrl.ActOutput(jnp.where(explore, uniform, action))

    def greedy(self, params, obs):
        mean, _ = self.net.apply(params, obs)
        return jnp.tanh(mean) * self.squash.scale + self.squash.center


class OffPolicyLearner(msrl.Learner):
    """What SAC's and TD3's learners share: parameter parts (``params[name]``) with an optimizer each (``txs``,
    each built with :meth:`chain`), the ``actor`` part as the policy, and ``updates`` updates per ``learn``."""

    txs: dict[str, optax.GradientTransformation]

    def policy_params(self, state):
        return with_obs_stats(state["params"]["actor"], state.get("obs_rms"))

    def normalization_state(self) -> dict:
        return normalization_state(self.obs, self.cfg.normalize_obs, self.cfg.normalize_reward)

    def learn(self, state, sample: msrl.Sample):
        """``updates`` updates, each on its slice of ``sample``; their metrics averaged. With normalization the
        sample is normalized by the statistics the actors acted with, which then take in the sample."""
        cfg, t, stats = self.cfg, sample.item, {}
        if cfg.normalize_obs:
            stats["obs_rms"] = update_stats(state["obs_rms"], t.obs, self.mean_over_replicas)
            t = t._replace(obs=normalize(state["obs_rms"], t.obs), next_obs=normalize(state["obs_rms"], t.next_obs))
        if cfg.normalize_reward:
            stats["reward_rms"] = update_stats(state["reward_rms"], t.reward, self.mean_over_replicas)
            t = t._replace(reward=scale_reward(state["reward_rms"], t.reward))
        rest = {k: v for k, v in state.items() if k not in stats}
        rest, metrics = several_updates(self.update, rest, sample._replace(item=t), cfg.updates)
        return {**rest, **stats}, metrics

    def step_part(self, name, loss, state, params, *args):
        """One step of ``name``'s optimizer on ``loss(params[name], *args) -> (loss, aux)``: ``params`` with
        that part updated, the part's new optimizer state, and the aux."""
        grads, aux = jax.grad(loss, has_aux=True)(params[name], *args)
        updates, opt = self.txs[name].update(grads, state["opt_state"][name], params[name])
        return {**params, name: optax.apply_updates(params[name], updates)}, opt, aux

    def update(self, state, sample: msrl.Sample):
        raise NotImplementedError


class SACLearner(OffPolicyLearner):
    def __init__(self, actor: TanhGaussian, critic: TwinQ, squash: Squash, cfg: SACConfig, example_obs,
                 example_action):
        self.actor, self.critic, self.squash, self.cfg = actor, critic, squash, cfg
        self.obs, self.action = example_obs, example_action

    # three optimizers, each after the policy's gradient transforms
    @property
    def txs(self) -> dict[str, optax.GradientTransformation]:
        cfg = self.cfg
        return {"actor": self.chain(flat(optax.adam(cfg.actor_lr))),
                "critic": self.chain(flat(optax.adam(cfg.critic_lr))),
                "alpha": self.chain(optax.adam(cfg.alpha_lr))}

    def init(self, key):
        k_actor, k_critic, key = jax.random.split(key, 3)
        params = {"actor": self.actor.init(k_actor, self.obs),
                  "critic": self.critic.init(k_critic, self.obs, self.action),
                  "alpha": jnp.zeros((), jnp.float32)}  # log alpha
        return {"params": params, "target": params["critic"], "key": key,
                "opt_state": {k: tx.init(params[k]) for k, tx in self.txs.items()}, **self.normalization_state()}


    def target(self, actor, target, alpha, t: Transition, key):
        """The critics' regression target: the reward, plus (unless the episode terminated) the discounted soft
        value of the next observation, a truncated episode's final one included."""
        next_action, next_logp = self.squash.sample(self.actor, actor, t.next_obs, key)
        q1, q2 = self.critic.apply(target, t.next_obs, next_action)
        soft = jnp.minimum(q1, q2) - alpha * next_logp
        return t.reward + self.cfg.gamma * (1.0 - t.terminated.astype(jnp.float32)) * soft

    def _critic_loss(self, critic, actor, target, alpha, t: Transition, key):
        y = jax.lax.stop_gradient(self.target(actor, target, alpha, t, key))
        q1, q2 = self.critic.apply(critic, t.obs, t.action)
        loss = jnp.mean((q1 - y) ** 2) + jnp.mean((q2 - y) ** 2)
        return loss, {"critic_loss": loss, "q": jnp.mean(q1)}

    def _actor_loss(self, actor, critic, alpha, obs, key):
        action, logp = self.squash.sample(self.actor, actor, obs, key)
        q1, q2 = self.critic.apply(critic, obs, action)
        loss = jnp.mean(alpha * logp - jnp.minimum(q1, q2))
        return loss, {"actor_loss": loss, "entropy": -jnp.mean(logp)}

    def _alpha_loss(self, log_alpha, entropy):
        target = -float(self.action.size) if self.cfg.target_entropy is None else self.cfg.target_entropy  # -dims
        return -log_alpha * (target - entropy), {}

    def update(self, state, sample: msrl.Sample):
        """One update once the buffer holds learning_starts transitions: the critic, then the actor on the
        new critic, then the temperature; the target critic follows by Polyak averaging."""
        cfg, t, params = self.cfg, sample.item, state["params"]
        key, k_critic, k_actor = jax.random.split(state["key"], 3)
        alpha = jnp.float32(cfg.alpha) if cfg.alpha is not None else jnp.exp(params["alpha"])
        params, opt_c, m_c = self.step_part("critic", self._critic_loss, state, params, params["actor"], state["target"],
                                        alpha, t, k_critic)
        params, opt_a, m_a = self.step_part("actor", self._actor_loss, state, params, params["critic"], alpha, t.obs,
                                        k_actor)
        opt = {**state["opt_state"], "critic": opt_c, "actor": opt_a}
        if cfg.alpha is None:
            params, opt["alpha"], _ = self.step_part("alpha", self._alpha_loss, state, params, m_a["entropy"])
        new = {"params": params, "target": optax.incremental_update(params["critic"], state["target"], cfg.tau),
               "key": key, "opt_state": opt}
        ready = sample.size >= max(cfg.learning_starts, 1)
        new = jax.tree.map(lambda a, b: jnp.where(ready, a, b), new, {**state, "key": key})
        return new, {**m_c, **m_a, "alpha": alpha, "learning": ready.astype(jnp.float32)}


class ContinuousOffPolicy(msrl.Algorithm):
    """What SAC and TD3 share: their checks of the env and config, the replay buffer, and the loop."""

    default_env = "gymnax:Pendulum-v1"

    def __init__(self, cfg, ctx: msrl.Context):
        super().__init__(cfg, ctx)
        spec, name = ctx.env_spec, cfg.name.upper()
        if isinstance(spec, msrl.MultiAgentSpec) or spec.discrete:
            has = "several agents" if isinstance(spec, msrl.MultiAgentSpec) else "discrete actions"
            raise msrl.ConfigError("algorithm.name", f"{name} needs one agent with continuous (Box) actions; {spec.id} "
                                   f"has {has} (e.g. env.id=gymnax:Pendulum-v1, as in examples/"
                                   f"{'td3' if cfg.name == 'td3' else 'sac'}_pendulum.yaml)", also=("env.id",))
        space = spec.action_space
        if not (np.isfinite(space.low).all() and np.isfinite(space.high).all()):
            raise msrl.ConfigError("env.id", f"{spec.id}'s actions are unbounded (low {space.low}, high {space.high}); "
                                   f"{name} squashes its actions into finite bounds: give the env's action space "
                                   "finite bounds (gymnasium's RescaleAction wrapper, say), or use ppo")
        if cfg.buffer_size // ctx.num_envs < max(cfg.rollout_len, 2):
            raise msrl.ConfigError("algorithm.buffer_size", f"{cfg.buffer_size} transitions are "
                                   f"{cfg.buffer_size // ctx.num_envs} steps of {ctx.num_envs} envs; it must hold "
                                   f"{max(cfg.rollout_len, 2)} steps (rollout_len, and at least 2)")
        # acting steps of uniformly random actions: until a learner's buffer holds learning_starts (multi_learner's
        # learners each hold their share of the envs; counted over them all, the rest acted with untrained policies)
        self.random_steps = -(-cfg.learning_starts // ctx.learner_envs)
        self.buffer = msrl.UniformBuffer(cfg.buffer_size)
        ctx.check_learning_starts(cfg.learning_starts, self.buffer, cfg.rollout_len, cfg.batch_size)

    def normalized(self, actor: msrl.Actor) -> msrl.Actor:
        """``actor``, acting on normalized observations where ``normalize_obs`` says so."""
        return NormalizedActor(actor) if self.cfg.normalize_obs else actor

    def train_step(self):
        obs = msrl.env_observe()
        for _ in range(self.cfg.rollout_len):
            out = msrl.agent_act(obs)
            step = msrl.env_step(out.action)
            msrl.buffer_insert(Transition(obs, out.action, step.reward, step.terminated, step.final_obs))
            obs = step.obs
        # every update's batch in one sample: the learner makes the updates in turn and averages their metrics
        return msrl.agent_learn(msrl.buffer_sample(self.cfg.batch_size * self.cfg.updates))


class SAC(ContinuousOffPolicy):
    """Soft actor-critic for Box actions: a tanh-squashed Gaussian actor, twin critics with Polyak targets
    and a learned temperature; ``updates`` replayed minibatch steps per iteration."""

    Config = SACConfig

    def __init__(self, cfg: SACConfig, ctx: msrl.Context):
        super().__init__(cfg, ctx)
        spec = ctx.env_spec
        space, hidden, dim = spec.action_space, tuple(cfg.hidden), action_dim(spec)
        if not (space.high > space.low).all():
            raise msrl.ConfigError("env.id", f"{spec.id}'s action bounds leave no room in dimension(s) "
                                   f"{np.flatnonzero(space.high <= space.low).tolist()} (low {space.low}, high "
                                   f"{space.high}); SAC's squashed Gaussian needs low < high in every dimension (its "
                                   "log-probability divides by high - low): drop the fixed dimensions from the env's "
                                   "action space, or use td3")
        squash = Squash(*squash_of(space))
        actor = TanhGaussian(dim, len(spec.obs_shape), hidden)
        critic = TwinQ(len(spec.obs_shape), hidden)
        self.actor = self.normalized(SACActor(actor, squash, space, self.random_steps))
        self.learner = SACLearner(actor, critic, squash, cfg, spec.example_obs(), jnp.zeros(space.shape, jnp.float32))
