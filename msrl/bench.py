"""``msrl bench``: run the scripts in ``benchmarks/`` as subprocesses and put their JSON side by side."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from msrl.errors import MsrlError

BENCH_EXTRA = "pip install -e '.[bench]'"
SB3 = ("torch", "stable_baselines3")  # the modules a peer needs (ray[tune]'s own check: pyarrow, fsspec)
RLLIB = ("torch", "tree", "ray.rllib", "pyarrow", "fsspec")


@dataclass(frozen=True)
class Benchmark:
    name: str
    script: str                       # file name in the benchmarks directory
    quick: tuple[str, ...]            # the script's flags for a short run
    msrl_key: str                     # JSON key of msrl's SPS
    peer_key: str                     # JSON key of the peer's SPS
    peer: str                         # the peer, in words
    needs: tuple[str, ...] = ()       # modules the peer needs; missing -> skipped
    configs: tuple[str, str] | None = None  # where the result holds "results" per config: their msrl and peer keys


BENCHMARKS = (
    Benchmark("ppo_fused", "ppo_fused.py", ("--total-env-steps", "51200", "--repeats", "1", "--no-peer"),
              "msrl_fused_sps", "handwritten_sps", "hand-written", configs=("msrl_sps", "handwritten_sps")),
    Benchmark("ppo_host_threads", "ppo_host_threads.py", ("--env-steps", "10240"),
              "msrl_threads_sps", "sb3_sps", "SB3", needs=SB3),
    Benchmark("sac_vs_sb3", "sac_vs_sb3.py", ("--env-steps", "3000", "--pairs", "1"),
              "msrl_sps", "sb3_sps_median", "SB3", needs=SB3),
    Benchmark("ppo_ray_vs_rllib", "ppo_ray_vs_rllib.py", ("--iterations", "5"),
              "msrl_ray_sps", "rllib_sps", "RLlib", needs=RLLIB),
)


def count(text: str) -> int:
    """A benchmark option's whole number >= 1 (an argparse ``type``)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"a whole number >= 1, got {text!r}")
    return value


def positive(text: str) -> float:
    """A benchmark option's number > 0 (an argparse ``type``)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"a number > 0, got {text!r}")
    return value


def benchmarks_dir() -> Path:
    """``benchmarks/`` of the source checkout msrl is installed from (editable install)."""
    import msrl

    d = Path(msrl.__file__).resolve().parent.parent / "benchmarks"
    if not d.is_dir():
        raise MsrlError(f"no benchmarks directory at {d}: `msrl bench` needs a source checkout installed with "
                        "`pip install -e .` (or pass --dir PATH/TO/benchmarks)")
    return d


def _missing(modules: tuple[str, ...]) -> list[str]:
    out = []
    for m in modules:
        try:
            found = importlib.util.find_spec(m) is not None
        except ImportError:  # a parent package is missing
            found = False
        if not found:
            out.append(m)
    return out


def require(*modules: str) -> None:
    """For a benchmark script: exit with a line saying what its peer needs and how to install it, where that is
    missing (not an ImportError's traceback midway)."""
    missing = _missing(modules)
    if missing:
        raise SystemExit(f"{Path(sys.argv[0]).name}: needs {', '.join(missing)} (not installed): {BENCH_EXTRA} in "
                         "msrl's folder")


def last_json(text: str) -> dict[str, Any]:
    """The JSON object a benchmark prints at the end of its output (anything may come before it)."""
    lines = text.splitlines()
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].lstrip().startswith("{"):
            try:
                obj = json.loads("\n".join(lines[i:]))
            except ValueError:
                continue
            if isinstance(obj, dict):
                return obj
    raise ValueError("no JSON object at the end of the output")


def run_one(b: Benchmark, directory: Path, quick: bool = True, timeout: float | None = None) -> dict[str, Any]:
    """Run one benchmark script; returns ``{name, status: ok|skipped|failed, reason, seconds, result}``."""
    rec: dict[str, Any] = {"name": b.name, "status": "ok", "reason": None, "seconds": 0.0, "result": None}
    missing = _missing(b.needs)
    if missing:
        return rec | {"status": "skipped", "reason": f"{BENCH_EXTRA}: needs {', '.join(missing)}"}
    script = Path(directory) / b.script
    if not script.is_file():
        return rec | {"status": "failed", "reason": f"{script} not found"}
    cmd = [sys.executable, str(script), *(b.quick if quick else ())]
    t = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=script.parent.parent,
                              check=False)
    except subprocess.TimeoutExpired:
        return rec | {"status": "failed", "reason": f"timed out after {timeout} s", "seconds": timeout}
    rec["seconds"] = round(time.perf_counter() - t, 1)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return rec | {"status": "failed", "reason": f"exit code {proc.returncode}: {tail}"}
    try:
        rec["result"] = last_json(proc.stdout)
    except ValueError as e:
        return rec | {"status": "failed", "reason": str(e)}
    return rec


