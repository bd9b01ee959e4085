"""The training driver: config -> env, algorithm, program, runtime -> a run directory with metrics."""

from __future__ import annotations

import csv
import json
import math
import os
import time
from pathlib import Path
import yaml

from msrl import checkpoint
from msrl.algorithm import Context
from msrl.config import ExperimentConfig, load_config
from msrl.envs import make_env
from msrl.errors import ConfigError, TrainingError
from msrl.registry import ALGORITHMS

TARGET_STEPS_PER_DISPATCH = 16_384


def enable_compile_cache(directory: str | Path) -> None:
    import jax

    Path(directory).mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(directory))


def build(cfg: ExperimentConfig):
    """Env, algorithm and compiled program of a config (nothing runs yet)."""
    from msrl.compiler import compile as compile_program

    env = make_env(cfg.env.id, **cfg.env.kwargs)
    num_envs = cfg.policy.total_envs(cfg.env.num_envs)
    ctx = Context(env_spec=env.spec, num_envs=num_envs, total_env_steps=cfg.run.total_env_steps,
                  updates_per_iteration=cfg.policy.learner_plan().updates_per_iteration)
    algorithm = ALGORITHMS.get(cfg.algorithm.name)(cfg.algorithm, ctx)
    return compile_program(algorithm, cfg.policy, env, num_envs)


class _Logger:
    """metrics.csv (one row per iteration), TensorBoard events, and the rich progress bar."""

    def __init__(self, run_dir: Path, cfg: ExperimentConfig, total_steps: int, resume_at: int | None = None):
        self.run_dir, self.cfg = run_dir, cfg
        kept: list[dict] = []
        if resume_at is not None and (run_dir / "metrics.csv").exists():  # drop rows after the checkpoint
            with open(run_dir / "metrics.csv", newline="") as f:
                kept = [r for r in csv.DictReader(f) if int(r["iteration"]) <= resume_at]
        self.csv_file = open(run_dir / "metrics.csv", "w", newline="")
        self.writer: csv.DictWriter | None = None
        if kept:
            self.writer = csv.DictWriter(self.csv_file, fieldnames=list(kept[0]), extrasaction="ignore")
            self.writer.writeheader()
            self.writer.writerows(kept)
        self.tb = None
        if cfg.run.tensorboard:
            from tensorboardX import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tb"))
        self.progress = None
        if cfg.run.progress:
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                                     TextColumn("{task.completed:,.0f}/{task.total:,.0f} steps"),
                                     TextColumn("{task.fields[sps]:,.0f} SPS"),
                                     TextColumn("return {task.fields[ret]}"), TimeRemainingColumn(), transient=False)
            self.task = self.progress.add_task(f"{cfg.algorithm.name} [{cfg.policy.name}]", total=total_steps,
                                               sps=0, ret="-")
            self.progress.start()

    def log(self, row: dict[str, float]) -> None:
        if self.writer is None:
            first = ["iteration", "env_steps", "episode_return", "sps", "wall_time"]
            self.writer = csv.DictWriter(self.csv_file, fieldnames=first + [k for k in row if k not in first],
                                         extrasaction="ignore")
            self.writer.writeheader()
        self.writer.writerow(row)
        if self.tb is not None:
            for k, v in row.items():
                if k not in ("iteration", "env_steps") and math.isfinite(v):
                    self.tb.add_scalar(k, v, int(row["env_steps"]))

    def update(self, row: dict[str, float]) -> None:
        self.csv_file.flush()
        if self.progress is not None:
            ret = row["episode_return"]
            self.progress.update(self.task, completed=row["env_steps"], sps=row["sps"],
                                 ret="-" if math.isnan(ret) else f"{ret:.1f}")

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        if self.tb is not None:
            self.tb.close()
        self.csv_file.close()


