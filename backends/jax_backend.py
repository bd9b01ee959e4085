"""The ``jax`` backend: one process, fragments jitted whole.

A program of one jitted fragment (``fused``) runs as a single XLA program per dispatch: a ``fori_loop`` of
up to ``iterations_per_dispatch`` training iterations (the state donated when it is large), so the host only
wakes up to log. One compiled executable serves every dispatch size (the count is a runtime argument).
Several seeds (or sweep members) are one batched program (``vmap``), or run one after another by the one-seed
program compiled for each device (``sequential``: each member bitwise its run alone).

A fragment with several replicas (``multi_learner``) is still one program: the replicas' states are stacked
on a leading axis split over the devices (``shard_map``), ``vmap``ped on each device; the learner's
all-reduce averages over all of them.

A program of several fragments (``single_learner_coarse`` with ``backend: jax``: actors on some JAX devices,
the learner on others, Sebulba-style) runs each replica in a thread pinned to its device, with
``device_put`` as the transport (:class:`DevicesRuntime`).
"""

from __future__ import annotations

import math
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import jaxpr_as_fun
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from msrl.backend import Backend, Runtime, learners_agree, metric_rows, replica_env_ids, replicated
from msrl.compiler.lower import reraise_at_user_line
from msrl.errors import ConfigError
from msrl.sweep import python_use
from msrl.backends.threads import ThreadsRuntime
from msrl.runtime.driver import failure


