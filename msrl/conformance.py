"""The conformance matrix: every test loop under every distribution policy and backend, against ``fused``.

    python -m msrl.conformance [--fast] [--out docs/conformance.md] [--only LOOP ...] [--columns ID ...]

Every loop of the corpus (:data:`LOOPS`: the built-in PPO, DQN with prioritized replay, A2C, IMPALA, MAPPO,
the REINFORCE of ``examples/custom_algorithm.py`` and the test loops of :mod:`msrl.conformance_loops`) runs
``k`` iterations (seed 0, 8 environments in total) under ``fused`` on ``jax`` (the reference) and under
every column of :data:`COLUMNS`; each cell gets exactly one verdict:

- ``equal to fused``: the policy parameters (``Session.params()``) equal the reference's leaf by leaf
  ("bitwise", or within ``TOL``) and so do the learner's whole state (optimizer, target networks, counters)
  and the per-iteration ``episodes`` column;
- ``refused``: building or running raised :class:`msrl.CompileError` / :class:`msrl.ConfigError`; the
  first line of the message is recorded and flagged when it does not read as a clear message;
- ``different by design``: only where the policy changes the numbers on purpose (``multi_learner`` with
  several learners, ``async`` with several workers, ``single_learner_coarse`` with ``sync: false``): the run
  must be finite and its parameters must have moved (it trained);
- ``SILENTLY DIFFERENT`` (it ran, was not refused, and its numbers differ where equality is promised, or a
  by-design run did not train) and ``ERROR`` (any other exception) are failures: the command exits 1.

Ray cells share one local cluster (4 CPUs) started once. ``single_learner_coarse`` on JAX devices needs
several devices: those cells run in one subprocess with ``XLA_FLAGS=--xla_force_host_platform_device_count=4``
and their parameters come back to be compared with this process's reference.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import importlib
import importlib.util
import json
import math
import os
import pickle
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

TOL = 1e-4
K = 3  # iterations per cell (one dispatch)
NUM_ENVS = 8  # in total: fused runs them all in one program; distributed policies split them
CELL_TIMEOUT_S = 600

EQUAL, REFUSED, DESIGN, SILENT, ERROR = ("equal to fused", "refused", "different by design", "SILENTLY DIFFERENT",
                                         "ERROR")
VERDICTS = (EQUAL, REFUSED, DESIGN, SILENT, ERROR)
FAILURES = (SILENT, ERROR)
RUN = {"seed": 0, "total_env_steps": 100_000, "progress": False, "tensorboard": False, "checkpoint_every_steps": 0,
       "compile_cache": False}
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "custom_algorithm.py"


# ---------------------------------------------------------------------------------------------- the corpus
def _conformance_loops() -> None:
    importlib.import_module("msrl.conformance_loops")  # registers conf_sac, conf_recurrent, conf_ema


def _envpool() -> None:
    importlib.import_module("envpool")  # the `envpool` extra


def _custom_algorithm() -> None:
    """Import examples/custom_algorithm.py by path, as the module ``custom_algorithm`` (which registers
    ``reinforce``); its folder goes on sys.path so that Ray's processes import it by name too."""
    if "custom_algorithm" in sys.modules:
        return
    if not EXAMPLE.is_file():
        raise FileNotFoundError(f"{EXAMPLE} (the REINFORCE example) is not there: run from a source checkout")
    if str(EXAMPLE.parent) not in sys.path:
        sys.path.insert(0, str(EXAMPLE.parent))
    spec = importlib.util.spec_from_file_location("custom_algorithm", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["custom_algorithm"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules["custom_algorithm"]
        raise


@dataclasses.dataclass(frozen=True)
class Loop:
    """A loop of the corpus: its algorithm config, env, and how to make its algorithm known by name."""

    name: str
    title: str
    algorithm: dict[str, Any]
    env: dict[str, Any] = dataclasses.field(default_factory=lambda: {"id": "gymnax:CartPole-v1"})
    setup: Callable[[], None] | None = None
    skip: dict[str, str] = dataclasses.field(default_factory=dict)  # column id -> why it is not a cell

    def config(self, policy: dict[str, Any]) -> dict[str, Any]:
        return {"algorithm": dict(self.algorithm), "env": {**self.env, "num_envs": NUM_ENVS}, "policy": dict(policy),
                "run": dict(RUN)}


_MAPPO_SKIP = "PPO's loop, unchanged: refused as in the ppo row"
LOOPS: dict[str, Loop] = {loop.name: loop for loop in [
    Loop("ppo", "PPO (built-in)", {"name": "ppo", "rollout_len": 16, "epochs": 2, "minibatches": 2, "hidden": [32]}),
    Loop("dqn_per", "DQN, prioritized replay (built-in, `prioritized: true`)",
         {"name": "dqn", "prioritized": True, "rollout_len": 4, "updates": 2, "batch_size": 32, "buffer_size": 1024,
          "learning_starts": 32, "n_step": 2, "target_update_every": 2, "eps_decay_steps": 1000, "hidden": [32]}),
    Loop("a2c", "A2C (built-in)", {"name": "a2c", "rollout_len": 5, "hidden": [32]}),
    Loop("impala", "IMPALA (built-in)", {"name": "impala", "rollout_len": 8, "hidden": [32]}),
    Loop("mappo", "MAPPO on MPE simple_spread (built-in)",
         {"name": "mappo", "rollout_len": 16, "epochs": 1, "minibatches": 2, "hidden": [32]},
         env={"id": "jaxmarl:MPE_simple_spread_v3", "kwargs": {"num_agents": 3, "num_landmarks": 3}},
         skip={"replay/threads": _MAPPO_SKIP, "replay/ray": _MAPPO_SKIP, "async-w1/threads": _MAPPO_SKIP,
               "async-w2/threads": _MAPPO_SKIP, "async-w1/ray": _MAPPO_SKIP, "async-w2/ray": _MAPPO_SKIP}),
    Loop("reinforce", "REINFORCE (examples/custom_algorithm.py, imported by path)",
         {"name": "reinforce", "rollout_len": 16, "hidden": 32}, setup=_custom_algorithm),
    Loop("sac_builtin", "SAC (built-in) on Pendulum",
         {"name": "sac", "rollout_len": 2, "batch_size": 32, "buffer_size": 1024, "learning_starts": 8, "updates": 2,
          "hidden": [32]},
         env={"id": "gymnax:Pendulum-v1"}),
    Loop("td3_builtin", "TD3 (built-in) on Pendulum",
         {"name": "td3", "rollout_len": 2, "batch_size": 32, "buffer_size": 1024, "learning_starts": 8, "updates": 2,
          "hidden": [32]}, env={"id": "gymnax:Pendulum-v1"}),
    Loop("ppo_norm", "PPO (built-in) with `normalize_obs` and `normalize_reward` on Pendulum",
         {"name": "ppo", "rollout_len": 16, "epochs": 2, "minibatches": 2, "hidden": [32], "normalize_obs": True,
          "normalize_reward": True}, env={"id": "gymnax:Pendulum-v1"}),
    Loop("ppo_truncated", "PPO (built-in) bootstrapping truncated episodes from their final observation, on "
         "CartPole cut at 12 steps", {"name": "ppo", "rollout_len": 16, "epochs": 2, "minibatches": 2, "hidden": [32],
                                      "bootstrap_truncated": True},
         env={"id": "gymnax:CartPole-v1", "kwargs": {"max_steps_in_episode": 12}}),
    Loop("sac_norm", "SAC (built-in) with `normalize_obs` and `normalize_reward` on Pendulum",
         {"name": "sac", "rollout_len": 2, "batch_size": 32, "buffer_size": 1024, "learning_starts": 8, "updates": 2,
          "hidden": [32], "normalize_obs": True, "normalize_reward": True}, env={"id": "gymnax:Pendulum-v1"}),
    Loop("sac", "SAC-shaped: local replay, twin critics, Polyak targets, 3 optimizers (conformance_loops)",
         {"name": "conf_sac"}, setup=_conformance_loops),
    Loop("recurrent", "Recurrent actor: GRU state per env, reset at episode starts (conformance_loops)",
         {"name": "conf_recurrent"}, setup=_conformance_loops),
    Loop("recurrent_ppo", "Recurrent PPO (built-in): GRU, BPTT from stored hidden states, minibatches by env",
         {"name": "recurrent_ppo", "rollout_len": 16, "epochs": 2, "minibatches": 2, "hidden": [32],
          "memory_size": 32}, env={"id": "gymnax:CartPole-v1", "kwargs": {"mask_obs": [1, 3]}}),
    Loop("recurrent_impala", "Recurrent IMPALA (built-in): the same GRU network, V-trace",
         {"name": "recurrent_impala", "rollout_len": 8, "hidden": [32], "memory_size": 32},
         env={"id": "gymnax:CartPole-v1", "kwargs": {"mask_obs": [1, 3]}}),
    Loop("recurrent_dqn", "Recurrent DQN (built-in): sequence replay of windows with stored hidden states (R2D2)",
         {"name": "recurrent_dqn", "prioritized": True, "rollout_len": 4, "updates": 2, "batch_size": 32,
          "buffer_size": 1024, "learning_starts": 16, "n_step": 2, "sequence_length": 6, "burn_in": 2,
          "target_update_every": 2, "eps_decay_steps": 1000, "hidden": [32], "memory_size": 16},
         env={"id": "gymnax:CartPole-v1", "kwargs": {"mask_obs": [1, 3]}}),
    Loop("ppo_envpool_xla", "PPO (built-in) on EnvPool's C++ CartPole, stepped inside XLA (`env.xla: true`)",
         {"name": "ppo", "rollout_len": 16, "epochs": 2, "minibatches": 2, "hidden": [32]},
         env={"id": "envpool:CartPole-v1", "xla": True}, setup=_envpool),
    Loop("ema", "Learner with extra state: step counter + EMA of params (conformance_loops)",
         {"name": "conf_ema"}, setup=_conformance_loops),
]}
FAST_LOOPS = ("sac", "a2c", "recurrent")


@dataclasses.dataclass(frozen=True)
class Column:
    """A (policy, backend) cell of every loop. ``expect``: "equal" (the numbers of fused are promised) or
    "design" (the policy changes them on purpose). ``where``: "main" (this process), "ray" (the shared
    cluster) or "devices" (the subprocess with 4 forced host devices)."""

    id: str
    label: str
    policy: dict[str, Any]
    expect: str = "equal"
    where: str = "main"


def _coarse(backend: str, **kw: Any) -> dict[str, Any]:
    return {"name": "single_learner_coarse", "backend": backend, "actors": 2, **kw}


COLUMNS: list[Column] = [
    Column("coarse/threads", "coarse · threads", _coarse("threads")),
    Column("coarse/ray", "coarse · ray", _coarse("ray"), where="ray"),
    Column("coarse/jax-devices", "coarse · jax devices",
           _coarse("jax", actor_devices=[0, 1], learner_devices=[2]), where="devices"),
    Column("coarse-async/threads", "coarse sync=false · threads", _coarse("threads", sync=False), "design"),
    Column("coarse-async/ray", "coarse sync=false · ray", _coarse("ray", sync=False), "design", "ray"),
    Column("fine/threads", "fine · threads", {"name": "single_learner_fine", "backend": "threads", "actors": 2}),
    Column("fine/ray", "fine · ray", {"name": "single_learner_fine", "backend": "ray", "actors": 2}, where="ray"),
    Column("replay/threads", "replay_server · threads",
           {"name": "replay_server", "backend": "threads", "actors": 2, "shards": 1}),
    Column("replay/ray", "replay_server · ray",
           {"name": "replay_server", "backend": "ray", "actors": 2, "shards": 1}, where="ray"),
    Column("async-w1/threads", "async w=1 · threads", {"name": "async", "backend": "threads", "workers": 1}),
    Column("async-w2/threads", "async w=2 · threads", {"name": "async", "backend": "threads", "workers": 2}, "design"),
    Column("async-w1/ray", "async w=1 · ray", {"name": "async", "backend": "ray", "workers": 1}, where="ray"),
    Column("async-w2/ray", "async w=2 · ray", {"name": "async", "backend": "ray", "workers": 2}, "design", "ray"),
    Column("multi-l1/jax", "multi_learner l=1 · jax", {"name": "multi_learner", "backend": "jax", "learners": 1}),
    Column("multi-l2/jax", "multi_learner l=2 · jax", {"name": "multi_learner", "backend": "jax", "learners": 2},
           "design"),
    Column("multi-l1/ray", "multi_learner l=1 · ray", {"name": "multi_learner", "backend": "ray", "learners": 1},
           where="ray"),
    Column("multi-l2/ray", "multi_learner l=2 · ray", {"name": "multi_learner", "backend": "ray", "learners": 2},
           "design", "ray"),
]
COLUMN = {c.id: c for c in COLUMNS}
REFERENCE = {"name": "fused", "backend": "jax"}


# ---------------------------------------------------------------------------------------------- running
@dataclasses.dataclass
class Outcome:
    """What one run gave: its parameters before and after, its metric rows; or the exception that stopped it."""

    status: str  # "ok", "refused" (CompileError / ConfigError), "error"
    before: Any = None
    after: Any = None
    rows: list[dict[str, float]] | None = None
    exc_type: str = ""
    message: str = ""
    phase: str = ""  # where it was raised: "build" or "run"
    key: str | None = None  # a ConfigError's key
    file: str | None = None  # a CompileError's file
    seconds: float = 0.0
    learner: Any = None  # the learner's whole state after (optimizer, target networks, counters)


class CellTimeout(Exception):
    pass


@contextlib.contextmanager
def _time_limit(seconds: int):
    """Raise :class:`CellTimeout` in the main thread after ``seconds`` (where signals can: POSIX, main thread)."""
    import threading

    if seconds <= 0 or not hasattr(signal, "SIGALRM") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_alarm(signum, frame):
        raise CellTimeout(f"timed out after {seconds} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _unwrap(e: BaseException) -> BaseException:
    """The exception a Ray task error carries (the one raised in the actor), else ``e``."""
    seen = set()
    while id(e) not in seen and isinstance(getattr(e, "cause", None), BaseException):
        seen.add(id(e))
        e = e.cause
    return e


def run_config(config: dict[str, Any], k: int = K, timeout: int = CELL_TIMEOUT_S) -> Outcome:
    """Build ``config`` into a :class:`msrl.Session`, run ``k`` iterations in one dispatch; the outcome."""
    import jax
    import numpy as np

    import msrl
    from msrl.config import validate_config

    t0, phase, session = time.perf_counter(), "build", None
    try:
        with _time_limit(timeout):
            try:
                session = msrl.Session(validate_config(config), iterations_per_dispatch=k)
                phase = "run"
                before = session.params()
                rows = session.run(k)
                after = session.params()
                learner = _learner_state(session.snapshot())
            finally:
                if session is not None:
                    session.close()
        before, after, learner = (jax.tree.map(np.asarray, p) for p in (before, after, learner))
        return Outcome("ok", before, after, rows, seconds=time.perf_counter() - t0, learner=learner)
    except Exception as raised:  # noqa: BLE001 - every exception is a verdict
        e = _unwrap(raised)
        refused = isinstance(e, (msrl.CompileError, msrl.ConfigError))
        message = str(e) if refused else f"{str(e)}\n{''.join(traceback.format_exception(raised))}"
        return Outcome("refused" if refused else "error", exc_type=type(e).__name__, message=message, phase=phase,
                       key=getattr(e, "key", None), file=getattr(e, "file", None), seconds=time.perf_counter() - t0)


def _learner_state(snapshot: dict[str, list[dict[str, Any]]]) -> Any:
    """The learner's whole state in a snapshot (its first replica's, in the first fragment holding it) as its
    leaves, without those a policy adds of its own (async's ``param_version``; multi_learner's all-reduce has
    none)."""
    import jax

    state = next((replicas[0]["learner"] for replicas in snapshot.values()
                  if replicas and isinstance(replicas[0], dict) and "learner" in replicas[0]), None)
    return None if state is None else [x for path, x in jax.tree_util.tree_flatten_with_path(state)[0]
                                       if "param_version" not in jax.tree_util.keystr(path)]


# ---------------------------------------------------------------------------------------------- verdicts
@dataclasses.dataclass
class Cell:
    loop: str
    column: str  # a Column id
    verdict: str
    detail: str
    seconds: float = 0.0
    unclear: str = ""  # a refusal whose message does not read as a clear one: why


def _leaves(tree: Any) -> list[Any]:
    import jax
    import numpy as np

    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def max_diff(a: Any, b: Any) -> float:
    """The largest absolute difference over every leaf (inf: the trees differ in structure or shapes; NaN
    anywhere makes it NaN)."""
    import jax
    import numpy as np

    if jax.tree.structure(a) != jax.tree.structure(b):
        return math.inf
    out = 0.0
    for x, y in zip(_leaves(a), _leaves(b), strict=True):
        if x.shape != y.shape:
            return math.inf
        if x.size:
            d = float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64))))
            if math.isnan(d):
                return math.nan
            out = max(out, d)
    return out


