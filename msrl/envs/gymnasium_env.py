"""Gymnasium vector environments as a host :class:`~msrl.components.Environment` (numpy in, numpy out).

A host environment runs only in host fragments (``single_learner_*`` on ``threads``); its "state" is the
stateful vector env itself plus episode counters. Environment ``i`` is seeded from the run's key and its
*global* index, so splitting environments over replicas changes no number.

With ``env.subprocesses: K`` a replica's envs step in K worker processes (``msrl/envs/gym_worker.py``, each a
contiguous slice of them), all at once and outside the actor's GIL; every env steps exactly as in-process (same
seed, same calls), so the numbers are the same.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import reprlib
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from msrl.components import Box, Discrete, Environment, EnvSpec, EnvStep
from msrl.envs.gym_worker import env_trace, reset_one, step_one
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
                "length_sum": int(self.last_length[finished].sum()), "episodes": int(self.episodes.sum()),
                "nonfinite": 0}  # none: a host env's step raises at the first non-finite number, naming it


def seed_words(key: jax.Array, env_ids: Any) -> list[int]:
    """A 32-bit seed for each env: the first word of ``SeedSequence([key words, global index])``, so an env's
    stream depends on the run's key and its global index only."""
    words = [int(w) for w in np.asarray(jax.random.key_data(key)).ravel()]
    return [int(np.random.SeedSequence([*words, int(i)]).generate_state(1)[0]) for i in np.asarray(env_ids)]


def host_spaces(env_id: str, obs_space: Any, act_space: Any, obs_hint: str = "", shifts: bool = False
                ) -> Discrete | Box:
    """msrl's action space for a Gymnasium-API env's spaces (a ConfigError on ``env.id`` for what msrl does not
    take: observations other than a Box, actions other than Discrete or Box). msrl's discrete actions count from
    0: a ``Discrete(n, start=k)`` is taken only where the caller ``shifts`` them by ``k``."""
    import gymnasium

    if not isinstance(obs_space, gymnasium.spaces.Box):
        raise ConfigError("env.id", f"{env_id} has a {type(obs_space).__name__} observation space; "
                          f"msrl supports Box observations{obs_hint}")
    if isinstance(act_space, gymnasium.spaces.Discrete):
        if int(act_space.start) and not shifts:
            raise ConfigError("env.id", f"{env_id}'s actions are {act_space}: msrl takes discrete actions from 0")
        return Discrete(int(act_space.n))
    if isinstance(act_space, gymnasium.spaces.Box):
        if act_space.dtype.kind != "f":  # (cast, its actions were truncated toward 0: the bounds never reached)
            raise ConfigError("env.id", f"{env_id}'s actions are {act_space}, a Box of {act_space.dtype}: msrl's "
                              "continuous actions are floats; give it a float Box whose step rounds them as it means "
                              "to, or a Discrete space")
        return Box(act_space.low, act_space.high, act_space.shape)
    raise ConfigError("env.id", f"{env_id} has a {type(act_space).__name__} action space; msrl supports Discrete "
                      "and Box (a gymnasium ActionWrapper of your own maps one of them onto it: a MultiDiscrete's "
                      "combinations numbered as one Discrete, say)")


