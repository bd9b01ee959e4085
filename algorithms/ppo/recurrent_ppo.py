"""Recurrent PPO: PPO with a GRU between the observation embedding and the heads, written once against the
msrl API.

The loop hands the actor the episode starts with every observation (``msrl.agent_act(obs, start)``); the
actor keeps one hidden state per environment and records the one each step started from. The learner
replays every environment's window from its stored initial hidden state (backpropagation through time over
the rollout) and splits minibatches by environment, so each minibatch holds whole sequences.
``memory: none`` is the same loop and network without the GRU (it shows what memory buys).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
from pydantic import Field
from msrl.algorithms.ppo.ppo import PPO, PPOConfig, PPOLearner

import msrl
from msrl.rl import (
    MemoryConfig,
    RecurrentActorCritic,
    RecurrentActorCriticActor,
    minibatch_epochs,
    recurrent_actor_critic,
    unroll,
)


class RecurrentPPOConfig(MemoryConfig, PPOConfig):
    """Recurrent PPO's keys: PPO's and the memory's (`msrl config algorithm.name=recurrent_ppo`)."""

    name: Literal["recurrent_ppo"] = "recurrent_ppo"
    minibatches: int = Field(4, gt=0, le=msrl.INT32_MAX, description="minibatches per pass, each the whole sequences "
                             "of some envs (it must divide the envs a learner sees)")
    network: Literal["mlp", "nature_cnn"] = Field("mlp", description="mlp only: the GRU actor-critic (ppo has "
                                                  "nature_cnn)")
    normalize_obs: bool = Field(False, description="false only: recurrent_ppo does not normalize (ppo does)")
    normalize_reward: bool = Field(False, description="false only: recurrent_ppo does not normalize (ppo does)")
    bootstrap_truncated: bool = Field(False, description="false only: recurrent_ppo ends the return at every episode "
                                      "end (ppo bootstraps a truncation)")


class Transition(NamedTuple):
    obs: jax.Array
    start: jax.Array  # obs begins an episode (the hidden state was reset before it)
    action: jax.Array
    reward: jax.Array
    done: jax.Array
    log_prob: jax.Array
    value: jax.Array
    hidden: jax.Array  # the hidden state the step started from


class RecurrentPPOLearner(PPOLearner):
    def init(self, key):
        init_key, key = jax.random.split(key)
        params = self.net.init_params(init_key, self.obs)
        return {"params": params, "opt_state": self.tx.init(params), "key": key}

    def _forward(self, params, t: Transition):
        _, head, value = unroll(self.net, params, t.hidden[0], t.obs, t.start)
        return head, value

    def _loss(self, params, mb):  # whole sequences, env-major: back to time-major for the unroll
        return super()._loss(params, jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), mb))

    def learn(self, state, batch: Transition, last_obs, last_start):
        cfg = self.cfg
        h, _, _ = unroll(self.net, state["params"], batch.hidden[0], batch.obs, batch.start)
        _, _, last_value = self.net.apply(state["params"], h, last_obs, last_start)
        adv, targets = self._gae(batch, last_value)
        data = jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), (batch, adv, targets))  # env-major: split by env
        return minibatch_epochs(self.tx, self._loss, state, data, cfg.epochs, cfg.minibatches)


class RecurrentPPO(PPO):
    """PPO with a GRU actor-critic: minibatches of whole environments' sequences, each replayed
    from its hidden state at the rollout's start."""

    Config = RecurrentPPOConfig

    def __init__(self, cfg: RecurrentPPOConfig, ctx: msrl.Context):
        for key in ("normalize_obs", "normalize_reward"):
            if getattr(cfg, key):
                raise msrl.ConfigError(f"algorithm.{key}", "recurrent_ppo does not normalize (yet): use ppo for that")
        if cfg.bootstrap_truncated:
            raise msrl.ConfigError("algorithm.bootstrap_truncated", "recurrent_ppo ends the return at every episode end "
                                   "(bootstrapping a truncation is not built for it yet): use ppo for that")
        if ctx.learner_envs % cfg.minibatches:
            raise msrl.ConfigError("algorithm.minibatches", f"{cfg.minibatches} does not divide the "
                                   f"{ctx.learner_envs} environments a learner sees (minibatches are whole sequences "
                                   "of some environments)")
        super().__init__(cfg, ctx)
        net = self.network(ctx.env_spec)
        self.actor = RecurrentActorCriticActor(net)
        self.learner = RecurrentPPOLearner(net, cfg, ctx.env_spec.example_obs(), self.learner.num_updates,
                                           ctx.learner_envs)

    def network(self, spec: msrl.EnvSpec) -> RecurrentActorCritic:
        if self.cfg.network != "mlp":
            raise msrl.ConfigError("algorithm.network", f"recurrent PPO's network is its GRU actor-critic; "
                                   f"{self.cfg.network!r} is PPO's (algorithm.name=ppo)")
        return recurrent_actor_critic(spec, self.cfg)

    def train_step(self):
        obs, start = msrl.env_observe(), msrl.env_starts()
        for _ in range(self.cfg.rollout_len):
            out = msrl.agent_act(obs, start)
            next_obs, reward, done = msrl.env_step(out.action)
            msrl.buffer_insert(Transition(obs, start, out.action, reward, done, out.log_prob, out.value, out.hidden))
            obs, start = next_obs, done
        return msrl.agent_learn(msrl.buffer_get(), last_obs=obs, last_start=start)
