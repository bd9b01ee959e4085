"""``msrl.compile(algorithm, policy, env) -> Program``: loop -> IR -> FDG -> partition -> fragments."""

from __future__ import annotations

import ast
import builtins
import contextlib
import copy
import dataclasses
import importlib.machinery
import importlib.util
import inspect
import json
import numbers
import os
import sys
import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import networkx as nx
import numpy as np

from msrl.backend import LOOP_UNROLL, scan, unsplit
from msrl.compiler import frontend, rows
from msrl.compiler.fdg import build_fdg
from msrl.compiler.ir import Stmt, leaves, walk
from msrl.compiler.lower import Lowered, generate, materialize, reraise_at_user_line
from msrl.compiler.partition import assign_roles, partition
from msrl.components import (SHAPE_PROBE, STATS, Actor, Environment, Learner, MultiAgentObs, MultiAgentSpec,
                             ReplayBuffer, Wrapper, vouched_rowwise)
from msrl.errors import CompileError, ConfigError, MsrlError, defined_at, gist, method_name
from msrl.plan import FragmentSpec, Plan
from msrl.policy import Policy, prepare_learner
from msrl.replay import shard_part

COMPONENTS = ("env", "actor", "learner", "buffer")
_SEEDS = {name: i for i, name in enumerate(COMPONENTS)}


def _scan(body: Callable, carry: Any, xs: Any, length: int) -> Any:
    """A training loop's ``for range`` (lower.py writes the calls): :func:`msrl.backend.scan`, unrolled by
    :data:`~msrl.backend.LOOP_UNROLL` where it unrolls."""
    return scan(body, carry, xs, length=length, default=LOOP_UNROLL)


def _sds(x: Any) -> Any:
    return jax.ShapeDtypeStruct(x.shape, x.dtype) if hasattr(x, "shape") and hasattr(x, "dtype") else x


_LAPACK_LOCK = threading.Lock()
_LAPACK_TRIED = False


def _lapack_without_scipy_linalg() -> None:
    """Hand jaxlib LAPACK without importing all of ``scipy.linalg`` (~0.27 s of every start on CPU).

    Orthogonal initializers run a QR, which jaxlib's CPU backend computes with LAPACK; jaxlib finds LAPACK's
    functions in the extension modules ``scipy.linalg.cython_blas`` and ``cython_lapack``, and importing them the
    usual way first imports the whole ``scipy.linalg`` package. Here the two modules are loaded by themselves
    (~15 ms), jaxlib reads them, and they leave ``sys.modules`` again, so a later ``import scipy.linalg`` is the
    ordinary one. The same LAPACK functions either way; if anything here fails, jaxlib imports them itself."""
    global _LAPACK_TRIED
    names = ("scipy.linalg.cython_blas", "scipy.linalg.cython_lapack")
    with _LAPACK_LOCK:
        if _LAPACK_TRIED or "scipy.linalg" in sys.modules:
            return
        _LAPACK_TRIED = True
        # in another jaxlib or scipy layout this fails and jaxlib imports scipy.linalg when it needs LAPACK
        try:
            with contextlib.suppress(ImportError, AttributeError, OSError, RuntimeError):
                import scipy
                from jaxlib.cpu import _lapack

                finder = importlib.machinery.FileFinder(
                    os.path.join(os.path.dirname(scipy.__file__), "linalg"),
                    (importlib.machinery.ExtensionFileLoader, importlib.machinery.EXTENSION_SUFFIXES))
                for name in names:
                    spec = finder.find_spec(name)
                    sys.modules[name] = module = importlib.util.module_from_spec(spec)
                    spec.loader.exec_module(module)
                _lapack.initialize()
        finally:
            for name in names:
                sys.modules.pop(name, None)


_INIT_LOCK = threading.Lock()


def run_init(init: Callable, *args: Any, cache: dict | None = None, name: Any = None) -> Any:
    """A component's ``init(*args)`` as one jitted program (a single XLA compile, kept in the persistent
    compilation cache; run eagerly, a network's initialization is dozens of small compiles every start), or
    eagerly where it cannot be traced (host-side state). Every replica, service and policy computes an initial
    state this way, so all of them start from the same bits. It runs once, so on CPU LLVM does not optimize it: that
    is a third of the compile time of a network's random initializers (the values agree to rounding with an optimized
    compile, not bitwise; XLA's GPU backend supports no such setting). ``cache`` (a program's, for the init of its
    component ``name``) keeps the compiled init for arguments of these shapes: the replicas of a program in one
    process compile it once, not once each (8 actors on threads started together compiled Brax's reset 8 times)."""
    _lapack_without_scipy_linalg()
    traced = any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(args))  # (inside a program)
    try:
        if traced:
            return jax.jit(init)(*args)
        once = {"xla_backend_optimization_level": 0} if jax.default_backend() == "cpu" else None

        def compile_init() -> Any:
            return jax.jit(init).lower(*args).compile(compiler_options=once)

        if cache is None:
            program = compile_init()
        else:
            leaves, tree = jax.tree.flatten(args)
            signature = (name, tree, *map(jax.typeof, leaves))
            with _INIT_LOCK:
                if signature not in cache:
                    cache[signature] = compile_init()
                program = cache[signature]
    except (jax.errors.JAXTypeError, jax.errors.JAXIndexError):
        return init(*args)
    return program(*args)


KINDS = {"actor": (Actor, "act"), "learner": (Learner, "learn"), "buffer": (ReplayBuffer, "insert")}


def _check_component_objects(algorithm: Any, components: dict[str, Any], stmts: list[Stmt]) -> None:
    """The components the loop uses (and the learner, which a policy prepares) are objects, not classes, of the
    kind their role needs, with the methods the loop's calls need (a CompileError at the user's class otherwise;
    a component may be any object with those methods: msrl's classes are not required)."""
    owner, calls = type(algorithm).__name__, [s for s in leaves(stmts) if s.kind == "api"]
    params = any("@params" in s.uses for s in calls)
    used = {s.api.component for s in calls} | {"learner"}
    for name, (base, method) in KINDS.items():
        value = components.get(name)
        if value is None or name not in used:
            continue
        if isinstance(value, type):
            raise CompileError(f"{owner}.{name} is the class {value.__name__}, not an object of it",
                               *defined_at(type(algorithm)), f"build one in __init__: self.{name} = "
                               f"{value.__name__}(...)")
        if not isinstance(value, base) and not callable(getattr(value, method, None)):
            raise CompileError(f"{owner}.{name} must be an msrl.{base.__name__} (an object of a subclass of it), got "
                               f"{type(value).__name__}", *defined_at(type(algorithm)))
    names = {s.api.name for s in calls}
    needs = [("actor", "act(state, params, obs)", "msrl.agent_act calls")] * ("agent_act" in names) + \
        [("learner", "learn(state, batch)", "msrl.agent_learn calls")] * ("agent_learn" in names) + \
        [("learner", "policy_params(state)", "gives the actor its parameters")] * params + \
        [("learner", "init(key)", "makes the learner's state")] * ("agent_learn" in names or params)
    for name, signature, why in needs:
        value = components.get(name)
        if value is not None and _undefined(value, signature.partition("(")[0], KINDS[name][0]):
            raise CompileError(f"{type(value).__name__}, {owner}'s {name}, defines no {signature}, which {why}",
                               *defined_at(type(value)))
    for name in ("actor", "learner"):
        if components.get(name) is not None and name in used:
            _check_traced_method_calls(components[name])


