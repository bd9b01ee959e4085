"""PPO written once against the msrl API; the distribution policy decides how it runs."""

from __future__ import annotations

from typing import Annotated, Literal, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from pydantic import Field

import msrl
from msrl.rl import (ActorCritic, ActorCriticActor, NatureCNN, NormalizedActor, action_dim, bootstrap_truncated_field,
                     discounted_returns, flat, gae, minibatch_epochs, normalization_state, normalize, per_env_carry,
                     policy, scale_reward, truncation, update_stats, with_obs_stats)


class PPOConfig(msrl.AlgorithmConfig):
    """PPO's keys (`msrl config algorithm.name=ppo` lists each with its meaning, bounds and default)."""

    name: Literal["ppo"] = "ppo"
    rollout_len: int = Field(128, gt=0, le=msrl.INT32_MAX, description="environment steps per iteration, per env")
    epochs: int = Field(4, gt=0, le=msrl.INT32_MAX, description="passes over each iteration's rollout")
    minibatches: int = Field(4, gt=0, le=msrl.INT32_MAX, description="minibatches per pass (each a shuffled share of "
                             "the rollout)")
    lr: float = Field(2.5e-4, gt=0, description="Adam's learning rate")
    anneal_lr: bool = Field(True, description="decay the learning rate linearly to 0 over the run")
    gamma: float = Field(0.99, gt=0, le=1, description="discount factor")
    gae_lambda: float = Field(0.95, ge=0, le=1, description="GAE's lambda")
    clip_eps: float = Field(0.2, gt=0, description="the probability ratio is clipped to 1 ± this, the value's change "
                            "from the rollout's to ± this")
    ent_coef: float = Field(0.01, ge=0, description="weight of the entropy bonus in the loss")
    vf_coef: float = Field(0.5, ge=0, description="weight of the value loss in the loss")
    max_grad_norm: float = Field(0.5, gt=0, description="gradients are clipped to this global norm")
    hidden: list[Annotated[int, Field(gt=0)]] = Field(default_factory=lambda: [64, 64], min_length=1,
                                                      description="widths of the hidden layers")
    activation: Literal["tanh", "relu"] = Field("tanh", description="the hidden layers' activation")
    network: Literal["mlp", "nature_cnn"] = Field("mlp", description="mlp: actor and critic MLPs of `hidden`; "
                                                  "nature_cnn: DQN-Nature convolutions shared by both heads, "
                                                  "for frame stacks [C, H, W] such as envpool:Breakout-v5's")
    normalize_obs: bool = Field(False, description="act and learn on observations standardized by running "
                                "statistics of every observation the learner has seen")
    normalize_reward: bool = Field(False, description="divide rewards by the running std of each env's "
                                   "discounted return")
    bootstrap_truncated: bool = bootstrap_truncated_field()

    def inert(self) -> dict[str, str]:
        return {} if self.network == "mlp" else dict.fromkeys(("hidden", "activation"), "algorithm.network=mlp")


class Transition(NamedTuple):
    obs: jax.Array
    action: jax.Array
    reward: jax.Array
    done: jax.Array
    log_prob: jax.Array
    value: jax.Array
    truncated: jax.Array | None = None  # with bootstrap_truncated: the episode was cut short here,
    final_obs: jax.Array | None = None  # and the observation it reached


