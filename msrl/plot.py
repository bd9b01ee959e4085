"""``msrl plot``: learning curves of several run directories on one figure (PNG, no screen needed)."""

from __future__ import annotations

import csv
import io
import math
import re
import sys
from pathlib import Path

import numpy as np
import yaml

from msrl.errors import ConfigError, arg

_AXES = ("env_steps", "wall_time")  # the x axes


def check_image_file(path: str | Path) -> Path:
    """``path`` (``-o``), refused unless its suffix names an image format matplotlib writes."""
    from matplotlib.backend_bases import FigureCanvasBase

    path, formats = Path(path), sorted(FigureCanvasBase.get_supported_filetypes())
    if path.suffix[1:].lower() not in formats:
        raise ConfigError("--output", f"{path}: cannot tell the image format from its suffix; use one of "
                          + ", ".join("." + f for f in formats))
    return path


def read_metrics(path: Path) -> list[dict[str, str]]:
    """A metrics.csv's complete rows: a last line cut short (a kill while it was written) and rows missing
    fields are left out; a file that does not read as CSV text is a ConfigError naming it."""
    try:
        text = path.read_bytes().decode()
        text = text[:text.rfind("\n") + 1]
        return [r for r in csv.DictReader(io.StringIO(text, newline="")) if None not in r and None not in r.values()]
    except (UnicodeDecodeError, csv.Error) as e:
        raise ConfigError(str(path), f"does not read as the CSV file msrl writes ({e}); move it away") from None


def read_curve(run_dir: str | Path, metric: str = "episode_return") -> dict[str, np.ndarray]:
    """``env_steps``, ``wall_time`` and ``metric`` (a column of metrics.csv: the return, a loss, ...) of the rows
    of ``RUN_DIR/metrics.csv`` where it is finite."""
    path = Path(run_dir) / "metrics.csv"
    if not path.is_file():
        why = ("no metrics.csv in it" if Path(run_dir).is_dir() else "a file, not a directory"
               if Path(run_dir).exists() else "no such directory")
        raise ConfigError(str(run_dir), f"{why}; expected a run directory written by `msrl train`")
    rows = read_metrics(path)
    if not rows:
        raise ConfigError(str(run_dir), "metrics.csv is empty (no iteration logged yet)")
    columns = (*_AXES, metric)
    missing = [c for c in columns if c not in rows[0]]
    if missing:
        raise ConfigError(arg("metric") if missing == [metric] else str(run_dir), f"{path} has no column "
                          f"{', '.join(missing)}" + (f"; its columns: {', '.join(rows[0])}"
                                                     if missing == [metric] else ""))

    def number(text: str | None) -> float:
        try:
            return float(text)
        except (TypeError, ValueError):
            return math.nan

    table = np.array([[number(r[c]) for c in columns] for r in rows], dtype=float).reshape(-1, len(columns))
    table = table[np.isfinite(table).all(axis=1)]
    if not len(table):
        raise ConfigError(str(run_dir), "metrics.csv has no row with a finished episode (its episode_return is "
                          "empty or NaN in every row: no episode ended yet)" if metric == "episode_return" else
                          f"metrics.csv has no row with a finite {metric}")
    return {c: table[:, i] for i, c in enumerate(columns)}


def moving_average(y: np.ndarray, k: int) -> np.ndarray:
    """Trailing moving average over the last ``k`` points (fewer at the start)."""
    if k <= 1:
        return y
    csum = np.concatenate([[0.0], np.cumsum(y)])
    hi = np.arange(1, len(y) + 1)
    lo = np.maximum(0, hi - k)
    return (csum[hi] - csum[lo]) / (hi - lo)


def _config(run_dir: Path) -> dict | None:
    try:
        cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
        return cfg if isinstance(cfg, dict) else None
    except (OSError, yaml.YAMLError):
        return None


def _label(run_dir: Path, name: str) -> str:
    if (run_dir.name.startswith("seed_") or "=" in run_dir.name) and (run_dir.parent / "config.yaml").exists():
        if name == run_dir.resolve().name:  # one member of a run: named with its run's folder
            name = f"{run_dir.parent.resolve().name}/{name}"
        run_dir = run_dir.parent
    try:
        cfg = _config(run_dir)
        return f"{name} ({cfg['algorithm']['name']}, {cfg['policy']['name']})"
    except (KeyError, TypeError):
        return name


