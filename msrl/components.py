"""Components: pure JAX objects with explicit state.

Each component has ``init(key, ...) -> state`` and pure methods ``(state, *inputs) -> (state, outputs)``.
The objects themselves hold only static configuration (networks, hyperparameters); everything that changes
lives in the state pytrees the compiler threads through the training loop.
"""

from __future__ import annotations

import contextvars
import copy
import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

PyTree = Any


# --------------------------------------------------------------------------------------------- spaces
@dataclasses.dataclass(frozen=True)
class Discrete:
    n: int

    def __post_init__(self):
        from msrl.errors import MsrlError

        if isinstance(self.n, bool) or not isinstance(self.n, (int, np.integer)) or self.n < 1:
            raise MsrlError(f"msrl.Discrete(n): n is how many actions there are, an int >= 1; got {self.n!r}")
        object.__setattr__(self, "n", int(self.n))

    @property
    def shape(self) -> tuple[int, ...]:
        return ()

    dtype = np.dtype(np.int32)


@dataclasses.dataclass(frozen=True)
class Box:
    """Actions in ``[low, high]``: numbers or arrays, kept as float32 arrays of ``shape``."""

    low: np.ndarray
    high: np.ndarray
    shape: tuple[int, ...]
    dtype: np.dtype = np.dtype(np.float32)

    def __post_init__(self):
        from msrl.errors import MsrlError

        if np.dtype(self.dtype) != np.float32:  # (float64 was dropped without a word: actions are float32)
            raise MsrlError(f"msrl.Box(low, high, shape, dtype={np.dtype(self.dtype).name}): actions are float32 (msrl "
                            "trains in 32 bits); leave dtype out (a Gymnasium env is handed actions of its own Box's "
                            "dtype)")

        shape = (int(self.shape),) if isinstance(self.shape, (int, np.integer)) else tuple(map(int, self.shape))
        try:
            low, high = (np.broadcast_to(np.asarray(b, np.float32), shape) for b in (self.low, self.high))
        except (ValueError, TypeError):
            raise MsrlError(f"msrl.Box(low, high, shape): low and high must be numbers or arrays of shape {shape}, "
                            f"got {np.shape(self.low)} and {np.shape(self.high)}") from None
        if np.isnan(low).any() or np.isnan(high).any() or (low > high).any():
            raise MsrlError(f"msrl.Box(low, high, shape): every low must be <= its high (neither NaN; -inf and inf "
                            f"leave a side unbounded), got low {low.tolist()} and high {high.tolist()}")
        for name, value in (("low", low), ("high", high), ("shape", shape)):
            object.__setattr__(self, name, value)


@dataclasses.dataclass(frozen=True)
class EnvSpec:
    """What an algorithm needs to know of an environment to build its networks."""

    id: str
    obs_shape: tuple[int, ...]
    obs_dtype: np.dtype
    action_space: Discrete | Box

    def __post_init__(self):
        from msrl.errors import MsrlError

        alike = " (every agent's is the same: agents are a batch axis)" if isinstance(self, MultiAgentSpec) else ""
        for name, shape in (("obs_shape", self.obs_shape), ("state_shape", getattr(self, "state_shape", ()))):
            if not isinstance(shape, (tuple, list)) or not all(isinstance(d, (int, np.integer)) and not isinstance(
                    d, bool) and d >= 0 for d in shape):
                raise MsrlError(f"msrl.{type(self).__name__}({self.id!r}, ...): {name} must be a tuple of ints, one "
                                f"observation's shape{alike if name == 'obs_shape' else ''}; got {shape!r}")
            object.__setattr__(self, name, tuple(int(d) for d in shape))
        if not isinstance(self.action_space, (Discrete, Box)):
            raise MsrlError(f"msrl.{type(self).__name__}({self.id!r}, ...): action_space must be an msrl.Discrete or "
                            f"msrl.Box{alike}; got {self.action_space!r}")
        try:
            dtype = np.dtype(self.obs_dtype)
        except TypeError:
            dtype = None
        if dtype is None or dtype.kind not in "biuf" or dtype.itemsize > 4:  # (float64: "observe() returned
            # float32, but the spec says float64", blaming observe(), which JAX cannot make return float64)
            raise MsrlError(f"msrl.{type(self).__name__}({self.id!r}, ...): obs_dtype {self.obs_dtype!r}: msrl trains "
                            "in 32 bits (JAX without 64-bit mode): give float32 (or uint8, int32, bool)")
        object.__setattr__(self, "obs_dtype", dtype)
        agents = getattr(self, "num_agents", 1)  # (0 was a ZeroDivisionError deep in an algorithm's network)
        if not isinstance(agents, (int, np.integer)) or isinstance(agents, bool) or agents < 1:
            raise MsrlError(f"msrl.{type(self).__name__}({self.id!r}, ...): num_agents must be a whole number >= 1; "
                            f"got {agents!r}")

    @property
    def discrete(self) -> bool:
        return isinstance(self.action_space, Discrete)

    def example_obs(self) -> jax.Array:
        """One environment's observation (zeros), to initialize networks with."""
        return jnp.zeros(self.obs_shape, self.obs_dtype)


