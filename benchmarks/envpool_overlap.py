"""Does overlapping EnvPool's stepping with the actor's inference pay on this machine? An actor's loop alone (no
learner): CartPole-v1 in EnvPool with actions from a jitted 64-64 tanh MLP, or Breakout-v5 (84x84x4 uint8 frames)
with the Nature CNN (``msrl.rl.NatureCNN``, as examples/ppo_breakout_envpool.yaml), three ways, alternating:

- ``sync``: one pool of N envs; each step acts on all N observations, then ``pool.step`` (what msrl's host actors do);
- ``halves``: two pools of N/2 in EnvPool's asynchronous mode; while one half's envs step in EnvPool's threads, the
  actor acts for the other half (deterministic: what msrl could offer, as two replicas per actor);
- ``ready_half``: EnvPool's own asynchronous recipe, one pool of N with ``batch_size=N/2``: receive whichever half
  is ready, act on it, send it back (which envs share a batch depends on timing).

    python benchmarks/envpool_overlap.py [--env cartpole|breakout] [--envs 8,16,64] [--steps 3000] [--pairs 3]

Prints JSON: per N the median env steps per second of each and each overlapped way's median per-round ratio to
``sync`` (> 1: overlap pays), and the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import warnings

import envpool
import jax
import jax.numpy as jnp
import numpy as np

warnings.filterwarnings("ignore", module="gymnasium")


ENVS = {"cartpole": ("CartPole-v1", (4,), np.float32, 2), "breakout": ("Breakout-v5", (4, 84, 84), np.uint8, 4)}


def actor(env: str):
    """A jitted ``act(obs) -> actions`` (numpy in, numpy out) for ``env``: a 64-64 tanh MLP, or the Nature CNN."""
    _, obs_shape, obs_dtype, actions = ENVS[env]
    if env == "breakout":
        from msrl.rl import NatureCNN

        net = NatureCNN(action_dim=actions, discrete=True)
    else:
        from msrl.rl import ActorCritic

        net = ActorCritic(action_dim=actions, discrete=True, obs_ndim=1)
    params = net.init(jax.random.PRNGKey(0), jnp.zeros((1, *obs_shape), obs_dtype))

    @jax.jit
    def act(obs, key):
        return jax.random.categorical(key, net.apply(params, obs)[0])

    return lambda obs, key=jax.random.PRNGKey(0): np.asarray(act(jnp.asarray(obs), key))


def sync(act, env: str, n: int, steps: int) -> float:
    pool = envpool.make(ENVS[env][0], env_type="gymnasium", num_envs=n, seed=0)
    obs, _ = pool.reset()
    act(obs)  # compiles
    t = time.perf_counter()
    for _ in range(steps):
        obs = pool.step(act(obs))[0]
    return n * steps / (time.perf_counter() - t)


def halves(act, env: str, n: int, steps: int) -> float:
    half, ids = n // 2, np.arange(n // 2)
    pools = [envpool.make(ENVS[env][0], env_type="gymnasium", num_envs=half, batch_size=half, seed=s) for s in (0, 1)]
    for pool in pools:
        pool.async_reset()
    obs = [pool.recv()[0] for pool in pools]
    act(obs[0])
    t = time.perf_counter()
    pools[0].send(act(obs[0]), ids)
    for step in range(steps):
        pools[1].send(act(obs[1]), ids)  # half 1's actions computed while half 0 steps, and so on
        obs[0] = pools[0].recv()[0]
        if step < steps - 1:
            pools[0].send(act(obs[0]), ids)
        obs[1] = pools[1].recv()[0]
    return n * steps / (time.perf_counter() - t)


def ready_half(act, env: str, n: int, steps: int) -> float:
    pool = envpool.make(ENVS[env][0], env_type="gymnasium", num_envs=n, batch_size=n // 2, seed=0)
    pool.async_reset()
    act(np.zeros((n // 2, *ENVS[env][1]), ENVS[env][2]))  # compiles
    t = time.perf_counter()
    for _ in range(2 * steps):
        obs, *_, info = pool.recv()
        pool.send(act(obs), info["env_id"])
    return n * steps / (time.perf_counter() - t)


def main() -> None:
    from msrl.bench import count

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--env", default="cartpole", choices=list(ENVS))
    ap.add_argument("--envs", default=[8, 16, 64], type=lambda text: [count(n) for n in text.split(",")],
                    help="pool sizes, comma-separated (default 8,16,64)")
    ap.add_argument("--steps", type=count, default=3000)
    ap.add_argument("--pairs", type=count, default=3)
    args = ap.parse_args()
    load_before, act, results = os.getloadavg()[0], actor(args.env), {}
    sides = {"sync": sync, "halves": halves, "ready_half": ready_half}
    for n in args.envs:
        rounds = []
        for r in range(args.pairs):
            order = list(sides) if r % 2 == 0 else list(sides)[::-1]
            rounds.append({side: sides[side](act, args.env, n, args.steps) for side in order})
        out = {f"{side}_sps": round(statistics.median(x[side] for x in rounds)) for side in sides}
        for side in ("halves", "ready_half"):
            out[f"{side}_over_sync"] = round(statistics.median(x[side] / x["sync"] for x in rounds), 2)
        results[n] = out
    print(json.dumps({"benchmark": "envpool_overlap", "env": ENVS[args.env][0], "steps": args.steps, "pairs": args.pairs,
                      "load_average_before": round(load_before, 2), "load_average_after": round(os.getloadavg()[0], 2),
                      "envs": results}, indent=2))


if __name__ == "__main__":
    main()
