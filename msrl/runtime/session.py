"""The public session API: build a compiled program on its policy's backend, run it, read it, close it.

The CLI's ``train``, the tests and the benchmarks all run programs through it::

    with msrl.Session("examples/ppo_cartpole.yaml", ["policy.name=single_learner_coarse"]) as s:
        rows = s.run(10)          # one metrics dict per iteration ("iteration", "env_steps", ...)
        params = s.params()       # the policy's parameters, as host arrays
        snap = s.snapshot()       # every replica's component states, by fragment
"""

from __future__ import annotations

import numbers
import weakref
from pathlib import Path
from typing import Any, Callable, Iterator


class Session:
    """A program running on its backend. Give a config (an :class:`msrl.config.ExperimentConfig`, or a
    YAML path with ``overrides``), or a compiled ``program`` (``msrl.compile``) with a ``seed``.
    ``iterations_per_dispatch``: iterations a jitted program runs per call (default: the config's
    ``run.iterations_per_dispatch`` where it sets one, else one).
    ``stall_timeout_s``: a replica making no progress this long raises a TrainingError (default: the config's
    ``run.stall_timeout_s``; 0: never). ``seeds``: run the program for seeds ``seed .. seed + seeds - 1`` at
    once (default: the config's ``run.num_seeds``), each for every combination of the config's ``run.sweep``
    values (``sweep``: for a compiled ``program``, built by ``msrl.runner.build`` from a config with that
    ``run.sweep``): ``members`` lists them (:class:`msrl.sweep.Member`). Every state leaf then has a leading member axis,
    and every row holds the mean over the members with each member's own row under ``per_seed``.
    ``seed_batching``: how the members share the program (default: the config's ``run.seed_batching``, or ``auto``)."""

    def __init__(self, config: Any = None, overrides: list[str] | tuple = (), *, program: Any = None,
                 seed: int | None = None, iterations_per_dispatch: int | None = None,
                 stall_timeout_s: float | None = None,
                 seeds: int | None = None, seed_batching: str | None = None, sweep: dict | None = None):
        from msrl.config import ExperimentConfig, RunConfig, load_config, override_list
        from msrl.errors import ConfigError
        from msrl.registry import BACKENDS
        from msrl.sweep import members

        if (config is None) == (program is None):
            given = "not both" if program is not None else "got neither"
            raise TypeError("Session takes a config (a YAML file's path, a dict of its sections or a validated config) "
                            f"or a compiled program (program=...), {given}")
        self.config = None
        if program is not None:
            from msrl.compiler import Program

            if not isinstance(program, Program):
                raise ConfigError("program", f"a compiled program (msrl.build(config)), got {type(program).__name__} "
                                  f"{program!r:.60}" + ("; give a config as Session's first argument"
                                                        if isinstance(program, (str, Path, dict, ExperimentConfig))
                                                        else ""))
        if overrides and (program is not None or isinstance(config, ExperimentConfig)):  # (they were dropped)
            raise ConfigError("overrides", "give overrides with a config file or dict, not with " + (
                "a compiled program (its config was fixed when it was built)" if program is not None else
                "a validated config"))
        if program is None:
            from msrl.runner import build

            self.config = config.checked() if isinstance(config, ExperimentConfig) else load_config(
                config, override_list(overrides))
            program = build(self.config)
            seed = self.config.run.seed if seed is None else seed
            seeds = self.config.run.num_seeds if seeds is None else seeds
            seed_batching = seed_batching or self.config.run.seed_batching
            sweep = self.config.run.sweep if sweep is None else sweep
            if iterations_per_dispatch is None:
                iterations_per_dispatch = self.config.run.iterations_per_dispatch
        k = 1 if iterations_per_dispatch is None else iterations_per_dispatch
        _whole("iterations_per_dispatch", k, 1, "a whole number >= 1 of iterations per call")
        run = _run_arguments(seed, seeds, sweep, stall_timeout_s, seed_batching, program)
        self.program, self.seed, self.seeds, self.iteration = program, run.seed, run.num_seeds, 0
        self.members = members(run)  # what the program runs for: every combination of swept values x every seed
        check_members(program.policy.backend, run, program.env.spec.id)
        backend = BACKENDS.get(program.policy.backend)()
        several = {}
        if len(self.members) > 1:
            several = {"members": [(m.seed, m.values) for m in self.members],
                       "vmap_seeds": vmap_seeds(seed_batching or "auto")}
        self.runtime = backend.build(program, self.seed, int(k), **several)
        # a session dropped without close(): its replicas (a private Ray cluster, env worker processes) end when
        # it is collected, not when the process exits
        self._close_runtime = weakref.finalize(self, self.runtime.close)
        self._close_runtime.atexit = False  # (at exit the backends' own shutdown runs)
        self._total_env_steps = self.config.run.total_env_steps if self.config is not None else None
        self.closed, self.broken, self.readable, self.stopped_by = False, None, False, None
        if stall_timeout_s is None:
            stall_timeout_s = (self.config.run if self.config is not None else RunConfig()).stall_timeout_s
        self.runtime.stall_timeout_s = float(stall_timeout_s)

    @property
    def env_steps_per_iteration(self) -> int:
        return self.program.env_steps_per_iteration

    @property
    def compile_seconds(self) -> float | None:
        """XLA compile time spent before the first iteration (None: compiled lazily while running)."""
        return self.runtime.compile_seconds

    def _number(self, rows: list[dict[str, float]]) -> list[dict[str, float]]:
        out = []
        for r in rows:
            self.iteration += 1
            at = {"iteration": self.iteration, "env_steps": self.iteration * self.env_steps_per_iteration}
            out.append({**at, **r} if "per_seed" not in r else
                       {**at, **r, "per_seed": [{**at, **each} for each in r["per_seed"]]})
        return out

    def _open(self, reading: bool = False) -> None:
        """Refuses a closed session, and one that a failure or an interrupt stopped (``reading``: but where its
        replicas' states are of one iteration, snapshot() and params() read them)."""
        if self.closed or (self.broken and not (reading and self.readable)):
            from msrl.errors import TrainingError

            raise TrainingError("this session is closed (its replicas are gone); start a new one" if self.closed else
                                self.broken)

    def run(self, iterations: int) -> list[dict[str, float]]:
        """Run ``iterations`` training iterations; one metrics row per iteration."""
        return [row for rows in self.stream(iterations, iterations) for row in rows]

    def stream(self, iterations: int, chunk: int = 1, stop: Callable[[], bool] = lambda: False
               ) -> Iterator[list[dict[str, float]]]:
        """Run ``iterations`` iterations, yielding the rows of each ``chunk`` as they finish; no chunk starts
        once ``stop()`` is true (the rows of those already started still come)."""
        self._open()
        _whole("iterations", iterations, 0, "a whole number >= 0 of iterations to run")
        _whole("chunk", chunk, 1, "a whole number >= 1 of iterations per list of rows")  # (0 spun for ever)
        end, total = (self.iteration + iterations) * self.env_steps_per_iteration, self._total_env_steps
        if total is not None and end > total:
            import sys

            print(f"msrl: note: this session runs to {end:,} env steps, past run.total_env_steps={total:,}, which "
                  "sizes the algorithm's schedules (a learning rate decayed to 0, an importance-sampling anneal): past "
                  "it they hold their final values (a rate that counts updates made goes on to 0); raise "
                  "run.total_env_steps to train longer",
                  file=sys.stderr)
            self._total_env_steps = None  # said once
        ended = "interrupted"  # (a KeyboardInterrupt, or a reader that stopped reading)
        try:
            for rows in self.runtime.stream(iterations, chunk, stop):
                yield self._number(rows)
            ended = None
        except Exception:
            ended = "failed"  # (a replica failed, stalled or died: the error says so)
            raise
        finally:
            if ended is not None:
                self._stopped(ended)

    def _stopped(self, ended: str) -> None:
        """After a stream that ended early: go on where the replicas are at rest, between iterations, and can
        run again; else refuse to run (a failed replica, a stopped transport), reading their states if they are
        of one iteration."""
        ahead = self.runtime.settle() if ended == "interrupted" or self.runtime.at_rest() else None
        if ahead is not None:  # the iterations already started finished: the state is theirs (rows lost)
            self.iteration += ahead
        if ended == "interrupted" and ahead is not None and self.runtime.can_go_on():
            return
        self.readable = ahead is not None
        at = (f"; snapshot() and params() read its replicas' states after iteration {self.iteration}, which "
              "Session.restore() puts into a new session" if self.readable else
              ", its replicas' states not those of one finished iteration")
        self.stopped_by = "a failure" if ended == "failed" else "an interrupt"
        self.broken = (f"this session stopped {'at a failure' if ended == 'failed' else 'by an interrupt'} after "
                       f"iteration {self.iteration}{at}; start a new session (or resume the run from its checkpoint)")

    def params(self) -> Any:
        """The policy's parameters (the learner's ``policy_params``), as host arrays."""
        import jax

        from msrl.errors import CompileError

        self._open(reading=True)
        if not any("learner" in f.state_keys for f in self.program.fragments.values()):
            cls = type(self.program.algorithm).__name__
            raise CompileError(f"{cls}.train_step never calls msrl.agent_learn: the program has no learner, so no "
                               "parameters (Session.snapshot() has its states)")
        return jax.device_get(self.runtime.params())

    def snapshot(self, skip: tuple[str, ...] = ()) -> Snapshot:
        """Every replica's component states as host arrays, by fragment (components in ``skip`` left out), and
        the iteration they were taken after."""
        self._open(reading=True)
        known = {k for f in self.program.fragments.values() for k in f.state_keys} | set(self.program.components)
        unknown = sorted(set(skip) - known) if isinstance(skip, (tuple, list, set, frozenset)) else [skip]
        if unknown:  # (a misspelled component was left in the snapshot without a word)
            from msrl.errors import ConfigError

            one = isinstance(skip, str) and skip in known
            raise ConfigError("skip", f"a tuple of names of components to leave out ({', '.join(sorted(known))}), "
                              f"got {', '.join(map(repr, unknown))}" + (f": write ({skip!r},)" if one else ""))
        return Snapshot(self.runtime.snapshot(skip), self.iteration)

    def restore(self, snapshot: dict[str, list[dict[str, Any]]], iteration: int | None = None) -> None:
        """Set the states in ``snapshot``; ``iteration``: the iteration it was taken after (default: the one a
        :class:`Snapshot` holds). Each state must have the structure, shapes and dtypes of this session's own (a
        snapshot of this program). The rows and the policy's schedules (parameter pulls, lag) go on from there."""
        self._open()
        if iteration is None:
            iteration = getattr(snapshot, "iteration", None)
        else:
            _whole("iteration", iteration, 0, "the iteration the snapshot was taken after: a whole number >= 0")
        _check_like(snapshot, self.runtime.shapes(_not_held(snapshot)))
        self.runtime.restore(snapshot, iteration)
        if iteration is not None:
            self.iteration = int(iteration)

    def close(self) -> None:
        self.closed = True
        self._close_runtime()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"stopped by {self.stopped_by}" if self.broken else "open"
        return (f"<msrl.Session {type(self.program.algorithm).__name__} under {self.program.policy.name} "
                f"({self.program.policy.backend}), after iteration {self.iteration}, {state}>")

    def __enter__(self) -> "Session":
        self._open()  # (a closed session entered again failed only at its first call)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Snapshot(dict):
    """``Session.snapshot()``: fragment -> each replica's component states, and ``iteration``, the iteration
    they were taken after (what ``Session.restore`` continues from)."""

    _registered = False

    def __init__(self, states: dict[str, list[dict[str, Any]]], iteration: int):
        Snapshot.register()
        super().__init__(states)
        self.iteration = iteration

    def __reduce__(self) -> tuple:
        return Snapshot, (dict(self), self.iteration)

    @staticmethod
    def register() -> None:
        """Once, when jax is in use: jax.tree functions map a Snapshot's states and keep its iteration."""
        import jax

        if not Snapshot._registered:
            jax.tree_util.register_pytree_with_keys(
                Snapshot, lambda s: ([(jax.tree_util.DictKey(k), s[k]) for k in sorted(s)], (sorted(s), s.iteration)),
                lambda aux, values: Snapshot(dict(zip(aux[0], values)), aux[1]))
            Snapshot._registered = True