class MultiAgentObs(NamedTuple):
    """The observation of a batch of multi-agent environments: agents are a batch axis after the
    environments' (``agents [num_envs, num_agents, *obs_shape]``), and ``state [num_envs, *state_shape]`` is the
    global state a centralized critic sees."""

    agents: jax.Array
    state: jax.Array


@dataclasses.dataclass(frozen=True)
class MultiAgentSpec(EnvSpec):
    """An environment of ``num_agents`` agents that share one reward. ``obs_shape``/``obs_dtype`` and
    ``action_space`` are one agent's (every agent has the same); observations are :class:`MultiAgentObs`,
    actions ``[num_envs, num_agents, *action_shape]``, rewards and dones ``[num_envs]``."""

    num_agents: int = 1
    state_shape: tuple[int, ...] = ()

    def example_obs(self) -> MultiAgentObs:
        """One environment's observation (zeros), to initialize networks with."""
        return MultiAgentObs(jnp.zeros((self.num_agents, *self.obs_shape), self.obs_dtype),
                             jnp.zeros(self.state_shape, self.obs_dtype))


@jax.tree_util.register_pytree_node_class
class EnvStep:
    """What ``msrl.env_step(action)`` returns, per environment. It unpacks as ``next_obs, reward, done``.

    - ``terminated``: the episode reached a terminal state (no value beyond it: do not bootstrap);
    - ``truncated``: the episode was cut short, by a time limit say (bootstrap from ``final_obs``);
    - ``done``: either of them. Environments reset themselves, so where ``done``, ``obs`` is already the next
      episode's first observation, and ``final_obs`` is the one the ended episode reached (``obs`` elsewhere).
    """

    def __init__(self, obs: Any, reward: Any, terminated: Any, truncated: Any, final_obs: Any = None):
        self.obs, self.reward, self.terminated, self.truncated = obs, reward, terminated, truncated
        self._final_obs = final_obs

    @property
    def done(self) -> Any:
        return self.terminated | self.truncated

    @property
    def final_obs(self) -> Any:
        if self._final_obs is None:
            from msrl.errors import MsrlError

            raise MsrlError("this environment does not report the final observation of an episode (its step "
                            "returns (obs, reward, done), or an EnvStep without final_obs), which EnvStep.final_obs "
                            "reads (SAC, TD3, algorithm.bootstrap_truncated): an env of your own gives it as "
                            "EnvStep's fifth argument, msrl.EnvStep(obs, reward, terminated, truncated, final_obs), "
                            "the observation each ended episode reached before its reset (obs elsewhere)")
        return self._final_obs

    def __iter__(self):
        return iter((self.obs, self.reward, self.done))

    def tree_flatten(self):
        return (self.obs, self.reward, self.terminated, self.truncated, self._final_obs), None

    @classmethod
    def tree_unflatten(cls, aux: Any, children: Any) -> "EnvStep":
        return cls(*children)

    def __repr__(self) -> str:
        return f"EnvStep(obs={self.obs!r}, reward={self.reward!r}, terminated={self.terminated!r}, " \
               f"truncated={self.truncated!r})"


