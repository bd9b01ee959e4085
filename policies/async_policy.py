"""``async`` (A3C: gradient parallelism). ``workers`` actor-learners each run the whole loop on their own
environments and compute gradients on their own rollouts; one parameter holder owns the parameters and the
optimizer, applies every gradient as it arrives and hands back its newest parameters, which the worker
acts and computes its next gradient with. A gradient computed on parameters more than ``max_staleness``
updates older than the holder's is dropped and counted.

The algorithm does not change. The policy puts a transformation in front of the learner's optimizer that
captures the gradient, and wraps the learner (:class:`RemoteLearner`): its ``learn`` runs the algorithm's
``learn`` jitted up to that gradient, then sends it to the holder. The holder is a :mod:`msrl.services`
service: one object on ``threads`` (the parameters live once in memory; every worker thread reads the
holder's arrays, Hogwild-style, and updates go one at a time under a lock), a Ray actor on ``ray``. With
one worker the run is serial, hence reproducible.

It needs a learner that makes one optimizer step per ``learn`` (A2C), whose state is a dict holding what it
differentiates under ``"params"`` and its optimizer's state under ``"opt_state"``, and whose new state is exactly
that step (the holder computes nothing else): every ``learn`` checks it, and a learner that changes the update or
the new parameters (clipping, scaling) is refused rather than trained otherwise.
"""

from __future__ import annotations

import contextvars
import threading
from functools import partial
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax
from pydantic import Field

import msrl
from msrl.compiler import run_init
from msrl.errors import method_name
from msrl.runtime.driver import current_iteration

_CAPTURED: contextvars.ContextVar[list | None] = contextvars.ContextVar("msrl_async_grads", default=None)


def capture_gradients() -> optax.GradientTransformation:
    """An optax transformation that records the gradients it is given (while :class:`RemoteLearner`
    traces the algorithm's ``learn``) and passes them on unchanged."""
    return optax.GradientTransformation(optax.init_empty_state, _capture)  # picklable: no closure


