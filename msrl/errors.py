"""The errors msrl raises for bad input. Each names what the user must fix: a config key, or file:line."""

from __future__ import annotations

import inspect
from contextvars import ContextVar
from typing import Any

CALLBACK_LOGS = ("jax._src.callback", "jax._src.debugging")  # where JAX logs the traceback of a raising callback

CLI_FLAGS: ContextVar[bool] = ContextVar("msrl_cli_flags", default=False)  # set while msrl's CLI runs a command


def arg(name: str, set_to: Any = None) -> str:
    """The argument ``name`` of ``train()``/``evaluate()`` as the user gives it: its flag (``--run-dir``) under
    msrl's CLI, else the keyword (``run_dir``). With ``set_to``, set: ``--resume DIR`` or ``resume=True`` (the
    keywords such flags set are booleans)."""
    if CLI_FLAGS.get():
        return f"--{name.replace('_', '-')}" + (f" {set_to}" if set_to not in (None, "") else "")
    return name if set_to is None else f"{name}=True"


class MsrlError(Exception):
    """Base class of every error msrl raises on purpose."""


class ConfigError(MsrlError, ValueError):
    """A bad configuration value. ``key`` is the dotted path of the offending key (``policy.actors``); ``also``,
    keys whose values make the error together with it (an algorithm and an env it cannot act in): where the user
    set one of those on the command line and not ``key``, the error names that one (see ``config.in_file``)."""

    def __init__(self, key: str, message: str, also: tuple[str, ...] = ()):
        self.key, self.message, self.also = key, message, tuple(also)
        super().__init__(f"{key}: {message}" if key else message)

    def __reduce__(self):  # picklable, so one raised in a Ray actor reaches the driver as itself
        return ConfigError, (self.key, self.message, self.also)


class CompileError(MsrlError):
    """A training loop msrl cannot compile. Carries the user's ``file`` and ``line`` and a ``hint``."""

    def __init__(self, message: str, file: str | None = None, line: int | None = None, hint: str | None = None):
        self.file, self.line, self.hint, self.reason = file, line, hint, message
        where = f"{file}:{line}: " if file else ""
        text = where + message
        if hint:
            text += f"\n  hint: {hint}"
        super().__init__(text)

    def __reduce__(self):
        return CompileError, (self.reason, self.file, self.line, self.hint)


class TrainingError(MsrlError):
    """Training stopped because something went wrong at run time (non-finite loss, env mismatch...)."""


class Interrupted(KeyboardInterrupt):
    """Training was stopped by SIGINT or SIGTERM after saving a checkpoint and the summary. A KeyboardInterrupt,
    as Ctrl-C is in Python: a loop of runs that goes on past a failed one (``except Exception``) stops."""


def quote(value: object, limit: int = 200) -> str:
    """``repr(value)`` for an error message, cut to about ``limit`` characters with "…" (a huge value is
    never rendered whole: containers are abbreviated as they are written)."""
    import reprlib

    short = reprlib.Repr()
    short.maxstring = short.maxother = short.maxlong = limit
    short.maxlevel, short.maxdict, short.maxlist, short.maxtuple, short.maxset = 4, 12, 12, 12, 12
    text = short.repr(value)
    return text if len(text) <= limit else text[:limit] + "…"


def defined_at(cls: type) -> tuple[str | None, int | None]:
    """The file and line of ``cls``'s definition, where Python can tell."""
    try:
        return inspect.getsourcefile(cls), inspect.getsourcelines(cls)[1]
    except (OSError, TypeError):
        return None, None


def did_you_mean(name: object, choices: object) -> str:
    """``"did you mean 'x'? "`` where ``name`` looks like a typo of one of ``choices``, else ``""``."""
    import difflib

    import re

    choices, words = [str(c) for c in choices], lambda s: sorted(re.split(r"[-_ ]", s.lower()))
    close = [c for c in choices if c.lower() == str(name).lower()] or \
        [c for c in choices if words(c) == words(str(name))] or \
        difflib.get_close_matches(str(name), choices, n=1)  # (`PPO`: the case alone differs; MinAtar-Breakout)
    return f"did you mean {close[0]!r}? " if close else ""


def raised_at(exc: BaseException, module: str) -> str | None:
    """``FILE:LINE`` where the code of ``module`` raised ``exc``: the deepest frame of its traceback in that
    module (a SyntaxError: the place it names); None if none is there."""
    import traceback

    if isinstance(exc, SyntaxError) and exc.filename:
        return f"{exc.filename}:{exc.lineno}"
    at = None
    for frame, line in traceback.walk_tb(exc.__traceback__):
        if frame.f_globals.get("__name__") == module:
            at = f"{frame.f_code.co_filename}:{line}"
    return at


def method_name(obj: Any, method: str) -> str:
    """``Class.method() (file:line)``: an object's method, for an error."""
    code = getattr(inspect.unwrap(getattr(type(obj), method, None)), "__code__", None)
    return f"{type(obj).__name__}.{method}()" + (f" ({code.co_filename}:{code.co_firstlineno})" if code else "")


def gist(text: str, limit: int = 600) -> str:
    """An error message's first line; where it ends with ':' (JAX's "... but they differ:"), with the block of
    lines it introduces (up to the next blank line, at most 3), on one line."""
    lines = [ln.strip() for ln in str(text).strip().splitlines()]
    if not lines:
        return ""
    out = lines[:1]
    if out[0].endswith(":"):
        for ln in lines[1:]:
            if not ln and len(out) > 1 or len(out) == 4:
                break
            out += [ln] if ln else []
    text = " ".join(out)
    return text if len(text) <= limit else text[:limit - 1] + "…"


def user_code_error(exc: BaseException, module: str, key: str) -> ConfigError:
    """``exc``, raised by the user's ``module``, as one line naming the user's file and line: ``KEY: FILE:LINE:
    TYPE: MESSAGE`` (raise it ``from exc``: ``--debug`` shows the whole traceback)."""
    at = raised_at(exc, module)
    text = exc.msg if isinstance(exc, SyntaxError) else gist(str(exc))
    return ConfigError(key, f"{at + ': ' if at else ''}{type(exc).__name__}: {text}")