class PPOLearner(msrl.Learner):
    def __init__(self, net: nn.Module, cfg: PPOConfig, example_obs, num_updates: int, num_envs: int):
        self.net, self.cfg, self.num_updates, self.num_envs = net, cfg, num_updates, num_envs  # envs it sees
        self.obs = example_obs  # one environment's observation, to initialize the network with

    def optimizer(self):
        cfg, steps_per_update = self.cfg, self.cfg.epochs * self.cfg.minibatches

        def annealed(count):  # linearly to 0 at the run's last update, and 0 after it (a Session run past the total)
            return cfg.lr * jnp.maximum(1.0 - (count // steps_per_update) / float(self.num_updates), 0.0)

        lr = annealed if cfg.anneal_lr else cfg.lr
        return flat(optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm), optax.adam(lr, eps=1e-5)))

    def init(self, key):
        init_key, key = jax.random.split(key)
        params = self.net.init(init_key, self.obs)
        return {"params": params, "opt_state": self.tx.init(params), "key": key,
                **normalization_state(self.obs, self.cfg.normalize_obs, self.cfg.normalize_reward, self.num_envs)}

    def policy_params(self, state):
        return with_obs_stats(state["params"], state.get("obs_rms"))

    def _gae(self, batch: Transition, last_value):
        return gae(batch.reward, batch.done, batch.value, last_value, self.cfg.gamma, self.cfg.gae_lambda)

    def _forward(self, params, t: Transition):
        """The policy head and value of a minibatch's observations."""
        return self.net.apply(params, t.obs)

    def _loss(self, params, mb):
        cfg = self.cfg
        t, adv, target = mb
        head, value = self._forward(params, t)
        pi = policy(self.net.discrete, head)
        log_prob = pi.log_prob(t.action)
        ratio = jnp.exp(log_prob - t.log_prob)
        adv = (adv - adv.mean()) / (adv.std() + 1e-8)
        adv = adv.reshape(adv.shape + (1,) * (log_prob.ndim - adv.ndim))  # one per agent, if several act
        policy_loss = -jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - cfg.clip_eps, 1 + cfg.clip_eps) * adv).mean()
        v_clipped = t.value + jnp.clip(value - t.value, -cfg.clip_eps, cfg.clip_eps)
        value_loss = 0.5 * jnp.maximum((value - target) ** 2, (v_clipped - target) ** 2).mean()
        entropy = pi.entropy().mean()
        total = policy_loss + cfg.vf_coef * value_loss - cfg.ent_coef * entropy
        return total, {"loss": total, "policy_loss": policy_loss, "value_loss": value_loss, "entropy": entropy}

    def learn(self, state, batch: Transition, last_obs):
        cfg, stats = self.cfg, {}
        if cfg.normalize_obs:  # the statistics the actors acted with; then this batch joins them
            stats["obs_rms"] = update_stats(state["obs_rms"], batch.obs, self.mean_over_replicas)
            batch = batch._replace(obs=normalize(state["obs_rms"], batch.obs),
                                   final_obs=None if batch.final_obs is None else normalize(state["obs_rms"],
                                                                                            batch.final_obs))
            last_obs = normalize(state["obs_rms"], last_obs)
        if cfg.normalize_reward:  # each env's discounted return runs on from the last batch
            ret = per_env_carry(state["ret"], batch.reward.shape[1])
            returns, ret = discounted_returns(ret, batch.reward, batch.done, cfg.gamma)
            stats["ret"] = per_env_carry(ret, state["ret"].shape[0])
            stats["reward_rms"] = update_stats(state["reward_rms"], returns, self.mean_over_replicas)
            batch = batch._replace(reward=scale_reward(stats["reward_rms"], batch.reward))
        if cfg.bootstrap_truncated:  # a cut-short return goes on past its end: reward + gamma * V(final obs)
            _, final_value = self.net.apply(state["params"], batch.final_obs)
            batch = batch._replace(reward=batch.reward + cfg.gamma * batch.truncated * final_value, truncated=None,
                                   final_obs=None)  # the minibatches need neither
        _, last_value = self.net.apply(state["params"], last_obs)
        adv, targets = self._gae(batch, last_value)
        data = jax.tree.map(lambda x: x.reshape((-1, *x.shape[2:])), (batch, adv, targets))
        new, metrics = minibatch_epochs(self.tx, self._loss, state, data, cfg.epochs, cfg.minibatches)
        return {**state, **new, **stats}, metrics