class Workers:
    """The worker processes of one replica's envs (``env.subprocesses``), each stepping a contiguous slice of them.
    :meth:`call` sends a command to every worker, then gathers the answers in env order, so the workers step at
    the same time."""

    SCRIPT = str(Path(__file__).with_name("gym_worker.py"))

    def __init__(self, env_id: str, count: int, spec: Any, kwargs: dict, seeds: list[int], ids: np.ndarray,
                 spaces: tuple):
        self.env_id, self.ids = env_id, ids
        self.parts = np.array_split(np.arange(len(seeds)), min(count, len(seeds)))
        self.procs: list[subprocess.Popen] = []
        self.conns: list[Connection] = []
        for _ in self.parts:
            mine, theirs = socket.socketpair()
            self.procs.append(subprocess.Popen([sys.executable, self.SCRIPT, str(theirs.fileno()), str(os.getpid())],
                                               pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL))
            theirs.close()
            self.conns.append(Connection(mine.detach()))
            self.conns[-1].send(sys.path)
        try:
            self.first = self.call("make", [(spec, kwargs, [seeds[i] for i in p], spaces) for p in self.parts])
        except (pickle.PicklingError, AttributeError, TypeError) as e:
            self.close()
            raise ConfigError("env.subprocesses", f"{env_id} cannot be sent to worker processes: its entry point "
                              f"or kwargs do not pickle ({type(e).__name__}: {e}); register it with an importable "
                              "class, or leave env.subprocesses 0") from None
        except BaseException:
            self.close()
            raise

    def slices(self, per_env: list) -> list[list]:
        return [per_env[p[0]:p[-1] + 1] for p in self.parts]

    def call(self, command: str, per_worker: list | None = None, step: int | None = None) -> list:
        for k, conn in enumerate(self.conns):
            try:
                conn.send((command, None if per_worker is None else per_worker[k]))
            except OSError:  # a broken pipe: the worker is gone
                raise self.died(k, command) from None
        out, error = [], None
        for k, conn in enumerate(self.conns):  # every answer is read, so no stale one is left for the next call
            try:
                status, value = conn.recv()
            except (EOFError, OSError):
                raise self.died(k, command) from None
            if status == "error" and error is None:
                at, message, trace = value
                where = (f"#{self.ids[self.parts[k][0] + at]}" if at is not None else self.span(k)) + (
                    "" if step is None else f" at step {step}")
                hint = (" (an env defined in your script's __main__ is unknown to worker processes: define it in "
                        "an importable module)" if "__main__" in message else "")
                error = TrainingError(f"environment {self.env_id} {where}, in its worker process, failed in "
                                      f"{command}: {message}{hint}" + (f"\nits traceback:\n{trace}" if trace else ""))
            elif status == "ok" and value is not None:
                out.extend(value)
        if error is not None:
            raise error
        return out

    def died(self, k: int, command: str) -> TrainingError:
        code = self.procs[k].wait(timeout=5)
        return TrainingError(f"the worker process of environments {self.env_id} {self.span(k)} (env.subprocesses) "
                             f"exited with code {code} during {command}")

    def span(self, k: int) -> str:
        ids = self.ids[self.parts[k]]
        return f"#{ids[0]}..#{ids[-1]}" if len(ids) > 1 else f"#{ids[0]}"

    def close(self) -> None:
        """Ask every worker to close its envs and end; one still running 5 s later (an env's step hangs) is killed.
        Safe while another thread waits on a step of theirs: it then fails as a worker that died."""
        for conn in self.conns:
            try:
                conn.send(("close", None))
            except OSError:  # gone already
                pass
        deadline = time.monotonic() + 5.0
        for proc, conn in zip(self.procs, self.conns):
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            conn.close()


@dataclasses.dataclass
class HostEnvState:
    envs: list[Any]  # one gymnasium env per index, stepped in a plain loop (cheaper than SyncVectorEnv)
    obs: np.ndarray
    counts: EpisodeCounts
    ids: np.ndarray  # global indices
    dtypes: list[np.dtype]  # of each env's first observation: it must not change
    workers: Workers | None = None  # env.subprocesses: the envs live there (and envs is empty)
    steps: int = 0
    busy: int | None = None  # the environment inside step() (or its reset) now, by position; -1: the workers
    beat: float = 0.0  # time.monotonic() when the last environment step started or ended
    slowest: float = 0.0  # seconds the slowest environment step so far took (the workers': a step of them all)


