"""The backend contract: turn a compiled :class:`~msrl.compiler.Program` into a running :class:`Runtime`."""

from __future__ import annotations

import contextvars
import functools
from typing import Any, Callable, Iterator


class Runtime:
    """A running program. ``run(n)`` performs ``n`` training iterations and returns one metrics dict per
    iteration (``episode_return``, ``episodes`` and the loop's own metrics, as Python floats)."""

    compile_seconds: float | None = None  # XLA compile time ahead of the run; None: compiled lazily in it
    # a replica (a host env's step, a collective) making no progress this long ends the run (0: never); set by
    # the Session; backends of replicas watch for it (msrl.runtime.driver.ReplicaRuntime.watch)
    stall_timeout_s: float = 0.0

    def run(self, iterations: int) -> list[dict[str, float]]:
        raise NotImplementedError

    def stream(self, iterations: int, chunk: int, stop: Callable[[], bool] = lambda: False
               ) -> Iterator[list[dict[str, float]]]:
        """Run ``iterations`` iterations, yielding the rows of every ``chunk`` of them as they finish (a
        backend may start the next chunk before the caller has read the last one); no chunk starts once
        ``stop()`` is true."""
        while iterations > 0 and not stop():
            n = min(chunk, iterations)
            yield self.run(n)
            iterations -= n

    def params(self) -> Any:
        """The policy's parameters (the learner's ``policy_params``; a service's, where one holds them)."""
        raise NotImplementedError

    def snapshot(self, skip: tuple[str, ...] = ()) -> dict[str, list[dict[str, Any]]]:
        """Every replica's component states, as host arrays, by fragment (components in ``skip`` left out)."""
        raise NotImplementedError

    def shapes(self, skip: tuple[str, ...] = ()) -> dict[str, list[dict[str, Any]]]:
        """What :meth:`snapshot` returns, each array as its ``jax.ShapeDtypeStruct`` (a backend holding its states
        as arrays gives them without copying anything to the host)."""
        import jax

        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if hasattr(x, "dtype") else x,
                            self.snapshot(skip))

    def restore(self, snapshot: dict[str, list[dict[str, Any]]], iteration: int | None = None) -> None:
        """Set the component states found in ``snapshot`` (as :meth:`snapshot` returns them); others stay.
        ``iteration``: the iteration the snapshot was taken after, where the run continues (a schedule of
        communication, such as a parameter pull every few iterations, goes on from there)."""
        raise NotImplementedError

    def at_rest(self) -> bool:
        """Whether the state held now is that of the end of the last finished dispatch (after a failed one:
        whether a snapshot now is a consistent checkpoint). False when unknown."""
        return False

    def can_go_on(self) -> bool:
        """After a :meth:`stream` that ended early, its replicas at rest: whether they can run again."""
        return True

    def settle(self) -> int | None:
        """After a :meth:`stream` that ended early (an exception such as a KeyboardInterrupt, or a reader that
        stopped reading): how many iterations past the rows it handed over the state now holds (work already
        started that finishes all the same), or None when the replicas' states may be of different iterations."""
        return 0 if self.at_rest() else None

    def close(self) -> None:
        pass

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Backend:
    """Subclass and register with ``@msrl.register_backend(name)`` (or the ``msrl.backends`` entry points).
    ``multi_seed``: ``build`` takes ``members=[(seed, values), ...]`` and runs the program once per member at once
    (``run.num_seeds`` x ``run.sweep``: the algorithm's config holds a member's ``values`` while its program is
    traced and initialized, :meth:`Program.hyperparameters`), batched if ``vmap_seeds`` (``run.seed_batching``)."""

    multi_seed = False

    def build(self, program: Any, seed: int, iterations_per_dispatch: int) -> Runtime:
        raise NotImplementedError


def result_metrics(result: Any) -> dict[str, float]:
    """One iteration's loop result as floats (a dict of scalars as is; arrays are averaged)."""
    import numpy as np

    if result is None:
        return {}
    out = {}
    for k, v in result.items() if isinstance(result, dict) else [("result", result)]:
        try:
            out[str(k)] = float(np.mean(np.asarray(v)))
        except (TypeError, ValueError):
            continue
    return out


def mean_metrics(rows: list[dict[str, float]]) -> dict[str, float]:
    """The mean of every metric over several replicas' rows (each returning replica's loop metrics)."""
    import numpy as np

    return {k: float(np.mean([r[k] for r in rows])) for k in rows[0]} if rows else {}


def stats_fn(env: Any) -> Callable[[Any], dict[str, Any]]:
    """``env.stats``, jitted for a functional env: a host loop calls it every iteration, where its
    eager reductions would cost more than a small iteration itself."""
    import jax

    return jax.jit(env.stats) if env.jittable else env.stats


