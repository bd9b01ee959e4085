"""msrl ``fused`` PPO vs the hand-written single-function PPO (``handwritten_ppo.py``) vs Rejax, same settings.

    python benchmarks/ppo_fused.py [--configs cartpole4,cartpole16,acrobot,pendulum] [--pairs 3]
                                   [--steps N] [--peer-python PATH | --no-peer] [--peer-msrl-xla-flag]

Every config runs the three side by side, alternating (msrl, hand-written, Rejax) ``--pairs`` times after one
warm-up run each (compile excluded), and prints one JSON object: per config the median wall SPS and CPU
seconds per million env steps of each, and the median over rounds of the per-round SPS ratios
(``msrl / rejax``, ``msrl / handwritten``; goal >= 1.0). Rejax runs in the peers' venv
(``../shared/peers/setup.sh``) through ``rejax_worker.py``. The same settings: envs, rollout, epochs,
minibatches, learning rate (constant), clipping, coefficients, and a 64x64 tanh actor and critic. Check that
the machine is quiet first: the load average is printed, before and after. msrl and the hand-written PPO run
with the XLA CPU option ``import msrl`` sets (``msrl.XLA_CPU_FLAG``); Rejax runs without it, as its users run it,
unless ``--peer-msrl-xla-flag``.
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
from handwritten_ppo import make_train  # noqa: E402
from rejax_peer import Peer, add_peer_args, peer_python, timed  # noqa: E402

from msrl.config import load_config  # noqa: E402

CONFIGS = {  # name: (gymnax env, envs, rollout, epochs, minibatches, example to start from)
    "cartpole4": ("CartPole-v1", 4, 128, 4, 4, "ppo_cartpole.yaml"),
    "cartpole16": ("CartPole-v1", 16, 128, 4, 4, "ppo_cartpole.yaml"),
    "acrobot": ("Acrobot-v1", 4, 128, 4, 4, "ppo_cartpole.yaml"),
    "pendulum": ("Pendulum-v1", 16, 128, 10, 32, "ppo_pendulum.yaml"),  # learner-heavy
}
LR, CLIP, MAX_GRAD_NORM = 2.5e-4, 0.2, 0.5


def bench(name: str, steps: int, pairs: int, python: str | None, peer_flag: bool = False) -> dict:
    env, envs, rollout, epochs, minibatches, example = CONFIGS[name]
    cfg = load_config(HERE.parent / "examples" / example, [
        f"env.id=gymnax:{env}", f"env.num_envs={envs}", f"algorithm.rollout_len={rollout}",
        f"algorithm.epochs={epochs}", f"algorithm.minibatches={minibatches}", f"algorithm.lr={LR}",
        "algorithm.anneal_lr=false", f"algorithm.clip_eps={CLIP}", f"algorithm.max_grad_norm={MAX_GRAD_NORM}",
        "algorithm.hidden=[64,64]", "algorithm.activation=tanh", "algorithm.ent_coef=0.01", "algorithm.vf_coef=0.5",
        "policy.name=fused", f"run.total_env_steps={steps}"])
    program = msrl.build(cfg)
    iterations = steps // program.env_steps_per_iteration
    steps = iterations * program.env_steps_per_iteration
    session = msrl.Session(program=program, seed=0, iterations_per_dispatch=iterations)
    sides = {"msrl": lambda: session.run(iterations)}
    if name != "pendulum":  # the hand-written PPO is discrete-only
        train = jax.jit(make_train(steps, num_envs=envs, rollout_len=rollout, epochs=epochs, minibatches=minibatches,
                                   lr=LR, anneal_lr=False, clip_eps=CLIP, max_grad_norm=MAX_GRAD_NORM, env_id=env))
        key = jax.random.PRNGKey(1)
        sides["handwritten"] = lambda: jax.block_until_ready(train(key))
    peer = None
    if python:
        peer = Peer(python, {"algo": "ppo", "env": env, "steps": steps, "config": {
            "num_envs": envs, "num_steps": rollout, "num_epochs": epochs, "num_minibatches": minibatches,
            "learning_rate": LR, "max_grad_norm": MAX_GRAD_NORM, "clip_eps": CLIP, "ent_coef": 0.01, "vf_coef": 0.5,
            "gamma": 0.99, "gae_lambda": 0.95, "agent_kwargs": {"activation": "tanh", "hidden_layer_sizes": [64, 64]}}}, peer_flag)
        sides["rejax"] = peer.run
    for side, fn in sides.items():  # warm-up (compiles)
        if side != "rejax":
            fn()
    times: dict[str, list[tuple[float, float]]] = {side: [] for side in sides}
    for _ in range(pairs):
        for side, fn in sides.items():
            times[side].append(fn() if side == "rejax" else timed(fn))
    if peer is not None:
        peer.close()
    out = {"env": f"gymnax:{env}", "num_envs": envs, "rollout_len": rollout, "epochs": epochs,
           "minibatches": minibatches, "env_steps": steps}
    for side, ts in times.items():
        out[f"{side}_sps"] = round(steps / float(np.median([w for w, _ in ts])))
        out[f"{side}_cpu_s_per_M"] = round(float(np.median([c for _, c in ts])) / steps * 1e6, 2)
    for other in ("rejax", "handwritten"):
        if other in times:  # per round: the other's wall time over msrl's
            out[f"msrl_over_{other}"] = round(float(np.median(
                [o[0] / m[0] for m, o in zip(times["msrl"], times[other])])), 3)
    return out


def main() -> None:
    from msrl.bench import count

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    ap.add_argument("--pairs", "--repeats", type=count, default=3)
    ap.add_argument("--steps", "--total-env-steps", type=count, default=500_000)
    add_peer_args(ap)
    ap.add_argument("--peer-msrl-xla-flag", action="store_true",
                    help="run Rejax with the XLA CPU option msrl sets at import (msrl.XLA_CPU_FLAG) too")
    args = ap.parse_args()
    names = args.configs.split(",")
    if unknown := [n for n in names if n not in CONFIGS]:
        ap.error(f"--configs: unknown {', '.join(unknown)}; choose from {', '.join(CONFIGS)}")
    if args.steps < (least := max(CONFIGS[n][1] * CONFIGS[n][2] for n in names)):
        ap.error(f"--steps: at least {least:,}, one iteration (envs x rollout) of each config")
    python = peer_python(args)
    load_before = os.getloadavg()[0]
    results = {name: bench(name, args.steps, args.pairs, python, args.peer_msrl_xla_flag) for name in names}
    first = next(iter(results.values()))  # its figures at the top too, for `msrl bench`
    print(json.dumps({"benchmark": "ppo_fused", "msrl_fused_sps": first["msrl_sps"],
                      "handwritten_sps": first.get("handwritten_sps"), "rejax_sps": first.get("rejax_sps"),
                      "pairs": args.pairs, "load_average_before": round(load_before, 2),
                      "load_average_after": round(os.getloadavg()[0], 2), "device": str(jax.devices()[0]),
                      "rejax": python is not None, "rejax_with_msrl_xla_flag": args.peer_msrl_xla_flag,
                      "results": results}, indent=2))


if __name__ == "__main__":
    main()
