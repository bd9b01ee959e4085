"""The training driver: config -> env, algorithm, program, runtime -> a run directory with metrics."""

from __future__ import annotations

import contextlib
import csv
import errno
import importlib
import json
import math
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Callable

import yaml

from msrl import checkpoint, resources
from msrl.algorithm import Context
from msrl.config import (ExperimentConfig, dotted, dump_yaml, in_file, override_list, read_config, spread,
                         validate_config)
from msrl.envs import make_env
from msrl.errors import (CLI_FLAGS, CompileError, ConfigError, Interrupted, MsrlError, TrainingError, arg, defined_at,
                         did_you_mean, user_code_error)
from msrl.plot import read_metrics
from msrl.registry import ALGORITHMS
from msrl.replay import PrioritizedBuffer, TrajectoryBuffer
from msrl.policy import answer
from msrl.runtime.session import check_members
from msrl.sweep import build_guard, member_config, members, spread_over_cores

TARGET_STEPS_PER_DISPATCH = 16_384
PLAIN_LOG_S = 10.0  # seconds between progress lines when stdout is not a terminal


def enable_compile_cache(directory: str | Path) -> None:
    import jax

    Path(directory).mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # the small ones too: they add up at start


def build(cfg: ExperimentConfig):
    """The compiled program of a validated config (its env and algorithm made and compiled; nothing runs yet)."""
    import jax

    from msrl.compiler import compile as compile_program

    if jax.config.jax_enable_x64:  # (the buffers' int32 indices and the algorithms' float32 state)
        raise ConfigError("jax_enable_x64", "msrl trains in 32 bits, but JAX's 64-bit mode is on (jax.config.update("
                          "'jax_enable_x64', True) or JAX_ENABLE_X64 in this process); turn it off to train (a policy "
                          "msrl.load gives acts either way)")
    env = make_env(cfg.env.id, cfg.env.subprocesses, cfg.env.xla, **cfg.env.kwargs)
    with build_guard(cfg.algorithm, list(cfg.run.sweep)):  # (a swept key used here would hold one value only)
        algorithm = make_algorithm(cfg, env.spec)
    program = compile_program(algorithm, cfg.policy, env, cfg.policy.total_envs(cfg.env.num_envs))
    from msrl.backend import replica_env_ids

    for fragment in program.fragments.values():  # each replica an equal share: refused here, before a backend
        replica_env_ids(program.num_envs, fragment)  # starts (a Ray cluster, say), as the backends do
    return program


def versions() -> dict[str, str]:
    """The versions a checkpoint records: a run resumed by other ones goes on, but not bitwise as before."""
    from importlib.metadata import version

    return {name: version(name) for name in ("msrl", "jax", "jaxlib")}


def make_algorithm(cfg: ExperimentConfig, env_spec: Any) -> Any:
    """The config's algorithm for an env of ``env_spec``, with the context its policy gives it; an exception its
    constructor raises is an error naming the file and line."""
    plan = answer(cfg.policy, "learner_plan")
    ctx = Context(env_spec=env_spec, num_envs=cfg.policy.total_envs(cfg.env.num_envs),
                  total_env_steps=cfg.run.total_env_steps, updates_per_iteration=plan.updates_per_iteration,
                  learner_replicas=plan.learner_replicas)
    cls = ALGORITHMS.get(cfg.algorithm.name)
    try:
        algorithm = cls(cfg.algorithm, ctx)
    except MsrlError:
        raise
    except Exception as e:
        raise user_code_error(e, cls.__module__, "algorithm") from e
    if not hasattr(algorithm, "cfg"):
        raise CompileError(f"{cls.__name__}.__init__ never calls super().__init__(cfg, ctx): self.cfg and self.ctx "
                           "are unset", *defined_at(cls))
    return algorithm


# a logged row's columns: these first, then the loop's own metrics (under "train/" in TensorBoard)
FIRST_COLUMNS = ("iteration", "env_steps", "episode_return", "episode_length", "sps", "wall_time")
SNAPSHOTS = ("episode_return", "episode_length", "episodes", "episode_return_std",  # a row's end state, not a mean
             "grads_applied", "stale_grads_dropped")
MAX_ROWS = 1000  # rows a run writes at most unless run.log_every_steps says otherwise
TB_GROUP = {"episode_return": "charts", "episode_length": "charts", "episodes": "charts",
            "episode_return_std": "charts", "sps": "perf", "wall_time": "perf"}


def merge_rows(rows: list[dict[str, float]]) -> dict[str, float]:
    """One metrics row of several iterations: the episode statistics at the last one, every other metric
    averaged over them."""
    out = {k: sum(r[k] for r in rows) / len(rows) for k in rows[-1] if k not in SNAPSHOTS}
    out.update({k: rows[-1][k] for k in SNAPSHOTS if k in rows[-1]})
    out.update(iteration=rows[-1]["iteration"], env_steps=rows[-1]["env_steps"], wall_time=rows[-1]["wall_time"])
    return out


def tensorboard_writer() -> type:
    """tensorboardX's ``SummaryWriter``. tensorboardX imports PyTorch where it is installed (seconds at every start),
    only for its type hints and torch inputs, and boto3 (~0.15 s) for ``s3://`` log dirs; msrl logs numbers to a local
    run directory, so tensorboardX is imported as if those were not installed (its own fallback for each), unless
    they are loaded already."""
    if "tensorboardX" not in sys.modules:
        from msrl.envs.gymnax_env import standing_in

        with standing_in(dict.fromkeys(name for name in ("torch", "boto3") if name not in sys.modules)):
            importlib.import_module("tensorboardX")
    from tensorboardX import SummaryWriter

    return SummaryWriter


_MISSING = object()


def _float(text: str) -> float:
    """A metrics.csv field as a number (nan where it is none)."""
    try:
        return float(text)
    except ValueError:
        return math.nan


