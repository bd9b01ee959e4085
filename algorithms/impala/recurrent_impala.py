"""IMPALA with the recurrent actor-critic of recurrent PPO (:class:`msrl.rl.RecurrentActorCritic`).

The actor records, with every step, the behaviour log-probability and the hidden state the step started
from; the learner replays each environment's trajectory from its stored initial hidden state with its own
parameters (backpropagation through time) and corrects for the policy lag with V-trace. Minibatches are
whole trajectories of some environments.
"""

from __future__ import annotations

from typing import Annotated, Literal, NamedTuple

import jax
import jax.numpy as jnp
from msrl.algorithms.impala.impala import IMPALA, IMPALAConfig, IMPALALearner
from pydantic import Field

import msrl
from msrl.rl import (
    RecurrentActorCritic,
    RecurrentActorCriticActor,
    action_dim,
    minibatch_epochs,
    unroll,
)


class RecurrentIMPALAConfig(IMPALAConfig):
    name: Literal["recurrent_impala"] = "recurrent_impala"
    memory: Literal["gru", "none"] = Field("gru", description="the recurrent cell; none: the same network without memory")
    memory_size: int = Field(128, gt=0, le=65_536, description="units of the recurrent cell")
    hidden: list[Annotated[int, Field(gt=0)]] = Field(default_factory=lambda: [128, 128], min_length=1,
                                                      description="the embedding's width, then the heads' layers")
    activation: Literal["tanh", "relu"] = "relu"


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
    Config = RecurrentIMPALAConfig

    def __init__(self, cfg: RecurrentIMPALAConfig, ctx: msrl.Context):
        super().__init__(cfg, ctx)
        spec = ctx.env_spec
        if isinstance(spec, msrl.MultiAgentSpec):
            raise msrl.ConfigError("algorithm.name", f"{spec.id} has {spec.num_agents} agents; recurrent_impala acts "
                                   "for one")
        net = RecurrentActorCritic(action_dim=action_dim(spec), discrete=spec.discrete, obs_ndim=len(spec.obs_shape),
                                   hidden=tuple(cfg.hidden), memory=cfg.memory, memory_size=cfg.memory_size,
                                   activation=cfg.activation)
        self.actor = RecurrentActorCriticActor(net)
        self.learner = RecurrentIMPALALearner(net, cfg, spec.example_obs(), self.learner.num_updates)

    def train_step(self):
        obs, start = msrl.env_observe(), msrl.env_starts()
        for _ in range(self.cfg.rollout_len):
            out = msrl.agent_act(obs, start)
            next_obs, reward, done = msrl.env_step(out.action)
            msrl.buffer_insert(Transition(obs, start, out.action, reward, done, out.log_prob, out.hidden))
            obs, start = next_obs, done
        return msrl.agent_learn(msrl.buffer_get(), last_obs=obs, last_start=start)