def run_benchmarks(benchmarks: tuple[Benchmark, ...] = BENCHMARKS, directory: str | Path | None = None,
                   quick: bool = True, only: list[str] | None = None, timeout: float | None = None,
                   console: Any = None) -> list[dict[str, Any]]:
    """Run the selected benchmarks one after another (they time themselves, so never in parallel)."""
    # (resolved: a script runs from the folder's parent, where a relative path would not lead)
    directory = Path(directory).resolve() if directory is not None else benchmarks_dir()
    if not directory.is_dir():
        raise MsrlError(f"no benchmarks directory at {directory}")
    names = [b.name for b in benchmarks]
    unknown = [n for n in only or () if n not in names]
    if unknown:
        raise MsrlError(f"unknown benchmark {', '.join(unknown)}; choose from {', '.join(names)}")
    missing = [b.script for b in benchmarks if (not only or b.name in only) and not (directory / b.script).is_file()]
    if missing:
        raise MsrlError(f"{directory} lacks the benchmark script{'s' if len(missing) > 1 else ''} "
                        f"{', '.join(missing)} (--dir: the repository's benchmarks/ folder)")
    records = []
    for b in benchmarks:
        if only and b.name not in only:
            continue
        if console is not None:
            console.print(f"[bold]{b.name}[/] ({'quick' if quick else 'full'}) ...")
        records.append(run_one(b, directory, quick, timeout))
    return records


def table(records: list[dict[str, Any]], benchmarks: tuple[Benchmark, ...] = BENCHMARKS):
    """A rich table: benchmark, peer, msrl SPS, peer SPS, ratio (msrl / peer), time, status."""
    from rich.markup import escape
    from rich.table import Table

    spec = {b.name: b for b in benchmarks}
    t = Table(title="msrl benchmarks")
    t.add_column("benchmark", overflow="fold")  # wraps in a narrow console (piped: 80 columns); the rest never
    t.add_column("vs", no_wrap=True)
    for col in ("msrl SPS", "peer SPS", "ratio", "time (s)"):
        t.add_column(col, justify="right", no_wrap=True)
    t.add_column("status", no_wrap=True)
    reasons = [f"{r['name']}: {escape(r['reason'])}" for r in records if r["reason"]]
    if reasons:  # below the table, wrapped, never cut (a skip's says what to install)
        t.caption, t.caption_justify = "\n".join(reasons), "left"

    def num(v: Any, fmt: str = ",.0f") -> str:
        return format(v, fmt) if isinstance(v, (int, float)) else "-"

    def ratio(ours: Any, peer: Any) -> Any:
        return ours / peer if isinstance(ours, (int, float)) and isinstance(peer, (int, float)) and peer else None

    for r in records:
        b = spec[r["name"]]
        res = r["result"] or {}
        status = {"ok": "[green]ok[/]", "skipped": "[yellow]skipped[/]", "failed": "[red]failed[/]"}[r["status"]]
        seconds = num(r["seconds"], ".0f") if r["status"] == "ok" else "-"
        per_config = res.get("results") if b.configs is not None else None
        if isinstance(per_config, dict) and per_config:  # a row per config (the top-level figures are the first's)
            for i, (name, each) in enumerate(per_config.items()):
                ours, peer = (each.get(k) for k in b.configs)
                t.add_row(f"{b.name}: {name}", b.peer, num(ours), num(peer), num(ratio(ours, peer), ".2f"),
                          *((seconds, status) if i == 0 else ("", "")))
            continue
        ours, peer = res.get(b.msrl_key), res.get(b.peer_key)
        t.add_row(b.name, b.peer, num(ours), num(peer), num(res.get("ratio", ratio(ours, peer)), ".2f"), seconds, status)
    return t
