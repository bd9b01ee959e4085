"""Distribution policies: data (a pydantic model) plus a small function over the FDG.

A policy says which fragment every statement of the loop belongs to (``assign``), what fragments exist
with their replica counts and placement (``fragments``) and which communication op goes on each cut edge
(``comm_op``). The compiler does the rest: it splits the FDG, inserts the communication nodes and lowers
each fragment. A user's policy subclasses :class:`Policy` and registers with ``@msrl.register_policy``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from msrl.compiler.ir import Stmt


class FragmentSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    replicas: int = 1
    backend: str = "jax"
    device: str | None = None
    jit: bool = True  # lower `for range` loops to lax.scan and jit the fragment
    num_cpus: float = 1.0  # per replica, where the backend schedules processes (ray)
    num_gpus: float = 0.0


class Policy(BaseModel):
    """Base of every policy's config. ``name`` picks the policy; ``backend`` the default placement."""

    model_config = ConfigDict(extra="forbid")

    name: str
    backend: str = "jax"

    def fragments(self) -> list[FragmentSpec]:
        raise NotImplementedError

    def total_envs(self, num_envs: int) -> int:
        """How many environments run in total, given ``env.num_envs`` (a policy may set it itself)."""
        return num_envs

    def assign(self, stmts: "list[Stmt]", fdg: Any) -> dict[str, str]:
        """The fragment of every leaf statement (API call, compute, return), by statement id."""
        raise NotImplementedError

    def grad_transforms(self) -> tuple[Any, ...]:
        """Optax transformations the learner applies to its gradients before the algorithm's optimizer
        (``multi_learner``: the all-reduce)."""
        return ()

    def services(self, learner: Any) -> dict[str, Any]:
        """Shared objects the backend hosts beside the fragments for the run (``async``: the parameter
        holder), by name: :class:`msrl.services.Service` handles."""
        return {}

    def wrap_learner(self, learner: Any, services: dict[str, Any]) -> Any:
        """The learner component the fragments call, given the algorithm's (``async``: one whose update is
        applied by a service)."""
        return learner

    def updates_per_iteration(self) -> int:
        """Learner updates per iteration of the loop over all replicas (``async``: one per worker). The
        algorithm is told (``Context.updates_per_iteration``), to size its schedules by."""
        return 1

    def buffer_shards(self) -> int:
        """Replicas the replay buffer is split over (``replay_server``): each holds ``capacity / shards``
        entries and draws ``batch_size / shards`` of a sample."""
        return 1

    def comm_axis(self, var: str, src: FragmentSpec, dst: FragmentSpec) -> str:
        """What a gather joins and a scatter splits along: ``env`` (each leaf's environment axis) or
        ``batch`` (the leading axis of every leaf that has one: a sampled batch, its priorities)."""
        return "env"

    def comm_every(self, var: str, src: FragmentSpec, dst: FragmentSpec) -> int:
        """Iterations between two transfers of ``var`` (the actors' ``@params``, say): in between, the
        sender sends nothing and the receiver keeps the last value it got."""
        return 1

    def comm_lag(self, var: str, src: FragmentSpec, dst: FragmentSpec) -> int:
        """Iterations late that a value carried across iterations (``@params``) may arrive: the receiver's
        iteration i takes what the sender sent at iteration ``i - lag`` (its own initial value before
        that), so it need not wait for the sender's newest (``single_learner_coarse`` with ``sync:
        false``: actors collect the next batch while the learner trains on the last)."""
        return 0

    def comm_op(self, var: str, src: FragmentSpec, dst: FragmentSpec) -> str:
        """The communication op for a value crossing from fragment ``src`` to ``dst``."""
        if var == "@params":
            return "broadcast"
        if src.replicas > 1 and dst.replicas == 1:
            return "gather"
        if src.replicas == 1 and dst.replicas > 1:
            return "scatter"
        return "send"


class Resources(BaseModel):
    model_config = ConfigDict(extra="forbid")

    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float = Field(0.0, ge=0)


class DistributedPolicy(Policy):
    """A policy whose fragments can run as processes (``backend: ray``): resources and fault tolerance."""

    resources: dict[str, Resources] = Field(default_factory=dict, description="per role: num_cpus, num_gpus")
    max_actor_restarts: int = Field(3, ge=0, description="restarts of each actor replica whose process dies (ray)")
    ray_address: str | None = Field(None, description="an existing Ray cluster to join (default: start a private one)")
    ray_dashboard: bool = Field(False, description="start the Ray dashboard with the private cluster")

    def role(self, name: str, replicas: int, backend_key: str) -> FragmentSpec:
        """Fragment ``name`` placed by the field ``backend_key`` (default: ``backend``), with its resources."""
        from msrl.errors import ConfigError

        backend = getattr(self, backend_key)
        if backend not in (None, "jax", self.backend):
            raise ConfigError(f"policy.{backend_key}", f"{backend!r} cannot run inside policy.backend="
                              f"{self.backend!r}; use {self.backend!r} or 'jax' (one jitted program per step)")
        res = self.resources.get(name, Resources())
        return FragmentSpec(name=name, replicas=replicas, backend=backend or self.backend, **res.model_dump())

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


def prepare_learner(policy: Policy, learner: Any) -> tuple[Any, dict[str, Any]]:
    """The learner the fragments call under ``policy`` (its gradient transforms set, maybe wrapped) and the
    policy's services: what the compiler builds, and what ``msrl eval`` restores a checkpoint into."""
    learner.grad_transforms = tuple(policy.grad_transforms())
    services = policy.services(learner)
    return policy.wrap_learner(learner, services), services


def downstream_of(fdg: Any, roots: set[str]) -> set[str]:
    """``roots`` and every statement that depends on them within one iteration (data edges, not carried)."""
    import networkx as nx

    within = nx.DiGraph((u, v) for u, v, d in fdg.edges(data=True) if d["kind"] == "data" and not d["carry"])
    out = set(roots)
    for r in roots:
        if r in within:
            out |= nx.descendants(within, r)
    return out
