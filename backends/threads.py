"""The ``threads`` backend: every fragment replica in a Python thread of this process.

Jitted code releases the GIL, so replicas overlap. The transport puts a delivery straight into the peer's
mailbox; a broadcast hands every receiver the same object (zero copy). A replica blocked on a receive
wakes up to notice a stop, so a failing replica ends the run instead of hanging it.

With ``devices`` (the ``jax`` backend's several-fragment programs) each replica is pinned to a JAX device:
its state lives there, it computes there, and what it receives is put there (``device_put`` as transport).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import jax

from msrl.backend import Backend, replica_env_ids
from msrl.runtime.driver import POLL_S, WATCH_S, Mailbox, ReplicaDriver, ReplicaRuntime, Transport


class InProcess(Transport):
    def __init__(self, mailboxes: dict[tuple[str, int], Mailbox]):
        self.mailboxes = mailboxes

    def deliver(self, dst, sender, iteration, messages) -> None:
        self.mailboxes[dst].put(sender, iteration, messages)


class ThreadsRuntime(ReplicaRuntime):
    def __init__(self, program: Any, seed: int, devices: dict[tuple[str, int], Any] | None = None):
        super().__init__(program, seed)
        self.mailboxes = {key: Mailbox() for key in self.keys}
        transport = InProcess(self.mailboxes)
        splits = {name: replica_env_ids(program.num_envs, frag) for name, frag in program.fragments.items()}
        self.drivers = {key: ReplicaDriver(program, key, seed, splits[key[0]][key[1]], transport, self.mailboxes[key],
                                           (devices or {}).get(key)) for key in self.keys}
        self.threads: dict[tuple[str, int], threading.Thread] = {}
        for service in program.services.values():  # one object, shared by every replica thread
            service.target = service.make(seed)

    def _run(self, iterations: int) -> dict:
        outputs, errors = {}, {}

        def work(key: tuple[str, int]) -> None:
            try:
                outputs[key] = self.drivers[key].run(iterations)
            except BaseException as e:  # noqa: BLE001 - raised in the caller's thread
                errors[key] = e
                for box in self.mailboxes.values():
                    box.stop()

        self.threads = {key: threading.Thread(target=work, args=(key,), daemon=True, name=f"msrl-{key[0]}-{key[1]}")
                        for key in self.keys}
        try:
            for t in self.threads.values():  # (an interrupt among these stops the ones started)
                t.start()
            watched, failed = time.monotonic(), None
            while alive := [k for k, t in self.threads.items() if t.is_alive()]:
                self.threads[alive[0]].join(timeout=POLL_S)
                if errors:  # the others stop within a poll interval, unless stuck in a host env's step
                    failed = failed or time.monotonic()
                    if time.monotonic() - failed > 2.0:
                        break
                elif time.monotonic() - watched >= WATCH_S:
                    watched = time.monotonic()
                    self.watch(alive)
        except BaseException:  # a stall or KeyboardInterrupt: stop the others (a stuck one stays behind)
            for box in self.mailboxes.values():
                box.stop()
            raise
        if errors:  # the first replica's, when several failed: the same report whichever thread came first
            raise errors[min(errors, key=self.keys.index)]
        return outputs

    def _call(self, keys, method: str, *args: Any) -> dict:
        return {key: getattr(self.drivers[key], method)(*args) for key in keys}

    def at_rest(self) -> bool:
        """Every replica stopped after the same iteration (a dispatch that ended early stops them all between
        two), its state whole (a step that failed after donating its replay buffer leaves it deleted)."""
        return all(not t.is_alive() for t in self.threads.values()) and \
            len({d.iteration for d in self.drivers.values()}) == 1 and \
            not any(x.is_deleted() for d in self.drivers.values() for x in jax.tree.leaves(d.state)
                    if isinstance(x, jax.Array))

    def settle(self) -> int | None:
        if not self.at_rest():
            return None
        self.iteration = next(iter(self.drivers.values())).iteration  # (past the last dispatch that finished)
        return super().settle()

    def can_go_on(self) -> bool:
        return not any(box.stopped for box in self.mailboxes.values())  # (stopped ones stay so)

    def close(self) -> None:
        """Stop every replica (blocked ones wake up within a poll interval) and release host envs. A replica
        stuck in a host environment's step cannot be stopped: it is left behind (its thread is a daemon) after
        a second, with its environments."""
        for box in self.mailboxes.values():
            box.stop()
        deadline = time.monotonic() + 1.0
        for t in self.threads.values():
            if t.ident is not None:  # (started)
                t.join(timeout=max(0.0, deadline - time.monotonic()))
        for key, driver in self.drivers.items():
            if "env" in driver.state and not (key in self.threads and self.threads[key].is_alive()):
                self.program.env.close(driver.state["env"])
        self.drivers = {}
        for service in self.program.services.values():
            service.target = None


class ThreadsBackend(Backend):
    """Runs each replica in a thread of this process (host environments, no collectives)."""

    def build(self, program: Any, seed: int, iterations_per_dispatch: int) -> ThreadsRuntime:
        return ThreadsRuntime(program, seed)
