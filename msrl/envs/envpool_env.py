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

Termination and truncation stay apart: an episode cut by EnvPool's ``max_episode_steps`` is truncated and
bootstrapped. One that also ended naturally on that step is truncated too, unlike a ``gymnasium:`` env's (there
terminal wins): EnvPool's Gymnasium API returns ``terminated = done & ~trunc``, so the terminal flag is lost.

Observations: float spaces are float32; Atari frames stay ``uint8`` ``[stack, 84, 84]`` (scale them in the
network). ``env.kwargs`` go to ``envpool.make`` (``num_threads``, ``max_episode_steps``, Atari's ``episodic_life``,
``reward_clip``, …) except what msrl sets itself (``num_envs``, ``batch_size``, ``seed``, ``env_seed``).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import itertools
import sys
import time
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from msrl.components import Box, Discrete, Environment, EnvSpec, EnvStep
from msrl.envs.gymnasium_env import EpisodeCounts, _ShapeOnly, host_spaces, seed_words
from msrl.envs.gymnax_env import FunctionalEnv, episode_counts
from msrl.errors import ConfigError, TrainingError, did_you_mean

# EnvPool builds Gymnasium Boxes from float64 bounds in every pool (and again as it steps); Gymnasium warns each
# time that it casts them to float32, which says nothing to a user
warnings.filterwarnings("ignore", message=".*precision lowered by casting to float32", module="gymnasium.spaces.box")

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
            raise ConfigError("env.id", f"envpool:{name} needs EnvPool: pip install -e '.[envpool]' in msrl's folder "
                              f"({e})") from None
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
        # EnvPool takes 0 or less, and then ends every episode after one step, steps no frames, or kills the
        # process (Atari's noop_max 0 and a 0-pixel image: a segfault, an OpenCV abort)
        for key in ("max_episode_steps", "frame_skip", "stack_num", "noop_max", "img_height", "img_width"):
            value = kwargs.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"env.kwargs.{key}", f"must be a whole number >= 1, got {value!r}")
        threads = kwargs.get("num_threads")  # (below 0: EnvPool aborts the process)
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 0):
            raise ConfigError("env.kwargs.num_threads", f"must be a whole number >= 0 (0: EnvPool's default), got "
                              f"{threads!r}")
        p = kwargs.get("repeat_action_probability")  # (sticky actions; EnvPool takes any number)
        if p is not None and (isinstance(p, bool) or not isinstance(p, int | float) or not 0 <= p <= 1):
            raise ConfigError("env.kwargs.repeat_action_probability", f"must be a probability in [0, 1], got {p!r}")
        reserved = sorted(set(kwargs) & set(RESERVED))
        if reserved:
            raise ConfigError("env.kwargs", f"{reserved} are set by msrl for envpool:{name} (env.num_envs sets the "
                              "pool's size, run.seed its seeds); leave them out")
        try:
            spec = envpool.make_spec(name, **kwargs)
        except Exception as e:  # noqa: BLE001 - EnvPool's config raises TypeError/AssertionError/ValueError
            if isinstance(e, TypeError):  # pybind's "incompatible constructor arguments": name the kwarg
                defaults = envpool.make_spec(name).config._asdict()
                takes = sorted(k for k in defaults if k not in RESERVED)
                for key in kwargs:
                    if key not in defaults:  # (a TypeError of EnvPool's Config naming it, keyed env.kwargs)
                        near = did_you_mean(key, takes)
                        raise ConfigError(f"env.kwargs.{key}", f"envpool:{name} takes no {key!r}"
                                          f"{f' ({near.strip()})' if near else ''}; it takes {', '.join(takes)}")
                for key, value in kwargs.items():
                    want = type(defaults.get(key))
                    if key in defaults and not isinstance(value, want) and not (want is float and
                                                                                isinstance(value, int)):
                        raise ConfigError(f"env.kwargs.{key}", f"envpool:{name} takes a {want.__name__} (default "
                                          f"{defaults[key]!r}), got {value!r}") from None
            raise ConfigError("env.kwargs" if kwargs else "env.id", f"envpool:{name} cannot be made"
                              f"{f' with kwargs {kwargs}' if kwargs else ''}: {type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''}") from None
        obs_space = spec.observation_space
        action_space = host_spaces(f"envpool:{name}", obs_space, spec.action_space, " (an EnvPool pool cannot be "
                                   "wrapped: use its gymnasium: id, with an id of your own whose entry point wraps it "
                                   "in gymnasium's FlattenObservation, imported with --import)")
        kind = np.dtype(obs_space.dtype)
        if kind == np.uint8:
            obs_dtype = np.dtype(np.uint8)  # Atari frames: the network scales them
        elif kind.kind in "fiu" or kind == np.bool_:
            obs_dtype = np.dtype(np.float32)
        else:
            raise ConfigError("env.id", f"envpool:{name} observes {kind}; msrl supports numeric observations")
        self.spec = EnvSpec(f"envpool:{name}", tuple(obs_space.shape), obs_dtype, action_space)
        self._float = obs_dtype.kind == "f"
        # Atari: the logged episodes are whole games (to game over), scored with raw rewards
        self._atari = "info:lives" in spec.state_array_spec

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
        terminated = np.asarray(terminated, np.bool_) & ~truncated  # (EnvPool's already: see the docstring)
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
        if self._atari:
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

    def episode_counts(self, state: EnvPoolState):
        return state.counts.episodes, state.counts.last_return

    def close(self, state: EnvPoolState) -> None:
        close = getattr(state.pool, "close", None)
        if close is not None:
            close()

    def shape_stand_in(self) -> Environment:
        return _ShapeOnly(self.spec)