def _finite(tree: Any) -> bool:
    import numpy as np

    return all(np.all(np.isfinite(x)) for x in _leaves(tree) if np.issubdtype(x.dtype, np.number))


_INTERNAL = ("_s_", "_msrl", "_api", "Traced<", "Tracer", "jaxpr", "Traceback", "<lambda>", "NoneType",
             "object has no attribute", "KeyError", "IndexError", "unhashable", "site-packages")


def unclear_reason(outcome: Outcome) -> str:
    """Why a refusal's message does not read as a clear one ("" when it does): too short, naming no config
    key (ConfigError) and no place or hint (CompileError), or showing internals."""
    first = outcome.message.strip().splitlines()[0] if outcome.message.strip() else ""
    reasons = []
    if len(first) < 30:
        reasons.append("first line too short")
    if outcome.exc_type == "ConfigError" and not outcome.key:
        reasons.append("names no config key")
    if outcome.exc_type == "CompileError" and not outcome.file and "hint:" not in outcome.message:
        reasons.append("no file:line and no hint")
    shown = [m for m in _INTERNAL if m in _clean(outcome.message)]
    if shown:
        reasons.append(f"shows internals ({', '.join(shown)})")
    return "; ".join(reasons)


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_ROOT = str(Path(__file__).resolve().parent.parent) + os.sep


