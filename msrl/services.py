"""Services: objects a distribution policy needs beside its fragments, shared by all of them (``async``'s
parameter holder).

A policy makes them (``LearnerPlan.services(learner)``: name -> :class:`Service`) and its components call
them through :meth:`Service.call`. The backend hosts each one for the run and points every process's copy
of the :class:`Service` at it: ``threads`` makes the object once in its process, so every replica thread
calls the same object; ``ray`` makes it a Ray actor (:class:`ServiceHost`) and hands its handle to every
replica process. Calls are made from Python, never from inside a running jitted computation.

A service defines ``metrics(iterations)`` (its counters as of the end of each of these iterations: a dict per
iteration, merged into its metrics row; a ``metrics()`` without them: its counters now, on every row) and
``get_state()`` /
``set_state(state)`` (saved in checkpoints); under the name :data:`PARAMETERS` also ``learner_state()``: the
run's authoritative learner state, which the backends report as the run's parameters.
"""

from __future__ import annotations

from typing import Any, Callable

PARAMETERS = "parameters"
SNAPSHOT_KEY = "_services"  # the pseudo-fragment under which a snapshot holds the services' states


class Service:
    """A handle on a shared object: ``make(seed)`` builds it; the backend sets ``target`` (the object, or
    a Ray actor hosting it) before the run and clears it after."""

    def __init__(self, make: Callable[[int], Any], name: str = "a policy service"):
        self.make, self.target, self.name = make, None, name  # name: what errors call it

    def call(self, method: str, *args: Any) -> Any:
        target = self.target
        if target is None:
            from msrl.errors import TrainingError

            raise TrainingError("a policy service was called while no backend hosts it (is the runtime closed?)")
        if type(target).__name__ == "ActorHandle":
            import jax
            import ray

            try:
                return ray.get(target.call.remote(method, *jax.device_get(args)))  # numpy: Ray ships it out of band
            except ray.exceptions.RayActorError as e:  # its process died (Ray's report is dozens of lines)
                from msrl.errors import TrainingError

                raise TrainingError(f"{self.name} (a Ray actor) died and cannot be restarted: it holds the run's "
                                    f"shared state ({type(e).__name__})") from None
        return counters(target, *args) if method == "counters" else getattr(target, method)(*args)


class ServiceHost:
    """The body of the Ray actor that hosts a service on ``ray``: builds the object from its pickled
    ``make`` and runs the calls it gets."""

    def __init__(self, make: bytes, seed: int, sys_path: list[str] = ()):
        import sys

        import cloudpickle

        for path in reversed(sys_path):  # the driver's modules (the algorithm's file) import here too
            if path not in sys.path:
                sys.path.insert(0, path)
        self.obj = cloudpickle.loads(make)(seed)

    def call(self, method: str, *args: Any) -> Any:
        import jax

        return jax.device_get(counters(self.obj, *args) if method == "counters" else getattr(self.obj, method)(*args))


def metrics(services: dict[str, Service], iterations: list[int]) -> list[dict[str, float]]:
    """Every service's counters as of the end of each of ``iterations`` (``metrics(iterations)``), merged: one
    dict per iteration, for its metrics row."""
    out: list[dict[str, float]] = [{} for _ in iterations]
    for name in sorted(services):
        for row, counters in zip(out, services[name].call("counters", list(iterations)), strict=True):
            row.update(counters)
    return out


def counters(obj: Any, iterations: list[int]) -> list[dict[str, float]]:
    """``obj.metrics(iterations)``; where its ``metrics()`` takes no iterations, the counters it gives now, on
    every row."""
    import inspect

    if not inspect.signature(obj.metrics).parameters:
        return [dict(obj.metrics())] * len(iterations)
    return obj.metrics(iterations)


def snapshot(services: dict[str, Service]) -> dict[str, list[dict]]:
    """The services' states as a snapshot entry (``{SNAPSHOT_KEY: [{name: state}]}``; empty if none)."""
    states = {name: s.call("get_state") for name, s in sorted(services.items())}
    return {SNAPSHOT_KEY: [states]} if states else {}


def held_params(program: Any) -> Any | None:
    """The run's policy parameters when a :data:`PARAMETERS` service holds them (None: a replica's learner
    state does)."""
    import jax

    if PARAMETERS not in program.services:
        return None
    state = jax.device_get(program.services[PARAMETERS].call("learner_state"))
    return program.components["learner"].policy_params(state)


def restore(services: dict[str, Service], snapshot: dict[str, list[dict]]) -> None:
    for name, state in (snapshot.get(SNAPSHOT_KEY) or [{}])[0].items():
        services[name].call("set_state", state)