def _whole(key: str, value: Any, least: int, what: str) -> None:
    """A ConfigError on ``key`` (``what`` it must be) unless ``value`` is a whole number >= ``least`` (no bool)."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < least:
        from msrl.errors import ConfigError

        raise ConfigError(key, f"{what}, got {value!r:.100}")


def _run_arguments(seed: Any, seeds: Any, sweep: Any, stall_timeout_s: Any, seed_batching: Any, program: Any) -> Any:
    """Session's keyword arguments checked as the config's run keys are (they went around them: ``seed=2**32``
    ran seed 0, ``seeds=-1`` ran nothing), as a RunConfig."""
    from pydantic import ValidationError

    from msrl.config import SEED_MAX, RunConfig
    from msrl.errors import ConfigError

    given = {"seed": 0 if seed is None else seed, "num_seeds": 1 if seeds is None else seeds,
             "sweep": {} if sweep is None else sweep,
             **({} if stall_timeout_s is None else {"stall_timeout_s": stall_timeout_s}),
             **({} if seed_batching is None else {"seed_batching": seed_batching})}
    flag = next((k for k, v in given.items() if isinstance(v, bool)), None)
    if flag is not None:  # (pydantic takes true for 1)
        raise ConfigError({"num_seeds": "seeds"}.get(flag, flag), f"a number, got {given[flag]!r} (as the config's "
                          f"run.{flag})")
    given = {k: int(v) if isinstance(v, numbers.Integral) and not isinstance(v, bool) else v for k, v in given.items()}
    try:
        run = RunConfig.model_validate(given)
    except ValidationError as e:
        error = e.errors()[0]
        key = str(error["loc"][0]) if error["loc"] else "seed"
        raise ConfigError({"num_seeds": "seeds"}.get(key, key), f"{error['msg']}, got {error.get('input')!r:.100} "
                          f"(as the config's run.{key})") from None
    if run.seed + run.num_seeds - 1 > SEED_MAX:
        raise ConfigError("seeds", f"seeds {run.seed:,} .. {run.seed + run.num_seeds - 1:,} pass the largest "
                          f"32-bit seed, {SEED_MAX:,}")
    empty = next((k for k, v in run.sweep.items() if not isinstance(v, list) or not v), None)
    if empty is not None:
        raise ConfigError("sweep", f"{empty!r} must be a non-empty list of values, got {run.sweep[empty]!r:.100}")
    cfg = program.algorithm.cfg  # (a program of one's own may hold any config object)
    unknown = next((k for k in run.sweep if not hasattr(cfg, k)), None)
    if unknown is not None:
        raise ConfigError("sweep", f"{unknown!r} is no key of algorithm {getattr(cfg, 'name', '')!r} (sweep takes "
                          "its keys: {'lr': [...]})")
    return run


def _not_held(snapshot: Any) -> tuple[str, ...]:
    """The components no replica's state in ``snapshot`` holds: what checking it against this session's own states
    need not fetch (a host env's simulators may not even leave their process)."""
    from msrl.compiler import COMPONENTS
    from msrl.services import SNAPSHOT_KEY

    replicas = [r for frag, reps in snapshot.items() if frag != SNAPSHOT_KEY and isinstance(reps, list) for r in reps] \
        if isinstance(snapshot, dict) else []
    return tuple(c for c in COMPONENTS if not any(isinstance(r, dict) and c in r for r in replicas))


def _check_like(snapshot: Any, own: dict[str, list[dict[str, Any]]]) -> None:
    """``snapshot`` holds, for fragments and replicas of this program, states shaped as this session's own."""
    import jax

    from msrl.errors import ConfigError
    from msrl.services import SNAPSHOT_KEY

    if not isinstance(snapshot, dict):
        raise ConfigError("snapshot", f"must be a dict of fragment -> replica states, got {type(snapshot).__name__}")
    ours = ", ".join(f"{k!r} ({len(v)})" for k, v in own.items())
    for frag, replicas in snapshot.items():
        if not isinstance(replicas, list):  # (the parameters, say: {"params": {...}})
            raise ConfigError("snapshot", f"is not a snapshot (Session.snapshot()'s: fragment -> a list of each "
                              f"replica's states): its {frag!r} holds {type(replicas).__name__}; this program's "
                              f"fragments (replicas) are {ours}")
        if frag not in own or len(replicas) != len(own[frag]):
            many = "s" if len(replicas) != 1 else ""
            raise ConfigError("snapshot", f"holds fragment {frag!r} ({len(replicas)} replica{many}); this program's "
                              f"are {ours}")
        for r, (states, mine) in enumerate(zip(replicas, own[frag])):
            if not isinstance(states, dict):
                raise ConfigError("snapshot", f"{frag!r} replica {r} must be a dict of component -> state, got "
                                  f"{type(states).__name__}")
            for name, state in states.items():
                if name not in mine:
                    raise ConfigError("snapshot", f"{frag!r} replica {r} holds state {name!r}; this program's "
                                      f"holds {', '.join(map(repr, mine))}")
                like = jax.tree.structure(state) == jax.tree.structure(mine[name]) and all(
                    _signature(a) == _signature(b) for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(mine[name])))
                if not like:
                    raise ConfigError("snapshot", f"{frag!r} replica {r}'s {name!r} state differs in structure, "
                                      "shapes or dtypes from this program's: it is a snapshot of another program")
    for frag in own:
        if frag not in snapshot and frag != SNAPSHOT_KEY:  # (the services' states: a snapshot may hold none)
            raise ConfigError("snapshot", f"holds no fragment {frag!r}; this program's fragments (replicas) are {ours}")