def metric_rows(train: Any, env: dict[str, Any], n: int) -> list[dict[str, float]]:
    """Per-iteration rows from stacked (leading axis = iteration) loop results and env statistics."""
    import jax

    from msrl.components import episode_metrics

    return [{**episode_metrics([{k: v[i] for k, v in env.items()}]),
             **result_metrics(jax.tree.map(lambda x: x[i], train))} for i in range(n)]


# ---------------------------------------------------------------------------------------- communication
def policy_lag(program: Any, iteration: int) -> dict[str, int]:
    """``{"policy_lag": n}``: how many learner updates behind the parameters the actors acted with in
    ``iteration`` are (the learner's ``@params`` broadcast, its ``every`` and ``lag``); ``{}`` when no
    parameters are communicated."""
    comm = program.plan.comm("@params")
    if comm is None:
        return {}
    received = comm.sent_for(iteration)
    return {"policy_lag": iteration - 1 - received if received >= 0 else iteration}


def gather_senders(receiver: int, senders: int, receivers: int) -> range:
    """The sender replicas a gather's ``receiver`` joins: an equal, contiguous group of them (all of them
    for a single receiver), so the joined value keeps global environment order."""
    group = senders // receivers
    return range(receiver * group, (receiver + 1) * group)


def gather_receiver(sender: int, senders: int, receivers: int) -> int:
    """The receiver replica of a gather that ``sender`` belongs to (see :func:`gather_senders`)."""
    return sender // (senders // receivers)


def concat_along(values: list[Any], axes: list[int | None], what: str = "a gathered value",
                 interleave: bool = False) -> Any:
    """Join same-structured pytrees leaf by leaf along each leaf's axis. A leaf with no axis (a scalar) must
    be the same in every value (it is then kept once): one that differs is an error, never dropped.
    ``interleave``: row ``j`` of the joined axis is row ``j // len(values)`` of value ``j % len(values)``
    (samples from several buffer shards: any run of rows, a multiple of the shards long, holds as many from
    each), rather than the values one after another."""
    import jax
    import numpy as np

    from msrl.errors import TrainingError

    flat = [jax.tree.leaves(v) for v in values]
    out = []
    for i in range(len(flat[0])):
        if i < len(axes) and axes[i] is not None:
            parts, ax = [np.asarray(f[i]) for f in flat], axes[i]
            joined = np.stack(parts, axis=ax + 1) if interleave else np.concatenate(parts, axis=ax)
            out.append(joined.reshape(*joined.shape[:ax], -1, *joined.shape[ax + 2:]) if interleave else joined)
            continue
        if any(not np.array_equal(np.asarray(f[i]), np.asarray(flat[0][i])) for f in flat[1:]):
            raise TrainingError(f"{what}: its leaf {i} has no axis to join along and differs between the replicas "
                                f"({[np.asarray(f[i]).tolist() for f in flat][:4]}); keeping one would drop the others")
        out.append(flat[0][i])
    return jax.tree.unflatten(jax.tree.structure(values[0]), out)


def split_along(value: Any, parts: int, axes: list[int | None], interleave: bool = False) -> list[Any]:
    """The inverse of :func:`concat_along`: ``parts`` pytrees, each leaf split along its axis."""
    import jax
    import numpy as np

    def split(x: np.ndarray, ax: int) -> list[np.ndarray]:
        if not interleave:
            return np.split(x, parts, axis=ax)
        rows = x.reshape(*x.shape[:ax], -1, parts, *x.shape[ax + 1:])
        return [np.take(rows, r, axis=ax + 1) for r in range(parts)]

    leaves, tree = jax.tree.flatten(value)
    split = [split(np.asarray(x), axes[i]) if i < len(axes) and axes[i] is not None
             else [x] * parts for i, x in enumerate(leaves)]
    return [jax.tree.unflatten(tree, [s[r] for s in split]) for r in range(parts)]


def unsplit(num_envs: int, replicas: int, fragment: str) -> Exception:
    """The error of ``num_envs`` environments that ``replicas`` replicas of ``fragment`` cannot share equally."""
    from msrl.errors import ConfigError

    return ConfigError("env.num_envs", f"{num_envs} environments cannot be split over {replicas} replicas of "
                       f"fragment {fragment!r}")


def replica_env_ids(num_envs: int, fragment: Any) -> list[Any]:
    """The global environment indices of each replica of ``fragment`` (contiguous, equal slices)."""
    import numpy as np

    n = fragment.spec.replicas
    if num_envs % n:
        raise unsplit(num_envs, n, fragment.name)
    return list(np.arange(num_envs).reshape(n, -1))