def _shown(group: list[Path], names: dict[Path, str]) -> str:
    """The name of a line of several runs: its run's folder (and swept value), or the runs' folders joined."""
    def run(d: Path) -> str:  # a member of a run of several seeds or values: named with its run's folder
        value = re.sub(r"[,/]?seed_\d+$", "", names[d])  # (names are paths where two runs' leaves are alike)
        if not ((d.name.startswith("seed_") or "=" in d.name) and (d.parent / "config.yaml").exists()):
            return names[d]
        return value if "/" in value else "/".join(filter(None, (d.parent.resolve().name, value)))

    runs = list(dict.fromkeys(map(run, group)))
    return ", ".join(runs[:3]) + (", …" if len(runs) > 3 else "")


def _group_key(run_dir: Path) -> str:
    """What runs that differ only by seed share: their config without ``run`` (or the folder's parent)."""
    if run_dir.name.startswith("seed_") and (run_dir.parent / "config.yaml").exists():  # one seed of a run
        return _group_key(run_dir.parent)
    cfg = _config(run_dir)
    if cfg is None:
        return str(run_dir.resolve().parent)
    return yaml.safe_dump({k: v for k, v in cfg.items() if k != "run"}, sort_keys=True)


def member_folders(run_dir: Path) -> list[Path]:
    """The folders of a run of several seeds or swept values (``seed_N``, ``lr=0.001``, ``lr=0.001,seed_N``),
    in the order it ran them."""
    cfg = _config(run_dir)
    if cfg is None:
        return []
    try:
        from msrl.config import RunConfig
        from msrl.sweep import members

        names = [m.name for m in members(RunConfig.model_validate(cfg.get("run") or {}))]
    except (ValueError, TypeError):
        return []
    return [run_dir / n for n in names if n and (run_dir / n / "metrics.csv").exists()]


def _columns(run_dir: Path) -> list[str]:
    try:
        with open(run_dir / "metrics.csv", newline="") as f:
            return next(csv.reader(f), [])
    except OSError:
        return []


def _of_the_run_only(group: list[Path], metric: str) -> bool:
    """Whether ``metric`` is a column of the run whose members ``group`` are, not of theirs (a run of several
    seeds logs ``episode_return_std`` in its own metrics.csv: it was refused as a member's missing column)."""
    parent = group[0].parent
    return all(d.parent == parent and d != parent for d in group) and (parent / "config.yaml").exists() and \
        metric not in _columns(group[0]) and metric in _columns(parent)


def mean_curve(curves: list[dict[str, np.ndarray]], points: int = 200, metric: str = "episode_return"
               ) -> dict[str, np.ndarray]:
    """Several runs' curves on one grid of env steps (up to where the shortest ends): the mean and standard
    deviation of their ``metric``, and their mean wall time, interpolated linearly between logged rows."""
    lo = max(c["env_steps"][0] for c in curves)
    hi = min(c["env_steps"][-1] for c in curves)
    if hi < lo:  # (a mean of one run's last value with another's first was drawn at one point)
        spans = ", ".join(f"{c['env_steps'][0]:,.0f}..{c['env_steps'][-1]:,.0f}" for c in curves)
        raise ValueError(f"share no env steps where {metric} is logged (they span {spans}): there is no mean to draw")
    grid = np.linspace(lo, hi, points) if hi > lo else np.array([hi], float)
    ret = np.stack([np.interp(grid, c["env_steps"], c[metric]) for c in curves])
    wall = np.stack([np.interp(grid, c["env_steps"], c["wall_time"]) for c in curves])
    return {"env_steps": grid, "mean": ret.mean(0), "std": ret.std(0), "wall_time": wall.mean(0)}


