"""EnvPool's C++ environment pools as a host :class:`~msrl.components.Environment` (``envpool:CartPole-v1``,
``envpool:Breakout-v5``…), numpy in, numpy out, through EnvPool's Gymnasium API.

One pool holds the envs one replica steps; it is made with a *list* of seeds, one per env (EnvPool's
``seed=[...]``), and env ``g`` (its global index) gets ``SeedSequence([run key, g])``'s first word, as
``gymnasium:`` envs do. EnvPool gives each env of a pool its own generator seeded with its own seed, so an env's
stream depends on the run key and its global index only: envs ``[4..7]`` in one pool step as envs ``4..7`` of an
8-env pool (tests/test_envpool.py checks it bitwise on CartPole and Pendulum).

Auto-reset. EnvPool resets an env on the step *after* its episode ended: that step ignores the action and
returns the first observation of the next episode with reward 0. msrl's contract is gymnax's: the step that ends an
episode returns the next episode's first observation, with the ended one's last observation as ``final_obs``.
So after a step where some envs ended, this adapter steps just those envs once more at once
(``pool.step(noop, env_id=ended)``, one more call into the pool): that is EnvPool's own auto-reset, moved into
the ending step. Their ``final_obs`` is what EnvPool returned for the ending step and their ``obs`` the reset
one; the next step then steps every env with its action. So every action the actor chose is applied and the data
has no zero-reward reset steps; the reset step's reward must be 0 and it must not end (else a TrainingError).
It is not ``pool.reset(env_id)``: with Atari's ``episodic_life`` EnvPool's auto-reset after a lost life goes on
with the same game (4 lives left), while ``reset`` starts a new game. tests/test_envpool.py checks the adapter
against a raw pool (CartPole, Pendulum, Breakout with ``episodic_life``), bitwise.

Termination and truncation stay apart: ``terminated &= ~truncated`` (an episode cut by EnvPool's
``max_episode_steps`` is bootstrapped, even if it also ended), as for ``gymnasium:`` envs.

Observations: float spaces are float32; Atari frames stay ``uint8`` ``[stack, 84, 84]`` (scale them in the
network). ``env.kwargs`` go to ``envpool.make`` (``num_threads``, ``max_episode_steps``, Atari's ``episodic_life``,
``reward_clip``, …) except what msrl sets itself (``num_envs``, ``batch_size``, ``seed``, ``env_seed``).
"""

from __future__ import annotations

import dataclasses
import difflib
import time
from typing import Any

import jax
import numpy as np

from msrl.components import Box, Discrete, Environment, EnvSpec, EnvStep
from msrl.envs.gymnasium_env import EpisodeCounts, _ShapeOnly, host_spaces, seed_words
from msrl.errors import ConfigError, TrainingError

RESERVED = ("num_envs", "batch_size", "seed", "env_seed", "env_type", "gym_reset_return_info")


@dataclasses.dataclass
class EnvPoolState:
    pool: Any  # one envpool pool for this replica's envs, in global-index order
    obs: np.ndarray
    counts: EpisodeCounts  # of whole games for Atari
    ids: np.ndarray  # global indices
    started: np.ndarray | None = None  # which envs begin the learner's episode at the current observation (None: all)
    steps: int = 0
    busy: bool = False  # inside the pool's step (or its reset) now
    beat: float = 0.0  # time.monotonic() when the last pool step started or ended


def env_seeds(key: jax.Array, env_ids: Any) -> list[int]:
    """The seed of each env: ``gymnasium:`` envs' (:func:`~msrl.envs.gymnasium_env.seed_words`), in int32's range
    (EnvPool's)."""
    return [seed & 0x7FFFFFFF for seed in seed_words(key, env_ids)]


