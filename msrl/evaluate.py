"""``msrl eval RUN_DIR``: the newest good (or a chosen) checkpoint's policy, acting greedily, over fresh episodes."""

from __future__ import annotations

import functools
import inspect
import numbers
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import jax
import numpy as np

from msrl import checkpoint
from msrl.components import Actor, Box, MultiAgentObs, MultiAgentSpec, acting
from msrl.config import SEED_MAX, load_config
from msrl.envs import MaskedObs, make_env
from msrl.envs.gymnasium_env import GymnasiumEnv
from msrl.errors import CLI_FLAGS, ConfigError, arg, quote
from msrl.policy import prepare_learner
from msrl.runner import make_algorithm, member_folder_of
from msrl.services import PARAMETERS, SNAPSHOT_KEY
from msrl.sweep import member_config, members

MAX_STEPS = 100_000
MAX_FRAMES = 1_000
MAX_EPISODES = 100_000  # episodes run side by side: more would not fit in memory


def trained_config(file: Path, meta: dict, path: Path) -> Any:
    """The config the checkpoint at ``path`` was trained with (its own copy; the run's ``file``, config.yaml,
    for a checkpoint without one). A config.yaml that differs from it (edited by hand) is named in a note."""
    import yaml

    if "config" not in meta:
        if not file.exists():
            raise ConfigError("RUN_DIR", f"{path} holds no config (it was written before checkpoints did) and "
                              f"{file} is missing")
        return _validated(file, file)
    saved = meta["config"]
    order = checkpoint.sweep_order(meta, file)
    if order:  # the members in the order they were trained
        sweep = saved["run"]["sweep"]
        saved = {**saved, "run": {**saved["run"], "sweep": {k: sweep[k] for k in order}}}
    cfg = _validated(saved, path)
    if not file.exists():  # (a checkpoint kept without its run directory)
        return cfg
    try:
        now = yaml.safe_load(file.read_text()) or {}
    except (yaml.YAMLError, OSError):
        now = None
    if isinstance(now, dict):  # (a key msrl added since the checkpoint, at its default in config.yaml, is none)
        keys = [k for k, _, _ in checkpoint.config_differences(saved, now, cfg.defaults())]
        what = f"its {', '.join(keys)} differ{'s' if len(keys) == 1 else ''}"
    else:
        keys, what = [None], "it does not read"
    if keys:
        print(f"msrl: note: {file} is not the config the checkpoint {path} was trained with ({what}); using the "
              "checkpoint's own", file=sys.stderr, flush=True)
    return cfg


def _validated(config: Path | dict, source: Path) -> Any:
    """``config`` loaded; an error in it names ``source`` (the run's config was valid when it trained: an
    algorithm's code has changed since, or msrl's)."""
    try:
        return load_config(config)
    except ConfigError as e:
        raise ConfigError(e.key, f"{source} (the config the run was trained with): {e.message}") from None


