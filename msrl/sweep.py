"""``run.sweep``: several values of an algorithm's float keys trained at once, in one fused program.

A run's *members* are every combination of the swept values (the first key varies slowest) times its
``run.num_seeds`` seeds. The jax backend runs the program once per member, as it runs several seeds: while
the program is traced, each swept key of the algorithm's config holds the member's value as a traced scalar
(:func:`hyperparameters`), so whatever the loop computes from it varies per member. A key the algorithm reads
when it is *built* (a value copied or baked into an optimizer in ``__init__``) would stay at one value for all
members; :func:`build_guard` makes any such use an error naming the key and the line.
"""

from __future__ import annotations

import itertools
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, NamedTuple

from msrl.errors import ConfigError


class Member(NamedTuple):
    name: str  # its folder in the run directory ("" for a run of one)
    seed: int
    values: dict[str, float]  # its swept algorithm keys' values


def members(run: Any) -> list[Member]:
    """Every member of a run (``run.sweep`` x ``run.num_seeds``); one unnamed member for a plain run."""
    keys = list(run.sweep)
    points = [dict(zip(keys, vs)) for vs in itertools.product(*run.sweep.values())]
    out = []
    for values in points:
        for i in range(run.num_seeds):
            parts = [f"{k}={v!r}" for k, v in values.items() if len(run.sweep[k]) > 1]
            parts += [f"seed_{run.seed + i}"] if run.num_seeds > 1 else []
            out.append(Member(",".join(parts), run.seed + i, values))
    return out


def member_config(cfg: Any, member: Member) -> Any:
    """The config of one member as a run of its own (its values and seed; no sweep, one seed)."""
    return cfg.model_copy(update={
        "algorithm": cfg.algorithm.model_copy(update=member.values),
        "run": cfg.run.model_copy(update={"seed": member.seed, "num_seeds": 1, "sweep": {}})})


def spread_over_cores(cfg: Any) -> int | None:
    """Give JAX one CPU device per core (``jax_num_cpu_devices``, at most one per member) for a run of several
    members on the jax backend: its program then splits the members over the devices and runs them at once.
    Only before JAX has started and where the user set no device count (a Python session that already ran JAX
    keeps its devices). Returns the count set, or None. An accelerator's devices are unaffected."""
    runs = len(members(cfg.run))
    if runs < 2 or cfg.policy.backend != "jax" or "xla_force_host_platform_device_count" in os.environ.get(
            "XLA_FLAGS", ""):
        return None
    import jax

    if jax.config.jax_num_cpu_devices != -1:  # the user's choice
        return None
    cores = min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1, runs)
    if cfg.run.seed_batching == "vmap":  # (a batched program splits its members evenly, or runs on one device)
        cores = max(d for d in range(1, cores + 1) if runs % d == 0)
    if cores < 2:
        return None
    try:
        jax.config.update("jax_num_cpu_devices", cores)
    except RuntimeError:  # JAX has started already
        return None
    from msrl.errors import CLI_FLAGS

    if not CLI_FLAGS.get():  # (a Python session: what runs after this in it sees these devices too)
        print(f"msrl: note: this process now has {cores} CPU devices (jax_num_cpu_devices), to run {runs} members "
              "at once; a later run in it keeps them (multi_learner splits its learners over them: other rounding "
              "than on one device)", file=sys.stderr, flush=True)
    return cores


@contextmanager
def hyperparameters(algorithm_cfg: Any, values: dict[str, Any]) -> Iterator[None]:
    """The algorithm config's keys set to ``values`` (traced scalars while a program is traced) until the
    block ends."""
    before = {k: getattr(algorithm_cfg, k) for k in values}
    try:
        for k, v in values.items():
            setattr(algorithm_cfg, k, v)
        yield
    finally:
        for k, v in before.items():
            setattr(algorithm_cfg, k, v)


def user_line(frames: Iterator[Any]) -> str:
    """``file:line`` of the innermost of ``frames`` (innermost first) that is not in jax, the libraries it
    builds on, or msrl's own runtime: where an algorithm used a value."""
    import msrl

    core = [str(Path(msrl.__file__).parent), *(str(Path(m.__file__).parent) for m in
                                               (sys.modules.get("msrl.backends"), sys.modules.get("msrl.policies"))
                                               if m is not None and getattr(m, "__file__", None))]
    for f in frames:
        file = f.f_code.co_filename
        if not any(file.startswith(p) for p in core) and "site-packages" not in file and not file.startswith("<"):
            return f"{file}:{f.f_lineno}"
    return "an unknown line"


class _BuiltWith:
    """What a swept key holds while the algorithm is built: any use of it raises a ConfigError."""

    def __init__(self, key: str):
        self.key = key

    def _refuse(self, *_: Any) -> Any:
        def outward(f):
            while f is not None:
                yield f
                f = f.f_back

        where = user_line(outward(sys._getframe(1)))
        raise ConfigError(f"run.sweep.{self.key}", f"algorithm.{self.key} is read when the algorithm is built "
                          f"(used at {where}), not while its loop runs, so one program cannot vary it; run one "
                          "program per value")

    def __repr__(self) -> str:
        return f"<algorithm.{self.key}: swept>"


for _name in ("__float__", "__int__", "__index__", "__bool__", "__neg__", "__pos__", "__abs__", "__array__",
              "__jax_array__", "__lt__", "__le__", "__gt__", "__ge__", "__format__", "__round__",
              *(f"__{p}{op}__" for op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul")
                for p in ("", "r"))):
    setattr(_BuiltWith, _name, _BuiltWith._refuse)


@contextmanager
def build_guard(algorithm_cfg: Any, keys: list[str]) -> Iterator[None]:
    """While the block builds the algorithm, every swept key refuses to be used (see :class:`_BuiltWith`)."""
    with hyperparameters(algorithm_cfg, {k: _BuiltWith(k) for k in keys}):
        yield


CONCRETE_ERRORS = ("ConcretizationTypeError", "TracerBoolConversionError", "TracerIntegerConversionError",
                   "TracerArrayConversionError")


def python_use(exc: BaseException, keys: list[str]) -> ConfigError | None:
    """The ConfigError for a trace that failed because a swept value was used as a Python value (an ``if``,
    a shape, a loop count): it names the swept keys and the line; None for any other error."""
    if type(exc).__name__ not in CONCRETE_ERRORS:
        return None
    frames, tb = [], exc.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    where = user_line(reversed(frames))
    swept = " or ".join(f"algorithm.{k}" for k in keys)
    return ConfigError("run.sweep", f"{swept} is used as a Python value (an `if`, a shape, a loop count) at "
                       f"{where}; one program can only sweep values its loop computes with: run one program per "
                       "value")
