"""Adapter from a gymnax environment to a batched msrl :class:`~msrl.components.Environment`.

:class:`FunctionalEnv` holds what every adapter of a functional (jittable, auto-resetting) environment
library shares: per-environment key chains, the observation of every env, and the episode statistics. An
adapter supplies only the batched ``_reset`` and ``_step`` of its library (gymnax here, JaxMARL in
:mod:`msrl.envs.jaxmarl_env`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import importlib
import importlib.util
import sys
import types
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from msrl.components import (Box, Discrete, Environment, EnvSpec, EnvStep, MultiAgentSpec, per_env_keys,
                             split_keys)
from msrl.errors import ConfigError, did_you_mean


@struct.dataclass
class EnvState:
    inner: Any  # the library's state of every env (batched)
    obs: Any  # [N, *obs_shape] (a pytree of such arrays for multi-agent envs)
    keys: jax.Array  # [N, 2] per-environment key chains
    running_return: jax.Array  # [N] return of the episode in progress
    last_return: jax.Array  # [N] return of the last completed episode
    episodes: jax.Array  # [N] completed episodes
    running_length: jax.Array  # [N] steps of the episode in progress
    last_length: jax.Array  # [N] steps of the last completed episode


def episode_counts(state: Any, reward: jax.Array, done: jax.Array) -> dict[str, jax.Array]:
    """The episode counters of ``state`` (:class:`EnvState`'s) after a step that paid ``reward`` and ended ``done``."""
    ret, length = state.running_return + reward, state.running_length + 1
    return {"running_return": jnp.where(done, 0.0, ret), "last_return": jnp.where(done, ret, state.last_return),
            "episodes": state.episodes + done.astype(jnp.int32), "running_length": jnp.where(done, 0, length),
            "last_length": jnp.where(done, length, state.last_length)}


def _unpickle(import_library: Any, data: bytes) -> Any:
    import cloudpickle

    import_library()
    cls, state = cloudpickle.loads(data)
    env = cls.__new__(cls)
    env.__dict__.update(state)
    return env


def in_tiles(fn: Any, tile: int) -> Any:
    """``fn`` over a batch (the leading axis of every argument), computed ``tile`` rows at a time by a loop of at
    least two tiles (the rows past the batch copies of its first): each environment's numbers the same whatever the
    batch. XLA's CPU compiler emits an op by its size, and its emitters contract a product and a sum into one fused
    multiply-add in some and not in others: MPE's ``sqrt(sum(square(delta)))`` of a contact rounded ~1e-7 apart on
    32 environments and on 64, which made a run on 2 actors x 32 envs leave ``fused`` on 64 (1.6e-4 in the
    parameters after one iteration); Brax's halfcheetah stepped 1, 8 or 64 envs 1e-5..3e-4 apart after 8 steps. In a
    loop the ops are a tile's size on any batch (one tile alone would not be a loop: XLA inlines it). On CPU only:
    msrl claims no bitwise split elsewhere, and a loop of small tiles would forgo an accelerator's width."""
    if jax.default_backend() != "cpu":
        return fn

    def tiled(*args: Any) -> Any:
        n = jax.tree.leaves(args)[0].shape[0]
        size = max(-(-n // tile), 2) * tile
        padded = jax.tree.map(lambda x: jnp.concatenate([x, jnp.broadcast_to(x[:1], (size - n, *x.shape[1:]))]), args)
        out = jax.lax.map(lambda a: fn(*a), jax.tree.map(lambda x: x.reshape(-1, tile, *x.shape[1:]), padded))
        return jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:])[:n], out)

    return tiled


