"""Environments by id: ``gymnax:CartPole-v1``, ``jaxmarl:MPE_simple_spread_v3``, ``brax:ant``, ``envpool:CartPole-v1`` and so on. Other prefixes
register with :func:`register_env`."""

from __future__ import annotations

from typing import Callable

from msrl.components import Environment, MultiAgentSpec, Wrapper, vouched_rowwise
from msrl.errors import ConfigError, MsrlError, did_you_mean
from msrl.registry import _path

_MAKERS: dict[str, Callable[..., Environment]] = {}


def register_env(prefix: str):
    """Register ``maker(name, **kwargs) -> Environment`` for ids ``prefix:name``. A prefix another maker holds
    (a built-in's too) is refused; the same ``module:qualname`` again (a module imported twice) replaces it."""
    if not isinstance(prefix, str) or not prefix or ":" in prefix:
        raise ConfigError("env.id", f"register_env takes the prefix of ids PREFIX:NAME (a non-empty string without "
                          f"':'), got {prefix!r}")

    def wrap(maker):
        if not callable(maker):
            raise ConfigError("env.id", f"register_env({prefix!r}) decorates a function maker(name, **kwargs) -> "
                              f"msrl.Environment, got {type(maker).__name__}")
        held = _MAKERS.get(prefix)
        if held is not None and _path(held) != _path(maker):
            raise ConfigError("env.id", f"prefix {prefix!r} is already the maker {_path(held)}; register "
                              f"{_path(maker)} under another prefix")
        _MAKERS[prefix] = maker
        return maker

    return wrap


def make_env(env_id: str, subprocesses: int = 0, xla: bool = False, **kwargs) -> Environment:
    """The environment ``env_id`` made with ``kwargs``. One kwarg is msrl's, for every id: ``mask_obs``, a list of
    (flat) indices of the observation that read as 0 (``[1, 3]`` on CartPole hides the velocities: a partially
    observed task that needs memory). ``subprocesses`` (``env.subprocesses``): ``gymnasium:`` envs step in that
    many worker processes per replica; ``xla`` (``env.xla``): ``envpool:`` pools stepped from inside the jitted
    program."""
    mask = kwargs.pop("mask_obs", None)
    if subprocesses:
        if env_id.partition(":")[0] != "gymnasium":
            raise ConfigError("env.subprocesses", f"only gymnasium: environments step in worker processes; {env_id} "
                              "does not (envpool: steps in C++ threads already; gymnax:, brax: and jaxmarl: are "
                              "jitted). Leave it 0")
        kwargs["subprocesses"] = subprocesses
    if xla:
        if env_id.partition(":")[0] != "envpool":
            raise ConfigError("env.xla", f"only envpool: environments step through XLA calls; {env_id} does not "
                              "(gymnax:, brax: and jaxmarl: are jitted already). Leave it false")
        from msrl.envs.envpool_env import EnvPoolXlaEnv

        env = EnvPoolXlaEnv(env_id.partition(":")[2], **kwargs)
        return env if mask is None else MaskedObs(env, mask)
    env = _make(env_id, **kwargs)
    return env if mask is None else MaskedObs(env, mask)


