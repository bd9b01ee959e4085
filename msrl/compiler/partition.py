"""Split the FDG by a policy: fragments, cut edges and the communication nodes on them."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import networkx as nx

from msrl.backend import reduces_over_replicas
from msrl.compiler.ir import Stmt, leaves
from msrl.errors import CompileError, ConfigError
from msrl.plan import AXES, COMM_OPS, CommSpec, FragmentSpec, Loop, Plan
from msrl.policy import Policy, answer, answered_at


def default_op(var: str, senders: int, receivers: int) -> str:
    """The op a cut edge gets by the replica counts: parameters are broadcast; many to one is a gather, one
    to many a scatter, equal counts a send (replica i to replica i)."""
    if var == "@params":
        return "broadcast"
    if senders > 1 and receivers == 1:
        return "gather"
    if senders == 1 and receivers > 1:
        return "scatter"
    return "send"


def _check_link(policy: Policy, var: str, op: str, link: Any, senders: int, receivers: int, src: str, dst: str) -> None:
    fits = {"gather": senders % receivers == 0, "scatter": senders == 1, "broadcast": senders == 1,
            "send": senders == receivers}
    def refuse(text: str) -> None:
        raise ConfigError("policy", f"policy {policy.name!r}: its link() gives `{var}` ({src} -> {dst}) {text}"
                          f"{answered_at(policy, 'link')}")

    if op not in fits:
        refuse(f"the op {op!r}; the ops are {', '.join(COMM_OPS)}")
    if link.axis not in AXES:
        refuse(f"the axis {link.axis!r}; the axes are {', '.join(AXES)}")
    if link.axis == "replicated" and op in ("gather", "scatter"):  # (the axis was ignored: joined by environment)
        refuse(f"the axis 'replicated', but a {op} {'joins' if op == 'gather' else 'splits'} a value along its "
               "environments (axis 'env'); 'replicated', the same on every replica, is the parameters' (a broadcast)")
    if var == "@params" and link.axis != "replicated":  # (it ran as a broadcast without a word)
        refuse(f"the axis {link.axis!r}; the parameters are the same on every replica: 'replicated' (a broadcast)")
    if not fits[op]:
        refuse(f"the op {op!r}, but a {op} cannot connect {senders} {src!r} replicas to {receivers} {dst!r} replicas"
               + (" (the parameters cross from one learner: replicas that learn together act too, in one role, as "
                  "multi_learner's)" if var == "@params" and senders > 1 else ""))
    if link.every < 1 or link.lag < 0:
        refuse(f"every={link.every}, lag={link.lag}: every must be >= 1 and lag >= 0")
    if link.lag > 1:  # (it trained, then no checkpoint of it could be resumed)
        refuse(f"lag={link.lag}: the parameters may arrive at most 1 iteration late (a checkpoint holds the "
               "learner's last parameters, so a resumed run can send those again, not older ones)")
    if link.lag and link.every > 1:  # (it waited for what was never sent until the stall timeout)
        refuse(f"every={link.every} with lag={link.lag}: each iteration that receives the parameters (one in "
               f"{link.every}) would wait for those sent in the iteration before, which sends none; set every=1 or "
               "lag=0")
    late = f"lag={link.lag}" if link.lag else f"every={link.every}" if link.every > 1 else ""
    if late and var != "@params":
        refuse(f"{late}: only the parameters (@params) may arrive late or skip iterations (an iteration's value from "
               "before the first does not exist); a value of the loop crosses in its own iteration")


def assign_roles(stmts: list[Stmt], fdg: nx.MultiDiGraph, policy: Policy) -> tuple[dict[str, FragmentSpec], dict[str, str]]:
    """The policy's roles and the role of every leaf statement, checked."""
    fragments = {f.name: f for f in answer(policy, "fragments")}
    for f in fragments.values():
        if f.replicas < 1:
            raise ConfigError("policy", f"policy {policy.name!r} gives its role {f.name!r} {f.replicas} replicas in "
                              "its fragments(); a role runs at least 1 (where a policy key counts them, it must be "
                              "> 0)")
    assign = answer(policy, "assign", Loop(list(leaves(stmts)), fdg))
    ids = [s.id for s in leaves(stmts)]
    stray = sorted(set(assign) - set(ids), key=str)
    if stray:  # (a KeyError inside the compiler)
        raise ConfigError("policy.name", f"policy {policy.name!r}: its assign() places {stray[0]!r}, which is not a "
                          f"statement of the loop (its statements: {', '.join(ids)}; `msrl graph` lists them)")
    for s in leaves(stmts):
        if assign.get(s.id) not in fragments:
            raise CompileError(
                f"policy {policy.name!r} placed `{s.source}` in fragment {assign.get(s.id)!r}, "
                f"which is not one of its fragments ({', '.join(fragments)})" if s.id in assign else
                f"the assign() of policy {policy.name!r} gives `{s.source}` no role (its roles: "
                f"{', '.join(fragments)}); "
                "every statement of the loop has one", s.file, s.line)
    used = set(assign.values())
    idle = [name for name in fragments if name not in used]
    if idle:  # (a policy may mean it: a role some loops need and this one does not)
        print(f"msrl: note: policy {policy.name!r} assigns no statement of the loop to its role"
              f"{'s' * (len(idle) > 1)} {', '.join(map(repr, idle))}: "
              f"{'their' if len(idle) > 1 else 'its'} replicas start and do nothing", file=sys.stderr, flush=True)
    plan = answer(policy, "learner_plan")
    averaged = reduces_over_replicas(plan.grad_transforms) or plan.wrap is not None  # (a wrap: async's holder)
    for s in leaves(stmts):
        f = fragments[assign[s.id]]
        if s.kind == "api" and s.api.name == "agent_learn" and f.replicas == 1 < plan.learner_replicas:
            raise CompileError(  # (the algorithm was told of 2 learners, each on half the envs: SAC's warm-up doubled)
                f"policy {policy.name!r} runs `{s.source}` on its role {f.name!r} of 1 replica, but its learner_plan() "
                f"declares {plan.learner_replicas} learner replicas: the algorithm would size what each learner "
                "sees (Context.learner_envs) for that many", s.file, s.line,
                "LearnerPlan(learner_replicas=N) counts the replicas of the role that runs msrl.agent_learn")
        if s.kind == "api" and s.api.name == "agent_learn" and f.replicas > 1 and \
                (f.replicas != plan.learner_replicas or not averaged):
            declares = (f"declares {plan.learner_replicas} learner replica{'s' * (plan.learner_replicas > 1)}"
                        if f.replicas != plan.learner_replicas else "does not average their gradients")
            raise CompileError(
                f"policy {policy.name!r} runs `{s.source}` on the {f.replicas} replicas of its role {f.name!r}, but "
                f"its learner_plan() {declares}: each replica would learn alone on its own environments and end "
                "with other parameters (the run would report one replica's)", s.file, s.line,
                "replicas that learn together average their gradients: LearnerPlan(learner_replicas=N, "
                "grad_transforms=(msrl.all_reduce_mean(),)), as multi_learner; else give the learner's role 1 replica")
    return fragments, assign


