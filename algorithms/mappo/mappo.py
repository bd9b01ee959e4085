"""MAPPO: PPO for agents that share a reward, with a parameter-shared actor and a centralized critic.

Agents are a batch axis, not new API calls. A multi-agent environment (``jaxmarl:...``) observes a
:class:`msrl.MultiAgentObs` — every agent's observation ``[num_envs, agents, ...]`` and the global state
``[num_envs, ...]`` — takes actions ``[num_envs, agents]`` and pays one reward ``[num_envs]``. So MAPPO is PPO
with another network, and its training loop is PPO's, unchanged::

    obs = msrl.env_observe()
    for _ in range(self.cfg.rollout_len):
        out = msrl.agent_act(obs)                     # action, log_prob: [num_envs, agents]; value: [num_envs]
        step = msrl.env_step(out.action)             # step.reward, step.done: [num_envs]
        msrl.buffer_insert(Transition(obs, out.action, step.reward, step.done, out.log_prob, out.value,
                                      **truncation(step, self.cfg.bootstrap_truncated)))
        obs = step.obs
    return msrl.agent_learn(msrl.buffer_get(), last_obs=obs)

The learner computes GAE on the shared reward with the centralized value, and PPO's clipped objective with
one probability ratio per agent, each weighted by the shared advantage (minibatches are drawn over env steps,
keeping the agents of a step together).
"""

from __future__ import annotations

from typing import Literal

import flax.linen as nn
import jax.numpy as jnp
from msrl.algorithms.ppo.ppo import PPO, PPOConfig
from pydantic import Field

import msrl
from msrl.rl import ActorCritic, action_dim, flatten


class MAPPOConfig(PPOConfig):
    name: Literal["mappo"] = "mappo"
    network: Literal["mlp", "nature_cnn"] = Field("mlp", description="mlp only: a shared actor MLP and a central "
                                                  "critic MLP (ppo has nature_cnn)")
    agent_ids: bool = Field(True, description="append a one-hot agent index to each agent's observation, so the "
                            "shared actor can tell the agents apart")


class SharedActorCentralCritic(ActorCritic):
    """PPO's actor-critic over agents: one actor, shared by all agents, maps each agent's observation to its
    action distribution (``[..., agents, actions]``); the critic values the global state (``[...]``)."""

    state_ndim: int = 1
    agent_ids: bool = True

    def inputs(self, obs: msrl.MultiAgentObs):
        agents = flatten(obs.agents, self.obs_ndim)  # [..., agents, features]
        if self.agent_ids:
            n = agents.shape[-2]
            agents = jnp.concatenate([agents, jnp.broadcast_to(jnp.eye(n), (*agents.shape[:-1], n))], axis=-1)
        return agents, flatten(obs.state, self.state_ndim)


class MAPPO(PPO):
    """PPO's components and training loop (``train_step`` is inherited: agents are a batch axis) with
    :class:`SharedActorCentralCritic` as the network."""

    Config = MAPPOConfig
    default_env = "jaxmarl:MPE_simple_spread_v3"

    def network(self, spec: msrl.EnvSpec) -> nn.Module:
        if not isinstance(spec, msrl.MultiAgentSpec):
            raise msrl.ConfigError("env.id", f"{spec.id} is a single-agent environment; MAPPO needs a multi-agent "
                                   "one (e.g. jaxmarl:MPE_simple_spread_v3), or use algorithm.name=ppo",
                                   also=("algorithm.name",))
        if self.cfg.network != "mlp":
            raise msrl.ConfigError("algorithm.network", f"MAPPO's actor and critic are MLPs; {self.cfg.network!r} is "
                                   "PPO's (algorithm.name=ppo)")
        return SharedActorCentralCritic(
            action_dim=action_dim(spec), discrete=spec.discrete, obs_ndim=len(spec.obs_shape),
            state_ndim=len(spec.state_shape), agent_ids=self.cfg.agent_ids, hidden=tuple(self.cfg.hidden),
            activation=self.cfg.activation)