def as_env_step(out: Any) -> EnvStep:
    """An environment's step result as an :class:`EnvStep`: a plain ``(obs, reward, done)`` counts every end
    as terminal."""
    if isinstance(out, EnvStep):
        return out
    obs, reward, done = out
    return EnvStep(obs, reward, done, done & False)


def _described(value: Any) -> str:
    """A value in an error's words: an array by its shape (a tracer's type names JAX's internals), else its type."""
    return f"an array shaped {list(value.shape)}" if hasattr(value, "shape") else f"a {type(value).__name__}"


def _check_step_form(env: Any, result: Any) -> None:
    """A jitted env's ``step`` returned ``(state, EnvStep or (obs, reward, done))`` with bool or integer ends;
    else a CompileError naming the method (raised at the loop's ``env_step``)."""
    from msrl.errors import CompileError, method_name

    name = method_name(env, "step")
    if not (isinstance(result, tuple) and len(result) == 2):
        got = f"{len(result)} values" if isinstance(result, tuple) else _described(result)
        raise CompileError(f"{name} returned {got}; it must return (state, EnvStep) or (state, (obs, reward, done))")
    out = result[1]
    if not isinstance(out, EnvStep) and not (isinstance(out, (tuple, list)) and len(out) == 3):
        got = f"{len(out)} values" if isinstance(out, (tuple, list)) else _described(out)
        raise CompileError(f"{name} returned (state, {got}); its output must be an EnvStep or (obs, reward, done)")
    ends = (out.terminated, out.truncated) if isinstance(out, EnvStep) else (out[2],)
    kinds = [jnp.result_type(x) for x in ends]
    if not all(k == jnp.bool_ or jnp.issubdtype(k, jnp.integer) for k in kinds):
        raise CompileError(f"{name} returned episode ends (done, or terminated and truncated) of dtype "
                           f"{', '.join(map(str, kinds))}; they must be bool", hint="compare, e.g. `t >= horizon`, "
                           "or use .astype(bool)")


