"""msrl PPO on a ``gymnasium:`` host env stepped in the actor's thread vs in worker processes (``env.subprocesses``),
side by side in one process.

    pip install -e '.[mujoco]'
    python benchmarks/host_env_subprocesses.py [--env HalfCheetah-v5] [--actors 1] [--envs-per-actor 8]
                                               [--subprocesses 2] [--env-steps 32768] [--pairs 3]

Both sides run ``examples/ppo_cartpole_threads.yaml``'s loop (``single_learner_coarse`` on threads, 128-step
rollouts) with the env swapped; they compute the same numbers (tests/test_subprocess_envs.py), so only the time
differs. Rounds alternate which side goes first. Prints JSON: each round's SPS (after the first, compiling,
iteration), the medians and their ratio (subprocesses / in-thread).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "ppo_cartpole_threads.yaml"


def steady_sps(example: str | Path, overrides: list[str], env_steps: int) -> float:
    """Env steps per second of ``example`` with ``overrides`` for ``env_steps`` steps (seed 0, one dispatch), after
    its first, compiling, iteration."""
    import msrl
    from msrl.config import load_config

    program = msrl.build(load_config(example, [*overrides, f"run.total_env_steps={env_steps}"]))
    iterations = env_steps // program.env_steps_per_iteration
    if iterations < 2:
        sys.exit(f"--env-steps: at least {2 * program.env_steps_per_iteration:,}, two iterations of "
                 f"{program.env_steps_per_iteration:,} steps (the first one compiles and is not timed)")
    with msrl.Session(program=program, seed=0, iterations_per_dispatch=iterations) as session:
        session.run(1)  # compiles
        t = time.perf_counter()
        session.run(iterations - 1)
        return (iterations - 1) * program.env_steps_per_iteration / (time.perf_counter() - t)


def sps(env: str, actors: int, envs_per_actor: int, subprocesses: int, env_steps: int) -> float:
    return steady_sps(EXAMPLE, [f"env.id=gymnasium:{env}", f"policy.actors={actors}",
                                f"policy.envs_per_actor={envs_per_actor}", f"env.subprocesses={subprocesses}",
                                "algorithm.anneal_lr=false"], env_steps)


def main() -> None:
    from msrl.bench import count

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--env", default="HalfCheetah-v5")
    ap.add_argument("--actors", type=count, default=1)
    ap.add_argument("--envs-per-actor", type=count, default=8)
    ap.add_argument("--subprocesses", type=count, default=2)
    ap.add_argument("--env-steps", type=count, default=32_768)
    ap.add_argument("--pairs", type=count, default=3)
    args = ap.parse_args()
    load_before = os.getloadavg()[0]
    rounds = []
    for k in range(args.pairs):
        order = [0, args.subprocesses] if k % 2 == 0 else [args.subprocesses, 0]
        rounds.append({f"sps_subprocesses_{s}": round(sps(args.env, args.actors, args.envs_per_actor, s,
                                                           args.env_steps)) for s in order})
    median = {s: statistics.median(r[f"sps_subprocesses_{s}"] for r in rounds) for s in (0, args.subprocesses)}
    print(json.dumps({
        "benchmark": "host_env_subprocesses", "env": f"gymnasium:{args.env}", "actors": args.actors,
        "envs_per_actor": args.envs_per_actor, "subprocesses": args.subprocesses, "env_steps": args.env_steps,
        "sps_in_thread": round(median[0]), "sps_subprocesses": round(median[args.subprocesses]),
        "subprocesses_over_in_thread": round(median[args.subprocesses] / median[0], 2),
        "load_average_before": round(load_before, 2), "load_average_after": round(os.getloadavg()[0], 2),
        "rounds": rounds,
    }, indent=2))


if __name__ == "__main__":
    main()
