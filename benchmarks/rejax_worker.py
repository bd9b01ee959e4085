"""Times Rejax training for a benchmark in ``benchmarks/``: run it with the peers' venv python
(``bash ../shared/peers/setup.sh`` prints it), which holds Rejax and the gymnax it needs.

    PEER_PYTHON rejax_worker.py '{"algo": "ppo", "env": "CartPole-v1", "steps": 204800, "config": {...}}'

(``"seeds": N`` in the spec: N seeds at once, the training ``vmap``ped over N keys.)

It compiles and runs the training once (without Rejax's evaluation), prints ``{"ready": ...}``, then for every line ``run`` on stdin trains
once more (a new seed) and prints ``{"wall_s": ..., "cpu_s": ...}`` (this process's CPU time), so that a
benchmark can alternate it with its own runs. It exits at the end of stdin.
"""

import json
import sys
import time

import jax
import rejax


def main() -> None:
    spec = json.loads(sys.argv[1])
    algo = rejax.get_algo(spec["algo"]).create(env=spec["env"], total_timesteps=spec["steps"],
                                               eval_freq=spec["steps"], skip_initial_evaluation=True,
                                               **spec["config"])
    # training only: Rejax's one evaluation at the end (128 episodes) is not timed
    algo = algo.replace(eval_callback=lambda algo, ts, rng: (jax.numpy.zeros(1), jax.numpy.zeros(1)))
    seeds = spec.get("seeds", 1)  # several: Rejax's own way, the training vmapped over that many keys
    train = jax.jit(algo.train if seeds == 1 else lambda key: jax.vmap(algo.train)(jax.random.split(key, seeds)))
    t = time.perf_counter()
    jax.block_until_ready(train(jax.random.PRNGKey(0)))
    print(json.dumps({"ready": True, "first_run_s": time.perf_counter() - t}), flush=True)
    seed = 0
    for line in sys.stdin:
        if line.strip() != "run":
            continue
        seed += 1
        t, c = time.perf_counter(), time.process_time()
        jax.block_until_ready(train(jax.random.PRNGKey(seed)))
        print(json.dumps({"wall_s": time.perf_counter() - t, "cpu_s": time.process_time() - c}), flush=True)


if __name__ == "__main__":
    main()
