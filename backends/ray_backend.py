"""The ``ray`` backend: every fragment replica is a Ray actor, in its own process, on any node.

Each actor compiles the program itself from the same recipe (algorithm, policy, env; one ``ray.put`` for
all of them), so it holds its fragment's jitted functions and state. Replicas talk to each other directly:
a send is queued and flushed as one ``deliver`` call to the receiving actor just before the sender next
blocks on a receive (or at the end of its iteration), so everything a replica sends a peer in one step
arrives together. Large arrays in a delivery travel through the object store (numpy leaves, pickled out of
band: no per-array copies in Python); a broadcast is one ``ray.put`` whose reference every receiver gets.
Messages carry (iteration, count): a receiver waits for exactly the messages its own step expects.

A jitted fragment with several replicas and no comms (``multi_learner``) is one SPMD program: its replicas
join one ``jax.distributed`` group (gloo collectives on CPU, replica 0 coordinates) and step together over a
mesh of one device per process, so the learner's all-reduce runs across the processes.

Fault tolerance: a replica that exchanges data with its peers once per iteration (all its sends before its
receives or after them, none inside a loop) and holds no learner is restartable. When its process dies Ray
restarts it (up to ``policy.max_actor_restarts``); it resumes at the first iteration its receivers have not
seen, with the parameters the learner broadcast for it and freshly initialized environments and keys. The
learner never loses an update. A learner that dies ends the run with a :class:`TrainingError`.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
import warnings
from typing import Any

import jax
import numpy as np

from msrl import services
from msrl.backend import (Backend, Runtime, check_comms, concat_along, gather_receiver, gather_senders,
                          mean_metrics, policy_lag, replica_env_ids, replicated, result_metrics, split_along,
                          stats_fn)
from msrl.compiler.ir import walk
from msrl.compiler.lower import materialize, reraise_at_user_line
from msrl.components import episode_metrics
from msrl.errors import CompileError, ConfigError, TrainingError

_POLL_S = 0.05
_INLINE_BYTES = 100 * 1024  # Ray passes task arguments up to this size inline, without the object store


def _numpy(tree: Any) -> Any:
    return jax.tree.map(np.asarray, tree)


def _nbytes(tree: Any) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))


class _Stopped(Exception):
    """Raised in a replica blocked on a receive when the run is being stopped."""


class _Endpoint:
    def __init__(self, worker: "FragmentWorker", comm: Any):
        self.worker, self.comm = worker, comm

    def send(self, value: Any) -> None:
        self.worker.send(self.comm, value)

    def recv(self) -> Any:
        return self.worker.recv(self.comm)


class FragmentWorker:
    """One fragment replica (the body of a Ray actor)."""

    def __init__(self, recipe: bytes, name: str, replica: int, seed: int, env_ids: Any, driver: dict,
                 spmd: bool = False):
        for path in reversed(driver["sys_path"]):  # the driver's modules (the algorithm's file) import here too
            if path not in sys.path:
                sys.path.insert(0, path)
        if driver["compile_cache"]:
            jax.config.update("jax_compilation_cache_dir", driver["compile_cache"])
        self.recipe, self.driver = recipe, driver
        self.key, self.replica, self.seed, self.env_ids = (name, replica), replica, seed, env_ids
        if not spmd:  # else the driver calls setup() once it knows where the group's coordinator is
            self.setup()

    def setup(self, group: dict | None = None) -> None:
        """Compile the program and initialize this replica's state. ``group`` (a fragment whose replicas
        are one SPMD program): join the other replicas' JAX processes first, so collectives span them."""
        import cloudpickle

        from msrl.compiler import compile as compile_program

        if group is not None:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
            jax.distributed.initialize(group["coordinator"], num_processes=group["size"], process_id=self.replica)
        self.program = compile_program(*cloudpickle.loads(self.recipe))
        if fingerprint(self.program) != self.driver["fingerprint"]:
            raise TrainingError("this process compiled the training loop differently from the driver (are msrl and "
                                "the algorithm's code the same version on every node?)")
        name = self.key[0]
        self.frag = self.program.fragments[name]
        self.comms = {c.id: c for c in self.program.partition.comms}
        self.replicas = {f.name: f.spec.replicas for f in self.program.fragments.values()}
        self.peers: dict[tuple[str, int], Any] = {}
        self.cond = threading.Condition()
        self.box: dict[tuple, Any] = {}  # (comm id, sender replica, iteration, count) -> value
        self.highest: dict[tuple[str, int], int] = {}  # sender -> highest iteration delivered from it
        self.sent: dict[tuple[str, int], Any] = {}  # (comm id, iteration) -> broadcast ref (kept for restarts)
        self.pending: dict[tuple[str, int], list] = {}
        self.in_flight: list[Any] = []
        self.stopped = False
        self.start = self.iteration = 0
        self.counts: dict[str, int] = {}
        self.last: dict[str, Any] = {}  # comm id -> the last value received (comms that skip iterations)
        self.params_from: tuple[Any, str] | None = None
        endpoints = {cid: _Endpoint(self, c) for cid, c in self.comms.items()}
        fn = materialize(self.frag.lowered, {**self.frag.namespace, "_msrl_comm": endpoints})
        self.group = _Group(fn, self.program.env) if group is not None else None
        self.fn = jax.jit(fn) if self.frag.mode == "scan" else fn
        self.env_stats = stats_fn(self.program.env)
        self.state = self.program.init_states(self.frag.state_keys, self.seed, self.env_ids)
        if self.group is not None:
            self.state = self.group.spread(self.state)

    def coordinator(self) -> str:
        """An address (this node, a free port) where this replica can coordinate its SPMD group."""
        import socket

        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"{ray.util.get_node_ip_address()}:{port}"

    # ------------------------------------------------------------------------------ driver calls
    def where(self) -> tuple[str, int]:
        import ray

        return ray.get_runtime_context().get_node_id(), os.getpid()

    def connect(self, peers: dict[tuple[str, int], Any], hosts: dict[str, Any]) -> None:
        self.peers = peers
        for name, host in hosts.items():  # the policy's services, each a Ray actor
            self.program.services[name].target = host

    def resume(self, peers: dict, iteration: int, params_from: tuple[Any, str] | None, iterations: int) -> list:
        """After a restart: continue at ``iteration`` with fresh environments and keys and the parameters
        the learner broadcast for it (fetched when the run starts, so the driver never waits on it)."""
        self.peers, self.params_from = peers, params_from
        with self.cond:
            self.start = self.iteration = iteration
            self.box = {k: v for k, v in self.box.items() if k[2] >= iteration}
        self.state = self.program.init_states(self.frag.state_keys, self.seed, self.env_ids, fold=iteration)
        return self.run(iterations)

    def run(self, iterations: int) -> list[tuple[int, Any, Any]]:
        """``iterations`` steps of the fragment: (iteration, env statistics, loop result) of each."""
        import ray

        if self.params_from is not None and self.iteration > 0:
            sender, cid = self.params_from
            comm = self.comms[cid]  # the last iteration before this one that sent its parameters
            sent = (self.iteration - 1 - comm.lag) // comm.every * comm.every
            if sent >= 0:
                (params,) = ray.get(sender.sent_value.remote(cid, sent))
                params = ray.get(params) if isinstance(params, ray.ObjectRef) else params
                self.state["params"] = self.last[cid] = params
        self.params_from = None
        out = []
        try:
            for _ in range(iterations):
                self.counts = {}
                try:
                    if self.group is None:
                        self.state, result = self.fn(self.state)
                        stats = self.env_stats(self.state["env"]) if "env" in self.state else None
                    else:
                        self.state, (result, stats) = self.group(self.state)
                except _Stopped:
                    raise
                except Exception as e:  # noqa: BLE001 - reported at the user's line
                    reraise_at_user_line(e, [self.frag.lowered], "running")
                self.flush()
                out.append((self.iteration, _numpy(stats), _numpy(result)))
                self.iteration += 1
        except _Stopped:
            pass
        return out

    def deliver(self, sender: tuple[str, int], iteration: int, messages: list) -> None:
        with self.cond:
            if iteration < self.start:  # sent to this replica before it was restarted
                return
            for cid, count, value in messages:
                self.box[(cid, sender[1], iteration, count)] = value
            self.highest[sender] = max(self.highest.get(sender, -1), iteration)
            self.cond.notify_all()

    def received_through(self, sender: tuple[str, int]) -> int:
        with self.cond:
            return self.highest.get(sender, -1)

    def sent_value(self, cid: str, iteration: int) -> list:
        with self.cond:
            while (cid, iteration) not in self.sent:
                if self.stopped:
                    raise _Stopped
                self.cond.wait(_POLL_S)
            return [self.sent[(cid, iteration)]]

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()

    def _host(self, tree: Any) -> Any:
        """Part of this replica's state as numpy arrays (its own shard, in an SPMD group)."""
        return self.group.local(tree) if self.group is not None else _numpy(tree)

    def get_state(self, skip: tuple[str, ...] = ()) -> dict:
        return self._host({k: v for k, v in self.state.items() if k not in skip})

    def set_state(self, state: dict) -> None:
        self.state = {**self.state, **(self.group.spread(state) if self.group is not None else state)}

    def params(self) -> Any:
        return self.program.components["learner"].policy_params(self._host(self.state["learner"]))

    # ------------------------------------------------------------------------------ the comm ops
    def _count(self, cid: str) -> int:
        self.counts[cid] = self.counts.get(cid, -1) + 1
        return self.counts[cid]

    def _due(self, comm: Any) -> bool:
        """Whether ``comm`` transfers this iteration (every ``comm.every``-th; else the receiver keeps the
        last value it got)."""
        return self.iteration % comm.every == 0

    def send(self, comm: Any, value: Any) -> None:
        import ray

        if not self._due(comm):
            return
        count, value = self._count(comm.id), _numpy(value)
        dst, n = comm.dst_fragment, self.replicas[comm.dst_fragment]
        if comm.op == "broadcast":
            # big values: one ray.put, every receiver fetches the same object; small ones ride inline
            ref = ray.put(value) if _nbytes(value) > _INLINE_BYTES else value
            with self.cond:
                self.sent[(comm.id, self.iteration)] = ref
                self.sent.pop((comm.id, self.iteration - 2 * comm.every - comm.lag), None)
                self.cond.notify_all()
            parts = {r: ref for r in range(n)}
        elif comm.op == "scatter":
            parts = dict(enumerate(split_along(value, n, self.program.comm_axes(comm))))
        else:  # gather to the replica whose group this one is in; send pairs replica i with replica i
            parts = {gather_receiver(self.replica, self.replicas[comm.src_fragment], n)
                     if comm.op == "gather" else self.replica: value}
        for r, part in parts.items():
            self.pending.setdefault((dst, r), []).append((comm.id, count, part))

    def recv(self, comm: Any) -> Any:
        import ray

        if not self._due(comm):
            return self.last[comm.id]
        if self.iteration < comm.lag:  # nothing sent that early: the value this replica holds
            return self.state[comm.var.lstrip("@")]
        self.flush()
        count = self._count(comm.id)
        senders = gather_senders(self.replica, self.replicas[comm.src_fragment], self.replicas[self.key[0]]) \
            if comm.op == "gather" else [self.replica] if comm.op == "send" else [0]
        keys = [(comm.id, s, self.iteration - comm.lag, count) for s in senders]
        with self.cond:
            while not all(k in self.box for k in keys):
                if self.stopped:
                    raise _Stopped
                self.cond.wait(_POLL_S)
            values = [self.box.pop(k) for k in keys]
        if isinstance(values[0], ray.ObjectRef):
            value = ray.get(values[0])
        else:
            value = concat_along(values, self.program.comm_axes(comm)) if comm.op == "gather" else values[0]
        self.last[comm.id] = value
        return value

    def flush(self) -> None:
        """Deliver everything queued, one call per receiving replica; reap finished deliveries (a failed
        one means the receiver died: the driver restarts it, and it resumes from what it had)."""
        import ray

        for dst, messages in self.pending.items():
            self.in_flight.append(self.peers[dst].deliver.remote(self.key, self.iteration, messages))
        self.pending = {}
        if len(self.in_flight) < 32:
            return
        done, self.in_flight = ray.wait(self.in_flight, num_returns=len(self.in_flight), timeout=0)
        for ref in done:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:
                pass