# --------------------------------------------------------------------------------------------- components
class Environment:
    """A functional, jittable batch of environments (gymnax protocol, auto-reset).

    ``init(key, env_ids)`` makes the state of the environments with the given *global* indices; every
    per-environment key is ``fold_in(key, env_index)``, so splitting environments over replicas changes
    no number (the determinism contract).
    """

    spec: EnvSpec
    jittable = True
    host_simulator = False  # True: ``init`` runs on the host and makes simulators of this process that the state
    # holds (EnvPool pools stepped from XLA): a state that is never stacked, stored or sent elsewhere
    rowwise = False  # True: environment i's numbers depend on environment i alone (msrl's own adapters). Otherwise
    # a policy that splits the environments over replicas first traces init and the methods the loop calls at
    # two environment counts and refuses an env that mixes them (a mean over environments, one key for all of
    # them), as it does a loop statement. A subclass that overrides one of those methods is checked again

    @property
    def host_state(self) -> bool:
        """Its state is made on the host (a host env, or simulators it holds): ``init`` is not traced and the
        state is not checkpointed."""
        return not self.jittable or self.host_simulator

    def init(self, key: jax.Array, env_ids: jax.Array) -> PyTree:
        raise NotImplementedError

    def observe(self, state: PyTree) -> tuple[PyTree, jax.Array]:
        raise NotImplementedError

    def reset(self, state: PyTree) -> tuple[PyTree, jax.Array]:
        raise NotImplementedError

    def starts(self, state: PyTree) -> tuple[PyTree, jax.Array]:
        """``(state, bool [N])``: where the current observation is the first of an episode (``msrl.env_starts``)."""
        from msrl.errors import CompileError, defined_at

        raise CompileError(f"{type(self).__name__} defines no starts(state), which msrl.env_starts() calls (recurrent "
                           "loops reset their memory where an episode starts): it returns (state, bool [N]), true "
                           "where an environment's current observation is the first of its episode",
                           *defined_at(type(self)))

    def step(self, state: PyTree, action: jax.Array) -> tuple[PyTree, EnvStep | tuple[jax.Array, jax.Array, jax.Array]]:
        """``(state, EnvStep)``, or ``(state, (obs, reward, done))`` for an env that tells no truncation."""
        raise NotImplementedError

    def transition(self, state: PyTree, action: jax.Array) -> tuple[PyTree, EnvStep]:
        """``step``, its result as an :class:`EnvStep` (what ``msrl.env_step`` and ``msrl eval`` call). A jitted
        env's actions are clipped to a Box's bounds first (a Gaussian policy's samples may fall outside them; msrl's
        adapters clip as they hand actions on, in the env's dtype), and its result is checked as it is traced:
        ``(state, EnvStep or (obs, reward, done))``, its ends bool or integers."""
        space = self.spec.action_space
        if isinstance(space, Box) and not self.host_state and hasattr(action, "shape"):
            action = jnp.clip(action, space.low, space.high)
        result = self.step(state, action)
        if not self.host_state:
            _check_step_form(self, result)
        state, out = result
        return state, as_env_step(out)

    def stats(self, state: PyTree) -> dict[str, Any]:
        """Episode statistics, summable over replicas: ``return_sum`` and ``length_sum`` (of the last completed
        episode of every env that completed one), ``finished`` (how many such envs) and ``episodes``
        (completed); optionally ``nonfinite``, how many non-finite numbers the observations and running returns
        hold: msrl's NaN guard then stops a run naming the environment."""
        from msrl.errors import CompileError, defined_at

        raise CompileError(f"{type(self).__name__} defines no stats(state), the episode statistics msrl logs "
                           f"({', '.join(STATS)}; optionally length_sum, nonfinite)", *defined_at(type(self)))

    def episode_counts(self, state: PyTree) -> tuple[Any, Any] | None:
        """``(episodes [N], last_return [N])``: how many episodes each environment completed and the return of
        its last one, counted as the training's rows count them (an Atari game to game over, with its raw score,
        where the learner sees lives); ``msrl eval`` scores by them. None (the default): eval sums the rewards
        up to each environment's first ``done``."""
        return None

    def close(self, state: PyTree) -> None:
        """Release what the state holds outside JAX (host environments' simulators)."""

    def shape_stand_in(self) -> "Environment":
        """A jittable environment with the same shapes, for the compiler's abstract tracing."""
        return self


class Wrapper(Environment):
    """An environment of your own around another (``self.env``): every method and attribute is the wrapped env's
    until you override it (``step`` to scale rewards, ``observe``/``reset``/``step`` to change observations: then
    give ``self.spec`` the new form). What msrl needs of the wrapped env passes through: whether it is jitted, its
    host simulators (an EnvPool ``env.xla`` pool), its episode statistics (what the metrics log: the wrapped env's
    returns, before your reward changes), closing it. Where a policy splits the environments over replicas, a jitted
    wrapper's own code is checked row by row (msrl's adapters inside it are taken on their word)."""

    def __init__(self, env: Environment):
        self.env, self.spec = env, env.spec
        self.jittable, self.host_simulator = env.jittable, env.host_simulator

    def init(self, key, env_ids):
        return self.env.init(key, env_ids)

    def observe(self, state):
        return self.env.observe(state)

    def reset(self, state):
        return self.env.reset(state)

    def starts(self, state):
        return self.env.starts(state)

    def step(self, state, action):
        return self.env.step(state, action)

    def stats(self, state):
        return self.env.stats(state)

    def episode_counts(self, state):
        return self.env.episode_counts(state)

    def close(self, state):
        return self.env.close(state)

    def shape_stand_in(self) -> Environment:
        inner = self.env.shape_stand_in()
        if inner is self.env:
            return self
        twin = copy.copy(self)  # (this wrapper around the wrapped env's stand-in: its shapes, no simulators)
        twin.env, twin.host_simulator = inner, inner.host_simulator
        return twin

    def __getattr__(self, name: str) -> Any:  # what else the wrapped env offers (a host env's busy(), say)
        if name == "env":
            raise AttributeError(name)
        return getattr(self.env, name)