def _clean(text: str) -> str:
    """Without terminal colours, and with paths in this checkout relative to it."""
    return _ANSI.sub("", text).replace(_ROOT, "")


def _first_line(text: str, limit: int = 400) -> str:
    text = _clean(text).strip()
    line = text.splitlines()[0] if text else "(empty message)"
    return line if len(line) <= limit else line[:limit] + "…"


def _root_cause(text: str, wrapper: str = "") -> str:
    """The last ``SomeError: ...`` line of a message with tracebacks that is not the ``wrapper`` error itself
    (what a wrapped error died of)."""
    lines = [ln.strip() for ln in _clean(text).splitlines()
             if re.match(r"^\s*[\w.]*(Error|Exception|Exit|Interrupt)\b.*:", ln)]
    inner = [ln for ln in lines if not wrapper or wrapper not in ln.split(":", 1)[0]]
    return (inner or lines or [""])[-1]


def _episodes(rows: list[dict[str, float]] | None) -> list[float]:
    return [r.get("episodes", math.nan) for r in rows or []]


def verdict(ref: Outcome | None, cell: Outcome, column: Column, k: int = K, tol: float = TOL) -> tuple[str, str, str]:
    """(verdict, detail, unclear) of a cell's outcome against the reference's."""
    if cell.status == "refused":
        return REFUSED, f"{cell.exc_type} at {cell.phase}: {_first_line(cell.message)}", unclear_reason(cell)
    if cell.status == "error":
        first, cause = _first_line(cell.message), _root_cause(cell.message, cell.exc_type)
        because = f" … {cause}" if cause and cause not in first and not first.endswith(cause.split(": ", 1)[-1]) else ""
        return ERROR, f"{cell.exc_type} at {cell.phase}: {first}{because}", ""
    if ref.status != "ok":
        return ERROR, f"the fused reference did not run ({ref.exc_type}: {_first_line(ref.message)})", ""
    diff = max_diff(ref.after, cell.after)
    moved = max_diff(cell.before, cell.after)
    if column.expect == "design":
        trained = _finite(cell.after) and moved > 0 and not math.isnan(moved)
        if not trained:
            why = "non-finite parameters" if not _finite(cell.after) else "parameters never moved"
            return SILENT, f"did not train in {k} iterations: {why} (max abs change from init {moved:.3g})", ""
        same = f" (within tol: the policy changed little in {k} iterations)" if diff <= tol else ""
        lag = [r["policy_lag"] for r in cell.rows or [] if "policy_lag" in r]
        return DESIGN, (f"trained: finite, params moved (max abs change from init {moved:.3g}); vs fused: max diff "
                        f"{diff:.3g}{same}; episodes {_episodes(cell.rows)}"
                        + (f"; policy_lag {lag}" if lag else "")), ""
    ref_eps, eps = _episodes(ref.rows), _episodes(cell.rows)
    problems = []
    if not diff <= tol:  # NaN too
        problems.append("parameter trees differ in structure or shape" if math.isinf(diff)
                        else f"max diff {diff:.3g} after {k} iterations (tol {tol:g})")
    whole = max_diff(ref.learner, cell.learner)  # (leaf lists: a policy's empty optax states have no leaves)
    if diff <= tol and not whole <= tol:
        what = "the learner's state (optimizer, target networks, counters)"
        problems.append(f"{what} differs in its leaves' number or shapes" if math.isinf(whole) else
                        f"{what} differs by {whole:.3g} after {k} iterations, its policy parameters not")
    if eps != ref_eps:
        problems.append(f"episodes per iteration {eps} vs fused {ref_eps}")
    if problems:
        return SILENT, "; ".join(problems), ""
    note = metric_differences(ref.rows, cell.rows, tol)
    note = f"; {_METRICS_DIFFER}: {note}" if note else ""
    state = f"; the learner's state within {whole:.3g}" if whole else ""  # (bitwise: both are)
    return EQUAL, ("bitwise" if diff == 0 and not whole else
                   f"≤ tol (max diff {diff:.3g} after {k} iterations{state})") + note, ""


