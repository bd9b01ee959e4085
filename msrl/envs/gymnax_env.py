"""Adapter from a gymnax environment to a batched msrl :class:`~msrl.components.Environment`."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from msrl.components import Box, Discrete, Environment, EnvSpec, per_env_keys, split_keys
from msrl.errors import ConfigError


@struct.dataclass
class EnvState:
    inner: Any  # the gymnax state of every env (batched)
    obs: jax.Array  # [N, *obs_shape]
    keys: jax.Array  # [N, 2] per-environment key chains
    running_return: jax.Array  # [N] return of the episode in progress
    last_return: jax.Array  # [N] return of the last completed episode
    episodes: jax.Array  # [N] completed episodes


class GymnaxEnv(Environment):
    def __init__(self, name: str, **kwargs: Any):
        import gymnax

        if name not in gymnax.registered_envs:
            raise ConfigError(
                "env.id", f"'gymnax:{name}' is not a gymnax environment; known: {', '.join(gymnax.registered_envs)}"
            )
        try:
            self.env, self.params = gymnax.make(name, **kwargs)
        except Exception as e:  # noqa: BLE001 - whatever the env's constructor raises on bad arguments
            raise ConfigError("env.kwargs", f"gymnax:{name} rejected {kwargs}: {type(e).__name__}: {e}") from None
        space = self.env.action_space(self.params)
        if hasattr(space, "n"):
            action_space = Discrete(int(space.n))
        else:
            shape = tuple(space.shape)
            action_space = Box(
                np.broadcast_to(np.asarray(space.low, np.float32), shape),
                np.broadcast_to(np.asarray(space.high, np.float32), shape),
                shape,
            )
        obs_space = self.env.observation_space(self.params)
        self.spec = EnvSpec(f"gymnax:{name}", tuple(obs_space.shape), np.dtype(obs_space.dtype), action_space)

    def init(self, key: jax.Array, env_ids: jax.Array) -> EnvState:
        keys, reset_keys = split_keys(per_env_keys(key, env_ids))
        obs, inner = jax.vmap(self.env.reset, in_axes=(0, None))(reset_keys, self.params)
        zeros = jnp.zeros(keys.shape[0], jnp.float32)
        return EnvState(inner, obs, keys, zeros, zeros, jnp.zeros(keys.shape[0], jnp.int32))

    def observe(self, state: EnvState):
        return state, state.obs

    def reset(self, state: EnvState):
        keys, reset_keys = split_keys(state.keys)
        obs, inner = jax.vmap(self.env.reset, in_axes=(0, None))(reset_keys, self.params)
        zeros = jnp.zeros_like(state.running_return)
        return state.replace(inner=inner, obs=obs, keys=keys, running_return=zeros), obs

    def step(self, state: EnvState, action: jax.Array):
        if isinstance(self.spec.action_space, Box):
            action = jnp.clip(action, self.spec.action_space.low, self.spec.action_space.high)
        keys, step_keys = split_keys(state.keys)
        obs, inner, reward, terminated, truncated, _ = jax.vmap(self.env.step, in_axes=(0, 0, 0, None))(
            step_keys, state.inner, action, self.params
        )
        reward = reward.astype(jnp.float32)
        done = jnp.logical_or(terminated, truncated)
        ret = state.running_return + reward
        state = EnvState(
            inner,
            obs,
            keys,
            jnp.where(done, 0.0, ret),
            jnp.where(done, ret, state.last_return),
            state.episodes + done.astype(jnp.int32),
        )
        return state, (obs, reward, done)

    def stats(self, state: EnvState):
        finished = state.episodes > 0
        bad = jnp.sum(~jnp.isfinite(state.obs)) + jnp.sum(~jnp.isfinite(state.running_return))
        return {"return_sum": jnp.sum(jnp.where(finished, state.last_return, 0.0)), "finished": finished.sum(),
                "episodes": state.episodes.sum(), "nonfinite": bad}
