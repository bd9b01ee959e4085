"""The replica driver: one fragment replica run against the plan, over a transport.

The protocol is written here once, for every backend whose replicas talk (threads, ray, JAX devices):
- a comm transfers on every ``every``-th iteration only; in between the receiver gets its last value again;
- a receive at iteration ``i`` takes what the sender sent at ``i - lag`` (before that, the receiver's own
  value);
- a gather joins its senders' values in global environment order (each receiver an equal, contiguous group
  of senders), a scatter splits along the same axes, a broadcast hands every receiver one shared value, a
  send pairs replica i with replica i;
- everything a replica sends a peer in one step goes as one delivery, just before it next blocks on a
  receive or at the end of its iteration; messages carry (comm, sender, iteration, count), so a receiver
  waits for exactly the messages its own step expects;
- errors are reported at the user's line, once, as :class:`msrl.TrainingError` (bad input found while
  running as itself);
- metric rows, snapshots, restores and parameters have one shape on every backend.

A backend supplies a :class:`Transport` (how a delivery reaches a peer's :class:`Mailbox`), placement and
lifecycle; the driver's side of a runtime is :class:`ReplicaRuntime`.
"""

from __future__ import annotations

import os
import re
import threading
import time
import traceback
from typing import Any

import jax
import numpy as np

from msrl import services
from msrl.backend import (Runtime, concat_along, gather_receiver, gather_senders, learners_agree, mean_metrics,
                          policy_lag, reduces_over_replicas, result_metrics, split_along, stats_fn)
from msrl.components import episode_metrics
from msrl.compiler.ir import walk
from msrl.compiler.lower import materialize, reraise_at_user_line, user_frames
from msrl.errors import CompileError, ConfigError, TrainingError

POLL_S = 0.05
WATCH_S = 0.5  # how often a runtime looks at its replicas' activities (the stall watch)
Key = tuple[str, int]  # (fragment, replica)


STOP_GRACE_S = 2.0  # after a stop request (SIGINT/SIGTERM), how long a replica may make no progress


class Stopped(Exception):
    """Raised in a replica blocked on a receive when the run is being stopped."""


class Stalled(TrainingError):
    """A replica, a host environment's step or a collective made no progress for ``run.stall_timeout_s``."""


def stall_report(found: dict[Key, tuple[str, float, str, int, float]], limit: float, order: list[Key]) -> str | None:
    """Words for a stall among the replicas' activities ``found`` (:meth:`ReplicaDriver.activity`; a replica
    missing from it did not answer), or None. A replica computing (in its step or a host environment's step)
    with no progress for ``limit`` seconds (plus the slack its activity gives) is named first; else, if every running replica has waited that
    long, they are named together. A replica's first step (XLA compiles it) is not timed, except for its
    host environments' steps."""
    def name(k: Key) -> str:
        return f"fragment {k[0]!r} replica {k[1]}"

    silent = [k for k in order if k in found and found[k] is None]
    if silent:
        return f"{name(silent[0])} did not answer for {limit:g} s (its process is stuck)"
    stuck = [k for k in order if k in found and found[k][0] in ("step", "env") and found[k][1] > limit + found[k][4]]
    if stuck:
        _, stale, words, iteration, _ = found[stuck[0]]
        return f"{name(stuck[0])} made no progress for {stale:.0f} s in iteration {iteration}: {words}"
    running = [k for k in order if k in found and found[k][0] != "idle"]
    if running and all(found[k][0] == "wait" and found[k][1] > limit for k in running):
        return "every running replica has waited more than {:g} s: {}".format(
            limit, "; ".join(f"{name(k)} in iteration {found[k][3]} {found[k][2]}" for k in running))
    return None