def load_policy(run_dir: Path, run_seed: int | None = None,
                member: str | None = None) -> tuple[Any, Any, Any, Path, dict]:
    """The run's config, algorithm and policy parameters from its newest good checkpoint (a corrupt or
    non-finite newer one is skipped with a warning; ``meta["checkpoint"]`` names the file used), or from the
    checkpoint file ``run_dir`` names. A run of several seeds or swept values gives the policy of one member: the
    one named ``member`` (``lr=0.001,seed_1``), or whose folder ``run_dir`` is (``RUN_DIR/lr=0.001``), or that of
    seed ``run_seed``, or else the first."""
    run_dir, asked = Path(run_dir).expanduser(), member
    if member is not None and not isinstance(member, str):
        raise ConfigError(arg("member"), f"a member's name (its folder's, e.g. lr=0.001,seed_1), got {member!r}")
    if run_seed is not None and (isinstance(run_seed, bool) or not isinstance(run_seed, (int, np.integer))):
        raise ConfigError(arg("run_seed"), f"must be a whole number (a seed the run trained), got {run_seed!r}")
    chosen = run_dir.is_file()
    if chosen:  # a checkpoint of one's choice: RUN_DIR/checkpoints/ckpt_NNNNNNNNN.msgpack
        path = run_dir
        states, meta = checkpoint.load(path)
        run_dir = path.parent.parent if path.parent.name == "checkpoints" else path.parent
    else:
        run = member_folder_of(run_dir)
        if run is not None:  # a member's folder: the run is its parent's
            if member not in (None, run_dir.name):
                raise ConfigError(arg("member"), f"{run_dir} is the folder of member {run_dir.name}, not {member}: "
                                  f"give one of the two")
            run_dir, member = run, run_dir.name
        if not (run_dir / "config.yaml").exists() and not (run_dir / "checkpoints").is_dir():
            from msrl.runner import writer_of

            pid = writer_of(run_dir) if run_dir.is_dir() else None  # (a run compiling: no config.yaml yet)
            raise ConfigError("RUN_DIR", f"{run_dir} holds no checkpoint (none yet: process {pid} is starting a run "
                              "in it)" if pid else f"{run_dir} is not a run directory (no config.yaml, no "
                              "checkpoints/)" if run_dir.is_dir() else f"{run_dir} does not exist")
        good = checkpoint.latest_good(run_dir)
        if good is None:
            raise ConfigError("RUN_DIR", f"{run_dir} holds no checkpoint ({why_no_checkpoint(run_dir)})")
        path, states, meta = good
        _note_if_the_run_went_on(run_dir, meta, path)
    meta = {**meta, "checkpoint": str(path)}
    cfg = trained_config(run_dir / "config.yaml", meta, path)
    each = members(cfg.run)
    i = 0
    if member is not None:
        names = [m.name for m in each]
        if len(each) == 1:
            raise ConfigError(arg("member"), f"the run in {run_dir} trained one seed and no sweep: drop "
                              f"{arg('member')}")
        same = [n for n in names if sorted(n.split(",")) == sorted(str(member).split(","))]  # (in any key order)
        member = same[0] if same else member
        if member not in names:
            raise ConfigError(arg("member") if asked is not None else "RUN_DIR", f"{run_dir / member} is not a "
                              f"member of the run in {run_dir} (its members: {', '.join(names)})")
        i = names.index(member)
        if run_seed is not None and run_seed != each[i].seed:
            twin = next((m for m in each if m.seed == run_seed and m.values == each[i].values), None)
            other = f"its folder, {run_dir / twin.name}" if cfg.run.sweep and twin else \
                None if cfg.run.sweep else f"the run, {run_dir}, with it"  # (the run and a seed: several values)
            raise ConfigError(arg("run_seed"), f"{run_dir / member} is the folder of seed {each[i].seed}, not "
                              f"{run_seed}: drop {arg('run_seed')}" + (f", or give {other}" if other else ""))
    elif run_seed is not None:
        seeds = sorted({m.seed for m in each})
        found = [j for j, m in enumerate(each) if m.seed == run_seed]
        if not found:
            raise ConfigError(arg("run_seed"), f"{run_dir} trained seed{'s' if len(seeds) > 1 else ''} "
                              f"{seeds[0]}{f'..{seeds[-1]}' if len(seeds) > 1 else ''}, not {run_seed}")
        if len(found) > 1:
            instead = f"give {arg('member')} instead (e.g. {each[found[0]].name})" if chosen else \
                f"evaluate one member's folder instead (e.g. {run_dir / each[found[0]].name})"
            raise ConfigError(arg("run_seed"), f"{run_dir} trained seed {run_seed} with {len(found)} swept values; "
                              + instead)
        i = found[0]
    elif len(each) > 1:
        pick = f"--member {each[1].name}" if CLI_FLAGS.get() else f"member={each[1].name!r}"
        another = (pick if chosen else f"give its folder, e.g. {run_dir / each[1].name}") \
            + (f", or {arg('run_seed')}" if not cfg.run.sweep else "")
        print(f"msrl: note: {run_dir} trained {len(each)} members; this is the first, {each[0].name} (another: "
              f"{another})", file=sys.stderr, flush=True)
    swept, cfg = bool(cfg.run.sweep), member_config(cfg, each[i])  # (a member's config sweeps nothing)
    env = make_env(cfg.env.id, **cfg.env.kwargs)
    algorithm = make_algorithm(cfg, env.spec)
    check_greedy(algorithm.actor, cfg.algorithm.name)
    key = next((k for k in sorted(states) if k.endswith("/learner")), None)
    if key is None:
        raise ConfigError("RUN_DIR", f"{path} holds no learner state")
    learner, services = prepare_learner(cfg.policy, algorithm.learner)  # as trained: a policy may wrap it
    held = f"{SNAPSHOT_KEY}/0/{PARAMETERS}" if PARAMETERS in services else None  # (async's parameter holder)
    if len(each) > 1:  # every saved array has a leading member axis
        states = {**states, **{k: checkpoint.Leaves([None if x is None else np.asarray(x)[i] for x in states[k]],
                                                    states[k].paths) for k in (key, held) if k in states}}
        meta = {**meta, "run_seed": each[i].seed, **({"member": each[i].name} if swept or member else {})}
    if held is not None:  # the run's parameters are the service's, not a replica's copy (maybe some updates old)
        holder = services[PARAMETERS].make(cfg.run.seed)
        holder.set_state(checkpoint.restore_state(holder.get_state(), states, held, path))
        return cfg, env, algorithm, learner.policy_params(holder.learner_state()), meta
    state = checkpoint.restore_state(_template(learner.init, states[key]), states, key, path)
    return cfg, env, algorithm, learner.policy_params(state), meta