class PoolRef:
    """A live EnvPool pool and its XLA ``send``/``recv``, held as *static* data of the env state (part of its tree
    structure, compared by identity): EnvPool bakes the pool into the XLA call it makes (the handle array is only
    threaded through for ordering), so a program traced for one pool must never run with another's state. A
    distinct pool is a distinct tree structure, hence its own trace.

    The calls are EnvPool's own XLA targets (``pool._xla()``, what its ``xla()`` wraps), with one difference: a
    64-bit array (MuJoCo's float64 actions and observations) crosses as pairs of uint32 words, which JAX has without
    ``jax_enable_x64``; float32 actions widen exactly, and float64 observations round to float32 as numpy's
    ``astype`` does (to nearest, ties to even), except that magnitudes below float32's smallest normal number
    (1.2e-38) become 0, as XLA on CPU treats them anyway."""

    _names = itertools.count()

    def __init__(self, pool: Any):
        from jax import ffi

        self.pool, self.calls = pool, {}
        for name, (handle, (ins, outs), (cpu, _)) in pool._xla():
            target = f"msrl_envpool_{next(self._names)}_{name}"
            ffi.register_ffi_target(target, cpu, platform="cpu", api_version=1)
            specs = [jax.ShapeDtypeStruct((*shape, 2), jnp.uint32) if np.dtype(dtype).itemsize == 8 else
                     jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype)) for dtype, shape in outs]
            # vmap: a replica alone in its process under multi_learner on ray runs inside a vmap of one; states of
            # several pools never stack (each pool is its own tree structure), so a batch is never more than one
            call = ffi.ffi_call(target, specs if len(specs) > 1 else specs[0], has_side_effect=True,
                                input_output_aliases={0: 0}, vmap_method="sequential")
            self.calls[name] = (call, [np.dtype(d) for d, _ in ins], [np.dtype(d) for d, _ in outs])
        self.handle = np.frombuffer(handle, np.uint8)
        self.address = int.from_bytes(handle, sys.byteorder)

    def send(self, handle: jax.Array, action: jax.Array, env_id: jax.Array) -> jax.Array:
        call, dtypes, _ = self.calls["send"]
        args = self.pool._from(action, env_id)  # EnvPool's own order of its action arrays
        return call(handle, *(_to_wire(a, d) for a, d in zip(args, dtypes[1:], strict=True)), handle=self.address)

    def recv(self, handle: jax.Array) -> tuple[jax.Array, Any]:
        call, _, dtypes = self.calls["recv"]
        handle, *values = call(handle, handle=self.address)
        values = [_from_wire(v, d) for v, d in zip(values, dtypes[1:], strict=True)]
        return handle, self.pool._to(values, reset=False, return_info=True)

    def __repr__(self) -> str:
        return f"PoolRef({id(self.pool):#x})"

    def __reduce__(self):
        raise TypeError("an env.xla EnvPool pool lives in the process that made it and cannot be pickled")


def _to_wire(x: jax.Array, dtype: np.dtype) -> jax.Array:
    """``x`` as EnvPool's ``dtype`` wants it: a 64-bit one as uint32 word pairs (low word first)."""
    if dtype.itemsize != 8:
        return jnp.asarray(x).astype(dtype)
    if dtype.kind != "f":  # int64: sign-extended
        low = jnp.asarray(x).astype(jnp.int32)
        return jnp.stack([low.astype(jnp.uint32), jnp.where(low < 0, jnp.uint32(0xFFFFFFFF), jnp.uint32(0))], -1)
    bits = jax.lax.bitcast_convert_type(jnp.asarray(x).astype(jnp.float32), jnp.uint32)
    sign, exp, mant = bits & jnp.uint32(0x80000000), (bits >> 23) & 0xFF, bits & 0x7FFFFF
    exp = jnp.where(exp == 0xFF, jnp.uint32(0x7FF), exp + jnp.uint32(1023 - 127))
    high, low = sign | (exp << 20) | (mant >> 3), (mant & 0x7) << 29
    zero = (bits & 0x7F800000) == 0  # zero (a subnormal is zero to XLA on CPU)
    return jnp.stack([jnp.where(zero, jnp.uint32(0), low), jnp.where(zero, sign, high)], -1)