class PPO(msrl.Algorithm):
    """Proximal policy optimization (clipped objective, GAE): ``rollout_len`` steps of every env, then
    ``epochs`` passes over ``minibatches`` shuffled minibatches; discrete or Box actions."""

    Config = PPOConfig

    def __init__(self, cfg: PPOConfig, ctx: msrl.Context):
        super().__init__(cfg, ctx)
        batch = ctx.num_envs * cfg.rollout_len
        if batch > msrl.INT32_MAX:  # minibatches are drawn by an int32 permutation of the batch
            raise msrl.ConfigError("algorithm.rollout_len", f"the batch of {ctx.num_envs} envs x {cfg.rollout_len} "
                                   f"steps = {batch} is more than {msrl.INT32_MAX}")
        if cfg.anneal_lr and cfg.epochs * cfg.minibatches > msrl.INT32_MAX:  # the optimizer counts steps in int32
            raise msrl.ConfigError("algorithm.epochs", f"{cfg.epochs} epochs x {cfg.minibatches} minibatches is more "
                                   f"than {msrl.INT32_MAX} optimizer steps per update")
        if cfg.anneal_lr:  # ... and in the whole run
            ctx.per_run(batch, cfg.epochs * cfg.minibatches)
        own = ctx.learner_envs * cfg.rollout_len  # the batch each learner splits (multi_learner: its share)
        if own % cfg.minibatches:
            raise msrl.ConfigError("algorithm.minibatches", f"{cfg.minibatches} does not divide the batch of "
                                   f"{ctx.learner_envs} envs x {cfg.rollout_len} steps = {own}"
                                   + (" a learner sees" if ctx.learner_envs < ctx.num_envs else ""))
        net = self.network(ctx.env_spec)
        self.actor = NormalizedActor(ActorCriticActor(net)) if cfg.normalize_obs else ActorCriticActor(net)
        self.learner = PPOLearner(net, cfg, ctx.env_spec.example_obs(), max(1, ctx.total_env_steps // batch),
                                  ctx.learner_envs)
        self.buffer = msrl.TrajectoryBuffer(cfg.rollout_len)

    def network(self, spec: msrl.EnvSpec) -> nn.Module:
        """The actor-critic: ``net.apply(params, obs) -> (policy head, value)`` for a batch of observations."""
        if isinstance(spec, msrl.MultiAgentSpec):
            raise msrl.ConfigError("algorithm.name", f"{spec.id} has {spec.num_agents} agents; PPO acts for one "
                                   "(use algorithm.name=mappo)", also=("env.id",))
        if self.cfg.network == "nature_cnn":
            shape = list(spec.obs_shape)
            if len(shape) != 3 or min(shape[1:]) < 36:
                last = len(shape) == 3 and shape[2] <= 4 and min(shape[:2]) >= 36  # [H, W, C]: Gymnasium's images
                raise msrl.ConfigError("algorithm.network", f"nature_cnn convolves frame stacks [C, H, W] of at least "
                                       f"36 x 36 pixels; {spec.id}'s observations are {shape}" + (
                                           ", images with their channels last: make the env give them channels "
                                           "first (np.transpose(obs, (2, 0, 1)), e.g. in a gymnasium "
                                           "ObservationWrapper of your env)" if last else ""))
            if self.cfg.normalize_obs:
                raise msrl.ConfigError("algorithm.normalize_obs", "nature_cnn scales its frames to [0, 1] itself; "
                                       "standardizing pixels by running statistics is not offered")
            return NatureCNN(action_dim=action_dim(spec), discrete=spec.discrete)
        return ActorCritic(action_dim=action_dim(spec), discrete=spec.discrete, obs_ndim=len(spec.obs_shape),
                           hidden=tuple(self.cfg.hidden), activation=self.cfg.activation)

    def train_step(self):
        obs = msrl.env_observe()
        for _ in range(self.cfg.rollout_len):
            out = msrl.agent_act(obs)
            step = msrl.env_step(out.action)
            msrl.buffer_insert(Transition(obs, out.action, step.reward, step.done, out.log_prob, out.value,
                                          **truncation(step, self.cfg.bootstrap_truncated)))
            obs = step.obs
        return msrl.agent_learn(msrl.buffer_get(), last_obs=obs)
