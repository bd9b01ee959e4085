"""Adapter from a JaxMARL multi-agent environment (``jaxmarl:MPE_simple_spread_v3``, ...) to a batched,
jittable msrl :class:`~msrl.components.Environment`.

Agents are a batch axis, not new API calls: the observation is a :class:`~msrl.components.MultiAgentObs` with
every agent's observation ``[num_envs, num_agents, obs_dim]`` and a global state ``[num_envs, num_agents *
obs_dim]`` (all agents' observations, concatenated) for a centralized critic; actions are ``[num_envs,
num_agents]``; the reward ``[num_envs]`` is the mean of the agents' rewards (shared), and an environment is done
when all its agents are. JaxMARL's ``step`` resets an environment whose episode ended.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import os
import sys
import types
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from msrl.components import Box, Discrete, MultiAgentObs, MultiAgentSpec
from msrl.envs.gymnax_env import FunctionalEnv, defer_plotting, in_tiles
from msrl.errors import ConfigError, did_you_mean


def _jaxmarl():
    """``import jaxmarl``, which prints about optional environments on stdout and, trying one, sets
    ``sys.stdout``/``sys.stderr`` to the process's own: silence file descriptor 1 and put both back."""
    module = sys.modules.get("jaxmarl")
    if module is not None and not isinstance(module, _Unrun):
        return module
    streams = sys.stdout, sys.stderr
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            import jaxmarl
            _ = jaxmarl.make  # (runs the package's own import, if only its MPE envs were imported so far)
            sys.__stdout__.flush()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        sys.stdout, sys.stderr = streams
    return jaxmarl


# jaxmarl.make's MPE ids and what makes each in jaxmarl.environments.mpe (tests/test_mappo.py checks them against it)
MPE = {"MPE_simple_v3": "SimpleMPE", "MPE_simple_tag_v3": "SimpleTagMPE",
       "MPE_simple_world_comm_v3": "SimpleWorldCommMPE", "MPE_simple_spread_v3": "SimpleSpreadMPE",
       "MPE_simple_crypto_v3": "SimpleCryptoMPE", "MPE_simple_speaker_listener_v4": "SimpleSpeakerListenerMPE",
       "MPE_simple_push_v3": "SimplePushMPE", "MPE_simple_adversary_v3": "SimpleAdversaryMPE",
       "MPE_simple_reference_v3": "SimpleReferenceMPE", "MPE_simple_facmac_v1": "SimpleFacmacMPE",
       "MPE_simple_facmac_3a_v1": "SimpleFacmacMPE3a", "MPE_simple_facmac_6a_v1": "SimpleFacmacMPE6a",
       "MPE_simple_facmac_9a_v1": "SimpleFacmacMPE9a"}


class _Unrun(types.ModuleType):
    """A package in ``sys.modules`` whose own ``__init__`` has not run yet: its submodules import as usual, and
    the first read of anything else runs it (importing all it imports) into this module, which then is the
    package as a plain ``import`` makes it."""

    def __init__(self, spec: Any):
        super().__init__(spec.name)
        self.__spec__, self.__loader__, self.__file__ = spec, spec.loader, spec.origin
        self.__path__, self.__package__ = list(spec.submodule_search_locations), spec.name

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__") and attr not in ("__all__", "__version__"):  # a probe (pickle's whichmodule, ...)
            raise AttributeError(f"module {self.__name__!r} has no attribute {attr!r}")
        self.__class__ = types.ModuleType  # (once: later reads find what the __init__ defined)
        try:
            self.__spec__.loader.exec_module(self)
        except BaseException:  # as a failed import: not left in sys.modules half made
            sys.modules.pop(self.__name__, None)
            raise
        return getattr(self, attr)


def _without_package_import() -> None:
    """Let JaxMARL's modules import without its package import, which imports every JaxMARL environment (STORM,
    SMAX, JaxNav, and MABrax with Brax and MuJoCo): ~3 s at every start of a process that makes or unpickles an
    MPE env (each Ray actor of MAPPO, say). ``jaxmarl`` and ``jaxmarl.environments`` wait in ``sys.modules``
    (:class:`_Unrun`) until something reads more of them than the modules it imports."""
    spec = None if "jaxmarl" in sys.modules else importlib.util.find_spec("jaxmarl")
    if spec is not None:
        defer_plotting()  # (the MPE visualizer imports matplotlib.pyplot at its import)
        package = sys.modules["jaxmarl"] = _Unrun(spec)
        package.environments = sys.modules["jaxmarl.environments"] = _Unrun(
            importlib.util.find_spec("jaxmarl.environments"))


def _mpe_make(name: str) -> Any:
    """What makes JaxMARL's MPE env ``name`` (its class, or JaxMARL's function for it): ``jaxmarl.make(name)``."""
    _without_package_import()
    return getattr(importlib.import_module("jaxmarl.environments.mpe"), MPE[name])


TILE = 8  # envs stepped together (in_tiles): the MAPPO example's speed unchanged


