"""The return of a uniform random policy on a multi-agent environment: the baseline MAPPO is measured against.

    python benchmarks/mappo_random.py [--env jaxmarl:MPE_simple_spread_v3] [--agents 3] [--episodes 4096]

Every agent picks one of its actions uniformly at random at every step, in ``--envs`` environments at once
(through msrl's adapter, so rewards and episode ends are those training sees). Prints JSON: the mean and
standard deviation of the completed episodes' returns (the shared reward, summed over an episode), and the
return that is 30 % of the way from it to 0 (MAPPO's acceptance bar; returns are negative).
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from msrl.envs import make_env


def random_returns(env_id: str, kwargs: dict, episodes: int, envs: int, seed: int = 0) -> np.ndarray:
    """Returns of at least ``episodes`` completed episodes under uniform random actions."""
    env = make_env(env_id, **kwargs)
    spec = env.spec
    if not spec.discrete:
        raise SystemExit(f"{env_id}: this baseline draws discrete actions only")

    @jax.jit
    def run(state, key, running):
        def step(carry, key):
            state, running = carry
            action = jax.random.randint(key, (envs, spec.num_agents), 0, spec.action_space.n)
            state, (_, reward, done) = env.step(state, action)
            running = running + reward
            return (state, jnp.where(done, 0.0, running)), (jnp.where(done, running, jnp.nan))

        (state, running), ends = jax.lax.scan(step, (state, running), jax.random.split(key, 256))
        return state, running, ends

    key = jax.random.PRNGKey(seed)
    state = env.init(key, jnp.arange(envs))
    running, returns = jnp.zeros(envs), []
    while sum(len(r) for r in returns) < episodes:
        key, use = jax.random.split(key)
        state, running, ends = run(state, use, running)
        ends = np.asarray(ends).ravel()
        returns.append(ends[np.isfinite(ends)])
    return np.concatenate(returns)


def main() -> None:
    from msrl.bench import count

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--env", default="jaxmarl:MPE_simple_spread_v3")
    ap.add_argument("--agents", type=count, default=3, help="num_agents and num_landmarks of the env")
    ap.add_argument("--episodes", type=count, default=4096, help="at least this many (whole batches of --envs run)")
    ap.add_argument("--envs", type=count, default=256)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    kwargs = {"num_agents": args.agents, "num_landmarks": args.agents}
    returns = random_returns(args.env, kwargs, args.episodes, args.envs, args.seed)
    mean = float(returns.mean())
    print(json.dumps({
        "benchmark": "mappo_random", "env": args.env, "env_kwargs": kwargs, "episodes": int(returns.size),
        "random_return_mean": round(mean, 3), "random_return_std": round(float(returns.std()), 3),
        "return_30pct_better": round(0.7 * mean if mean < 0 else 1.3 * mean, 3),
    }, indent=2))


if __name__ == "__main__":
    main()