# ---------------------------------------------------------------------------------------- replicas as SPMD
# The mesh axes the running program's replicas are mapped over, set while a backend traces it: the
# all-reduce reads them, so outside a replicated program (the compiler's shape probe, one replica) it is the
# identity.
_REPLICA_AXES: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("msrl_replica_axes", default=())
REPLICA_AXIS = "replica"  # the vmap axis of the replicas on one device


def all_reduce_mean() -> Any:
    """An optax transformation that replaces every replica's gradients by their mean over all replicas."""
    import optax

    return optax.GradientTransformation(optax.init_empty_state, _mean_over_replicas)  # picklable: no closure


def reduces_over_replicas(transforms: Any) -> bool:
    """Whether gradient ``transforms`` hold :func:`all_reduce_mean` (a collective of the learner's replicas)."""
    return any(getattr(t, "update", None) is _mean_over_replicas for t in transforms)



def learners_agree(program: Any, params: list[Any]) -> None:
    """``params``, the policy parameters of a learner's replicas that average every update
    (:func:`all_reduce_mean`), checked equal: replicas apart were updated by an optimizer that skipped the average
    (``params()`` would read replica 0's). The rest of their states may differ (each replica's own environments'
    running returns): a checkpoint holds and restores every replica's."""
    import jax
    import numpy as np

    from msrl.errors import CompileError, defined_at

    learner = program.components["learner"]
    first = jax.tree.leaves(params[0])
    for r, each in enumerate(params[1:], 1):
        apart = [float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
                 for a, b in zip(first, jax.tree.leaves(each))
                 if not np.array_equal(a, b, equal_nan=True)]  # (NaN alike on all: the NaN guard's to report)
        if apart:  # (the learner's code: its definition is named)
            raise CompileError(f"the {len(params)} learner replicas of policy {program.policy.name!r} hold "
                               f"different parameters (replica {r}'s are up to {max(apart):.3g} from replica 0's): "
                               f"an update was not averaged over them. Build every optimizer of "
                               f"{type(learner).__name__} with self.chain(...) (its optimizer() is), so that the "
                               "policy's gradient average applies to it, and average what the parameters take from "
                               "each replica's share of the batch (running statistics of its observations, say) with "
                               "self.mean_over_replicas(...)", *defined_at(type(learner)))


def _mean_over_replicas(grads: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
    from jax.lax import pmean

    axes = _REPLICA_AXES.get()
    if not axes:
        return grads, state
    return unravel(grads, pmean(ravel(grads), axes)), state  # one all-reduce of every gradient, not one per leaf


LEARNER_UNROLL = 8  # steps per while-loop iteration of a learner's scans (GAE, minibatch updates), off the CPU
LOOP_UNROLL = 4  # ... and of a training loop's own `for range` (a rollout: an env step, the network, a buffer write)
UNROLL_MAX_EQNS = 2000  # a step of more operations than this is not unrolled (Brax's physics: ~7000)


def scan(body: Callable, init: Any, xs: Any = None, length: int | None = None, reverse: bool = False,
         default: int = LEARNER_UNROLL) -> Any:
    """``jax.lax.scan`` with several steps per iteration of the while loop XLA makes of it where that pays: on an
    accelerator each iteration costs a fixed ~10 us beside its steps' small kernels, so a step of at most
    :data:`UNROLL_MAX_EQNS` jaxpr operations is unrolled ``default`` times (its trace counted once more); a larger
    one, whose iteration overhead is small beside its work and whose compile time would grow with the copies, is
    not, and on CPU nothing is (slower there). Measured on an H200 (fused PPO, ``benchmarks/ppo_fused.py``):
    Pendulum's 320 minibatch updates an iteration +27 % steps per second, 16-env CartPole +37 %; a rollout
    unrolled by 8 instead of 4 was ~10 % slower on CartPole and Acrobot. The environment variable
    ``MSRL_SCAN_UNROLL``: ``N`` unrolls every such loop ``N`` times anywhere, ``auto`` chooses as on an accelerator
    anywhere (read when a program is traced). Every policy runs the same scans, so no equality between policies
    changes; an unrolled loop may round otherwise (XLA fuses across its steps), so runs with other choices are
    not bitwise equal."""
    import os

    import jax

    value = os.environ.get("MSRL_SCAN_UNROLL", "").strip().lower()
    if value.isdigit() and int(value) >= 1:
        unroll = int(value)
    elif value not in ("", "auto"):
        from msrl.errors import ConfigError

        raise ConfigError("MSRL_SCAN_UNROLL", f"{value!r} is neither a whole number of steps >= 1 nor auto (unset: "
                          f"auto off the CPU, 1 on it)")
    elif value == "" and jax.default_backend() == "cpu":
        unroll = 1
    else:
        step = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), xs)  # one step's xs (None: None)
        unroll = default if _eqns(jax.make_jaxpr(body)(init, step).jaxpr) <= UNROLL_MAX_EQNS else 1
    return jax.lax.scan(body, init, xs, length=length, reverse=reverse, unroll=unroll)