class JaxMarlEnv(FunctionalEnv):
    rowwise = True  # each environment stepped alone (vmapped, in tiles), its keys from its global index
    _import_library = staticmethod(_without_package_import)

    def __init__(self, name: str, **kwargs: Any):
        if name in MPE:
            make = _mpe_make(name)
        else:
            jaxmarl = _jaxmarl()
            if name not in jaxmarl.registered_envs:
                raise ConfigError("env.id", f"'jaxmarl:{name}' is not a JaxMARL environment; "
                                  f"{did_you_mean(name, jaxmarl.registered_envs)}known: "
                                  f"{', '.join(jaxmarl.registered_envs)}")
            make = functools.partial(jaxmarl.make, name)
        try:
            self.env = make(**kwargs)
        except Exception as e:  # noqa: BLE001 - whatever the env's constructor raises on bad arguments
            raise ConfigError("env.kwargs", f"jaxmarl:{name} rejected {kwargs}: {type(e).__name__}: {e}") from None
        unknown = [k for k in kwargs if k not in _parameters(type(self.env)) and not hasattr(self.env, k)]
        if unknown:  # JaxMARL's constructors take **kwargs and ignore what they do not know
            raise ConfigError(f"env.kwargs.{unknown[0]}", f"jaxmarl:{name} does not take it; it takes "
                              f"{', '.join(sorted(_parameters(type(self.env))))}")
        self.agents = list(self.env.agents)
        if not self.agents:
            raise ConfigError("env.kwargs", f"jaxmarl:{name} made with {kwargs} has no agents")
        spaces = [self.env.observation_space(a) for a in self.agents]
        if any(not hasattr(sp, "shape") for sp in spaces):  # (storm's is a dict: an AttributeError in msrl)
            raise ConfigError("env.id", f"jaxmarl:{name}: its agents' observation space is a "
                              f"{type(spaces[0]).__name__}, not an array's (a Box); msrl's agents read arrays")
        try:  # what reset returns, which JaxMARL's overcooked declares otherwise ((5, 4, 26); it returns (4, 5, 26))
            first = jax.eval_shape(self.env.reset, jax.random.PRNGKey(0))[0]
            obs_spaces = {tuple(first[a].shape) for a in self.agents}
        except Exception:  # noqa: BLE001 - its declared spaces, then
            obs_spaces = {tuple(np.atleast_1d(sp.shape).tolist()) for sp in spaces}
        act_spaces = {_describe(self.env.action_space(a)) for a in self.agents}
        if len(obs_spaces) > 1 or len(act_spaces) > 1:
            raise ConfigError("env.id", f"jaxmarl:{name}: its agents have different observation or action spaces "
                              f"({sorted(obs_spaces)}, {sorted(act_spaces)}); msrl needs them alike (agents are a "
                              "batch axis)")
        space, obs_shape, n = self.env.action_space(self.agents[0]), obs_spaces.pop(), len(self.agents)
        action_space = Discrete(int(space.n)) if hasattr(space, "n") else Box(space.low, space.high, space.shape)
        self.spec = MultiAgentSpec(f"jaxmarl:{name}", obs_shape, np.dtype(np.float32), action_space,
                                   num_agents=n, state_shape=(n * int(np.prod(obs_shape)),))
        base = next((c for c in type(self.env).__mro__ if c.__name__ == "MultiAgentEnv"), object)  # (whose
        masked = [m for m in ("get_avail_actions", "get_legal_moves") if callable(getattr(self.env, m, None))
                  and getattr(type(self.env), m, None) is not getattr(base, m, None)]  # get_avail_actions raises)
        if masked:  # (SMAX, Hanabi trained without a word, choosing unavailable actions: 71 % of SMAX's greedy ones)
            raise ConfigError("env.id", f"jaxmarl:{name} masks its agents' actions ({masked[0]}: some are unavailable "
                              "in some states), which msrl's agents do not read: they would choose unavailable "
                              "actions; use an environment without action masks")

    def _observation(self, obs: dict[str, jax.Array]) -> MultiAgentObs:
        agents = jnp.stack([obs[a] for a in self.agents], axis=1).astype(jnp.float32)  # [num_envs, agents, ...]
        return MultiAgentObs(agents, agents.reshape(agents.shape[0], -1))

    def _reset(self, keys):
        obs, inner = in_tiles(jax.vmap(self.env.reset), TILE)(keys)
        return self._observation(obs), inner

    def _step(self, keys, inner, action):
        def one(key, state, act):  # act: [num_agents, *action_shape] of one environment
            obs, state, reward, done, _ = self.env.step(key, state, {a: act[i] for i, a in enumerate(self.agents)})
            return obs, state, jnp.mean(jnp.stack([reward[a] for a in self.agents])), done["__all__"]

        obs, inner, reward, done = in_tiles(jax.vmap(one), TILE)(keys, inner, action)
        # JaxMARL reports no truncation: every end counts as terminal, and the final observation is not kept
        return self._observation(obs), inner, reward.astype(jnp.float32), done, done & False, None


def _parameters(cls: type) -> set[str]:
    """The named parameters of the constructors of ``cls`` and its bases."""
    return {name for c in cls.__mro__ if "__init__" in vars(c)
            for name, p in inspect.signature(c.__init__).parameters.items()
            if name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}


def _describe(space: Any) -> tuple:
    return ("discrete", int(space.n)) if hasattr(space, "n") else ("box", tuple(space.shape))
