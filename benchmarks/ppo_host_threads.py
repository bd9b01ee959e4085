"""msrl (threads, single_learner_coarse, host CartPole: Gymnasium's and/or EnvPool's) vs Stable-Baselines3 PPO,
side by side in one process.

    pip install -e '.[bench,envpool]'
    python benchmarks/ppo_host_threads.py [--env-steps 102400] [--actors 2] [--envs-per-actor 4]
                                          [--env gymnasium,envpool,envpool_xla|both|all] [--pairs 1]

msrl steps CartPole-v1 on the host with ``gymnasium:CartPole-v1`` (Python envs, one by one), ``envpool:CartPole-v1``
(EnvPool's C++ pool, one per actor, stepped from the actor's Python loop) and/or ``envpool_xla`` (the same pools
with ``env.xla=true``: stepped from inside each actor's jitted rollout); SB3 steps Gymnasium's CartPole-v1 in a
DummyVecEnv.
Same sizes everywhere: actors x envs_per_actor environments, 128-step rollouts, 4 epochs x 4 minibatches, a 64-64
tanh actor-critic. ``--pairs N`` runs N rounds of (SB3, each msrl side), alternating the order from round to round
so a drift in the machine's load falls on every side alike. Prints JSON: each round's SPS (msrl's after its first,
compiling, iteration), the medians, and each msrl side's ratio to SB3 (goal >= 5).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import time
from pathlib import Path

from msrl.bench import SB3, count, require

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "ppo_cartpole_threads.yaml"
ENV_IDS = {"gymnasium": "gymnasium:CartPole-v1", "envpool": "envpool:CartPole-v1", "envpool_xla": "envpool:CartPole-v1"}


def msrl_sps(env_steps: int, actors: int, envs_per_actor: int, env: str = "gymnasium") -> tuple[float, float, float]:
    import msrl
    from msrl.config import load_config

    cfg = load_config(EXAMPLE, [f"policy.actors={actors}", f"policy.envs_per_actor={envs_per_actor}",
                                f"run.total_env_steps={env_steps}", f"env.id={ENV_IDS[env]}",
                                f"env.xla={env == 'envpool_xla'}"])
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
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--env-steps", type=count, default=102_400)
    ap.add_argument("--actors", type=count, default=2)
    ap.add_argument("--envs-per-actor", type=count, default=4)
    ap.add_argument("--env", default=None,
                    help="msrl's host CartPole, comma-separated: gymnasium, envpool, envpool_xla; both (gymnasium and "
                         "envpool) or all (default: all where EnvPool is installed, else gymnasium)")
    ap.add_argument("--pairs", type=count, default=1, help="rounds of (SB3, msrl sides), alternating their order")
    args = ap.parse_args()
    require(*SB3)
    num_envs = args.actors * args.envs_per_actor
    if args.env is None:
        args.env = "all" if importlib.util.find_spec("envpool") is not None else "gymnasium"
    sides = {"both": ["gymnasium", "envpool"], "all": list(ENV_IDS)}.get(args.env, args.env.split(","))
    unknown = sorted(set(sides) - set(ENV_IDS))
    if unknown:
        ap.error(f"--env: unknown {unknown}; choose from {list(ENV_IDS)}, both or all")
    load_before = os.getloadavg()
    rounds = []
    for k in range(args.pairs):
        order = ["sb3", *sides] if k % 2 == 0 else [*reversed(sides), "sb3"]
        result = {"order": order}
        for side in order:
            if side == "sb3":
                sps, ret = sb3_sps(args.env_steps, num_envs)
                result["sb3_sps"], result["sb3_last_return"] = round(sps), ret
            else:
                sps, first, ret = msrl_sps(args.env_steps, args.actors, args.envs_per_actor, side)
                result[f"msrl_{side}_sps"], result[f"msrl_{side}_last_return"] = round(sps), ret
                result[f"msrl_{side}_first_iteration_s (compile)"] = round(first, 2)
        rounds.append(result)

    def median(key):
        return statistics.median(r[key] for r in rounds)

    out = {
        "benchmark": "ppo_host_threads",
        "envs": {"sb3": "gymnasium CartPole-v1 (DummyVecEnv)",
                 **{f"msrl_{s}": ENV_IDS[s] + (" (env.xla=true)" if s == "envpool_xla" else "") for s in sides}},
        "actors": args.actors, "envs_per_actor": args.envs_per_actor,
        "rollout_len": 128, "epochs": 4, "minibatches": 4, "env_steps": args.env_steps, "pairs": args.pairs,
        "sb3_sps": round(median("sb3_sps")),
        # msrl_threads_sps / ratio: the Gymnasium side (the keys `msrl bench` reads); *_envpool_*: EnvPool's
        **{("msrl_threads_sps" if s == "gymnasium" else f"msrl_threads_{s}_sps"): round(median(f"msrl_{s}_sps"))
           for s in sides},
        **{("ratio" if s == "gymnasium" else f"ratio_{s}"): round(median(f"msrl_{s}_sps") / median("sb3_sps"), 2)
           for s in sides},
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "rounds": rounds,
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
