"""msrl on Ray (single_learner_coarse, gymnax CartPole inside the actors) vs RLlib PPO, one Ray cluster.

    pip install -e '.[bench]'
    python benchmarks/ppo_ray_vs_rllib.py [--iterations 30] [--actors 2] [--envs-per-actor 2]

Same shapes on both sides: ``actors`` actors (RLlib: env runners) with ``envs_per_actor`` CartPole-v1
environments each, 128-step rollouts, a train batch of actors x envs x 128 steps, 4 epochs of 4 minibatches,
a 64-64 tanh actor-critic. Both run a few warm-up iterations (msrl compiles in them) before the timed ones.
Prints JSON: both SPS (env steps sampled and trained on per wall-clock second) and the ratio (goal >= 50).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "ppo_cartpole.yaml"
WARMUP = 3


def msrl_sps(iterations: int, actors: int, envs_per_actor: int) -> tuple[float, float]:
    import msrl
    from msrl.config import load_config

    cfg = load_config(EXAMPLE, ["policy.name=single_learner_coarse", "policy.backend=ray",
                                f"policy.actors={actors}", f"policy.envs_per_actor={envs_per_actor}"])
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
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--actors", type=int, default=2)
    parser.add_argument("--envs-per-actor", type=int, default=2)
    args = parser.parse_args()
    ray.init(address="local", include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False,
             num_cpus=max(4, args.actors + 2))
    try:
        m_sps, m_ret = msrl_sps(args.iterations, args.actors, args.envs_per_actor)
        r_sps, r_ret = rllib_sps(args.iterations, args.actors, args.envs_per_actor)
    finally:
        ray.shutdown()
    print(json.dumps({"actors": args.actors, "envs_per_actor": args.envs_per_actor, "iterations": args.iterations,
                      "msrl_ray_sps": round(m_sps), "rllib_sps": round(r_sps), "ratio": round(m_sps / r_sps, 1),
                      "msrl_return": m_ret, "rllib_return": r_ret}, indent=2))


if __name__ == "__main__":
    main()