def _eqns(jaxpr: Any) -> int:
    """The operations of ``jaxpr``, those of the jaxprs inside its operations (calls, loops, branches) too."""
    n = 0
    for eqn in jaxpr.eqns:
        n += 1
        for value in eqn.params.values():
            for inner in value if isinstance(value, (list, tuple)) else [value]:
                inner = getattr(inner, "jaxpr", inner)  # a ClosedJaxpr's
                if hasattr(inner, "eqns"):
                    n += _eqns(inner)
    return n


def ravel(tree: Any) -> Any:
    """Every leaf of ``tree`` flattened into one vector, written by in-place copies: XLA's CPU backend (jax 0.10)
    splits one concatenation of many large leaves over its threads and then runs it erratically slowly (Adam on
    a 256-wide MLP took 0.9 ms a step, and 0.9-7.6 ms with the concatenation, varying from run to run). Under
    ``vmap`` (several seeds, a device's replicas) the copies stay copies (:func:`rowwise`)."""
    import jax

    leaves = jax.tree.leaves(tree)
    return _ravel_rows()(*(x.reshape(1, -1) for x in leaves))[0]


@functools.cache
def _ravel_rows() -> Callable:
    import jax
    import jax.numpy as jnp

    def copies(*leaves):  # leaves [R, n_i] side by side: [R, sum n_i]
        out, at = jnp.zeros((leaves[0].shape[0], sum(x.shape[1] for x in leaves)), jnp.result_type(*leaves)), 0
        for x in leaves:
            out, at = jax.lax.dynamic_update_slice(out, x.astype(out.dtype), (0, at)), at + x.shape[1]
        return out

    return rowwise(copies)


def rowwise(fn: Callable) -> Callable:
    """``fn(*arrays) -> array``, all with a leading axis of rows that ``fn`` treats one by one, such that under
    ``vmap`` the batch is folded into the rows: ``fn`` runs unbatched on batch x rows rows, at any depth of
    ``vmap``. For in-place writes (``dynamic_update_slice``), which ``vmap`` would make bounds-checked scatters
    that XLA's CPU backend runs as loops over the whole batched array (8 vmapped seeds of PPO on CartPole ran
    2.2x slower so). Derivatives are ``fn``'s own (``custom_vmap`` alone has no reverse mode)."""
    import jax
    import jax.numpy as jnp

    @jax.custom_batching.custom_vmap
    def batchable(*args):
        return fn(*args)

    @batchable.def_vmap
    def batched(size, in_batched, *args):
        args = [x if b else jnp.broadcast_to(x, (size, *x.shape)) for x, b in zip(args, in_batched, strict=True)]
        r = args[0].shape[1]
        out = folded(*(x.reshape(size * r, *x.shape[2:]) for x in args))
        return out.reshape(size, r, *out.shape[1:]), True

    @jax.custom_jvp
    def folded(*args):
        return batchable(*args)

    folded.defjvp(lambda primals, tangents: (folded(*primals), jax.jvp(fn, primals, tangents)[1]))
    return folded


def unravel(like: Any, vector: Any) -> Any:
    """The inverse of :func:`ravel`: ``vector`` cut into leaves shaped as those of ``like``."""
    import jax
    import numpy as np

    leaves, tree = jax.tree.flatten(like)
    ends = np.cumsum([x.size for x in leaves])
    return tree.unflatten([vector[e - x.size: e].reshape(x.shape) for x, e in zip(leaves, ends)])


def replicated(fn: Callable, mesh: Any) -> Callable:
    """``fn`` over a leading replica axis of every input and output leaf: the replicas are split over the
    devices of ``mesh`` (its one axis; ``shard_map``) and ``vmap``ped on each device, and collectives
    inside (:func:`all_reduce_mean`) reduce over all of them. Trace the result under jit."""
    import jax
    from jax.sharding import PartitionSpec

    axes = (mesh.axis_names[0], REPLICA_AXIS)
    spec = PartitionSpec(axes[0])
    mapped = jax.shard_map(jax.vmap(fn, axis_name=REPLICA_AXIS), mesh=mesh, in_specs=spec, out_specs=spec,
                           check_vma=False)

    def call(*args: Any) -> Any:
        token = _REPLICA_AXES.set(axes)
        try:
            return mapped(*args)
        finally:
            _REPLICA_AXES.reset(token)

    return call
