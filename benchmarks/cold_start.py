"""Seconds from a fresh ``msrl train`` process's start to its first ``metrics.csv`` row at the target return.

    python benchmarks/cold_start.py [--runs 5] [--config examples/ppo_cartpole.yaml] [--target 475] [--cold]

Each run starts ``msrl train CONFIG`` in a new process and watches its ``metrics.csv``; the time is taken when a
row with ``episode_return >= --target`` appears (the process is then stopped). One run first fills a JAX
compilation cache of its own (a temporary folder, ``MSRL_COMPILE_CACHE``) that the timed runs share, as a second
run of a config on a user's machine does; ``--cold`` gives every run an empty cache instead. Prints JSON: each
run's seconds (null: not reached), the median of those that reached it, ``import msrl.cli`` alone
(``python -X importtime``, once), and the load average before and after (check that the machine is quiet
first). The #23 goal: <= 5 s for examples/ppo_cartpole.yaml.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "ppo_cartpole.yaml"


def reached(metrics: Path, target: float) -> bool:
    if not metrics.exists():
        return False
    with open(metrics) as f:
        for row in csv.DictReader(f):
            try:
                if float(row["episode_return"]) >= target:
                    return True
            except (KeyError, TypeError, ValueError):  # a row still being written, or no return yet
                pass
    return False


def one_run(config: Path, target: float, cache: Path, timeout: float) -> float | None:
    """Seconds to the first row at ``target``; None where the run ended (or ran ``timeout`` s) without one."""
    msrl = shutil.which("msrl")
    command = [msrl] if msrl else [sys.executable, "-c", "import sys; from msrl.cli import main; sys.exit(main())"]
    with tempfile.TemporaryDirectory(prefix="msrl-cold-") as tmp:
        metrics = Path(tmp) / "run" / "metrics.csv"
        start = time.perf_counter()
        proc = subprocess.Popen([*command, "train", str(config), "--run-dir", str(Path(tmp) / "run")],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env={**os.environ, "MSRL_COMPILE_CACHE": str(cache)})
        try:
            while time.perf_counter() - start < timeout:
                if reached(metrics, target):
                    return time.perf_counter() - start
                if proc.poll() is not None:
                    return time.perf_counter() - start if reached(metrics, target) else None
                time.sleep(0.01)
            return None
        finally:
            proc.kill()
            proc.wait()


def import_seconds() -> float:
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", "import msrl.cli"], capture_output=True, text=True)
    return int(out.stderr.strip().splitlines()[-1].split("|")[1]) / 1e6  # msrl.cli's cumulative microseconds


def main() -> None:
    from msrl.bench import count

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=count, default=5)
    ap.add_argument("--config", type=Path, default=EXAMPLE)
    ap.add_argument("--target", type=float, default=475.0)
    ap.add_argument("--cold", action="store_true", help="an empty compilation cache for every run")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds a run may take (default 120)")
    args = ap.parse_args()
    if not args.config.exists():
        ap.error(f"--config: no such file {args.config}")
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="msrl-cold-cache-") as tmp:
        shared = Path(tmp) / "cache"
        if not args.cold:
            one_run(args.config, args.target, shared, args.timeout)  # fills the cache
        seconds = [one_run(args.config, args.target, Path(tmp) / f"cache{i}" if args.cold else shared, args.timeout)
                   for i in range(args.runs)]
    done = [s for s in seconds if s is not None]
    print(json.dumps({"benchmark": "cold_start", "config": str(args.config), "target": args.target,
                      "cache": "cold" if args.cold else "warm", "seconds": [None if s is None else round(s, 2)
                                                                             for s in seconds],
                      "median_s": round(statistics.median(done), 2) if done else None, "reached": len(done),
                      "import_msrl_cli_s": round(import_seconds(), 2), "load_average_before": round(load_before, 2),
                      "load_average_after": round(os.getloadavg()[0], 2)}, indent=2))


if __name__ == "__main__":
    main()
