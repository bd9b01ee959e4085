"""The ``ray`` backend: every fragment replica is a Ray actor, in its own process, on any node.

Each actor compiles the program itself from the same recipe (algorithm, policy, env, and the shapes the driver's
compiler traced; one ``ray.put`` for all of them) and runs its replica's driver (:mod:`msrl.runtime.driver`). The
transport: a delivery is one ``deliver`` call on the receiving actor; its arrays travel as numpy (pickled out of
band, through the object store when large); a broadcast is one ``ray.put`` whose reference every receiver gets.

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

import contextlib
import logging
import os
import re
import subprocess
import sys
import threading
import time
import warnings
from typing import Any

import jax
import numpy as np
import ray
from ray import cloudpickle  # not the cloudpickle package: from 3.1.3 it renames code pickled by value (a script's
# classes) to "<dynamic-code>", and every process compiles the loop from the source in the file it names
from ray._private.services import canonicalize_bootstrap_address
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from msrl import services
from msrl.backend import Backend, gather_receiver, replica_env_ids, replicated
from msrl.compiler.ir import walk
from msrl.errors import CALLBACK_LOGS, ConfigError, MsrlError, TrainingError
from msrl.registry import USER_MODULES, import_user_module
from msrl.runtime.driver import POLL_S, STOP_GRACE_S, WATCH_S, ReplicaDriver, ReplicaRuntime, Transport, fragment_fn

FORWARD_S = 0.5  # Ray's log monitor reads the replicas' output every 0.1 s; publishing it to the driver takes more
_INLINE_BYTES = 100 * 1024  # Ray passes task arguments up to this size inline, without the object store


def _numpy(tree: Any) -> Any:
    return jax.tree.map(np.asarray, tree)


class ToPeers(Transport):
    """Deliveries as calls on the peers' actors; finished calls are reaped now and then (a failed one means
    the receiver died: the driver restarts it, and it resumes from what it had)."""

    def __init__(self) -> None:
        self.peers: dict[tuple[str, int], Any] = {}
        self.in_flight: list[Any] = []

    def deliver(self, dst, sender, iteration, messages) -> None:
        messages = [(cid, n, v if isinstance(v, ray.ObjectRef) else _numpy(v)) for cid, n, v in messages]
        self.in_flight.append(self.peers[dst].deliver.remote(sender, iteration, messages))
        if len(self.in_flight) >= 32:
            done, self.in_flight = ray.wait(self.in_flight, num_returns=len(self.in_flight), timeout=0)
            for ref in done:
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError:
                    pass

    def drain(self) -> None:
        in_flight, self.in_flight = self.in_flight, []
        for ref in in_flight:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:  # (the receiver died: it resumes from what it had)
                pass

    def share(self, value: Any) -> Any:  # big values: one ray.put, every receiver fetches the same object
        value = _numpy(value)
        return ray.put(value) if sum(x.nbytes for x in jax.tree.leaves(value)) > _INLINE_BYTES else value

    def fetch(self, value: Any) -> Any:
        return ray.get(value) if isinstance(value, ray.ObjectRef) else value


class _GroupDriver(ReplicaDriver):
    """A replica of a fragment whose replicas are one jitted program over their processes (one device each),
    so the all-reduce inside runs across them (gloo on CPU). It keeps its state as its shard of the group's
    arrays."""

    def __init__(self, program: Any, key: tuple[str, int], *args: Any, **kwargs: Any):
        from jax.sharding import Mesh, NamedSharding, PartitionSpec

        devices = [min((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)
                   for p in range(jax.process_count())]
        mesh = Mesh(np.array(devices), ("processes",))
        self.sharding, self.local_device = NamedSharding(mesh, PartitionSpec("processes")), devices[jax.process_index()]
        fn, env = fragment_fn(program, key[0]), program.env

        def with_stats(state: Any) -> Any:
            state, result = fn(state)
            return state, (result, env.stats(state["env"]) if "env" in state else None)

        self.group_step = jax.jit(replicated(with_stats, mesh), donate_argnums=0)
        super().__init__(program, key, *args, **kwargs)

    def step(self, state: Any) -> tuple[Any, Any, Any]:
        state, (result, stats) = self.group_step(state)
        return state, result, stats

    def place(self, tree: Any) -> Any:
        n = self.sharding.mesh.size
        return jax.tree.map(lambda x: jax.make_array_from_single_device_arrays(
            (n, *np.shape(x)), self.sharding, [jax.device_put(np.asarray(x)[None], self.local_device)]), tree)

    def host(self, tree: Any) -> Any:
        return jax.tree.map(lambda x: np.asarray(x.addressable_data(0))[0] if isinstance(x, jax.Array)
                            else np.asarray(x), tree)


class FragmentWorker:
    """The body of the Ray actor of one fragment replica: its driver, reached by the runtime and peers."""

    def __init__(self, recipe: bytes, key: tuple[str, int], seed: int, env_ids: Any, driver: dict, spmd: bool):
        self.failed: Exception | None = None  # raised by connect(): Ray reports a constructor's error without it
        try:
            self._start(recipe, key, seed, env_ids, driver, spmd)
        except Exception as e:  # noqa: BLE001 - the runtime's first call raises it
            self.failed = e

    def _start(self, recipe: bytes, key: tuple[str, int], seed: int, env_ids: Any, driver: dict, spmd: bool) -> None:
        for stream in (sys.stdout, sys.stderr):  # Ray forwards what the loop prints (jax.debug.print) as it comes
            if hasattr(stream, "reconfigure"):
                stream.reconfigure(line_buffering=True)
        for name, level in driver["log_levels"].items():  # a raising callback's log, as the driver has it (the
            logging.getLogger(name).setLevel(level)  # CLI keeps it for --debug: the error says it in one line)
        for path in reversed(driver["sys_path"]):  # the driver's modules (the algorithm's file) import here too
            if path not in sys.path:
                sys.path.insert(0, path)
        for module in driver["imports"]:  # --import: the user's registrations (envs, algorithms) happen here too
            import_user_module(module)
        if driver["compile_cache"]:  # the driver's cache, as the driver uses it
            jax.config.update("jax_compilation_cache_dir", driver["compile_cache"][0])
            jax.config.update("jax_persistent_cache_min_compile_time_secs", driver["compile_cache"][1])
        self.args, self.transport = (recipe, key, seed, env_ids, driver["fingerprint"]), ToPeers()
        if not spmd:  # else the runtime calls setup() once it knows where the group's coordinator is
            self.setup()

    def setup(self, group: dict | None = None) -> None:
        """Compile the program and initialize this replica. ``group``: join the other replicas' JAX
        processes first, so collectives span them."""
        from msrl.compiler import compile as compile_program

        if self.failed is not None:
            raise self.failed
        recipe, key, seed, env_ids, expected = self.args
        if group is not None:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
            # the coordinator listens on the address its peers are given (not on every interface, jax's default):
            # 127.0.0.1 in a private cluster
            jax.distributed.initialize(group["coordinator"], num_processes=group["size"], process_id=key[1],
                                       coordinator_bind_address=group["coordinator"] if key[1] == 0 else None)
        program = compile_program(*cloudpickle.loads(recipe))
        if fingerprint(program) != expected:
            raise TrainingError("this process compiled the training loop differently from the driver (are msrl and "
                                "the algorithm's code the same version on every node?)")
        self.driver = (_GroupDriver if group else ReplicaDriver)(program, key, seed, env_ids, self.transport)

    def coordinator(self) -> str:
        """An address (this node, a free port) where this replica can coordinate its SPMD group."""
        import socket

        ip = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET) as s:
            s.bind((ip, 0))
            port = s.getsockname()[1]
        return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"

    def where(self) -> tuple[str, int]:
        return ray.get_runtime_context().get_node_id(), os.getpid()

    def __repr__(self) -> str:  # Ray's prefix of the lines this process prints: "(learner 0 pid=...)"
        return " ".join(map(str, self.args[1])) if hasattr(self, "args") else "FragmentWorker"

    def connect(self, peers: dict[tuple[str, int], Any], hosts: dict[str, Any]) -> None:
        if self.failed is not None:
            raise self.failed
        self.transport.peers = peers
        self.quiet_at = self.printed()
        for name, host in hosts.items():  # the policy's services, each a Ray actor
            self.driver.program.services[name].target = host

    def run(self, iterations: int) -> list:
        return self.driver.run(iterations)

    @staticmethod
    def printed() -> int:
        """Bytes this process wrote to its stdout and stderr (Ray's log files, which it forwards to the driver)."""
        sys.stdout.flush()
        sys.stderr.flush()
        return sum(os.fstat(fd).st_size for fd in (1, 2))

    def spoke(self) -> bool:
        """Whether the loop printed something since the replica connected."""
        return self.printed() > self.quiet_at

    def resume(self, peers: dict, hosts: dict, iteration: int, params_from: Any, iterations: int) -> list:
        """After a restart: continue at ``iteration`` with fresh environments and keys and the parameters
        the learner last broadcast before it."""
        self.connect(peers, hosts)
        self.driver.restart(iteration)
        if params_from is not None and iteration > 0:
            sender, cid = params_from
            comm = self.driver.comms[cid]
            sent = comm.sent_for(iteration)
            if sent >= 0:
                params = self.transport.fetch(ray.get(sender.call.remote("sent_value", cid, sent)))
                self.driver.state["params"] = self.driver.last[cid] = params
            if comm.lag and iteration >= comm.lag:  # what it takes at `iteration`, sent to its dead process
                late = iteration - comm.lag
                self.driver.mailbox.put((comm.src_fragment, 0), late,
                                        [(cid, 0, ray.get(sender.call.remote("sent_value", cid, late)))])
        return self.run(iterations)

    def deliver(self, sender: tuple[str, int], iteration: int, messages: list) -> None:
        self.driver.mailbox.put(sender, iteration, messages)

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self.driver, method)(*args)


