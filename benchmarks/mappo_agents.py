"""MAPPO iteration time against the number of agents, under ``fused`` and ``single_learner_coarse`` (threads).

    python benchmarks/mappo_agents.py [--agents 3 6 12 24] [--iterations 10] [--repeats 2]

MAPPO (``examples/mappo_spread.yaml`` with 16 envs: 128-step rollouts, 4 epochs x 4 minibatches, 128-128
MLPs) on MPE simple_spread with N agents and N landmarks, for each N: ``fused`` (the whole iteration one jitted
program, all iterations in one dispatch) and ``single_learner_coarse`` on threads (2 actor threads x 8 envs,
one learner thread). Each runtime first runs the iterations once (threads compile in it), then ``--repeats``
times timed. Prints JSON: per (agents, policy) the best time per iteration, env steps/s, agent steps/s (env
steps x agents), the XLA compile time ahead of the run (``fused``; null where compiled in the first run), the
first run's time, and the sizes of an agent's observation and of the global state. Agents are a batch axis:
acting grows with N, and so do the critic's input (N x obs_dim, obs_dim ~ 4N) and the env's pairwise
collisions (N^2).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import jax

import msrl
from msrl.config import load_config

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "mappo_spread.yaml"
POLICIES = {"fused": ["policy.name=fused"],
            "single_learner_coarse": ["policy.name=single_learner_coarse", "policy.backend=threads", "policy.actors=2"]}


def measure(agents: int, policy: str, iterations: int, repeats: int, num_envs: int) -> dict:
    cfg = load_config(EXAMPLE, [*POLICIES[policy], f"env.num_envs={num_envs}", f"env.kwargs.num_agents={agents}",
                                f"env.kwargs.num_landmarks={agents}"])
    program = msrl.build(cfg)
    with msrl.Session(program=program, seed=0, iterations_per_dispatch=iterations) as session:
        t = time.perf_counter()
        session.run(iterations)  # compiles (threads: in the first iteration)
        first = time.perf_counter() - t
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            session.run(iterations)
            times.append((time.perf_counter() - t) / iterations)
    steps = program.env_steps_per_iteration
    spec = program.env.spec
    return {"agents": agents, "policy": policy, "iteration_s": round(min(times), 4),
            "env_sps": round(steps / min(times)), "agent_sps": round(steps * agents / min(times)),
            "compile_s": None if session.compile_seconds is None else round(session.compile_seconds, 2),
            "first_run_s": round(first, 2), "obs_dim": spec.obs_shape[0], "state_dim": spec.state_shape[0]}


def main() -> None:
    from msrl.bench import count

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--agents", type=count, nargs="+", default=[3, 6, 12, 24])
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    ap.add_argument("--iterations", type=count, default=10)
    ap.add_argument("--repeats", type=count, default=2)
    ap.add_argument("--num-envs", type=count, default=16)
    args = ap.parse_args()
    load_before = round(os.getloadavg()[0], 2)
    results = [measure(n, p, args.iterations, args.repeats, args.num_envs) for n in args.agents for p in args.policies]
    cfg = load_config(EXAMPLE, [f"env.num_envs={args.num_envs}"])
    print(json.dumps({
        "benchmark": "mappo_agents", "env": cfg.env.id, "num_envs": args.num_envs,
        "rollout_len": cfg.algorithm.rollout_len, "epochs": cfg.algorithm.epochs,
        "minibatches": cfg.algorithm.minibatches, "iterations": args.iterations, "repeats": args.repeats,
        "results": results, "device": str(jax.devices()[0]), "load_average_before": load_before,
        "load_average_after": round(os.getloadavg()[0], 2),
    }, indent=2))


if __name__ == "__main__":
    main()