def _capture(grads: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
    slot = _CAPTURED.get()
    if slot is not None:
        slot.append(grads)
    return grads, state


def optimizer_step(tx: optax.GradientTransformation, grads: Any, opt_state: Any, params: Any) -> tuple[Any, Any]:
    """``tx``'s step on ``grads``: the new parameters and optimizer state (what the holder applies)."""
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


class ParameterHolder:
    """The one copy of the parameters and of the optimizer's state. ``push`` applies a gradient (or drops
    it, if computed on parameters more than ``max_staleness`` updates old) and returns the newest
    parameters and optimizer state, their version (updates applied so far) and the gradient's staleness."""

    def __init__(self, tx: optax.GradientTransformation, params: Any, max_staleness: int):
        """``tx``: the learner's own ``tx`` (its optimizer after the policy's gradient capture, which passes
        gradients through here), so the optimizer state has the structure of a worker's."""
        self.apply = jax.jit(partial(optimizer_step, tx))
        self.max_staleness, self.lock = max_staleness, threading.Lock()
        self.params, self.opt_state = params, jax.jit(tx.init)(params)
        self.version = self.dropped = 0
        self.counted: dict[int, tuple[int, int]] = {}  # a worker's iteration -> (version, dropped) after its push
        self.reported = (0, 0)  # (version, dropped) as of the last iteration metrics() reported

    def push(self, grads: Any, version: int, iteration: int | None = None) -> tuple[Any, Any, int, int]:
        """``iteration``: the pushing worker's (its counters are reported as of the end of each iteration)."""
        with self.lock:
            staleness = self.version - int(version)
            if staleness > self.max_staleness:
                self.dropped += 1
            else:
                self.params, self.opt_state = self.apply(grads, self.opt_state, self.params)
                self.version += 1
            at = -1 if iteration is None else int(iteration)  # (-1: a push from outside a run)
            self.counted[at] = (self.version, self.dropped)
            return self.params, self.opt_state, self.version, staleness

    def learner_state(self) -> dict[str, Any]:
        """The run's learner state: all of it (:data:`HELD`)."""
        with self.lock:
            return {"params": self.params, "opt_state": self.opt_state}

    def metrics(self, iterations: list[int]) -> list[dict[str, float]]:
        """The gradients applied and dropped as of the end of each of ``iterations``: after the last push a
        worker made in it or before (a worker ahead of the others has pushed more since)."""
        with self.lock:
            out, pushed, i = [], sorted(self.counted), 0
            for it in iterations:
                while i < len(pushed) and pushed[i] <= it:
                    self.reported = max(self.reported, self.counted.pop(pushed[i]))  # (both counts only grow)
                    i += 1
                out.append({"grads_applied": float(self.reported[0]), "stale_grads_dropped": float(self.reported[1])})
            return out

    def get_state(self) -> dict[str, Any]:
        with self.lock:
            return jax.device_get({"params": self.params, "opt_state": self.opt_state,
                                   "version": np.int64(self.version), "dropped": np.int64(self.dropped)})

    def set_state(self, state: dict[str, Any]) -> None:
        with self.lock:
            self.params, self.opt_state = state["params"], state["opt_state"]
            self.version, self.dropped = int(state["version"]), int(state["dropped"])
            self.counted, self.reported = {}, (self.version, self.dropped)


PLAIN = (bool, int, float, complex, str, bytes, type(None))  # values a jitted fragment keeps static (not numpy's)
HELD = ("params", "opt_state")  # the learner state the holder carries: all of it, or the policy refuses
FITS = ("use policy.name=single_learner_coarse or multi_learner for an on-policy loop (msrl.buffer_get), "
        "replay_server, single_learner_fine or multi_learner for one that samples a replay buffer")


def checked_init(learner: Any, key: jax.Array, init: Any = None) -> dict[str, Any]:
    """The learner's initial state (``init``: how to compute it), which must be a dict of the parameters
    ("params") and the optimizer's state ("opt_state") alone: the holder carries exactly these, so nothing
    else of it could be kept."""
    state = (init or learner.init)(key)
    if not isinstance(state, dict) or "params" not in state:
        raise msrl.ConfigError("policy.name", f"async applies gradients to the learner's state['params'], but "
                               f"{method_name(learner, 'init')} returns no dict with a 'params' key; " + FITS)
    extra = sorted(set(state) - set(HELD))
    if extra:
        raise msrl.ConfigError("policy.name", f"async's parameter holder carries a learner state of the parameters "
                          "('params') and the optimizer's state ('opt_state') only, but "
                          f"the state {method_name(learner, 'init')} returns also holds {', '.join(map(repr, extra))}, "
                          "which every worker would compute and throw away (target networks, keys and counters would "
                          "never advance); if one is the optimizer's state, name it 'opt_state'; else " + FITS)
    return state


def _own(state: dict[str, Any]) -> dict[str, Any]:
    """The learner's state as its own init made it: without the holder's ``param_version``."""
    return {k: v for k, v in state.items() if k != "param_version"}


class RemoteLearner:
    """The learner component under ``async``: the algorithm's learner, with ``learn`` split into computing
    the gradient (jitted, on the worker) and applying it (at the holder). It runs on the host, between the
    loop's jitted segments, so the holder is never called from inside a running computation."""

    jittable = False

    def __init__(self, learner: Any, holder: msrl.Service):
        self.learner, self.holder = learner, holder
        self.jitted: dict[tuple, Any] = {}  # _grads jitted, by which of learn()'s arguments are plain Python values

    def grads(self, state: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any, jax.Array]:
        """:meth:`_grads`, jitted. A plain Python value the loop passes to ``learn`` (a literal, a config
        value) stays one, as in the loop's own jitted fragments: static, not traced."""
        static = (tuple(i + 1 for i, a in enumerate(args) if type(a) in PLAIN),  # (an int loop index: one
                  tuple(sorted(k for k, v in kwargs.items() if type(v) in PLAIN)))  # compile per value, then cached)
        if static not in self.jitted:
            self.jitted[static] = jax.jit(self._grads, static_argnums=static[0], static_argnames=static[1])
        return self.jitted[static](state, *args, **kwargs)

    def init(self, key: jax.Array) -> dict[str, Any]:
        return {**checked_init(self.learner, key), "param_version": np.int32(0)}

    def policy_params(self, state: Any) -> Any:
        return self.learner.policy_params(_own(state))

    def _grads(self, state: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any, jax.Array]:
        """The gradient ``learn`` gives its optimizer, its metrics, and whether its new state is that
        optimizer step's (what the holder will compute)."""
        slot: list = []
        token = _CAPTURED.set(slot)
        try:
            new, metrics = self.learner.learn(_own(state), *args, **kwargs)
        finally:
            _CAPTURED.reset(token)
        if len(slot) != 1:
            raise msrl.ConfigError("policy.name", f"async needs a learner that makes one optimizer step per learn(); "
                              f"{method_name(self.learner, 'learn')} made {len(slot)}; " + FITS)
        params, opt_state = optimizer_step(self.learner.tx, slot[0], state["opt_state"], state["params"])
        step = {"params": params, "opt_state": opt_state}
        new = {k: new.get(k) for k in HELD} if isinstance(new, dict) else new
        if jax.tree.structure(new) != jax.tree.structure(step):
            return slot[0], metrics, jnp.bool_(False)
        # the step's, within rounding (fused differently); a non-finite update is the NaN guard's to report
        pairs = list(zip(jax.tree.leaves(new), jax.tree.leaves(step), strict=True))
        close = [jnp.all(jnp.abs(a - b) <= 1e-6 * jnp.max(jnp.abs(b), initial=0)) for a, b in pairs]
        finite = [jnp.isfinite(a).all() & jnp.isfinite(b).all() for a, b in pairs]
        return slot[0], metrics, jnp.all(jnp.stack(close)) | ~jnp.all(jnp.stack(finite))

    def learn(self, state: Any, *args: Any, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        name, learn = type(self.learner).__name__, method_name(self.learner, "learn")
        try:
            grads, metrics, is_step = self.grads(state, *args, **kwargs)
        except jax.errors.UnexpectedTracerError:  # the step ran inside a loop of learn(): several steps
            raise msrl.ConfigError("policy.name", "async needs a learner that makes one optimizer step per learn(); "
                              f"{learn} steps inside a loop (minibatches, epochs)"
                              "; " + FITS) from None
        if not bool(is_step):
            raise msrl.ConfigError("policy.name", f"async's parameter holder applies {name}.optimizer()'s step to "
                                   f"the gradient {learn} computes, and nothing else, but it returns "
                                   "other parameters or optimizer state than that step (it changes the update or the "
                                   "new parameters: clipping, scaling, ...); the workers would train something other "
                                   "than the loop; " + FITS)
        params, opt_state, version, staleness = self.holder.call("push", grads, state["param_version"],
                                                                 current_iteration())
        state = {**state, "params": params, "opt_state": opt_state, "param_version": np.int32(version)}
        return state, {**metrics, "policy_lag": staleness}


class Async(msrl.DistributedPolicy):
    """A3C-style: ``workers`` replicas each run the whole loop on their share of the environments and push
    their gradients to a parameter holder, which applies each as it comes (different from ``fused`` by design
    with 2 or more workers)."""

    name: Literal["async"] = "async"
    backend: Literal["threads", "ray"] = Field("threads", description="where the workers run: threads of this "
                                               "process, or Ray actors")
    workers: int = Field(4, gt=0, le=4096, description="actor-learners, each on its own environments")
    envs_per_worker: int | None = Field(None, gt=0, le=msrl.INT32_MAX,
                                        description="environments per worker (default: env.num_envs / workers)")
    max_staleness: int = Field(16, ge=0, le=msrl.INT32_MAX, description="drop a gradient computed on parameters more "
                               "than this many updates older than the holder's (counted as stale_grads_dropped)")

    def total_envs(self, num_envs: int) -> int:
        return self.shard_envs(num_envs, "workers", "envs_per_worker")

    def fragments(self) -> list[msrl.FragmentSpec]:
        return self.check_roles([self.role("worker", self.workers, "backend")])

    def assign(self, loop: msrl.Loop) -> dict[str, str]:
        return loop.roles(lambda s: "worker")

    def learner_plan(self) -> msrl.LearnerPlan:
        """Gradients captured in front of the optimizer, the optimizer applied at a parameter holder (a
        service), one update per worker per iteration."""
        return msrl.LearnerPlan(grad_transforms=(capture_gradients(),), services=self._services,
                                wrap=lambda learner, services: RemoteLearner(learner, services[msrl.PARAMETERS]),
                                learner_replicas=self.workers)

    def _services(self, learner: Any) -> dict[str, msrl.Service]:
        if getattr(type(learner), "optimizer", msrl.Learner.optimizer) is msrl.Learner.optimizer:
            raise msrl.ConfigError("policy.name", f"async applies the learner's optimizer() at a parameter holder; "
                                   f"{type(learner).__name__} defines none; " + FITS)
        max_staleness = self.max_staleness
        checked_init(learner, jax.random.PRNGKey(0), partial(jax.eval_shape, learner.init))  # refuse it now

        def make(seed: int) -> ParameterHolder:
            key = msrl.component_keys(seed)["learner"]  # (computed as every replica's initial state is: the same bits)
            params = jax.device_get(run_init(partial(checked_init, learner), key)["params"])
            return ParameterHolder(learner.tx, params, max_staleness)

        return {msrl.PARAMETERS: msrl.Service(make, name="async's parameter holder")}