def spmd(fragment: Any) -> bool:
    """Whether the replicas of ``fragment`` run as one program (a jitted fragment with several replicas and
    no comms: ``multi_learner``), each a JAX process of one ``jax.distributed`` group."""
    return fragment.spec.replicas > 1 and fragment.mode == "scan"


def fingerprint(program: Any) -> str:
    """What every process must agree on: the fragments' code and the comm nodes."""
    import hashlib

    return hashlib.sha256((program.code() + repr(program.plan.comms)).encode()).hexdigest()


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


class RayRuntime(ReplicaRuntime):
    def __init__(self, program: Any, seed: int):
        super().__init__(program, seed)
        self.policy = program.policy
        self.restarts: dict[tuple[str, int], int] = {}
        self.unrestartable = {name: restartable(f) for name, f in program.fragments.items()}
        self.workers: dict[tuple[str, int], Any] = {}
        self.hosts: dict[str, Any] = {}  # the policy's services, by name
        self.dispatching = False  # (a dispatch that does not finish kills the replicas: see at_rest)
        # ~2 KB; the analysis spares each process the compiler's shape probes (the fingerprint checks the result)
        recipe = cloudpickle.dumps((program.algorithm, self.policy, program.env, program.num_envs, program.analysis()))
        cache = jax.config.jax_compilation_cache_dir
        driver = {"sys_path": [p for p in sys.path if p],
                  "compile_cache": cache and (cache, jax.config.jax_persistent_cache_min_compile_time_secs),
                  "fingerprint": fingerprint(program), "imports": list(USER_MODULES),
                  "log_levels": {name: logging.getLogger(name).level for name in CALLBACK_LOGS}}
        _connect(self.policy, program)
        _OPEN.add(id(self))
        try:
            _check_resources(program, release_s=0.0 if _OPEN - {id(self)} else 10.0)  # (not while others hold theirs)
            nodes = _placement(program)
            for name, frag in program.fragments.items():
                spec = frag.spec
                options = dict(num_cpus=spec.num_cpus, num_gpus=spec.num_gpus, max_concurrency=4, max_task_retries=0,
                               max_restarts=0 if self.unrestartable[name] else self.policy.max_actor_restarts,
                               enable_task_events=False)  # else the GCS keeps an event per delivery (memory grows)
                for r, env_ids in enumerate(replica_env_ids(program.num_envs, frag)):  # (soft: a restart goes on
                    where = NodeAffinitySchedulingStrategy(nodes[(name, r)], soft=True)  # another node if its is lost)
                    self.workers[(name, r)] = ray.remote(FragmentWorker).options(**options, scheduling_strategy=where) \
                        .remote(recipe, (name, r), seed, env_ids, driver, spmd(frag))
                if spmd(frag):  # one jax.distributed group, coordinated by replica 0
                    group = {"coordinator": ray.get(self.workers[(name, 0)].coordinator.remote()),
                             "size": spec.replicas}
                    ray.get([self.workers[(name, r)].setup.remote(group) for r in range(spec.replicas)])
            host = ray.remote(services.ServiceHost).options(num_cpus=0, enable_task_events=False)
            for name, service in program.services.items():
                service.target = self.hosts[name] = host.remote(cloudpickle.dumps(service.make), seed,
                                                                driver["sys_path"])
            ray.get([w.connect.remote(self.workers, self.hosts) for w in self.workers.values()])
            self.where_ = dict(zip(self.workers, ray.get([w.where.remote() for w in self.workers.values()]),
                                   strict=True))
        except BaseException as e:
            self.close()
            if isinstance(e, ray.exceptions.RayTaskError) and isinstance(e.cause, MsrlError):
                raise e.cause from None  # what the replica found wrong (an env's observations, say), as on threads
            if isinstance(e, ray.exceptions.RayError):
                cause = e.cause if isinstance(e, ray.exceptions.RayTaskError) and e.cause is not None else e
                raise TrainingError(f"a fragment replica could not start: {type(cause).__name__}: "
                                    f"{_first_line(cause)}\n(a Ray actor imports the "
                                    "modules given to --import, and the driver's sys.path: the algorithm's module, "
                                    "and one that registers what the config names, must be importable there)"
                                    ) from None
            raise

    def where(self) -> dict[tuple[str, int], tuple[str, int]]:
        """(node id, process id) of every replica."""
        return dict(self.where_)

    def _replicas(self) -> dict[tuple[str, int], Any]:
        if not self.workers:  # closed: after a failure its replicas were killed
            raise TrainingError("this session's Ray replicas were stopped after the failure it reported; start a new "
                                "session (or resume the run from its checkpoint)")
        return self.workers

    def at_rest(self) -> bool:
        """Between dispatches (a stream its reader left between chunks): every replica holds the state of the
        last finished iteration. A dispatch that did not finish closed the session's replicas."""
        return bool(self.workers) and not self.dispatching

    def _run(self, iterations: int) -> dict:
        target = self.iteration + iterations
        running = {w.run.remote(iterations): key for key, w in self._replicas().items()}
        self.dispatching = True
        outputs: dict[tuple[str, int], list] = {}
        try:
            while running:
                ready, _ = ray.wait(list(running), num_returns=1, timeout=WATCH_S)
                if not ready:  # the stall watch
                    self.watch(sorted(set(running.values()), key=self.keys.index))
                    continue
                key = running.pop(ready[0])
                try:
                    outputs.setdefault(key, []).extend(ray.get(ready[0]))
                except ray.exceptions.RayActorError as e:  # its process died
                    running[self._recover(key, target, e)] = key
                except ray.exceptions.RayTaskError as e:  # the driver's own report (msrl.runtime.driver)
                    raise (e.cause if e.cause is not None else TrainingError(str(e))) from None
        except BaseException as e:
            self.close()
            if isinstance(e, ray.exceptions.RayError) and not isinstance(e, ray.exceptions.RayTaskError):
                # the cluster itself failed under the replicas (a lost raylet or GCS)
                who = ", ".join(f"{k[0]!r} replica {k[1]}" for k in sorted(set(running.values()) or self.keys,
                                                                           key=self.keys.index))
                raise TrainingError(f"the Ray cluster failed while fragment {who} ran: {type(e).__name__}: "
                                    f"{_first_line(e)}") from None
            raise
        self.dispatching = False
        return outputs

    def collective(self, fragment: Any) -> bool:
        return spmd(fragment)

    def _activities(self, keys: list) -> dict:
        """Each replica's activity; None for one that does not answer within the stall limit (a dead one is
        left out: its ``run`` reference reports it)."""
        refs = {k: self.workers[k].call.remote("activity") for k in keys}
        limit = min(self.stall_timeout_s or STOP_GRACE_S, STOP_GRACE_S if self.stopping() else 5.0)
        found: dict = {}
        deadline = time.monotonic() + limit
        for k, ref in refs.items():
            try:
                found[k] = ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
            except ray.exceptions.GetTimeoutError:
                found[k] = None
            except ray.exceptions.RayError:
                pass
        return found

    def snapshot(self, skip: tuple[str, ...] = ()) -> dict[str, list[dict]]:
        """As the threads backend's, less a host environment's state: its simulators (worker processes, a C++
        pool) stay in their replica's process, and no snapshot or checkpoint holds them."""
        return super().snapshot((*skip, "env") if self.program.env.host_state else skip)

    def _call(self, keys, method: str, *args: Any) -> dict:
        refs = {k: self._replicas()[k].call.remote(method, *args) for k in keys}
        out = {}
        for key, ref in refs.items():
            try:
                out[key] = ray.get(ref)
            except ray.exceptions.RayTaskError as e:  # the driver's own report
                raise (e.cause if e.cause is not None else TrainingError(str(e))) from None
            except ray.exceptions.RayError as e:  # its process, its node or the cluster is gone
                self.close()
                raise TrainingError(f"fragment {key[0]!r} replica {key[1]} could not be reached ({method}): "
                                    f"{type(e).__name__}: {_first_line(e)}") from None
        return out

    def _recover(self, key: tuple[str, int], target: int, error: Exception) -> Any:
        """A replica's process died: wait for Ray to restart it, then resume it at the first iteration its
        receivers lack; its new ``run`` reference."""
        name, replica = key
        why = self.unrestartable[name]
        limit = self.stall_timeout_s or float("inf")
        deadline = time.monotonic() + limit
        while why is None:
            try:
                node, pid = ray.get(self.workers[key].where.remote(),
                                    timeout=None if limit == float("inf") else max(1.0, deadline - time.monotonic()))
                break
            except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError) as e:  # restarting
                if time.monotonic() > deadline:
                    why, error = f"Ray did not restart it within run.stall_timeout_s={limit:g} s", e
                time.sleep(POLL_S)
            except ray.exceptions.RayActorError as e:
                limit, seen = self.policy.max_actor_restarts, self.restarts.get(key, 0)
                why, error = (f"Ray gave up on it after policy.max_actor_restarts={limit}" if seen >= limit else
                              f"Ray will not restart it ({seen} of policy.max_actor_restarts={limit} restarts seen; "
                              "ray.kill, say, ends an actor for good)"), e
        else:
            env = self.program.env
            hosts = "env" in self.program.fragments[name].state_keys and env.host_state and \
                not getattr(env, "subprocesses", 0)
            raise TrainingError(f"fragment {name!r} replica {replica} died and cannot be restarted: {why}"
                                f"\n{type(error).__name__}: {_first_line(error)}" + (
                                    f"\n(its process steps environments {env.spec.id}: one that ends the process, "
                                    "os._exit or a crash in C, ends the replica so; env.subprocesses=N steps them "
                                    "in processes of their own, whose exit names the environment)" if hosts else ""))
        if self.where_[key] != (node, pid):
            self.where_[key] = (node, pid)
            self.restarts[key] = self.restarts.get(key, 0) + 1
        comms, frags = self.program.plan.comms, self.program.fragments
        receivers = {(c.dst_fragment, gather_receiver(replica, frags[name].spec.replicas,
                                                      frags[c.dst_fragment].spec.replicas)
                      if c.op == "gather" else replica) for c in comms if c.src_fragment == name}
        resume_at = min(ray.get([self.workers[r].call.remote("received_through", key)
                                 for r in receivers])) + 1
        ran = (f"iteration {self.iteration}" if resume_at == self.iteration + 1 else
               f"iterations {self.iteration}-{resume_at - 1}")
        lost = (f" (its episodes of {ran} were never reported: the metrics leave them out)"
                if resume_at > self.iteration else "")
        print(f"msrl: note: fragment {name!r} replica {replica}'s process died; Ray restarted it (restart "
              f"{self.restarts.get(key, 0)} of policy.max_actor_restarts={self.policy.max_actor_restarts}), and it "
              f"rejoins at iteration {resume_at}{lost}", file=sys.stderr, flush=True)
        params = next(((self.workers[(c.src_fragment, 0)], c.id) for c in comms
                       if c.dst_fragment == name and c.var == "@params"), None)
        return self.workers[key].resume.remote(self.workers, self.hosts, resume_at, params, target - resume_at)

    def _let_output_arrive(self) -> None:
        """Ray's log monitor forwards what the replicas print from their log files every 0.1 s: where they printed
        anything, a moment for their last lines to reach the driver before the replicas go."""
        refs = [w.spoke.remote() for w in self.workers.values()]
        answered, _ = ray.wait(refs, num_returns=len(refs), timeout=2.0) if refs else ([], [])  # a hung or dead
        # replica does not hold us
        spoke = False
        for ref in answered:
            try:
                spoke = ray.get(ref) or spoke
            except ray.exceptions.RayError:
                pass
        if spoke:
            time.sleep(FORWARD_S)

    def close(self) -> None:
        """Kill our actors; leave the cluster (and stop it if msrl made the connection and no other session of
        this process is open on it)."""
        if not ray.is_initialized():
            return
        self._let_output_arrive()
        for actor in [*self.workers.values(), *self.hosts.values()]:
            ray.kill(actor, no_restart=True)
        self.workers, self.hosts = {}, {}
        for service in self.program.services.values():
            service.target = None
        _OPEN.discard(id(self))
        if not _OPEN and _MADE:
            shutdown()