def _from_wire(x: jax.Array, dtype: np.dtype) -> jax.Array:
    """An array EnvPool returned as ``dtype``, in JAX's 32-bit dtypes (a float64 rounded to nearest, ties to even)."""
    if dtype.itemsize != 8:
        return x
    low, high = x[..., 0], x[..., 1]
    if dtype.kind != "f":
        return low.astype(jnp.int32)
    sign, exp = high & jnp.uint32(0x80000000), (high >> 20) & 0x7FF
    mant = jnp.uint32(1 << 23) | ((high & 0xFFFFF) << 3) | (low >> 29)  # 24 bits with the leading one
    rest, half = low & 0x1FFFFFFF, jnp.uint32(1 << 28)
    mant = mant + ((rest > half) | ((rest == half) & ((mant & 1) == 1))).astype(jnp.uint32)
    carry = mant >> 24  # rounded up to 2^24: one more in the exponent
    exp32 = exp.astype(jnp.int32) - (1023 - 127) + carry.astype(jnp.int32)
    bits = sign | (jnp.clip(exp32, 0, 255).astype(jnp.uint32) << 23) | ((mant >> carry) & 0x7FFFFF)
    bits = jnp.where(exp32 >= 255, sign | 0x7F800000, bits)  # too large: infinity
    bits = jnp.where(exp32 <= 0, sign, bits)  # too small (and zero): zero
    nan = (exp == 0x7FF) & (((high & 0xFFFFF) | low) != 0)
    bits = jnp.where(exp == 0x7FF, sign | 0x7F800000 | jnp.where(nan, jnp.uint32(0x400000), jnp.uint32(0)), bits)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


@struct.dataclass
class EnvPoolXlaState:
    handle: jax.Array  # uint8 [8]: EnvPool's handle, threaded through every call to order them
    obs: jax.Array  # [N, *obs_shape]
    running_return: jax.Array
    last_return: jax.Array
    episodes: jax.Array
    running_length: jax.Array
    last_length: jax.Array
    started: jax.Array  # [N] bool: the current observation begins the learner's episode (an Atari life)
    ref: PoolRef | None = struct.field(pytree_node=False, default=None)  # None: the compiler's shape stand-in