_METRICS_DIFFER = "but the logged metrics differ"
_POLICY_METRICS = ("policy_lag", "grads_applied", "stale_grads_dropped", "iteration", "env_steps")


def metric_differences(ref_rows: list[dict[str, float]] | None, rows: list[dict[str, float]] | None,
                       tol: float = TOL) -> str:
    """The metrics both runs log (but the policies' own counters) that differ by more than ``tol`` (relative
    to the reference's magnitude, at least 1) in some iteration; "" when none do."""
    out = []
    for i, (a, b) in enumerate(zip(ref_rows or [], rows or [])):
        for key in sorted(set(a) & set(b) - set(_POLICY_METRICS)):
            x, y = float(a[key]), float(b[key])
            if (math.isnan(x) and math.isnan(y)) or abs(x - y) <= tol * max(1.0, abs(x)):
                continue
            out.append(f"{key} at iteration {i + 1}: {y:.6g} vs fused {x:.6g}")
    missing = sorted(set((ref_rows or [{}])[0]) - set((rows or [{}])[0]) - set(_POLICY_METRICS))
    if missing:
        out.append(f"not logged: {', '.join(missing)}")
    return "; ".join(out[:4]) + (f"; … ({len(out) - 4} more)" if len(out) > 4 else "")


# ---------------------------------------------------------------------------------------------- the matrix
def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _init_ray() -> bool:
    """Start the one local Ray cluster every Ray cell shares (4 CPUs, loopback only, no dashboard); False if
    one runs."""
    import ray

    from msrl.registry import BACKENDS

    if ray.is_initialized():
        return False
    BACKENDS.get("ray").start_local(num_cpus=4)
    return True


