"""multi_learner (DD-PPO on CartPole) with 1, 2 and 4 learners, on the jax multi-device path and on ray.

    python benchmarks/multi_learner_scaling.py [--iterations 40] [--envs-per-learner 4] [--learners 1 2 4]

Weak scaling, as DD-PPO runs: every learner steps ``--envs-per-learner`` environments, so the batch grows
with the learners. Every configuration runs twice: as is, and with a policy that leaves the all-reduce out
(the replicas then train independently); the difference per iteration is the all-reduce's cost, reported
with the number of all-reduces per iteration (epochs x minibatches: one per gradient step).

- jax: a subprocess with ``--xla_force_host_platform_device_count`` = the largest learner count, so each
  learner gets its own (CPU) device; the replicas are one ``shard_map`` program.
- ray: one private Ray cluster; each learner a Ray actor and a JAX process; the all-reduce runs over
  ``jax.distributed`` (gloo on CPU).

Prints JSON: ms per iteration, SPS and all-reduce ms per iteration, per backend and learner count.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Literal

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "ppo_cartpole.yaml"


def _policies() -> None:
    """Register ``multi_learner_no_allreduce``: the same replicas with the all-reduce left out. msrl refuses
    learner replicas that do not average their gradients (each would learn alone and the run report one
    replica's parameters) unless the plan wraps the learner (as async's does); this one wraps it in nothing, to time
    the replicas without their all-reduce."""
    import msrl
    from msrl.policies.multi_learner import MultiLearner

    @msrl.register_policy("multi_learner_no_allreduce")
    class NoAllReduce(MultiLearner):
        name: Literal["multi_learner_no_allreduce"] = "multi_learner_no_allreduce"

        def learner_plan(self):
            return msrl.LearnerPlan(learner_replicas=self.learners, wrap=lambda learner, services: learner)


def measure(backend: str, learners: int, envs_per_learner: int, iterations: int, all_reduce: bool) -> dict:
    import msrl
    from msrl.config import load_config

    name = "multi_learner" if all_reduce else "multi_learner_no_allreduce"
    overrides = [f"policy.name={name}", f"policy.backend={backend}", f"policy.learners={learners}",
                 f"policy.envs_per_learner={envs_per_learner}"]
    if backend == "ray":  # 4 learners on a 2-core machine
        overrides.append("policy.resources.learner.num_cpus=0.5")
    cfg = load_config(EXAMPLE, overrides)
    program = msrl.build(cfg)
    with msrl.Session(program=program, seed=0, iterations_per_dispatch=10) as session:
        session.run(3)  # compiled, warm
        t = time.perf_counter()
        session.run(iterations)
        seconds = (time.perf_counter() - t) / iterations
    return {"ms_per_iteration": 1000 * seconds, "sps": program.env_steps_per_iteration / seconds}


def sweep(backend: str, args: argparse.Namespace) -> dict:
    from msrl.config import load_config

    algo = load_config(EXAMPLE).algorithm
    out = {}
    for n in args.learners:
        on = measure(backend, n, args.envs_per_learner, args.iterations, True)
        off = measure(backend, n, args.envs_per_learner, args.iterations, False) if n > 1 else on
        out[str(n)] = {**on, "no_allreduce_ms_per_iteration": off["ms_per_iteration"],
                       "allreduce_ms_per_iteration": on["ms_per_iteration"] - off["ms_per_iteration"],
                       "allreduces_per_iteration": algo.epochs * algo.minibatches if n > 1 else 0}
    return out


def main() -> None:
    from msrl.bench import count

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iterations", type=count, default=40)
    p.add_argument("--envs-per-learner", type=count, default=4)
    p.add_argument("--learners", type=count, nargs="+", default=[1, 2, 4])
    p.add_argument("--only", choices=["jax", "ray"], help=argparse.SUPPRESS)  # the jax subprocess
    args = p.parse_args()
    _policies()
    if args.only == "jax":
        print(json.dumps(sweep("jax", args)))
        return
    load_before = round(os.getloadavg()[0], 2)
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={max(args.learners)}"}
    out = subprocess.run([sys.executable, __file__, "--only", "jax", "--iterations", str(args.iterations),
                          "--envs-per-learner", str(args.envs_per_learner), "--learners", *map(str, args.learners)],
                         env=env, capture_output=True, text=True, check=False)
    if out.returncode:
        sys.exit(out.stderr[-3000:])
    result = {"benchmark": "multi_learner_scaling", "load_average_before": load_before,
              "config": {"iterations": args.iterations, "envs_per_learner": args.envs_per_learner,
                         "cpus": os.cpu_count()},
              "jax_devices": json.loads(out.stdout.strip().splitlines()[-1])}

    import logging

    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(address="local", num_cpus=max(4, os.cpu_count() or 1), include_dashboard=False,
             logging_level=logging.ERROR, log_to_driver=False)
    try:
        result["ray"] = sweep("ray", args)
    finally:
        ray.shutdown()
    print(json.dumps({**result, "load_average_after": round(os.getloadavg()[0], 2)}, indent=2))


if __name__ == "__main__":
    main()
