"""Distribution policies: data (a pydantic model) plus a small function over the loop.

A policy says which fragment every statement of the loop belongs to (``assign``), what fragments exist
with their replica counts and placement (``fragments``), what crosses each cut edge (``link``) and how the
learner runs (``learner_plan``). The compiler does the rest: it splits the FDG, checks that every cut value
keeps its meaning, inserts the communication nodes, freezes it all into a :class:`msrl.plan.Plan` and
lowers each fragment. A user's policy subclasses :class:`Policy` and registers with ``@msrl.register_policy``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from msrl.plan import FragmentSpec, LearnerPlan, Link, Loop


class Policy(BaseModel):
    """Base of every policy's config. ``name`` picks the policy; ``backend`` the default placement.

    A policy answers four questions, each with data the compiler checks and freezes into the plan:
    ``fragments()`` (its roles), ``assign(loop)`` (the role of every statement), ``link(var, src, dst)``
    (what a value crossing between two roles means and how it travels) and ``learner_plan()`` (gradient
    transformations, services, a wrapped learner, updates per iteration)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    name: str
    backend: str = Field("jax", description="the backend the roles run on (jax, threads, ray)")

    def fragments(self) -> list[FragmentSpec]:
        raise NotImplementedError

    def total_envs(self, num_envs: int) -> int:
        """How many environments run in total, given ``env.num_envs`` (a policy may set it itself). Applied when a
        config is validated and again where it is built or resumed (to a count that already holds its answer): given
        its own answer, it must give it again."""
        return num_envs

    def inert(self) -> dict[str, str]:
        """Keys that change nothing under this config's other values, each with the setting that gives it effect
        (as :meth:`msrl.AlgorithmConfig.inert`)."""
        return {}

    def assign(self, loop: Loop) -> dict[str, str]:
        """The fragment of every statement of ``loop`` (API call, compute, return), by statement id."""
        raise NotImplementedError

    def link(self, var: str, src: FragmentSpec, dst: FragmentSpec) -> Link:
        """How ``var`` crosses from role ``src`` to role ``dst``: the learner's parameters are broadcast
        (replicated); anything else is per-environment, its op picked from the replica counts."""
        return Link(axis="replicated") if var == "@params" else Link()

    def learner_plan(self) -> LearnerPlan:
        """How the learner runs under this policy (default: as the algorithm wrote it)."""
        return LearnerPlan()


