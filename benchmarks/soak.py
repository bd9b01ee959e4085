"""Soak: PPO on Ray (single_learner_coarse) for a long time, watching memory.

    python benchmarks/soak.py [--minutes 10] [--every 10]

Every ``every`` seconds it samples the resident memory (RSS) of every process of the run (this driver and
every process of the private Ray cluster: GCS, raylet, our actors...) and the object store's usage. The
first sample is taken after a warm-up minute (compilation, caches filling). Prints JSON: per process kind
and in total, RSS at start, end and max, growth end/start, and the object store's start/end/max bytes.
Goal: total growth <= 5 %.
"""

from __future__ import annotations

import argparse
import json
import logging
import threading
import time
from collections import defaultdict
from pathlib import Path

import psutil

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "ppo_cartpole.yaml"
WARMUP_S = 60


def kind(proc: psutil.Process) -> str:
    try:
        cmd = " ".join(proc.cmdline())
    except psutil.Error:
        return "gone"
    for name in ("gcs_server", "raylet", "FragmentWorker", "dashboard", "log_monitor", "runtime_env", "monitor"):
        if name in cmd:
            return name
    return "driver" if proc.pid == psutil.Process().pid else "ray:" + (proc.name() or "?")


def rss_by_kind() -> dict[str, int]:
    me = psutil.Process()
    out: dict[str, int] = defaultdict(int)
    for proc in [me, *me.children(recursive=True)]:
        try:
            out[kind(proc)] += proc.memory_info().rss
        except psutil.Error:
            continue
    return dict(out)


def object_store_used() -> int:
    import ray

    total = ray.cluster_resources().get("object_store_memory", 0)
    free = ray.available_resources().get("object_store_memory", 0)
    return int(total - free)


def main() -> None:
    import ray

    import msrl
    from msrl.config import load_config

    from msrl.bench import positive

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=positive, default=10.0)
    parser.add_argument("--every", type=positive, default=10.0)
    args = parser.parse_args()

    ray.init(address="local", include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False, num_cpus=4)
    cfg = load_config(EXAMPLE, ["policy.name=single_learner_coarse", "policy.backend=ray", "policy.actors=2",
                                "run.total_env_steps=10000000000"])
    session = msrl.Session(cfg, seed=0, iterations_per_dispatch=16)
    samples: list[tuple[float, dict[str, int], int]] = []
    stop = threading.Event()
    iterations = 0

    def sampler() -> None:
        stop.wait(WARMUP_S)
        while not stop.is_set():
            samples.append((time.time(), rss_by_kind(), object_store_used()))
            stop.wait(args.every)

    thread = threading.Thread(target=sampler, daemon=True)
    end = time.time() + WARMUP_S + args.minutes * 60
    thread.start()
    try:
        while time.time() < end:
            iterations += len(session.run(16))
    finally:
        stop.set()
        thread.join()
        samples.append((time.time(), rss_by_kind(), object_store_used()))
        session.close()
        ray.shutdown()

    kinds = sorted({k for _, rss, _ in samples for k in rss})
    per_kind = {}
    for k in kinds:
        series = [rss.get(k, 0) for _, rss, _ in samples]
        per_kind[k] = {"start_mb": series[0] / 2**20, "end_mb": series[-1] / 2**20, "max_mb": max(series) / 2**20}
    total = [sum(rss.values()) for _, rss, _ in samples]
    store = [s for _, _, s in samples]
    print(json.dumps({
        "minutes": (samples[-1][0] - samples[0][0]) / 60, "samples": len(samples), "iterations": iterations,
        "total_rss_mb": {"start": total[0] / 2**20, "end": total[-1] / 2**20, "max": max(total) / 2**20,
                         "growth": total[-1] / total[0] - 1},
        "object_store_bytes": {"start": store[0], "end": store[-1], "max": max(store)},
        "per_kind": per_kind}, indent=2, default=float))


if __name__ == "__main__":
    main()