_OPEN: set[int] = set()  # the open runtimes of this process: the connection msrl made goes with the last
_MADE = False  # whether msrl made this process's Ray connection (else the program's own ray.init did)


def _connect(policy: Any, program: Any) -> None:
    """Join the running Ray session, ``policy.ray_address``, or start a private cluster on this machine
    (loopback only, dashboard off unless ``policy.ray_dashboard``)."""
    global _MADE, _AUTH_BEFORE
    _forward_output()
    if ray.is_initialized():
        _note_other_cluster(policy.ray_address)
        return
    _AUTH_BEFORE = os.environ.get(AUTH_MODE)  # Ray sets it for a cluster it starts: put back on shutdown()
    if policy.ray_address:
        scheme = policy.ray_address.partition("://")[0] if "://" in policy.ray_address else None
        if scheme is not None:
            raise ConfigError("policy.ray_address", f"{policy.ray_address}: msrl joins a Ray cluster at the address "
                              "of its head node, host:port (what `ray start --head` prints), or auto; not "
                              + ("through Ray Client (ray://)" if scheme == "ray" else f"a {scheme}:// URL"))
        reachable = _check_reachable(policy.ray_address)
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # nothing leaves this machine
        _choose_auth(policy.ray_address)
        with warnings.catch_warnings(), _own_sigterm():
            warnings.filterwarnings("ignore", message="os.fork", category=RuntimeWarning)
            try:
                ray.init(address=policy.ray_address, **QUIET)
            except (ConnectionError, ValueError) as e:  # no cluster found ("auto"), a malformed address, ...
                why = str(e).split(". ")[0].rstrip(".")
                if reachable:  # ... or a cluster that refused us
                    raise ConfigError("policy.ray_address", f"cannot join the Ray cluster at {policy.ray_address} "
                                      f"({why}), though something answers there: a cluster on another machine "
                                      "started with Ray's token authentication takes its token (RAY_AUTH_MODE=token "
                                      "RAY_AUTH_TOKEN=<`ray get-auth-token` on its head node>), and its Ray must be "
                                      f"the version here ({ray.__version__})") from None
                raise _no_cluster(policy.ray_address, why) from None
    else:
        init_local(local_cpus(policy, program), dashboard=policy.ray_dashboard)
    _MADE = True