def _run_file(run_dir: Path, name: str) -> dict:
    """``run_dir``'s summary.json or config.yaml as a dict; {} where it is missing or does not read."""
    import json

    import yaml

    try:
        data = (json.loads if name.endswith(".json") else yaml.safe_load)((run_dir / name).read_text())
    except (OSError, ValueError, yaml.YAMLError):
        return {}
    return data if isinstance(data, dict) else {}


def why_no_checkpoint(run_dir: Path) -> str:
    """Why a run directory holds no checkpoint, as its lock, summary.json and config.yaml tell."""
    from msrl.runner import writer_of

    run = _run_file(run_dir, "config.yaml").get("run")
    every = run.get("checkpoint_every_steps") if isinstance(run, dict) else None
    due = f", due every {every:,} env steps" if isinstance(every, int) and every > 0 else ""
    if every == 0:
        return "train with run.checkpoint_every_steps > 0"
    pid = writer_of(run_dir)
    if pid is not None:
        return f"none yet: process {pid} is training this run" + (f"; checkpoints are{due[1:]}" if due else "")
    partial = sorted((run_dir / "checkpoints").glob("ckpt_*.tmp"))
    if partial:  # (a kill as the first one was written: "they were removed", it said)
        return f"its first checkpoint was being written when the run was killed ({partial[-1].name} is incomplete)"
    steps = _run_file(run_dir, "summary.json").get("env_steps")
    if isinstance(steps, int) and steps > 0:
        return f"the run ended at {steps:,} env steps, as its summary.json says; its checkpoints were removed"
    logged = _logged_steps(run_dir)  # (a run killed before its summary)
    if isinstance(every, int) and every > 0 and logged >= every:
        return f"it logged {logged:,} env steps (metrics.csv), past its first checkpoint{due}: they were removed"
    return f"it stopped before its first checkpoint{due}"


def _logged_steps(run_dir: Path) -> int:
    """The env steps of the last row of ``run_dir``'s metrics.csv (0: none, or it does not read)."""
    from msrl.errors import ConfigError
    from msrl.plot import read_metrics

    try:
        rows = read_metrics(run_dir / "metrics.csv")
        return int(float(rows[-1]["env_steps"])) if rows else 0
    except (OSError, ConfigError, KeyError, ValueError):
        return 0


def _note_if_the_run_went_on(run_dir: Path, meta: dict, path: Path) -> None:
    """A note on stderr when the run trained past the checkpoint used (its newer ones removed or bad, or it is
    still training): what is evaluated is not the run's end."""
    ended = _run_file(run_dir, "summary.json").get("env_steps")
    if isinstance(ended, int) and isinstance(meta.get("env_steps"), int) and ended > meta["env_steps"]:
        print(f"msrl: note: {path} is of {meta['env_steps']:,} env steps (iteration {meta.get('iteration')}); the "
              f"run went on to {ended:,} (summary.json)", file=sys.stderr, flush=True)


