"""msrl (threads, single_learner_coarse, Gymnasium CartPole) vs Stable-Baselines3 PPO, same process.

    pip install -e '.[bench]'
    python benchmarks/ppo_host_threads.py [--env-steps 102400] [--actors 2] [--envs-per-actor 4]

Both step Gymnasium's CartPole-v1 on the host with the same sizes: actors x envs_per_actor environments
(SB3: that many in a DummyVecEnv), 128-step rollouts, 4 epochs x 4 minibatches, a 64-64 tanh actor-critic.
Prints JSON: both SPS (msrl's after its first, compiling, iteration), and the ratio (goal >= 5).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "ppo_cartpole_threads.yaml"


def msrl_sps(env_steps: int, actors: int, envs_per_actor: int) -> tuple[float, float]:
    import msrl
    from msrl.config import load_config

    cfg = load_config(EXAMPLE, [f"policy.actors={actors}", f"policy.envs_per_actor={envs_per_actor}",
                                f"run.total_env_steps={env_steps}"])
    program = msrl.build(cfg)
    iterations = env_steps // program.env_steps_per_iteration
    with msrl.Session(program=program, seed=0, iterations_per_dispatch=iterations) as session:
        t = time.perf_counter()
        session.run(1)  # compiles the jitted segments
        first = time.perf_counter() - t
        t = time.perf_counter()
        rows = session.run(iterations - 1)
        sps = (iterations - 1) * program.env_steps_per_iteration / (time.perf_counter() - t)
    return sps, first, rows[-1]["episode_return"]


def sb3_sps(env_steps: int, num_envs: int) -> tuple[float, float]:
    import torch
    from stable_baselines3 import PPO
    from stable_baselines3.common.env_util import make_vec_env

    torch.set_num_threads(2)
    env = make_vec_env("CartPole-v1", n_envs=num_envs, seed=0)
    batch = num_envs * 128
    model = PPO("MlpPolicy", env, n_steps=128, batch_size=batch // 4, n_epochs=4, learning_rate=1e-3,
                gamma=0.99, gae_lambda=0.95, clip_range=0.2, ent_coef=0.01, vf_coef=0.5, max_grad_norm=0.5,
                policy_kwargs={"net_arch": [64, 64], "activation_fn": torch.nn.Tanh}, device="cpu", seed=0,
                verbose=0)
    t = time.perf_counter()
    model.learn(total_timesteps=env_steps)
    elapsed = time.perf_counter() - t
    returns = [ep["r"] for ep in model.ep_info_buffer]
    return env_steps / elapsed, float(sum(returns[-10:]) / max(1, len(returns[-10:])))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--env-steps", type=int, default=102_400)
    ap.add_argument("--actors", type=int, default=2)
    ap.add_argument("--envs-per-actor", type=int, default=4)
    args = ap.parse_args()
    num_envs = args.actors * args.envs_per_actor
    sb3, sb3_return = sb3_sps(args.env_steps, num_envs)
    ours, first_iteration_s, our_return = msrl_sps(args.env_steps, args.actors, args.envs_per_actor)
    print(json.dumps({
        "benchmark": "ppo_host_threads",
        "env": "gymnasium:CartPole-v1", "actors": args.actors, "envs_per_actor": args.envs_per_actor,
        "rollout_len": 128, "epochs": 4, "minibatches": 4, "env_steps": args.env_steps,
        "msrl_threads_sps": round(ours),
        "sb3_sps": round(sb3),
        "ratio": round(ours / sb3, 2),
        "msrl_first_iteration_s (compile)": round(first_iteration_s, 2),
        "msrl_last_return": our_return,
        "sb3_last_return": sb3_return,
    }, indent=2))


if __name__ == "__main__":
    main()
