"""msrl ``fused`` PPO vs a hand-written single-function ``lax.scan`` PPO, same math, same process.

    python benchmarks/ppo_fused.py [--total-env-steps 500000] [--repeats 3]

Both train PPO on gymnax CartPole-v1 with 4 envs x 128 steps, 4 epochs x 4 minibatches. Prints JSON:
SPS of each (best of ``repeats`` interleaved runs, compile excluded), their ratio (goal >= 1.0) and the median
of the per-pair ratios (more robust on a shared machine), XLA compile times, and
msrl's loop -> FDG -> fragments time excluding XLA (goal <= 0.5 s), cold (first in the process: it includes
JAX's one-time tracing warm-up of flax/distrax/gymnax code) and warm, with the time of each compiler phase.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from handwritten_ppo import make_train  # noqa: E402

import msrl  # noqa: E402
from msrl.config import load_config  # noqa: E402

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "ppo_cartpole.yaml"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--total-env-steps", type=int, default=500_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--lr", type=float, default=2.5e-4)
    args = ap.parse_args()

    hp = dict(num_envs=4, rollout_len=128, epochs=4, minibatches=4, lr=args.lr, anneal_lr=True)
    cfg = load_config(EXAMPLE, [f"run.total_env_steps={args.total_env_steps}", f"algorithm.lr={args.lr}",
                                "env.num_envs=4", "algorithm.rollout_len=128", "algorithm.epochs=4",
                                "algorithm.minibatches=4", "algorithm.anneal_lr=true", "policy.name=fused"])
    jax.devices()  # backend start-up is not the compiler's time

    # ---- msrl: loop -> IR -> FDG -> partition -> fragments (no XLA), cold then warm
    program = msrl.build(cfg)
    graph_cold, phases_cold = program.compile_seconds, program.timings
    program = msrl.build(cfg)
    graph_warm, phases_warm = program.compile_seconds, program.timings
    iterations = args.total_env_steps // program.env_steps_per_iteration
    session = msrl.Session(program=program, seed=0, iterations_per_dispatch=32)  # XLA compile here

    # ---- hand-written
    train = make_train(args.total_env_steps, **hp)
    key = jax.random.PRNGKey(0)
    t = time.perf_counter()
    compiled = jax.jit(train).lower(key).compile()
    hand_compile = time.perf_counter() - t

    msrl_times, hand_times, msrl_ret, hand_ret = [], [], None, None
    for _ in range(args.repeats):  # interleaved so machine noise hits both alike
        t = time.perf_counter()
        rows = session.run(iterations)
        msrl_times.append(time.perf_counter() - t)
        msrl_ret = msrl_ret if msrl_ret is not None else rows[-1]["episode_return"]
        t = time.perf_counter()
        _, metrics = jax.block_until_ready(compiled(key))
        hand_times.append(time.perf_counter() - t)
        hand_ret = float(np.asarray(metrics["episode_return"])[-1])

    steps = iterations * program.env_steps_per_iteration
    msrl_sps, hand_sps = steps / min(msrl_times), steps / min(hand_times)
    print(json.dumps({
        "benchmark": "ppo_fused",
        "env": "gymnax:CartPole-v1", "num_envs": 4, "rollout_len": 128, "epochs": 4, "minibatches": 4,
        "env_steps": steps,
        "msrl_fused_sps": round(msrl_sps),
        "handwritten_sps": round(hand_sps),
        "ratio": round(msrl_sps / hand_sps, 3),
        "ratio_median_of_pairs": round(float(np.median(np.array(hand_times) / np.array(msrl_times))), 3),
        "msrl_xla_compile_s": round(session.compile_seconds, 2),
        "handwritten_xla_compile_s": round(hand_compile, 2),
        "msrl_loop_to_fragments_s_cold": round(graph_cold, 3),
        "msrl_loop_to_fragments_s_warm": round(graph_warm, 3),
        "msrl_phases_s_cold": {k: round(v, 3) for k, v in phases_cold.items()},
        "msrl_phases_s_warm": {k: round(v, 3) for k, v in phases_warm.items()},
        "msrl_final_return_first_run": msrl_ret,
        "handwritten_final_return": hand_ret,
        "repeats": args.repeats,
        "device": str(jax.devices()[0]),
    }, indent=2))


if __name__ == "__main__":
    main()