class JaxRuntime(Runtime):
    def __init__(self, program: Any, seed: int, iterations_per_dispatch: int,
                 members: list[tuple[int, dict[str, float]]] | None = None, vmap_seeds: bool = True):
        members = members or [(seed, {})]
        self.program, self.fragment, self.seed = program, next(iter(program.fragments.values())), seed
        self.replicas, self.members = self.fragment.spec.replicas, len(members)
        self.k = max(1, int(iterations_per_dispatch))
        self._unread = 0  # iterations a stream that stopped early dispatched without handing over their rows
        env = program.env
        if env.host_simulator and self.replicas > 1:  # (several members: refused by check_members)
            raise ConfigError("env.xla", f"{env.spec.id}'s pools step from inside one XLA program each, which cannot be "
                              "batched over replicas on the jax backend; run each replica as its own process "
                              "(policy.backend=ray), or place the envs on threads "
                              "(policy.name=single_learner_coarse policy.backend=threads)")
        frag_fn = self.fragment.fn
        swept = list(members[0][1])
        # each swept key's value per member: while the program is traced, the algorithm's config holds them
        self._hp = {k: jnp.asarray([values[k] for _, values in members], jnp.float32) for k in swept}

        def one(state, hp):
            with program.hyperparameters(hp):
                state, result = frag_fn(state)
            return state, {"train": result, "env": env.stats(state["env"])}

        # The whole program once per member (seed x swept values): every state leaf has a leading member axis.
        # Batched (vmap) in one program; or, ``sequential``, each member's state run by the one-member program
        # itself, compiled once per device and dispatched per member: the very executable of the member's run
        # alone, so its numbers are bitwise that run's (XLA fuses and rounds a program inside a batch or a
        # loop over members differently: ~1e-8 in a running variance after 3 iterations, diverging later).
        self.sequential = self.members > 1 and not vmap_seeds
        if self.members > 1 and not self.sequential:
            one = jax.vmap(one)

        self.mesh = None  # the devices a leading axis of the state is split over (replicas, or members)
        if self.members > 1 and not self.sequential and len(jax.devices()) > 1:  # the members split over the devices
            self.mesh = replica_mesh(self.members, "members")
            spec = PartitionSpec(self.mesh.axis_names[0])
            one = jax.shard_map(one, mesh=self.mesh, in_specs=spec, out_specs=spec, check_vma=False)

        if self.replicas > 1:  # one program over every replica: shard_map over the devices, vmap on each
            self.mesh = replica_mesh(self.replicas)
            each = replicated(partial(one, hp={}), self.mesh)

            def one(state, hp):  # noqa: F811 - the replicas' metrics averaged, their episode statistics summed
                state, out = each(state)
                return state, {"train": jax.tree.map(lambda x: x.mean(0), out["train"]),
                               "env": jax.tree.map(lambda x: x.sum(0), out["env"])}

        def chunk(state, hp, n):
            # the loop is traced once: its jaxpr gives the metrics' shapes and is the fori_loop's body (tracing it
            # for the shapes and again for the body cost a second trace of the user's loop at every start)
            closed, spec = jax.make_jaxpr(one, return_shape=True)(state, hp)
            buf = jax.tree.map(lambda s: jnp.zeros((self.k, *s.shape), s.dtype), spec[1])

            def body(i, carry):
                st, b = carry
                st, out = jax.tree.unflatten(jax.tree.structure(spec), jaxpr_as_fun(closed)(*jax.tree.leaves((st, hp))))
                return st, jax.tree.map(lambda x, y: x.at[i].set(y), b, out)

            return jax.lax.fori_loop(0, n, body, (state, buf))

        def init_member(ids, member_seed, values):
            with program.hyperparameters(values):  # (its concrete values: an init may read them)
                return program.init_states(self.fragment.state_keys, member_seed, ids)

        inits = [[init_member(ids, s, values) for s, values in members]
                 for ids in replica_env_ids(program.num_envs, self.fragment)]
        t0 = time.perf_counter()
        if self.sequential:  # member m on device m % devices, run by a thread of that device's own
            devices = jax.devices()[:self.members]
            self.devices = [devices[m % len(devices)] for m in range(self.members)]
            self._states = [self._place([init], device) for init, device in zip(inits[0], self.devices)]
            self._hps = [jax.device_put({k: v[m] for k, v in self._hp.items()}, device)
                         for m, device in enumerate(self.devices)]
            # traced in this thread (the config holds a trace's swept values while it runs), then compiled and run
            # by one thread per device, its members one at a time (queued asynchronously instead, the devices'
            # programs ran all at once, contending for the cores: ~20% slower on 2 CPU devices)
            lowered = [self._lower(chunk, self._states[d], self._hps[d], swept) for d in range(len(devices))]
            self._threads = [ThreadPoolExecutor(1, thread_name_prefix=f"msrl-{d}") for d in devices]
            self._inflight: list[Any] = []
            try:
                self._compiled = [f.result() for f in [t.submit(low.compile) for low, t in zip(lowered, self._threads)]]
            except BaseException:
                self.close()
                raise
        else:
            self._state = self._place([init[0] if self.members == 1 else stack(init) for init in inits])
            self._hp = self._place([self._hp]) if self.members > 1 else self._hp
            self._recompile = lambda: self._lower(chunk, self._state, self._hp, swept).compile()
            self._compiled = self._recompile()
        self.compile_seconds = time.perf_counter() - t0

    def _lower(self, chunk: Any, state: Any, hp: Any, swept: list[str]) -> Any:
        try:
            # the state is donated (updated in place) only when large (a replay buffer): donating a small one
            # made XLA's CPU loop ~25% slower (PPO on CartPole), and a copy of a few MB per dispatch costs nothing
            donate = (0,) if state_bytes(state) > DONATE_BYTES else ()
            lowered = jax.jit(chunk, donate_argnums=donate).lower(state, hp, jnp.int32(self.k))
        except Exception as e:  # noqa: BLE001 - reported at the user's line
            refused = python_use(e, swept) if swept else None
            if refused is not None:
                raise refused from None
            reraise_at_user_line(e, [self.fragment.lowered], "tracing")
        return lowered

    def _run_members(self, d: int, n: int) -> dict[int, Any]:
        """``sequential``: ``n`` iterations of each member on device ``d``, one after another (its thread)."""
        outs = {}
        for m in range(d, self.members, len(self._threads)):
            self._states[m], out = self._compiled[d](self._states[m], self._hps[m], jnp.int32(n))
            outs[m] = jax.device_get(out)
        return outs

    def _view(self, skip: tuple[str, ...] = (), only: str | None = None) -> dict[str, Any]:
        """The program's state without ``skip``'s components (or ``only`` one): a ``sequential`` run's member
        states stacked on the host, once the iterations in flight are done."""
        keep = lambda state: {k: v for k, v in state.items() if k not in skip and only in (None, k)}
        if not self.sequential:
            return keep(self._state)
        self._settle()
        return stack([keep(state) for state in self._states])

    def _settle(self) -> None:
        """Wait for the members' iterations in flight (``sequential``)."""
        for f in self._inflight:
            f.result()

    def _place(self, states: list[Any], device: Any = None) -> Any:
        """Device state from per-replica states (stacked on a leading axis split over the mesh when several; a
        member axis is split over it too); fresh buffers, so they can be donated."""
        state = states[0] if self.replicas == 1 else stack(states)
        if self.mesh is None:
            return jax.device_put(state, device, may_alias=False)  # (a copy that compiles nothing)
        return jax.device_put(state, NamedSharding(self.mesh, PartitionSpec(self.mesh.axis_names[0])))

    def _replica_states(self, state: Any) -> list[Any]:
        state = jax.device_get(state)
        if self.replicas == 1:
            return [state]
        return [jax.tree.map(lambda x: x[r], state) for r in range(self.replicas)]

    def run(self, iterations: int) -> list[dict[str, float]]:
        return [row for rows in self.stream(iterations, self.k) for row in rows]

    def stream(self, iterations: int, chunk: int, stop=lambda: False):
        """Dispatch (asynchronously) the next chunk before reading the last one, so the device never
        waits for the host's logging."""
        pending, unread = None, []  # unread: the dispatched chunks' iterations whose rows were not handed over

        def advance() -> list | None:
            """Dispatch the next chunk (if any is left) and read the last one: its rows."""
            nonlocal iterations, pending
            dispatched, rows = None, None
            if iterations > 0 and not stop():
                n = min(iterations, self.k, chunk)
                if self.sequential:
                    out = self._inflight = [t.submit(self._run_members, d, n) for d, t in enumerate(self._threads)]
                else:
                    self._state, out = self._compiled(self._state, self._hp, jnp.int32(n))
                dispatched, iterations = (out, n), iterations - n
                unread.append(n)
            if pending is not None:
                out, n = pending
                if self.sequential:  # the members' outputs on the axis after the iteration's
                    outs = {m: out_m for f in out for m, out_m in f.result().items()}
                    out = jax.tree.map(lambda *xs: np.stack(xs, axis=1), *[outs[m] for m in range(self.members)])
                out = jax.device_get(out)
                unread.pop(0)
                rows = (metric_rows(out["train"], out["env"], n) if self.members == 1 else
                        seed_rows(out, n, self.members))
            pending = dispatched
            return rows

        try:
            while (iterations > 0 and not stop()) or pending is not None:
                try:  # (a failure inside the program, a host callback's, comes out at a dispatch or a read)
                    rows = advance()
                except Exception as e:  # noqa: BLE001 - reported at the user's line
                    raise failure(e, self.fragment.lowered, f"fragment {self.fragment.name!r}") from None
                if rows is not None:
                    yield rows
        finally:  # stopped early: the chunks dispatched run to their end all the same (their rows are lost)
            self._unread += sum(unread)

    def settle(self) -> int:
        done, self._unread = self._unread, 0
        return done

    def snapshot(self, skip: tuple[str, ...] = ()) -> dict[str, list[dict]]:
        states = self._replica_states(self._view(skip))
        if self.replicas > 1 and "learner" in states[0]:
            learner = self.program.components["learner"]
            learners_agree(self.program, [learner.policy_params(state["learner"]) for state in states])
        return {self.fragment.name: states}

    def shapes(self, skip: tuple[str, ...] = ()) -> dict[str, list[dict]]:
        lead = 1 if self.replicas > 1 else 0  # each replica's share of the replica axis
        state, members = (self._states[0], (self.members,)) if self.sequential else (self._state, ())
        one = jax.tree.map(lambda x: jax.ShapeDtypeStruct((*members, *x.shape[lead:]), x.dtype)
                           if hasattr(x, "dtype") else x, {k: v for k, v in state.items() if k not in skip})
        return {self.fragment.name: [one] * self.replicas}

    def restore(self, snapshot: dict[str, list[dict]], iteration: int | None = None) -> None:
        if self.sequential:
            self._settle()
            saved = snapshot[self.fragment.name][0]
            self._states = [{**state, **self._place([jax.tree.map(lambda x, m=m: x[m], saved)], device)}
                            for m, (state, device) in enumerate(zip(self._states, self.devices))]
            return
        env, states = self.program.env, snapshot[self.fragment.name]
        if env.host_simulator and "env" in self._state:  # no snapshot holds a pool's episodes: this one's stay
            states = [{k: v for k, v in state.items() if k != "env"} for state in states]
        self._state = {**self._state, **self._place(states)}
        if env.host_simulator and "env" in self._state and iteration is not None:  # (one replica, one member)
            env.close(self._state["env"])  # a restored run's episodes start afresh, as a replica backend's do
            ids = replica_env_ids(self.program.num_envs, self.fragment)[0]
            self._state["env"] = self._place([self.program.init_states(["env"], self.seed, ids, fold=iteration)])["env"]
            self._compiled = self._recompile()  # (the program calls the pool it was traced with)

    def params(self) -> Any:
        learner = self.program.components["learner"]
        states = self._replica_states(self._view(only="learner")["learner"])
        if self.replicas > 1:
            learners_agree(self.program, [learner.policy_params(state) for state in states])
        state = states[0]
        if self.members == 1:
            return learner.policy_params(state)
        each = [learner.policy_params(jax.tree.map(lambda x, m=m: x[m], state)) for m in range(self.members)]
        return jax.tree.map(lambda *xs: np.stack(xs), *each)  # (policy_params is written for one member's state)

    def close(self) -> None:
        """Release what the env state holds outside JAX (``env.xla``'s EnvPool pools)."""
        if self.program.env.host_simulator and "env" in self._state:  # (never several members: refused)
            self.program.env.close(self._state["env"])
        for thread in getattr(self, "_threads", []):  # (an iteration under way ends in the background)
            thread.shutdown(wait=False, cancel_futures=True)


