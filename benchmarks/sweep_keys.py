"""Does every float key of the built-in algorithms sweep (``run.sweep``), each member computing its own run?

    python benchmarks/sweep_keys.py [EXAMPLE ...]      (default: the ten built-in algorithms' examples)

For every float key of each example's algorithm: a fused program sweeping the key over two values (its own and
half of it; ``run.seed_batching=sequential``) runs 2 iterations, and so does a run alone with the second value.
An off-policy example starts learning early (``learning_starts``: one iteration's transitions; with the example's
own 1000 or 2000, 2 iterations never reach the learner) and runs until an iteration learned (n-step windows wait
a few). Prints one JSON line per key: the largest difference between the second member's state and the lone run's
(0.0: bitwise), whether the last iteration learned (``learning``, where the algorithm logs it), or the ConfigError
that refused the sweep. Not a test: it takes ~15 minutes here.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import jax
import numpy as np

import msrl
from msrl.config import float_key, load_config

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
DEFAULT = ["a2c_cartpole", "dqn_cartpole", "impala_cartpole", "mappo_spread", "ppo_cartpole", "recurrent_dqn_cartpole",
           "recurrent_impala_cartpole", "recurrent_ppo_cartpole", "sac_pendulum", "td3_pendulum"]
BASE = ["policy.name=fused", "run.seed_batching=sequential"]


def state_after(path: Path, overrides: list[str], iterations: int | None = None) -> tuple[list[np.ndarray], int, Any]:
    """The state after ``iterations`` iterations (None: 2, or until the last one learned, at most 30), the count
    run, and the last row's ``learning``."""
    with msrl.Session(path, [*BASE, *overrides]) as s:
        rows = s.run(iterations or 2)
        while iterations is None and rows[-1].get("learning", 1.0) < 1.0 and s.iteration < 30:
            rows = s.run(1)
        states = [np.asarray(x, np.float64) for x in jax.tree.leaves(s.snapshot()["main"][0])]
        return states, s.iteration, rows[-1].get("learning")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("examples", nargs="*", metavar="EXAMPLE", help="an examples/ config's name")
    names = ap.parse_args().examples or DEFAULT
    if unknown := [n for n in names if not (EXAMPLES / f"{n}.yaml").is_file()]:
        known = sorted(p.stem for p in EXAMPLES.glob("*.yaml"))
        ap.error(f"unknown {', '.join(unknown)}; choose from {', '.join(known)}")
    for name in names:
        path = EXAMPLES / f"{name}.yaml"
        cfg = load_config(path, BASE)
        starts = [f"algorithm.learning_starts={cfg.env.num_envs * cfg.algorithm.rollout_len}"] \
            if hasattr(cfg.algorithm, "learning_starts") else []
        for key, field in type(cfg.algorithm).model_fields.items():
            if not float_key(field.annotation):
                continue
            value = getattr(cfg.algorithm, key)
            if value is None:  # a float or null (SAC's alpha: null learns it): swept over numbers
                value = 0.2
            other = value * 0.5 if value else 0.1
            out = {"example": name, "key": key, "values": [value, other]}
            try:
                swept, iterations, learning = state_after(path, [*starts, f"algorithm.{key}=[{value},{other}]"])
                alone, _, _ = state_after(path, [*starts, f"algorithm.{key}={other}"], iterations)
                out["iterations"] = iterations
                out["max_diff"] = max((float(np.max(np.abs(a[1] - b))) for a, b in zip(swept, alone) if b.size),
                                      default=0.0)
                if learning is not None:
                    out["learning"] = learning
            except msrl.ConfigError as e:
                out["refused"] = str(e)
            print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
