"""Split the FDG by a policy: fragments, cut edges and the communication nodes on them."""

from __future__ import annotations

import dataclasses

import networkx as nx

from msrl.compiler.ir import Stmt, leaves
from msrl.errors import CompileError
from msrl.policy import FragmentSpec, Policy


@dataclasses.dataclass(frozen=True)
class Comm:
    """A communication node: ``var`` defined at statement ``src`` flows from fragment ``src_fragment`` to
    ``dst_fragment``. It is sent right after ``point`` and received at the same point of the consumer's
    program (both run the same loop skeleton): a value made in a loop but used after it crosses once."""

    id: str
    op: str
    var: str
    src: str
    src_fragment: str
    dst_fragment: str
    point: str  # the statement (or loop) after which it happens: src, hoisted out of loops the use is not in
    along: str = "env"  # gather/scatter along each leaf's env axis, or along the leading (batch) axis
    every: int = 1  # it crosses every `every`-th iteration only (the receiver keeps the last value in between)
    lag: int = 0  # the receiver's iteration i takes the sender's value of iteration i - lag


@dataclasses.dataclass
class Partition:
    fragments: dict[str, FragmentSpec]
    assign: dict[str, str]  # leaf statement id -> fragment name
    comms: list[Comm]


def partition(stmts: list[Stmt], fdg: nx.MultiDiGraph, policy: Policy) -> Partition:
    fragments = {f.name: f for f in policy.fragments()}
    assign = policy.assign(stmts, fdg)
    by_id = {s.id: s for s in leaves(stmts)}
    for sid, s in by_id.items():
        if assign.get(sid) not in fragments:
            raise CompileError(
                f"policy {policy.name!r} placed `{s.source}` in fragment {assign.get(sid)!r}, "
                f"which is not one of its fragments ({', '.join(fragments)})", s.file, s.line)

    # loops belong to every fragment with a statement inside them
    for n, data in fdg.nodes(data=True):
        data["fragment"] = assign.get(n)
    for n, data in fdg.nodes(data=True):
        if data["kind"] == "loop":
            inside = sorted({assign[d] for d in assign if _inside(fdg, d, n)})
            data["fragment"] = ",".join(inside)

    comms: dict[tuple[str, str, str], Comm] = {}
    for u, v, var, data in list(fdg.edges(keys=True, data=True)):
        fu, fv = fdg.nodes[u]["fragment"], fdg.nodes[v]["fragment"]
        if u not in assign or fu == fv:
            continue
        if data["kind"] == "state":
            s, t = by_id[u], by_id[v]
            raise CompileError(
                f"policy {policy.name!r} splits the state of component '{var[1:]}' between fragments {fu!r} "
                f"(`{s.source}`, {s.where}) and {fv!r} (`{t.source}`, {t.where})", t.file, t.line,
                "a component's state lives in one fragment; cut elsewhere")
        point = _exit_point(fdg, u, v)
        key = (point, var, fv)
        if key not in comms:
            src, dst = fragments[fu], fragments[fv]
            comms[key] = Comm(f"c{len(comms) + 1}", policy.comm_op(var, src, dst), var, u, fu, fv, point,
                              policy.comm_axis(var, src, dst), policy.comm_every(var, src, dst),
                              policy.comm_lag(var, src, dst))
            c = comms[key]
            fdg.add_node(c.id, kind="comm", op=c.op, fragment=f"{fu}->{fv}", parent=fdg.nodes[point]["parent"],
                         text=f"{c.op} {var}", file=None, line=None)
            fdg.add_edge(u, c.id, key=var, **{**data, "carry": False})
        fdg.add_edge(comms[key].id, v, key=var, **data)
        fdg.remove_edge(u, v, key=var)
    return Partition(fragments, assign, list(comms.values()))


def _exit_point(fdg: nx.MultiDiGraph, u: str, v: str) -> str:
    """``u`` or the outermost loop around it that does not also contain ``v``."""
    point = u
    while fdg.nodes[point]["parent"] is not None and not _inside(fdg, v, fdg.nodes[point]["parent"]):
        point = fdg.nodes[point]["parent"]
    return point


def _inside(fdg: nx.MultiDiGraph, node: str, loop: str) -> bool:
    parent = fdg.nodes[node]["parent"]
    while parent is not None:
        if parent == loop:
            return True
        parent = fdg.nodes[parent]["parent"]
    return False
