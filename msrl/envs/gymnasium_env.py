"""Gymnasium vector environments as a host :class:`~msrl.components.Environment` (numpy in, numpy out).

A host environment runs only in host fragments (``single_learner_*`` on ``threads``); its "state" is the
stateful vector env itself plus episode counters. Environment ``i`` is seeded from the run's key and its
*global* index, so splitting environments over replicas changes no number.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from msrl.components import Box, Discrete, Environment, EnvSpec, EnvStep
from msrl.errors import ConfigError, TrainingError


@dataclasses.dataclass
class EpisodeCounts:
    """A host environment's episode counters, one entry per env: the return and length of the episode in
    progress and of the last finished one, and how many finished."""

    running_return: np.ndarray
    last_return: np.ndarray
    episodes: np.ndarray
    running_length: np.ndarray
    last_length: np.ndarray

    @classmethod
    def zeros(cls, n: int) -> EpisodeCounts:
        zeros, counts = np.zeros(n, np.float32), np.zeros(n, np.int32)
        return cls(zeros, zeros.copy(), counts, counts.copy(), counts.copy())

    def restart(self) -> None:
        """Every episode in progress starts again (a reset)."""
        self.running_return[:] = 0
        self.running_length[:] = 0

    def count(self, reward: np.ndarray, done: np.ndarray) -> None:
        """One step of every env: ``reward`` earned, ``done`` where an episode ended with it."""
        ret = self.running_return + reward
        self.last_return = np.where(done, ret, self.last_return)
        self.running_return = np.where(done, 0.0, ret).astype(np.float32)
        self.episodes = self.episodes + done
        length = self.running_length + 1
        self.last_length = np.where(done, length, self.last_length)
        self.running_length = np.where(done, 0, length).astype(np.int32)

    def stats(self) -> dict:
        finished = self.episodes > 0
        return {"return_sum": float(self.last_return[finished].sum()), "finished": int(finished.sum()),
                "length_sum": int(self.last_length[finished].sum()), "episodes": int(self.episodes.sum())}


def seed_words(key: jax.Array, env_ids: Any) -> list[int]:
    """A 32-bit seed for each env: the first word of ``SeedSequence([key words, global index])``, so an env's
    stream depends on the run's key and its global index only."""
    words = [int(w) for w in np.asarray(jax.random.key_data(key)).ravel()]
    return [int(np.random.SeedSequence([*words, int(i)]).generate_state(1)[0]) for i in np.asarray(env_ids)]


def host_spaces(env_id: str, obs_space: Any, act_space: Any, obs_hint: str = "") -> Discrete | Box:
    """msrl's action space for a Gymnasium-API env's spaces (a ConfigError on ``env.id`` for what msrl does not
    take: observations other than a Box, actions other than Discrete or Box)."""
    import gymnasium

    if not isinstance(obs_space, gymnasium.spaces.Box):
        raise ConfigError("env.id", f"{env_id} has a {type(obs_space).__name__} observation space; "
                          f"msrl supports Box observations{obs_hint}")
    if isinstance(act_space, gymnasium.spaces.Discrete):
        return Discrete(int(act_space.n))
    if isinstance(act_space, gymnasium.spaces.Box):
        return Box(act_space.low.astype(np.float32), act_space.high.astype(np.float32), tuple(act_space.shape))
    raise ConfigError("env.id", f"{env_id} has a {type(act_space).__name__} action space; "
                      "msrl supports Discrete and Box")


@dataclasses.dataclass
class HostEnvState:
    envs: list[Any]  # one gymnasium env per index, stepped in a plain loop (cheaper than SyncVectorEnv)
    obs: np.ndarray
    counts: EpisodeCounts
    ids: np.ndarray  # global indices
    dtypes: list[np.dtype]  # of each env's first observation: it must not change
    steps: int = 0
    busy: int | None = None  # the environment inside step() (or its reset) now, by position
    beat: float = 0.0  # time.monotonic() when the last environment step started or ended


