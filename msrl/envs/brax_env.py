"""Brax environments (``brax:NAME``) as a functional msrl :class:`~msrl.components.Environment`: JAX physics
inside the fused program. Episodes end at ``episode_length`` steps (a truncation) or when the env says it
terminated; an ended environment is reset from its own key."""

from __future__ import annotations

import inspect
import re
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from msrl.components import Box, EnvSpec
from msrl.envs.gymnax_env import FunctionalEnv, in_tiles
from msrl.errors import ConfigError, did_you_mean


TILE = 16  # envs stepped together (in_tiles): 8 cost halfcheetah ~25% of its CPU speed, 16 nothing


def _import_brax_envs() -> Any:
    """``brax.envs``, without the lines MuJoCo prints on its import where its optional Warp backend is not
    installed ("Failed to import warp: No module named 'warp'", twice: it reads as an error, and is none)."""
    import contextlib
    import io
    import sys

    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            from brax import envs
    finally:
        sys.stdout.writelines(line for line in printed.getvalue().splitlines(keepends=True)
                              if not re.match(r"Failed to import (mujoco_)?warp: No module named", line))
    return envs


class BraxEnv(FunctionalEnv):
    rowwise = True  # each environment stepped alone (vmapped, in tiles), its keys from its global index

    def __init__(self, name: str, episode_length: int = 1000, action_repeat: int = 1, **kwargs: Any):
        try:
            envs = _import_brax_envs()
        except ImportError:
            raise ConfigError("env.id", f"brax:{name} needs Brax: pip install -e '.[brax]' in msrl's folder") from None
        if name not in envs._envs:
            raise ConfigError("env.id", f"'brax:{name}' is not a Brax environment; {did_you_mean(name, envs._envs)}"
                              f"known: {', '.join(sorted(envs._envs))}")
        whole = {"episode_length": episode_length, "action_repeat": action_repeat}
        for key, value in whole.items():  # (2.5 was cut to 2; "10" a TypeError; YAML reads 1e3 as 1000.0)
            whole[key] = int(value) if isinstance(value, float) and value.is_integer() else value
            if not isinstance(whole[key], int) or isinstance(value, bool) or whole[key] < 1:
                raise ConfigError(f"env.kwargs.{key}", f"must be a whole number >= 1, got {value!r}")
        episode_length, action_repeat = whole.values()
        mine = ("episode_length", "action_repeat")
        own = [p for p in inspect.signature(envs._envs[name]).parameters if p != "kwargs"]
        try:
            with warnings.catch_warnings():  # (Brax's notice that it is no longer maintained, at every env made)
                warnings.filterwarnings("ignore", message="Brax System, piplines and environments are not actively")
                env = envs.get_environment(name, **kwargs)
        except Exception as e:  # noqa: BLE001 - whatever the env's constructor raises on bad arguments
            typos = "".join(did_you_mean(k, [*mine, *own]) for k in kwargs if k not in own)  # (not a known key's)
            raise ConfigError("env.kwargs", f"brax:{name} rejected {kwargs}: {type(e).__name__}: {e} ({typos}msrl's "
                              f"keys: {', '.join(mine)}; the env's: {', '.join(own)})") from None
        self.env = envs.wrappers.training.EpisodeWrapper(env, episode_length, action_repeat)
        # the observation's shape from an abstract reset: Brax's observation_size runs reset op by op (~9 s on 2 cores)
        obs = jax.eval_shape(self.env.reset, jax.random.PRNGKey(0)).obs
        if not isinstance(obs, jax.ShapeDtypeStruct):  # (obs_mode: dict_state, say: an AttributeError of a dict)
            raise ConfigError("env.kwargs" if kwargs else "env.id", f"brax:{name}{f' with {kwargs}' if kwargs else ''} "
                              f"observes a {type(obs).__name__}; msrl takes Brax envs whose observation is one array")
        self.spec = EnvSpec(f"brax:{name}", tuple(obs.shape), np.dtype(obs.dtype),
                            Box(-1.0, 1.0, env.action_size))

    def _reset(self, keys):
        state = in_tiles(jax.vmap(self.env.reset), TILE)(keys)
        return state.obs, state

    def _step(self, keys, inner, action):
        state = in_tiles(jax.vmap(self.env.step), TILE)(inner, action)
        truncated = state.info["truncation"].astype(bool)
        terminated = state.done.astype(bool) & ~truncated
        done = terminated | truncated
        fresh = in_tiles(jax.vmap(self.env.reset), TILE)(keys)
        pick = lambda new, old: jnp.where(done.reshape(done.shape + (1,) * (new.ndim - 1)), new, old)  # noqa: E731
        inner = jax.tree.map(pick, fresh, state)
        return inner.obs, inner, state.reward.astype(jnp.float32), terminated, truncated, state.obs