STATS = ("return_sum", "finished", "episodes")  # what Environment.stats returns (optionally length_sum, nonfinite)
ENV_METHODS = ("init", "observe", "reset", "starts", "step", "transition", "_reset", "_step")


def vouched_rowwise(env: Environment) -> bool:
    """Whether ``env.rowwise`` holds: set on the env itself (a wrapper's, from what it wraps), or by a class whose
    methods the loop calls are still the env's (a user's subclass that overrides one is not vouched for)."""
    if "rowwise" in vars(env):
        return bool(env.rowwise)
    owner = next(c for c in type(env).__mro__ if "rowwise" in vars(c))
    return bool(owner.rowwise) and all(getattr(type(env), m, None) is getattr(owner, m, None) for m in ENV_METHODS)


def episode_metrics(stats: list[dict[str, Any]]) -> dict[str, float]:
    """Merge :meth:`Environment.stats` of several replicas: the mean return and length of the last completed
    episodes."""
    finished = sum(float(s["finished"]) for s in stats)
    total = sum(float(s["return_sum"]) for s in stats)
    length = sum(float(s.get("length_sum", math.nan)) for s in stats)
    out = {"episode_return": total / finished if finished else float("nan"),
           "episode_length": length / finished if finished else float("nan"),
           "episodes": sum(float(s["episodes"]) for s in stats)}
    if any("nonfinite" in s for s in stats):  # non-finite numbers in the envs' observations or returns
        out["env_nonfinite"] = sum(float(s.get("nonfinite", 0)) for s in stats)
    return out


class ActOutput(NamedTuple):
    """What an actor returns; algorithms may return their own NamedTuple with more fields."""

    action: jax.Array
    log_prob: jax.Array | None = None
    value: jax.Array | None = None


class Actor:
    """``act(state, params, obs) -> (state, output)``. Its state holds one PRNG key per environment.

    A recurrent actor defines ``act(state, params, obs, done=None)`` (``msrl.agent_act(obs, done)``): it keeps
    a hidden state per environment in its state and resets it where ``done`` (this observation starts an
    episode). For stateful evaluation it defines ``initial_carry(n)`` and ``greedy_step(params, carry, obs,
    done) -> (carry, action)`` instead of ``greedy``.
    """

    recurrent = False

    def init(self, key: jax.Array, env_ids: jax.Array) -> PyTree:
        return {"keys": per_env_keys(key, env_ids)}

    def act(self, state: PyTree, params: PyTree, obs: jax.Array) -> tuple[PyTree, Any]:
        raise NotImplementedError

    def greedy(self, params: PyTree, obs: jax.Array) -> jax.Array:
        """The deterministic action for each observation (``msrl eval``): the policy's mode, say."""
        raise NotImplementedError(f"{type(self).__name__} defines no greedy(params, obs), which msrl eval needs")