class EnvPoolXlaEnv(EnvPoolEnv):
    """``envpool:ID`` with ``env.xla: true``: the pool is stepped from *inside* the jitted program through EnvPool's
    XLA interface (its ``xla()`` send/recv as XLA custom calls), so a rollout of a host-simulated env runs as one
    XLA loop, with no Python between steps.

    Each replica's pool is made on the host when its state is (``host_simulator``), in EnvPool's asynchronous mode
    with ``batch_size=1``: a step sends every env its action (one call per env), then receives the N results in
    whatever order they finish and puts each at its env's index. The envs that ended step once more (EnvPool's
    auto-reset step, its action ignored), as the host adapter does, so msrl's contract holds: the ending step returns
    the next episode's first observation and ``final_obs``. Seeds are the host adapter's, so every env steps exactly
    as an ``envpool:`` env on the host (tests/test_envpool.py checks it bitwise). 64-bit arrays (MuJoCo's) cross as
    uint32 word pairs (:class:`PoolRef`).

    The state holds the pool itself: it cannot be stacked (``run.num_seeds``, replicas on the jax backend), stored in
    a checkpoint (a resumed run starts the episodes afresh, as host envs do) or sent to another process."""

    jittable = True
    host_simulator = True
    rowwise = True  # each env its own C++ simulator, seeded from its global index
    busy = None  # its steps run inside the replica's program: the stall watch sees a step that has not finished

    def shape_stand_in(self) -> Environment:
        stand_in = copy.copy(self)  # this env's shapes; its init makes zeros, no pool
        stand_in.host_simulator = False
        return stand_in

    def _zeros(self, n: int, ref: PoolRef | None, obs: Any = None) -> EnvPoolXlaState:
        zeros, counts = jnp.zeros(n, jnp.float32), jnp.zeros(n, jnp.int32)
        obs = jnp.zeros((n, *self.spec.obs_shape), self.spec.obs_dtype) if obs is None else jnp.asarray(obs)
        handle = jnp.zeros(8, jnp.uint8) if ref is None else jnp.asarray(ref.handle)
        return EnvPoolXlaState(handle, obs, zeros, zeros, counts, counts, counts, jnp.ones(n, jnp.bool_), ref)

    def init(self, key: jax.Array, env_ids: Any) -> EnvPoolXlaState:
        if not self.host_simulator:
            return self._zeros(len(env_ids), None)
        import envpool

        env_ids = np.asarray(env_ids)
        n = len(env_ids)
        pool = envpool.make(self.name, env_type="gymnasium", num_envs=n, batch_size=1, seed=env_seeds(key, env_ids),
                            **self.kwargs)
        pool.async_reset()
        obs = np.zeros((n, *self.spec.obs_shape), self.spec.obs_dtype)
        for _ in range(n):
            o, _, _, _, info = pool.recv()
            obs[int(info["env_id"][0])] = np.asarray(o[0])
        return self._zeros(n, PoolRef(pool), obs)

    def reset(self, state: EnvPoolXlaState):
        raise ConfigError("env.xla", f"envpool:{self.name} with env.xla cannot reset every env inside the program "
                          "(msrl.env_reset); EnvPool's XLA interface only steps. Leave env.xla off for this loop")

    def step(self, state: EnvPoolXlaState, action: jax.Array):
        space, n = self.spec.action_space, state.obs.shape[0]
        dtype = self.spec.obs_dtype
        if isinstance(space, Box):
            action = jnp.clip(action.astype(jnp.float32), space.low, space.high)
            noop = jnp.clip(jnp.zeros((1, *space.shape), jnp.float32), space.low, space.high)
        else:
            noop = jnp.zeros(1, jnp.int32)
        action = action.astype(noop.dtype)
        zeros_f, zeros_b = jnp.zeros(n, jnp.float32), jnp.zeros(n, jnp.bool_)
        if state.ref is None:  # the shape stand-in
            final, reward, terminated, truncated, handle = state.obs, zeros_f, zeros_b, zeros_b, state.handle
            obs, score, game_end = final, reward, terminated
        else:
            send, recv = state.ref.send, state.ref.recv

            def send_one(i, handle):  # env i gets its action
                return send(handle, jax.lax.dynamic_slice_in_dim(action, i, 1), i[None])

            def recv_one(_, carry):  # whichever env finished first, put at its index
                handle, obs, reward, terminated, truncated, score, game_over = carry
                handle, (o, r, te, tr, info) = recv(handle)
                e = info["env_id"][0]
                raw, over = (info["reward"][0], info["terminated"][0]) if self._atari else (r[0], te[0])
                return (handle, obs.at[e].set(o[0].astype(dtype)), reward.at[e].set(r[0].astype(jnp.float32)),
                        terminated.at[e].set(te[0]), truncated.at[e].set(tr[0]),
                        score.at[e].set(raw.astype(jnp.float32)), game_over.at[e].set(over.astype(jnp.bool_)))

            handle = jax.lax.fori_loop(0, n, send_one, state.handle)
            handle, final, reward, terminated, truncated, score, game_over = jax.lax.fori_loop(
                0, n, recv_one, (handle, jnp.zeros_like(state.obs), zeros_f, zeros_b, zeros_b, zeros_f, zeros_b))
            terminated = terminated & ~truncated  # (as on the host)
            done = terminated | truncated
            game_end = (game_over | truncated) if self._atari else done

            def auto_reset(carry):  # the ended envs step once more: EnvPool's auto-reset, moved into this step
                handle, obs = carry
                ended, k = jnp.nonzero(done, size=n, fill_value=0)[0].astype(jnp.int32), done.sum()

                def recv_reset(_, carry):
                    handle, obs = carry
                    handle, (o, _, _, _, info) = recv(handle)
                    return handle, obs.at[info["env_id"][0]].set(o[0].astype(dtype))

                handle = jax.lax.fori_loop(0, k, lambda j, h: send(h, noop, ended[j][None]), handle)
                return jax.lax.fori_loop(0, k, recv_reset, (handle, obs))

            handle, obs = jax.lax.cond(done.any(), auto_reset, lambda carry: carry, (handle, final))
        state = state.replace(handle=handle, obs=obs, started=terminated | truncated,
                              **episode_counts(state, score, game_end))
        return state, EnvStep(obs, reward, terminated, truncated, final)

    # a functional env's: the current observations, and statistics from the same counters
    observe, stats, episode_counts = FunctionalEnv.observe, FunctionalEnv.stats, FunctionalEnv.episode_counts

    def starts(self, state: EnvPoolXlaState):
        return state, state.started

    def close(self, state: EnvPoolXlaState) -> None:
        if state.ref is not None:
            close = getattr(state.ref.pool, "close", None)
            if close is not None:
                close()
