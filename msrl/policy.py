"""Distribution policies: data (a pydantic model) plus a small function over the FDG.

A policy says which fragment every statement of the loop belongs to (``assign``), what fragments exist
with their replica counts and placement (``fragments``) and which communication op goes on each cut edge
(``comm_op``). The compiler does the rest: it splits the FDG, inserts the communication nodes and lowers
each fragment. A user's policy subclasses :class:`Policy` and registers with ``@msrl.register_policy``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    from msrl.compiler.ir import Stmt


class FragmentSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    replicas: int = 1
    backend: str = "jax"
    device: str | None = None
    jit: bool = True  # lower `for range` loops to lax.scan and jit the fragment


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

    def comm_op(self, var: str, src: FragmentSpec, dst: FragmentSpec) -> str:
        """The communication op for a value crossing from fragment ``src`` to ``dst``."""
        if var == "@params":
            return "broadcast"
        if src.replicas > 1 and dst.replicas == 1:
            return "gather"
        if src.replicas == 1 and dst.replicas > 1:
            return "scatter"
        return "send"


def downstream_of(fdg: Any, roots: set[str]) -> set[str]:
    """``roots`` and every statement that depends on them within one iteration (data edges, not carried)."""
    import networkx as nx

    within = nx.DiGraph((u, v) for u, v, d in fdg.edges(data=True) if d["kind"] == "data" and not d["carry"])
    out = set(roots)
    for r in roots:
        if r in within:
            out |= nx.descendants(within, r)
    return out