class _Table:
    """One metrics.csv and its TensorBoard events (a run's, or one seed's of a run of several)."""

    def __init__(self, folder: Path, cfg: ExperimentConfig, resume_at: int | None):
        folder.mkdir(parents=True, exist_ok=True)
        kept: list[dict] = []
        path = folder / "metrics.csv"
        if resume_at is not None:  # drop rows after the checkpoint
            if path.exists():
                kept = [r for r in read_metrics(path) if r.get("iteration", "").isdigit()
                        and int(r["iteration"]) <= resume_at]
                rewrite_csv(path, kept)
            last = int(kept[-1]["iteration"]) if kept else 0
            if last != resume_at:  # (a checkpoint is always of a logged row's iteration)
                print(f"msrl: note: {path}'s rows end at iteration {last}, the checkpoint is of iteration {resume_at}"
                      f": the rows of iterations {last + 1}..{resume_at} are lost (the file was cut, edited or "
                      f"removed); the rows go on from iteration {resume_at + 1}", file=sys.stderr, flush=True)
        self.csv_file = open(path, "a" if resume_at is not None else "w", newline="")
        self.writer: csv.DictWriter | None = None
        self.kept = kept  # (until the first row: a resumed run whose code logs new metrics rewrites the header)
        if kept:
            self.writer = csv.DictWriter(self.csv_file, fieldnames=list(kept[0]), extrasaction="ignore")
        self.tb = None
        # TensorBoard's writer (its import, a queue and a thread: ~0.15 s) opens at the first row, which the
        # jax backend hands over while it computes the next ones, rather than while the first ones wait for it
        self.tb_folder = folder / "tb" if cfg.run.tensorboard else None
        # resumed: TensorBoard drops every earlier event (those logged after the checkpoint are redone, and a kill
        # loses those its writer had not flushed yet) and is given metrics.csv's rows again: it holds what they hold
        self.tb_purge = 1 if resume_at is not None else None
        self.tb_rows = [{k: _float(v) for k, v in r.items()} for r in kept]
        # (a resumed run's config is the one already there)
        self.tb_config = None if resume_at is not None else cfg.dump()

    def board(self) -> Any:
        """The TensorBoard writer (None without ``run.tensorboard``), opened at its first use."""
        if self.tb is None and self.tb_folder is not None:
            self.tb = tensorboard_writer()(str(self.tb_folder), purge_step=self.tb_purge)
            if self.tb_config is not None:
                self.tb.add_text("config", "```yaml\n" + dump_yaml(self.tb_config, sort_keys=False) + "```")
            for row in self.tb_rows:
                self.add_scalars(row)
        return self.tb

    def add_scalars(self, row: dict[str, float]) -> dict[str, float]:
        """``row``'s finite scalars under their TensorBoard tags, given to TensorBoard where it is on."""
        scalars = {f"{TB_GROUP.get(k, 'train')}/{k}": v for k, v in row.items()
                   if k not in ("iteration", "env_steps") and isinstance(v, float | int) and math.isfinite(v)}
        for k, v in scalars.items() if self.tb is not None else ():
            self.tb.add_scalar(k, v, int(row["env_steps"]))
        return scalars

    def log(self, row: dict[str, float]) -> dict[str, float]:
        """Write ``row``; returns its finite scalars under their TensorBoard tags."""
        new = [k for k in row if self.kept and k not in self.kept[0]]
        if new:  # a resumed run logs metrics its rows before lack (msrl or the algorithm changed): add columns
            path = Path(self.csv_file.name)
            self.csv_file.close()
            columns = [*self.kept[0], *new]
            rewrite_csv(path, self.kept, columns)
            print(f"msrl: note: {path} gains the column{'s' * (len(new) > 1)} {', '.join(new)} (the rows before the "
                  "resumed checkpoint leave them empty)", file=sys.stderr, flush=True)
            self.csv_file = open(path, "a", newline="")
            self.writer = csv.DictWriter(self.csv_file, fieldnames=columns, extrasaction="ignore")
        self.kept = []
        if self.writer is None:
            self.writer = csv.DictWriter(self.csv_file, extrasaction="ignore",
                                         fieldnames=[*FIRST_COLUMNS, *(k for k in row if k not in FIRST_COLUMNS)])
            self.writer.writeheader()
        self.writer.writerow(row)
        self.board()
        return self.add_scalars(row)

    def close(self, cfg: ExperimentConfig, final_return: float) -> None:
        if self.board() is not None:
            # (a sweep's root averages members of different values: not one trial, so no hparams session)
            if math.isfinite(final_return) and not cfg.run.sweep:
                for old in (Path(self.tb.file_writer.get_logdir()) / "hparams").glob("events.out.tfevents.*"):
                    old.unlink()  # the session an interrupted call of this run wrote: one run, one hparams session
                self.tb.add_hparams(_flat(cfg.dump()), {"hparam/episode_return": final_return}, name="hparams")
            self.tb.close()
        self.csv_file.close()


def member_dirs(run_dir: Path, cfg: ExperimentConfig) -> list[tuple[Path, ExperimentConfig]]:
    """Where each member of a run of several (``run.num_seeds`` x ``run.sweep``) logs, with its own config:
    ``RUN_DIR/seed_N``, ``RUN_DIR/lr=0.001`` or ``RUN_DIR/lr=0.001,seed_N``."""
    each = members(cfg.run)
    return [(run_dir / m.name, member_config(cfg, m)) for m in each] if len(each) > 1 else []


def _shown(row: dict[str, float]) -> str:
    """A row's return as the progress shows it."""
    return "-" if math.isnan(row["episode_return"]) else f"{row['episode_return']:.1f}"


class _Logger:
    """metrics.csv (one row per logged interval), TensorBoard events, Weights & Biases, and the progress bar.
    A run of several seeds or swept values logs their mean (and ``episode_return_std``) in the run directory and
    each member's own rows and config in its folder (:func:`member_dirs`)."""

    def __init__(self, run_dir: Path, cfg: ExperimentConfig, total_steps: int, resume_at: int | None = None):
        self.run_dir, self.cfg = run_dir, cfg
        self.table = _Table(run_dir, cfg, resume_at)
        self.members = []
        for d, member_cfg in member_dirs(run_dir, cfg):
            self.members.append((_Table(d, member_cfg, resume_at), member_cfg))
            checkpoint.write_atomic(d / "config.yaml", dump_yaml(member_cfg.dump(), sort_keys=False).encode())
        self.wandb = None
        if cfg.run.wandb is not None:
            try:
                self.wandb = _wandb_run(run_dir, cfg, resumed=resume_at is not None)
            except BaseException:  # its metrics files and TensorBoard writers (threads) close again
                for table in (self.table, *(t for t, _ in self.members)):
                    table.close(cfg, math.nan)
                raise
        self.progress, self.plain = None, None  # a bar on a terminal; elsewhere a plain line every ~10 s
        self.unprinted: dict | None = None  # the last row a plain line did not show
        self.label, self.total = f"{cfg.algorithm.name} [{cfg.policy.name}]", total_steps
        if cfg.run.progress and not sys.stderr.isatty():  # (on stderr: stdout is the summary's JSON alone)
            self.plain = 0.0
        elif cfg.run.progress:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                                     TextColumn("{task.completed:,.0f}/{task.total:,.0f} steps"),
                                     TextColumn("{task.fields[sps]:,.0f} SPS"),
                                     TextColumn("return {task.fields[ret]}"), TimeRemainingColumn(), transient=False,
                                     console=Console(stderr=True))
            self.task = self.progress.add_task(rf"{cfg.algorithm.name} \[{cfg.policy.name}]", total=total_steps,
                                               sps=0, ret="-")
            self.progress.start()

    def log(self, row: dict[str, float], per_seed: list[dict[str, float]] = ()) -> None:
        scalars = self.table.log(row)
        for (table, _), seed_row in zip(self.members, per_seed):
            for k, v in table.log(seed_row).items():
                scalars[f"{table.csv_file.name.split('/')[-2]}/{k}"] = v
        if self.wandb is not None:
            self.wandb.log({**scalars, "iteration": row["iteration"]}, step=int(row["env_steps"]))

    def update(self, row: dict[str, float]) -> None:
        for table in (self.table, *(t for t, _ in self.members)):
            table.csv_file.flush()
        if self.plain is not None:
            self.unprinted = row
            if time.monotonic() - self.plain >= PLAIN_LOG_S or row["env_steps"] >= self.total:
                self._line()
        if self.progress is not None:
            self.progress.update(self.task, completed=row["env_steps"], sps=row["sps"], ret=_shown(row))

    def _line(self) -> None:
        """The plain progress line of the last row :meth:`update` had."""
        row, self.unprinted, self.plain = self.unprinted, None, time.monotonic()
        print(f"{self.label} {row['env_steps']:,.0f}/{self.total:,.0f} steps  {row['sps']:,.0f} SPS  "
              f"return {_shown(row)}", file=sys.stderr, flush=True)

    def close(self, final_return: float = math.nan, seed_returns: list[float] = ()) -> None:
        if self.progress is not None:
            self.progress.stop()
        if self.unprinted is not None:  # a run that stopped early: where it stopped
            self._line()
        try:
            self.table.close(self.cfg, final_return)
            for (table, member_cfg), ret in zip(self.members, seed_returns):
                table.close(member_cfg, ret)
        finally:
            if self.wandb is not None:
                self.wandb.finish()


def rewrite_csv(path: Path, rows: list[dict], columns: list[str] | None = None) -> None:
    """Replace a CSV file by ``rows`` (header ``columns``, else the first row's keys) atomically: a kill at any
    moment leaves either the old file or the new one (a resumed run then appends to it)."""
    import io

    text = io.StringIO()
    if rows:
        writer = csv.DictWriter(text, fieldnames=columns or list(rows[0]), lineterminator="\r\n")
        writer.writeheader()
        writer.writerows(rows)
    checkpoint.write_atomic(path, text.getvalue().encode())



def _flat(config: dict, prefix: str = "") -> dict[str, Any]:
    """A config's scalar values under dotted keys (TensorBoard's hparams take nothing else)."""
    out: dict[str, Any] = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        elif isinstance(v, (bool, int, float, str)):
            out[f"{prefix}{k}"] = v
        elif isinstance(v, list):  # (algorithm.hidden) as its text
            out[f"{prefix}{k}"] = str(v)
    return out