class MaskedObs(Wrapper):
    """``env`` with some entries of its (flat) observation zeroed (``env.kwargs.mask_obs``); the rest is ``env``'s."""

    def __init__(self, env: Environment, indices):
        import numpy as np

        super().__init__(env)
        self.rowwise = vouched_rowwise(env)
        if isinstance(env.spec, MultiAgentSpec):
            raise ConfigError("env.kwargs.mask_obs", f"masks a single agent's observation; {env.spec.id} has "
                              f"{env.spec.num_agents} agents")
        size = int(np.prod(env.spec.obs_shape))
        if not isinstance(indices, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool)
                                                              for i in indices):
            raise ConfigError("env.kwargs.mask_obs", f"must be a list of observation indices, got {indices!r}")
        bad = [i for i in indices if not -size <= i < size]
        if bad:
            raise ConfigError("env.kwargs.mask_obs", f"indices {bad} are outside {env.spec.id}'s observation of "
                              f"{size} entries")
        keep = np.ones(size, np.float32)
        keep[list(indices)] = 0.0
        self.keep = keep.reshape(env.spec.obs_shape).astype(env.spec.obs_dtype)

    def _mask(self, obs):
        return obs * self.keep

    def observe(self, state):
        state, obs = self.env.observe(state)
        return state, self._mask(obs)

    def reset(self, state):
        state, obs = self.env.reset(state)
        return state, self._mask(obs)

    def step(self, state, action):
        from msrl.components import EnvStep, as_env_step

        state, out = self.env.step(state, action)
        out = as_env_step(out)
        final = None if out._final_obs is None else self._mask(out._final_obs)
        return state, EnvStep(self._mask(out.obs), out.reward, out.terminated, out.truncated, final)


def _make(env_id: str, **kwargs) -> Environment:
    prefix, sep, name = env_id.partition(":")
    if not sep:
        raise ConfigError("env.id", f"{env_id!r} is not an environment id; write PREFIX:NAME with PREFIX one of "
                          f"{sorted(_MAKERS)} (e.g. 'gymnax:CartPole-v1')")
    if prefix not in _MAKERS:
        typo = did_you_mean(prefix, _MAKERS)
        own = "" if typo else f" (an env of your own registers {prefix!r} when its module is imported: `msrl ... " \
            "--import FILE.py` or run.imports in the config)"
        raise ConfigError("env.id", f"{env_id!r} is not an environment id: no prefix {prefix!r} is registered; "
                          f"{typo}the prefixes: {sorted(_MAKERS)}{own}")
    maker = _MAKERS[prefix]
    try:
        env = maker(name, **kwargs)
    except MsrlError:
        raise
    except Exception as e:  # a maker of the user's: its error in one line (--debug: the traceback)
        import urllib.error

        offline = " (it downloads data as it is made: this machine could not fetch it)" \
            if isinstance(e, (urllib.error.URLError, ConnectionError)) else ""  # (gymnax's MNISTBandit: MNIST)
        raise ConfigError("env.kwargs" if kwargs and isinstance(e, TypeError) else "env.id", f"{_path(maker)} ("
                          f"{env_id}{f' with {kwargs}' if kwargs else ''}) raised {type(e).__name__}: {e}{offline}") \
            from e
    if not isinstance(env, Environment):
        what = "a gymnasium.Env: a Gymnasium env of your own takes a gymnasium: id (register it with gymnasium)" \
            if type(env).__module__.startswith("gymnasium") else f"{type(env).__name__}"
        raise ConfigError("env.id", f"{_path(maker)} made {env_id} as {what}, not an msrl.Environment")
    return env


@register_env("gymnax")
def _gymnax(name: str, **kwargs) -> Environment:
    from msrl.envs.gymnax_env import GymnaxEnv

    return GymnaxEnv(name, **kwargs)


@register_env("gymnasium")
def _gymnasium(name: str, **kwargs) -> Environment:
    from msrl.envs.gymnasium_env import GymnasiumEnv

    return GymnasiumEnv(name, **kwargs)


@register_env("envpool")
def _envpool(name: str, **kwargs) -> Environment:
    from msrl.envs.envpool_env import EnvPoolEnv

    return EnvPoolEnv(name, **kwargs)


@register_env("jaxmarl")
def _jaxmarl(name: str, **kwargs) -> Environment:
    from msrl.envs.jaxmarl_env import JaxMarlEnv

    return JaxMarlEnv(name, **kwargs)


@register_env("brax")
def _brax(name: str, **kwargs) -> Environment:
    from msrl.envs.brax_env import BraxEnv

    return BraxEnv(name, **kwargs)