class GymnasiumEnv(Environment):
    jittable = False

    def __init__(self, name: str, **kwargs: Any):
        import gymnasium

        self.name, self.kwargs = name, kwargs
        try:
            probe = gymnasium.make(name, **kwargs)
        except (gymnasium.error.Error, ModuleNotFoundError, ImportError) as e:
            raise ConfigError("env.id", f"gymnasium:{name} cannot be made: {e}") from None
        except Exception as e:  # noqa: BLE001 - whatever the env's constructor raises on bad arguments
            raise ConfigError("env.kwargs" if kwargs else "env.id", f"gymnasium:{name} cannot be made"
                              f"{f' with kwargs {kwargs}' if kwargs else ''}: {type(e).__name__}: {e}") from None
        obs_space, act_space = probe.observation_space, probe.action_space
        probe.close()
        action_space = host_spaces(f"gymnasium:{name}", obs_space, act_space,
                                   " (wrap it with gymnasium's FlattenObservation)")
        self.spec = EnvSpec(f"gymnasium:{name}", tuple(obs_space.shape), np.dtype(np.float32), action_space)

    def init(self, key: jax.Array, env_ids: Any) -> HostEnvState:
        import gymnasium

        envs, first = [], []
        for seed in seed_words(key, env_ids):
            env = gymnasium.make(self.name, disable_env_checker=True, **self.kwargs)
            first.append(env.reset(seed=seed)[0])
            envs.append(env)
        state = HostEnvState(envs, np.zeros((len(envs), *self.spec.obs_shape), np.float32),
                             EpisodeCounts.zeros(len(envs)), np.asarray(env_ids), [np.asarray(o).dtype for o in first])
        for i, o in enumerate(first):
            state.obs[i] = self._checked(state, i, o)
        return state

    def observe(self, state: HostEnvState):
        return state, state.obs

    def starts(self, state: HostEnvState):
        return state, state.counts.running_length == 0

    def reset(self, state: HostEnvState):
        state.obs = np.stack([env.reset()[0] for env in state.envs]).astype(np.float32)
        state.counts.restart()
        return state, state.obs

    def step(self, state: HostEnvState, action: Any):
        action = np.asarray(action)
        if isinstance(self.spec.action_space, Box):
            action = np.clip(action, self.spec.action_space.low, self.spec.action_space.high)
        n = len(state.envs)
        obs = np.empty((n, *self.spec.obs_shape), np.float32)
        reward = np.empty(n, np.float32)
        terminated, truncated = np.empty(n, np.bool_), np.empty(n, np.bool_)
        final = np.empty((n, *self.spec.obs_shape), np.float32)
        for i, env in enumerate(state.envs):  # auto-reset in the same step, as gymnax does
            state.busy, state.beat = i, time.monotonic()
            o, r, terminated[i], truncated[i], _ = env.step(action[i].item() if action.ndim == 1 else action[i])
            terminated[i] &= not truncated[i]  # cut by a time limit: bootstrap, even if also terminal
            final[i] = self._checked(state, i, o)
            obs[i] = self._checked(state, i, env.reset()[0]) if terminated[i] or truncated[i] else final[i]
            reward[i] = r
        state.busy, state.beat = None, time.monotonic()
        done = terminated | truncated
        if not (np.isfinite(obs).all() and np.isfinite(final).all() and np.isfinite(reward).all()):
            good = np.isfinite(obs).reshape(n, -1).all(1) & np.isfinite(final).reshape(n, -1).all(1)
            i = int(np.flatnonzero(~(good & np.isfinite(reward)))[0])
            raise TrainingError(f"{self._where(state, i)} returned a non-finite "
                                f"{'reward' if good[i] else 'observation'}: "
                                f"{reward[i] if good[i] else (obs[i] if not np.isfinite(obs[i]).all() else final[i])}")
        state.steps += 1
        state.counts.count(reward, done)
        state.obs = obs.astype(np.float32)
        return state, EnvStep(state.obs, reward, terminated, truncated, final)

    def busy(self, state: HostEnvState) -> tuple[str | None, float]:
        """For the stall watch: the environment inside a step now, in words (None: none), and when the last
        environment step started or ended (``time.monotonic()``)."""
        i = state.busy
        return (f"{self._where(state, i)} has not returned from step()" if i is not None else None), state.beat

    def _where(self, state: HostEnvState, i: int) -> str:
        return f"environment {self.spec.id} #{state.ids[i]} at step {state.steps}"  # counted from 0

    def _checked(self, state: HostEnvState, i: int, o: Any) -> np.ndarray:
        """An observation as the run started: same shape and dtype, numeric (else a TrainingError)."""
        o = np.asarray(o)
        if o.shape != self.spec.obs_shape or o.dtype != state.dtypes[i] or o.dtype.kind not in "fiub":
            raise TrainingError(f"{self._where(state, i)} returned an observation of {o.dtype}{list(o.shape)}, but "
                                f"its observations are {state.dtypes[i]}{list(self.spec.obs_shape)}")
        return o

    def stats(self, state: HostEnvState):
        return state.counts.stats()

    def close(self, state: HostEnvState) -> None:
        for env in state.envs:
            env.close()

    def shape_stand_in(self) -> Environment:
        return _ShapeOnly(self.spec)


class _ShapeOnly(Environment):
    """Zeros of the right shapes: lets the compiler trace a loop whose environment runs on the host."""

    def __init__(self, spec: EnvSpec):
        self.spec = spec

    def init(self, key, env_ids):
        return jnp.zeros((len(env_ids), *self.spec.obs_shape), self.spec.obs_dtype)

    def observe(self, state):
        return state, state

    reset = observe

    def starts(self, state):
        return state, jnp.zeros(state.shape[0], jnp.bool_)

    def step(self, state, action):
        n = state.shape[0]
        return state, EnvStep(state, jnp.zeros(n, jnp.float32), jnp.zeros(n, jnp.bool_), jnp.zeros(n, jnp.bool_), state)

    def stats(self, state):
        return {"return_sum": jnp.zeros(()), "finished": jnp.zeros((), jnp.int32), "length_sum": jnp.zeros((), jnp.int32),
                "episodes": jnp.zeros((), jnp.int32)}