def check_greedy(actor: Any, name: str) -> None:
    """An actor that ``msrl eval`` and ``msrl.load`` cannot act with is refused before anything is loaded."""
    cls = type(actor)
    where = f"{cls.__qualname__} ({name}'s actor, {inspect.getsourcefile(cls)})"
    if hasattr(cls, "greedy_step"):
        if not hasattr(cls, "initial_carry"):
            raise ConfigError("algorithm.name", f"{where} defines greedy_step(params, carry, obs, done) but no "
                              "initial_carry(n), the hidden state msrl eval and msrl.load start each environment "
                              "from; define it")
    elif getattr(cls, "greedy", None) is Actor.greedy:
        raise ConfigError("algorithm.name", f"{where} defines no greedy(params, obs), the deterministic action for "
                          "each observation (the policy's mode, say), which msrl eval and msrl.load act with; define "
                          "it (a recurrent actor: initial_carry(n) and greedy_step)")
    elif getattr(cls, "recurrent", False):
        raise ConfigError("algorithm.name", f"{where} is recurrent, but its greedy(params, obs) acts without the "
                          "hidden state it trained with, so msrl eval and msrl.load would score another policy; define "
                          "initial_carry(n) and greedy_step(params, carry, obs, done) -> (carry, action)")


def _template(init: Any, saved: list[Any]) -> Any:
    """The learner state's structure, shapes and dtypes, traced without compiling or running its
    initialization (a network's is dozens of small compiles, seconds); run where a leaf was not stored (a host
    object) or the init cannot be traced, since the restored state takes those leaves from it."""
    key = jax.random.PRNGKey(0)
    if all(x is not None for x in saved):
        try:
            return jax.eval_shape(init, key)
        except (jax.errors.JAXTypeError, jax.errors.JAXIndexError):
            pass
    return init(key)