DONATE_BYTES = 64 * 2**20


def state_bytes(state: Any) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))


def stack(states: list[Any]) -> Any:
    """States stacked on a new leading axis."""
    return jax.tree.map(lambda *xs: np.stack(xs), *jax.device_get(states))


def seed_rows(out: dict[str, Any], n: int, seeds: int) -> list[dict[str, Any]]:
    """Rows of a program run for several seeds (outputs ``[iteration, seed, ...]``): every metric's mean over
    the seeds (``episode_return_std`` too), with each seed's own row under ``per_seed``."""
    per_seed = [metric_rows(jax.tree.map(lambda x: x[:, i], out["train"]),
                            {k: v[:, i] for k, v in out["env"].items()}, n) for i in range(seeds)]
    rows = []
    for it in range(n):
        each = [per_seed[i][it] for i in range(seeds)]
        with np.errstate(all="ignore"):
            row = {k: float(np.mean([r[k] for r in each])) for k in each[0]}  # a non-finite metric stays so
            for k in ("episode_return", "episode_length"):  # seeds with no finished episode yet do not count
                finite = [r[k] for r in each if math.isfinite(r[k])]
                row[k] = float(np.mean(finite)) if finite else math.nan
            returns = np.array([r["episode_return"] for r in each])
            row["episode_return_std"] = float(np.nanstd(returns)) if np.isfinite(returns).any() else math.nan
        if "env_nonfinite" in row:
            row["env_nonfinite"] = sum(r["env_nonfinite"] for r in each)
        rows.append({**row, "per_seed": [{k: v for k, v in r.items() if k != "env_nonfinite"} for r in each]})
    return rows