class Resources(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    num_cpus: float = Field(1.0, ge=0, description="CPUs Ray reserves for each replica of the role")
    num_gpus: float = Field(0.0, ge=0, description="GPUs (or a fraction of one) Ray reserves for each replica")


class DistributedPolicy(Policy):
    """A policy whose fragments can run as processes (``backend: ray``): resources and fault tolerance."""

    resources: dict[str, Resources] = Field(default_factory=dict, description="per role (`msrl graph` lists a "
                                            "policy's roles): num_cpus, num_gpus")
    max_actor_restarts: int = Field(3, ge=0, description="restarts of each actor replica whose process dies (ray)")
    ray_address: str | None = Field(None, description="an existing Ray cluster to join (default: start a private one)")
    ray_dashboard: bool = Field(False, description="start the Ray dashboard with the private cluster")

    def inert(self) -> dict[str, str]:
        return {} if self.backend == "ray" else dict.fromkeys(
            ("ray_address", "ray_dashboard", "max_actor_restarts", "resources"), "policy.backend=ray")

    def role(self, name: str, replicas: int, backend_key: str, devices: list[int] | None = None) -> FragmentSpec:
        """Fragment ``name`` placed by the field ``backend_key`` (default: ``backend``), with its resources
        (and, on the jax backend, the JAX devices its replicas take in turn)."""
        from msrl.errors import ConfigError

        backend = getattr(self, backend_key)
        if backend not in (None, "jax", self.backend):
            raise ConfigError(f"policy.{backend_key}", f"{backend!r} cannot run inside policy.backend="
                              f"{self.backend!r}; use " + (f"{self.backend!r} or " if self.backend != "jax" else "")
                              + "'jax' (one jitted program per step)")
        res = self.resources.get(name, Resources())
        return FragmentSpec(name=name, replicas=replicas, backend=backend or self.backend,
                            devices=tuple(devices) if devices is not None else None, **res.model_dump())

    def shard_envs(self, num_envs: int, replicas_key: str, per_replica_key: str) -> int:
        """Total environments when the fields ``replicas_key`` replicas hold ``per_replica_key`` envs each
        (default: ``env.num_envs`` shared evenly)."""
        from msrl.config import INT32_MAX
        from msrl.errors import ConfigError

        replicas, per = getattr(self, replicas_key), getattr(self, per_replica_key)
        if per is not None:
            if replicas * per > INT32_MAX:
                raise ConfigError(f"policy.{per_replica_key}", f"{replicas} {replicas_key} x {per} envs is more "
                                  f"than {INT32_MAX} environments")
            return replicas * per
        if num_envs % replicas:
            raise ConfigError(f"policy.{replicas_key}", f"{replicas} {replicas_key} cannot share env.num_envs="
                              f"{num_envs} environments evenly; set policy.{per_replica_key}")
        return num_envs

    def check_roles(self, roles: list[FragmentSpec]) -> list[FragmentSpec]:
        from msrl.errors import ConfigError

        unknown = set(self.resources) - {r.name for r in roles}
        if unknown:
            raise ConfigError(f"policy.resources.{sorted(unknown)[0]}",
                              f"not a role of {self.name!r} (roles: {', '.join(r.name for r in roles)})")
        return roles


_ANSWERS = {"fragments": "a list of msrl.FragmentSpec (self.role(...))", "assign": "a dict of statement id to role "
            "name (loop.roles(...))", "link": "an msrl.Link", "learner_plan": "an msrl.LearnerPlan"}


def answered_at(policy: Policy, method: str) -> str:
    """" (at FILE:LINE)" of ``method`` where the policy's own class defines it; "" where msrl's does."""
    import inspect

    fn = getattr(type(policy), method, None)
    if fn is None or getattr(Policy, method, None) is fn or \
            type(policy).__module__.startswith(("policies.", "msrl.policies.")):
        return ""
    try:
        return f" (at {inspect.getsourcefile(fn)}:{inspect.getsourcelines(fn)[1]})"
    except (OSError, TypeError):
        return ""


def answer(policy: Policy, method: str, *args: Any) -> Any:
    """``policy.method(*args)`` (one of the four questions), checked: it answers with what the compiler reads, and
    an error in a policy's own code names the policy, the method and its file:line (a ConfigError)."""
    import keyword
    import numbers
    import reprlib

    from msrl.errors import ConfigError, MsrlError, raised_at

    try:
        out = getattr(policy, method)(*args)
    except MsrlError:
        raise
    except Exception as e:
        at = raised_at(e, type(policy).__module__)
        if isinstance(e, NotImplementedError) and at is None:
            raise ConfigError("policy.name", f"policy {policy.name!r} ({type(policy).__name__}) defines no {method}(); "
                              "a policy defines fragments() and assign(loop) (link and learner_plan have defaults)") from None
        if at is None:  # not raised in the policy's code: msrl's own error, with its traceback
            raise
        raise ConfigError("policy.name", f"policy {policy.name!r}: its {method}() raised {type(e).__name__}: {e}"
                          f" (at {at})") from None
    fits = {"fragments": isinstance(out, (list, tuple)) and all(isinstance(f, FragmentSpec) for f in out),
            "assign": isinstance(out, dict), "link": isinstance(out, Link),
            "learner_plan": isinstance(out, LearnerPlan)}[method]
    if not fits:
        raise ConfigError("policy.name", f"policy {policy.name!r}: its {method}() returned {type(out).__name__} "
                          f"{reprlib.repr(out)}; it returns {_ANSWERS[method]}")
    if method == "fragments":
        for f in out:
            if not f.name.isidentifier() or keyword.iskeyword(f.name):  # (it names the generated functions, and
                # checkpoints' keys: FRAGMENT/replica/component)
                raise ConfigError("policy.name", f"policy {policy.name!r}: its fragments() name a role {f.name!r}; a "
                                  "role's name is a Python identifier (letters, digits, _), e.g. 'actor'")
            if f.devices is not None and f.backend != "jax":  # (ignored without a word)
                raise ConfigError("policy.name", f"policy {policy.name!r}: its fragments() give the role {f.name!r} "
                                  f"the JAX devices {list(f.devices)}, but place it on backend {f.backend!r}: only "
                                  "a role on 'jax' runs on JAX devices")
            if f.backend not in ("jax", policy.backend):
                raise ConfigError("policy.name", f"policy {policy.name!r}: its fragments() place the role {f.name!r} "
                                  f"on backend {f.backend!r}, but the policy runs on policy.backend={policy.backend!r} "
                                  f"(a role runs there, or as a jitted program there: 'jax')")
        names = [f.name for f in out]
        if len(set(names)) < len(names):
            twice = next(n for n in names if names.count(n) > 1)
            raise ConfigError("policy.name", f"policy {policy.name!r}: its fragments() give the role {twice!r} "
                              f"{names.count(twice)} times; each role has one name (its replicas count them)")
    if method == "learner_plan":
        from msrl.backend import reduces_over_replicas

        for key in ("updates_per_iteration", "learner_replicas"):
            value = getattr(out, key)
            if not (value is None and key == "updates_per_iteration") and \
                    (not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1):
                raise ConfigError("policy.name", f"policy {policy.name!r}: its learner_plan() gives {key}="
                                  f"{value!r}; it must be a whole number >= 1")
        for t in out.grad_transforms:
            if not (callable(getattr(t, "init", None)) and callable(getattr(t, "update", None))):
                raise ConfigError("policy.name", f"policy {policy.name!r}: its learner_plan() has the gradient transform "
                                  f"{t!r}; each is an optax.GradientTransformation (msrl.all_reduce_mean(), say)")
        averaged = reduces_over_replicas(out.grad_transforms)
        updates = 1 if averaged else out.learner_replicas
        if out.wrap is not None and out.updates_per_iteration is not None:  # (a wrapped learner's own holder may
            updates = out.updates_per_iteration  # apply its replicas' gradients as one update: its policy says)
        if out.updates_per_iteration not in (None, updates):  # (an A2C's schedule was sized by it, silently apart)
            raise ConfigError("policy.name", f"policy {policy.name!r}: its learner_plan() gives updates_per_iteration="
                              f"{out.updates_per_iteration}, but its {out.learner_replicas} learner replica"
                              f"{'s' * (out.learner_replicas > 1)} update{'s' * (out.learner_replicas == 1)} the "
                              f"parameters {updates} time"
                              f"{'s' * (updates > 1)} per iteration (" + ("their gradients averaged" if averaged else
                                                                         "each its own update") + "); the algorithm "
                              "sizes its schedules by it: leave it out (msrl counts them)")
        out = dataclasses.replace(out, updates_per_iteration=updates)
    return out


def prepare_learner(policy: Policy, learner: Any) -> tuple[Any, dict[str, Any]]:
    """The learner the fragments call under ``policy`` (its gradient transforms set, maybe wrapped) and the
    policy's services: what the compiler builds, and what ``msrl eval`` restores a checkpoint into."""
    plan = answer(policy, "learner_plan")
    learner.grad_transforms = tuple(plan.grad_transforms)
    services = plan.services(learner) if plan.services is not None else {}
    return (plan.wrap(learner, services) if plan.wrap is not None else learner), services