def failure(e: BaseException, lowered: Any, name: str) -> BaseException:
    """What the caller is told of an error in the replica ``name`` (of the fragment ``lowered``): bad input as
    itself, anything else a TrainingError naming the replica, the user's line and (but for msrl's own, which say
    what went wrong) the traceback."""
    if isinstance(e, (ConfigError, CompileError)):
        return e
    if isinstance(e, jax.errors.JAXTypeError):  # raised while the fragment is traced: the loop's error, as
        try:  # fused reports it when it compiles (that one traces at build; a replica on its first step)
            reraise_at_user_line(e, [lowered], "tracing")
        except CompileError as compile_error:
            return compile_error
        except Exception:  # noqa: BLE001, S110 - not at a line of the user's: reported as any other failure below
            pass
    frame, inner = user_frames(e, [lowered])
    lines = str(e).strip().splitlines()
    callback = len(lines) > 1 and "Traceback (most recent call" in lines[0]  # a host callback raised in the program
    at = f" at {frame[0]}:{frame[1]} `{frame[2]}`" if frame else ""
    if frame and (callback or isinstance(e, jax.errors.JaxRuntimeError)):  # raised while a jitted segment of
        at = f" in the jitted statements from {frame[0]}:{frame[1]} `{frame[2]}` on"  # the loop ran: its first line
    elif inner is not None and frame is not None and inner[:2] != frame[:2]:
        at += f", in {inner[2]}() at {inner[0]}:{inner[1]}"
    if callback:
        frames = [m for m in (re.match(r'\s*File "(.+)", line (\d+), in (\S+)', x) for x in lines)
                  if m and f"{os.sep}jax{os.sep}" not in m[1]]
        where = f", in {frames[-1][3]}() at {frames[-1][1]}:{frames[-1][2]}" if frames else ""
        return TrainingError(f"{name} failed{at}: {type(e).__name__}: "
                             f"{lines[0].split('Traceback')[0].strip().rstrip(':')}: {lines[-1].strip()}{where} "
                             "(--debug logs the callback's traceback)")
    trace = "" if isinstance(e, TrainingError) else f"\n{traceback.format_exc()}"
    return TrainingError(f"{name} failed{at}: {type(e).__name__}: {e}{trace}")


class Mailbox:
    """The messages delivered to one replica, by (comm id, sender replica, sender iteration, count)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.box: dict[tuple, Any] = {}
        self.highest: dict[Key, int] = {}  # sender -> highest iteration delivered from it
        self.restored = -1  # the iteration a restore continued after: every sender's deliveries count as done to it
        self.start, self.stopped = 0, False

    def put(self, sender: Key, iteration: int, messages: list[tuple[str, int, Any]]) -> None:
        with self.cond:
            if iteration < self.start:  # sent to this replica before it was restarted
                return
            for cid, count, value in messages:
                self.box[(cid, sender[1], iteration, count)] = value
            self.highest[sender] = max(self.highest.get(sender, -1), iteration)
            self.cond.notify_all()

    def take(self, keys: list[tuple]) -> list[Any]:
        with self.cond:
            while not all(k in self.box for k in keys):
                if self.stopped:
                    raise Stopped
                self.cond.wait(POLL_S)
            return [self.box.pop(k) for k in keys]

    def received_through(self, sender: Key) -> int:
        with self.cond:
            return max(self.highest.get(sender, -1), self.restored)

    def restart_at(self, iteration: int) -> None:
        with self.cond:
            self.start = iteration
            self.box = {k: v for k, v in self.box.items() if k[2] >= iteration}

    def forget(self, iteration: int) -> None:
        """Continue at ``iteration`` with restored states: nothing delivered before is kept (the restored senders
        send again what a lag carries into it)."""
        with self.cond:
            self.start, self.box, self.highest, self.restored = iteration - 1, {}, {}, iteration - 1

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()


class Transport:
    """How a replica's deliveries reach its peers. ``share`` makes the one copy of a broadcast value that
    every receiver gets, ``fetch`` reads such a copy back; both are the identity in one process. ``drain``
    waits until every delivery made has arrived (in one process, at once)."""

    def drain(self) -> None:
        pass

    def deliver(self, dst: Key, sender: Key, iteration: int, messages: list[tuple[str, int, Any]]) -> None:
        raise NotImplementedError

    def share(self, value: Any) -> Any:
        return value

    def fetch(self, value: Any) -> Any:
        return value


class _Running(threading.local):
    driver: "ReplicaDriver | None" = None


_RUNNING = _Running()


def current_iteration() -> int | None:
    """The iteration (counted from 0) the replica running in this thread is in; None outside one."""
    driver = _RUNNING.driver
    return None if driver is None else driver.iteration


class _Endpoint:
    def __init__(self, cid: str):
        self.cid = cid

    def send(self, value: Any) -> None:
        _RUNNING.driver.send(self.cid, value)

    def recv(self) -> Any:
        return _RUNNING.driver.recv(self.cid)


def fragment_fn(program: Any, name: str) -> Any:
    """The fragment's function, made once per program and shared by the replicas in this process (its
    jitted segments compile once): ``_msrl_comm`` resolves to the running replica's driver."""
    cache = program.__dict__.setdefault("_replica_fns", {})
    if name not in cache:
        frag = program.fragments[name]
        fn = materialize(frag.lowered, {**frag.namespace, "_msrl_comm": {c.id: _Endpoint(c.id) for c in
                                                                          program.plan.comms}})
        cache[name] = jax.jit(fn) if frag.mode == "scan" else fn
    return cache[name]