def _import_wandb() -> Any:
    try:
        import wandb
    except ImportError:
        raise ConfigError("run.wandb", "needs the wandb package: pip install -e '.[wandb]' in msrl's folder") from None
    return wandb


def _wandb_run(run_dir: Path, cfg: ExperimentConfig, resumed: bool) -> Any:
    """A Weights & Biases run with the config (``run.wandb``), its files under ``RUN_DIR/wandb``. A resumed run
    goes on in the W&B run it started (its id kept in ``RUN_DIR/wandb/run_id``), not in a second one."""
    wandb = _import_wandb()
    w, id_file = cfg.run.wandb, run_dir / "wandb" / "run_id"
    run_id = id_file.read_text().strip() if resumed and id_file.exists() else None
    try:
        run = wandb.init(project=w.project, entity=w.entity, name=w.name or run_dir.resolve().name, tags=w.tags,
                         mode=w.mode, dir=str(run_dir), config=cfg.dump(), reinit="create_new", id=run_id,
                         resume="allow" if run_id else None)
    except Exception as e:  # noqa: BLE001 - wandb's own (no API key, no network...): one line naming the key
        raise ConfigError("run.wandb", f"Weights & Biases did not start: {type(e).__name__}: {e} (run.wandb.mode="
                          "offline, or WANDB_MODE=offline, needs no account or network)") from None
    id_file.parent.mkdir(exist_ok=True)
    id_file.write_text(run.id)
    return run


RUN_FILES = ("config.yaml", "metrics.csv", "summary.json", "checkpoints", "tb", "wandb")  # what a run directory holds
# (and the folders of a run of several seeds or swept values: seed_N/, KEY=VALUE/)


def member_folder_of(run_dir: Path) -> Path | None:
    """The run directory whose member's folder (``seed_N/``, ``KEY=VALUE/``) ``run_dir`` is, or None."""
    parent = run_dir.parent if run_dir.parent != Path(".") else run_dir.resolve().parent
    if not (run_dir.name.startswith("seed_") or "=" in run_dir.name) or not (parent / "checkpoints").is_dir():
        return None
    try:  # the parent a run of several members (its own folders seed_N/, KEY=VALUE/)
        run = (yaml.safe_load((parent / "config.yaml").read_text()) or {}).get("run") or {}
    except (OSError, yaml.YAMLError, AttributeError):
        return None
    return parent if isinstance(run, dict) and ((run.get("num_seeds") or 1) > 1 or run.get("sweep")) else None


def prepare_run_dir(run_dir: Path, resume: bool, overwrite: bool) -> bool:
    """A run directory holds one run: an existing non-empty one is refused unless the run continues
    (``resume``) or is replaced (``overwrite``, and only if it holds a run). True: the old run is to be
    cleared (:func:`clear_run_dir`), which waits until the new one has compiled and started, so that a
    config the compiler refuses leaves the old run as it was."""
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(arg("run_dir"), f"{run_dir} is a file, not a directory")
    run = member_folder_of(run_dir)
    if run is not None:
        raise ConfigError(arg("resume" if resume else "run_dir"), f"{run_dir} is one member's folder of the run in "
                          f"{run}, which holds every member's checkpoints: "
                          + (f"resume {run}" if resume else f"choose another {arg('run_dir')}"))
    outer = None if resume else next((p for p in run_dir.resolve().parents if _holds_a_run(p)), None)
    if outer is not None:  # (its --overwrite would keep this one as the user's files; its plots would not see it)
        raise ConfigError(arg("run_dir"), f"{run_dir} is inside the run in {outer}: choose a {arg('run_dir')} "
                          "outside it")
    if resume or not run_dir.exists() or not any(p.name != LOCK for p in run_dir.iterdir()):
        return False
    is_run = _has_run_files(run_dir)
    if not overwrite and is_run and not any(run_dir.rglob("ckpt_*.msgpack")):
        raise ConfigError(arg("run_dir"), f"{run_dir} already holds a run that stopped before its first checkpoint; "
                          f"start it again with {arg('overwrite', '')}, or choose another {arg('run_dir')}")
    if not is_run:  # (neither resumed nor replaced: someone's own files)
        raise ConfigError(arg("overwrite" if overwrite else "run_dir"), f"{run_dir} holds files but no run (none "
                          f"of {', '.join(RUN_FILES)}): not {'clearing' if overwrite else 'writing into'} it; choose "
                          f"another {arg('run_dir')}")
    if not overwrite:
        raise ConfigError(arg("run_dir"), f"{run_dir} already holds a run; continue it with "
                          f"{arg('resume', run_dir)}, or replace it with {arg('overwrite', '')}")
    return True


def _has_run_files(folder: Path) -> bool:
    """Whether ``folder`` holds any of what a run directory holds (:data:`RUN_FILES`)."""
    return any((folder / name).exists() for name in RUN_FILES)


def _holds_a_run(folder: Path) -> bool:
    """Whether ``folder`` is an msrl run's directory (not a project's of its own config.yaml and checkpoints/)."""
    if not (folder / "config.yaml").is_file() or not (checkpoint.saved(folder) or
                                                       (folder / "metrics.csv").is_file()):
        return False
    try:
        config = yaml.safe_load((folder / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return False
    return isinstance(config, dict) and isinstance(config.get("algorithm"), dict) and "env" in config


LOCK = ".msrl.lock"  # in a run directory: locked by the process writing the run, which it names


def lock_run_dir(run_dir: Path, key: str) -> contextlib.AbstractContextManager:
    """Hold ``run_dir`` for this process until the returned file is closed: a second run started into the same
    directory meanwhile (a new one before the first wrote anything, or a second resume) is refused, naming
    ``key``, instead of the two interleaving their files. No lock (and no refusal) where the system has none:
    Windows, or a file system without ``flock``."""
    try:
        import fcntl
    except ImportError:
        return contextlib.nullcontext()
    try:
        held = open(run_dir / LOCK, "a+")  # noqa: SIM115 - held until the run ends
    except OSError:  # (someone else's lock file: lock it read-only; a missing folder: refused on reading it)
        try:
            held = open(run_dir / LOCK)  # noqa: SIM115
        except OSError:
            return contextlib.nullcontext()
    try:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        for _ in range(20):  # (the holder writes its pid just after it locks: "process ?" when read between)
            held.seek(0)
            pid = held.read().strip()
            if pid:
                break
            time.sleep(0.025)
        held.close()
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):  # (no flock here: ENOLCK, ...)
            return contextlib.nullcontext()
        then = "then resume it" if key == arg("resume") else f"or choose another {arg('run_dir')}"
        raise ConfigError(key, f"{run_dir} is in use by another run (process {pid or '?'}) writing into it; wait "
                          f"for it to end, {then}") from None
    if held.writable():
        held.seek(0)
        held.truncate()
        held.write(f"{os.getpid()}\n")
        held.flush()
    return held


def writer_of(run_dir: Path) -> str | None:
    """The process id (as its lock file names it; '?' if it does not) of a run writing into ``run_dir`` now, or
    None (none is, or the system has no ``flock``)."""
    try:
        import fcntl

        held = open(run_dir / LOCK)  # noqa: SIM115 - closed below
    except (ImportError, OSError):
        return None
    with held:
        try:
            fcntl.flock(held, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as e:
            return (held.read().strip() or "?") if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN) else None
    return None


def clear_run_dir(run_dir: Path) -> None:
    """Remove a run's files from ``run_dir`` (what ``--overwrite`` replaces; the user's own files stay)."""
    import shutil

    members = [p for p in [*run_dir.glob("seed_*"), *run_dir.glob("*=*")]  # (a member's folder holds its metrics)
               if p.is_dir() and any((p / name).exists() for name in RUN_FILES)]
    for path in [*(run_dir / name for name in RUN_FILES), *members]:
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)


def _fresh_run_dir(cfg: ExperimentConfig) -> Path:
    """``runs/ALGORITHM-POLICY-TIMESTAMP``, with a suffix if that is taken, made here (two runs started in the
    same second each get their own)."""
    base = Path("runs") / f"{cfg.algorithm.name}-{cfg.policy.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    path, n = base, 1
    while True:
        try:
            path.mkdir(parents=True)
            return path
        except FileExistsError:
            n += 1
            path = base.with_name(f"{base.name}-{n}")