def lines(run_dirs: list[Path], aggregate: bool = False) -> list[list[Path]]:
    """The run folders each line of a plot draws, in order: a run of several seeds or swept values is one line
    per config (its seeds' mean), any other run its own line; ``aggregate`` joins the folders of every run given
    whose configs differ only under ``run``."""
    groups: dict[tuple, list[Path]] = {}
    members = {d: member_folders(d) for d in run_dirs}
    with_run = {m.resolve() for ms in members.values() for m in ms}
    given: set[Path] = set()  # each folder drawn once, though given twice, or on its own and with its run
    for k, d in enumerate(run_dirs):
        if d.resolve() in given or d.resolve() in with_run:
            print(f"msrl plot: note: {d} is given " + ("twice" if d.resolve() in given else "on its own and with its "
                  "run") + "; it is drawn once", file=sys.stderr)
            continue
        given.add(d.resolve())
        for member in members[d] or [d]:
            groups.setdefault((_group_key(member),) if aggregate else (k, _group_key(member)), []).append(member)
    return list(groups.values())


def plot_runs(run_dirs: list[str | Path], out: str | Path, smooth: int = 1, aggregate: bool = False,
              metric: str = "episode_return") -> Path:
    """Plot ``metric`` (a column of metrics.csv; the episode return unless given) against env steps and against
    wall time, one line per run; returns ``out``. A line of several runs (see :func:`lines`) is their mean, with
    a band of ± one standard deviation."""
    from matplotlib.figure import Figure  # a bare Figure renders with Agg: no pyplot, no display

    out = check_image_file(out)
    if smooth < 1:
        raise ConfigError("--smooth", f"must be >= 1 (got {smooth})")
    if not run_dirs:
        raise ConfigError("", "no run directory given")
    groups = lines(list(map(Path, run_dirs)), aggregate)
    groups = [[g[0].parent] if _of_the_run_only(g, metric) else g for g in groups]
    dirs = [d for group in groups for d in group]
    curves = {d: read_curve(d, metric) for d in dirs}
    for c in curves.values():
        c[metric] = moving_average(c[metric], smooth)
    names = {d: d.resolve().name for d in dirs}
    if len(set(names.values())) < len(names):  # same leaf name in different parents: show the paths as given
        names = {d: str(d) for d in dirs}

    fig = Figure(figsize=(12, 4.5), layout="constrained")
    ax_steps, ax_time = fig.subplots(1, 2, sharey=True)
    for group in groups:
        if len(group) == 1:
            c = curves[group[0]]
            dot = "o" if len(c[metric]) == 1 else None  # (one row: a line of one point is not drawn)
            line, = ax_steps.plot(c["env_steps"], c[metric], label=_label(group[0], names[group[0]]), marker=dot)
            ax_time.plot(c["wall_time"], c[metric], color=line.get_color(), marker=dot)
            continue
        try:
            m = mean_curve([curves[d] for d in group], metric=metric)
        except ValueError as e:  # (the seeds of one run are one line without --aggregate too)
            if aggregate:
                raise ConfigError("--aggregate", f"the runs of one line {e}; plot them without --aggregate") from None
            raise ConfigError(str(group[0].parent), f"its members {e}; plot their folders "
                              f"({', '.join(d.name for d in group)}) one by one") from None
        ends = {d: int(curves[d]["env_steps"][-1]) for d in group}
        shortest = min(group, key=ends.get)
        if ends[shortest] < max(ends.values()):
            print(f"msrl plot: note: {shortest} ends at {ends[shortest]:,} env steps, another run of its line at "
                  f"{max(ends.values()):,}: their mean is drawn up to {ends[shortest]:,}", file=sys.stderr)
        label = f"{_label(group[0], _shown(group, names))}: mean ± std of {len(group)} runs"
        dot = "o" if len(m["mean"]) == 1 else None
        line, = ax_steps.plot(m["env_steps"], m["mean"], label=label, marker=dot)
        for ax, x in ((ax_steps, m["env_steps"]), (ax_time, m["wall_time"])):
            ax.fill_between(x, m["mean"] - m["std"], m["mean"] + m["std"], color=line.get_color(), alpha=0.2)
        ax_time.plot(m["wall_time"], m["mean"], color=line.get_color(), marker=dot)
    ax_steps.set_xlabel("env steps")
    ax_time.set_xlabel("wall time (s)")
    ax_steps.set_ylabel(metric.replace("_", " ") + (f" (mean of last {smooth})" if smooth > 1 else ""))
    for ax in (ax_steps, ax_time):
        ax.grid(alpha=0.3)
    ax_steps.legend(fontsize="small")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return out