def _sampled(fdg: nx.MultiDiGraph, by_id: dict[str, Stmt]) -> set[str]:
    """The statements that sample a replay buffer (msrl.buffer_sample) and those computed from a sample."""
    found = [n for n, s in by_id.items() if s.kind == "api" and s.api.name == "buffer_sample"]
    seen = set(found)
    while found:
        found = [v for u in found for _, v, data in fdg.out_edges(u, data=True)
                 if data["kind"] == "data" and v in by_id and v not in seen]
        seen.update(found)
    return seen


def _learned_before(fdg: nx.MultiDiGraph, node: str, fragment: str, by_id: dict[str, Stmt]) -> Stmt | None:
    """The nearest ``msrl.agent_learn`` in ``fragment`` whose value ``node`` uses (through data edges), if any."""
    seen, frontier = {node}, [node]
    while frontier:
        nxt = []
        for n in frontier:
            for p, _, data in fdg.in_edges(n, data=True):
                if data["kind"] != "data" or p in seen or p not in by_id:
                    continue
                seen.add(p)
                stmt = by_id[p]
                if stmt.kind == "api" and stmt.api.name == "agent_learn" and fdg.nodes[p]["fragment"] == fragment:
                    return stmt
                nxt.append(p)
        frontier = nxt
    return None