class GymnasiumEnv(Environment):
    jittable = False

    def __init__(self, name: str, subprocesses: int = 0, **kwargs: Any):
        import gymnasium

        self.name, self.kwargs, self.subprocesses = name, kwargs, subprocesses
        try:
            probe = gymnasium.make(name, **kwargs)
        except (gymnasium.error.Error, ModuleNotFoundError, ImportError) as e:
            mine = isinstance(e, gymnasium.error.NameNotFound) and ":" not in name
            mujoco = isinstance(e, gymnasium.error.DependencyNotInstalled) and "mujoco" in str(e).lower()
            raise ConfigError("env.id", f"gymnasium:{name} cannot be made: {e}" + (
                " (one of your own registers when its module is imported: `msrl ... --import FILE.py`, or import "
                "it before msrl.train)" if mine else " (msrl's extra: pip install -e '.[mujoco]' in msrl's folder)"
                if mujoco else "")) from None
        except Exception as e:  # noqa: BLE001 - whatever the env's constructor raises on bad arguments
            raise ConfigError("env.kwargs" if kwargs else "env.id", f"gymnasium:{name} cannot be made"
                              f"{f' with kwargs {kwargs}' if kwargs else ''}: {type(e).__name__}: {e}") from None
        obs_space, act_space = self.spaces = probe.observation_space, probe.action_space
        probe.close()
        # what makes its envs wherever this object goes (a Ray actor, a worker process): the registered spec, so an
        # env registered by the user's code needs no registration there ("module:id" imports its module there)
        self.made_from = name if ":" in name else gymnasium.spec(name)
        flatten = (" (register an id of your own whose entry point wraps it with gymnasium's FlattenObservation, "
                   "its module imported with --import: env.kwargs only reach gymnasium.make)")
        action_space = host_spaces(f"gymnasium:{name}", obs_space, act_space, flatten, shifts=True)
        self.start = int(act_space.start) if isinstance(act_space, gymnasium.spaces.Discrete) else 0
        self.bounds = (act_space.low, act_space.high, act_space.dtype) if isinstance(act_space, gymnasium.spaces.Box) \
            else None
        pixels = obs_space.dtype == np.uint8  # (stored and sent as such, as EnvPool's and jitted envs' frames are)
        self.spec = EnvSpec(f"gymnasium:{name}", tuple(obs_space.shape), np.dtype(np.uint8 if pixels else np.float32),
                            action_space)
        self.space = f"{obs_space.dtype}{list(obs_space.shape)}"  # (what its observation space says)

    def init(self, key: jax.Array, env_ids: Any) -> HostEnvState:
        import gymnasium

        envs, first, workers = [], [], None
        if self.subprocesses:
            workers = Workers(self.spec.id, self.subprocesses, self.made_from, self.kwargs, seed_words(key, env_ids),
                              np.asarray(env_ids), self.spaces)
            first = workers.first
        else:
            for i, seed in zip(env_ids, seed_words(key, env_ids)):
                env = gymnasium.make(self.made_from, disable_env_checker=True, **self.kwargs)
                first.append(self._call(i, None, "reset", reset_one, env, seed, self.spaces))
                envs.append(env)
        n = len(first)
        state = HostEnvState(envs, np.zeros((n, *self.spec.obs_shape), self.spec.obs_dtype), EpisodeCounts.zeros(n),
                             np.asarray(env_ids), [np.asarray(o).dtype for o in first], workers)
        for i, o in enumerate(first):
            state.obs[i] = self._checked(state, i, o)
        return state

    def observe(self, state: HostEnvState):
        return state, state.obs

    def starts(self, state: HostEnvState):
        return state, state.counts.running_length == 0

    def reset(self, state: HostEnvState):
        first = state.workers.call("reset") if state.workers else \
            [self._call(i, None, "reset", reset_one, env) for i, env in zip(state.ids, state.envs)]
        state.obs = np.stack([self._checked(state, i, o) for i, o in enumerate(first)]).astype(self.spec.obs_dtype)
        state.counts.restart()
        return state, state.obs

    def env_actions(self, action: Any) -> np.ndarray:
        """msrl's actions as this env's own ``step`` takes them: a Box's in its dtype, clipped to its bounds in that
        dtype (a float64 Box's 0.1 is 0.100000001 in msrl's float32), a ``Discrete(n, start=k)``'s from ``k``."""
        if self.bounds is not None:
            low, high, dtype = self.bounds
            return np.clip(np.asarray(action).astype(dtype), low, high)
        return np.asarray(action) + self.start

    def step(self, state: HostEnvState, action: Any):
        action = self.env_actions(action)
        actions = action.tolist() if action.ndim == 1 else list(action)
        if state.workers is not None:
            state.busy, state.beat = -1, time.monotonic()
            results = state.workers.call("step", state.workers.slices(actions), state.steps)
            state.slowest = max(state.slowest, time.monotonic() - state.beat)
        else:
            results = []
            for i, env in enumerate(state.envs):
                state.busy, state.beat = i, time.monotonic()
                results.append(self._call(state.ids[i], state.steps, "step", step_one, env, actions[i]))
                state.slowest = max(state.slowest, time.monotonic() - state.beat)
        n = len(results)
        obs = np.empty((n, *self.spec.obs_shape), self.spec.obs_dtype)
        reward = np.empty(n, np.float32)
        terminated, truncated = np.empty(n, np.bool_), np.empty(n, np.bool_)
        final = np.empty((n, *self.spec.obs_shape), self.spec.obs_dtype)
        with np.errstate(over="ignore"):  # (a float64 beyond float32's range: named below)
            for i, (o, r, terminated[i], truncated[i], first) in enumerate(results):
                reward[i] = self._reward(state, i, r)
                final[i] = self._checked(state, i, o)
                obs[i] = final[i] if first is None else self._checked(state, i, first)
        state.busy, state.beat = None, time.monotonic()
        done = terminated | truncated
        if not (np.isfinite(obs).all() and np.isfinite(final).all() and np.isfinite(reward).all()):
            good = np.isfinite(obs).reshape(n, -1).all(1) & np.isfinite(final).reshape(n, -1).all(1)
            i = int(np.flatnonzero(~(good & np.isfinite(reward)))[0])
            o, r, _, _, first = results[i]
            what, got = ("reward", r) if good[i] else ("observation", o if not np.isfinite(final[i]).all() else first)
            raise TrainingError(f"{self._where(state, i)} returned " + (
                f"a non-finite {what}: {got}" if not np.isfinite(np.asarray(got, np.float64)).all() else
                f"a {what} beyond float32's range (msrl's observations and rewards are float32): {got}"))
        state.steps += 1
        state.counts.count(reward, done)
        state.obs = obs
        return state, EnvStep(state.obs, reward, terminated, truncated, final)

    def busy(self, state: HostEnvState) -> tuple[str | None, float, float]:
        """For the stall watch: the environment inside a step now, in words (None: none), when the last
        environment step started or ended (``time.monotonic()``), and the seconds of the slowest step so far: a
        step no slower is progress still (a simulator taking seconds a step is no hang)."""
        i = state.busy
        if i == -1:
            return (f"the worker processes of environments {self.spec.id} at step {state.steps} have not answered "
                    "step()"), state.beat, state.slowest
        return (None if i is None else f"{self._where(state, i)} has not returned from step()"), state.beat, state.slowest

    def _call(self, index: int, step: int | None, what: str, fn: Any, env: Any, *args: Any) -> Any:
        """``fn(env, *args)``; what the env raises, as a TrainingError naming it (global ``index``, ``step``) and
        its own frames. (Its words are made only then: this runs for every environment's every step.)"""
        try:
            return fn(env, *args)
        except Exception as e:  # noqa: BLE001 - the env's own error, named with the environment and its step
            trace, where = env_trace(e), f"#{index}" + ("" if step is None else f" at step {step}")
            raise TrainingError(f"environment {self.spec.id} {where} failed in {what}: {type(e).__name__}: {e}"
                                + (f"\nits traceback:\n{trace}" if trace else "")) from None

    def _where(self, state: HostEnvState, i: int) -> str:
        return f"environment {self.spec.id} #{state.ids[i]} at step {state.steps}"  # counted from 0

    def _reward(self, state: HostEnvState, i: int, r: Any) -> float:
        """A reward as one number (else a TrainingError naming the environment and step)."""
        value = None if isinstance(r, (str, bytes)) else np.asarray(r)
        if value is None or value.size != 1 or value.dtype.kind not in "fiub":
            raise TrainingError(f"{self._where(state, i)} returned the reward {reprlib.repr(r)} "
                                f"({type(r).__name__}); step() returns one number as its reward")
        return float(value.reshape(()))

    def _checked(self, state: HostEnvState, i: int, o: Any) -> np.ndarray:
        """An observation as the run started: same shape and dtype, numeric (else a TrainingError)."""
        o = np.asarray(o)
        if o.shape != self.spec.obs_shape or o.dtype.kind not in "fiub":
            raise TrainingError(f"{self._where(state, i)} returned an observation of {o.dtype}{list(o.shape)}, but "
                                f"its observation space is {self.space}")
        if self.spec.obs_dtype == np.uint8 and o.dtype != np.uint8:
            raise TrainingError(f"{self._where(state, i)} returned an observation of {o.dtype}{list(o.shape)}, but "
                                f"its observation space is {self.space} (msrl keeps such frames as uint8)")
        if o.dtype != state.dtypes[i]:
            raise TrainingError(f"{self._where(state, i)} returned an observation of {o.dtype}{list(o.shape)}, but its "
                                f"first one (from reset) was {state.dtypes[i]}: an environment's observations keep one "
                                f"dtype (its observation space says {self.space})")
        return o

    def stats(self, state: HostEnvState):
        return state.counts.stats()

    def episode_counts(self, state: HostEnvState):
        return state.counts.episodes, state.counts.last_return

    def close(self, state: HostEnvState) -> None:
        if state.workers is not None:
            state.workers.close()
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
