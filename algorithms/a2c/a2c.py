"""A2C (synchronous n-step advantage actor-critic) written once against the msrl API.

Every iteration each environment takes ``rollout_len`` steps; the learner then makes ONE gradient step on
the whole rollout: the policy gradient weighted by n-step advantages (GAE with ``gae_lambda``; 1.0 gives
plain n-step returns bootstrapped from the value of the last observation), a value regression toward those
returns, and an entropy bonus. Values and log-probabilities are recomputed from the learner's current
parameters, so a gradient is always that of the parameters it is applied to.

Under ``fused`` or ``single_learner_coarse`` this is synchronous A2C; under a gradient-parallel policy
(``async``: actor-learners sending gradients to one parameter holder) the same file is A3C.
"""

from __future__ import annotations

from typing import Annotated, Literal, NamedTuple

import flax.linen as nn
import jax
import optax
from pydantic import Field

import msrl
from msrl.rl import ActorCritic, ActorCriticActor, action_dim, bootstrap_truncated_field, flat, gae, policy, truncation


class A2CConfig(msrl.AlgorithmConfig):
    """A2C's keys (`msrl config algorithm.name=a2c` lists each with its meaning, bounds and default)."""

    name: Literal["a2c"] = "a2c"
    rollout_len: int = Field(5, gt=0, le=msrl.INT32_MAX, description="environment steps per iteration, per env (the n "
                             "of n-step returns)")
    gamma: float = Field(0.99, gt=0, le=1, description="discount factor")
    gae_lambda: float = Field(1.0, ge=0, le=1, description="1.0: plain n-step returns; < 1: GAE(lambda)")
    lr: float = Field(7e-4, gt=0, description="the optimizer's learning rate")
    anneal_lr: bool = Field(False, description="decay the learning rate linearly to 0 over the run")
    optimizer: Literal["adam", "rmsprop"] = Field("adam", description="adam, or rmsprop (A3C's and IMPALA's papers)")
    rms_decay: float = Field(0.99, gt=0, lt=1, description="rmsprop's squared-gradient decay")
    opt_eps: float = Field(1e-5, gt=0, description="adam's epsilon (g / (sqrt(v) + eps)); rmsprop's "
                          "(g / sqrt(v + eps), inside the root as in TensorFlow, not outside as in PyTorch)")
    normalize_advantage: bool = Field(False, description="standardize the advantages of each batch")
    ent_coef: float = Field(0.0, ge=0, description="weight of the entropy bonus in the loss")
    vf_coef: float = Field(0.5, ge=0, description="weight of the value loss in the loss")
    max_grad_norm: float = Field(0.5, gt=0, description="gradients are clipped to this global norm")
    hidden: list[Annotated[int, Field(gt=0)]] = Field(default_factory=lambda: [64, 64], min_length=1,
                                                      description="widths of the hidden layers")
    activation: Literal["tanh", "relu"] = Field("tanh", description="the hidden layers' activation")
    bootstrap_truncated: bool = bootstrap_truncated_field()

    def inert(self) -> dict[str, str]:
        return {} if self.optimizer == "rmsprop" else {"rms_decay": "algorithm.optimizer=rmsprop"}


class Transition(NamedTuple):
    """One step of every environment (values and log-probs are recomputed by the learner)."""

    obs: jax.Array
    action: jax.Array
    reward: jax.Array
    done: jax.Array
    truncated: jax.Array | None = None  # with bootstrap_truncated: the episode was cut short here,
    final_obs: jax.Array | None = None  # and the observation it reached


def make_optimizer(cfg: A2CConfig, total_steps: int) -> optax.GradientTransformation:
    """Global-norm clipping, then adam or rmsprop, with the learning rate optionally decayed linearly to 0
    over ``total_steps`` optimizer steps."""
    lr = optax.linear_schedule(cfg.lr, 0.0, max(1, total_steps)) if cfg.anneal_lr else cfg.lr
    opt = (optax.adam(lr, eps=cfg.opt_eps) if cfg.optimizer == "adam"
           else optax.rmsprop(lr, decay=cfg.rms_decay, eps=cfg.opt_eps))
    return flat(optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm), opt))