def train(cfg: ExperimentConfig | str | Path, overrides: list[str] = (), run_dir: str | Path | None = None,
          resume: bool = False) -> dict:
    """Train; returns the summary (also written to ``RUN_DIR/summary.json``). ``resume``: continue the run in
    ``run_dir`` from its latest checkpoint."""
    if not isinstance(cfg, ExperimentConfig):
        cfg = load_config(cfg, overrides)
    if resume:  # refuse before building anything
        path = checkpoint.latest(run_dir) if run_dir is not None else None
        if path is None:
            raise ConfigError("--resume", f"{run_dir} holds no checkpoint (checkpoints/ckpt_*.msgpack) to resume from")
        states, meta = checkpoint.load(path)
        checkpoint.check_same_config(meta["config"], cfg.dump(), path)
    run_dir = Path(run_dir or Path("runs") / f"{cfg.algorithm.name}-{cfg.policy.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    run_dir.mkdir(parents=True, exist_ok=True)
    if cfg.run.compile_cache:
        enable_compile_cache(os.environ.get("MSRL_COMPILE_CACHE", run_dir.resolve().parent / ".jax_cache"))

    from msrl.runtime.session import Session

    program = build(cfg)
    steps_per_iter = program.env_steps_per_iteration
    iterations = cfg.run.total_env_steps // steps_per_iter
    if iterations < 1:
        raise ConfigError("run.total_env_steps", f"{cfg.run.total_env_steps} is less than one iteration "
                          f"({steps_per_iter} env steps)")
    # several iterations per dispatch, but at least ~10 progress updates in a run
    auto = max(1, min(TARGET_STEPS_PER_DISPATCH // steps_per_iter, iterations // 10))
    per_dispatch = min(cfg.run.iterations_per_dispatch or auto, iterations)
    session = Session(program=program, seed=cfg.run.seed, iterations_per_dispatch=per_dispatch)
    # host environments' simulators cannot be stored: a resumed run starts their episodes afresh
    skip = tuple(k for k, drop in (("env", not program.env.jittable), ("buffer", not cfg.run.checkpoint_buffer)) if drop)

    elapsed0, last_return, row = 0.0, float("nan"), {}
    try:
        if resume:
            session.restore(checkpoint.restore(session.snapshot(skip), states, path), iteration=meta["iteration"])
            elapsed0, last_return = meta["wall_time"], meta["episode_return"]
        (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.dump(), sort_keys=False))
        logger = _Logger(run_dir, cfg, iterations * steps_per_iter, resume_at=session.iteration if resume else None)
    except BaseException:
        session.close()
        raise
    every = cfg.run.checkpoint_every
    start = time.perf_counter() - elapsed0
    try:
        while session.iteration < iterations:
            done = session.iteration
            segment = iterations - done if not every else min(iterations - done, every - done % every)
            for rows in session.stream(segment, per_dispatch):
                elapsed = time.perf_counter() - start
                for r in rows:
                    _check_finite(r, r["iteration"], cfg.env.id, steps_per_iter, run_dir)
                    if math.isfinite(r["episode_return"]):
                        last_return = r["episode_return"]
                    row = {"iteration": r["iteration"], "env_steps": r["env_steps"],
                           "sps": r["env_steps"] / elapsed, "wall_time": elapsed, **r}
                    logger.log(row)
                logger.update(row)
            if every:
                done = session.iteration
                _save_checkpoint(session, run_dir, cfg, skip, {
                    "iteration": done, "env_steps": done * steps_per_iter, "wall_time": time.perf_counter() - start,
                    "episode_return": last_return, "config": cfg.dump()})
    finally:
        logger.close()
        session.close()
    elapsed = time.perf_counter() - start
    summary = {
        "env_steps": iterations * steps_per_iter,
        "iterations": iterations,
        "episode_return": last_return,
        "sps": iterations * steps_per_iter / elapsed,
        "wall_time": elapsed,
        "compile_time": session.compile_seconds,
        "graph_time": program.compile_seconds,
        "policy": cfg.policy.name,
        "backend": cfg.policy.backend,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _check_finite(row: dict[str, float], iteration: int, env_id: str, steps_per_iter: int, run_dir: Path) -> None:
    """The NaN guard: a non-finite env observation/reward or metric stops the run, naming where."""
    if row.pop("env_nonfinite", 0):
        raise TrainingError(f"environment {env_id} produced a non-finite observation or reward in iteration "
                            f"{iteration} (env steps {(iteration - 1) * steps_per_iter}..{iteration * steps_per_iter}); "
                            f"training stopped{_last_good(run_dir)}")
    bad = [k for k, v in row.items() if k != "episode_return" and not math.isfinite(v)]
    if bad:
        raise TrainingError(f"iteration {iteration}: metric {bad[0]!r} is {row[bad[0]]} (non-finite); training "
                            f"stopped{_last_good(run_dir)}. Lower algorithm.lr or check the environment's rewards.")


def _save_checkpoint(session, run_dir: Path, cfg: ExperimentConfig, skip: tuple[str, ...], meta: dict) -> None:
    """Save, unless the learner's state went non-finite (the last good checkpoint then stays the latest)."""
    import jax
    import numpy as np

    snap = session.snapshot(skip)
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
    path = checkpoint.latest(run_dir)
    return f" (last good checkpoint: {path})" if path else ""