class ReplicaDriver:
    """One fragment replica: its state, its step, and its end of every comm."""

    def __init__(self, program: Any, key: Key, seed: int, env_ids: Any, transport: Transport,
                 mailbox: Mailbox | None = None, device: Any = None):
        self.program, self.key, self.seed, self.env_ids = program, key, seed, env_ids
        self.frag = program.fragments[key[0]]
        self.transport, self.mailbox, self.device = transport, mailbox or Mailbox(), device
        self.replicas = {f.name: f.spec.replicas for f in program.fragments.values()}
        self.comms = {c.id: c for c in program.plan.comms}
        self.iteration = 0
        self.warm = False  # a step finished in this process: its jitted code is compiled
        self.doing, self.since = "idle", time.monotonic()  # what it does (the stall watch reads it), since when
        self.counts: dict[str, int] = {}
        self.last: dict[str, Any] = {}  # comm id -> the last value received (comms that skip iterations)
        self.pending: dict[Key, list] = {}
        self.sent: dict[tuple[str, int], Any] = {}  # (comm id, iteration) -> a broadcast's shared value
        self.fn = fragment_fn(program, key[0])
        self.env_stats = stats_fn(program.env)
        self.state = self.place(program.init_states(self.frag.state_keys, seed, env_ids))

    # ------------------------------------------------------------------------------ placement
    def place(self, tree: Any) -> Any:
        """``tree`` where this replica computes (its JAX device, if it has one)."""
        return tree if self.device is None else jax.device_put(tree, self.device)

    def host(self, tree: Any) -> Any:
        """Part of this replica's state as host (numpy) arrays."""
        return jax.tree.map(np.asarray, jax.device_get(tree))

    # ------------------------------------------------------------------------------ running
    def step(self, state: Any) -> tuple[Any, Any, Any]:
        """One iteration: the new state, the loop's result and the environments' statistics."""
        state, result = self.fn(state)
        return state, result, self.env_stats(state["env"]) if "env" in state else None

    def run(self, iterations: int) -> list[tuple[int, Any, Any]]:
        """``iterations`` steps: (iteration, env statistics, loop result) of each, as host arrays."""
        out = []
        _RUNNING.driver = self
        try:
            for _ in range(iterations):
                self.counts = {}
                self._doing("step" if self.warm else "compile")
                try:
                    if self.device is None:
                        self.state, result, stats = self.step(self.state)
                    else:
                        with jax.default_device(self.device):
                            self.state, result, stats = self.step(self.state)
                except Stopped:
                    raise
                except Exception as e:  # noqa: BLE001 - reported at the user's line
                    raise self.failure(e) from None
                self.flush()
                try:
                    out.append((self.iteration, self.host(stats), self.host(result)))
                except Exception as e:  # noqa: BLE001 - an error XLA reports once the outputs are read (a host
                    raise self.failure(e) from None  # callback's) is this replica's too
                self.iteration += 1
                self.warm = True
        except Stopped:
            pass
        finally:
            _RUNNING.driver = None
            self._doing("idle")
        return out

    # ------------------------------------------------------------------------------ the stall watch
    def _doing(self, what: str) -> None:
        self.doing, self.since = what, time.monotonic()

    def activity(self) -> tuple[str, float, str, int, float]:
        """What this replica does ("idle", "compile", "step", "wait", or "env": inside a host environment's
        step), for how many seconds it has made no progress at it, in words (naming the environment and its
        step, or what it waits for), the iteration it is in (counted from 1), and the seconds it may take beyond
        the limit (inside a host environment's step: as long as its slowest step so far)."""
        doing, stale, words = self.doing, time.monotonic() - self.since, ""
        busy = getattr(self.program.env, "busy", None)
        env = self.state.get("env") if isinstance(self.state, dict) else None
        if doing in ("compile", "step") and busy is not None and env is not None:
            words, last, *slack = busy(env)  # a host env: each of its environments' steps is progress (a third
            if words:  # value: the seconds a step may take, Gymnasium's slowest so far)
                return "env", time.monotonic() - last, words, self.iteration + 1, (slack or [0.0])[0]
            stale = min(stale, time.monotonic() - last)
        if doing == "wait":
            words = self.waiting_for
        elif doing in ("compile", "step"):
            words = "its step has not finished" + (" (a collective of its replicas' group, or its own "
                                                  "computation)" if self.frag.mode == "scan" else "")
        return doing, stale, words, self.iteration + 1, 0.0

    def failure(self, e: BaseException) -> BaseException:
        """What the caller is told of an error in this replica (:func:`failure`)."""
        return failure(e, self.frag.lowered, f"fragment {self.key[0]!r} replica {self.key[1]}")

    def restart(self, iteration: int) -> None:
        """Continue at ``iteration`` with fresh environments and keys (after the process was restarted). A value
        that crosses with a lag (``sync: false``'s parameters) was sent for an earlier iteration: it is taken."""
        lag = max((c.lag for c in self.comms.values() if c.dst_fragment == self.key[0]), default=0)
        self.mailbox.restart_at(iteration - lag)
        self.iteration = iteration
        self.state = self.place(self.program.init_states(self.frag.state_keys, self.seed, self.env_ids,
                                                         fold=iteration))

    # ------------------------------------------------------------------------------ the comm ops
    def _count(self, cid: str) -> int:
        self.counts[cid] = self.counts.get(cid, -1) + 1
        return self.counts[cid]

    def send(self, cid: str, value: Any) -> None:
        comm = self.comms[cid]
        if self.iteration % comm.every:
            return
        count, dst, n = self._count(cid), comm.dst_fragment, self.replicas[comm.dst_fragment]
        if comm.op == "broadcast":
            shared = self.transport.share(value)
            with self.mailbox.cond:  # kept a while: a restarted receiver asks for what it missed
                self.sent[(cid, self.iteration)] = shared
                self.sent.pop((cid, self.iteration - 2 * comm.every - comm.lag), None)
                self.mailbox.cond.notify_all()
            parts = dict.fromkeys(range(n), shared)
        elif comm.op == "scatter":
            parts = dict(enumerate(split_along(value, n, self.program.comm_axes(comm), comm.axis == "batch")))
        elif comm.op == "gather":  # to the receiver whose group this replica is in
            parts = {gather_receiver(self.key[1], self.replicas[comm.src_fragment], n): value}
        else:  # send: replica i to replica i
            parts = {self.key[1]: value}
        for r, part in parts.items():
            self.pending.setdefault((dst, r), []).append((cid, count, part))

    def recv(self, cid: str) -> Any:
        comm = self.comms[cid]
        if self.iteration % comm.every:  # the last value received (after a restore: the one the state holds)
            return self.last[cid] if cid in self.last else self.state[comm.var.lstrip("@")]
        if self.iteration < comm.lag:  # nothing sent that early: the value this replica holds
            return self.state[comm.var.lstrip("@")]
        self.flush()
        count = self._count(cid)
        senders = (gather_senders(self.key[1], self.replicas[comm.src_fragment], self.replicas[self.key[0]])
                   if comm.op == "gather" else [self.key[1]] if comm.op == "send" else [0])
        self.waiting_for = f"waiting for `{comm.var}` from fragment {comm.src_fragment!r}"
        doing, self.doing, self.since = self.doing, "wait", time.monotonic()
        values = self.mailbox.take([(cid, s, self.iteration - comm.lag, count) for s in senders])
        values = [self.transport.fetch(v) for v in values]
        self._doing(doing)
        value = (concat_along(values, self.program.comm_axes(comm), f"`{comm.var}` from {comm.src_fragment!r}",
                              interleave=comm.axis == "batch") if comm.op == "gather" else values[0])
        self.last[cid] = value = self.place(value)
        return value

    def flush(self) -> None:
        """Deliver everything queued: one delivery per receiving replica."""
        pending, self.pending = self.pending, {}
        for dst, messages in pending.items():
            self.transport.deliver(dst, self.key, self.iteration, messages)

    def received_through(self, sender: Key) -> int:
        """The last iteration ``sender`` delivered to this replica (a restarted sender resumes after it)."""
        return self.mailbox.received_through(tuple(sender))

    def sent_value(self, cid: str, iteration: int) -> Any:
        """The broadcast this replica sent on ``cid`` at ``iteration`` (waits until it has sent it)."""
        with self.mailbox.cond:
            while (cid, iteration) not in self.sent:
                if self.mailbox.stopped:
                    raise Stopped
                self.mailbox.cond.wait(POLL_S)
            return self.sent[(cid, iteration)]

    # ------------------------------------------------------------------------------ state
    def get_state(self, skip: tuple[str, ...] = ()) -> dict:
        return self.host({k: v for k, v in self.state.items() if k not in skip})

    def drain(self) -> None:
        """Wait until what this replica delivered has arrived (before its peers :meth:`forget` it)."""
        self.transport.drain()

    def forget(self, iteration: int | None = None) -> None:
        """Before a restore (of every replica, this one's peers too): drop what was delivered, sent or received
        before, so that the restored run continues at ``iteration`` (default: this one) on the restored states
        alone."""
        self.mailbox.forget(self.iteration if iteration is None else iteration)
        self.last, self.counts, self.pending, self.sent = {}, {}, {}, {}

    def set_state(self, state: dict, iteration: int | None = None) -> None:
        """Set the states in ``state`` (after :meth:`forget`) and continue after ``iteration`` (default: this
        one's): the comms' schedules go on from it, and a lagged parameter broadcast this replica sends gets the
        value it sent in the iteration before (the restored learner's parameters), which the receivers take next.
        With ``iteration`` a host env's episodes start afresh, seeded for it; without, they go on."""
        env = self.program.components.get("env")
        host_env = env is not None and env.host_state and "env" in self.state
        if host_env:  # no snapshot holds a host env's episodes (its entry is what the env was): this one's stay
            state = {k: v for k, v in state.items() if k != "env"}
        self.state = {**self.state, **self.place(state)}
        if host_env and iteration is not None:  # a restored run's episodes start afresh, seeded for the iteration
            env.close(self.state["env"])  # as a restarted replica's
            self.state["env"] = self.place(self.program.init_states(["env"], self.seed, self.env_ids,
                                                                    fold=iteration))["env"]
        iteration = self.iteration if iteration is None else iteration
        for c in self.comms.values():
            if c.lag and c.src_fragment == self.key[0] and iteration >= c.lag:
                if c.lag > 1 or c.var != "@params":
                    raise TrainingError(f"`{c.var}` crosses with a lag of {c.lag} iterations: a restored run cannot "
                                        "send again what it sent before the snapshot")
                self.iteration = iteration - 1
                self.send(c.id, self.program.components["learner"].policy_params(self.state["learner"]))
                self.flush()
        self.iteration, self.counts = iteration, {}

    def params(self) -> Any:
        return self.program.components["learner"].policy_params(self.host(self.state["learner"]))