def actor_critic(spec: msrl.EnvSpec, cfg: A2CConfig, algorithm: str) -> ActorCritic:
    """PPO's actor-critic network for a single-agent env spec (discrete or continuous actions)."""
    if isinstance(spec, msrl.MultiAgentSpec):
        raise msrl.ConfigError("algorithm.name", f"{spec.id} has {spec.num_agents} agents; {algorithm} acts for one "
                               "(use algorithm.name=mappo)", also=("env.id",))
    return ActorCritic(action_dim=action_dim(spec), discrete=spec.discrete, obs_ndim=len(spec.obs_shape),
                       hidden=tuple(cfg.hidden), activation=cfg.activation)


class A2CLearner(msrl.Learner):
    def __init__(self, net: nn.Module, cfg: A2CConfig, example_obs, num_updates: int):
        self.net, self.cfg, self.num_updates = net, cfg, num_updates
        self.obs = example_obs  # one environment's observation, to initialize the network with

    def optimizer(self):
        return make_optimizer(self.cfg, self.num_updates)

    def init(self, key):
        params = self.net.init(key, self.obs)
        return {"params": params, "opt_state": self.tx.init(params)}

    def policy_params(self, state):
        return state["params"]

    def _loss(self, params, batch: Transition, last_obs):
        cfg = self.cfg
        head, value = self.net.apply(params, batch.obs)  # [time, env]
        _, last_value = self.net.apply(params, last_obs)
        reward = batch.reward
        if cfg.bootstrap_truncated:  # a cut-short return goes on past its end: reward + gamma * V(final obs)
            _, final_value = self.net.apply(params, batch.final_obs)
            reward = reward + cfg.gamma * batch.truncated * jax.lax.stop_gradient(final_value)
        adv, target = gae(reward, batch.done, jax.lax.stop_gradient(value), jax.lax.stop_gradient(last_value),
                          cfg.gamma, cfg.gae_lambda)
        if cfg.normalize_advantage:
            adv = (adv - adv.mean()) / (adv.std() + 1e-8)
        pi = policy(self.net.discrete, head)
        policy_loss = -(adv * pi.log_prob(batch.action)).mean()
        value_loss = 0.5 * ((target - value) ** 2).mean()
        entropy = pi.entropy().mean()
        total = policy_loss + cfg.vf_coef * value_loss - cfg.ent_coef * entropy
        return total, {"loss": total, "policy_loss": policy_loss, "value_loss": value_loss, "entropy": entropy}

    def learn(self, state, batch: Transition, last_obs):
        grads, metrics = jax.grad(self._loss, has_aux=True)(state["params"], batch, last_obs)
        updates, opt_state = self.tx.update(grads, state["opt_state"], state["params"])  # incl. grad_transforms
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "opt_state": opt_state}, {**metrics, "grad_norm": optax.tree.norm(grads)}


class A2C(msrl.Algorithm):
    """Advantage actor-critic (synchronous): ``rollout_len`` steps of every env, GAE advantages, one
    gradient step per iteration on the whole rollout (under ``async``: one per worker, applied as it comes)."""

    Config = A2CConfig

    def __init__(self, cfg: A2CConfig, ctx: msrl.Context):
        super().__init__(cfg, ctx)
        net = actor_critic(ctx.env_spec, cfg, "A2C")
        self.actor = ActorCriticActor(net)  # samples from the policy; its value output goes unused
        self.learner = A2CLearner(net, cfg, ctx.env_spec.example_obs(),
                                  ctx.per_run(ctx.num_envs * cfg.rollout_len, ctx.updates_per_iteration))
        self.buffer = msrl.TrajectoryBuffer(cfg.rollout_len)

    def train_step(self):
        obs = msrl.env_observe()
        for _ in range(self.cfg.rollout_len):
            out = msrl.agent_act(obs)
            step = msrl.env_step(out.action)
            msrl.buffer_insert(Transition(obs, out.action, step.reward, step.done,
                                          **truncation(step, self.cfg.bootstrap_truncated)))
            obs = step.obs
        batch = msrl.buffer_get()
        metrics = msrl.agent_learn(batch, last_obs=obs)
        return metrics
