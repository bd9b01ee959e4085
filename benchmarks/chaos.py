"""Chaos: PPO on Ray (single_learner_coarse) while random actor processes are SIGKILLed.

    python benchmarks/chaos.py [--kills 20] [--actors 3] [--every 2.0]

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


def main() -> None:
    import ray

    import msrl
    from msrl.config import load_config

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--actors", type=int, default=3)
    parser.add_argument("--every", type=float, default=2.0)
    args = parser.parse_args()

    ray.init(address="local", include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False,
             num_cpus=args.actors + 2)
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
        ray.shutdown()
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
