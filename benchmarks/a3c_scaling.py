"""A3C (A2C under the ``async`` policy, CartPole) with 1, 2 and 4 actor-learners, on threads and on ray.

    python benchmarks/a3c_scaling.py [--iterations 200] [--envs-per-worker 4] [--workers 1 2 4]

Weak scaling, as A3C runs: every worker steps ``--envs-per-worker`` environments and sends one gradient
per iteration (``rollout_len`` x envs transitions) to the parameter holder. For reference, the same
algorithm fused into one jitted program on one worker's environments (``a2c_fused``) shows what a
worker's loop costs without the holder round trip.

Prints JSON per backend and worker count: env steps per second (all workers), gradients applied per
second, the mean policy lag of the applied gradients (holder updates between a worker's parameters and its
gradient's arrival) and the stale gradients dropped.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "a3c_cartpole.yaml"


def measure(overrides: list[str], iterations: int) -> dict:
    import numpy as np

    import msrl
    from msrl.config import load_config

    cfg = load_config(EXAMPLE, overrides)
    program = msrl.build(cfg)
    with msrl.Session(program=program, seed=0, iterations_per_dispatch=iterations) as session:
        warm = session.run(3)  # compiled, warm
        t = time.perf_counter()
        rows = session.run(iterations)
        seconds = time.perf_counter() - t
    out = {"sps": iterations * program.env_steps_per_iteration / seconds, "ms_per_iteration": 1000 * seconds / iterations}
    if "grads_applied" in rows[-1]:
        out |= {"grads_per_second": (rows[-1]["grads_applied"] - warm[-1]["grads_applied"]) / seconds,
                "mean_policy_lag": float(np.mean([r["policy_lag"] for r in rows])),
                "stale_grads_dropped": rows[-1]["stale_grads_dropped"]}
    return out


def main() -> None:
    from msrl.bench import count

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iterations", type=count, default=200)
    p.add_argument("--envs-per-worker", type=count, default=4)
    p.add_argument("--workers", type=count, nargs="+", default=[1, 2, 4])
    args = p.parse_args()

    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(address="local", num_cpus=max(4, os.cpu_count() or 1), include_dashboard=False,
             logging_level=logging.ERROR, log_to_driver=False)
    result: dict = {"benchmark": "a3c_scaling", "load_average_before": round(os.getloadavg()[0], 2),
                    "config": {"iterations": args.iterations, "envs_per_worker": args.envs_per_worker,
                               "cpus": os.cpu_count()}}
    try:
        result["a2c_fused"] = measure(["policy.name=fused", f"env.num_envs={args.envs_per_worker}"], args.iterations)
        for backend in ("threads", "ray"):
            result[backend] = {str(n): measure([f"policy.backend={backend}", f"policy.workers={n}",
                                                f"policy.envs_per_worker={args.envs_per_worker}"], args.iterations)
                               for n in args.workers}
    finally:
        ray.shutdown()
    print(json.dumps({**result, "load_average_after": round(os.getloadavg()[0], 2)}, indent=2))


if __name__ == "__main__":
    main()