def partition(stmts: list[Stmt], fdg: nx.MultiDiGraph, policy: Policy, fragments: dict[str, FragmentSpec],
              assign: dict[str, str], services: tuple[str, ...] = (), buffer_shards: int = 1) -> Plan:
    """Split ``fdg`` (annotated with shapes) by the roles: a comm node on every cut edge; the frozen plan."""
    by_id = {s.id: s for s in leaves(stmts)}
    samples = any(s.kind == "api" and s.api.name == "buffer_sample" for s in by_id.values())  # a replay buffer
    sampled = _sampled(fdg, by_id)  # (before the cut edges below go through comm nodes)

    # loops belong to every fragment with a statement inside them
    for n, data in fdg.nodes(data=True):
        data["fragment"] = assign.get(n)
    for n, data in fdg.nodes(data=True):
        if data["kind"] == "loop":
            inside = sorted({assign[d] for d in assign if _inside(fdg, d, n)})
            data["fragment"] = ",".join(inside)

    comms: dict[tuple[str, str, str], CommSpec] = {}
    for u, v, var, data in list(fdg.edges(keys=True, data=True)):
        fu, fv = fdg.nodes[u]["fragment"], fdg.nodes[v]["fragment"]
        if u not in assign or fu == fv:
            continue
        if data["kind"] == "state":
            s, t = by_id[u], by_id[v]
            learn = _learned_before(fdg, v, fv, by_id)  # (what placed t on the learner's side, where it is)
            raise CompileError(
                f"policy {policy.name!r} splits the state of component '{var[1:]}' between fragments {fu!r} "
                f"(`{s.source}`, {s.where}) and {fv!r} (`{t.source}`, {t.where})" + (
                    f"; {fv!r} because it uses a value `{learn.source}` ({learn.where}) computes there"
                    if learn else ""), t.file, t.line,
                "a component's state lives in one fragment; " + (
                    "compute that value without what the learner returns, or use single_learner_fine or fused, "
                    "which run the loop whole" if learn and not samples else
                    "a replay buffer that actors fill and the learner samples is policy.name=replay_server's job "
                    "(or single_learner_fine, which keeps the buffer central)" if var == "@buffer" else
                    f"the loop calls the {var[1:]} on both sides of this policy's cut: use a policy that keeps "
                    "those calls together, " + ("" if policy.name == "single_learner_fine" else
                                                 "single_learner_fine (only the environments' steps on its workers) "
                                                 "or ") + "fused"))
        point = _exit_point(fdg, u, v)
        key = (point, var, fv)
        if key not in comms:
            src, dst = fragments[fu], fragments[fv]
            link = answer(policy, "link", var, src, dst)
            if link.axis is None:
                link = dataclasses.replace(link, axis="replicated" if var == "@params" else "env")
            op = link.op or default_op(var, src.replicas, dst.replicas)
            _check_link(policy, var, op, link, src.replicas, dst.replicas, fu, fv)
            if link.axis == "batch" and u not in sampled:
                s = by_id[u]
                raise CompileError(
                    f"policy {policy.name!r} sends `{var}` from {fu!r} to {fv!r} along axis 'batch', but it is not a "
                    "replay buffer's sample: its replicas' rows would be interleaved, not joined by environment",
                    s.file, s.line, "only a sample (msrl.buffer_sample) and what is computed from it has a batch "
                    "axis; a value of the environments crosses along 'env' (the default)")
            comms[key] = c = CommSpec(f"c{len(comms) + 1}", op, var, u, fu, fv, point, link.axis, link.every,
                                      link.lag)
            fdg.add_node(c.id, kind="comm", op=c.op, fragment=f"{fu}->{fv}", parent=fdg.nodes[point]["parent"],
                         text=f"{c.op} {var} ({c.axis}" + (f", every {c.every}" if c.every > 1 else "")
                         + (f", lag {c.lag}" if c.lag else "") + ")", file=None, line=None)
            fdg.add_edge(u, c.id, key=var, **{**data, "carry": False})
        fdg.add_edge(comms[key].id, v, key=var, **data)
        fdg.remove_edge(u, v, key=var)
    return Plan(fragments, assign, tuple(comms.values()), services, buffer_shards)


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
