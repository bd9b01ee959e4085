"""``msrl plot``: learning curves of several run directories on one figure (PNG, no screen needed)."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np
import yaml

from msrl.errors import ConfigError

_COLUMNS = ("env_steps", "wall_time", "episode_return")


def read_curve(run_dir: str | Path) -> dict[str, np.ndarray]:
    """``env_steps``, ``wall_time`` and ``episode_return`` of the rows of ``RUN_DIR/metrics.csv`` that have a
    finite return."""
    path = Path(run_dir) / "metrics.csv"
    if not path.is_file():
        why = "no such directory" if not Path(run_dir).is_dir() else "no metrics.csv in it"
        raise ConfigError(str(run_dir), f"{why}; expected a run directory written by `msrl train`")
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise ConfigError(str(run_dir), "metrics.csv is empty (no iteration logged yet)")
    missing = [c for c in _COLUMNS if c not in rows[0]]
    if missing:
        raise ConfigError(str(run_dir), f"metrics.csv has no column {', '.join(missing)}")

    def number(text: str | None) -> float:
        try:
            return float(text)
        except (TypeError, ValueError):
            return math.nan

    table = np.array([[number(r[c]) for c in _COLUMNS] for r in rows], dtype=float).reshape(-1, len(_COLUMNS))
    table = table[np.isfinite(table).all(axis=1)]
    if not len(table):
        raise ConfigError(str(run_dir), "metrics.csv has no row with a finished episode (episode_return is empty)")
    return {c: table[:, i] for i, c in enumerate(_COLUMNS)}


def moving_average(y: np.ndarray, k: int) -> np.ndarray:
    """Trailing moving average over the last ``k`` points (fewer at the start)."""
    if k <= 1:
        return y
    csum = np.concatenate([[0.0], np.cumsum(y)])
    hi = np.arange(1, len(y) + 1)
    lo = np.maximum(0, hi - k)
    return (csum[hi] - csum[lo]) / (hi - lo)


def _label(run_dir: Path, name: str) -> str:
    try:
        cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
        return f"{name} ({cfg['algorithm']['name']}, {cfg['policy']['name']})"
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        return name


def plot_runs(run_dirs: list[str | Path], out: str | Path, smooth: int = 1) -> Path:
    """Plot episode return against env steps and against wall time, one line per run; returns ``out``."""
    from matplotlib.figure import Figure  # a bare Figure renders with Agg: no pyplot, no display

    if smooth < 1:
        raise ConfigError("--smooth", f"must be >= 1 (got {smooth})")
    if not run_dirs:
        raise ConfigError("", "no run directory given")
    dirs = [Path(d) for d in run_dirs]
    curves = [read_curve(d) for d in dirs]
    names = [d.resolve().name for d in dirs]
    if len(set(names)) < len(names):  # same leaf name in different parents: show the paths as given
        names = [str(d) for d in dirs]

    fig = Figure(figsize=(12, 4.5), layout="constrained")
    ax_steps, ax_time = fig.subplots(1, 2, sharey=True)
    for d, name, c in zip(dirs, names, curves):
        y = moving_average(c["episode_return"], smooth)
        line, = ax_steps.plot(c["env_steps"], y, label=_label(d, name))
        ax_time.plot(c["wall_time"], y, color=line.get_color())
    ax_steps.set_xlabel("env steps")
    ax_time.set_xlabel("wall time (s)")
    ax_steps.set_ylabel("episode return" + (f" (mean of last {smooth})" if smooth > 1 else ""))
    for ax in (ax_steps, ax_time):
        ax.grid(alpha=0.3)
    ax_steps.legend(fontsize="small")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return out