def _setup(loop: Loop) -> str | None:
    """Make the loop's algorithm known; the reason it cannot be, if it cannot."""
    try:
        if loop.setup is not None:
            loop.setup()
        return None
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"


def _devices_outcomes(loops: list[str], columns: list[str], k: int, timeout: int) -> dict[tuple[str, str], Outcome]:
    """Run the ``devices`` cells in one subprocess with 4 forced host devices; their outcomes."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "outcomes.pkl"
        env = {**os.environ, "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") +
                                           " --xla_force_host_platform_device_count=4").strip()}
        cmd = [sys.executable, "-m", "msrl.conformance", "--worker-devices", str(out), "--k", str(k),
               "--timeout", str(timeout), "--only", *loops, "--columns", *columns]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False,
                              timeout=timeout * len(loops) * len(columns) + 300)
        if proc.returncode != 0 or not out.is_file():
            why = f"the devices subprocess failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}"
            return {(lp, c): Outcome("error", exc_type="SubprocessError", message=why, phase="build")
                    for lp in loops for c in columns}
        with open(out, "rb") as f:
            return pickle.load(f)


def _worker_devices(path: str, loops: list[str], columns: list[str], k: int, timeout: int) -> int:
    import jax

    if jax.device_count() < 4:
        raise SystemExit(f"the devices worker needs 4 JAX devices, has {jax.device_count()} (XLA_FLAGS?)")
    outcomes = {}
    for name in loops:
        loop = LOOPS[name]
        problem = _setup(loop)
        for cid in columns:
            if problem:
                outcomes[(name, cid)] = Outcome("error", exc_type="SetupError", message=problem, phase="build")
                continue
            _log(f"[devices] {name} × {cid} ...")
            outcomes[(name, cid)] = run_config(loop.config(COLUMN[cid].policy), k, timeout)
    with open(path, "wb") as f:
        pickle.dump(outcomes, f)
    return 0


def run_matrix(loops: list[str] | None = None, columns: list[str] | None = None, *, ray: bool = True,
               devices: bool = True, k: int = K, tol: float = TOL, timeout: int = CELL_TIMEOUT_S,
               log: Callable[[str], None] = _log) -> tuple[list[Cell], dict[str, dict[str, Any]]]:
    """Run the reference and every selected cell. Returns the cells (in loop, column order) and, by loop, the
    reference's facts (seconds, how far its parameters moved, its episodes) and the columns it skips."""
    loops = list(loops or LOOPS)
    unknown = [c for c in columns or [] if c not in COLUMN]
    if unknown:
        raise ValueError(f"unknown column(s) {unknown}; choose from {', '.join(COLUMN)}")
    asked = [c for c in COLUMNS if columns is None or c.id in columns]
    columns = [c for c in asked if (ray or c.where != "ray") and (devices or c.where != "devices")]
    if not columns:
        raise ValueError(f"no cell to run: the columns asked for ({', '.join(c.id for c in asked)}) are Ray or "
                         "JAX-devices cells, which --fast, --no-ray and --no-devices leave out")
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"--k: iterations per cell must be a whole number >= 1, got {k!r}")
    unknown = [n for n in loops if n not in LOOPS]
    if unknown:
        raise ValueError(f"unknown loop(s) {unknown}; the corpus: {', '.join(LOOPS)}")
    refs: dict[str, Outcome] = {}  # the fused references, run when a cell first needs one
    info: dict[str, dict[str, Any]] = {}
    outcomes: dict[tuple[str, str], Outcome] = {}

    def reference(name: str) -> Outcome:
        if name not in refs:
            log(f"{name}: fused reference ...")
            refs[name] = ref = run_config(LOOPS[name].config(REFERENCE), k, timeout)
            if ref.status == "ok":
                moved = max_diff(ref.before, ref.after)
                info[name]["reference"] = f"{ref.seconds:.0f} s; params moved by {moved:.3g}; " \
                                          f"episodes {_episodes(ref.rows)}"
            else:
                info[name]["reference"] = f"{ref.status}: {ref.exc_type}: {_first_line(ref.message)}"
        return refs[name]

    judged: dict[tuple[str, str], Cell] = {}

    def judge(name: str, col: Column) -> None:
        out = outcomes[(name, col.id)]
        ref = reference(name) if out.status == "ok" else None
        v, detail, unclear = verdict(ref, out, col, k, tol)
        judged[(name, col.id)] = Cell(name, col.id, v, detail, out.seconds, unclear)
        log(f"  {name} × {col.id}: {v} — {detail}" + (f" [UNCLEAR: {unclear}]" if unclear else ""))

    setup_problem: dict[str, str] = {}
    for name in loops:  # this process's cells, loop by loop
        loop = LOOPS[name]
        info[name] = {"skip": {c.id: loop.skip[c.id] for c in columns if c.id in loop.skip},
                      "reference": "not run: no cell ran to compare with it"}
        problem = _setup(loop)
        if problem:
            setup_problem[name] = info[name]["reference"] = f"could not be set up: {problem}"
            continue
        for col in columns:
            if col.where == "main" and col.id not in loop.skip:
                log(f"{name} × {col.id} ...")
                outcomes[(name, col.id)] = run_config(loop.config(col.policy), k, timeout)
                judge(name, col)
    ray_cols = [c for c in columns if c.where == "ray"]
    if ray_cols and any(c.id not in LOOPS[n].skip for n in loops for c in ray_cols):
        try:
            started_ray = _init_ray()
            ray_problem = None
        except Exception as e:  # noqa: BLE001
            ray_problem = f"{type(e).__name__}: {e}"
        for name in loops:
            for col in ray_cols:
                if col.id in LOOPS[name].skip or name in setup_problem:
                    continue
                if ray_problem:
                    outcomes[(name, col.id)] = Outcome("error", exc_type="RayInitError", message=ray_problem,
                                                       phase="build")
                    continue
                log(f"{name} × {col.id} ...")
                outcomes[(name, col.id)] = run_config(LOOPS[name].config(col.policy), k, timeout)
                judge(name, col)
        if not ray_problem and started_ray:
            from msrl.registry import BACKENDS

            BACKENDS.get("ray").shutdown()
    dev_cols = [c.id for c in columns if c.where == "devices"]
    dev_loops = [n for n in loops if n not in setup_problem]
    if dev_cols and dev_loops:
        log(f"devices subprocess: {len(dev_loops)} loops × {dev_cols} ...")
        dev = _devices_outcomes(dev_loops, dev_cols, k, timeout)
        outcomes.update({key: o for key, o in dev.items() if key[1] not in LOOPS[key[0]].skip})
    cells = []
    for name in loops:
        for col in columns:
            if col.id in LOOPS[name].skip:
                continue
            if name in setup_problem:
                cells.append(Cell(name, col.id, ERROR, f"the loop {setup_problem[name]}"))
                continue
            if (name, col.id) not in judged:
                judge(name, col)
            cells.append(judged[(name, col.id)])
    return cells, info