def _note_other_cluster(address: str | None) -> None:
    """A note where ``address`` is not the cluster this process is already connected to (its own ``ray.init``),
    which msrl uses."""
    if not address:
        return
    here = ray.get_runtime_context().gcs_address
    try:
        wanted = canonicalize_bootstrap_address(address)
    except Exception:  # noqa: BLE001 - an address Ray cannot read is not the one in use either
        wanted = address
    if wanted != here:
        print(f"msrl: note: policy.ray_address={address} is not used: this process is already connected to the Ray "
              f"cluster at {here} (its own ray.init), where msrl runs", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _own_sigterm():
    """Around ``ray.init``, which makes SIGTERM exit the process (its own handler): the handler that was there
    before (msrl's: checkpoint and stop) is put back, and a SIGTERM during the call stops as Ctrl-C does."""
    import signal

    before = signal.getsignal(signal.SIGTERM) if threading.current_thread() is threading.main_thread() else None
    try:
        yield
    except SystemExit as e:
        if e.code == signal.SIGTERM:
            raise KeyboardInterrupt from None
        raise
    finally:
        if before is not None:
            signal.signal(signal.SIGTERM, before)


def _forward_output() -> None:
    """What the replicas print, as Ray forwards it: whole on stdout (a user's prints and ``jax.debug.print``,
    whose lines differ in their numbers, are not folded into "[repeated Nx across cluster]"; Ray still folds
    warnings on stderr repeated by every replica), prefixes without colour codes when not on a terminal."""
    from ray._private import worker

    if "RAY_DEDUP_LOGS" not in os.environ and hasattr(worker, "stdout_deduplicator"):
        worker.stdout_deduplicator.deduplicate = lambda batch: [batch]
    if not sys.stderr.isatty():
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")


AUTH_MODE = "RAY_AUTH_MODE"  # Ray's switch of token authentication, read by every Ray process it reaches
_AUTH_BEFORE: str | None = None


def _choose_auth(address: str) -> None:
    """Join a cluster on this machine with Ray's token authentication exactly when it requires the token. Where
    this machine holds one (``~/.ray/auth_token``), ``ray start`` requires it, a cluster started from Python
    (``ray.cluster_utils.Cluster``) or with ``RAY_AUTH_MODE=disabled`` does not; ``ray.init`` sends it to an
    explicit address only when told, and a driver that uses it where the cluster does not is cut off (the
    cluster's calls to the driver carry none: its replicas die as they start). So a client without the token
    asks the cluster first, which refuses it only if it requires one. ``RAY_AUTH_MODE`` set by the user is
    left as it is; no token is sent to another machine."""
    from ray._raylet import AuthenticationTokenLoader

    if AUTH_MODE in os.environ or not AuthenticationTokenLoader.instance().has_token(ignore_auth_mode=True):
        return
    try:
        resolved = canonicalize_bootstrap_address(address)  # auto: the cluster this machine started last
    except Exception:  # noqa: BLE001 - ray.init says what is wrong with it
        return
    if not resolved or not _on_this_machine(resolved.rpartition(":")[0].strip("[]")):
        return
    os.environ[AUTH_MODE] = "token" if _refuses_a_client_without_token(resolved) else "disabled"
    _reload_auth()


def _reload_auth() -> None:
    """Ray's cached config and token read ``RAY_AUTH_MODE`` again (a driver that keeps the token cached uses it)."""
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def _on_this_machine(host: str) -> bool:
    import socket

    import psutil

    try:
        ips = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    mine = {a.address for addrs in psutil.net_if_addrs().values() for a in addrs}
    return bool(ips) and all(ip.startswith("127.") or ip == "::1" or ip in mine for ip in ips)


def _refuses_a_client_without_token(address: str) -> bool:
    from ray._raylet import InnerGcsClient
    from ray.exceptions import AuthenticationError

    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)  # not Ray's C++ warning of the refusal, which is the answer here
    try:
        InnerGcsClient.standalone(address, None, 5000)
    except AuthenticationError:
        return True
    except Exception:  # noqa: BLE001 - no answer of the kind: ray.init says what is wrong
        return False
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
    return False


