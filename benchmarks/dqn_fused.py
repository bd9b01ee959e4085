"""msrl ``fused`` DQN vs Rejax DQN on gymnax CartPole-v1, same settings, side by side.

    python benchmarks/dqn_fused.py [--steps 200000] [--pairs 3] [--envs 8] [--peer-python PATH | --no-peer]

Both: ``--envs`` envs stepped once per iteration, 2 gradient updates per iteration on batches of 128 from a
100k-transition uniform replay (training from 1,000 transitions), double DQN with 1-step targets, a hard
target copy every 1,000 env steps, a 64x64 ReLU Q-network, adam at a constant 1e-3, linear epsilon 1 -> 0.05.
One warm-up run each (compile excluded), then ``--pairs`` alternating rounds; prints JSON with the median
wall SPS, CPU seconds per million env steps, the median of the per-round ratios (``msrl_over_rejax``; goal
>= 1.0) and the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import msrl  # first: it sets an XLA CPU option that counts only before JAX starts its backend

import jax
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from rejax_peer import Peer, add_peer_args, peer_python, timed  # noqa: E402

from msrl.config import load_config  # noqa: E402

BATCH, BUFFER, STARTS, LR, TARGET_EVERY_STEPS, UPDATES = 128, 100_000, 1_000, 1e-3, 1_000, 2


def main() -> None:
    from msrl.bench import count

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=count, default=200_000)
    ap.add_argument("--pairs", type=count, default=3)
    ap.add_argument("--envs", type=count, default=8)
    add_peer_args(ap)
    args = ap.parse_args()
    if args.steps < 2 * STARTS:
        ap.error(f"--steps: at least {2 * STARTS:,} (learning starts after {STARTS:,} transitions)")
    load_before = os.getloadavg()[0]
    steps, envs = args.steps // args.envs * args.envs, args.envs
    cfg = load_config(HERE.parent / "examples" / "dqn_cartpole.yaml", [
        f"env.num_envs={envs}", "algorithm.rollout_len=1", f"algorithm.updates={UPDATES}",
        f"algorithm.batch_size={BATCH}", f"algorithm.buffer_size={BUFFER}", f"algorithm.learning_starts={STARTS}",
        f"algorithm.lr={LR}", "algorithm.anneal_lr=false", "algorithm.n_step=1", "algorithm.double=true",
        f"algorithm.target_update_every={TARGET_EVERY_STEPS // envs * UPDATES}", "algorithm.tau=1.0",
        "algorithm.hidden=[64,64]", "algorithm.eps_end=0.05", f"algorithm.eps_decay_steps={steps // 10}",
        "algorithm.prioritized=false", "policy.name=fused", f"run.total_env_steps={steps}"])
    program = msrl.build(cfg)
    iterations = steps // program.env_steps_per_iteration
    session = msrl.Session(program=program, seed=0, iterations_per_dispatch=iterations)
    sides = {"msrl": lambda: timed(lambda: session.run(iterations))}
    python = peer_python(args)
    peer = None
    if python:
        peer = Peer(python, {"algo": "dqn", "env": "CartPole-v1", "steps": steps, "config": {
            "num_envs": envs, "num_epochs": UPDATES, "batch_size": BATCH, "buffer_size": BUFFER,
            "fill_buffer": STARTS, "learning_rate": LR, "max_grad_norm": 10.0, "ddqn": True,
            "target_update_freq": TARGET_EVERY_STEPS, "polyak": 0.0, "eps_start": 1.0, "eps_end": 0.05,
            "exploration_fraction": 0.1, "gamma": 0.99, "agent_kwargs": {"activation": "relu"}}})
        sides["rejax"] = peer.run
    sides["msrl"]()  # warm-up
    times: dict[str, list[tuple[float, float]]] = {side: [] for side in sides}
    for _ in range(args.pairs):
        for side, fn in sides.items():
            times[side].append(fn())
    if peer is not None:
        peer.close()
    out = {"benchmark": "dqn_fused", "env": "gymnax:CartPole-v1", "num_envs": envs, "updates_per_iteration": UPDATES,
           "batch_size": BATCH, "env_steps": steps, "pairs": args.pairs}
    for side, ts in times.items():
        out[f"{side}_sps"] = round(steps / float(np.median([w for w, _ in ts])))
        out[f"{side}_cpu_s_per_M"] = round(float(np.median([c for _, c in ts])) / steps * 1e6, 2)
    if "rejax" in times:
        out["msrl_over_rejax"] = round(float(np.median([r[0] / m[0] for m, r in zip(times["msrl"], times["rejax"])])), 3)
    out.update(load_average_before=round(load_before, 2), load_average_after=round(os.getloadavg()[0], 2),
               device=str(jax.devices()[0]), rejax=python is not None)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