class FunctionalEnv(Environment):
    """A batch of functional environments with auto-reset; subclasses define ``_reset`` and ``_step``."""

    @staticmethod
    def _import_library() -> None:
        """Import the env's library as the adapter does (e.g. :func:`import_gymnax`)."""

    def __reduce__(self):
        """Pickled, the library is imported the adapter's way before the state's objects import it: a Ray actor
        or subprocess that loads a gymnax env starts about a second sooner."""
        import cloudpickle

        return _unpickle, (self._import_library, cloudpickle.dumps((type(self), self.__dict__)))

    def _reset(self, keys: jax.Array) -> tuple[Any, Any]:
        """``(obs, inner)`` of freshly reset environments, one per key."""
        raise NotImplementedError

    def _step(self, keys: jax.Array, inner: Any, action: jax.Array) -> tuple[Any, Any, jax.Array, jax.Array, Any, Any]:
        """``(obs, inner, reward [N] float32, terminated [N] bool, truncated [N] bool, final_obs)``; an env whose
        episode ended is reset (``final_obs``: its observation before, or None if the library does not say)."""
        raise NotImplementedError

    def init(self, key: jax.Array, env_ids: jax.Array) -> EnvState:
        keys, reset_keys = split_keys(per_env_keys(key, env_ids))
        obs, inner = self._reset(reset_keys)
        zeros, counts = jnp.zeros(keys.shape[0], jnp.float32), jnp.zeros(keys.shape[0], jnp.int32)
        return EnvState(inner, obs, keys, zeros, zeros, counts, counts, counts)

    def observe(self, state: EnvState):
        return state, state.obs

    def starts(self, state: EnvState):
        return state, state.running_length == 0

    def reset(self, state: EnvState):
        keys, reset_keys = split_keys(state.keys)
        obs, inner = self._reset(reset_keys)
        return state.replace(inner=inner, obs=obs, keys=keys, running_return=jnp.zeros_like(state.running_return),
                             running_length=jnp.zeros_like(state.running_length)), obs

    def step(self, state: EnvState, action: jax.Array):
        if isinstance(self.spec.action_space, Box):
            action = jnp.clip(action, self.spec.action_space.low, self.spec.action_space.high)
        keys, step_keys = split_keys(state.keys)
        obs, inner, reward, terminated, truncated, final_obs = self._step(step_keys, state.inner, action)
        space = self.spec.action_space
        if isinstance(space, Discrete) and not isinstance(self.spec, MultiAgentSpec):  # gymnax takes any integer
            # (CartPole's action 4 pushes 7x as hard): its reward is NaN, which the NaN guard stops the run at
            reward = jnp.where((action < 0) | (action >= space.n), jnp.nan, reward)
        state = EnvState(inner, obs, keys, **episode_counts(state, reward, terminated | truncated))
        return state, EnvStep(obs, reward, terminated, truncated, final_obs)

    def episode_counts(self, state: EnvState):
        return state.episodes, state.last_return

    def stats(self, state: EnvState):
        finished = state.episodes > 0
        bad = sum(jnp.sum(~jnp.isfinite(x)) for x in jax.tree.leaves(state.obs)) + \
            jnp.sum(~jnp.isfinite(state.running_return))
        return {"return_sum": jnp.sum(jnp.where(finished, state.last_return, 0.0)), "finished": finished.sum(),
                "length_sum": jnp.sum(jnp.where(finished, state.last_length, 0)),
                "episodes": state.episodes.sum(), "nonfinite": bad}


class _Deferred(types.ModuleType):
    """Stands in ``sys.modules`` for a module not imported yet: the first attribute read imports it (and puts
    the real module in its place), every read is forwarded to it. A package's stand-in gives its submodules'
    stand-ins as they are (``import matplotlib.pyplot as plt`` reads ``pyplot`` of ``matplotlib``)."""

    def __init__(self, name: str, path: list[str] | None = None):
        super().__init__(name)
        self.__spec__ = None  # (what `import` checks of a module found in sys.modules)
        if path is not None:  # a package's (`from package import x` reads it)
            self.__path__ = path

    def __getattr__(self, attr: str) -> Any:
        child = sys.modules.get(f"{self.__name__}.{attr}")
        if isinstance(child, _Deferred):
            return child
        if sys.modules.get(self.__name__) is self:
            del sys.modules[self.__name__]
        return getattr(importlib.import_module(self.__name__), attr)


@contextlib.contextmanager
def standing_in(entries: dict[str, Any]) -> Any:
    """``entries`` in ``sys.modules`` for the block (a stand-in, or ``None``: what makes ``import name`` raise
    ImportError); afterwards each leaves again unless the block put something else in its place."""
    sys.modules.update(entries)
    try:
        yield
    finally:
        for name, value in entries.items():
            if name in sys.modules and sys.modules[name] is value:
                del sys.modules[name]


def defer_plotting() -> None:
    """Leave the plotting packages that env libraries import for their render functions (seaborn, which
    brings pandas and scipy.stats; matplotlib.pyplot and matplotlib.animation) to import on first use."""
    for name in ("seaborn", "matplotlib.pyplot", "matplotlib.animation"):
        if name not in sys.modules:
            sys.modules[name] = _Deferred(name)


def import_gymnax() -> Any:
    """``import gymnax``, with the plotting packages its package import pulls in for a few envs' render
    functions left to import on first use (:func:`defer_plotting`): about a second less at every start.
    While gymnax imports, matplotlib itself and ``matplotlib.colors`` (which its Pong imports) stand in too
    (another ~0.2 s); their stand-ins leave ``sys.modules`` afterwards, so whoever imports them next gets them,
    and gymnax's own references import them on first use."""
    if "gymnax" not in sys.modules:
        defer_plotting()
        package = None if "matplotlib" in sys.modules else importlib.util.find_spec("matplotlib")
        during = {} if package is None else {"matplotlib": _Deferred("matplotlib", package.submodule_search_locations),
                                             "matplotlib.colors": _Deferred("matplotlib.colors")}
        with standing_in(during):
            import gymnax
    import gymnax

    return gymnax


def gymnax_step() -> Any:
    """gymnax's ``Environment.step`` (step, then auto-reset), which :meth:`GymnaxEnv._step` writes out."""
    from gymnax.environments.environment import Environment

    return Environment.step