class TrainedPolicy:
    """A run's trained policy, for plain Python: ``act(obs)`` takes a batch of observations (numpy or jax,
    leading axis = environments) and returns the greedy actions as numpy, as the environment itself takes them
    (within a Box's bounds; a Gymnasium ``Discrete(n, start=k)``'s from ``k``). ``config``, ``params`` (the policy
    parameters), ``iteration`` (of the checkpoint) and ``env_spec`` describe it.

    A recurrent policy carries its hidden state from one ``act`` to the next: pass ``done`` (bool per env, true
    where ``obs`` is a new episode's first observation: the previous step's done; of Gymnasium's vector envs, in
    autoreset mode NEXT_STEP the done returned one step before ``obs``, in SAME_STEP the one returned with it) to
    reset it there, or call ``reset()``
    before a fresh batch of episodes, or of another number of environments (a call with another number without
    it is refused: it would forget every environment's state)."""

    def __init__(self, run_dir: str | Path, run_seed: int | None = None, member: str | None = None):
        if not isinstance(run_dir, (str, os.PathLike)):
            raise ConfigError("run_dir", f"a run directory's path, got {type(run_dir).__name__} {run_dir!r:.100}")
        self.config, self.env, self.algorithm, self.params, meta = load_policy(Path(run_dir), run_seed, member)
        self.env_spec, self.iteration = self.env.spec, meta["iteration"]
        actor = self.algorithm.actor  # (recurrent PPO's ``memory: none`` holds no state: any batch, as PPO's)
        self.recurrent = hasattr(actor, "greedy_step") and getattr(getattr(actor, "net", None), "memory", "") != "none"
        self._initial_carry, self._step = greedy_policy(self.algorithm.actor)
        self._env_actions = env_actions(self.env)
        self._carry, self._n = None, None  # the hidden state, and the number of environments it is for
        self._warned = False  # (once: act without done on a recurrent policy)

    def reset(self) -> None:
        """Forget a recurrent policy's hidden state: the next ``act`` starts every episode afresh."""
        self._n = None

    def act(self, obs: Any, done: Any = None) -> np.ndarray:
        """The greedy actions for ``obs`` (a batch, leading axis = environments, or one environment's observation)
        as numpy, as the environment takes them; ``done``: a recurrent policy's episode starts (see the class)."""
        if isinstance(obs, (list, tuple)) and not hasattr(obs, "_fields"):  # a plain list of numbers
            obs = np.asarray(obs)  # (in the env's dtype, a list's floats were cut to uint8 before any check)
        obs = jax.tree.map(np.asarray, obs)
        spec = self.env_spec
        shape = tuple(spec.obs_shape)
        if not isinstance(spec, MultiAgentSpec) and not isinstance(obs, np.ndarray):
            raise TypeError(f"act: an observation of {spec.id} is an array shaped {shape}, got {type(obs).__name__}")
        if isinstance(spec, MultiAgentSpec) and not isinstance(obs, (np.ndarray, MultiAgentObs)):
            raise TypeError(f"act: observations of {spec.id} are an array shaped (n, {spec.num_agents}, "
                            f"{', '.join(map(str, shape))}) (every agent's, in the env's agent order) or an "
                            f"msrl.MultiAgentObs, got {type(obs).__name__}")
        one = False  # (one environment's MultiAgentObs, as one environment's array is taken)
        if isinstance(obs, MultiAgentObs):
            agents, state = (spec.num_agents, *shape), tuple(spec.state_shape)
            one = obs.agents.shape == agents and obs.state.shape == state
            if not one and (obs.agents.shape[1:] != agents or obs.state.shape[1:] != state or
                            len(obs.agents) != len(obs.state)):
                raise ValueError(f"act: a MultiAgentObs of {spec.id} holds agents shaped (n, "
                                 f"{', '.join(map(str, agents))}) and state (n, {', '.join(map(str, state))}) (or one "
                                 f"environment's: {agents} and {state}), got {obs.agents.shape} and "
                                 f"{obs.state.shape}")
        for x in jax.tree.leaves(obs):
            if x.dtype.kind not in "fiub":
                raise ValueError(f"act: observations are numbers, got an array of {x.dtype}")
            if x.size == 0:
                raise ValueError(f"act: got no observation (an array shaped {x.shape})")
            if not np.isfinite(x).all():
                raise ValueError(f"act: an observation holds a non-finite number ({x[~np.isfinite(x)].flat[0]})")
            if spec.obs_dtype == np.uint8 and x.dtype.kind == "f" and 0 < np.abs(x).max() <= 1:  # (taken as 0..1
                raise ValueError(f"act: observations of {spec.id} are pixels 0..255 as the env returns them (as "  # of
                                 "training saw them); got floats within [0, 1]: pass them unscaled")  # 255)
            if spec.obs_dtype == np.uint8 and (x.min() < 0 or x.max() > 255):
                raise ValueError(f"act: observations of {spec.id} are pixels 0..255 as the env returns them, got "
                                 f"{x.min() if x.min() < 0 else x.max()}")
        if isinstance(spec, MultiAgentSpec) and isinstance(obs, np.ndarray):  # every agent's, as one array
            shape = (spec.num_agents, *shape)
        if isinstance(obs, np.ndarray) and obs.shape != shape and obs.shape[1:] != shape:
            what = f"its {spec.num_agents} agents' observations of {spec.id} are" \
                if len(shape) > len(spec.obs_shape) else f"an observation of {spec.id} is"
            raise ValueError(f"act: {what} shaped {shape} (a batch: (n, "
                             f"{', '.join(map(str, shape))})), got {obs.shape}")
        single = one or isinstance(obs, np.ndarray) and obs.shape == shape
        if single:  # one observation: act on a batch of one
            obs = jax.tree.map(lambda x: x[None], obs)
        if isinstance(spec, MultiAgentSpec) and isinstance(obs, np.ndarray):
            obs = self._multi_agent(obs)
        if isinstance(self.env, MaskedObs):  # env.kwargs.mask_obs, as training saw the env's observations
            obs = obs * self.env.keep
        n = jax.tree.leaves(obs)[0].shape[0]
        if self.recurrent and self._n is not None and self._n != n:
            raise ValueError(f"act: this recurrent policy holds the hidden state of {self._n} environments, got "
                             f"{n}; call reset() first to start {n} afresh (to go on, keep the batch and pass "
                             "done where an episode ended)")
        fresh = self._n != n
        if self.recurrent and not fresh and done is None and not self._warned:
            self._warned = True
            warnings.warn("act: this recurrent policy carries its hidden state on from the last call, across "
                          "episode ends too: pass done (where obs starts a new episode: the previous step's done) "
                          "or call reset() between episodes", stacklevel=2)
        if fresh:
            self._carry, self._n = self._initial_carry(n), n
        if single and done is not None and np.shape(done) == ():  # one observation's done
            done = [done]
        if done is not None and np.shape(done) != (n,):
            raise ValueError(f"act: done is one bool per environment, shaped ({n},), got {np.shape(done)}")
        if done is not None and np.asarray(done).dtype.kind not in "bui":  # (["no"]: every one true)
            raise ValueError(f"act: done is one bool per environment, got {np.asarray(done).dtype} values "
                             f"{np.asarray(done).tolist()!r:.100}")
        start = np.zeros(n, bool) if done is None else np.asarray(done, bool)
        self._carry, actions = self._step(self.params, self._carry, obs, start | fresh)
        actions = self._env_actions(np.asarray(actions))
        return actions[0] if single else actions

    def _multi_agent(self, agents: np.ndarray) -> MultiAgentObs:
        """A batch of every agent's observations as the env gives them: with the global state of JaxMARL's
        adapter (all agents' observations, concatenated); another env's state must be given (a MultiAgentObs)."""
        spec = self.env_spec
        if tuple(spec.state_shape) != (int(np.prod(agents.shape[1:])),):
            raise ValueError(f"act: {spec.id}'s global state {tuple(spec.state_shape)} is not its agents' "
                             "observations concatenated; give msrl.MultiAgentObs(agents, state)")
        return MultiAgentObs(agents, agents.reshape(len(agents), -1))

    def __repr__(self) -> str:
        return (f"TrainedPolicy({self.config.algorithm.name} on {self.env_spec.id}, "
                f"iteration {self.iteration}{', recurrent' if self.recurrent else ''})")