def replica_mesh(replicas: int, what: str = "replicas") -> Mesh:
    """The devices ``replicas`` replicas (or members: seeds x swept values) run on: as many as divide them evenly
    (the rest are vmapped)."""
    devices = jax.devices()
    n = max(d for d in range(1, min(replicas, len(devices)) + 1) if replicas % d == 0)
    if n < min(replicas, len(devices)):  # (devices left idle)
        print(f"msrl: note: {replicas} {what} on {len(devices)} JAX devices run on {n} of them, {replicas // n} on "
              f"each (as many devices as divide {replicas} evenly)", file=sys.stderr, flush=True)
    return Mesh(np.array(devices[:n]), ("devices",))


class DevicesRuntime(ThreadsRuntime):
    """Fragments pinned to JAX devices in one process: each replica of a role with ``devices`` computes on
    the device its index picks from them (round robin); what crosses a cut is ``device_put`` there."""

    def __init__(self, program: Any, seed: int):
        devices = jax.devices()
        pinned = {}
        for name, frag in program.fragments.items():
            ids = frag.spec.devices or range(len(devices))
            if max(ids) >= len(devices):  # (the key of the built-in policies' devices, or the policy of yours)
                key = f"{name}_devices" if f"{name}_devices" in type(program.policy).model_fields else "name"
                cpu = devices[0].platform == "cpu"  # (a resume in a shell without the XLA_FLAGS the run had)
                raise ConfigError(f"policy.{key}", f"device {max(ids)} of role {name!r} does not exist: this process "
                                  f"has {len(devices)} JAX devices ({devices[0].platform})" + (
                                      f"; XLA_FLAGS=--xla_force_host_platform_device_count={max(ids) + 1} gives the "
                                      "CPU that many in a new process (this one's JAX has started: its devices stay)"
                                      if cpu else ""))
            pinned.update({(name, r): devices[ids[r % len(ids)]] for r in range(frag.spec.replicas)})
        super().__init__(program, seed, pinned)


