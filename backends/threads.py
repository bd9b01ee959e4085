"""The ``threads`` backend: every fragment replica in a Python thread, channels over ``queue.Queue``.

Jitted code releases the GIL, so replicas overlap. A fragment's source is materialized once and shared by
its replicas (its jitted segments compile once); which replica is running is a thread-local, so the
``_msrl_comm`` table the generated code calls resolves to that replica's end of each channel.

Comm ops: ``gather`` concatenates the senders' values along each leaf's environment axis (or the batch
axis, for a sample), in replica order (= global environment order), each receiver taking an equal
contiguous group of senders (all of them, for one receiver); ``scatter`` splits along it; ``broadcast``
hands every receiver the same object (zero copy, in process); ``send`` pairs replica i with replica i. A
comm with ``every > 1`` transfers on every ``every``-th iteration only. A receive waits on its queue but
wakes up to notice a stop, so a failing replica ends the run instead of hanging it; its traceback comes
back to the caller in a :class:`TrainingError`.
"""

from __future__ import annotations

import queue
import threading
import traceback
from typing import Any

import jax

from msrl import services
from msrl.backend import (Backend, Runtime, check_comms, concat_along, gather_senders, mean_metrics, policy_lag,
                          replica_env_ids, result_metrics, split_along, stats_fn)
from msrl.compiler.lower import materialize
from msrl.components import episode_metrics
from msrl.errors import CompileError, ConfigError, TrainingError

_POLL_S = 0.05


class _Stopped(Exception):
    """Raised in a replica blocked on a channel when the run is being stopped."""


class Channel:
    def __init__(self, op: str, axes: list[int | None], senders: int, receivers: int, every: int,
                 stop: threading.Event):
        self.op, self.axes, self.every, self.stop = op, axes, every, stop
        self.senders, self.receivers = senders, receivers
        self.queues = [queue.Queue() for _ in range(max(senders, receivers))]

    def _get(self, q: queue.Queue) -> Any:
        while True:
            try:
                return q.get(timeout=_POLL_S)
            except queue.Empty:
                if self.stop.is_set():
                    raise _Stopped from None

    def send(self, replica: int, value: Any) -> None:
        if self.op == "broadcast":
            for q in self.queues:
                q.put(value)
        elif self.op == "scatter":
            for q, part in zip(self.queues, split_along(value, len(self.queues), self.axes), strict=True):
                q.put(part)
        else:  # gather, send: the sender's own queue
            self.queues[replica].put(value)

    def recv(self, replica: int) -> Any:
        if self.op != "gather":
            return self._get(self.queues[replica])
        group = gather_senders(replica, self.senders, self.receivers)
        return concat_along([self._get(self.queues[s]) for s in group], self.axes)


class _Endpoint:
    """One replica's end of a channel. With ``every > 1`` only every ``every``-th transfer happens: the
    sender skips the others and the receiver gets the last value again."""

    def __init__(self, channel: Channel, replica: int):
        self.channel, self.replica = channel, replica
        self.calls, self.last = 0, None

    def _due(self) -> bool:
        self.calls += 1
        return (self.calls - 1) % self.channel.every == 0

    def send(self, value: Any) -> None:
        if self._due():
            self.channel.send(self.replica, value)

    def recv(self) -> Any:
        if self._due():
            self.last = self.channel.recv(self.replica)
        return self.last


class _CommTable:
    """``_msrl_comm[id]`` in generated code: the running replica's end of channel ``id``."""

    def __init__(self, channels: dict[str, Channel], local: threading.local):
        self.channels, self.local = channels, local
        self.endpoints: dict[tuple[str, int], _Endpoint] = {}

    def __getitem__(self, cid: str) -> _Endpoint:
        key = (cid, self.local.replica)
        if key not in self.endpoints:
            self.endpoints[key] = _Endpoint(self.channels[cid], self.local.replica)
        return self.endpoints[key]


class _Replica:
    def __init__(self, fragment: Any, index: int, fn: Any, state: dict):
        self.fragment, self.index, self.fn, self.state = fragment, index, fn, state
        self.results: list[Any] = []
        self.stats: list[dict[str, Any]] = []
        self.error: str | None = None
        self.exc: BaseException | None = None