def intervals(run: Any, iterations: int, steps_per_iter: int) -> tuple[int, int]:
    """Iterations between logged rows and between checkpoints (a multiple of the former; 0: none)."""
    if run.log_every_steps is not None:
        log_every = max(1, round(run.log_every_steps / steps_per_iter))
    else:
        log_every = max(1, -(-iterations // MAX_ROWS))
    every = max(1, run.checkpoint_every_steps // steps_per_iter) if run.checkpoint_every_steps else 0
    return log_every, -(-every // log_every) * log_every


class _Signals:
    """SIGINT and SIGTERM while training: the first asks the run to stop after the iterations already
    started (it then checkpoints and writes its summary); a second one exits at once. While the run starts
    (``starting``: compiling, starting the backend) either one stops it at once (KeyboardInterrupt). The same
    signal again within ``SAME_S`` is the first one delivered twice: coreutils' ``timeout`` signals the process,
    then its process group (it stopped a run at once, saving nothing, one time in four)."""

    SAME_S = 0.5

    def __init__(self) -> None:
        self.received: str | None = None
        self.received_at = 0.0
        self.old: dict[int, Any] = {}
        self.starting = True
        self.unheard = False  # a signal came while starting (raised as KeyboardInterrupt where it landed)

    def __enter__(self) -> "_Signals":
        import signal
        import threading

        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        import signal
        import sys

        if self.received == signal.Signals(signum).name and time.monotonic() - self.received_at < self.SAME_S:
            return
        if self.received is not None or self.starting:
            self.unheard = True  # (where Python swallows it, in a garbage collector's callback
            # of JAX's, say, the run stops all the same once it has started: :meth:`heard`)
            raise KeyboardInterrupt
        self.received, self.received_at = signal.Signals(signum).name, time.monotonic()
        fresh = "\n" if getattr(sys.stderr, "isatty", lambda: False)() else ""  # (off a progress bar's line)
        print(f"{fresh}msrl: {self.received}: finishing the iterations under way, then saving a checkpoint (again to "
              "stop at once)", file=sys.stderr, flush=True)

    def heard(self) -> None:
        """Stop at once (KeyboardInterrupt) if a signal came while starting whose KeyboardInterrupt was lost."""
        if self.unheard:
            raise KeyboardInterrupt

    def __exit__(self, *exc: Any) -> None:
        import signal

        for sig, handler in self.old.items():
            signal.signal(sig, handler)
        self.old = {}


def _continue_with(run_dir: Path) -> str:
    """How the user continues an interrupted run: the command, or the call in Python."""
    return f"msrl train --resume {shlex.quote(str(run_dir))}" if CLI_FLAGS.get() else \
        f"msrl.train(None, run_dir={str(run_dir)!r}, resume=True)"


class TrainResult(dict):
    """What :func:`train` returns: the summary (a dict, as written to ``summary.json``) with the run's metric
    rows this call logged (one per ``run.log_every_steps``, as metrics.csv holds them) as ``.rows``, and its run
    directory as ``.run_dir`` (the one made for it where none was given)."""

    rows: list[dict[str, float]]
    run_dir: Path


def summary_json(summary: dict) -> str:
    """A summary as strict JSON: a number that is not finite (no episode ended: NaN) is written null."""
    def clean(v: Any) -> Any:
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, (list, tuple)):
            return [clean(x) for x in v]
        return {k: clean(x) for k, x in v.items()} if isinstance(v, dict) else v

    return json.dumps(clean(summary), indent=2, allow_nan=False)


@resources.mapped
def train(cfg: ExperimentConfig | str | Path | dict | None, overrides: list[str] = (),
          run_dir: str | Path | None = None, resume: bool = False, on_iteration: Callable[[dict], Any] | None = None,
          overwrite: bool = False, **sections: Any) -> TrainResult:
    """Train; returns the summary (also written to ``RUN_DIR/summary.json``) with the metric rows as ``.rows``
    and the run directory as ``.run_dir``. ``cfg``: a YAML file's path, a dict of its sections, a config from
    :func:`msrl.load_config`, or None with ``resume`` (the run's own). Overrides come as ``KEY.PATH=VALUE``
    strings or as sections: ``train(path, run={"seed": 1}, policy={...})``.
    ``resume``: continue the run in
    ``run_dir`` from its latest checkpoint (``cfg`` None: the run's own config). ``overwrite``: replace the
    run in ``run_dir`` (a used run directory is refused otherwise). ``on_iteration(row)`` is called with
    every metrics row; when it returns true the run stops after the iterations already started
    (``summary["stopped_early"]``); when it raises, the run stops so too, checkpoints, writes the summary and
    raises that exception again. SIGINT/SIGTERM stop it the same way, then checkpoint, write the summary
    and raise :class:`msrl.errors.Interrupted` naming the command that resumes it.
    A resume whose ``run.total_env_steps`` is less than its checkpoint's env steps is refused (a ConfigError
    naming ``run.total_env_steps``); exactly as many finishes at once, with the checkpoint's summary.
    metrics.csv is cut back to the checkpoint by an atomic replace, and summary.json is written atomically.
    A run directory this call made is removed again if the run fails before it logged a row or saved a
    checkpoint."""
    for name, flag in (("resume", resume), ("overwrite", overwrite)):
        if not isinstance(flag, bool):  # (resume="no" was true)
            raise ConfigError(name, f"true or false, got {type(flag).__name__} {flag!r:.100}")
    if on_iteration is not None and not callable(on_iteration):
        raise ConfigError("on_iteration", f"a function of a metrics row (true: stop), got {type(on_iteration).__name__}")
    words = ("overrides", "run_dir", "resume", "on_iteration", "overwrite")
    for stray in (k for k in sections if k not in ("algorithm", "env", "policy", "run")):
        section, _, key = stray.partition("_")
        hint = f"did you mean {section}={{{key!r}: ...}}? " if key and section in ("algorithm", "env", "policy",
                                                                                  "run") else did_you_mean(stray, words)
        if hint:  # (rundir= was "unknown key; did you mean 'run'?", on_iter= had no hint; seed= keeps its own)
            raise ConfigError(stray, f"not an argument of train(); {hint}it takes {', '.join(words)}, and the "
                              "config's sections (algorithm, env, policy, run) as dicts")
    made: list[Path] = []
    if isinstance(run_dir, (str, os.PathLike)):  # ~ as a shell would read it (not a folder named "~" here)
        run_dir = Path(run_dir).expanduser()
    try:
        return _train(cfg, overrides, run_dir, resume, on_iteration, overwrite, made, **sections)
    except BaseException as e:
        for run_dir in made:
            _remove_if_unused(run_dir)
        if isinstance(e, ConfigError) and isinstance(cfg, (str, os.PathLike)) and \
                e.key.startswith(("env.", "algorithm.")):  # (the env's, the algorithm's checks)
            located = in_file(e, cfg, _given(overrides, sections))
            if located is not e:
                raise located.with_traceback(e.__traceback__) from e.__cause__
        raise


def _given(overrides: Any, sections: dict[str, Any]) -> list[str]:
    """The KEY.PATH=VALUE overrides of a train() call: its list, then its sections' (``run={"seed": 1}``)."""
    return [*override_list(overrides), *(o for name, value in sections.items() for o in dotted(name, value))]


def _remove_if_unused(run_dir: Path) -> None:
    import shutil

    metrics = run_dir / "metrics.csv"
    if checkpoint.latest(run_dir) is None and (not metrics.exists() or len(metrics.read_bytes().splitlines()) <= 1):
        shutil.rmtree(run_dir, ignore_errors=True)


def _train(*args: Any, **kwargs: Any) -> TrainResult:
    with contextlib.ExitStack() as hold:  # the run directory's lock (lock_run_dir), held until the run ends
        return _train_holding(hold, *args, **kwargs)


def _train_holding(hold: contextlib.ExitStack, cfg: ExperimentConfig | str | Path, overrides: list[str] = (),
                   run_dir: str | Path | None = None, resume: bool = False,
                   on_iteration: Callable[[dict], Any] | None = None, overwrite: bool = False,
                   made: list[Path] | None = None, **sections: Any) -> TrainResult:
    if resume and run_dir is None:
        raise ConfigError(arg("resume"), f"resuming needs the run's directory ({arg('run_dir')})")
    if run_dir is not None and not isinstance(run_dir, (str, os.PathLike)):  # (an int: taken for a file descriptor)
        raise ConfigError(arg("run_dir"), f"a run directory's path, got {type(run_dir).__name__} {run_dir!r:.100}")
    if run_dir is not None:
        try:
            os.stat(run_dir)
        except (FileNotFoundError, NotADirectoryError):
            pass
        except OSError as e:  # a name too long, say
            raise ConfigError(arg("run_dir"), f"{run_dir}: {e.strerror or e}") from None
    if resume and overwrite:
        raise ConfigError(arg("overwrite"), f"a resumed run continues its directory; {arg('overwrite', '')} would "
                          "clear it")
    saved = Path(run_dir) / "config.yaml" if resume else None
    if cfg is None and saved is not None:
        cfg = saved
        empty = cfg.is_file() and not cfg.read_bytes().strip()  # (stopped while an older msrl wrote it)
        if not cfg.is_file() or empty:
            if Path(run_dir).is_file() and Path(run_dir).parent.name == "checkpoints":  # a checkpoint named
                raise ConfigError(arg("resume"), f"{run_dir} is a checkpoint; a run resumes from its newest good "
                                  f"one: give its directory, {Path(run_dir).parent.parent} (to go on from an older "
                                  "checkpoint, move the newer ones out of checkpoints/ first)")
            pid = writer_of(Path(run_dir)) if Path(run_dir).is_dir() else None
            if pid:  # (a run that has not written its config yet: "not a run directory" sent the user elsewhere)
                raise ConfigError(arg("resume"), f"{run_dir} is in use by another run (process {pid}) writing into "
                                  "it, which has not written its config.yaml yet; wait for it to end, then resume it")
            if not Path(run_dir).exists():
                raise ConfigError(arg("resume"), f"{run_dir} does not exist")
            raise ConfigError(arg("resume"), (f"{saved} is empty" if empty else
                                              f"{run_dir} is not a run directory (no config.yaml)") + (
                f"; its checkpoints are there: give the config file it was trained with too (msrl train CONFIG "
                f"--resume {shlex.quote(str(run_dir))}, or train(CONFIG, run_dir=..., resume=True)), and its "
                "config.yaml is written again"
                if checkpoint.saved(Path(run_dir)) else ""))
    overrides = _given(overrides, sections)
    if isinstance(cfg, ExperimentConfig) and overrides:
        raise ConfigError("overrides", "give overrides with a config file or dict, not with a validated config")
    if isinstance(cfg, ExperimentConfig):
        cfg = cfg.checked()
    data = cfg.dump() if isinstance(cfg, ExperimentConfig) else read_config(cfg, overrides, switch_check=saved is None)
    if saved is not None:
        _same_algorithm_and_policy(saved, data)
    own = saved is not None and isinstance(cfg, (str, Path)) and Path(cfg).resolve() == saved.resolve()
    overridden = {o.split("=", 1)[0].strip() for o in spread(overrides)}  # (algorithm={lr: 1}: algorithm.lr)
    if not isinstance(cfg, ExperimentConfig):
        try:
            cfg = validate_config(data)
        except ConfigError as e:  # (where the file writes the key: a resumed run's config.yaml too)
            raise in_file(e, cfg, overrides) from None
    spread_over_cores(cfg)  # (before anything starts JAX)
    check_members(cfg.policy.backend, cfg.run, cfg.env.id)  # (before compiling)
    if cfg.run.wandb is not None:  # (before compiling)
        _import_wandb()
    if resume:  # refuse before building anything
        prepare_run_dir(Path(run_dir), resume, overwrite)
        folder = Path(run_dir)  # (a folder of none of a run's files: "it stopped before its first checkpoint", it said)
        if not _has_run_files(folder) and writer_of(folder) is None:
            raise ConfigError(arg("resume"), f"{folder} does not exist" if not folder.exists() else
                              f"{folder} is not a run directory (it holds none of {', '.join(RUN_FILES)})")
        if checkpoint.latest(run_dir) is not None:  # (before reading it; a folder without one is refused below)
            hold.enter_context(lock_run_dir(Path(run_dir), arg("resume")))
        good = checkpoint.latest_good(run_dir) if run_dir is not None else None
        if good is None:
            from msrl.evaluate import why_no_checkpoint

            why = why_no_checkpoint(Path(run_dir))
            raise ConfigError(arg("resume"), f"{run_dir} holds no checkpoint (checkpoints/ckpt_*.msgpack) to resume "
                              f"from ({why}); " + ("wait for it to end, then resume it" if writer_of(Path(run_dir))
                                                   else f"start it again with {arg('overwrite', '')}"))
        path, states, meta = good
        order = checkpoint.sweep_order(meta, Path(run_dir) / "config.yaml")
        swept = order or list((meta["config"].get("run") or {}).get("sweep") or {})
        if set(swept) != set(cfg.run.sweep):  # (before the values a new swept key's first one differs in)
            raise ConfigError("run.sweep", f"the checkpoint {path} swept {', '.join(swept) or 'nothing'}; this config "
                              f"sweeps {', '.join(cfg.run.sweep) or 'nothing'}: a resumed run keeps its members")
        checkpoint.check_same_config(meta["config"], cfg.dump(), path, cfg.defaults(), overridden,
                                     saved if own else None)
        if order is not None and list(cfg.run.sweep) != order:  # the saved states' members are in the run's order
            raise ConfigError("run.sweep", f"the checkpoint {path} swept {', '.join(order)} in that order (its "
                              f"members in that order); this config sweeps {', '.join(cfg.run.sweep)}: give the keys "
                              "in the run's order")
        _refuse_going_back(Path(run_dir), meta, path, arg("resume"))
        if cfg.run.total_env_steps < meta["env_steps"]:  # its summary would contradict the checkpoint
            raise ConfigError("run.total_env_steps", f"{cfg.run.total_env_steps} is less than the "
                              f"{meta['env_steps']} env steps the checkpoint {path} already holds; resume with "
                              f"at least {meta['env_steps']} (that many finishes at once)")
        then, now = meta.get("versions"), versions()
        if then != now:  # (a checkpoint saved before 2026-11-30 names none)
            listed = lambda v: ", ".join(f"{k} {v.get(k, '?')}" for k in now)  # noqa: E731
            print(f"msrl: note: the checkpoint {path} was saved with "
                  f"{listed(then) if then else 'an msrl of before 2026-11-30'}; this is {listed(now)}: the run goes "
                  "on from it, but its numbers may differ in the last digits from those the old versions would "
                  "compute", file=sys.stderr, flush=True)
        done, summary = meta["iteration"], Path(run_dir) / "summary.json"
        left = not done or cfg.run.total_env_steps // (meta["env_steps"] // done) > done
        before = (meta["config"].get("run") or {}).get("total_env_steps")
        if left and before is not None and before != cfg.run.total_env_steps:
            alg = cfg.algorithm
            named = [k for k, on in (("anneal_lr's learning rate", getattr(alg, "anneal_lr", False)),
                                     ("prioritized replay's beta", getattr(alg, "prioritized", False))) if on]
            change = f"msrl: note: run.total_env_steps changes from {before:,} to {cfg.run.total_env_steps:,}; "
            print(change + (f"{' and '.join(named)} follow{'s' * (len(named) == 1)} the new total from the "
                            "checkpoint on (its value at update k is that of a run of the new length: a rate annealed "
                            "to 0 rises again), so the run differs from one of either length" if named else
                            "any schedule the algorithm builds from it follows the new total from the checkpoint on "
                            "(none of the built-ins' does with anneal_lr and prioritized off: they go on as a run of "
                            "the new length would)"), file=sys.stderr, flush=True)
        ended = json.loads(summary.read_text()) if not left and summary.is_file() else {}
        if ended.get("env_steps") == meta["env_steps"]:  # nothing left to run, and the summary is of this checkpoint
            print(f"msrl: note: the run already ended at {meta['env_steps']:,} env steps; nothing is left to train "
                  "(a larger run.total_env_steps continues it)", file=sys.stderr, flush=True)
            result = TrainResult(ended)  # (not of a newer one that was lost): as it was, compiling nothing
            result.rows, result.run_dir = [], Path(run_dir)
            return result
    made_here = run_dir is None or not Path(run_dir).exists()
    locked = resume or not made_here and (Path(run_dir) / LOCK).is_file()  # (another run's: named before what
    if locked and not resume:  # it holds, which prepare_run_dir would take for a run to resume or overwrite)
        hold.enter_context(lock_run_dir(Path(run_dir), arg("run_dir")))
    replace = run_dir is not None and prepare_run_dir(Path(run_dir), resume, overwrite)
    fresh = run_dir is None
    try:
        run_dir = _fresh_run_dir(cfg) if fresh else Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(arg("run_dir"), f"cannot create {run_dir or 'runs/'}: {e.strerror}") from None
    resources.check_writable(run_dir, arg("resume" if resume else "run_dir"))
    if not locked:
        hold.enter_context(lock_run_dir(run_dir, arg("run_dir")))
    if made is not None and made_here:  # (once it is this run's: a run refused here leaves the folder to the other)
        made.append(run_dir)
    import jax

    # (a cache directory the process already set, the user's own or an earlier run's, stays: JAX opens one)
    if cfg.run.compile_cache and (os.environ.get("MSRL_COMPILE_CACHE") or not jax.config.jax_compilation_cache_dir):
        cache = os.environ.get("MSRL_COMPILE_CACHE", run_dir.resolve().parent / ".jax_cache")
        try:
            enable_compile_cache(cache)
        except OSError as e:
            raise ConfigError("run.compile_cache", f"cannot create the compile cache {cache}: {e.strerror}; set "
                              "run.compile_cache=false or MSRL_COMPILE_CACHE=DIR") from None

    stage = (lambda text: print(f"msrl: {text}", file=sys.stderr, flush=True)) if cfg.run.progress else (lambda _: None)
    if fresh:
        stage(f"the run is written to {run_dir} ({arg('run_dir')} names another)")
    signals = _Signals().__enter__()  # from here on SIGTERM, like SIGINT, ends the run cleanly
    try:
        return _run(cfg, run_dir, resume, states if resume else None, meta if resume else None,
                    path if resume else None, on_iteration, stage, signals, replace)
    finally:
        signals.__exit__()


def _same_algorithm_and_policy(saved: Path, data: dict[str, Any]) -> None:
    """A resume under another algorithm or policy is refused first, naming that (rather than a key the
    other one does not have)."""
    try:
        was = yaml.safe_load(saved.read_text())
    except (OSError, yaml.YAMLError):
        return  # (loading it reports what is wrong)
    if not isinstance(was, dict) or not isinstance(was.get("algorithm"), dict):
        return  # (not a run's config: a folder of one's own, refused as holding no checkpoint)
    for key, default in (("algorithm.name", None), ("policy.name", "fused")):
        a, b = checkpoint.lookup(was, key) or default, checkpoint.lookup(data, key) or default
        if a != b:
            raise ConfigError(key, f"the run in {saved.parent} was trained with {key}={a!r}, this resume asks for "
                              f"{b!r}; resume with the run's own config ({saved}) or start a new run")


def _run(cfg: ExperimentConfig, run_dir: Path, resume: bool, states: Any, meta: Any, path: Any,
         on_iteration: Callable[[dict], Any] | None, stage: Callable[[str], None], signals: _Signals,
         replace: bool = False) -> TrainResult:
    from msrl.runtime.session import Session

    stage(f"compiling {cfg.algorithm.name}'s loop under {cfg.policy.name} ({cfg.env.id})")
    program = build(cfg)
    steps_per_iter = program.env_steps_per_iteration
    iterations = cfg.run.total_env_steps // steps_per_iter
    if iterations < 1:
        raise ConfigError("run.total_env_steps", f"{cfg.run.total_env_steps} is less than one iteration "
                          f"({steps_per_iter} env steps)")
    from msrl.compiler.ir import leaves

    if not any(s.kind == "api" and s.api.name == "agent_learn" for s in leaves(program.stmts)):  # (a random or
        # scripted agent may mean it: a note, not an error)
        print(f"msrl: note: {type(program.algorithm).__name__}.train_step never calls msrl.agent_learn: this run "
              "learns nothing", file=sys.stderr, flush=True)
    if cfg._envs_asked is not None:
        print(f"msrl: note: policy {cfg.policy.name!r} runs env.num_envs={cfg.env.num_envs:,} environments (its "
              f"replicas x envs per replica), not the {cfg._envs_asked:,} the config gives", file=sys.stderr,
              flush=True)
    holders = [f.spec.replicas for f in program.fragments.values() if "env" in f.state_keys]
    if cfg.env.subprocesses and holders and cfg.env.subprocesses > program.num_envs // holders[0]:
        per = program.num_envs // holders[0]
        print(f"msrl: note: env.subprocesses={cfg.env.subprocesses}, but each replica steps {per} environment"
              f"{'s' if per > 1 else ''}: {per} worker process{'es' if per > 1 else ''} each", file=sys.stderr, flush=True)
    inert: dict[str, list[str]] = {}
    dump, defaults = cfg.dump(), cfg.defaults()
    for section in ("algorithm", "policy"):
        model = getattr(cfg, section)
        for key, needs in model.inert().items():
            given, default = dump[section], defaults[section]  # (a key of a nested model: "optim.lr")
            for part in key.split("."):
                given, default = (x.get(part, _MISSING) if isinstance(x, dict) else _MISSING for x in (given, default))
            if given is _MISSING:
                raise ConfigError(f"{section}.{key}", f"{type(model).__qualname__}.inert() names it, but it is not a "
                                  f"key of {section} {model.name}")
            if given != default:
                inert.setdefault(needs, []).append(f"{section}.{key}")
    for needs, keys in inert.items():
        print(f"msrl: note: {', '.join(keys)} only {'apply' if len(keys) > 1 else 'applies'} with {needs}; ignored "
              "here", file=sys.stderr, flush=True)
    if iterations * steps_per_iter != cfg.run.total_env_steps:
        print(f"msrl: note: run.total_env_steps={cfg.run.total_env_steps:,} rounded down to {iterations:,} whole "
              f"iteration{'s' if iterations != 1 else ''} of {steps_per_iter:,} env steps: "
              f"{iterations * steps_per_iter:,}", file=sys.stderr, flush=True)
    # several iterations per dispatch, but at least ~10 progress updates in a run
    auto = max(1, min(TARGET_STEPS_PER_DISPATCH // steps_per_iter, iterations // 10))
    per_dispatch = min(cfg.run.iterations_per_dispatch or auto, iterations)
    resources.check_memory(program, cfg)  # before anything is allocated
    replicas = sum(f.spec.replicas for f in program.fragments.values())
    stage(f"starting the {cfg.policy.backend} backend: {replicas} replica{'s' if replicas > 1 else ''} of "
          f"{', '.join(f'{f.name} x{f.spec.replicas}' for f in program.fragments.values())}"
          + "".join(f", and {s.name}" for s in program.services.values())
          + (" (XLA compiles the program now)" if cfg.policy.backend == "jax" else
             (f" (one process per replica starts now, on the Ray cluster at {cfg.policy.ray_address})"
              if getattr(cfg.policy, "ray_address", None) else " (a Ray cluster and one process per replica start now)")
             if cfg.policy.backend == "ray" else ""))
    session = Session(program=program, seed=cfg.run.seed, iterations_per_dispatch=per_dispatch,
                      stall_timeout_s=cfg.run.stall_timeout_s, seeds=cfg.run.num_seeds,
                      seed_batching=cfg.run.seed_batching, sweep=cfg.run.sweep)
    # host environments' simulators cannot be stored: a resumed run starts their episodes afresh
    skip = tuple(k for k, drop in (("env", program.env.host_state),
                                   ("buffer", not cfg.run.checkpoint_buffer)) if drop and k in program.components)

    elapsed0, last_return = 0.0, float("nan")
    episodes0 = last_episodes = 0.0  # episodes0: those counted before a resume whose envs start afresh (host envs)
    seed_returns = [math.nan] * len(session.members) if len(session.members) > 1 else []  # each member's last return
    try:
        if resume:
            session.restore(checkpoint.restore(session.snapshot(skip), states, path), iteration=meta["iteration"])
            stage(f"resuming at iteration {meta['iteration']:,} ({meta['env_steps']:,} env steps) from {path}")
            buffer = program.components.get("buffer")
            if "buffer" in skip and buffer is not None and not isinstance(buffer, TrajectoryBuffer):
                prioritized = isinstance(buffer, PrioritizedBuffer)  # (its schedule is counted in its state)
                print(f"msrl: note: run.checkpoint_buffer=false: {type(buffer).__name__} starts empty again (the "
                      "checkpoint does not hold its content" + ("; its importance-sampling exponent anneals from "
                                                                "per_beta again, and its priorities from 1" if
                                                                prioritized else "") + ")",
                      file=sys.stderr, flush=True)
            if "env" in skip:  # (its numbers then differ from an uninterrupted run's, which it did not say)
                print(f"msrl: note: {cfg.env.id}'s simulators are not in checkpoints: their episodes start afresh "
                      "(the run goes on from the checkpoint, but not as an uninterrupted one would)",
                      file=sys.stderr, flush=True)
            elapsed0, last_return = meta["wall_time"], meta["episode_return"]
            episodes0 = last_episodes = meta.get("episodes", 0.0) if "env" in skip else 0.0
            seed_returns = meta.get("episode_return_per_seed", seed_returns)
        signals.heard()  # (before an --overwrite clears the old run)
        if replace:  # (--overwrite) the new run has compiled and started: the old one goes now
            clear_run_dir(run_dir)
        checkpoint.write_atomic(run_dir / "config.yaml", dump_yaml(cfg.dump(), sort_keys=False).encode())
        logger = _Logger(run_dir, cfg, iterations * steps_per_iter, resume_at=session.iteration if resume else None)
    except BaseException:
        session.close()
        raise
    log_every, every = intervals(cfg.run, iterations, steps_per_iter)
    start, last_time = time.perf_counter() - elapsed0, elapsed0
    stop, history = [], []  # stop: set by on_iteration or a signal; history: every logged row of this call
    raised: list[tuple[int, Exception]] = []  # on_iteration's exception: the run stops, checkpoints, raises it
    pending: list[dict] = []  # iterations since the last logged row
    last = {"env_steps": session.iteration * steps_per_iter, "wall_time": elapsed0}  # the last logged row
    steps0 = last["env_steps"]

    def emit() -> None:
        nonlocal last
        row = merge_rows([{k: v for k, v in p.items() if k != "per_seed"} for p in pending])
        span = row["wall_time"] - last["wall_time"]
        row["sps"] = (row["env_steps"] - last["env_steps"]) / span if span > 0 else math.nan
        each = [{**merge_rows([{**p["per_seed"][i], "wall_time": row["wall_time"]} for p in pending]), "sps": row["sps"]}
                for i in range(len(seed_returns))]
        pending.clear()
        logger.log(row, each)
        history.append({**row, "per_seed": each} if each else row)
        last = row
        if on_iteration is None or raised:
            return
        try:
            asked = bool(on_iteration({**row, **({"per_seed": [dict(e) for e in each]} if each else {})}))  # (a
            # copy: the callback's edits do not reach summary.rows)
        except BaseException as e:  # noqa: BLE001 - raised again once the run has stopped and saved (a
            # KeyboardInterrupt or SystemExit too: the iterations done are kept, not lost)
            raised.append((row["iteration"], e))
            asked = True
        if asked and not stop:
            stop.append(row["iteration"])

    signals.starting = False

    def meta_now() -> dict:
        """A checkpoint's meta: the last complete iteration and where the run stands."""
        done = session.iteration
        return {"iteration": done, "env_steps": done * steps_per_iter, "wall_time": time.perf_counter() - start,
                "episode_return": last_return, "episodes": last_episodes, "config": cfg.dump(),
                "sweep_order": list(cfg.run.sweep),  # (the config's dicts are stored with their keys sorted)
                "versions": versions(),
                **({"episode_return_per_seed": seed_returns} if seed_returns else {})}

    def fault(e: TrainingError) -> MsrlError:
        """A failed dispatch (a replica failed, stalled or died, the cluster failed): the error, naming the last
        complete iteration and the checkpoint saved of it, or the last one there is."""
        done, saved = session.iteration, None
        if session.runtime.at_rest() and done > 0:  # the state is that of the last complete iteration: keep it
            if pending:  # its rows too, so that a resumed run's rows follow on
                emit()
            try:
                _save_checkpoint(session, run_dir, cfg, skip, meta_now())
                saved = checkpoint.latest(run_dir)
            except Exception:  # noqa: BLE001 - the report below says there is none of this iteration
                saved = None
        newest = checkpoint.latest(run_dir)
        note = (f"saved a checkpoint of it: {saved}" if saved is not None else
                f"its checkpoint is {newest}" if newest == checkpoint.of_iteration(run_dir, done) else
                ("" if done == 0 else "no checkpoint of it could be saved (its state is lost or mid-iteration); ") +
                (f"the last checkpoint is {newest}" if newest is not None else "there is no checkpoint"))
        batched = f" (iterations come back {per_dispatch} at a time: run.iterations_per_dispatch)" \
            if per_dispatch > 1 else ""
        text = f"{str(e).rstrip().rstrip('.')}" + ("\n" if "\n" in str(e).strip() else ". ") + \
            f"The last complete iteration is {done} of {iterations}{batched}; {note}"
        if signals.received:
            return Interrupted(f"{signals.received}: {text}" + (f". Continue with: {_continue_with(run_dir)}"
                                                                 if newest is not None else ""))
        return TrainingError(text)

    def stream(segment: int):
        rows_of = session.stream(segment, per_dispatch, lambda: bool(stop or signals.received))
        while True:
            try:
                rows = next(rows_of)
            except StopIteration:
                return
            except TrainingError as e:
                raise fault(e) from None
            yield rows

    try:
        while session.iteration < iterations and not stop:
            done = session.iteration
            segment = iterations - done if not every else min(iterations - done, every - done % every)
            for rows in stream(segment):
                # a dispatch's iterations share its wall time evenly (they run inside one call)
                before, now = last_time, time.perf_counter() - start
                for i, r in enumerate(rows):
                    _check_finite(r, r["iteration"], cfg, steps_per_iter, run_dir)
                    if math.isfinite(r["episode_return"]):
                        last_return = r["episode_return"]
                    if "episodes" in r:
                        r["episodes"] = last_episodes = r["episodes"] + episodes0
                    for s, each in enumerate(r.get("per_seed", ())):
                        if math.isfinite(each["episode_return"]):
                            seed_returns[s] = each["episode_return"]
                    pending.append({**r, "wall_time": before + (now - before) * (i + 1) / len(rows)})
                    if r["iteration"] % log_every == 0 or r["iteration"] == iterations:
                        emit()
                last_time = now
                if history:  # the bar's SPS: this call's average (a row's is its own interval's, and the
                    # interval of a short dispatch, the last or one cut at a checkpoint, is slower)
                    logger.update({**last, "env_steps": rows[-1]["env_steps"],
                                   "sps": (rows[-1]["env_steps"] - steps0) / max(now - elapsed0, 1e-9)})
            if signals.received:
                stop.append("signal")
            if stop and pending:  # a stopped run logs the iterations it did after its last row
                emit()
            if every or signals.received or raised:
                _save_checkpoint(session, run_dir, cfg, skip, meta_now(), on_fault=fault)
    except (KeyboardInterrupt, SystemExit) as e:  # raised into the run by a handler of the user's own (msrl's
        # SIGINT handler stops it as above): keep what is done, where the replicas' states are of one iteration
        kept = session.broken is None or session.readable  # (states of one iteration)
        if not isinstance(e, Interrupted) and not signals.received and kept and \
                session.iteration > 0:  # (Interrupted: a failed dispatch under a signal, saved already; a signal
            # received: this is the second, which stops at once)
            if pending:
                emit()
            try:
                _save_checkpoint(session, run_dir, cfg, skip, meta_now())
                e.add_note(f"msrl: the run stopped after iteration {session.iteration} of {iterations} and saved its "
                           f"checkpoint in {run_dir} (msrl.train(..., resume=True) continues it)")
            except Exception:  # noqa: BLE001 - the interrupt is what the user sees
                pass
        if signals.received and not isinstance(e, Interrupted) and isinstance(e, KeyboardInterrupt):
            newest = checkpoint.latest(run_dir)  # (the second signal)
            raise Interrupted(f"{signals.received} again: stopped at once, saving nothing of the iterations under way; "
                              + (f"the last checkpoint is {newest}. Continue with: {_continue_with(run_dir)}"
                                 if newest is not None else f"{run_dir} holds no checkpoint: start it again with "
                                 f"{arg('overwrite', '')}")) from None
        raise
    finally:
        try:
            logger.close(last_return, seed_returns)  # may fail (a full disk): the session closes all the same
        finally:
            session.close()
    elapsed = time.perf_counter() - start
    if signals.received and session.iteration >= iterations:  # (it came in the last dispatch: nothing is left)
        print(f"msrl: note: {signals.received} came as the run's last iteration ran; the run is complete",
              file=sys.stderr)
        signals.received = None
    summary = {
        "env_steps": session.iteration * steps_per_iter,
        "iterations": session.iteration,
        "episode_return": last_return,
        "sps": session.iteration * steps_per_iter / elapsed,
        "stopped_early": bool(stop),
        "interrupted": signals.received,
        "checkpointed": checkpoint.of_iteration(run_dir, session.iteration).is_file(),  # (its end: resumable)
        "wall_time": elapsed,
        "compile_time": session.compile_seconds,
        "graph_time": program.compile_seconds,
        "policy": cfg.policy.name,
        "backend": cfg.policy.backend,
    }
    if seed_returns:
        summary.update(seeds=[m.seed for m in session.members], episode_return_per_seed=seed_returns)
        if cfg.run.sweep:
            summary.update(members=[m.name for m in session.members])
    checkpoint.write_atomic(run_dir / "summary.json", summary_json(summary).encode())
    if raised:
        at, error = raised[0]
        error.add_note(f"msrl: on_iteration raised this at iteration {at}; the run stopped after iteration "
                       f"{session.iteration} of {iterations} and saved its checkpoint and summary in {run_dir} "
                       "(msrl.train(..., resume=True) continues it)")
        raise error
    if signals.received:
        raise Interrupted(f"{signals.received}: stopped after iteration {session.iteration} of {iterations}; "
                          f"checkpoint and summary saved. Continue with: {_continue_with(run_dir)}")
    result = TrainResult(summary)
    result.rows, result.run_dir = history, Path(run_dir)
    return result


def _check_finite(row: dict[str, float], iteration: int, cfg: ExperimentConfig, steps_per_iter: int,
                  run_dir: Path) -> None:
    """The NaN guard: a non-finite env observation/reward or metric stops the run, naming where (and the
    algorithm's learning-rate keys)."""
    env_id, alg = cfg.env.id, cfg.algorithm
    env_checked = "env_nonfinite" in row  # the env counts them (msrl's adapters; a user's env may not)
    if row.pop("env_nonfinite", 0):
        steps = f"{(iteration - 1) * steps_per_iter}..{iteration * steps_per_iter}"
        raise TrainingError(f"environment {env_id} produced a non-finite observation or reward in iteration "
                            f"{iteration} (env steps {steps}), or was given an action outside its Discrete(n) actions "
                            f"(a jitted env's reward is then NaN); training stopped{_last_good(run_dir)}")
    bad = [k for k, v in row.items() if k not in ("episode_return", "episode_length", "episode_return_std", "per_seed")
           and not math.isfinite(v)]
    if bad:
        lr = " / ".join(f"algorithm.{k}" for k in type(alg).model_fields if (k == "lr" or k.endswith("_lr"))
                        and not isinstance(getattr(alg, k), bool)) or "the learning rate"  # (not anneal_lr)
        from msrl.sweep import members

        which = [m.name for m, each in zip(members(cfg.run), row.get("per_seed") or [], strict=False)
                 if not math.isfinite(each.get(bad[0], 0.0))]  # (one member's NaN makes the mean NaN)
        of = f" (of member{'s' if which[1:] else ''} {', '.join(which)}: the members are one program)" if which else ""
        raise TrainingError(f"iteration {iteration}: metric {bad[0]!r} is {row[bad[0]]} (non-finite){of}; training "
                            f"stopped{_last_good(run_dir)}. " + (
                                f"Lower {lr} or check the environment's rewards." if env_checked else
                                f"Check environment {env_id}'s observations and rewards (it does not count "
                                f"non-finite ones: its stats() has no 'nonfinite'), or lower {lr}.") +
                            (" A prioritized buffer given a NaN, negative or infinite priority samples NaN weights."
                             if getattr(alg, "prioritized", False) is True else "") +
                            " (A metric the loop sets to NaN on purpose stops the run too: log a finite value.)")


def _refuse_going_back(run_dir: Path, meta: dict, path: Path, key: str) -> None:
    """A ConfigError where the run trained past every checkpoint it wrote (``run.checkpoint_every_steps=0`` saves
    none at the end): resuming would go back to the newest and drop what came after it from metrics.csv. (Newer
    checkpoints moved out of checkpoints/ on purpose, to go back, are not this: the run's end had one.)"""
    from msrl.evaluate import _run_file

    summary = _run_file(run_dir, "summary.json")  # ({} where it is missing or does not read)
    ended = summary.get("iterations")
    if isinstance(ended, int) and ended > meta["iteration"] and summary.get("checkpointed") is False:
        zero = ((meta.get("config") or {}).get("run") or {}).get("checkpoint_every_steps") == 0
        raise ConfigError(key, f"{run_dir} trained to iteration {ended:,} (its summary.json), past its newest "
                          f"checkpoint, {path.name} of iteration {meta['iteration']:,}"
                          + (" (run.checkpoint_every_steps=0 saves none at the end)" if zero else "")
                          + ": resuming would train again from there and drop the iterations after it from "
                          "metrics.csv. Start a new run (with checkpoints to extend it later); to go back to that "
                          "checkpoint all the same, remove its summary.json first")


def _save_checkpoint(session, run_dir: Path, cfg: ExperimentConfig, skip: tuple[str, ...], meta: dict,
                     on_fault: Callable[[TrainingError], Exception] | None = None) -> None:
    """Save, unless the learner's state went non-finite (the last good checkpoint then stays the latest).
    ``on_fault``: what to raise instead when the runtime cannot give its state (a replica or the cluster is gone)."""
    import jax
    import numpy as np

    try:
        snap = session.snapshot(skip)
    except TrainingError as e:
        if on_fault is None:
            raise
        raise on_fault(e) from None
    for frag, replicas in snap.items():
        for state in replicas:
            for path, x in jax.tree_util.tree_leaves_with_path({k: state[k] for k in ("learner", "params") if k in state}):
                x = np.asarray(x)
                if np.issubdtype(x.dtype, np.floating) and not np.isfinite(x).all():
                    raise TrainingError(f"iteration {meta['iteration']}: parameter {jax.tree_util.keystr(path)} "
                                        f"of fragment {frag!r} is non-finite; training stopped"
                                        f"{_last_good(run_dir)}")
    checkpoint.save(run_dir, snap, meta, keep=cfg.run.keep_checkpoints)


def _last_good(run_dir: Path) -> str:
    """The NaN guard's pointer to the newest checkpoint that loads (checksum and finite values checked)."""
    try:
        good = checkpoint.latest_good(run_dir, quiet=True)
    except TrainingError:
        return " (no good checkpoint)"
    return f" (last good checkpoint: {good[0]})" if good else ""