def replica_keys(program: Any) -> list[Key]:
    return [(name, r) for name, f in program.fragments.items() for r in range(f.spec.replicas)]


class ReplicaRuntime(Runtime):
    """The driver's side of a runtime of replicas: metric rows, snapshots, restores and parameters, over
    two things a backend provides: ``_run(iterations)`` (every replica's outputs, by key, or the first
    failure raised) and ``_call(keys, method, *args)`` (a driver method on each replica, results by key)."""

    def __init__(self, program: Any, seed: int):
        self.program, self.seed, self.iteration = program, seed, 0
        self.handed = 0  # the iterations whose rows the caller got (an interrupt can come between)
        self.keys = replica_keys(program)
        self._env_seen: dict[Key, tuple[dict, float]] = {}  # a replica's last env stats, and the episodes its
        # processes before a restart counted
        self.stopping: Any = lambda: False  # the caller's stop request (see stream)
        transforms = getattr(program.components.get("learner"), "grad_transforms", ())
        for name, frag in program.fragments.items():
            learns = any(s.kind == "api" and s.api.name == "agent_learn" for s in walk(frag.stmts))
            if learns and frag.spec.replicas > 1 and reduces_over_replicas(transforms) and not self.collective(frag):
                threads = frag.spec.backend == "threads"
                why = ("the threads backend has no collectives" if threads else
                       f"the {frag.spec.backend} backend runs a role as one program over its replicas only when the "
                       "role is jitted whole (no host environment) and exchanges nothing with another role")
                fix = ("run it on policy.backend=jax or ray, with a jitted environment (gymnax, Brax)" if threads else
                       "step a jitted environment (gymnax, Brax) and act in the learners' own role, as multi_learner "
                       "does")
                raise ConfigError("policy.backend", f"policy {program.policy.name!r} averages the gradients of its "
                                  f"{frag.spec.replicas} {name!r} replicas (msrl.all_reduce_mean()), but {why}: "
                                  f"nothing would average them. To average them, {fix}; or use a policy of one learner "
                                  "(single_learner_coarse)")

    def collective(self, fragment: Any) -> bool:
        """Whether the replicas of ``fragment`` run as one program whose collectives reduce over them."""
        return False

    def stream(self, iterations: int, chunk: int, stop: Any = lambda: False) -> Any:
        self.stopping = stop  # a replica that makes no progress after a stop request ends the wait early
        try:
            while iterations > 0 and not stop():
                n = min(chunk, iterations)
                rows = self.run(n)
                self.handed = self.iteration
                yield rows
                iterations -= n
        finally:
            self.stopping = lambda: False

    def settle(self) -> int | None:
        """At rest: the iterations run whose rows the caller did not get (an interrupt while they were made)."""
        return self.iteration - self.handed if self.at_rest() else None

    def _activities(self, keys: list[Key]) -> dict[Key, tuple[str, float, str, int, float]]:
        """:meth:`ReplicaDriver.activity` of the replicas ``keys`` (a backend may answer for fewer)."""
        return self._call(keys, "activity")

    def watch(self, running: list[Key]) -> None:
        """Called now and then while the replicas ``running`` run: a :class:`Stalled` error when one made no
        progress for ``stall_timeout_s`` (or for :data:`STOP_GRACE_S` once a stop was requested), or when all
        of them have waited that long (each for another)."""
        limit = self.stall_timeout_s
        if self.stopping():
            limit = min(limit, STOP_GRACE_S) if limit else STOP_GRACE_S
        if not limit or not running:
            return
        found = self._activities(running)
        report = stall_report(found, limit, self.keys)
        if report is not None:
            why = (f"it did not finish within {limit:g} s of the stop request" if self.stopping() else
                   f"run.stall_timeout_s={self.stall_timeout_s:g}")
            raise Stalled(f"{report} ({why})")

    def _run(self, iterations: int) -> dict[Key, list[tuple[int, Any, Any]]]:
        raise NotImplementedError

    def _call(self, keys: list[Key], method: str, *args: Any) -> dict[Key, Any]:
        raise NotImplementedError

    def run(self, iterations: int) -> list[dict[str, float]]:
        outputs = self._run(iterations)
        start, self.iteration = self.iteration, self.iteration + iterations
        stats: dict[int, list] = {}
        results: dict[int, list[dict[str, float]]] = {}  # the loop's metrics, of every replica returning them
        for key, out in outputs.items():
            returns = any(s.kind == "return" for s in self.program.fragments[key[0]].stmts)
            for it, result in ((it, result) for it, _, result in out if returns):
                results.setdefault(it, []).append(result_metrics(result))
            for it, st in self._env_stats(key, {it: st for it, st, _ in out if st is not None}, start):
                stats.setdefault(it, []).append(st)
        iterations = list(range(start, self.iteration))
        counters = services.metrics(self.program.services, iterations)  # as of the end of each iteration
        return [{**episode_metrics(stats.get(it, [])), **mean_metrics(results.get(it, [])),
                 **policy_lag(self.program, it), **counted} for it, counted in zip(iterations, counters, strict=True)]

    def _env_stats(self, key: Key, by_iteration: dict[int, dict], start: int) -> list[tuple[int, dict]]:
        """A replica's env stats for each iteration from ``start`` on, counting its episodes on through a restart:
        a restarted process's environments count from 0 (the episodes before are added), and the iterations its
        dead process ran but never reported keep the last stats it did report."""
        if not by_iteration and key not in self._env_seen:
            return []
        out = []
        for it in range(start, self.iteration):
            last, before = self._env_seen.get(key, (None, 0.0))
            st = by_iteration.get(it, last)
            if st is None:
                continue
            if last is not None and float(st["episodes"]) < float(last["episodes"]):  # a restarted process's
                before += float(last["episodes"])
            self._env_seen[key] = (st, before)
            out.append((it, {**st, "episodes": float(st["episodes"]) + before}))
        return out

    def snapshot(self, skip: tuple[str, ...] = ()) -> dict[str, list[dict]]:
        states = self._call(self.keys, "get_state", skip)
        out: dict[str, list[dict]] = {}
        for key in self.keys:
            out.setdefault(key[0], []).append(states[key])
        learner = self.program.components.get("learner")
        for name in self._averaging():
            learners_agree(self.program, [learner.policy_params(state["learner"]) for state in out[name]])
        return {**out, **services.snapshot(self.program.services)}

    def _averaging(self) -> list[str]:
        """The fragments whose learner replicas average their updates over each other (one collective program)."""
        return [name for name, frag in self.program.fragments.items() if frag.spec.replicas > 1
                and "learner" in frag.state_keys and self.collective(frag)]

    def restore(self, snapshot: dict[str, list[dict]], iteration: int | None = None) -> None:
        self._env_seen = {}  # (the restored environments count their own episodes)
        self._call(self.keys, "drain")  # (a delivery still on its way would land after the forget)
        self._call(self.keys, "forget", iteration)  # (every replica's, before any sends what a lag carries)
        for key in self.keys:
            self._call([key], "set_state", snapshot[key[0]][key[1]], iteration)
        services.restore(self.program.services, snapshot)
        if iteration is not None:
            self.iteration = iteration
        self.handed = self.iteration

    def params(self) -> Any:
        held = services.held_params(self.program)
        if held is not None:
            return held
        key = next(k for k in self.keys if "learner" in self.program.fragments[k[0]].state_keys)
        averaging = key[0] in self._averaging()  # (its replicas' parameters, compared; else the first's alone)
        params = self._call([k for k in self.keys if k[0] == key[0]] if averaging else [key], "params")
        if averaging:
            learners_agree(self.program, list(params.values()))
        return params[key]