ACT_ROWS = 1024  # environments acted on at once: acting holds a copy of a layer's kernel per 16 of them


def greedy_policy(actor: Any) -> tuple[Any, Any]:
    """``(initial_carry(n), step(params, carry, obs, start) -> (carry, action))`` of an actor: a recurrent
    one's ``greedy_step``, or a stateless ``greedy`` with an empty carry. It acts as actors do in training
    (:func:`msrl.components.acting`: each environment's action the same in a batch of any size), on at most
    ``ACT_ROWS`` environments at a time."""
    if hasattr(actor, "greedy_step"):
        initial_carry, one = actor.initial_carry, jax.jit(functools.partial(acting, actor.greedy_step))
    else:
        greedy = jax.jit(functools.partial(acting, actor.greedy))
        initial_carry, one = (lambda n: None), (lambda params, carry, obs, start: (None, greedy(params, obs)))

    def step(params: Any, carry: Any, obs: Any, start: np.ndarray) -> tuple[Any, Any]:
        parts = [one(params, *jax.tree.map(lambda x: x[i:i + ACT_ROWS], (carry, obs, start)))
                 for i in range(0, len(start), ACT_ROWS)]
        return parts[0] if len(parts) == 1 else jax.tree.map(lambda *xs: np.concatenate(xs), *parts)

    return initial_carry, step


def load(run_dir: str | Path, run_seed: int | None = None, member: str | None = None) -> TrainedPolicy:
    """``msrl.load(RUN_DIR)``: the policy of the run's newest good checkpoint, or of the checkpoint file given
    (:class:`TrainedPolicy`); of seed ``run_seed`` for a run of several, or of the member whose folder
    ``RUN_DIR/lr=0.001`` is or whose name ``member`` is (a sweep: ``lr=0.001,seed_1`` with a checkpoint file)."""
    return TrainedPolicy(run_dir, run_seed, member)