def local_cpus(policy: Any, program: Any) -> int:
    """The CPUs a private cluster offers: this machine's, or as many as the replicas ask for, so that they all
    start (sharing the cores); a note says so where ``policy.resources`` asked for more than there are."""
    need, cores = sum(f.spec.num_cpus * f.spec.replicas for f in program.fragments.values()), os.cpu_count() or 1
    if need > cores and getattr(policy, "resources", None):
        print(f"msrl: note: the replicas ask for {need:g} CPUs in all (policy.resources; 1 per replica unless set) "
              f"and this machine has {cores}: the private Ray cluster offers {int(np.ceil(need))} so that every "
              f"replica starts, and they share the {cores} cores (num_cpus places replicas, it reserves no cores)",
              file=sys.stderr, flush=True)
    return max(cores, int(np.ceil(need)))


LOCAL_ONLY = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": Ray's local-only mode (node address 127.0.0.1)
QUIET = {"logging_level": 40, "log_to_driver": True, "configure_logging": True}  # 40: logging.ERROR


def init_local(num_cpus: int, dashboard: bool = False, **kwargs: Any) -> None:
    """``ray.init`` of a private cluster on this machine whose every process listens on 127.0.0.1 only, and
    dies with this process (a watchdog, :mod:`backends.ray_watchdog`, kills what is left of it).

    Ray binds its gRPC servers (GCS, raylet, workers), object manager, runtime-env agent and metrics ports
    to the node's IP address, and binds them to loopback only when that address is 127.0.0.1. Ray picks
    127.0.0.1 in its local-only mode, the one it uses on macOS and Windows (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER
    =0``); on Linux it otherwise resolves even an explicit ``_node_ip_address="127.0.0.1"`` to the machine's
    outward address. Ray reads that variable once, when it is imported, so the switch is set in the module
    that holds it, only while this cluster starts (joining another cluster later still uses the real address).
    ``ray.init`` makes SIGTERM exit the process; the handler that was there before is put back
    (:func:`_own_sigterm`).
    """
    import signal

    global _WATCHDOG
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # nothing leaves this machine
    # started first, so that a cluster half started when this process dies is reaped too
    import psutil

    others = [str(c.pid) for c in psutil.Process().children()]
    _WATCHDOG = subprocess.Popen([sys.executable, os.path.join(os.path.dirname(__file__), "ray_watchdog.py"),
                                  str(os.getpid()), *others], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL, start_new_session=True)
    main = threading.current_thread() is threading.main_thread()
    # a Ctrl-C waits until ray.init returns: interrupted inside it, its half-connected core worker crashed the
    # process's exit (SIGSEGV in its metrics thread, ~1 start in 3); after it, shutdown() stops it cleanly
    sigint, deferred = (signal.getsignal(signal.SIGINT) if main else None), []
    if sigint is not None:
        signal.signal(signal.SIGINT, lambda sig, frame: deferred.append(frame))
    from ray._private import ray_constants  # where Ray keeps the switch (tests/test_ray.py checks the result)

    before = (os.environ.get(LOCAL_ONLY), getattr(ray_constants, "ENABLE_RAY_CLUSTER", True))
    os.environ[LOCAL_ONLY], ray_constants.ENABLE_RAY_CLUSTER = "0", False
    try:
        with warnings.catch_warnings(), _own_sigterm():  # Ray's processes are fork+exec'd: not JAX's fork warning
            warnings.filterwarnings("ignore", message="os.fork", category=RuntimeWarning)
            try:
                ray.init(address="local", num_cpus=num_cpus, include_dashboard=dashboard, dashboard_host="127.0.0.1",
                         **{**QUIET, **kwargs})
            except BaseException:
                shutdown()
                raise
    finally:
        if before[0] is None:
            os.environ.pop(LOCAL_ONLY, None)
        else:
            os.environ[LOCAL_ONLY] = before[0]
        ray_constants.ENABLE_RAY_CLUSTER = before[1]
        if sigint is not None:
            signal.signal(signal.SIGINT, sigint)
    if deferred and callable(sigint):  # now: its handler (msrl's, Python's: KeyboardInterrupt) stops the start
        try:
            sigint(signal.SIGINT, deferred[0])
        except BaseException:
            shutdown()
            raise
    _WATCHDOG.stdin.write(f"{ray.get_runtime_context().get_node_id()}\n".encode())  # the cluster is up
    _WATCHDOG.stdin.flush()


