"""Replay latency: insert throughput and prioritized-sample latency at 1M stored items.

    python benchmarks/replay_latency.py [--capacity 1000000] [--insert-batch 1024] [--batch 256] [--samples 500]

Item: a CartPole transition (obs 4 float32, action int32, reward float32, done bool, next_obs 4 float32).
Each setting fills a prioritized buffer of ``capacity`` items with batched inserts (``insert-batch``
transitions per call), then times ``samples`` prioritized samples of ``batch`` items one by one (each
waited for) and as many priority updates. Prints JSON: one key per setting —
``in_process`` (msrl's PrioritizedBuffer, jitted with the state donated), ``flashbax`` (flashbax's
prioritised flat buffer, the same sizes, jitted the same way), and the buffer as a replay server:
``threads_server`` (in another thread, as the threads backend places a replay_server shard) and
``ray_server`` (in a Ray actor, as the ray backend does). For the servers a sample is timed as the client
sees it (request, sample, answer back); ``in_server_sample_plus_update_ms`` is the part spent inside the
buffer, so the rest is the transport.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from msrl.replay import PrioritizedBuffer


class Transition(NamedTuple):
    obs: jax.Array
    action: jax.Array
    reward: jax.Array
    done: jax.Array
    next_obs: jax.Array


def transitions(n: int, seed: int = 0) -> Transition:
    k = jax.random.split(jax.random.PRNGKey(seed), 3)
    return Transition(jax.random.normal(k[0], (n, 4)), jax.random.randint(k[1], (n,), 0, 2),
                      jnp.ones((n,)), jnp.zeros((n,), bool), jax.random.normal(k[2], (n, 4)))


def _ms(samples: list[float]) -> dict[str, float]:
    return {"p50_ms": round(float(np.percentile(samples, 50)) * 1e3, 4),
            "p99_ms": round(float(np.percentile(samples, 99)) * 1e3, 4)}


def measure(state: Any, insert: Callable, sample: Callable, update: Callable, items: Transition, capacity: int,
            samples: int) -> dict[str, Any]:
    """Fill to ``capacity`` with ``insert(state, items)``, timing it; then time ``sample(state)`` and
    ``update(state, sampled)`` one call at a time."""
    per_call = items.reward.shape[0]
    state = jax.block_until_ready(insert(state, items))  # compile
    calls = capacity // per_call
    t = time.perf_counter()
    for _ in range(calls):
        state = insert(state, items)
    jax.block_until_ready(state)
    insert_s = time.perf_counter() - t
    state, out = jax.block_until_ready(sample(state))  # compile
    state = jax.block_until_ready(update(state, out))
    sample_t, update_t = [], []
    for _ in range(samples):
        t = time.perf_counter()
        state, out = jax.block_until_ready(sample(state))
        sample_t.append(time.perf_counter() - t)
        t = time.perf_counter()
        state = jax.block_until_ready(update(state, out))
        update_t.append(time.perf_counter() - t)
    return {"stored": (calls + 1) * per_call, "insert_transitions_per_s": round((calls * per_call) / insert_s),
            "sample": _ms(sample_t), "update": _ms(update_t)}


def in_process(capacity: int, insert_batch: int, batch: int, samples: int) -> dict[str, Any]:
    """msrl's PrioritizedBuffer in this process, every call jitted with the state donated. Inserts are rows
    of one transition each (width 1), so ``insert_batch`` rows per call."""
    buf = PrioritizedBuffer(capacity, alpha=0.6, beta=0.4)
    items = jax.tree.map(lambda x: x[:, None], transitions(insert_batch))  # [rows, width 1, ...]
    state = buf.init(jax.random.PRNGKey(0), jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), items))
    insert = jax.jit(buf.insert_batch, donate_argnums=0)
    sample = jax.jit(lambda s: buf.sample(s, batch), donate_argnums=0)
    update = jax.jit(lambda s, out: buf.update(s, out.indices, jnp.abs(out.item.reward) + out.indices % 7),
                     donate_argnums=0)
    return {"impl": "msrl.replay.PrioritizedBuffer", "jax": jax.__version__,
            **measure(state, insert, sample, update, items, capacity, samples)}


def flashbax(capacity: int, insert_batch: int, batch: int, samples: int) -> dict[str, Any]:
    """flashbax's prioritised flat buffer, same sizes, every call jitted with the state donated."""
    try:
        import flashbax as fbx
    except ImportError as e:
        return {"error": f"flashbax not installed ({e}); pip install flashbax, or pip install -e '.[bench]'"}
    from importlib.metadata import version

    with warnings.catch_warnings():  # it says min_length is raised to the sequence length (2): as intended
        warnings.simplefilter("ignore", UserWarning)
        buf = fbx.make_prioritised_flat_buffer(max_length=capacity, min_length=batch, sample_batch_size=batch,
                                               add_batch_size=insert_batch, priority_exponent=0.6)
    items = transitions(insert_batch)
    state = (buf.init(jax.tree.map(lambda x: x[0], items)), jax.random.PRNGKey(1))  # its sampling key beside it

    def sample(s):
        key, use = jax.random.split(s[1])
        return (s[0], key), buf.sample(s[0], use)

    def update(s, out):
        return buf.set_priorities(s[0], out.indices, jnp.abs(out.experience.first.reward) + out.indices % 7), s[1]

    insert = jax.jit(lambda s, items: (buf.add(s[0], items), s[1]), donate_argnums=0)
    sample, update = jax.jit(sample, donate_argnums=0), jax.jit(update, donate_argnums=0)
    return {"impl": "flashbax.make_prioritised_flat_buffer", "version": version("flashbax"),
            **measure(state, insert, sample, update, items, capacity, samples)}


