"""Atari Breakout PPO SPS: msrl (``examples/ppo_breakout_envpool.yaml``: EnvPool, Nature CNN, single_learner_coarse
on threads) vs Stable-Baselines3 PPO (``CnnPolicy``, the same Nature CNN, on ALE's Breakout through its Atari
wrappers), side by side in one process.

    pip install -e '.[bench,envpool]'
    python benchmarks/ppo_breakout_vs_sb3.py [--env-steps 8192] [--pairs 2] [--sb3-device cuda]

Same setup on both sides: 8 envs (msrl: 2 actor threads x 4), 84x84 grayscale frames stacked 4, frame skip 4,
128-step rollouts, 4 epochs x 4 minibatches (batch 256), lr 2.5e-4, clip 0.1; SB3 on 2 torch threads. SPS counts
env steps (x4 frames) after each side's first iteration (msrl compiles in it). Rounds alternate the order. Prints
JSON: each round's SPS, the medians and their ratio (goal >= 2). On a machine with a GPU, msrl's networks run
on it (JAX's default device) and ``--sb3-device cuda`` puts SB3's there too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from msrl.bench import SB3, count, require

from host_env_subprocesses import steady_sps  # a sibling script

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "ppo_breakout_envpool.yaml"


def sb3_sps(env_steps: int, device: str) -> float:
    import ale_py
    import gymnasium
    import torch
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.env_util import make_atari_env
    from stable_baselines3.common.vec_env import VecFrameStack

    gymnasium.register_envs(ale_py)
    torch.set_num_threads(2)
    env = VecFrameStack(make_atari_env("BreakoutNoFrameskip-v4", n_envs=8, seed=0), n_stack=4)
    model = PPO("CnnPolicy", env, n_steps=128, batch_size=256, n_epochs=4, learning_rate=2.5e-4, clip_range=0.1,
                ent_coef=0.01, vf_coef=0.5, max_grad_norm=0.5, device=device, seed=0, verbose=0)

    class Clock(BaseCallback):  # starts the clock after the first iteration, as msrl's side does
        start: float | None = None
        steps0 = 0

        def _on_rollout_start(self) -> None:
            if self.start is None and self.num_timesteps > 0:
                self.start, self.steps0 = time.perf_counter(), self.num_timesteps

        def _on_step(self) -> bool:
            return True

    clock = Clock()
    model.learn(total_timesteps=env_steps, callback=clock)
    return (model.num_timesteps - clock.steps0) / (time.perf_counter() - clock.start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--env-steps", type=count, default=8192)
    ap.add_argument("--pairs", type=count, default=2)
    ap.add_argument("--sb3-device", default="cpu", help="torch device of SB3's networks (cpu, cuda)")
    args = ap.parse_args()
    require("ale_py", "cv2", *SB3)
    sides = {"sb3": lambda: sb3_sps(args.env_steps, args.sb3_device),
             "msrl": lambda: steady_sps(EXAMPLE, [], args.env_steps)}
    load_before, rounds = os.getloadavg(), []
    for k in range(args.pairs):
        order = ["sb3", "msrl"] if k % 2 == 0 else ["msrl", "sb3"]
        rounds.append({side: round(sides[side](), 1) for side in order})
    sb3, ours = (statistics.median(r[s] for r in rounds) for s in ("sb3", "msrl"))
    import jax  # after msrl's import (in steady_sps), which sets an XLA option before JAX's backend starts

    print(json.dumps({
        "benchmark": "ppo_breakout_vs_sb3", "msrl_device": str(jax.devices()[0]), "sb3_device": args.sb3_device,
        "envs": 8, "rollout_len": 128, "epochs": 4, "minibatches": 4,
        "env_steps": args.env_steps, "pairs": args.pairs, "sb3_sps": round(sb3, 1), "msrl_sps": round(ours, 1),
        "ratio": round(ours / sb3, 2), "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()], "rounds": rounds,
    }, indent=2))


if __name__ == "__main__":
    main()
