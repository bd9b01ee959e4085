"""IMPALA with the recurrent actor-critic of recurrent PPO (:class:`msrl.rl.RecurrentActorCritic`).

The actor records, with every step, the behaviour log-probability and the hidden state the step started
from; the learner replays each environment's trajectory from its stored initial hidden state with its own
parameters (backpropagation through time) and corrects for the policy lag with V-trace. Minibatches are
whole trajectories of some environments.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
from msrl.algorithms.impala.impala import IMPALA, IMPALAConfig, IMPALALearner

import msrl
from msrl.rl import (
    MemoryConfig,
    RecurrentActorCriticActor,
    minibatch_epochs,
    recurrent_actor_critic,
    unroll,
)


class RecurrentIMPALAConfig(MemoryConfig, IMPALAConfig):
    """Recurrent IMPALA's keys: IMPALA's and the memory's (`msrl config algorithm.name=recurrent_impala`)."""

    name: Literal["recurrent_impala"] = "recurrent_impala"


class Transition(NamedTuple):
    obs: jax.Array
    start: jax.Array  # obs begins an episode
    action: jax.Array
    reward: jax.Array
    done: jax.Array
    behaviour_log_prob: jax.Array
    hidden: jax.Array  # the hidden state the step started from


class RecurrentIMPALALearner(IMPALALearner):
    def init(self, key):
        init_key, key = jax.random.split(key)
        params = self.net.init_params(init_key, self.obs)
        return {"params": params, "opt_state": self.tx.init(params), "key": key}

    def _forward(self, params, batch: Transition, last_obs, last_start):
        h, head, value = unroll(self.net, params, batch.hidden[0], batch.obs, batch.start)  # [time, env]
        _, _, last_value = self.net.apply(params, h, last_obs, last_start)
        return head, value, last_value

    def learn(self, state, batch: Transition, last_obs, last_start):
        cfg = self.cfg

        def loss(params, mb):  # whole trajectories of some environments, env-major: back to time-major
            t, last, last_start = mb
            return self._loss(params, jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), t), last, last_start)

        data = (jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), batch), last_obs, last_start)
        return minibatch_epochs(self.tx, loss, state, data, cfg.epochs, cfg.minibatches, shuffle=cfg.minibatches > 1)


class RecurrentIMPALA(IMPALA):
    """IMPALA with a GRU actor-critic; the learner replays each rollout from its first hidden state."""

    Config = RecurrentIMPALAConfig

    def __init__(self, cfg: RecurrentIMPALAConfig, ctx: msrl.Context):
        super().__init__(cfg, ctx)
        net = recurrent_actor_critic(ctx.env_spec, cfg)
        self.actor = RecurrentActorCriticActor(net)
        self.learner = RecurrentIMPALALearner(net, cfg, ctx.env_spec.example_obs(), self.learner.num_updates)

    def train_step(self):
        obs, start = msrl.env_observe(), msrl.env_starts()
        for _ in range(self.cfg.rollout_len):
            out = msrl.agent_act(obs, start)
            next_obs, reward, done = msrl.env_step(out.action)
            msrl.buffer_insert(Transition(obs, start, out.action, reward, done, out.log_prob, out.hidden))
            obs, start = next_obs, done
        return msrl.agent_learn(msrl.buffer_get(), last_obs=obs, last_start=start)
