"""A worker process that steps some of a replica's ``gymnasium:`` environments (``env.subprocesses > 0``).

The parent starts it as a plain script (``python gym_worker.py FD``), so it imports numpy and Gymnasium and
nothing of msrl or JAX (unless the env's module does), and re-runs none of the user's ``__main__``. Its first
message is the parent's ``sys.path``; then the env comes as the parent's Gymnasium ``EnvSpec``, so an env registered
by an importable module of the user's works here too. The two talk over a socket pair with
:class:`multiprocessing.connection.Connection` (pickled messages). Each request is ``(command, argument)``; each
answer ``("ok", value)`` or ``("error", (position, message, traceback))``. The worker steps its envs exactly as
:class:`~msrl.envs.gymnasium_env.GymnasiumEnv` does in-process (:func:`step_one`), so the numbers are the same;
the parent checks what comes back. When the parent goes away, the socket closes and the worker ends (a watcher
thread ends it too, should an env's step hang).
"""

from __future__ import annotations

import sys
import traceback
from typing import Any

import numpy as np


def step_one(env: Any, action: Any) -> tuple[Any, Any, bool, bool, Any]:
    """One step of one env with msrl's auto-reset in the same step: ``(obs, reward, terminated, truncated,
    first)``, where ``first`` is the next episode's first observation if this step ended one (else None). A
    terminal state is terminal even on the time limit's step (the env says both): it is not bootstrapped."""
    try:
        out = env.step(action)
    except ValueError as e:  # a wrapper of Gymnasium's (TimeLimit) unpacking what the env returned
        if "values to unpack" not in str(e) or "gymnasium" not in traceback.extract_tb(e.__traceback__)[-1].filename:
            raise
        out = None
    if not isinstance(out, tuple) or len(out) != 5:
        got = "what Gymnasium's wrappers cannot unpack" if out is None else _count(out)
        raise TypeError(f"{_named(env)}.step() returned {got}; Gymnasium's API returns "
                        "(obs, reward, terminated, truncated, info) (an env of the old Gym API returns 4)")
    obs, reward, terminated, truncated, _ = out
    terminated = _flag(env, "terminated", terminated)
    truncated = _flag(env, "truncated", truncated) and not terminated
    return obs, reward, terminated, truncated, reset_one(env) if terminated or truncated else None


def reset_one(env: Any, seed: int | None = None, spaces: tuple | None = None) -> Any:
    """The first observation of a new episode of ``env``; first, where ``spaces`` are given (a new env's), that
    its observation and action spaces are those (the spaces the run was built for, its first env's)."""
    for what, space, want in zip(("observation", "action"), (env.observation_space, env.action_space), spaces or ()):
        if space != want:  # (its actions would be another space's: out of range, or never all taken)
            raise ValueError(f"its {what} space is {space}, but the run's (its first environment's) is {want}: "
                             "the environments of a run must have the same spaces")
    out = env.reset(seed=seed) if seed is not None else env.reset()
    if not isinstance(out, tuple) or len(out) != 2:
        raise TypeError(f"{_named(env)}.reset() returned {_count(out)}; Gymnasium's API returns "
                        "(obs, info) (an env of the old Gym API returns the observation alone)")
    return out[0]


def _named(env: Any) -> str:
    """The env as its author knows it: their wrappers around the env class, Gymnasium's own (``gymnasium.make``'s
    time limit, ...) left out: ``DoneArray(CartPoleEnv)``."""
    names = []
    while hasattr(env, "env") and hasattr(env, "unwrapped") and env is not env.unwrapped:
        if not type(env).__module__.startswith("gymnasium."):
            names.append(type(env).__name__)
        env = env.env
    return "(".join([*names, type(env).__name__]) + ")" * len(names)


def _flag(env: Any, name: str, value: Any) -> bool:
    """``terminated`` or ``truncated`` as a bool: a bool, or a number that is 0 or 1 (numpy's too); else a
    TypeError (a string or None read as a bool would end episodes the env did not end, or none)."""
    if value is True or value is False:
        return value
    flag = None if isinstance(value, (str, bytes)) or value is None else np.asarray(value)
    if flag is None or flag.size != 1 or flag.dtype.kind not in "biuf" or flag.reshape(()) not in (0, 1):
        raise TypeError(f"{_named(env)}.step() returned {name}={value!r} "
                        f"({type(value).__name__}); Gymnasium's API returns a bool")
    return bool(flag.reshape(()))


def env_trace(e: BaseException) -> str:
    """The traceback of an env's exception, its own frames only: not this package's (msrl's own checks have
    none) nor Gymnasium's wrappers'."""
    import os

    skip = [os.path.dirname(os.path.abspath(__file__)) + os.sep]
    if "gymnasium" in sys.modules:  # its wrappers (TimeLimit, OrderEnforcing ...): not its own envs
        home = os.path.dirname(os.path.abspath(sys.modules["gymnasium"].__file__))
        skip += [os.path.join(home, "wrappers") + os.sep, os.path.join(home, "core.py")]
    frames = [f for f in traceback.extract_tb(e.__traceback__) if not os.path.abspath(f.filename).startswith(tuple(skip))]
    return "".join(traceback.format_list(frames))


def _count(out: Any) -> str:
    return f"{len(out)} values" if isinstance(out, tuple) else f"a {type(out).__name__}"


def serve(conn: Any) -> None:
    envs: list[Any] = []
    while True:
        at = None
        try:
            try:
                command, arg = conn.recv()
            except (EOFError, OSError):  # the parent is gone
                return
            except Exception as e:  # noqa: BLE001 - what was sent does not unpickle here: not the env's frames
                conn.send(("error", (None, f"{type(e).__name__}: {e}", "")))
                continue
            if command == "make":  # (env spec, kwargs, seeds, spaces): make the envs, reset each with its seed
                import gymnasium

                spec, kwargs, seeds, spaces = arg
                value = []
                for at, seed in enumerate(seeds):
                    envs.append(gymnasium.make(spec, disable_env_checker=True, **kwargs))
                    value.append(reset_one(envs[-1], seed, spaces))
            elif command == "step":  # one action per env
                value = []
                for at, (env, action) in enumerate(zip(envs, arg)):
                    value.append(step_one(env, action))
            elif command == "reset":
                value = []
                for at, env in enumerate(envs):
                    value.append(reset_one(env))
            elif command == "close":
                for env in envs:
                    env.close()
                conn.send(("ok", None))
                return
            else:
                raise ValueError(f"unknown command {command!r}")
        except Exception as e:  # noqa: BLE001 - the env's own error, reported by the parent with its env's index
            conn.send(("error", (at, f"{type(e).__name__}: {e}", env_trace(e))))
            continue
        conn.send(("ok", value))


def end_with(parent: int) -> None:
    """Exit as soon as process ``parent`` is gone, also while an env's step hangs (the closed socket is seen
    only between commands): a stalled run's workers do not outlive it."""
    import os
    import threading
    import time

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, daemon=True, name="msrl-parent-watch").start()


if __name__ == "__main__":
    import signal
    from multiprocessing.connection import Connection

    # a terminal's Ctrl-C (or `timeout`'s SIGTERM) goes to the whole process group: the parent stops the run
    # cleanly, and needs its workers for that; they end when it closes their socket, or when it is gone
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    end_with(int(sys.argv[2]))

    conn = Connection(int(sys.argv[1]))
    sys.path[:] = conn.recv()  # the parent's first message: import what it would (not from this script's folder)
    serve(conn)