_WATCHDOG: Any = None  # the private cluster's watchdog (backends/ray_watchdog.py): kills it if this process dies


def shutdown() -> None:
    """``ray.shutdown``, and the watchdog of a private cluster this process started reaps what is left of it."""
    global _WATCHDOG, _MADE
    ray.shutdown()
    if _MADE and os.environ.get(AUTH_MODE) != _AUTH_BEFORE:  # as the user's process had it (Ray set it, or msrl)
        if _AUTH_BEFORE is None:
            os.environ.pop(AUTH_MODE, None)
        else:
            os.environ[AUTH_MODE] = _AUTH_BEFORE
        _reload_auth()
    _MADE = False
    if _WATCHDOG is not None:
        _WATCHDOG.stdin.close()  # it reaps what is left of the cluster, then exits: waited for in the background
        # (not a zombie child, nor a ResourceWarning of Popen's when the object goes)
        threading.Thread(target=_WATCHDOG.wait, daemon=True, name="ray-watchdog-reaper").start()
        _WATCHDOG = None


def _check_reachable(address: str, timeout_s: float = 10.0) -> str | None:
    """Fail now, not after minutes of Ray's retries, when nothing answers at ``policy.ray_address``; the host
    that answered (None: an address with no port to try)."""
    import socket

    host, sep, port = address.split("://")[-1].rpartition(":")
    if address in ("auto", "local") or not sep or not port.isdigit():
        return None
    host = host.strip("[]")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise _no_cluster(address, f"nothing answers: {e.strerror or e}") from None
    return host