def counts(cells: list[Cell]) -> dict[str, int]:
    return {v: sum(c.verdict == v for c in cells) for v in VERDICTS}


# ---------------------------------------------------------------------------------------------- report
_SHORT = {EQUAL: "=", REFUSED: "refused", DESIGN: "≠ design ✓", SILENT: "**SILENTLY DIFFERENT**", ERROR: "**ERROR**"}


def _short(cell: Cell) -> str:
    if cell.verdict == EQUAL:
        return ("= bitwise" if cell.detail.startswith("bitwise") else "= ≤ tol") + \
            (" (metrics ≠)" if _METRICS_DIFFER in cell.detail else "")
    if cell.verdict == REFUSED and cell.unclear:
        return "refused (**unclear**)"
    return _SHORT[cell.verdict]


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render(cells: list[Cell], info: dict[str, dict[str, Any]], command: str, seconds: float, k: int = K,
           tol: float = TOL) -> str:
    loops = list(dict.fromkeys(c.loop for c in cells)) or list(info)
    cols = [c for c in COLUMNS if any(cell.column == c.id for cell in cells)]
    by = {(c.loop, c.column): c for c in cells}
    n = counts(cells)
    lines = [
        "# Conformance matrix",
        "",
        f"Generated by `{command}` on {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')} "
        f"({seconds / 60:.1f} min; {len(cells)} cells).",
        "",
        f"Every loop runs {k} iterations (seed 0, {NUM_ENVS} environments in total, one dispatch) under `fused` on "
        "`jax` — the reference — and under each policy/backend below (2 actors × 4 envs, or the workers / learners "
        "sharing the 8 envs; `replay_server` with 1 shard). Each cell has exactly one verdict:",
        "",
        f"- **equal to fused** (`= bitwise`, `= ≤ tol`): `Session.params()` and the learner's whole state "
        "(optimizer, target networks, counters; a policy's own counter such as `async`'s `param_version` left "
        f"out) equal the reference leaf by leaf — bitwise, or within {tol:g} (the detail gives the max diffs) — "
        "and so does the per-iteration `episodes` column.",
        "- **refused**: building or running raised `msrl.CompileError` / `msrl.ConfigError`; the first line of "
        "the message is recorded. `refused (unclear)` flags a message that does not read clearly (too short, "
        "naming no config key, or no file:line/hint, or showing internals).",
        "- **different by design** (`≠ design ✓`): only `multi_learner` with 2 learners, `async` with 2 workers "
        "and `single_learner_coarse` with `sync: false` (policy lag 1) change the numbers on purpose (outside the "
        "matrix, so do `replay_server` with several shards or `param_sync_every` > 1); the cell "
        "checks that the run is finite and its parameters moved (it trained).",
        "- **SILENTLY DIFFERENT**: it ran, was not refused, and differs beyond the tolerance where equality is "
        "promised (or a by-design run did not train). **ERROR**: it crashed with an exception that is not an "
        "msrl refusal. Both are failures: the command exits 1.",
        "- `—`: not a cell (see the loop's notes).",
        "",
        "## Counts",
        "",
        "| verdict | cells |",
        "|---|---|",
        *[f"| {v} | {n[v]} |" for v in VERDICTS],
        f"| **total** | {len(cells)} |",
        "",
    ]
    unclear = [c for c in cells if c.verdict == REFUSED and c.unclear]
    if unclear:
        lines.append(f"Refusals flagged unclear: {len(unclear)}.")
        lines.append("")
    lines += ["## Matrix", "", "| loop | " + " | ".join(c.label for c in cols) + " |",
              "|---|" + "---|" * len(cols)]
    for loop in loops:
        row = [_short(by[(loop, c.id)]) if (loop, c.id) in by else "—" for c in cols]
        lines.append(f"| `{loop}` | " + " | ".join(row) + " |")
    lines += ["", "## Loops", "", "| loop | what | reference (fused) | not cells |", "|---|---|---|---|"]
    for loop in loops:
        meta = LOOPS[loop]
        by_reason: dict[str, list[str]] = {}
        for c, why in info.get(loop, {}).get("skip", {}).items():
            by_reason.setdefault(why, []).append(c)
        skips = "; ".join(f"{', '.join(cs)} ({why})" for why, cs in by_reason.items())
        lines.append(f"| `{loop}` | {_md(meta.title)} — `{_md(json.dumps(meta.algorithm))}`"
                     f"{' on ' + meta.env['id'] if meta.env['id'] != 'gymnax:CartPole-v1' else ''} | "
                     f"{_md(info.get(loop, {}).get('reference', ''))} | {_md(skips)} |")
    failures = [c for c in cells if c.verdict in FAILURES]
    if failures or unclear:
        lines += ["", "## Failures and unclear refusals", "", "| loop | policy · backend | verdict | detail |",
                  "|---|---|---|---|"]
        for c in failures + unclear:
            extra = f" — unclear: {c.unclear}" if c.unclear and c.verdict == REFUSED else ""
            lines.append(f"| `{c.loop}` | {COLUMN[c.column].label} | {c.verdict} | {_md(c.detail + extra)} |")
    lines += ["", "## Every cell", "", "| loop | policy · backend | verdict | detail | s |", "|---|---|---|---|---|"]
    for c in cells:
        extra = f" — **unclear**: {c.unclear}" if c.unclear else ""
        lines.append(f"| `{c.loop}` | {COLUMN[c.column].label} | {c.verdict} | {_md(c.detail + extra)} | "
                     f"{c.seconds:.0f} |")
    lines.append("")
    return "\n".join(lines)


