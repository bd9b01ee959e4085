"""Wall time of N seeds of ``fused`` PPO in one program (``run.num_seeds``) against one seed.

    python benchmarks/seeds_fused.py [--seeds 8] [--steps 204800] [--pairs 3] [--seed-batching auto|vmap|sequential]
                                     [--one-device]

PPO on gymnax CartPole-v1 with examples/ppo_cartpole.yaml's settings (4 envs). One warm-up each (compile
excluded), then ``--pairs`` alternating rounds; prints JSON with the median wall time of each and the median
per-round ratio ``n_seeds_over_one`` (goal <= 2.5 for 8 seeds), and the load average. Where the peers' venv is
there (``../shared/peers/setup.sh``), Rejax runs beside it with the same settings, its seeds ``vmap``ped as its
users run them: ``rejax_n_seeds_over_one`` says what the same hardware gives the peer.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

import msrl  # first: it sets msrl's XLA CPU option

import jax
from msrl.config import load_config
from msrl.sweep import spread_over_cores
from rejax_peer import Peer, add_peer_args, peer_python

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "ppo_cartpole.yaml"


def main() -> None:
    from msrl.bench import count

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=count, default=8)
    ap.add_argument("--steps", type=count, default=204_800)
    ap.add_argument("--pairs", type=count, default=3)
    ap.add_argument("--seed-batching", default="auto", choices=["auto", "vmap", "sequential"])
    add_peer_args(ap)
    ap.add_argument("--one-device", action="store_true", help="keep JAX's one CPU device (msrl train gives a run "
                    "of several seeds one per core, and its program splits them over those)")
    args = ap.parse_args()
    devices = None if args.one_device else spread_over_cores(load_config(EXAMPLE, [f"run.num_seeds={args.seeds}"]))
    load_before = os.getloadavg()[0]
    sides = {}
    for n in (1, args.seeds):
        # the session's whole length (warm-up and pairs), and a constant lr as Rejax's: no note of running past it
        s = msrl.Session(EXAMPLE, ["policy.name=fused", f"run.total_env_steps={args.steps * (args.pairs + 1)}",
                                    "algorithm.anneal_lr=false", f"run.num_seeds={n}",
                                    f"run.seed_batching={args.seed_batching}"],
                         iterations_per_dispatch=args.steps // 512)
        s.run(args.steps // 512)  # warm-up

        def run(s=s):
            t = time.perf_counter()
            s.run(args.steps // 512)
            return time.perf_counter() - t

        sides[("msrl", n)] = run
    python, peers = peer_python(args), []
    if python:
        a = s.config.algorithm
        for n in (1, args.seeds):
            peers.append(Peer(python, {"algo": "ppo", "env": "CartPole-v1", "steps": args.steps, "seeds": n, "config": {
                "num_envs": s.config.env.num_envs, "num_steps": a.rollout_len, "num_epochs": a.epochs,
                "num_minibatches": a.minibatches, "learning_rate": a.lr, "max_grad_norm": a.max_grad_norm,
                "clip_eps": a.clip_eps, "ent_coef": a.ent_coef, "vf_coef": a.vf_coef, "gamma": a.gamma,
                "gae_lambda": a.gae_lambda, "agent_kwargs": {"activation": a.activation,
                                                             "hidden_layer_sizes": a.hidden}}}))
            sides[("rejax", n)] = lambda peer=peers[-1]: peer.run()[0]
    times: dict[tuple, list[float]] = {side: [] for side in sides}
    for _ in range(args.pairs):
        for side, fn in sides.items():
            times[side].append(fn())
    for peer in peers:
        peer.close()
    out = {"benchmark": "seeds_fused", "seeds": args.seeds, "seed_batching": args.seed_batching,
           "env_steps_per_seed": args.steps, "device": str(jax.devices()[0]),
           "msrl_cpu_devices": (devices or 1) if jax.default_backend() == "cpu" else None}
    for name in ("msrl", "rejax"):
        if (name, 1) not in times:
            continue
        one, many = times[(name, 1)], times[(name, args.seeds)]
        prefix = "" if name == "msrl" else "rejax_"
        out.update({f"{prefix}one_seed_s": round(float(np.median(one)), 3),
                    f"{prefix}n_seeds_s": round(float(np.median(many)), 3),
                    f"{prefix}n_seeds_over_one": round(float(np.median([m / o for m, o in zip(many, one)])), 3)})
    out.update(load_average_before=round(load_before, 2), load_average_after=round(os.getloadavg()[0], 2))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
