"""How far can seeds batched on this machine's CPU cores go below "N seeds take N/cores times one seed"? A lower
bound from the learner alone.

    python benchmarks/seeds_learner_share.py [--seeds-per-core 4] [--steps 204800] [--repeats 5]

PPO CartPole with examples/ppo_cartpole.yaml's settings (4 envs x 128 steps, 4 epochs x 4 minibatches), ``fused``.
Times, in ms per iteration (512 env steps): one seed's whole program; its learner's update alone (``learn`` on a
batch of the iteration's shape, in a jitted loop); and ``--seeds-per-core`` learners ``vmap``ped in one program (what
each core runs of 8 seeds on 2 cores). Since every seed's learner must run, ``seeds_learner_over_one_seed`` (the
vmapped learners over one seed's whole iteration) bounds below the wall-time ratio ``benchmarks/seeds_fused.py``
measures, whatever the rollout costs. Prints JSON with the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import msrl  # first: it sets msrl's XLA CPU option

import jax
import jax.numpy as jnp

from msrl.config import load_config

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "ppo_cartpole.yaml"
LOOPS = 100


def ms_per_call(fn, repeats: int) -> float:
    jax.block_until_ready(fn())  # compiles
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    from msrl.bench import count

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds-per-core", type=count, default=4)
    ap.add_argument("--steps", type=count, default=204_800)
    ap.add_argument("--repeats", type=count, default=5)
    args = ap.parse_args()
    load_before = os.getloadavg()[0]
    config = load_config(EXAMPLE, ["policy.name=fused", f"run.total_env_steps={args.steps}"])
    program = msrl.build(config)
    iterations = args.steps // program.env_steps_per_iteration
    session = msrl.Session(program=program, seed=0, iterations_per_dispatch=iterations)
    whole = ms_per_call(lambda: session.run(iterations), args.repeats) / iterations

    learner, cfg = program.algorithm.learner, config.algorithm
    envs, obs_shape = program.num_envs, program.env.spec.obs_shape
    from msrl.algorithms.ppo.ppo import Transition

    def batch(key):  # one iteration's rollout, as the buffer hands it to the learner ([time, env, ...])
        t, n = cfg.rollout_len, envs
        return Transition(jax.random.normal(key, (t, n, *obs_shape)), jax.random.randint(key, (t, n), 0, 2),
                          jnp.ones((t, n)), jax.random.uniform(key, (t, n)) < 0.05, -jnp.ones((t, n)), jnp.zeros((t, n)))

    def learners(seeds: int):
        keys = jax.random.split(jax.random.PRNGKey(0), seeds)
        data, state = jax.vmap(batch)(keys), jax.vmap(learner.init)(keys)
        update = lambda s, b: learner.learn(s, b, b.obs[-1])[0]  # noqa: E731
        if seeds == 1:  # one learner as the fused program runs it, not a vmap of one
            data, state = jax.tree.map(lambda x: x[0], (data, state))
        else:
            update = jax.vmap(update)
        run = jax.jit(lambda s: jax.lax.fori_loop(0, LOOPS, lambda _, s: update(s, data), s))
        return ms_per_call(lambda: run(state), args.repeats) / LOOPS

    one, many = learners(1), learners(args.seeds_per_core)
    print(json.dumps({"benchmark": "seeds_learner_share", "seeds_per_core": args.seeds_per_core,
                      "one_seed_iteration_ms": round(whole, 3), "one_learner_ms": round(one, 3),
                      "learner_share_of_one_seed": round(one / whole, 3),
                      "seeds_learners_ms": round(many, 3), "seeds_learners_over_one_learner": round(many / one, 2),
                      "seeds_learner_over_one_seed": round(many / whole, 2),
                      "load_average_before": round(load_before, 2), "load_average_after": round(os.getloadavg()[0], 2)},
                     indent=2))


if __name__ == "__main__":
    main()
