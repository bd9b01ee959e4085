"""The fragmented dataflow graph: a ``networkx.MultiDiGraph`` over the IR's statements.

Nodes are API call sites, compute statements, loops and the return; after partition, communication nodes.
Edges come from reaching definitions and carry what flows: ``data`` (a variable, with shape and dtype),
``state`` (a component's state threaded from one call to the next) or ``params`` (the learner's policy
parameters flowing to the actor: where a weight broadcast goes). Edges closing a loop iteration are
marked ``carry``.
"""

from __future__ import annotations

from typing import Any

import jax
import networkx as nx

from msrl.compiler.ir import Stmt, is_state


def edge_kind(var: str) -> str:
    if var == "@params":
        return "params"
    return "state" if is_state(var) else "data"


def describe(value: Any) -> tuple[Any, str]:
    """(shape, dtype) of a recorded value for an edge: an array's own, or a pytree's leaves in short form."""
    if value is None:
        return None, "none"
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return list(value.shape), str(value.dtype)
    leaves = jax.tree.leaves(value)
    if not leaves:
        return None, type(value).__name__

    def short(x: Any) -> str:
        if hasattr(x, "shape"):
            return f"{x.dtype}{list(x.shape)}"
        return type(x).__name__

    return [short(x) for x in leaves], f"{type(value).__name__}"


def build_fdg(stmts: list[Stmt], shapes: dict[tuple[str, str], Any] | None = None) -> nx.MultiDiGraph:
    shapes = shapes or {}
    g = nx.MultiDiGraph()

    def add_node(s: Stmt) -> None:
        attrs = dict(kind=s.kind, file=s.file, line=s.line, text=s.source, parent=s.parent)
        if s.kind == "api":
            attrs["api"] = s.api.name
            attrs["component"] = s.api.component
        if s.kind == "loop":
            attrs["trip_count"] = s.trip_count
            attrs["var"] = s.var
        g.add_node(s.id, **attrs)

    def add_edge(src: str, dst: str, var: str, carry: bool) -> None:
        if g.has_edge(src, dst, key=var):
            return
        shape, dtype = describe(shapes[(src, var)]) if (src, var) in shapes else (None, None)
        g.add_edge(src, dst, key=var, kind=edge_kind(var), name=var, shape=shape, dtype=dtype, carry=carry)

    def reach(block: list[Stmt], cur: dict[str, set[str]], second_pass: bool) -> dict[str, set[str]]:
        cur = {k: set(v) for k, v in cur.items()}
        for s in block:
            if s.kind == "loop":
                if not second_pass:
                    add_node(s)
                entry = {**cur, s.var: {s.id}} if s.var else cur
                end = reach(s.body, entry, second_pass)
                merged = {k: entry.get(k, set()) | end.get(k, set()) for k in set(entry) | set(end)}
                cur = reach(s.body, merged, True)  # the second pass adds the loop-carried edges
                continue
            if not second_pass:
                add_node(s)
            for var in sorted(s.uses):  # sorted: every process numbers edges and comm nodes alike
                for d in sorted(cur.get(var, ())):
                    add_edge(d, s.id, var, carry=second_pass and not g.has_edge(d, s.id, key=var))
            for var in s.defs:
                cur[var] = {s.id}
        return cur

    # train_step itself repeats: a second pass links the end of an iteration to the start of the next
    # (this is where the learner's new parameters reach the actor, and env state wraps around)
    reach(stmts, reach(stmts, {}, False), True)
    return g