class _Server:
    """A replay shard: msrl's PrioritizedBuffer and its jitted calls, as the replay_server policy holds one
    (state donated, results numpy for the wire). ``handle`` serves one request."""

    def __init__(self, capacity: int, insert_batch: int, batch: int):
        self.buf = PrioritizedBuffer(capacity, alpha=0.6, beta=0.4)
        items = jax.tree.map(lambda x: x[:, None], transitions(insert_batch))
        spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), items)
        self.state = self.buf.init(jax.random.PRNGKey(0), spec)
        self._insert = jax.jit(self.buf.insert_batch, donate_argnums=0)
        self._sample = jax.jit(lambda s: self.buf.sample(s, batch), donate_argnums=0)
        self._update = jax.jit(self.buf.update, donate_argnums=0)
        self.busy = 0.0  # seconds spent inside the buffer's calls

    def handle(self, op: str, *args: Any) -> Any:
        t = time.perf_counter()
        if op == "insert":
            self.state = self._insert(self.state, jax.tree.map(lambda x: x[:, None], Transition(*args[0])))
            out = None
        elif op == "sample":
            self.state, sample = self._sample(self.state)
            out = jax.tree.map(np.asarray, sample)
        elif op == "update":
            self.state = self._update(self.state, *args)
            out = None
        else:  # "sync": wait for everything queued
            out = int(jax.block_until_ready(self.state).count)
        self.busy += time.perf_counter() - t
        return out

    def busy_s(self) -> float:
        return self.busy


def remote(call: Callable, post: Callable, capacity: int, insert_batch: int, batch: int, samples: int) -> dict:
    """Time a server through ``call(op, *args)`` (a round trip: the answer) and ``post(op, *args)`` (one way,
    not waited for): inserts posted back to back until ``capacity`` is stored, then ``samples`` sample
    round trips, each followed by a posted priority update."""
    items = tuple(np.asarray(x) for x in transitions(insert_batch))
    call("insert", items)
    call("sync")  # compiled
    calls = capacity // insert_batch
    t = time.perf_counter()
    for _ in range(calls):
        post("insert", items)
    stored = call("sync")
    insert_s = time.perf_counter() - t
    out = call("sample")
    call("update", out.indices, np.abs(out.item.reward) + out.indices % 7)
    busy0 = call("busy")
    sample_t = []
    for _ in range(samples):
        t = time.perf_counter()
        out = call("sample")
        sample_t.append(time.perf_counter() - t)
        post("update", out.indices, np.abs(out.item.reward) + out.indices % 7)
    call("sync")
    in_server = (call("busy") - busy0) / samples  # sample + update, inside the buffer
    return {"stored": stored, "insert_transitions_per_s": round(calls * insert_batch / insert_s),
            "sample": _ms(sample_t), "in_server_sample_plus_update_ms": round(in_server * 1e3, 4)}