def _signature(x: Any) -> tuple[tuple[int, ...], str]:
    """A state leaf's shape and dtype (an array, its shape-dtype struct, or a Python value)."""
    import numpy as np

    x = x if hasattr(x, "shape") and hasattr(x, "dtype") else np.asarray(x)
    return tuple(x.shape), str(x.dtype)


def session(config: str | Path | Any = None, overrides: list[str] | tuple = (), **kwargs: Any) -> Session:
    """``msrl.session(...)``: a :class:`Session` (see there)."""
    return Session(config, overrides, **kwargs)


def check_members(backend: str, run: Any, env_id: str = "") -> None:
    """A ConfigError unless ``backend`` runs the members ``run`` asks for (several seeds or swept values need one
    that runs them in one program, and an environment the program steps: not a host env's simulators)."""
    from msrl.registry import BACKENDS
    from msrl.sweep import members

    if len(members(run)) > 1:
        from msrl.errors import ConfigError

        key, what = ("run.sweep", "swept values") if run.sweep else ("run.num_seeds", "seeds")
        if env_id.split(":")[0] in ("gymnasium", "envpool"):  # (env.xla's pools too: one per program)
            raise ConfigError(key, f"{env_id}'s simulators train one seed per run (several {what} share msrl's jitted "
                              "program, which steps jitted environments only): train each in a run of its own")
        if not BACKENDS.get(backend).multi_seed:
            raise ConfigError(key, f"the {backend} backend runs one member per program (one seed, one value of each "
                              f"key); several {what} in one program need one jitted program: the jax backend, with "
                              "policy.name=fused (or multi_learner with policy.learners=1 there)")


def vmap_seeds(seed_batching: str) -> bool:
    """Whether several seeds run batched (``vmap``) rather than one after another (``run.seed_batching``)."""
    from typing import get_args

    from msrl.config import RunConfig

    allowed = get_args(RunConfig.model_fields["seed_batching"].annotation)  # the config key's own choices
    if seed_batching not in allowed:
        from msrl.errors import ConfigError

        raise ConfigError("run.seed_batching", f"'{seed_batching}' is not one of {', '.join(allowed)}")
    if seed_batching == "auto":
        import jax

        return jax.default_backend() != "cpu"
    return seed_batching == "vmap"