class ThreadsRuntime(Runtime):
    def __init__(self, program: Any, seed: int, iterations_per_dispatch: int):
        check_comms(program)
        self.program = program
        self.stop = threading.Event()
        self.local = threading.local()
        frags = program.fragments
        channels = {}
        for c in program.partition.comms:
            channels[c.id] = Channel(c.op, program.comm_axes(c), frags[c.src_fragment].spec.replicas,
                                     frags[c.dst_fragment].spec.replicas, c.every, self.stop)
        self.replicas: list[_Replica] = []
        self.threads: list[threading.Thread] = []
        for frag in frags.values():
            ns = {**frag.namespace, "_msrl_comm": _CommTable(channels, self.local)}
            fn = materialize(frag.lowered, ns)
            if frag.mode == "scan":
                fn = jax.jit(fn)
            for r, env_ids in enumerate(replica_env_ids(program.num_envs, frag)):
                self.replicas.append(_Replica(frag, r, fn, program.init_states(frag.state_keys, seed, env_ids)))
        self.channels, self.iteration, self.env_stats = channels, 0, stats_fn(program.env)
        for name, service in program.services.items():  # one object, shared by every replica thread
            service.target = service.make(seed)

    def _work(self, rep: _Replica, iterations: int) -> None:
        self.local.replica = rep.index
        try:
            for _ in range(iterations):
                rep.state, result = rep.fn(rep.state)
                rep.results.append(result)
                if "env" in rep.state:
                    rep.stats.append(self.env_stats(rep.state["env"]))
        except _Stopped:
            pass
        except BaseException as e:  # noqa: BLE001 - reported in the caller's thread
            rep.error, rep.exc = traceback.format_exc(), e
            self.stop.set()

    def run(self, iterations: int) -> list[dict[str, float]]:
        if self.iteration == 0:  # a late comm's first receives get the receiver's own (maybe restored) value
            for c in self.program.partition.comms:
                for rep in (r for r in self.replicas if r.fragment.name == c.dst_fragment):
                    for _ in range(c.lag):
                        self.channels[c.id].queues[rep.index].put(rep.state[c.var.lstrip("@")])
        for rep in self.replicas:
            rep.results, rep.stats = [], []
        self.threads = [threading.Thread(target=self._work, args=(rep, iterations), daemon=True,
                                         name=f"msrl-{rep.fragment.name}-{rep.index}") for rep in self.replicas]
        for t in self.threads:
            t.start()
        try:
            for t in self.threads:
                while t.is_alive():
                    t.join(timeout=_POLL_S)
        except KeyboardInterrupt:
            self.close()
            raise
        failed = [rep for rep in self.replicas if rep.error]
        if failed:
            rep = failed[0]
            if isinstance(rep.exc, (ConfigError, CompileError)):  # bad input, found while running: as itself
                raise rep.exc
            raise TrainingError(f"fragment {rep.fragment.name!r} replica {rep.index} failed:\n{rep.error}")
        returners = [rep for rep in self.replicas if any(s.kind == "return" for s in rep.fragment.stmts)]
        with_env = [rep for rep in self.replicas if rep.stats]
        counters = services.metrics(self.program.services)  # as of the end of these iterations
        rows = [{**episode_metrics([rep.stats[i] for rep in with_env]),
                 **mean_metrics([result_metrics(rep.results[i]) for rep in returners]),
                 **policy_lag(self.program, self.iteration + i), **counters} for i in range(iterations)]
        self.iteration += iterations
        return rows

    def state(self) -> dict[str, list[dict]]:
        out: dict[str, list[dict]] = {}
        for rep in self.replicas:
            out.setdefault(rep.fragment.name, []).append(rep.state)
        return out

    def snapshot(self, skip: tuple[str, ...] = ()) -> dict[str, list[dict]]:
        out: dict[str, list[dict]] = {}
        for rep in self.replicas:
            out.setdefault(rep.fragment.name, []).append(
                jax.device_get({k: v for k, v in rep.state.items() if k not in skip}))
        return {**out, **services.snapshot(self.program.services)}

    def restore(self, snapshot: dict[str, list[dict]]) -> None:
        for rep in self.replicas:
            rep.state = {**rep.state, **snapshot[rep.fragment.name][rep.index]}
        services.restore(self.program.services, snapshot)

    def params(self) -> Any:
        held = services.held_params(self.program)
        if held is not None:
            return held
        rep = next(r for r in self.replicas if "learner" in r.state)
        return self.program.components["learner"].policy_params(rep.state["learner"])

    def close(self) -> None:
        """Stop every replica (blocked ones wake up within a poll interval) and release host envs."""
        self.stop.set()
        for t in self.threads:
            t.join()
        for rep in self.replicas:
            if "env" in rep.state:
                self.program.env.close(rep.state["env"])
        self.replicas = []
        for service in self.program.services.values():
            service.target = None


class ThreadsBackend(Backend):
    def build(self, program: Any, seed: int, iterations_per_dispatch: int) -> Runtime:
        return ThreadsRuntime(program, seed, iterations_per_dispatch)
