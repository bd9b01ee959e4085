"""msrl on Ray (single_learner_coarse) vs RLlib PPO, one Ray cluster.

    pip install -e '.[bench]'            # and '.[envpool]' for --env envpool
    python benchmarks/ppo_ray_vs_rllib.py [--iterations 30] [--actors 2] [--envs-per-actor 2]
                                          [--env gymnax,gymnasium,envpool,envpool_xla] [--pairs 1]

msrl's CartPole per ``--env`` side: ``gymnax`` (jitted inside the actors: ``examples/ppo_cartpole.yaml``), or a host
env stepped in each actor process, ``gymnasium`` (Python envs) or ``envpool`` (EnvPool's C++ pool; ``envpool_xla``:
the same pool stepped from inside the actor's jitted rollout, ``env.xla=true``)
(``examples/ppo_cartpole_threads.yaml`` with the actors as Ray actors). ``--pairs N`` runs N rounds of (RLlib,
msrl sides), alternating the order. Same shapes on both sides: ``actors`` actors (RLlib: env runners) with ``envs_per_actor`` CartPole-v1
environments each, 128-step rollouts, a train batch of actors x envs x 128 steps, 4 epochs of 4 minibatches,
a 64-64 tanh actor-critic. Both run a few warm-up iterations (msrl compiles in them) before the timed ones.
Prints JSON: the SPS (env steps sampled and trained on per wall-clock second; medians over the rounds) and each
msrl side's ratio to RLlib (goal >= 50); ``msrl_ray_sps``/``ratio`` are the first side's.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time
from pathlib import Path

from msrl.bench import RLLIB, count, require

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
SIDES = {  # msrl's CartPole: the example and the overrides
    "gymnax": ("ppo_cartpole.yaml", ["policy.name=single_learner_coarse"]),
    "gymnasium": ("ppo_cartpole_threads.yaml", ["policy.actor_backend=ray", "env.id=gymnasium:CartPole-v1"]),
    "envpool": ("ppo_cartpole_threads.yaml", ["policy.actor_backend=ray", "env.id=envpool:CartPole-v1"]),
    "envpool_xla": ("ppo_cartpole_threads.yaml", ["policy.actor_backend=ray", "env.id=envpool:CartPole-v1",
                                                  "env.xla=true"]),
}
WARMUP = 3


def msrl_sps(iterations: int, actors: int, envs_per_actor: int, env: str = "gymnax") -> tuple[float, float]:
    import msrl
    from msrl.config import load_config

    example, overrides = SIDES[env]
    cfg = load_config(EXAMPLES / example, [*overrides, "policy.backend=ray", f"policy.actors={actors}",
                                           f"policy.envs_per_actor={envs_per_actor}"])
    program = msrl.build(cfg)
    with msrl.Session(program=program, seed=0, iterations_per_dispatch=iterations) as session:
        session.run(WARMUP)
        t = time.perf_counter()
        rows = session.run(iterations)
        sps = iterations * program.env_steps_per_iteration / (time.perf_counter() - t)
    return sps, rows[-1]["episode_return"]


def _find(result: dict, key: str):
    for k, v in result.items():
        if k == key:
            return v
        if isinstance(v, dict) and (found := _find(v, key)) is not None:
            return found
    return None


def rllib_sps(iterations: int, actors: int, envs_per_actor: int) -> tuple[float, float]:
    from ray.rllib.algorithms.ppo import PPOConfig
    from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig

    batch = actors * envs_per_actor * 128
    config = (PPOConfig().environment("CartPole-v1").framework("torch")
              .env_runners(num_env_runners=actors, num_envs_per_env_runner=envs_per_actor,
                           rollout_fragment_length=128)
              .training(train_batch_size_per_learner=batch, minibatch_size=batch // 4, num_epochs=4, lr=1e-3,
                        gamma=0.99, lambda_=0.95, clip_param=0.2, entropy_coeff=0.01, vf_loss_coeff=0.5,
                        grad_clip=0.5)
              .rl_module(model_config=DefaultModelConfig(fcnet_hiddens=[64, 64], fcnet_activation="tanh"))
              .debugging(seed=0, log_level="ERROR"))
    algo = config.build_algo()
    try:
        for _ in range(WARMUP):
            result = algo.train()
        before = _find(result, "num_env_steps_sampled_lifetime")
        t = time.perf_counter()
        for _ in range(iterations):
            result = algo.train()
        elapsed = time.perf_counter() - t
        steps = _find(result, "num_env_steps_sampled_lifetime") - before
        ret = _find(result, "episode_return_mean")
    finally:
        algo.stop()
    return steps / elapsed, float(ret) if ret is not None else float("nan")


def main() -> None:
    import ray

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=count, default=30)
    parser.add_argument("--actors", type=count, default=2)
    parser.add_argument("--envs-per-actor", type=count, default=2)
    parser.add_argument("--env", default="gymnax", help="msrl sides, comma-separated: gymnax, gymnasium, envpool, envpool_xla")
    parser.add_argument("--pairs", type=count, default=1, help="rounds of (RLlib, msrl sides), alternating their order")
    args = parser.parse_args()
    require(*RLLIB)
    sides = args.env.split(",")
    if unknown := set(sides) - set(SIDES):
        parser.error(f"--env: unknown {sorted(unknown)}; choose from {sorted(SIDES)}")
    ray.init(address="local", include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False,
             num_cpus=max(4, args.actors + 2))
    load_before, rounds = os.getloadavg(), []
    try:
        for k in range(args.pairs):
            order = ["rllib", *sides] if k % 2 == 0 else [*reversed(sides), "rllib"]
            rounds.append({side: (rllib_sps(args.iterations, args.actors, args.envs_per_actor) if side == "rllib" else
                                  msrl_sps(args.iterations, args.actors, args.envs_per_actor, side)) for side in order})
    finally:
        ray.shutdown()
    sps = {side: statistics.median(r[side][0] for r in rounds) for side in ["rllib", *sides]}
    print(json.dumps({
        "actors": args.actors, "envs_per_actor": args.envs_per_actor, "iterations": args.iterations,
        "pairs": args.pairs, "msrl_ray_sps": round(sps[sides[0]]), "rllib_sps": round(sps["rllib"]),
        "ratio": round(sps[sides[0]] / sps["rllib"], 2),
        **{f"msrl_ray_{s}_sps": round(sps[s]) for s in sides}, **{f"ratio_{s}": round(sps[s] / sps["rllib"], 2)
                                                                  for s in sides},
        "returns": [{side: round(v[1], 1) for side, v in r.items()} for r in rounds],
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
    }, indent=2))


if __name__ == "__main__":
    main()
