"""The compiled plan: immutable data that says what runs where and what crosses each cut.

A policy produces its entries (roles, each statement's role, a :class:`Link` per cut edge, a
:class:`LearnerPlan`); the compiler checks them against the loop and freezes them into a :class:`Plan`; a
backend runs the plan. Nothing here runs anything.

Every value that crosses a cut has a meaning (``CommSpec.axis``):
- ``env``: per-environment: each leaf has an environment axis; a gather joins and a scatter splits along it,
  in global environment order;
- ``batch``: per-sample: each leaf's leading axis is a batch (a sampled batch, its priorities);
- ``replicated``: the same on every replica (the learner's parameters): a broadcast hands every receiver
  the one value.
A gather of a value whose leaves are not all per-environment (or per-sample) would have to drop or invent
numbers: the compiler refuses it.
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Any, Callable, Iterable, Mapping

from pydantic import BaseModel, ConfigDict

COMM_OPS = ("gather", "scatter", "broadcast", "send")
AXES = ("env", "batch", "replicated")


class FragmentSpec(BaseModel):
    """A role: a fragment of the loop, its replica count and its placement."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    replicas: int = 1
    backend: str = "jax"
    devices: tuple[int, ...] | None = None  # backend jax with several fragments: the JAX devices of its replicas
    jit: bool = True  # lower `for range` loops to lax.scan and jit the fragment
    num_cpus: float = 1.0  # per replica, where the backend schedules processes (ray)
    num_gpus: float = 0.0


@dataclasses.dataclass(frozen=True)
class Link:
    """What a policy says of a value crossing from one role to another (a cut edge). ``op`` None: by the
    replica counts (one to many: scatter; many to one: gather; equal: send; parameters: broadcast)."""

    op: str | None = None
    axis: str | None = None  # None: "replicated" for the parameters (@params), "env" for anything else
    every: int = 1  # it crosses every `every`-th iteration only; in between the receiver keeps the last value
    lag: int = 0  # the receiver's iteration i takes the sender's value of iteration i - lag


@dataclasses.dataclass(frozen=True)
class CommSpec:
    """A communication node of the plan: ``var`` defined at statement ``src`` flows from fragment
    ``src_fragment`` to ``dst_fragment``. It is sent right after ``point`` and received at the same point of
    the consumer's program (both run the same loop skeleton): a value made in a loop but used after it
    crosses once."""

    id: str
    op: str
    var: str
    src: str
    src_fragment: str
    dst_fragment: str
    point: str  # the statement (or loop) after which it happens: src, hoisted out of loops the use is not in
    axis: str = "env"
    every: int = 1
    lag: int = 0

    def sent_for(self, iteration: int) -> int:
        """The sender's iteration whose value the receiver holds going into ``iteration`` (its ``every`` and
        ``lag``); negative where none was sent yet."""
        return (iteration - 1 - self.lag) // self.every * self.every


@dataclasses.dataclass(frozen=True)
class LearnerPlan:
    """How the learner runs under a policy: gradient transformations put in front of its optimizer (an
    all-reduce, say), services the backend hosts beside the fragments (built from the learner), the
    learner component the fragments call instead of the algorithm's, and learner updates per iteration
    over all replicas (the algorithm is told, to size its schedules by; None: msrl counts them — 1 where the
    replicas average their gradients, else one per replica — and refuses a given count that differs)."""

    grad_transforms: tuple[Any, ...] = ()
    services: Callable[[Any], dict[str, Any]] | None = None
    wrap: Callable[[Any, dict[str, Any]], Any] | None = None
    updates_per_iteration: int | None = None
    learner_replicas: int = 1  # replicas of the learner, each learning on an equal share of the environments


@dataclasses.dataclass(frozen=True)
class Plan:
    """Fragments (roles), the role of every leaf statement, the comm node on every cut edge, the services,
    and how many replicas the replay buffer is split over (the replicas of the role that holds it)."""

    fragments: Mapping[str, FragmentSpec]
    assign: Mapping[str, str]
    comms: tuple[CommSpec, ...]
    services: tuple[str, ...] = ()
    buffer_shards: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "fragments", MappingProxyType(dict(self.fragments)))
        object.__setattr__(self, "assign", MappingProxyType(dict(self.assign)))
        object.__setattr__(self, "comms", tuple(self.comms))

    def comm(self, var: str) -> CommSpec | None:
        """The first comm node carrying ``var`` (``"@params"``: the parameter broadcast), if any."""
        return next((c for c in self.comms if c.var == var), None)


def _known(what: str, names: Iterable[str], known: Iterable[str]) -> None:
    from msrl.errors import did_you_mean

    for name in names:
        if name not in known:
            raise ValueError(f"{name!r} is not {what}; {did_you_mean(name, known)}they are: {', '.join(sorted(known))}")


class Loop:
    """The loop as a policy sees it to assign roles: its statements and their data dependencies."""

    def __init__(self, statements: list[Any], fdg: Any):
        self.statements, self.fdg = statements, fdg

    def calls(self, *names: str) -> set[str]:
        """Ids of the calls of the named API functions (``"agent_learn"``, ...): none where this loop makes none;
        a name that is no API function is an error (a typo would leave a role without its statements)."""
        from msrl.api import API

        _known("an API function", names, API)
        return {s.id for s in self.statements if s.kind == "api" and s.api.name in names}

    def component_calls(self, component: str) -> set[str]:
        """Ids of the API calls on a component (``"env"``, ``"buffer"``, ...)."""
        from msrl.api import API

        _known("a component of the API", [component], {spec.component for spec in API.values()})
        return {s.id for s in self.statements if s.kind == "api" and s.api.component == component}

    def downstream_of(self, roots: Iterable[str]) -> set[str]:
        """``roots`` and every statement that depends on them within one iteration (data, not carried)."""
        import networkx as nx

        within = nx.DiGraph((u, v) for u, v, d in self.fdg.edges(data=True) if d["kind"] == "data" and not d["carry"])
        roots = set(roots)
        out = set(roots)
        for r in roots:
            if r in within:
                out |= nx.descendants(within, r)
        return out

    def roles(self, role: Callable[[Any], str]) -> dict[str, str]:
        """``{statement id: role(statement)}`` for every statement."""
        return {s.id: role(s) for s in self.statements}