def evaluate(run_dir: str | Path, episodes: int = 10, render: str | Path | None = None, seed: int = 0,
             run_seed: int | None = None, member: str | None = None) -> dict:
    """Mean and std of the greedy policy's return over ``episodes`` (1..MAX_EPISODES) fresh episodes
    (``run_seed``: which seed's policy, for a run of several; ``member``: which member's, as :func:`load`)."""
    whole = lambda x: isinstance(x, numbers.Integral) and not isinstance(x, bool)  # noqa: E731
    if not whole(episodes) or not 1 <= episodes <= MAX_EPISODES:
        raise ConfigError(arg("episodes"), f"must be a whole number between 1 and {MAX_EPISODES:,}, got "
                          f"{episodes!r:.100}")  # (1.5 and True: "must be between 1 and 100,000")
    if not whole(seed) or not 0 <= seed <= SEED_MAX:
        raise ConfigError(arg("seed"), f"must be a whole number between 0 and {SEED_MAX:,}, got {seed!r:.100}")
    if render is not None and Path(render).exists() and not Path(render).is_dir():
        raise ConfigError(arg("render"), f"{render} is a file; give a folder for the frames and episode.gif")
    cfg, env, algorithm, params, meta = load_policy(Path(run_dir), run_seed, member)
    if render is not None and not cfg.env.id.startswith("gymnasium:"):  # (before the episodes are played)
        raise ConfigError(arg("render"), f"msrl renders gymnasium: environments only, not {cfg.env.id} (train the "
                          "task's Gymnasium version to render it: gymnasium:CartPole-v1 for gymnax:CartPole-v1, "
                          "gymnasium:InvertedPendulum-v5 for brax:inverted_pendulum)")
    if render is not None:
        try:
            Path(render).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(arg("render"), f"cannot create the folder {render}: {e.strerror}") from None
    initial_carry, act = greedy_policy(algorithm.actor)
    step = jax.jit(env.transition) if env.jittable else env.transition  # (as msrl.env_step steps it)
    init = env.init if env.host_state else jax.jit(env.init)  # one compile, not dozens
    state = init(jax.random.PRNGKey(seed), np.arange(episodes))
    state, obs = env.observe(state)
    carry, start = initial_carry(episodes), np.ones(episodes, bool)  # a recurrent policy's state, reset at starts
    returns, finished = np.zeros(episodes), np.zeros(episodes, bool)
    partial = np.zeros(episodes)  # the rewards so far: the score of an episode MAX_STEPS cut short
    lengths = np.zeros(episodes, int)  # each episode's steps (to its end, as counted: an Atari game's to game over)
    from msrl.compiler import env_method

    counted = env_method(env, "episode_counts", state, ConfigError) is not None  # episodes as the training's rows
    # count them (Atari: games); a wrapper whose state is not its env's and reads it through is named
    for steps in range(1, MAX_STEPS + 1):
        carry, action = act(params, carry, obs, start)
        state, (obs, reward, done) = step(state, action)
        start = np.asarray(done)
        partial += np.where(finished, 0.0, np.asarray(reward))
        lengths += ~finished
        if counted:
            ended, last = (np.asarray(x) for x in env.episode_counts(state))
            returns = np.where(finished, returns, last)
            finished |= ended > 0
        else:
            finished |= start
        if finished.all():
            break
    returns = np.where(finished, returns, partial) if counted else partial
    env.close(state)
    out = {"checkpoint": meta["checkpoint"], "iteration": meta["iteration"],
           **{k: meta[k] for k in ("run_seed", "member") if k in meta},
           "episodes": episodes, "return_mean": float(returns.mean()), "return_std": float(returns.std()),
           "length_mean": float(lengths.mean()), "env_steps": steps * episodes}
    if render is not None:  # the first scored episode again, on a renderer
        from msrl.envs.gymnasium_env import seed_words

        out["frames"], out["render_return"] = _render(cfg.env.id, cfg.env.kwargs, (initial_carry, act), params,
                                                      Path(render), seed_words(jax.random.PRNGKey(seed), [0])[0],
                                                      env_actions(env))
    return out


def evaluate_each(run_dir: str | Path, episodes: int = 10, seed: int = 0) -> list[dict]:
    """:func:`evaluate` of each member of a run of several seeds or swept values, in the order it trained them
    (each result's ``member`` names it)."""
    from msrl.plot import member_folders

    if Path(run_dir).expanduser().is_file():
        raise ConfigError("RUN_DIR", f"{run_dir} is a checkpoint file; each member is evaluated from a run "
                          f"directory (its newest checkpoint); evaluate one member of this checkpoint with "
                          f"{arg('member')} NAME")
    folders = member_folders(Path(run_dir).expanduser())
    if not folders:
        raise ConfigError("RUN_DIR", f"{run_dir} is not a run of several seeds or swept values (run.num_seeds, "
                          "run.sweep) with a folder for each; evaluate it alone")
    return [{**evaluate(folder, episodes, seed=seed), "member": folder.name} for folder in folders]