class EnvPoolEnv(Environment):
    jittable = False

    def __init__(self, name: str, **kwargs: Any):
        try:
            import envpool
        except ImportError as e:
            raise ConfigError("env.id", f"envpool:{name} needs EnvPool: pip install 'msrl[envpool]' ({e})") from None
        import gymnasium

        self.name, self.kwargs = name, kwargs
        known = envpool.list_all_envs()
        if name not in known:
            close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
            hint = f"; did you mean {', '.join(f'envpool:{c}' for c in close)}?" if close else ""
            if name in gymnasium.registry:
                hint += f" (Gymnasium has it: write gymnasium:{name})"
            raise ConfigError("env.id", f"envpool:{name} is not an EnvPool environment{hint} "
                              "(envpool.list_all_envs() lists them)")
        reserved = sorted(set(kwargs) & set(RESERVED))
        if reserved:
            raise ConfigError("env.kwargs", f"{reserved} are set by msrl for envpool:{name} (env.num_envs sets the "
                              "pool's size, run.seed its seeds); leave them out")
        try:
            spec = envpool.make_spec(name, **kwargs)
        except Exception as e:  # noqa: BLE001 - EnvPool's config raises TypeError/AssertionError/ValueError
            raise ConfigError("env.kwargs" if kwargs else "env.id", f"envpool:{name} cannot be made"
                              f"{f' with kwargs {kwargs}' if kwargs else ''}: {type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''}") from None
        obs_space = spec.observation_space
        action_space = host_spaces(f"envpool:{name}", obs_space, spec.action_space)
        kind = np.dtype(obs_space.dtype)
        if kind == np.uint8:
            obs_dtype = np.dtype(np.uint8)  # Atari frames: the network scales them
        elif kind.kind in "fiu" or kind == np.bool_:
            obs_dtype = np.dtype(np.float32)
        else:
            raise ConfigError("env.id", f"envpool:{name} observes {kind}; msrl supports numeric observations")
        self.spec = EnvSpec(f"envpool:{name}", tuple(obs_space.shape), obs_dtype, action_space)
        self._float = obs_dtype.kind == "f"

    def init(self, key: jax.Array, env_ids: Any) -> EnvPoolState:
        import envpool

        env_ids = np.asarray(env_ids)
        n = len(env_ids)
        pool = envpool.make(self.name, env_type="gymnasium", num_envs=n, seed=env_seeds(key, env_ids), **self.kwargs)
        state = EnvPoolState(pool, np.zeros((n, *self.spec.obs_shape), self.spec.obs_dtype), EpisodeCounts.zeros(n),
                             env_ids)
        state.obs = self._reset(state, None)
        return state

    def _reset(self, state: EnvPoolState, which: np.ndarray | None) -> np.ndarray:
        """The first observations of the envs at positions ``which`` (all: None), reset now, in that order."""
        obs, info = state.pool.reset(None if which is None else which.astype(np.int32))
        order = np.argsort(info["env_id"])  # EnvPool answers in its own order
        obs = np.asarray(obs)[order]
        self._check_shape(state, obs)
        return obs.astype(self.spec.obs_dtype, copy=False)

    def _auto_reset(self, state: EnvPoolState, ended: np.ndarray) -> np.ndarray:
        """The next first observations of the envs at positions ``ended`` (ascending), whose episodes just ended:
        EnvPool's own auto-reset, done now by stepping just those envs once (an env that ended ignores the action
        of its next step). Not ``pool.reset``: with Atari's ``episodic_life``, EnvPool's auto-reset after a lost life
        goes on with the same game, while ``reset`` starts a new one."""
        n = len(ended)
        space = self.spec.action_space
        if isinstance(space, Discrete):
            noop = np.zeros(n, np.int32)
        else:
            noop = np.broadcast_to(np.clip(np.zeros(space.shape, np.float32), space.low, space.high), (n, *space.shape))
        obs, reward, terminated, truncated, info = state.pool.step(np.ascontiguousarray(noop), ended.astype(np.int32))
        order = np.argsort(info["env_id"])  # EnvPool answers in its own order
        obs, reward = np.asarray(obs)[order], np.asarray(reward)[order]
        done = (np.asarray(terminated) | np.asarray(truncated))[order]
        if (reward != 0).any() or done.any():
            i = int(ended[np.flatnonzero((reward != 0) | done)[0]])
            raise TrainingError(f"{self._where(state, i)}: EnvPool's auto-reset step after the episode's end "
                                "paid a reward or ended again; msrl cannot move it into the ending step")
        self._check_shape(state, obs)
        return obs.astype(self.spec.obs_dtype, copy=False)

    def observe(self, state: EnvPoolState):
        return state, state.obs

    def starts(self, state: EnvPoolState):
        return state, np.ones(len(state.ids), np.bool_) if state.started is None else state.started

    def reset(self, state: EnvPoolState):
        state.obs = self._reset(state, None)
        state.counts.restart()
        state.started = None
        return state, state.obs

    def step(self, state: EnvPoolState, action: Any):
        action = np.asarray(action)
        if isinstance(self.spec.action_space, Box):
            action = np.clip(action, self.spec.action_space.low, self.spec.action_space.high)
        n = len(state.ids)
        state.busy, state.beat = True, time.monotonic()
        final, reward, terminated, truncated, info = state.pool.step(action)
        ids = np.asarray(info["env_id"])
        if not np.array_equal(ids, np.arange(n)):  # sync mode answers for every env; put them in order
            order = np.argsort(ids)
            final, reward, terminated, truncated = (np.asarray(x)[order] for x in (final, reward, terminated, truncated))
        final = np.asarray(final)
        self._check_shape(state, final)
        final = final.astype(self.spec.obs_dtype, copy=False)
        reward = np.asarray(reward, np.float32)
        truncated = np.asarray(truncated, np.bool_)
        terminated = np.asarray(terminated, np.bool_) & ~truncated  # cut by a time limit: bootstrap
        done = terminated | truncated
        obs = final
        if done.any():  # msrl resets in the same step (gymnax's contract); EnvPool would on the next one
            ended = np.flatnonzero(done)
            obs = final.copy()
            obs[ended] = self._auto_reset(state, ended)
        state.busy, state.beat = False, time.monotonic()
        bad = ~np.isfinite(reward)
        if self._float:
            bad |= ~(np.isfinite(obs).reshape(n, -1).all(1) & np.isfinite(final).reshape(n, -1).all(1))
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            what = f"reward {reward[i]}" if not np.isfinite(reward[i]) else \
                f"observation {obs[i] if not np.isfinite(obs[i]).all() else final[i]}"
            raise TrainingError(f"{self._where(state, i)} returned a non-finite {what}")
        state.steps += 1
        score, game_end = reward, done
        if "lives" in info:  # Atari: the logged episodes are whole games (to game over), scored with raw rewards
            order = np.argsort(ids)
            score = np.asarray(info["reward"], np.float32)[order]
            game_end = np.asarray(info["terminated"], np.bool_)[order] | truncated
        state.counts.count(score, game_end)
        state.obs, state.started = obs, done
        return state, EnvStep(obs, reward, terminated, truncated, final)

    def busy(self, state: EnvPoolState) -> tuple[str | None, float]:
        """For the stall watch: the pool inside a step now, in words (None: none), and when the last pool step
        started or ended (``time.monotonic()``)."""
        return (f"the EnvPool pool of {self.spec.id} (envs {self._span(state)}) at step {state.steps} has not "
                "returned from step()" if state.busy else None), state.beat

    @staticmethod
    def _span(state: EnvPoolState) -> str:
        ids = state.ids
        return f"#{ids[0]}..#{ids[-1]}" if len(ids) > 1 else f"#{ids[0]}"

    def _where(self, state: EnvPoolState, i: int) -> str:
        return f"environment {self.spec.id} #{state.ids[i]} at step {state.steps}"  # counted from 0

    def _check_shape(self, state: EnvPoolState, obs: np.ndarray) -> None:
        if obs.shape[1:] != self.spec.obs_shape:
            raise TrainingError(f"environment {self.spec.id} (envs {self._span(state)}) returned observations of "
                                f"shape {list(obs.shape[1:])}, but its space says {list(self.spec.obs_shape)}")

    def stats(self, state: EnvPoolState):
        return state.counts.stats()

    def close(self, state: EnvPoolState) -> None:
        close = getattr(state.pool, "close", None)
        if close is not None:
            close()

    def shape_stand_in(self) -> Environment:
        return _ShapeOnly(self.spec)