class GymnaxEnv(FunctionalEnv):
    rowwise = True  # each environment stepped alone (vmapped), its keys from its global index
    _import_library = staticmethod(import_gymnax)

    def __init__(self, name: str, **kwargs: Any):
        gymnax = import_gymnax()

        if name not in gymnax.registered_envs:
            raise ConfigError(
                "env.id", f"'gymnax:{name}' is not a gymnax environment; {did_you_mean(name, gymnax.registered_envs)}"
                f"known: {', '.join(gymnax.registered_envs)}"
            )
        # env.kwargs: the constructor's, and the fields of its EnvParams (CartPole's max_steps_in_episode)
        self.env, self.params = gymnax.make(name)
        fields = {f.name: f for f in dataclasses.fields(self.params)}
        given = {k: v for k, v in kwargs.items() if k in fields}
        takes = inspect.signature(type(self.env)).parameters
        if not any(p.kind is p.VAR_KEYWORD for p in takes.values()):
            known = [*fields, *(k for k, p in takes.items() if p.kind is not p.VAR_POSITIONAL)]
            for key in (k for k in kwargs if k not in known):  # (a typo of a parameter: named with the closest one)
                raise ConfigError(f"env.kwargs.{key}", f"gymnax:{name} takes no parameter {key!r}; "
                                  f"{did_you_mean(key, known)}its parameters: {', '.join(known) or 'none'}")
        try:
            if len(given) < len(kwargs):  # the constructor's arguments: make it again with them
                self.env, self.params = gymnax.make(name, **{k: v for k, v in kwargs.items() if k not in fields})
        except Exception as e:  # noqa: BLE001 - whatever the env's constructor raises on bad arguments
            raise ConfigError("env.kwargs", f"gymnax:{name} rejected {kwargs}: {type(e).__name__}: {e} (its "
                              f"parameters, also env.kwargs: {', '.join(fields) or 'none'})") from None
        for key, value in given.items():
            default = getattr(self.params, key)
            number = isinstance(value, bool) if isinstance(default, bool) else \
                isinstance(value, int | float) and not isinstance(value, bool)
            if not number or (isinstance(value, float) and np.issubdtype(np.asarray(default).dtype, np.integer)):
                raise ConfigError(f"env.kwargs.{key}", f"gymnax:{name}'s parameter {key} is "
                                  f"{type(default).__name__} (default {default!r}), got {value!r}")
            if key == "max_steps_in_episode" and value < 1:  # (0 ended every episode after one step)
                raise ConfigError(f"env.kwargs.{key}", f"must be a whole number >= 1 (steps before an episode is "
                                  f"cut off; default {default}), got {value!r}")
        self.params = self.params.replace(**given)
        space = self.env.action_space(self.params)
        if hasattr(space, "n"):
            action_space = Discrete(int(space.n))
        else:
            action_space = Box(space.low, space.high, space.shape)
        # what reset gives, not what the space says: Catch-bsuite's space is int32 and its observations float32
        obs = jax.eval_shape(lambda key: self.env.reset(key, self.params)[0], jax.random.PRNGKey(0))
        self.spec = EnvSpec(f"gymnax:{name}", tuple(obs.shape), np.dtype(obs.dtype), action_space)

    def _reset(self, keys):
        return jax.vmap(self.env.reset, in_axes=(0, None))(keys, self.params)

    def _step(self, keys, inner, action):
        env, params = self.env, self.params
        if type(env).step is not gymnax_step():  # an env with its own step (DeepSea-bsuite)
            obs, inner, reward, terminated, truncated, info = jax.vmap(env.step, in_axes=(0, 0, 0, None))(
                keys, inner, action, params)
            final_obs = info["final_observation"]
        else:  # gymnax's own step, except that on CPU the auto-reset runs only on a step where some episode ended
            halves = jax.vmap(jax.random.split)(keys)  # gymnax's (step key, reset key) of every env
            final_obs, state, reward, terminated, _ = jax.vmap(env.step_env, in_axes=(0, 0, 0, None))(
                halves[:, 0], inner, action, params)
            truncated = jax.vmap(env.is_truncated, in_axes=(0, None))(state, params)
            done = jnp.logical_or(terminated, truncated)

            def reset(_):  # every env reset, kept where done. The split is redone here: where step_env takes
                # no key (CartPole, Pendulum, ...), the one above is dead code and this is the only one
                reset_keys = jax.vmap(jax.random.split)(keys)[:, 1]
                obs_re, state_re = jax.vmap(env.reset_env, in_axes=(0, None))(reset_keys, params)

                def pick(re, st):
                    where = jnp.broadcast_to(done.reshape(done.shape + (1,) * (st.ndim - 1)), st.shape)
                    return jax.lax.select(where, re, st)
                return jax.tree.map(pick, obs_re, final_obs), jax.tree.map(pick, state_re, state)

            # on an accelerator a condition costs a round trip to the host at every step: reset every step there
            obs, inner = jax.lax.platform_dependent(None, default=reset, cpu=lambda _: jax.lax.cond(
                done.any(), reset, lambda _: (final_obs, state), None))
        terminated = jnp.asarray(terminated, bool)  # (gymnax >= 1.0.1: the state's own end, no time limit)
        truncated = jnp.asarray(truncated, bool) & ~terminated  # a terminal state on the time limit's step is
        # terminal, as Gymnasium has it
        return obs, inner, reward.astype(jnp.float32), terminated, truncated, final_obs