class _Group:
    """A fragment's replicas as one jitted program over their processes (one device each), so the
    all-reduce inside runs across them (gloo on CPU). Each replica keeps its state as its shard of the
    group's arrays; ``local`` reads its own part."""

    def __init__(self, fn: Any, env: Any):
        from jax.sharding import Mesh, NamedSharding, PartitionSpec

        devices = [min((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)
                   for p in range(jax.process_count())]
        mesh = Mesh(np.array(devices), ("processes",))
        self.sharding, self.device = NamedSharding(mesh, PartitionSpec("processes")), devices[jax.process_index()]

        def with_stats(state: Any) -> Any:
            state, result = fn(state)
            return state, (result, env.stats(state["env"]) if "env" in state else None)

        self.step = jax.jit(replicated(with_stats, mesh), donate_argnums=0)

    def __call__(self, state: Any) -> tuple[Any, Any]:
        """One step: the group's new state, and this replica's (loop result, env statistics)."""
        state, out = self.step(state)
        return state, self.local(out)

    def spread(self, state: Any) -> Any:
        """This replica's state as its shard of the group's arrays."""
        n = self.sharding.mesh.size
        return jax.tree.map(lambda x: jax.make_array_from_single_device_arrays(
            (n, *np.shape(x)), self.sharding, [jax.device_put(np.asarray(x)[None], self.device)]), state)

    def local(self, tree: Any) -> Any:
        return jax.tree.map(lambda x: np.asarray(x.addressable_data(0))[0], tree)


def spmd(fragment: Any) -> bool:
    """Whether the replicas of ``fragment`` run as one program (a jitted fragment with several replicas and
    no comms: ``multi_learner``), each a JAX process of one ``jax.distributed`` group."""
    return fragment.spec.replicas > 1 and fragment.mode == "scan"


def fingerprint(program: Any) -> str:
    """What every process must agree on: the fragments' code and the comm nodes."""
    import hashlib

    return hashlib.sha256((program.code() + repr(program.partition.comms)).encode()).hexdigest()


def restartable(fragment: Any) -> str | None:
    """Why a replica of ``fragment`` cannot be restarted after its process dies (None: it can)."""
    if "learner" in fragment.state_keys:
        return "it holds the learner"
    comm = [s for s in walk(fragment.stmts) if s.kind in ("send", "recv")]
    if any(s.parent for s in comm):
        return "it exchanges data inside its loop, so a restart could not rejoin its peers mid-iteration"
    kinds = "".join("s" if s.kind == "send" else "r" for s in comm)
    if "s" not in kinds:
        return "it sends nothing, so where to resume is unknown"
    if re.search("s.*r.*s", kinds):
        return "it sends both before and after a receive within an iteration"
    return None


class RayRuntime(Runtime):
    def __init__(self, program: Any, seed: int, iterations_per_dispatch: int):
        import cloudpickle
        import ray

        check_comms(program)
        self.program, self.policy = program, program.policy
        self.iteration = 0
        self.restarts: dict[tuple[str, int], int] = {}
        self.unrestartable = {name: restartable(f) for name, f in program.fragments.items()}
        self.workers: dict[tuple[str, int], Any] = {}
        self.hosts: dict[str, Any] = {}  # the policy's services, by name
        splits = {name: replica_env_ids(program.num_envs, frag) for name, frag in program.fragments.items()}
        recipe = cloudpickle.dumps((program.algorithm, self.policy, program.env, program.num_envs))  # ~2 KB
        driver = {"sys_path": [p for p in sys.path if p], "compile_cache": jax.config.jax_compilation_cache_dir,
                  "fingerprint": fingerprint(program)}
        self.owns_connection = _connect(self.policy, program)
        try:
            _check_resources(program)
            for name, frag in program.fragments.items():
                spec = frag.spec
                cls = ray.remote(FragmentWorker).options(
                    num_cpus=spec.num_cpus, num_gpus=spec.num_gpus, max_concurrency=4, max_task_retries=0,
                    max_restarts=0 if self.unrestartable[name] else self.policy.max_actor_restarts,
                    scheduling_strategy="SPREAD",
                    enable_task_events=False)  # else the GCS keeps an event for every delivery (memory grows)
                for r, env_ids in enumerate(splits[name]):
                    self.workers[(name, r)] = cls.remote(recipe, name, r, seed, env_ids, driver, spmd(frag))
                if spmd(frag):  # one jax.distributed group, coordinated by replica 0
                    group = {"coordinator": ray.get(self.workers[(name, 0)].coordinator.remote()),
                             "size": spec.replicas}
                    ray.get([self.workers[(name, r)].setup.remote(group) for r in range(spec.replicas)])
            host = ray.remote(services.ServiceHost).options(num_cpus=0, enable_task_events=False)
            for name, service in program.services.items():
                service.target = self.hosts[name] = host.remote(cloudpickle.dumps(service.make), seed)
            ray.get([w.connect.remote(self.workers, self.hosts) for w in self.workers.values()])
            self.where_ = dict(zip(self.workers, ray.get([w.where.remote() for w in self.workers.values()]),
                                   strict=True))
        except BaseException as e:
            self.close()
            if isinstance(e, ray.exceptions.RayError):
                raise TrainingError(f"a fragment replica could not start:\n{e}\n(on ray, the algorithm's module "
                                    "must be importable on every node)") from None
            raise

    def where(self) -> dict[tuple[str, int], tuple[str, int]]:
        """(node id, process id) of every replica."""
        return dict(self.where_)

    def run(self, iterations: int) -> list[dict[str, float]]:
        import ray

        target = self.iteration + iterations
        running = {w.run.remote(iterations): key for key, w in self.workers.items()}
        stats: dict[int, list] = {}
        results: dict[int, list[dict[str, float]]] = {}  # the loop's metrics, of every replica returning them
        try:
            while running:
                (ref,), _ = ray.wait(list(running), num_returns=1)
                key = running.pop(ref)
                try:
                    out = ray.get(ref)
                except ray.exceptions.RayActorError as e:  # its process died
                    running[self._recover(key, target, e)] = key
                    continue
                except ray.exceptions.RayTaskError as e:
                    if isinstance(e.cause, (ConfigError, CompileError)):  # bad input, found while running
                        raise e.cause from None
                    raise TrainingError(f"fragment {key[0]!r} replica {key[1]} failed:\n{e}") from None
                for it, st, result in out:
                    if st is not None:
                        stats.setdefault(it, []).append(st)
                    if any(s.kind == "return" for s in self.program.fragments[key[0]].stmts):
                        results.setdefault(it, []).append(result_metrics(result))
        except BaseException:
            self.close()
            raise
        counters = services.metrics(self.program.services)  # as of the end of these iterations
        rows = [{**episode_metrics(stats.get(it, [])), **mean_metrics(results.get(it, [])),
                 **policy_lag(self.program, it), **counters} for it in range(self.iteration, target)]
        self.iteration = target
        return rows

    def _recover(self, key: tuple[str, int], target: int, error: Exception) -> Any:
        """A replica's process died: wait for Ray to restart it, then resume it; its new ``run`` reference."""
        import ray

        name, replica = key
        why = self.unrestartable[name]
        while why is None:
            try:
                node, pid = ray.get(self.workers[key].where.remote())
                break
            except ray.exceptions.ActorUnavailableError:  # restarting
                time.sleep(_POLL_S)
            except ray.exceptions.RayActorError as e:
                why, error = f"Ray gave up on it after policy.max_actor_restarts={self.policy.max_actor_restarts}", e
        else:
            raise TrainingError(f"fragment {name!r} replica {replica} died and cannot be restarted: {why}"
                                f"\n{type(error).__name__}: {str(error).splitlines()[0]}")
        if self.where_[key] != (node, pid):
            self.where_[key] = (node, pid)
            self.restarts[key] = self.restarts.get(key, 0) + 1
        return self._resume(key, target)

    def _resume(self, key: tuple[str, int], target: int) -> Any:
        """Resume a restarted replica at the first iteration its receivers lack; its new ``run`` reference."""
        import ray

        name, replica = key
        comms = self.program.partition.comms
        frags = self.program.fragments
        receivers = {(c.dst_fragment, gather_receiver(replica, frags[name].spec.replicas,
                                                      frags[c.dst_fragment].spec.replicas)
                      if c.op == "gather" else replica) for c in comms if c.src_fragment == name}
        resume_at = min(ray.get([self.workers[r].received_through.remote(key) for r in receivers])) + 1
        params = next(((self.workers[(c.src_fragment, 0)], c.id) for c in comms
                       if c.dst_fragment == name and c.var == "@params"), None)
        return self.workers[key].resume.remote(self.workers, resume_at, params, target - resume_at)

    def state(self) -> dict[str, list[dict]]:
        return self.snapshot()

    def snapshot(self, skip: tuple[str, ...] = ()) -> dict[str, list[dict]]:
        import ray

        out: dict[str, list[Any]] = {}
        for (name, _), w in self.workers.items():
            out.setdefault(name, []).append(w.get_state.remote(skip))
        return {**{name: ray.get(refs) for name, refs in out.items()}, **services.snapshot(self.program.services)}

    def restore(self, snapshot: dict[str, list[dict]]) -> None:
        import ray

        ray.get([w.set_state.remote(snapshot[name][r]) for (name, r), w in self.workers.items()])
        services.restore(self.program.services, snapshot)

    def params(self) -> Any:
        import ray

        held = services.held_params(self.program)
        if held is not None:
            return held
        key = next(k for k, f in ((k, self.program.fragments[k[0]]) for k in self.workers)
                   if "learner" in f.state_keys)
        return ray.get(self.workers[key].params.remote())

    def close(self) -> None:
        """Kill our actors; leave (and, if we started it, stop) the cluster."""
        import ray

        if not ray.is_initialized():
            return
        for actor in [*self.workers.values(), *self.hosts.values()]:
            ray.kill(actor, no_restart=True)
        self.workers, self.hosts = {}, {}
        for service in self.program.services.values():
            service.target = None
        if self.owns_connection:
            ray.shutdown()
            self.owns_connection = False


def _connect(policy: Any, program: Any) -> bool:
    """Join the running Ray session, ``policy.ray_address``, or start a private cluster on this machine
    (dashboard off unless ``policy.ray_dashboard``). True when this runtime made the connection."""
    import logging

    import ray

    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # nothing leaves this machine
    quiet = {"logging_level": logging.ERROR, "log_to_driver": False, "configure_logging": True}
    if policy.ray_address:
        kwargs = {"address": policy.ray_address}
    else:
        need = sum(f.spec.num_cpus * f.spec.replicas for f in program.fragments.values())
        kwargs = {"address": "local", "num_cpus": max(os.cpu_count() or 1, int(np.ceil(need))),
                  "include_dashboard": policy.ray_dashboard}
    with warnings.catch_warnings():  # Ray's processes are fork+exec'd: JAX's fork warning does not apply
        warnings.filterwarnings("ignore", message="os.fork", category=RuntimeWarning)
        ray.init(**kwargs, **quiet)
    return True


def _check_resources(program: Any) -> None:
    """Fail now, not hang, when the cluster cannot hold every replica at once."""
    import ray

    have = ray.cluster_resources()
    for res, field in (("CPU", "num_cpus"), ("GPU", "num_gpus")):
        need = sum(getattr(f.spec, field) * f.spec.replicas for f in program.fragments.values())
        if need > have.get(res, 0) + 1e-9:
            raise ConfigError("policy.resources", f"the replicas need {need:g} {res}s in all, but the Ray cluster has "
                              f"{have.get(res, 0):g}; lower policy.resources.<role>.{field} (fractions are fine) or "
                              "give the cluster more")


class RayBackend(Backend):
    def build(self, program: Any, seed: int, iterations_per_dispatch: int) -> Runtime:
        return RayRuntime(program, seed, iterations_per_dispatch)