def _no_cluster(address: str, why: str) -> ConfigError:
    return ConfigError("policy.ray_address", f"cannot join a Ray cluster at {address} ({why}); start the cluster "
                       "there (`ray start --head`), fix the address, or leave it unset for a private cluster on this "
                       "machine")


def _check_resources(program: Any, release_s: float) -> None:
    """Fail now, not hang, when the cluster cannot hold every replica at once: in all, on one node for each
    replica, or with what is free (actors of another session hold the rest; those of one just closed are
    released within ``release_s``)."""
    kinds = (("CPU", "num_cpus"), ("GPU", "num_gpus"))
    need = {res: sum(getattr(f.spec, field) * f.spec.replicas for f in program.fragments.values())
            for res, field in kinds}
    unset = {"CPU": " (1 per replica unless set)", "GPU": ""}
    have = ray.cluster_resources()
    for res, field in kinds:
        if need[res] > have.get(res, 0) + 1e-9:
            raise ConfigError("policy.resources", f"the replicas need {need[res]:g} {res}s in all{unset[res]}, but the "
                              f"Ray cluster has {have.get(res, 0):g}; lower policy.resources.<role>.{field} (fractions "
                              "are fine) or give the cluster more")
    largest = {res: max((n["Resources"].get(res, 0) for n in ray.nodes() if n["Alive"]), default=0) for res, _ in kinds}
    for f in program.fragments.values():  # Ray places a replica on one node, or waits for one forever
        for res, field in kinds:
            if getattr(f.spec, field) > largest[res] + 1e-9:
                raise ConfigError("policy.resources", f"a replica of {f.name} needs {getattr(f.spec, field):g} "
                                  f"{res}s, but no node of the Ray cluster has that many (the largest has "
                                  f"{largest[res]:g}); lower policy.resources.{f.name}.{field} or add a larger node")
    deadline = time.monotonic() + release_s
    while True:
        free = ray.available_resources()
        short = [(res, field) for res, field in kinds if need[res] > free.get(res, 0) + 1e-9]
        if not short or time.monotonic() > deadline:
            break
        time.sleep(POLL_S)
    for res, field in short:
        raise ConfigError("policy.resources", f"the replicas need {need[res]:g} {res}s in all{unset[res]}, but only "
                          f"{free.get(res, 0):g} of the Ray cluster's {have.get(res, 0):g} are free: others hold "
                          "the rest (another session on the cluster, msrl's or not, or your own actors); close it, or "
                          f"lower policy.resources.<role>.{field} (fractions are fine)")


