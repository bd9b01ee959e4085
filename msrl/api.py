"""The interaction API a training loop is written with.

None of these functions takes component state: the compiler threads each component's state through the
loop (``agent_act`` reads the actor's state and the learner's policy parameters, ``agent_learn`` writes the
learner's state, ...). Called outside a loop compiled by :func:`msrl.compile` they raise, because they have
no meaning there.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable

from msrl.errors import MsrlError


@dataclasses.dataclass(frozen=True)
class ApiSpec:
    """What an API call does to component state, for the compiler."""

    name: str
    component: str  # the component whose method it calls
    method: str  # that component's method
    reads: tuple[str, ...]  # states read; "params" is the learner's policy parameters
    writes: tuple[str, ...]  # states written
    signature: inspect.Signature
    returns: str  # short description, for docs and errors


API: dict[str, ApiSpec] = {}


def _api(component: str, method: str, reads: tuple[str, ...], writes: tuple[str, ...], returns: str):
    def wrap(fn: Callable) -> Callable:
        spec = ApiSpec(fn.__name__, component, method, reads, writes, inspect.signature(fn), returns)
        API[fn.__name__] = spec

        def outside(*args: Any, **kwargs: Any):
            caller = inspect.currentframe().f_back  # (it named no place: a call in __init__, say, was a riddle)
            where = f"{caller.f_code.co_filename}:{caller.f_lineno}: " if caller is not None else ""
            within = f" (here in {caller.f_code.co_name}())" if caller is not None else ""
            raise MsrlError(
                f"{where}msrl.{spec.name}() was called directly{within}. The API is the training loop's: msrl "
                "compiles an algorithm's train_step() (and helper methods it calls) into its program, where each "
                "call runs; call it there, not from __init__, a component's method or your own code"
            )

        outside.__name__ = outside.__qualname__ = fn.__name__
        outside.__doc__ = fn.__doc__
        outside.__signature__ = spec.signature  # type: ignore[attr-defined]
        outside.__msrl_api__ = spec  # type: ignore[attr-defined]
        return outside

    return wrap


@_api("env", "observe", ("env",), (), "obs")
def env_observe():
    """The current observation of every environment, ``[num_envs, *obs_shape]``."""


@_api("env", "starts", ("env",), (), "starts")
def env_starts():
    """Which environments' current observation starts an episode, ``bool [num_envs]`` (the previous step's
    ``done``; all true after a reset). What a recurrent loop hands ``agent_act`` first in every iteration."""


@_api("env", "reset", ("env",), ("env",), "obs")
def env_reset():
    """Reset every environment; returns the first observations."""


@_api("env", "transition", ("env",), ("env",), "EnvStep")
def env_step(action):
    """Step every environment (auto-reset on episode end). Returns an :class:`msrl.EnvStep`, which unpacks as
    ``next_obs, reward, done`` and also has ``.terminated``, ``.truncated`` and ``.final_obs``."""


@_api("actor", "act", ("actor", "params"), ("actor",), "ActOutput")
def agent_act(obs, done=None):
    """The actor's output (action, and whatever else the algorithm's actor returns) for ``obs``.

    ``done`` (optional, ``bool [num_envs]``): where ``obs`` starts a new episode (the previous step's ``done``,
    or ``msrl.env_starts()`` at the start of an iteration). A recurrent actor keeps one hidden state per
    environment in its state and resets it where ``done`` is set; an actor that keeps no state takes no
    ``done`` (passing one to it is a compile error)."""


@_api("learner", "learn", ("learner",), ("learner", "params"), "metrics")
def agent_learn(batch, **kwargs):
    """Update the learner on ``batch``; returns its metrics. New policy parameters flow to the actors."""


@_api("buffer", "insert", ("buffer",), ("buffer",), "None")
def buffer_insert(item):
    """Insert one item (a pytree batched over environments) into the buffer."""


@_api("buffer", "get", ("buffer",), ("buffer",), "batch")
def buffer_get():
    """Everything inserted since the last get (on-policy rollout storage); empties the buffer."""


@_api("buffer", "sample", ("buffer",), ("buffer",), "batch")
def buffer_sample(batch_size=None):
    """A random batch from the buffer (replay buffers: a :class:`msrl.replay.Sample` of the items, their
    indices and importance weights)."""


@_api("buffer", "update", ("buffer",), ("buffer",), "None")
def buffer_update(indices, priorities):
    """Set new priorities of sampled entries (``Sample.indices``): prioritized replay's priority update."""


def api_spec(obj: Any) -> ApiSpec | None:
    """The :class:`ApiSpec` of an API function object, or None for anything else."""
    return getattr(obj, "__msrl_api__", None)