def threads_server(capacity: int, insert_batch: int, batch: int, samples: int) -> dict[str, Any]:
    """The shard in its own thread (the threads backend's placement), requests and answers over
    ``queue.Queue``: the answer's arrays are handed over, not copied."""
    import queue
    import threading

    server, requests, answers = _Server(capacity, insert_batch, batch), queue.Queue(), queue.Queue()

    def serve() -> None:
        while (req := requests.get()) is not None:
            out = server.busy_s() if req[0] == "busy" else server.handle(*req[1:])
            if req[0]:
                answers.put(out)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()

    def call(op: str, *args: Any) -> Any:
        requests.put((op, op, *args))
        return answers.get()

    try:
        return {"impl": "PrioritizedBuffer in a server thread, queue.Queue",
                **remote(call, lambda op, *args: requests.put((None, op, *args)), capacity, insert_batch, batch,
                         samples)}
    finally:
        requests.put(None)
        thread.join()


def ray_server(capacity: int, insert_batch: int, batch: int, samples: int) -> dict[str, Any]:
    """The shard in a Ray actor (the ray backend's placement; a local cluster here), the client in the
    driver: a sample is a Ray call whose numpy answer comes back inline (256 transitions: ~20 KB)."""
    import logging
    import os

    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    with warnings.catch_warnings():  # Ray fork+execs its processes: JAX's fork warning does not apply
        warnings.filterwarnings("ignore", message="os.fork", category=RuntimeWarning)
        ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level=logging.ERROR,
                 log_to_driver=False)
    try:
        actor = ray.remote(_Server).options(num_cpus=1).remote(capacity, insert_batch, batch)

        def call(op: str, *args: Any) -> Any:
            return ray.get(actor.busy_s.remote() if op == "busy" else actor.handle.remote(op, *args))

        return {"impl": "PrioritizedBuffer in a Ray actor, Ray calls", "ray": ray.__version__,
                **remote(call, lambda op, *args: actor.handle.remote(op, *args), capacity, insert_batch, batch,
                         samples)}
    finally:
        ray.shutdown()


SETTINGS = {"in_process": in_process, "flashbax": flashbax, "threads_server": threads_server,
            "ray_server": ray_server}


def main() -> None:
    from msrl.bench import count

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--capacity", type=count, default=1_000_000)
    ap.add_argument("--insert-batch", type=count, default=1024, help="transitions per insert call")
    ap.add_argument("--batch", type=count, default=256, help="prioritized sample size")
    ap.add_argument("--samples", type=count, default=500, help="timed samples (and priority updates)")
    ap.add_argument("--only", nargs="*", choices=sorted(SETTINGS), default=list(SETTINGS))
    args = ap.parse_args()
    out: dict[str, Any] = {"benchmark": "replay_latency", "capacity": args.capacity,
                           "insert_batch": args.insert_batch, "sample_batch": args.batch,
                           "item": "CartPole transition (obs 4 f32, action i32, reward f32, done bool, next_obs 4 f32)",
                           "device": str(jax.devices()[0]), "load_average_before": round(os.getloadavg()[0], 2)}
    for name in args.only:
        out[name] = SETTINGS[name](args.capacity, args.insert_batch, args.batch, args.samples)
    print(json.dumps({**out, "load_average_after": round(os.getloadavg()[0], 2)}, indent=2))


if __name__ == "__main__":
    main()