def _first_line(error: BaseException) -> str:
    """Ray's error in one line: its first, and why an actor died where Ray says (its node died, ray.kill)."""
    text = str(error).strip()
    why = re.search(r"The actor is dead because ([^.\n]*)", text)
    return (text.splitlines() or [""])[0] + (f" ({why.group(1).strip()})" if why else "")


def _placement(program: Any) -> dict[tuple[str, int], str]:
    """Each replica's node: the largest first, each on the node with the most CPUs left (spread, as Ray's SPREAD
    would, but placed so that all fit at once: Ray placing them one by one can leave no node room for the last,
    and waits for one forever). A ConfigError where no such placement is found."""
    room = {n["NodeID"]: [n["Resources"].get("CPU", 0.0), n["Resources"].get("GPU", 0.0)]
            for n in ray.nodes() if n["Alive"]}
    replicas = sorted(((f.spec.num_cpus, f.spec.num_gpus, name, r) for name, f in program.fragments.items()
                       for r in range(f.spec.replicas)), key=lambda x: (-x[1], -x[0]))
    where = {}
    for cpus, gpus, name, r in replicas:
        fits = [n for n, (c, g) in room.items() if c >= cpus - 1e-9 and g >= gpus - 1e-9]
        if not fits:
            left = ", ".join(f"{c:g} CPUs" + (f" {g:g} GPUs" if g else "") for c, g in room.values())
            raise ConfigError("policy.resources", f"the replicas do not fit on the Ray cluster's nodes together: "
                              f"with the larger ones placed, no node has the {cpus:g} CPUs"
                              f"{f' and {gpus:g} GPUs' if gpus else ''} a replica of {name} needs (left per node: "
                              f"{left}); lower policy.resources.<role>.num_cpus (fractions are fine) or add a node")
        where[(name, r)] = node = max(fits, key=lambda n: room[n][0])
        room[node][0] -= cpus
        room[node][1] -= gpus
    return where


class RayBackend(Backend):
    """Runs each replica as a Ray actor (a process) on a local or given Ray cluster."""

    start_local = staticmethod(init_local)  # for callers that reach the backend through the registry
    shutdown = staticmethod(shutdown)

    def build(self, program: Any, seed: int, iterations_per_dispatch: int) -> RayRuntime:
        return RayRuntime(program, seed)