def _check_traced_method_calls(component: Any) -> None:
    """A user's actor or learner method that JAX traces calls no np.random / random / time (a value the trace
    fixes: the same every iteration, without a word); a print() in one is a warning, as in the loop."""
    import inspect
    import textwrap

    for method in ("init", "act", "learn", "policy_params"):
        fn = getattr(type(component), method, None)
        if fn is None or getattr(fn, "__module__", "").startswith("msrl.") or not inspect.isfunction(fn):
            continue
        try:
            file, (lines, first) = inspect.getsourcefile(fn), inspect.getsourcelines(fn)
            tree = ast.parse(textwrap.dedent("".join(lines)))
        except (OSError, TypeError, SyntaxError):
            continue
        what, fdef = f"{type(component).__name__}.{method}()", tree.body[0]
        line = lambda node: first + getattr(node, "lineno", 1) - 1  # noqa: E731
        changed = frontend.lasting_change_in(fdef) if isinstance(fdef, ast.FunctionDef) else None
        if changed is not None:  # (self.updates += 1 in learn() counted traces, not updates)
            raise CompileError(f"{what} changes an object that outlives it (of its self, a class or a global): JAX "
                               "traces it a few times, not once per call, so what it keeps counts traces", file,
                               line(changed), "keep what changes in the state the method is given and returns")
        me = {fdef.args.args[0].arg: component} if isinstance(fdef, ast.FunctionDef) and fdef.args.args else {}
        frontend.check_traced_calls(tree, {**vars(builtins), **fn.__globals__, **me}, file, line, what, "JAX traces it",
                                    "call", "draw random numbers with jax.random from a key in the state the method "
                                    "is given")


def _undefined(value: Any, method: str, base: type) -> bool:
    """``value`` has no ``method`` of its own (or its class's): none at all, or only ``base``'s placeholder."""
    own = getattr(value, "__dict__", {})
    if method in own:
        return not callable(own[method])
    found = getattr(type(value), method, None)
    return found is None or found is getattr(base, method, None)


def _hint(e: CompileError, instead: str) -> str:
    """``e``'s own hint, or ``instead`` where it only says to run with ``--debug``."""
    return e.hint if e.hint and "--debug" not in e.hint else instead


