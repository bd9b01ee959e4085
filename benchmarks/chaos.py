"""Chaos: PPO on Ray (single_learner_coarse) while random actor processes are SIGKILLed.

    python benchmarks/chaos.py [--kills 20] [--actors 3] [--every 2.0]
    python benchmarks/chaos.py --raylet [--runs 3]

``--raylet``: ``msrl train`` on Ray in a subprocess; once it has a checkpoint, its cluster's raylet is
SIGKILLed. Prints JSON per run: exit code, seconds from the kill to the exit, the error line, and the
processes of the run alive 10 s after it ended (goal: exit 2 with a one-line error, none left).

A helper thread kills a random actor every ``every`` ± 50 % seconds (after the previous victim is back),
until ``kills`` kills. Training goes on in chunks of 4 iterations until then. Prints JSON: kills,
restarts, iterations completed, learner updates expected vs applied (lost = their difference, goal 0),
final return, and restart latency (kill -> replica running again).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import threading
import time
from pathlib import Path

import jax
import numpy as np

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "ppo_cartpole.yaml"


def raylet_kills(runs: int) -> None:
    import subprocess
    import sys
    import tempfile

    import psutil

    for run in range(runs):
        with tempfile.TemporaryDirectory() as tmp:
            run_dir = Path(tmp) / "run"
            proc = subprocess.Popen([sys.executable, "-m", "msrl.cli", "train", str(EXAMPLE), "policy.backend=ray",
                                     "policy.name=single_learner_coarse", "policy.actors=2", "run.progress=false",
                                     "run.tensorboard=false", "run.total_env_steps=1000000",
                                     "run.iterations_per_dispatch=4", "run.checkpoint_every_steps=2048",
                                     "--run-dir", str(run_dir)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True)
            while not list((run_dir / "checkpoints").glob("ckpt_*.msgpack")) and proc.poll() is None:
                time.sleep(0.1)
            family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
            raylets = [p for p in family if p.name() == "raylet"]
            raylets[0].kill()
            killed = time.perf_counter()
            _, err = proc.communicate(timeout=300)
            took = time.perf_counter() - killed
            time.sleep(10)
            left = [p.name() for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
            lines = [x for x in err.splitlines() if x.startswith("msrl: error:")]
            print(json.dumps({"run": run, "exit_code": proc.returncode, "seconds_to_exit": round(took, 1),
                              "error": lines[-1][:400] if lines else err[-400:], "alive_10s_later": left}), flush=True)


def main() -> None:
    import msrl
    from msrl.config import load_config

    from msrl.bench import count, positive

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=count, default=20)
    parser.add_argument("--actors", type=count, default=3)
    parser.add_argument("--every", type=positive, default=2.0)
    parser.add_argument("--raylet", action="store_true", help="kill a run's raylet instead (see above)")
    parser.add_argument("--runs", type=count, default=3, help="with --raylet: how many runs")
    args = parser.parse_args()
    if args.raylet:
        return raylet_kills(args.runs)

    from msrl.backends.ray_backend import init_local, shutdown

    init_local(args.actors + 2, logging_level=logging.ERROR, log_to_driver=False)
    cfg = load_config(EXAMPLE, ["policy.name=single_learner_coarse", "policy.backend=ray",
                                f"policy.actors={args.actors}", f"env.num_envs={2 * args.actors}",
                                f"policy.max_actor_restarts={args.kills}"])
    session = msrl.Session(cfg, seed=0, iterations_per_dispatch=4)
    runtime = session.runtime  # the ray runtime: where() and restarts
    rng, kills, latency = random.Random(0), [], []

    def chaos() -> None:
        while len(kills) < args.kills:
            time.sleep(rng.uniform(0.5, 1.5) * args.every)
            victim = ("actor", rng.randrange(args.actors))
            before = runtime.restarts.get(victim, 0)
            try:
                os.kill(runtime.where()[victim][1], signal.SIGKILL)
            except ProcessLookupError:
                continue
            t = time.perf_counter()
            kills.append(victim)
            while runtime.restarts.get(victim, 0) == before:
                time.sleep(0.02)
            latency.append(time.perf_counter() - t)

    killer = threading.Thread(target=chaos, daemon=True)
    start = time.perf_counter()
    killer.start()
    rows = []
    try:
        while killer.is_alive():
            rows += session.run(4)
        state = session.snapshot()["learner"][0]["learner"]
        applied = {int(x) for p, x in jax.tree_util.tree_leaves_with_path(state["opt_state"])
                   if "count" in jax.tree_util.keystr(p)}
    finally:
        session.close()
        shutdown()
    expected = len(rows) * cfg.algorithm.epochs * cfg.algorithm.minibatches
    returns = [r["episode_return"] for r in rows if np.isfinite(r["episode_return"])]
    print(json.dumps({
        "kills": len(kills), "restarts": sum(runtime.restarts.values()), "iterations": len(rows),
        "learner_updates_expected": expected, "learner_updates_applied": max(applied),
        "learner_updates_lost": expected - max(applied), "final_return": returns[-1] if returns else None,
        "restart_seconds_median": float(np.median(latency)), "restart_seconds_max": float(np.max(latency)),
        "wall_seconds": time.perf_counter() - start}, indent=2))


if __name__ == "__main__":
    main()
