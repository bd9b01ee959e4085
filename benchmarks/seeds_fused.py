"""Wall time of N seeds of ``fused`` PPO in one program (``run.num_seeds``) against one seed.

    python benchmarks/seeds_fused.py [--seeds 8] [--steps 204800] [--pairs 3] [--seed-batching auto|vmap|sequential]

PPO on gymnax CartPole-v1 with examples/ppo_cartpole.yaml's settings (4 envs). One warm-up each (compile
excluded), then ``--pairs`` alternating rounds; prints JSON with the median wall time of each and the median
per-round ratio ``n_seeds_over_one`` (goal <= 2.5 for 8 seeds), and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

import msrl

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "ppo_cartpole.yaml"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=204_800)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--seed-batching", default="auto", choices=["auto", "vmap", "sequential"])
    args = ap.parse_args()
    load_before = os.getloadavg()[0]
    sessions = {}
    for n in (1, args.seeds):
        s = msrl.Session(EXAMPLE, ["policy.name=fused", f"run.total_env_steps={args.steps}", f"run.num_seeds={n}",
                                    f"run.seed_batching={args.seed_batching}"],
                         iterations_per_dispatch=args.steps // 512)
        s.run(args.steps // 512)  # warm-up
        sessions[n] = s
    times: dict[int, list[float]] = {n: [] for n in sessions}
    for _ in range(args.pairs):
        for n, s in sessions.items():
            t = time.perf_counter()
            s.run(args.steps // 512)
            times[n].append(time.perf_counter() - t)
    one, many = times[1], times[args.seeds]
    print(json.dumps({"benchmark": "seeds_fused", "seeds": args.seeds, "seed_batching": args.seed_batching,
                      "env_steps_per_seed": args.steps,
                      "one_seed_s": round(float(np.median(one)), 3), "n_seeds_s": round(float(np.median(many)), 3),
                      "n_seeds_over_one": round(float(np.median([m / o for m, o in zip(many, one)])), 3),
                      "load_average_before": round(load_before, 2), "load_average_after": round(os.getloadavg()[0], 2)},
                     indent=2))


if __name__ == "__main__":
    main()