def _signature(tree: Any) -> dict[str, tuple]:
    """Each leaf's path -> (shape, dtype)."""
    return {jax.tree_util.keystr(p) or "the state": (tuple(getattr(x, "shape", ())), str(getattr(x, "dtype", "")))
            for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def _written(method: str) -> str:
    """A component's method as its author wrote it: ``msrl.env_step`` calls an env's ``transition``, which wraps
    the ``step`` the author wrote."""
    return "step" if method == "transition" else method


def _check_returned(component: Any, method: str, old: Any, result: Any, alone: bool = False) -> None:
    """A component's method returns ``(state, output)`` (``alone``: the state alone, a buffer's ``insert`` and
    ``update``) with the state it was given, in structure, shapes and dtypes (the loop carries it): else a
    CompileError naming the method's file:line (raised at the user's API call)."""
    name = method_name(component, _written(method))
    if alone:
        if _signature(old) != _signature(result) and isinstance(result, tuple) and len(result) == 2 and \
                _signature(old) == _signature(result[0]):
            raise CompileError(f"{name} returned (state, {type(result[1]).__name__}); it returns its new state alone")
        result = (result, None)
    if not (isinstance(result, tuple) and len(result) == 2):
        got = f"{len(result)} values" if isinstance(result, tuple) else \
            f"an array of shape {tuple(result.shape)}" if hasattr(result, "shape") else \
            f"a {type(result).__name__}" + (f" with keys {list(result)[:6]}" if isinstance(result, dict) else "")
        raise CompileError(f"{name} returned {got}; it must return (state, output): its new state first")
    before, after = _signature(old), _signature(result[0])
    if before != after:
        diff = [f"{k}: missing" for k in before if k not in after] + [f"{k}: new" for k in after if k not in before]
        diff += [f"{k}: {before[k]} -> {after[k]}" for k in before if k in after and before[k] != after[k]]
        raise CompileError(f"{name} returned a new state unlike the one it was given ({'; '.join(diff[:3])}); the "
                           "loop carries it from call to call, so it keeps its structure, shapes and dtypes",
                           hint="return (state, output) with the state built like the one init returned")


def _check_env_output(env: Any, method: str, result: tuple) -> None:
    """An env's ``observe``, ``reset`` and ``step`` give what its spec says, for each of the N environments:
    observations ``[N, *obs_shape]`` of ``obs_dtype``, and from ``step`` ``[N]`` rewards and ends; else a
    CompileError naming the method (``step``'s form is checked by :meth:`Environment.transition`)."""
    spec = env.spec
    if method not in ("observe", "reset", "transition"):
        return
    out, name = result[1], method_name(env, _written(method))
    obs = out.obs if method == "transition" else out

    def form(x: Any) -> str:
        return f"{np.dtype(x.dtype).name}{list(x.shape)}" if hasattr(x, "dtype") else f"a {type(x).__name__}"

    dtype = np.dtype(spec.obs_dtype)
    if isinstance(spec, MultiAgentSpec):  # agents [N, num_agents, *obs_shape], state [N, *state_shape]
        agents = (spec.num_agents, *spec.obs_shape)
        want = f"MultiAgentObs(agents={dtype.name}{list(agents)}, state={list(spec.state_shape)})"
        shape = tuple(getattr(getattr(obs, "agents", None), "shape", ()))
        fits = isinstance(obs, MultiAgentObs) and shape[1:] == agents and hasattr(obs.agents, "dtype") and \
            np.dtype(obs.agents.dtype) == dtype and tuple(getattr(obs.state, "shape", ())) == (*shape[:1],
                                                                                                *spec.state_shape)
        got = f"MultiAgentObs(agents={form(obs.agents)}, state={form(obs.state)})" if isinstance(obs, MultiAgentObs) \
            else form(obs)
    else:
        want, shape = f"{dtype.name}{list(spec.obs_shape)}", tuple(getattr(obs, "shape", ()))
        fits = shape[1:] == tuple(spec.obs_shape) and np.dtype(getattr(obs, "dtype", None)) == dtype
        got = form(obs)
    if not fits:
        hint = "return what the spec says, or make the spec say what the env returns"
        if not isinstance(obs, MultiAgentObs) and not hasattr(obs, "shape"):  # a dict, a tuple: one array each
            hint = ("an observation is one array per environment: concatenate the parts (jnp.concatenate of each "
                    "flattened, along the last axis) and give the spec that shape")
        elif dtype.kind in "fiu" and dtype.itemsize == 8:  # (which JAX without x64 never gives)
            hint = (f"msrl runs JAX in 32 bits (jax_enable_x64 is refused), so a jitted env's arrays are never "
                    f"{dtype.name}: make the spec say {dtype.name.replace('64', '32')}")
        raise CompileError(f"{name} returned observations {got}, but {spec.id}'s spec ({type(spec).__name__}) says "
                           f"{want} for each environment", hint=hint)
    if method == "transition":
        for what, x in (("rewards", out.reward), ("terminated flags", out.terminated),
                        ("truncated flags", out.truncated)):
            if tuple(getattr(x, "shape", ())) != shape[:1]:
                raise CompileError(f"{name} returned {what} of shape {list(getattr(x, 'shape', ()))}; they must "
                                   f"be one per environment: [{shape[0]}]")
        final = out._final_obs
        if final is not None and jax.tree.map(form, final) != jax.tree.map(form, obs):
            raise CompileError(f"{name} returned final observations {jax.tree.map(form, final)}, but observations "
                               f"{got}: final_obs is each environment's last observation (of the episode that "
                               "ended; obs elsewhere), shaped as obs", hint="give final_obs the observations' form")


def _check_actions(env: Any, action: Any, num_envs: int | None = None) -> None:
    """The actions the loop hands ``msrl.env_step`` are one per environment (of ``num_envs``), shaped as the env's
    action space says (an env may broadcast others without a word); else a CompileError (raised at the loop's
    line)."""
    spec = env.spec
    if not hasattr(action, "shape"):  # (a tuple: "can't multiply sequence by non-int" from inside the env)
        shown = jax.tree.map(lambda x: f"{x.dtype}{list(x.shape)}" if hasattr(x, "shape") else x, action)
        raise CompileError(f"msrl.env_step got a {type(action).__name__} as its actions ({gist(repr(shown))}), not "
                           "an array", hint="hand it the actions array: out.action of what msrl.agent_act returns "
                           "(an actor's act() returns (state, msrl.ActOutput(action=...)))")
    if num_envs is not None and action.shape[:1] != (num_envs,):  # (jax's vmap message: "inconsistent sizes")
        raise CompileError(f"msrl.env_step got actions shaped {list(action.shape)}, but the loop steps {num_envs} "
                           "environments", hint=f"hand it one action per environment: [{num_envs}, ...]")
    if isinstance(spec, MultiAgentSpec):  # (a multi-agent spec: its adapter's)
        return
    if spec.discrete and hasattr(action, "dtype") and not jnp.issubdtype(action.dtype, jnp.integer):
        raise CompileError(f"msrl.env_step got {action.dtype} actions, but {spec.id}'s actions are integers "
                           f"(0..{spec.action_space.n - 1})", hint="hand it the sampled actions' indices (jnp.int32)")
    want = () if spec.discrete else tuple(spec.action_space.shape)
    if tuple(action.shape[1:]) != want:
        each = "one integer" if spec.discrete else f"shaped {list(want)}"
        raise CompileError(f"msrl.env_step got actions shaped {list(action.shape)}, but {spec.id}'s actions are "
                           f"{each} for each environment", hint=f"hand it [num_envs{''.join(f', {d}' for d in want)}]")


def _users_env(env: Environment) -> Environment:
    """The user's env inside msrl's own wrapper (``env.kwargs.mask_obs``)."""
    from msrl.envs import MaskedObs

    while isinstance(env, MaskedObs):
        env = env.env
    return env


def env_method(env: Environment, method: str, state: Any, error: type = CompileError) -> Any:
    """``env.method(state)`` (``stats``, read for the rows; ``episode_counts``, by ``msrl eval``); what it raises
    as ``error`` (a CompileError, or a ConfigError on ``env.id``) naming the user's env (a ``msrl.Wrapper`` whose
    state is not its env's, say: it was a raw AttributeError)."""
    try:
        return getattr(env, method)(state)
    except (MsrlError, jax.errors.JAXTypeError):
        raise
    except Exception as e:  # noqa: BLE001 - the user's env's own error, named
        env = _users_env(env)
        wrapper = " (a msrl.Wrapper whose state is not the wrapped env's overrides it too)" \
            if isinstance(env, Wrapper) else ""
        where = defined_at(type(env))
        message = f"{type(env).__name__}.{method}(state) raised {type(e).__name__}: {gist(str(e))}{wrapper}"
        raise (CompileError(message, *where) if error is CompileError else
               ConfigError("env.id", f"{message} ({where[0]}:{where[1]})")) from e


def _check_env_stats(env: Environment, state: Any) -> None:
    """A jitted env's ``stats(state)`` is a dict of the episode statistics msrl logs (a CompileError at its class
    otherwise: it is first called in the program, where a KeyError would name none of the user's lines)."""
    from collections.abc import Mapping

    stats = env_method(env, "stats", state)
    missing = [k for k in STATS if not isinstance(stats, Mapping) or k not in stats]
    if missing:
        env = _users_env(env)
        got = f"no {', '.join(missing)}" if isinstance(stats, Mapping) else f"a {type(stats).__name__}"
        raise CompileError(f"{type(env).__name__}.stats(state) returns {got}; msrl logs episodes from a dict of "
                           f"{', '.join(STATS)} (optionally length_sum, nonfinite: see msrl.Environment.stats)",
                           *defined_at(type(env)))


def component_keys(seed: int) -> dict[str, jax.Array]:
    root = jax.random.PRNGKey(seed)
    return {name: jax.random.fold_in(root, i) for name, i in _SEEDS.items()}


@dataclasses.dataclass
class Fragment:
    spec: FragmentSpec
    stmts: list[Stmt]  # the program projected onto this fragment (with send/recv statements)
    state_keys: list[str]  # component states it holds ("params" when it receives them)
    lowered: Lowered
    zeros: dict[str, Any]
    mode: str  # "scan": jit it whole; "host": calls its own jitted segments; "python": eager
    namespace: dict[str, Any]  # what its source runs in (backends add the comm endpoints)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def source(self) -> str:
        return self.lowered.source

    @property
    def fn(self):
        return self.lowered.fn


def whole(buffer: Any, scale: float = 1.0) -> Any:
    """A replay buffer (one that a policy may split over shards) as one, holding ``scale`` times its capacity: what
    the shape probes (which trace every environment at once, or twice as many: ``scale`` 2, the same steps of
    each) and the memory estimate see. Its samples are the learner's joined batch."""
    if not hasattr(buffer, "shards") or (buffer.shards == 1 and scale == 1):
        return buffer
    one = _resized(buffer, scale)
    one.shards = 1
    return one


def _resized(buffer: Any, scale: float) -> Any:
    """A copy of a splittable replay buffer holding ``scale`` times its capacity."""
    if not isinstance(getattr(buffer, "capacity", None), numbers.Integral):  # (an AttributeError in the compiler)
        raise CompileError(f"{type(buffer).__name__} has `shards` but no `capacity` (the entries it holds, an int), "
                           "which a policy splitting it sets to each shard's part", *defined_at(type(buffer)))
    one = copy.copy(buffer)
    one.capacity = max(1, round(buffer.capacity * scale))
    if getattr(buffer, "item_spec", None) is not None and scale != 1:  # an explicit spec: items of as many envs
        one.item_spec = _env_rows(buffer.item_spec, lambda n: round(n * scale))
    return one


def _env_rows(spec: Any, rows: Callable[[int], int]) -> Any:
    """An explicit buffer item spec with ``rows(n)`` environments on its leading axis, of ``n``."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct((rows(x.shape[0]), *x.shape[1:]), x.dtype) if x.shape else x,
                        spec)


class _ProbeBuffer:
    """During shape inference: initializes the buffer from the first inserted item's shapes."""

    def __init__(self, buffer: Any, scale: float = 1.0):
        self.buffer = whole(buffer, scale)
        # as the shards hold it (a sample's size must divide among them), for as many steps of the probe's envs
        self.split = buffer if getattr(buffer, "shards", 1) == 1 or scale == 1 else _resized(buffer, scale)
        self.key, self.item_spec = None, self.buffer.item_spec

    def init(self, item: Any) -> Any:
        self.item_spec = jax.tree.map(_sds, item)
        return self.buffer.init(self.key, self.item_spec)

    def insert(self, state: Any, item: Any) -> Any:
        if state is not None:
            return self.buffer.insert(state, item)
        state = self.init(item)  # (the first: the loop's check has no state to compare with)
        result = self.buffer.insert(state, item)
        _check_returned(self.split, "insert", state, result, alone=True)
        return result

    def __getattr__(self, method: str):
        def call(state: Any, *args: Any, **kwargs: Any):
            if state is None:
                raise CompileError(
                    f"buffer.{method}() runs before any buffer_insert, so the shape of the buffer's items is "
                    "unknown", hint="give the buffer an explicit item_spec (a pytree of jax.ShapeDtypeStruct)")
            shards = getattr(self.split, "shards", 1) if method == "sample" else 1
            if shards > 1:  # split by a policy
                shard_part(self.split, args[0] if args else kwargs.get("batch_size"))
            out = getattr(self.buffer, method)(state, *args, **kwargs)
            if shards > 1:  # each shard draws its part (one drawing the whole: a batch `shards` times larger)
                one = _env_rows(self.item_spec, lambda n: n // shards)  # (a shard holds its actors' environments)
                part = self.split.sample(self.split.init(self.key, one), *args, **kwargs)
                items = (jax.tree.leaves(getattr(o[1], "item", o[1])) for o in (out, part))
                whole_rows, shard_rows = next(((len(a), len(b)) for a, b in zip(*items)
                                               if getattr(a, "ndim", 0) and getattr(b, "ndim", 0)), (0, 0))
                if shard_rows * shards != whole_rows:
                    raise CompileError(f"{method_name(self.split, 'sample')} draws {shard_rows} entries on each of its "
                                       f"{shards} shards, {shard_rows * shards} joined, where a sample of the whole "
                                       f"buffer has {whole_rows}: the learner would see another batch size",
                                       hint="a buffer with `shards` draws batch_size / shards entries of each sample "
                                            "on each (msrl.replay.shard_part(self, batch_size) gives it)")
            return out

        return call


class Program:
    """A compiled training loop: the FDG, its partition and one generated function per fragment."""

    def __init__(self, algorithm: Any, policy: Policy, env: Environment, num_envs: int,
                 analysis: dict[str, Any] | None = None):
        self.algorithm, self.policy, self.env, self.num_envs = algorithm, policy, env, num_envs
        self.components = {"env": env, **{k: getattr(algorithm, k, None) for k in COMPONENTS[1:]}}
        self.services: dict[str, Any] = {}  # shared objects the backend hosts (msrl.services)
        self.timings: dict[str, float] = {}  # seconds per compiler phase (no XLA compilation in any)
        self._inputs: dict[int, dict[str, dict[str, Any]]] = {}  # per probed env count: what statements read
        with self._phase("frontend"):
            self.stmts, self.namespace = frontend.parse(algorithm)
            _check_component_objects(algorithm, self.components, self.stmts)
            # the program's own learner: the policy sets its gradient transforms there, not on the algorithm's,
            # which another program compiled from the same algorithm object (under another policy) shares
            self.learner = copy.copy(self.components["learner"])
            if self.learner is not None:
                self.components["learner"], self.services = prepare_learner(policy, self.learner)
            self._check_components()
        self.env_steps_per_iteration = num_envs * self._count("env_step")  # >= num_envs: the frontend checks
        with self._phase("fdg+partition"):  # roles first: the buffer's role says how many shards it has
            fragments, assign = assign_roles(self.stmts, build_fdg(self.stmts), policy)
            shards = self._shard_buffer(fragments, assign)
        with self._phase("shapes"):
            self.shapes, self.item_spec = \
                (analysis["shapes"], analysis["item_spec"]) if analysis else self._infer_shapes()
        with self._phase("fdg+partition"):
            self.fdg = build_fdg(self.stmts, self.shapes)
            self.plan: Plan = partition(self.stmts, self.fdg, policy, fragments, assign, tuple(self.services), shards)
        for spec in self.plan.fragments.values():  # (a KeyError in the row check; an uneven split msrl.build and
            if spec.replicas > num_envs:  # the backends refuse, the compiler's analysis takes)
                raise unsplit(num_envs, spec.replicas, spec.name)
        self.env_axes: dict[tuple[str, str], list[int | None]] = {}  # needed only to gather/scatter/split
        self.item_axes: list[int | None] | None = None
        self._doubled: dict[tuple[str, str], Any] = {}  # the shapes traced with twice the environments
        if analysis:  # this loop's own analysis, from another process (the caller checks they compiled alike)
            self.env_axes, self.item_axes, self._doubled = (analysis[k] for k in ("env_axes", "item_axes", "doubled"))
        elif self.plan.comms or any(f.replicas > 1 for f in self.plan.fragments.values()):
            with self._phase("env axes"):
                self.env_axes = self._env_axes()
                self._check_cuts()
                self._check_rows()
        with self._phase("lowering"):
            self.fragments = {name: self._lower(spec) for name, spec in self.plan.fragments.items()}
        self.compile_seconds = sum(self.timings.values())

    def analysis(self) -> dict[str, Any]:
        """What the compiler found by tracing the loop (its values' shapes and per-environment axes), for another
        process compiling the same loop to take instead of tracing it again (``compile(..., analysis=)``)."""
        return {"shapes": self.shapes, "item_spec": self.item_spec, "env_axes": self.env_axes,
                "item_axes": self.item_axes, "doubled": self._doubled}

    @contextlib.contextmanager
    def _phase(self, name: str):
        t0 = time.perf_counter()
        yield
        self.timings[name] = time.perf_counter() - t0

    # ------------------------------------------------------------------------------------ analysis
    def _check_components(self) -> None:
        for s in leaves(self.stmts):
            if s.kind == "api" and self.components.get(s.api.component) is None:
                raise CompileError(f"msrl.{s.api.name}() needs a `{s.api.component}` component", s.file, s.line)
            if s.kind == "api" and s.api.name == "agent_act" and (len(s.args) > 1 or s.kwargs):
                act = self.components["actor"].act
                try:
                    inspect.signature(act).bind(None, None, *s.args, **dict(s.kwargs))
                except TypeError:
                    raise CompileError(f"msrl.agent_act(obs, done) hands episode starts to the actor, but "
                                       f"{type(self.components['actor']).__name__}.act(state, params, obs) takes "
                                       "none (it keeps no recurrent state)", s.file, s.line,
                                       "call msrl.agent_act(obs), or give the actor act(state, params, obs, "
                                       "done=None)") from None
            elif s.kind == "api" and s.api.name == "agent_act" and getattr(self.components["actor"], "recurrent",
                                                                           False):
                raise CompileError(f"{type(self.components['actor']).__name__} is recurrent (it keeps a hidden state "
                                   "per environment and resets it where an episode starts), but msrl.agent_act(obs) "
                                   "hands it no episode starts: acting, it would carry each episode's memory into the "
                                   "next", s.file, s.line, "call msrl.agent_act(obs, start), start marking the "
                                   "observations that begin an episode (msrl.env_starts() first, then each step's done)")
            if "@params" in s.uses and self.components["learner"] is None:
                raise CompileError(f"msrl.{s.api.name}() acts with the learner's policy parameters, but "
                                   f"{type(self.algorithm).__name__} has no learner", s.file, s.line,
                                   "set self.learner in __init__")

    def _count(self, api: str) -> int:
        def count(stmts: list[Stmt]) -> int:
            n = 0
            for s in stmts:
                if s.kind == "loop":
                    n += s.trip_count * count(s.body)
                elif s.kind == "api" and s.api.name == api:
                    n += 1
            return n

        return count(self.stmts)

    def _shard_buffer(self, fragments: dict[str, FragmentSpec], assign: dict[str, str]) -> int:
        """A replay buffer held apart from the learner is split over the replicas of the role that holds it
        (``replay_server``'s shards): each holds ``capacity / shards`` entries and draws ``batch_size /
        shards`` of a sample. (A buffer read whole, ``buffer_get``, is split along its environments; a replica
        that learns has a buffer of its own.)"""
        buffer = self.components["buffer"] = copy.copy(self.components["buffer"])  # the program's own, as the learner
        calls = [s for s in leaves(self.stmts) if s.kind == "api" and s.api.component == "buffer"]
        roles = {assign[s.id] for s in calls}
        learners = {assign[s.id] for s in leaves(self.stmts) if s.kind == "api" and s.api.name == "agent_learn"}
        shards = fragments[roles.pop()].replicas if len(roles) == 1 and not roles & learners else 1
        if hasattr(buffer, "shards"):
            buffer.shards = shards
        elif shards > 1 and any(s.api.name == "buffer_sample" for s in calls):
            shardable = ("msrl.UniformBuffer or msrl.PrioritizedBuffer, or give yours `shards` (each replica then "
                         "holds capacity / shards entries and samples batch_size / shards)")
            raise ConfigError("policy.name", f"policy {self.policy.name!r} splits the replay buffer over {shards} "
                              f"replicas, but {type(buffer).__name__} cannot be split (it has no `shards`); " + (
                                  f"use {shardable}" if self.policy.name == "replay_server" else
                                  "a buffer that actors fill and the learner samples is policy.name=replay_server's "
                                  f"job, with {shardable}; single_learner_fine and fused keep the buffer whole"))
        return shards

    def _check_cuts(self) -> None:
        """Every array joined from several replicas has a leaf axis to join along (per-environment or
        per-sample); anything else (a sample of one replica's local buffer, say) is refused: joining it would
        drop or invent numbers. (A scalar leaf is joined only if every replica holds the same: checked as
        it runs.)"""
        by_id, frags, shared = {s.id: s for s in leaves(self.stmts)}, self.plan.fragments, self._env_shares()
        for c in self.plan.comms:
            if c.op == "broadcast" and c.dst_fragment in shared and any(a is not None for a in self.comm_axes(c)):
                s = by_id[c.src]  # (each replica got every environment's rows for its share's: a vmap error mid-run)
                raise CompileError(
                    f"policy {self.policy.name!r} broadcasts `{c.var}`, a per-environment value, from "
                    f"{c.src_fragment!r} to the {frags[c.dst_fragment].replicas} {c.dst_fragment!r} replicas, each of "
                    "which holds a share of the environments: each would get every environment's rows",
                    s.file, s.line, "split it among them: a scatter along axis 'env' (what link() gives from 1 "
                    "replica to several when it returns msrl.Link())")
            senders = frags[c.src_fragment].replicas
            receivers = frags[c.dst_fragment].replicas
            if c.op != "gather" or senders == receivers:
                continue
            value = self.shapes.get((c.src, c.var))
            paths = jax.tree_util.tree_leaves_with_path(value)
            axes = self.comm_axes(c)
            bad = [jax.tree_util.keystr(p) or c.var for i, (p, x) in enumerate(paths)
                   if getattr(x, "shape", ()) and (i >= len(axes) or axes[i] is None)]
            if not bad:
                continue
            s = by_id[c.src]
            what = f"`{c.var}`" if not c.var.startswith("_") else \
                f"the result of msrl.{s.api.name}()" if s.kind == "api" else f"a value of `{s.source}`"
            sampled = any(b.kind == "api" and b.api.name == "buffer_sample" and self.plan.assign[b.id] == c.src_fragment
                          for b in by_id.values())
            raise CompileError(
                f"policy {self.policy.name!r} joins {what} from {senders} {c.src_fragment!r} replicas into "
                f"{receivers} {c.dst_fragment!r} replica{'s' if receivers > 1 else ''}, but "
                f"{'its leaves ' if len(bad) > 1 else 'its leaf '}{', '.join(bad[:3])} "
                f"{'are' if len(bad) > 1 else 'is'} not per-environment: joining the replicas' values would keep "
                "one and drop the others", s.file, s.line,
                "a replay buffer that the learner samples is sharded by policy.name=replay_server (or kept central "
                "by single_learner_fine)" if sampled else
                f"compute {what} on the {c.dst_fragment!r} side of the cut, or use policy.name=fused (one program)")

    def _env_shares(self) -> dict[str, int]:
        """The roles whose replicas each hold a share of the environments (a gather or scatter along them), and
        that share."""
        frags = self.plan.fragments
        return {f: self.num_envs // frags[f].replicas for c in self.plan.comms if c.op in ("gather", "scatter") and
                c.axis == "env" for f in (c.src_fragment, c.dst_fragment) if frags[f].replicas > 1}

    def _check_rows(self) -> None:
        """A replica holding a share of the environments runs the loop's statements on that share. Each must
        compute every environment's row from that environment alone (:mod:`msrl.compiler.rows`: traced at the N
        environments of the loop and at the replica's share), and a number a replica hands across a cut must not
        depend on how many environments it holds; otherwise the policy would compute something other than the
        loop, so it refuses it."""
        frags, comms, share = self.plan.fragments, self.plan.comms, self._env_shares()
        at = {n: self._probe_share(n, set(share)) for n in set(share.values())}  # the shapes at a replica's share
        small = self._inputs[self.num_envs]
        actor, env = self.components.get("actor"), self.components["env"]
        checked = {"actor"} | ({"env"} if not (env.host_state or vouched_rowwise(env)) else set())  # a user's env too
        namespace = {**self.namespace, "self": self.algorithm, "_c_actor": actor, "_c_env": env}
        acting = [s for s in leaves(self.stmts) if self.plan.assign.get(s.id) in share and s.kind == "api"
                  and s.api.component in checked]
        stepping = next((s for s in leaves(self.stmts) if self.plan.assign.get(s.id) in share and s.kind == "api"
                         and s.api.component == "env"), None)
        if stepping is not None and env.jittable and env.host_simulator and not vouched_rowwise(env):
            frag, (file, line) = self.plan.assign[stepping.id], defined_at(type(env))
            where = f" ({file}:{line})" if file else ""
            raise CompileError(
                f"policy {self.policy.name!r} steps each of its {frags[frag].replicas} {frag!r} replicas' share of "
                f"the {self.num_envs} environments alone, but {type(env).__name__}{where} holds "
                "simulators of the host (an EnvPool env.xla pool), so msrl cannot check that it computes each "
                "environment's numbers from that environment alone", stepping.file, stepping.line,
                "set the env's `rowwise = True` if it does (no mean or key shared over environments), or use "
                "policy.name=fused")

        def judge(n: int, at_n: Callable[[int], str | None]) -> str | None:
            """Why a replica's ``n`` environments may compute other rows than the loop's N. For one environment,
            jax traces some operations in their own way (``take_along_axis``), so a trace that differs there in
            more than a number is judged at N and 2N instead."""
            why = at_n(n)
            return at_n(2 * self.num_envs) if why and n == 1 and why != rows.COUNT else why

        first: dict[tuple[str, int], Stmt] = {}
        for s in acting:
            first.setdefault((s.api.component, share[self.plan.assign[s.id]]), s)
        for s in first.values():
            comp, n = self.components[s.api.component], share[self.plan.assign[s.id]]  # its state, as a replica
            ids = {k: [jax.random.PRNGKey(0), jax.ShapeDtypeStruct((k,), jnp.int32)]  # starts it
                   for k in (n, self.num_envs, 2 * self.num_envs)}
            with rows.trusting(comp):  # (the adapters a user's env wraps: on msrl's word)
                why = judge(n, lambda k, comp=comp: rows.mixing_fn(comp.init, ids[self.num_envs], ids[k]))
            if why:
                raise CompileError(
                    f"policy {self.policy.name!r} initializes the {s.api.component} on each of its "
                    f"{frags[self.plan.assign[s.id]].replicas} replicas for its {n} of the {self.num_envs} "
                    f"environments, but {method_name(comp, 'init')} {why}: the replicas could compute something "
                    "other than the loop", s.file, s.line, "derive per-environment values from env_ids (the "
                    "global environment indices), or use policy.name=fused" +
                    (" or single_learner_fine" if comp is actor else ""))
        for s in leaves(self.stmts):
            frag = self.plan.assign.get(s.id)
            if frag not in share or s.id not in small:
                continue
            n, what = share[frag], "this statement"
            why = judge(n, lambda k: rows.mixing(s, small[s.id], self._inputs[k].get(s.id, {}), namespace))
            if not why and s in acting:  # its arguments pass: the actor's or env's own method, with its state
                comp = self.components[s.api.component]
                what = f"{method_name(comp, _written(s.api.method))}, called here,"
                with rows.trusting(comp):
                    why = judge(n, lambda k: rows.mixing(s, small[s.id], self._inputs[k].get(s.id, {}), namespace,
                                                         method=True))
                if why and comp is env:
                    raise CompileError(
                        f"policy {self.policy.name!r} steps each of its {frags[frag].replicas} {frag!r} replicas' "
                        f"{n} of the {self.num_envs} environments alone, but {what} {why}: the replicas could "
                        "compute something other than the loop", s.file, s.line,
                        "make environment i's numbers from its own row of the state alone (its key from "
                        "fold_in(key, env_id), no mean or key shared over environments), set the env's `rowwise = "
                        "True` if it does so in a way msrl cannot tell, or use policy.name=fused")
            if why:
                raise CompileError(
                    f"policy {self.policy.name!r} runs {what} on each of its {frags[frag].replicas} "
                    f"{frag!r} replicas, which hold {n} of the {self.num_envs} environments each, but it {why}: the "
                    "replicas could compute something other than the loop", s.file, s.line,
                    "compute it inside the learner (on the whole batch"
                    f"{', as one of its metrics' if s.kind == 'return' else ''}), or use policy.name=fused or "
                    "single_learner_fine, which act on all environments in one place")
        by_id = {s.id: s for s in leaves(self.stmts)}
        for c in comms:
            if c.op != "gather" or c.src_fragment not in share:
                continue
            n = share[c.src_fragment]
            pairs = zip(jax.tree.leaves(self.shapes.get((c.src, c.var))), jax.tree.leaves(at[n].get((c.src, c.var))),
                        strict=False)
            moved = next(((a, b) for a, b in pairs if isinstance(a, (int, float)) and a != b), None)
            if moved is not None:
                s = by_id[c.src]
                raise CompileError(
                    f"policy {self.policy.name!r} hands `{c.var}` from each of its {frags[c.src_fragment].replicas} "
                    f"{c.src_fragment!r} replicas to the {c.dst_fragment!r}, but its value depends on how many "
                    f"environments a replica holds ({moved[0]} for the loop's {self.num_envs} environments, "
                    f"{moved[1]} for a replica's {n}): the replicas would compute something other than the loop",
                    s.file, s.line, "compute it where all environments are seen: inside the learner, from the "
                    "batch's shape")

    def _probe_share(self, n: int, shared: set[str]) -> dict[tuple[str, str], Any]:
        """The loop's shapes (and each statement's inputs, for the row check) traced with a replica's ``n``
        environments. A statement of another fragment (the learner's) need not trace with ``n``: it never runs
        with them; the probe stops there, and what the replicas' statements read before it is what counts."""
        shapes: dict[tuple[str, str], Any] = {}
        try:
            self._infer_shapes(n, shapes)
        except CompileError as e:
            missing = [s for s in leaves(self.stmts) if self.plan.assign.get(s.id) in shared
                       and s.id in self._inputs[self.num_envs] and s.id not in self._inputs[n]]
            if missing:
                raise CompileError(
                    f"{e.reason} (with {n} environments: each replica of policy {self.policy.name!r} runs the loop "
                    f"on its {n} of the {self.num_envs} environments)", e.file, e.line,
                    _hint(e, "a statement whose shapes hold only for one count of environments (a size written as a "
                          "number) cannot run on a share of them: derive the size from the arrays, or use "
                          "policy.name=fused")) from None
        return shapes

    def _state_keys(self, stmts: list[Stmt]) -> tuple[list[str], bool]:
        """The states a fragment holds, and whether it derives the policy params from its own learner
        (else, if it reads them, it holds a "params" state that the backend keeps up to date)."""
        used = {s.api.component for s in leaves(stmts) if s.kind == "api"}
        keys = [c for c in COMPONENTS if c in used]
        reads_params = any("@params" in s.uses for s in leaves(stmts))
        derive = "learner" in used and reads_params
        return keys + (["params"] if reads_params and not derive else []), derive

    def _infer_shapes(self, num_envs: int | None = None,
                      shapes: dict | None = None) -> tuple[dict[tuple[str, str], Any], Any]:
        """Run the whole loop once under ``jax.eval_shape``, recording every definition's shape (into ``shapes``,
        if given, as the probe goes)."""
        num_envs = num_envs or self.num_envs
        used, derive = self._state_keys(self.stmts)
        probe_buffer = _ProbeBuffer(self.components["buffer"], num_envs / self.num_envs) if "buffer" in used else None
        lowered, _ = generate("probe", self.stmts, used, "probe", derive_params=derive, returns=True)
        shapes = {} if shapes is None else shapes
        inputs = self._inputs[num_envs] = {}  # what each statement reads, for the row check

        def record(sid: str, values: dict[str, Any]) -> None:
            for var, value in values.items():
                shapes[(sid, var)] = jax.tree.map(_sds, value)

        def record_in(sid: str, values: dict[str, Any]) -> None:
            inputs[sid] = jax.tree.map(_sds, values)

        def returned(component: str, method: str, old: Any, result: Any, alone: bool) -> Any:
            if old is not None:  # (a buffer's state is made by its first insert)
                _check_returned(components[component], method, old, result, alone)
            if component == "env":
                _check_env_output(components["env"], method, result)
            return result

        # host components cannot be traced: an env's stand-in has its shapes, a wrapped learner's is the one it wraps
        components = {**self.components, "env": self.env.shape_stand_in(), "learner": self.learner}
        ns = {**self.namespace, "self": self.algorithm, "_msrl_record": record, "_msrl_record_in": record_in,
              "_msrl_returned": returned,
              "_msrl_check_actions": lambda a: _check_actions(components["env"], a, num_envs),
              **{f"_c_{c}": components[c] for c in used if c != "params"}}
        if probe_buffer is not None:
            ns["_c_buffer"] = probe_buffer
        fn = materialize(lowered, ns)

        def probe():  # everything inside one abstract trace: nothing is computed or compiled
            if probe_buffer is not None:
                probe_buffer.key = component_keys(0)["buffer"]
            token = SHAPE_PROBE.set(True)
            try:
                states, result = fn(self.init_states(used, 0, jnp.arange(num_envs), lazy_buffer=True,
                                                     components=components))
            finally:
                SHAPE_PROBE.reset(token)
            self._check_metrics(result)
            if "env" in states and not self.env.host_state:
                _check_env_stats(components["env"], states["env"])
            return states, result

        try:
            jax.eval_shape(probe)
        except Exception as e:  # noqa: BLE001 - mapped to the user's line
            reraise_at_user_line(e, [lowered], "tracing")
        return shapes, probe_buffer.item_spec if probe_buffer else None

    def _check_metrics(self, result: Any) -> None:
        """What the loop returns (traced) becomes the iteration's metrics row: each metric must be one number (an
        array would be averaged into one number without a word; a string cannot leave the program)."""
        items = result.items() if isinstance(result, dict) else [("result", result)]
        ret = next((s for s in leaves(self.stmts) if s.kind == "return"), None)
        for key, value in items:
            if "Tracer" in str(key):  # (a column named "loss_JitTracer(float32[])" was logged)
                raise CompileError(
                    f"{self.algorithm.__class__.__name__}.train_step returns a metric named {str(key)!r:.80}: its "
                    "name is made from a value of the loop, known only as it runs", ret.file if ret else None,
                    ret.line if ret else None, "name metrics with text and numbers known at compile time")
            text = next((x for x in jax.tree.leaves(value) if not isinstance(x, (jax.Array, np.ndarray, np.generic,
                                                                                 int, float, bool))), None)
            if text is not None:
                raise CompileError(
                    f"{self.algorithm.__class__.__name__}.train_step returns metric {str(key)!r} = {text!r:.60} "
                    f"({type(text).__name__}); every metric is one number per iteration",
                    ret.file if ret else None, ret.line if ret else None,
                    "log text another way (print, or TensorBoard from on_iteration)")
            shapes = [np.shape(x) for x in jax.tree.leaves(value)]
            if len(shapes) == 1 and not jax.tree_util.treedef_is_leaf(jax.tree.structure(value)):  # (it was dropped)
                raise CompileError(
                    f"{self.algorithm.__class__.__name__}.train_step returns metric {str(key)!r} as a "
                    f"{type(value).__name__} holding one number; every metric is one number under its own key",
                    ret.file if ret else None, ret.line if ret else None,
                    f"return it flat, e.g. {{'{key}/loss': ...}} (TensorBoard groups the keys by their '/')")
            bad = next((shape for shape in shapes if shape != ()), None)
            if bad is not None or len(shapes) > 1:
                raise CompileError(
                    f"{self.algorithm.__class__.__name__}.train_step returns metric {str(key)!r} of shape "
                    f"{list(bad) if bad is not None else f'a tree of {len(shapes)} arrays'}; every metric is one "
                    "number per iteration", ret.file if ret else None, ret.line if ret else None,
                    "reduce it (jnp.mean(x), x.sum()) or return each number under its own key")

    def _env_axes(self) -> dict[tuple[str, str], list[int | None]]:
        """For every recorded value, the axis of each leaf that runs over environments (None: not batched
        over environments), found by probing again with twice the environments. Gathers concatenate and
        scatters split along these axes."""
        try:
            doubled, doubled_item = self._infer_shapes(2 * self.num_envs)
        except CompileError as e:  # the loop traced with N environments: say where 2N comes from
            raise CompileError(
                f"{e.reason} (with {2 * self.num_envs} environments: policy {self.policy.name!r} cuts the loop, "
                f"and traces it with twice the {self.num_envs} environments to tell which axes are per-environment)",
                e.file, e.line, _hint(e, "a statement whose shapes hold only for one count of environments (a size "
                                      "written as a number) cannot be cut: derive the size from the arrays, read "
                                      "state the learner keeps per environment through msrl.rl.per_env_carry (sized "
                                      "by Context.learner_envs), or use policy.name=fused")) from None
        self._doubled = doubled

        def axes(value: Any, twice: Any) -> list[int | None]:
            pairs = zip(jax.tree.leaves(value), jax.tree.leaves(twice), strict=False)
            return [next((i for i, (m, n) in enumerate(zip(a.shape, b.shape)) if m != n), None)
                    if hasattr(a, "shape") and hasattr(b, "shape") else None for a, b in pairs]

        self.item_axes = axes(self.item_spec, doubled_item) if self.item_spec is not None else None
        return {key: axes(value, doubled.get(key)) for key, value in self.shapes.items()}

    def comm_axes(self, comm: Any) -> list[int | None]:
        """The axis of each leaf of ``comm``'s value that its gather joins and its scatter splits."""
        if comm.axis == "batch":
            return [0 if len(s.shape) else None for s in jax.tree.leaves(self.shapes[(comm.src, comm.var)])]
        return self.env_axes.get((comm.src, comm.var), [])

    # ------------------------------------------------------------------------------------ fragments
    def _project(self, stmts: list[Stmt], frag: str) -> list[Stmt]:
        out: list[Stmt] = []
        for s in stmts:
            if s.kind == "loop":
                body = self._project(s.body, frag)
                if body:
                    out.append(dataclasses.replace(s, body=body))
            elif self.plan.assign[s.id] == frag:
                out.append(s)
            for c in self.plan.comms:
                if c.point == s.id and frag in (c.src_fragment, c.dst_fragment):
                    send = c.src_fragment == frag
                    var = frozenset({c.var})
                    out.append(Stmt(c.id, "send" if send else "recv", s.file, s.line, s.source,
                                    uses=var if send else frozenset(), defs=frozenset() if send else var,
                                    parent=s.parent))
        return out

    def _replica_shapes(self, n: int) -> dict[tuple[str, str], Any]:
        """The probe's shapes for a replica holding ``n`` of the environments (a loop variable that starts
        from zeros has its replica's size): a size that changes with the count of environments is affine in it,
        so the probes at N and 2N give it at ``n``."""
        big, num = self._doubled, self.num_envs

        def at(a: Any, b: Any) -> Any:
            if not isinstance(a, jax.ShapeDtypeStruct) or len(a.shape) != len(b.shape):
                return a
            return jax.ShapeDtypeStruct(tuple(x + (y - x) * (n - num) // num for x, y in zip(a.shape, b.shape)),
                                        a.dtype)

        return {k: jax.tree.map(at, v, big[k]) if k in big else v for k, v in self.shapes.items()}

    def _set_to_jax(self) -> list[str]:
        """The policy's role placements (``actor_backend``, ...) set to jax: what put a role there."""
        fields = type(self.policy).model_fields
        return [k for k in fields if k.endswith("_backend") and getattr(self.policy, k) == "jax"]

    def _lower(self, spec: FragmentSpec) -> Fragment:
        stmts = self._project(self.stmts, spec.name)
        keys, derive = self._state_keys(stmts)
        returns = any(s.kind == "return" for s in stmts)
        host = frozenset(c for c in keys if getattr(self.components.get(c), "jittable", True) is False)
        if host and spec.backend == "jax":
            placed = self._set_to_jax() if getattr(self.policy, "backend", "jax") != "jax" else []
            raise CompileError(
                f"environment {self.env.spec.id!r} runs on the host (numpy), but policy {self.policy.name!r} "
                f"places it in fragment {spec.name!r} on the jax backend, which jits it",
                hint=(f"policy.{placed[0]}=jax places it there: leave policy.{placed[0]} unset" if placed else
                      f"use policy.name={'replay_server' if self._count('buffer_sample') else 'single_learner_coarse'}"
                      " (or single_learner_fine) with policy.backend=threads (or ray)")
                + ("; or env.xla=true, which steps EnvPool's pools from inside the jitted program"
                   if self.env.spec.id.startswith("envpool:") else ""))
        on_host = host or any(s.kind in ("send", "recv") for s in leaves(stmts))
        mode = "python" if not spec.jit else "host" if on_host else "scan"
        if not spec.jit:  # (a policy's debugging switch: its numbers were 2e-7 from fused's, without a word)
            print(f"msrl: note: policy {self.policy.name!r} runs its role {spec.name!r} eagerly (FragmentSpec(jit="
                  "False)): op by op, slower, and its floats may round differently from fused's (by ~1e-7)",
                  file=sys.stderr, flush=True)
        per_step = [s for s in walk(stmts) if s.kind == "loop" and any(b.kind in ("send", "recv") for b in walk(s.body))]
        if spec.backend == "jax" and per_step:
            placed = next(iter(self._set_to_jax()), "backend")
            raise CompileError(f"policy {self.policy.name!r} places fragment {spec.name!r} on the jax backend "
                               f"(policy.{placed}=jax), but it communicates inside this loop", per_step[0].file,
                               per_step[0].line, "a role on jax runs as one jitted program between receiving and "
                               f"sending; set policy.{placed}=threads (or ray)")
        shapes = self.shapes if spec.replicas == 1 else self._replica_shapes(self.num_envs // spec.replicas)
        lowered, zeros = generate(spec.name, stmts, keys, mode, derive, returns, shapes, host)
        ns = {**self.namespace, "self": self.algorithm, "_msrl_scan": _scan, "_msrl_arange": jnp.arange,
              "_msrl_jit": jax.jit, "_msrl_stack": lambda items: jax.tree.map(lambda *xs: np.stack(xs), *items),
              "_msrl_zeros": lambda name: jax.tree.map(jnp.zeros_like, zeros[name]),  # (a Python number's too)
              **{f"_c_{c}": self.components[c] for c in keys if c != "params"}}
        if derive:
            ns["_c_learner"] = self.components["learner"]
        materialize(lowered, ns)
        return Fragment(spec, stmts, keys, lowered, zeros, mode, ns)

    # ------------------------------------------------------------------------------------ state
    def init_states(self, names: list[str], seed: int, env_ids: Any, lazy_buffer: bool = False,
                    components: dict[str, Any] | None = None, fold: int | None = None) -> dict:
        """Initial state of the named components for the environments ``env_ids`` (global indices);
        ``fold`` (a restarted replica's iteration) draws fresh keys for the same environments."""
        components = components or self.components
        keys = component_keys(seed)
        if fold is not None:
            keys = {name: jax.random.fold_in(key, fold) for name, key in keys.items()}
        out: dict[str, Any] = {}
        # the compiled inits, shared by the replicas in this process (not for components= of another program), per
        # config: a sweep's member sets the algorithm's config to its values, which an init may read (an optimizer
        # state that holds its learning rate)
        config = repr(getattr(self.algorithm, "cfg", None))
        cache = self.__dict__.setdefault("_inits", {}).setdefault(config, {}) if components is self.components else None
        for c in names:
            comp = components.get(c)
            if c == "env" and comp.host_state:
                out[c] = comp.init(keys[c], env_ids)
            elif c in ("env", "actor"):
                out[c] = run_init(comp.init, keys[c], env_ids, cache=cache, name=c)
            elif c == "learner":
                out[c] = run_init(comp.init, keys[c], cache=cache, name=c)
            elif c == "buffer":
                spec = comp.item_spec if comp.item_spec is not None or lazy_buffer else self._item_spec(len(env_ids))
                if comp.item_spec is not None and len(env_ids) != self.num_envs:  # a replica's share of its rows
                    spec = _env_rows(spec, lambda n: n * len(env_ids) // self.num_envs)
                key = keys[c] if len(env_ids) == self.num_envs else jax.random.fold_in(keys[c], env_ids[0])
                # (a shard of the buffer draws its own samples: the shards' keys were one, their draws alike)
                out[c] = None if spec is None else run_init(lambda key, comp=comp, spec=spec: comp.init(key, spec),
                                                            key, cache=cache, name=(c, str(spec)))
            elif c == "params":
                learner = components["learner"]
                state = out["learner"] if "learner" in out else run_init(learner.init, keys["learner"], cache=cache,
                                                                         name="learner")
                out[c] = learner.policy_params(state)
        return out

    def _item_spec(self, num_envs: int) -> Any:
        """The inferred buffer item spec for a replica holding ``num_envs`` environments."""
        if num_envs == self.num_envs or self.item_spec is None:
            return self.item_spec
        leaves, tree = jax.tree.flatten(self.item_spec)
        return jax.tree.unflatten(tree, [
            jax.ShapeDtypeStruct(tuple(num_envs if i == ax else d for i, d in enumerate(x.shape)), x.dtype)
            for x, ax in zip(leaves, self.item_axes, strict=True)])

    def hyperparameters(self, values: dict[str, Any]):
        """A block in which the algorithm's config keys hold ``values`` (``run.sweep``: a member's values, or
        traced scalars while its program is traced)."""
        from msrl.sweep import hyperparameters

        return hyperparameters(self.algorithm.cfg, values)

    def run_fragment(self, fragment: Fragment, state: dict) -> tuple[dict, Any]:
        """Call a fragment's function; errors raised in user code are reported at the user's line."""
        try:
            return fragment.fn(state)
        except Exception as e:  # noqa: BLE001
            reraise_at_user_line(e, [fragment.lowered], "running")

    # ------------------------------------------------------------------------------------ views
    def code(self) -> str:
        return "\n".join(f"# ---- fragment {f.name} (replicas={f.spec.replicas}, backend={f.spec.backend}"
                         f"{', jit' if f.spec.jit else ''})\n{f.source}" for f in self.fragments.values())

    def graph_dict(self) -> dict[str, Any]:
        nodes = [{"id": n, **{k: v for k, v in d.items()}} for n, d in self.fdg.nodes(data=True)]
        edges = [{"src": u, "dst": v, "kind": d["kind"], "name": d["name"], "shape": d["shape"], "dtype": d["dtype"],
                  "carry": d["carry"]} for u, v, d in self.fdg.edges(data=True)]
        shown = {"replicas", "backend", "devices", "jit"}  # (and on ray, what each replica's process reserves)
        frags = [{"name": f.name, **f.spec.model_dump(include=shown | ({"num_cpus", "num_gpus"} if f.spec.backend ==
                                                                       "ray" else set())), "state": f.state_keys}
                 for f in self.fragments.values()]
        return {"nodes": nodes, "edges": edges, "fragments": frags,
                "env_steps_per_iteration": self.env_steps_per_iteration, "beside_the_graph": self.beside_the_graph()}

    def beside_the_graph(self) -> list[str]:
        """What the policy adds that no comm node shows: an all-reduce inside the learner's optimizer step, the
        services it hosts (async's parameter holder)."""
        from msrl.backend import reduces_over_replicas

        out = []
        learners = [f for f in self.fragments.values() if "learner" in f.state_keys]
        if reduces_over_replicas(getattr(self.components.get("learner"), "grad_transforms", ())) and learners:
            out.append(f"the gradients of the {learners[0].spec.replicas} {learners[0].name!r} replicas are averaged "
                       "(an all-reduce) before every optimizer step, so every replica holds the same parameters")
        out += [f"service {name!r}: {service.name}, which every replica calls (its state is checkpointed)"
                for name, service in self.services.items()]
        return out

    def to_json(self) -> str:
        return json.dumps(self.graph_dict(), indent=2, default=str)

    def topological_order(self) -> list[str]:
        acyclic = nx.DiGraph((u, v) for u, v, d in self.fdg.edges(data=True) if not d["carry"])
        return list(nx.topological_sort(acyclic))


def compile(algorithm: Any, policy: Policy, env: Environment, num_envs: int,  # noqa: A001
            analysis: dict[str, Any] | None = None) -> Program:
    """Compile ``algorithm.train_step`` under ``policy`` for ``num_envs`` environments of ``env``. ``analysis``:
    a ``Program.analysis()`` of the same loop, policy, env and count (its shape probes are then not run again)."""
    if isinstance(algorithm, type):
        raise CompileError(f"msrl.compile takes an algorithm object, not the class {algorithm.__name__}: build it "
                           f"first ({algorithm.__name__}(cfg, msrl.Context(...)), or msrl.build(config))")
    if not isinstance(policy, Policy):
        raise ConfigError("policy", f"msrl.compile takes a policy object (a validated config's: "
                          f"msrl.load_config(...).policy, or one built from its class), got {type(policy).__name__} "
                          f"{policy!r:.60}")
    if not isinstance(env, Environment):
        raise ConfigError("env", f"msrl.compile takes an environment object (msrl.envs.make_env('gymnax:CartPole-v1'), "
                          f"or your own msrl.Environment), got {type(env).__name__} {env!r:.60}")
    if not isinstance(num_envs, numbers.Integral) or isinstance(num_envs, bool) or num_envs < 1:
        raise ConfigError("num_envs", f"a whole number >= 1 of environments, got {num_envs!r:.60}")
    told = getattr(getattr(algorithm, "ctx", None), "num_envs", None)
    if isinstance(told, numbers.Integral) and told != num_envs:  # (its schedules and batch checks are sized by it)
        raise ConfigError("num_envs", f"the algorithm was built for {told} environments (its msrl.Context("
                          f"num_envs={told})), but is compiled for {num_envs}: build it with the count it runs")
    return Program(algorithm, policy, env, int(num_envs), analysis)