def env_actions(env: Any) -> Any:
    """``f(actions)``: msrl's actions as ``env``'s own ``step`` takes them, as msrl's env adapters hand them on: a
    Box's within its bounds (a Gymnasium Box's in its dtype), a Gymnasium ``Discrete(n, start=k)``'s from ``k``."""
    inner = env.env if isinstance(env, MaskedObs) else env
    if isinstance(inner, GymnasiumEnv):
        return inner.env_actions
    space = env.spec.action_space
    return (lambda a: np.clip(a, space.low, space.high)) if isinstance(space, Box) else (lambda a: a)


def _frame(env: Any, env_id: str) -> np.ndarray:
    """``env.render()``: an RGB image (H, W, 3), or a ConfigError naming what it gave."""
    frame = env.render()
    if not (isinstance(frame, np.ndarray) and frame.ndim == 3 and frame.shape[-1] in (3, 4)):
        raise ConfigError(arg("render"), f"{env_id}'s render() in render_mode='rgb_array' gave {quote(frame, 80)}, "
                          "not an RGB image (an array of shape (height, width, 3))")
    return frame


def _render(env_id: str, kwargs: dict, policy: Any, params: Any, out: Path, seed: int,
            to_env: Any) -> tuple[int, float]:
    """One greedy episode of a Gymnasium environment (reset with ``seed``; ``to_env``: its actions from msrl's, as
    training hands them on) as frame_NNNN.png files and episode.gif; its number of frames and its return."""
    for driver in ("SDL_AUDIODRIVER", "SDL_VIDEODRIVER"):  # pygame's init: no sound card or display needed
        os.environ.setdefault(driver, "dummy")
    import gymnasium
    import matplotlib.pyplot as plt
    from PIL import Image

    try:
        mask = kwargs.get("mask_obs") or []
        kwargs = {k: v for k, v in kwargs.items() if k not in ("mask_obs", "render_mode")}  # (frames: rgb_array)
        env = gymnasium.make(env_id.split(":", 1)[1], render_mode="rgb_array", **kwargs)
        obs, _ = env.reset(seed=seed)
        frames = [_frame(env, env_id)]
    except (gymnasium.error.DependencyNotInstalled, ImportError) as e:
        raise ConfigError(arg("render"), f"{env_id} cannot render here: {e}") from None
    except NotImplementedError:  # gymnasium.Env's render
        raise ConfigError(arg("render"), f"{env_id} has no renderer: its render() raised NotImplementedError") from None
    except TypeError as e:  # an env of one's own whose constructor takes no render_mode
        raise ConfigError(arg("render"), f"{env_id} did not make itself with render_mode='rgb_array': {e}") from None
    initial_carry, act = policy
    carry, start, done, score = initial_carry(1), np.ones(1, bool), False, 0.0
    while not done and len(frames) < MAX_FRAMES:
        seen = np.asarray(obs, np.float32).copy()
        seen.reshape(-1)[mask] = 0.0  # env.kwargs.mask_obs, as in training
        carry, action = act(params, carry, seen[None], start)
        action, start = to_env(np.asarray(action))[0], np.zeros(1, bool)
        obs, reward, terminated, truncated, _ = env.step(action)
        score += float(reward)
        frames.append(_frame(env, env_id))
        done = terminated or truncated
    env.close()
    for old in out.glob("frame_[0-9][0-9][0-9][0-9].png"):  # an earlier, longer episode's would stay behind
        old.unlink()
    for i, frame in enumerate(frames):
        plt.imsave(out / f"frame_{i:04d}.png", frame)
    images = [Image.fromarray(f) for f in frames]
    images[0].save(out / "episode.gif", save_all=True, append_images=images[1:], duration=33, loop=0)
    return len(frames), score