class Learner:
    """``learn(state, batch, **kw) -> (state, metrics)``; ``policy_params(state)`` is what actors use.

    Gradients go through ``self.tx``: the algorithm's optax chain (``optimizer()``) preceded by
    ``grad_transforms`` that a distribution policy may set (an all-reduce, say) without touching the
    algorithm. The built-in algorithms wrap their optimizers in :func:`msrl.rl.flat` (``optax.flatten``'s
    numbers): the update then runs on one flat vector, not once per parameter array (a third fewer XLA ops per
    PPO minibatch step)."""

    grad_transforms: tuple[optax.GradientTransformation, ...] = ()

    def optimizer(self) -> optax.GradientTransformation:
        from msrl.errors import CompileError, defined_at

        raise CompileError(f"{type(self).__name__} defines no optimizer(), the optax transformation its self.tx "
                           "chains", *defined_at(type(self)))

    @property
    def tx(self) -> optax.GradientTransformation:
        return self.chain(self.optimizer())

    def chain(self, optimizer: optax.GradientTransformation) -> optax.GradientTransformation:
        """``optimizer`` after the policy's ``grad_transforms``: a learner with several optimizers (an actor's,
        a critic's) builds each with it, so that a policy's transforms apply to every part."""
        return optax.chain(*self.grad_transforms, optimizer)

    def mean_over_replicas(self, tree: PyTree) -> PyTree:
        """``tree``'s mean over the learner replicas that each learn on an equal share of the environments
        (``multi_learner``), reduced by the policy's gradient transforms as a gradient is (its all-reduce);
        ``tree`` itself where one learner sees every environment. Running statistics merge this way."""
        tx = self.chain(optax.identity())
        return tx.update(tree, tx.init(tree))[0]

    def init(self, key: jax.Array) -> PyTree:
        raise NotImplementedError

    def learn(self, state: PyTree, batch: PyTree, **kwargs: Any) -> tuple[PyTree, dict[str, jax.Array]]:
        raise NotImplementedError

    def policy_params(self, state: PyTree) -> PyTree:
        raise NotImplementedError


class ReplayBuffer:
    """Functional buffer: ``insert(state, item) -> state``, ``get``/``sample(state) -> (state, batch)``.

    ``item_spec`` (a pytree of ``jax.ShapeDtypeStruct``) may be left ``None``: the compiler then infers it
    from the first ``buffer_insert`` of the training loop.
    """

    item_spec: PyTree | None = None

    def init(self, key: jax.Array, item_spec: PyTree) -> PyTree:
        raise NotImplementedError

    def insert(self, state: PyTree, item: PyTree) -> PyTree:
        raise NotImplementedError

    def insert_batch(self, state: PyTree, items: PyTree) -> PyTree:
        """Insert items stacked on a leading axis, in order: the same as inserting them one by one."""
        return jax.lax.scan(lambda s, item: (self.insert(s, item), None), state, items)[0]

    def get(self, state: PyTree) -> tuple[PyTree, PyTree]:
        raise NotImplementedError

    def sample(self, state: PyTree, batch_size: int | None = None) -> tuple[PyTree, PyTree]:
        raise NotImplementedError


# True while the compiler traces the loop abstractly to learn its shapes, with other numbers of environments
# than any replica has: a learner's per-environment state need not fit its batch then.
SHAPE_PROBE: contextvars.ContextVar[bool] = contextvars.ContextVar("msrl_shape_probe", default=False)

# True while an actor's ``act`` runs (is traced) for ``msrl.agent_act``: networks may then compute each
# environment's row in a way that rounds alike for any number of rows (``msrl.rl.Dense``), so that replicas
# acting on some environments compute what one acting on all does; learners need not pay for it.
ACTING: contextvars.ContextVar[bool] = contextvars.ContextVar("msrl_acting", default=False)


def acting(act: Any, *args: Any, **kwargs: Any) -> Any:
    """``act(*args, **kwargs)`` with :data:`ACTING` set: how generated code calls an actor."""
    token = ACTING.set(True)
    try:
        return act(*args, **kwargs)
    finally:
        ACTING.reset(token)


def per_env_keys(key: jax.Array, env_ids: jax.Array) -> jax.Array:
    """One key per environment, derived from its global index only."""
    return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, jnp.asarray(env_ids, jnp.uint32))


def split_keys(keys: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Split every per-environment key: returns (next keys, keys to use now)."""
    both = jax.vmap(jax.random.split)(keys)
    return both[:, 0], both[:, 1]