class JaxBackend(Backend):
    """Runs a fragment as jitted programs in this process: one over all replicas, or one per JAX device."""

    multi_seed = True

    def build(self, program: Any, seed: int, iterations_per_dispatch: int,
              members: list[tuple[int, dict[str, float]]] | None = None, vmap_seeds: bool = True) -> Runtime:
        if jax.config.jax_disable_jit:
            raise ConfigError("policy.backend", "the jax backend runs the loop as compiled XLA programs, but "
                              "jax_disable_jit is on (jax.config.update('jax_disable_jit', True) or JAX_DISABLE_JIT); "
                              "turn it off, or step the loop eagerly with policy.name=single_learner_coarse "
                              "policy.backend=threads (slowly)")
        frags = list(program.fragments.values())
        several = members is not None and len(members) > 1
        key = "run.sweep" if several and members[0][1] else "run.num_seeds"
        if len(frags) == 1 and frags[0].mode == "scan":
            if several and frags[0].spec.replicas > 1:
                raise ConfigError(key, f"several seeds or swept values in one program need a single replica; "
                                  f"{program.policy.name} runs {frags[0].spec.replicas} (use policy.name=fused, or "
                                  "policy.learners=1 under multi_learner)")
            return JaxRuntime(program, seed, iterations_per_dispatch, members, vmap_seeds)
        if several:
            raise ConfigError(key, f"several seeds or swept values in one program need one jitted program (policy "
                              f"fused); {program.policy.name} on the jax backend runs {len(frags)} fragments")
        return DevicesRuntime(program, seed)