def summary(cells: list[Cell], seconds: float, out: str | None) -> dict[str, Any]:
    return {"cells": len(cells), "counts": counts(cells), "seconds": round(seconds, 1), "out": out,
            "failures": [{"loop": c.loop, "column": c.column, "verdict": c.verdict, "detail": c.detail}
                         for c in cells if c.verdict in FAILURES],
            "unclear_refusals": [{"loop": c.loop, "column": c.column, "detail": c.detail, "why": c.unclear}
                                 for c in cells if c.verdict == REFUSED and c.unclear],
            "equal_but_metrics_differ": [{"loop": c.loop, "column": c.column, "detail": c.detail}
                                         for c in cells if c.verdict == EQUAL and _METRICS_DIFFER in c.detail]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m msrl.conformance", description=__doc__.split("\n\n")[0])
    parser.add_argument("--fast", action="store_true", help=f"threads and jax cells only (no Ray cluster, no "
                        f"devices subprocess); loops {', '.join(FAST_LOOPS)} unless --only")
    parser.add_argument("--out", help="the markdown report ('' or '-': none; default: docs/conformance.md for the "
                        "whole matrix, none for a part of it, which would replace that report)")
    parser.add_argument("--only", nargs="+", action="extend", metavar="LOOP", help=f"loops: {', '.join(LOOPS)}")
    parser.add_argument("--columns", nargs="+", action="extend", metavar="ID",
                        help=f"policy/backend cells: {', '.join(COLUMN)}")
    parser.add_argument("--no-ray", action="store_true", help="leave out the Ray cells")
    parser.add_argument("--no-devices", action="store_true", help="leave out the JAX-devices cells (subprocess)")
    parser.add_argument("--k", type=int, default=K, help="iterations per cell")
    parser.add_argument("--timeout", type=int, default=CELL_TIMEOUT_S, help="seconds per run before it is an ERROR")
    parser.add_argument("--worker-devices", metavar="PICKLE", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    loops = [name for item in (args.only or []) for name in item.split(",") if name] or None
    columns = [c for item in (args.columns or []) for c in item.split(",") if c] or None
    if args.worker_devices:
        return _worker_devices(args.worker_devices, loops or list(LOOPS), columns or [], args.k, args.timeout)
    if args.fast and loops is None:
        loops = list(FAST_LOOPS)
    command = "python -m msrl.conformance" + (" " + " ".join(argv if argv is not None else sys.argv[1:])).rstrip()
    t0 = time.perf_counter()
    try:
        cells, info = run_matrix(loops, columns, ray=not (args.fast or args.no_ray),
                                 devices=not (args.fast or args.no_devices), k=args.k, timeout=args.timeout)
    except ValueError as e:
        parser.error(str(e))
    seconds = time.perf_counter() - t0
    whole = not (loops or columns or args.fast or args.no_ray or args.no_devices)
    out = args.out if args.out is not None else "docs/conformance.md" if whole else ""
    out = out if out not in ("", "-") else None
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(render(cells, info, command, seconds, args.k))
    print(json.dumps(summary(cells, seconds, out), indent=1))
    return 1 if any(c.verdict in FAILURES for c in cells) else 0


if __name__ == "__main__":  # run as the module msrl.conformance, so what the devices worker pickles unpickles anywhere
    from msrl.conformance import main as _main

    sys.exit(_main())
