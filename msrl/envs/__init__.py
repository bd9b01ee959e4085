"""Environments by id: ``gymnax:CartPole-v1``, ``jaxmarl:MPE_simple_spread_v3``, ``brax:ant`` and so on. Other prefixes
register with :func:`register_env`."""

from __future__ import annotations

from typing import Callable

from msrl.components import Environment
from msrl.errors import ConfigError

_MAKERS: dict[str, Callable[..., Environment]] = {}


def register_env(prefix: str):
    """Register ``maker(name, **kwargs) -> Environment`` for ids ``prefix:name``."""

    def wrap(maker):
        _MAKERS[prefix] = maker
        return maker

    return wrap


def make_env(env_id: str, **kwargs) -> Environment:
    prefix, sep, name = env_id.partition(":")
    if not sep or prefix not in _MAKERS:
        raise ConfigError(
            "env.id",
            f"{env_id!r} is not an environment id; write PREFIX:NAME with PREFIX one of "
            f"{sorted(_MAKERS)} (e.g. 'gymnax:CartPole-v1')",
        )
    return _MAKERS[prefix](name, **kwargs)


@register_env("gymnax")
def _gymnax(name: str, **kwargs) -> Environment:
    from msrl.envs.gymnax_env import GymnaxEnv

    return GymnaxEnv(name, **kwargs)


@register_env("gymnasium")
def _gymnasium(name: str, **kwargs) -> Environment:
    from msrl.envs.gymnasium_env import GymnasiumEnv

    return GymnasiumEnv(name, **kwargs)


@register_env("jaxmarl")
def _jaxmarl(name: str, **kwargs) -> Environment:
    from msrl.envs.jaxmarl_env import JaxMarlEnv

    return JaxMarlEnv(name, **kwargs)


@register_env("brax")
def _brax(name: str, **kwargs) -> Environment:
    from msrl.envs.brax_env import BraxEnv

    return BraxEnv(name, **kwargs)
