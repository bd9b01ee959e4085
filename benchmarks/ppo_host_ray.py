"""msrl (ray backend, single_learner_coarse, host CartPole: EnvPool's and/or Gymnasium's) vs RLlib PPO, side by side
on one local Ray cluster in one process.

    pip install -e '.[bench,envpool]'
    python benchmarks/ppo_host_ray.py [--actors 2] [--envs-per-actor 16] [--env-steps 131072]
                                      [--env envpool|gymnasium|both] [--pairs 1]

msrl: ``examples/ppo_cartpole_threads.yaml`` with ``policy.backend=ray`` and ``policy.actor_backend=ray`` (each
actor a Ray actor process stepping its envs; the learner a Ray actor running one jitted update). RLlib: PPO
(its default new API stack) with ``actors`` env runners x ``envs_per_actor`` Gymnasium CartPole-v1 envs, a local
learner, the same batch (128-step rollouts), 4 epochs x 4 minibatches, a 64-64 tanh actor-critic, lr 1e-3.
Rounds alternate the order of the sides. SPS counts env steps after each side's first (compiling / warming)
iteration. Prints JSON with the medians and each msrl side's ratio to RLlib (goal >= 50).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "ppo_cartpole_threads.yaml"
ENV_IDS = {"gymnasium": "gymnasium:CartPole-v1", "envpool": "envpool:CartPole-v1"}


def msrl_sps(env_steps: int, actors: int, envs_per_actor: int, env: str) -> tuple[float, float]:
    import msrl
    from msrl.config import load_config

    cfg = load_config(EXAMPLE, [f"policy.actors={actors}", f"policy.envs_per_actor={envs_per_actor}",
                                "policy.backend=ray", "policy.actor_backend=ray", f"env.id={ENV_IDS[env]}",
                                f"run.total_env_steps={env_steps}"])
    program = msrl.build(cfg)
    iterations = env_steps // program.env_steps_per_iteration
    with msrl.Session(program=program, seed=0, iterations_per_dispatch=iterations) as session:
        session.run(1)
        t = time.perf_counter()
        rows = session.run(iterations - 1)
        return (iterations - 1) * program.env_steps_per_iteration / (time.perf_counter() - t), rows[-1]["episode_return"]


def _find(result: dict, key: str):
    for k, v in result.items():
        if k == key:
            return v
        if isinstance(v, dict):
            found = _find(v, key)
            if found is not None:
                return found
    return None


def rllib_sps(env_steps: int, actors: int, envs_per_actor: int) -> tuple[float, float]:
    from ray.rllib.algorithms.ppo import PPOConfig
    from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig

    batch = actors * envs_per_actor * 128
    config = (PPOConfig()
              .environment("CartPole-v1")
              .env_runners(num_env_runners=actors, num_envs_per_env_runner=envs_per_actor,
                           rollout_fragment_length=128)
              .learners(num_learners=0)
              .training(train_batch_size_per_learner=batch, minibatch_size=batch // 4, num_epochs=4, lr=1e-3,
                        gamma=0.99, lambda_=0.95, clip_param=0.2, entropy_coeff=0.01, vf_loss_coeff=0.5,
                        grad_clip=0.5)
              .rl_module(model_config=DefaultModelConfig(fcnet_hiddens=[64, 64], fcnet_activation="tanh"))
              .debugging(seed=0))
    algo = config.build_algo()
    try:
        result = algo.train()
        start_steps, t = _find(result, "num_env_steps_sampled_lifetime"), time.perf_counter()
        steps = start_steps
        while steps - start_steps < env_steps - batch:
            result = algo.train()
            steps = _find(result, "num_env_steps_sampled_lifetime")
        elapsed = time.perf_counter() - t
        return (steps - start_steps) / elapsed, float(_find(result, "episode_return_mean") or float("nan"))
    finally:
        algo.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--env-steps", type=int, default=131_072)
    ap.add_argument("--actors", type=int, default=2)
    ap.add_argument("--envs-per-actor", type=int, default=16)
    ap.add_argument("--env", choices=["gymnasium", "envpool", "both"], default="both")
    ap.add_argument("--pairs", type=int, default=1)
    args = ap.parse_args()
    import ray

    # logical CPUs: each side places actors + 1 learner; both wait for the same 2-core box alike
    ray.init(address="local", num_cpus=max(4, args.actors + 2), include_dashboard=False, log_to_driver=False)
    sides = ["gymnasium", "envpool"] if args.env == "both" else [args.env]
    load_before = os.getloadavg()
    rounds = []
    for k in range(args.pairs):
        order = ["rllib", *sides] if k % 2 == 0 else [*reversed(sides), "rllib"]
        result = {"order": order}
        for side in order:
            if side == "rllib":
                sps, ret = rllib_sps(args.env_steps, args.actors, args.envs_per_actor)
            else:
                sps, ret = msrl_sps(args.env_steps, args.actors, args.envs_per_actor, side)
            result[f"{side}_sps"], result[f"{side}_last_return"] = round(sps), round(ret, 1)
        rounds.append(result)

    def median(key):
        return statistics.median(r[key] for r in rounds)

    print(json.dumps({
        "benchmark": "ppo_host_ray", "actors": args.actors, "envs_per_actor": args.envs_per_actor,
        "rollout_len": 128, "epochs": 4, "minibatches": 4, "env_steps": args.env_steps, "pairs": args.pairs,
        "rllib_sps": round(median("rllib_sps")),
        **{f"msrl_ray_{s}_sps": round(median(f"{s}_sps")) for s in sides},
        **{f"ratio_{s}": round(median(f"{s}_sps") / median("rllib_sps"), 2) for s in sides},
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()], "rounds": rounds,
    }, indent=2))


if __name__ == "__main__":
    main()
