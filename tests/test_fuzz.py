"""Bad-input fuzzing (hypothesis): configs and training loops.

Whatever a user writes, msrl answers with one of its own errors, never with a crash from deep inside:

- a config (YAML or ``KEY=VALUE`` overrides, mutated from the real examples) either loads and builds, or
  raises :class:`msrl.ConfigError` whose ``key`` names the offending config key, or :class:`msrl.CompileError`;
- a training loop (generated source mixing valid API calls with constructs the compiler rejects) either
  compiles, or raises :class:`msrl.CompileError` at a line of the generated file; a loop with a construct
  that is always rejected must not compile.

The runs are derandomized (no example database), so CI sees the same cases every time: 1700 in all
(``MAX_EXAMPLES``; the last test checks that they ran and reached both accepted and rejected inputs),
about 40 s on 2 cores; ``MSRL_FUZZ_SCALE=10`` searches ten times deeper. Most config cases stop at
validation; only ``test_fuzz_config_build`` goes on to build() (jax tracing). The ``test_fuzz_found_*`` tests
pin what the fuzzer found.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import itertools
import math
import os
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import msrl
from msrl.config import EnvConfig, RunConfig, apply_overrides, load_config, validate_config
from msrl.envs import make_env
from msrl.policies.fused import Fused
from msrl.policies.single_learner import SingleLearnerCoarse, SingleLearnerFine
from msrl.registry import ALGORITHMS, POLICIES
from msrl.runner import build

import loops  # noqa: F401 - generated loops use its components; it also registers the "growth" algorithm

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
EXAMPLE_FILES = [EXAMPLES / "ppo_cartpole.yaml", EXAMPLES / "ppo_cartpole_threads.yaml"]
SECTIONS = ("algorithm", "env", "policy", "run")

MAX_EXAMPLES = {  # cases per test (1700 in all; the last test checks that >= 90 % of each ran)
    "config_yaml": 500,  # validation only: milliseconds each
    "config_overrides": 500,
    "config_build": 100,  # on to build(): jax tracing, ~0.3 s each when it gets that far
    "loops": 600,  # msrl.compile of a generated loop: ~10-50 ms each
}
SCALE = float(os.environ.get("MSRL_FUZZ_SCALE", "1"))  # MSRL_FUZZ_SCALE=10: a deeper (slower) search
GENERATED: Counter = Counter()  # cases run, per test
OUTCOMES: Counter = Counter()  # what they ended in (printed by the last test, with -s)


def fuzz_settings(name: str):
    return settings(max_examples=max(1, int(MAX_EXAMPLES[name] * SCALE)), deadline=None, derandomize=True,
                    database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                          HealthCheck.function_scoped_fixture])


# ============================================================================================ configs
BASE = {p.name: yaml.safe_load(p.read_text()) for p in EXAMPLE_FILES}

SCHEMA = {  # the keys each section may have (algorithm, policy: those of any registered one)
    "algorithm": set().union(*(ALGORITHMS.get(n).Config.model_fields for n in ALGORITHMS.names())),
    "env": set(EnvConfig.model_fields),
    "policy": set().union(*(POLICIES.get(n).model_fields for n in POLICIES.names())),
    "run": set(RunConfig.model_fields),
}
SIZE_KEYS = ["algorithm.rollout_len", "algorithm.epochs", "algorithm.minibatches", "env.num_envs",
             "policy.actors", "policy.envs_per_actor", "run.total_env_steps", "run.seed",
             "run.iterations_per_dispatch", "run.checkpoint_every_steps", "run.keep_checkpoints",
             "policy.max_actor_restarts"]
FLOAT_KEYS = ["algorithm.lr", "algorithm.gamma", "algorithm.gae_lambda", "algorithm.clip_eps", "algorithm.ent_coef",
              "algorithm.vf_coef", "algorithm.max_grad_norm", "policy.resources.actor.num_cpus",
              "policy.resources.learner.num_gpus", "run.stall_timeout_s"]
OTHER_KEYS = ["algorithm.name", "algorithm.anneal_lr", "algorithm.hidden", "algorithm.activation", "env.id",
              "env.kwargs", "policy.name", "policy.backend", "policy.actor_backend", "policy.learner_backend",
              "policy.resources", "policy.ray_address", "policy.ray_dashboard", "run.progress", "run.tensorboard",
              "run.compile_cache", "run.checkpoint_buffer"]
ALL_KEYS = SIZE_KEYS + FLOAT_KEYS + OTHER_KEYS

HUGE = [2**31 - 1, 2**31, 2**53 + 1, 2**63, 2**64 + 7, 10**30]
NAMES = {
    "algorithm.name": ["ppo", "PPO", "dqn", "", " ppo", "reinforce", "growth"],
    "policy.name": ["fused", "single_learner_coarse", "single_learner_fine", "multi_learner", "async", "Fused", ""],
    "policy.backend": ["jax", "threads", "ray", "mpi", "", "JAX"],
    "policy.actor_backend": ["jax", "threads", "ray", "gpu", ""],
    "policy.learner_backend": ["jax", "threads", "ray", "tpu", ""],
    "algorithm.activation": ["tanh", "relu", "gelu", "", "Tanh"],
    "env.id": ["gymnax:CartPole-v1", "gymnax:Pendulum-v1", "gymnax:Acrobot-v1", "gymnax:MountainCarContinuous-v0",
               "gymnax:Breakout-MinAtar", "gymnax:Nope-v0", "gymnax:", "gymnax", "CartPole-v1", ":", "", "foo:bar",
               "gymnasium:CartPole-v1", "gymnasium:Pendulum-v1", "gymnasium:FrozenLake-v1", "gymnasium:Taxi-v3",
               "gymnasium:Blackjack-v1", "gymnasium:Nope-v9", "gymnasium:ALE/Pong-v5", "gymnasium:",
               "gymnasium:CartPole-v1:extra", "gymnax:cartpole-v1"],
    "env.kwargs": [{}, {"max_episode_steps": -1}, {"max_episode_steps": "x"}, {"max_episode_steps": 0},
                   {"render_mode": 5}, {"render_mode": "nope"}, {"foo": 1}, {1: 2}, {"sutton_barto_reward": "x"},
                   {"disable_env_checker": "yes"}, {"max_episode_steps": 2**70}],
    "policy.resources": [{}, {"actor": {"num_cpus": 2}}, {"learner": {"num_gpus": -1}}, {"nobody": {}},
                         {"actor": 3}, {"actor": {"num_tpus": 1}}, {"env_worker": {"num_cpus": 0.5}},
                         {"central": None}, {"actor": {"num_cpus": "x"}}],
    "algorithm.hidden": [[64, 64], [8], [], [0], [-3], [2**31], [1.5], ["64"], 64, None, [[8]], [8, None]],
}

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 10), st.sampled_from(HUGE), st.sampled_from([-(2**63), -(10**30)]),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6),
    st.sampled_from(["4", "four", "1e3", "2.5", "-1", "true", "null", "[1]", "jax"]),
)
any_value = st.one_of(
    scalars,
    st.dates(), st.datetimes(), st.binary(max_size=4),  # what else YAML reads: timestamps, !!binary, !!set
    st.sets(st.integers(0, 3), max_size=2),
    st.lists(scalars, max_size=3),
    st.dictionaries(st.one_of(st.text(max_size=5), st.integers(0, 3)), scalars, max_size=2),
)
junk_keys = st.one_of(
    st.sampled_from(["nope", "Name", "lr_", "num-envs", "1", "__class__", "model_config", "model_fields",
                     "name ", "kwargs", "resources", "algorithm", "items", "copy", "dict"]),
    st.text(alphabet="abcxyz_.-0123 ", min_size=1, max_size=8),
    st.integers(-2, 3), st.just(None), st.just(True),
)


def value_for(key: str) -> st.SearchStrategy:
    """Values for ``key``: the plausible ones for its type, wrong types and junk."""
    options = [any_value]
    if key in SIZE_KEYS:
        options += [st.integers(-3, 9), st.sampled_from(HUGE), st.sampled_from([2.0, 2.5, "3", "x", [4], {"n": 4}])]
    if key in FLOAT_KEYS:
        options += [st.floats(-2, 2), st.sampled_from([0.0, -0.0, 1.0, 1.0000001, math.inf, -math.inf, math.nan,
                                                       "1e-3", 1e308])]
    if key in NAMES:
        options += [st.sampled_from(NAMES[key])] * 3
    return st.one_of(*options)


def _get(data: Any, path: list[Any]) -> Any:
    for p in path:
        data = data[p]
    return data


def _paths(data: dict, prefix: tuple = (), inside: tuple = ()) -> list[tuple]:
    """Every key path in ``data`` (mappings only, each once), sections included."""
    out, inside = [], (*inside, id(data))
    for k, v in data.items():
        out.append(prefix + (k,))
        if isinstance(v, dict) and id(v) not in inside:
            out += _paths(v, prefix + (k,), inside)
    return out


def _set(data: dict, key: str, value) -> None:
    """Set dotted ``key`` in ``data`` (making mappings on the way); DELETE removes it. Values are copied:
    never the pools' own objects, which later mutations would change."""
    node = data
    *parents, last = key.split(".")
    for p in parents:
        if not isinstance(node.get(p), dict):
            node[p] = {}
        node = node[p]
    if value is DELETE:
        node.pop(last, None)
    else:
        node[last] = copy.deepcopy(value)


@st.composite
def mutated_config(draw) -> dict:
    """One of the example configs with 1-4 mutations: wrong values, unknown keys, deletions, whole sections
    replaced, mappings that contain themselves, incompatible combinations."""
    data = copy.deepcopy(BASE[draw(st.sampled_from(sorted(BASE)))])
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["set", "set", "set", "unknown", "delete", "section", "combo", "cycle"]))
        if op == "set":
            key = draw(st.sampled_from(ALL_KEYS))
            _set(data, key, draw(value_for(key)))
        elif op == "unknown":
            targets = [()] + [p for p in _paths(data) if isinstance(_get(data, p), dict)]
            where = draw(st.sampled_from(targets))
            _get(data, where)[draw(junk_keys)] = copy.deepcopy(draw(any_value))
        elif op == "delete":
            paths = _paths(data)
            if paths:
                path = draw(st.sampled_from(paths))
                del _get(data, path[:-1])[path[-1]]
        elif op == "section":
            data[draw(st.sampled_from(SECTIONS))] = copy.deepcopy(draw(any_value))
        elif op == "cycle":  # a mapping that contains itself or an enclosing one (YAML anchor + alias)
            paths = [p for p in _paths(data) if isinstance(_get(data, p), dict)]
            if paths:
                path = draw(st.sampled_from(paths))
                target = _get(data, path[: draw(st.integers(1, len(path)))])
                value = target if draw(st.booleans()) else [1, target]
                _get(data, path)[draw(st.sampled_from(["kwargs", "x", "actor", "name"]))] = value
        else:  # incompatible combinations
            combo = draw(st.sampled_from(COMBOS))
            for key, value in combo.items():
                _set(data, key, value)
    return data


DELETE = object()
COMBOS = [
    {"env.id": "gymnasium:CartPole-v1", "policy": {"name": "fused"}},  # a host env under fused
    {"env.id": "gymnasium:Pendulum-v1", "policy": {"name": "fused", "backend": "jax"}},
    {"policy": {"name": "fused", "backend": "threads"}},  # a backend fused does not support
    {"policy": {"name": "fused", "backend": "ray"}},
    {"policy": {"name": "fused", "actors": 2}},  # another policy's key
    {"policy": {"name": "single_learner_coarse", "backend": "jax"}},
    {"policy": {"name": "single_learner_fine", "backend": "threads", "actor_backend": "ray"}},
    {"policy": {"name": "single_learner_coarse", "backend": "ray", "learner_backend": "threads"}},
    {"policy": {"name": "single_learner_coarse", "actors": 3}, "env.num_envs": 8},  # 3 does not divide 8
    {"policy": {"name": "single_learner_fine", "actors": 5}, "env.num_envs": 4},
    {"policy": {"name": "single_learner_coarse", "actors": 2, "envs_per_actor": 3}, "env.num_envs": 8},
    {"policy": {"name": "single_learner_coarse", "actors": 2**31, "envs_per_actor": 2**31}},
    {"policy": {"name": "single_learner_coarse", "actor_backend": "jax", "learner_backend": "jax"},
     "env.id": "gymnasium:CartPole-v1"},  # a host env in a jitted role
    {"policy": {"name": "single_learner_fine", "actor_backend": "jax"}, "env.id": "gymnasium:CartPole-v1"},
    {"policy": {"name": "single_learner_fine", "learner_backend": "jax"}},
    {"policy": {"name": "single_learner_coarse", "resources": {"env_worker": {"num_cpus": 1}}}},  # not a role
    {"algorithm.minibatches": 3},  # does not divide 4 x 128
    {"algorithm.minibatches": 1024, "algorithm.rollout_len": 16},
    {"algorithm.minibatches": 7, "env.num_envs": 7, "algorithm.rollout_len": 1},
    {"algorithm.rollout_len": 1, "algorithm.minibatches": 1, "env.num_envs": 1},
    {"run.total_env_steps": 1, "algorithm.rollout_len": 2},  # less than one iteration
    {"env.id": "gymnax:Pendulum-v1", "algorithm.activation": "relu"},
    {"env.id": "gymnax:Breakout-MinAtar", "algorithm.hidden": [4]},
    {"policy.name": DELETE, "policy.backend": "threads"},
    {"algorithm.name": DELETE},
    {"env.kwargs": {"max_episode_steps": 10}, "env.id": "gymnasium:CartPole-v1",
     "policy": {"name": "single_learner_coarse"}},
]


def _split_key(key: str) -> list[str]:
    """``a.b.'c.d'.0`` -> ``["a", "b", "'c.d'", "0"]`` (keys that would not show are written as repr())."""
    return re.findall(r"""'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*"|[^.]+""", key)


def _walk_key(data: Any, parts: list[str]) -> bool:
    for p in parts:
        if isinstance(data, dict):
            match = [k for k in data if p in (str(k), repr(k))]
            if not match:
                return False
            data = data[match[0]]
        elif isinstance(data, list) and p.isdigit() and int(p) < len(data):
            data = data[int(p)]
        else:
            return False
    return True


def assert_names_a_key(err: msrl.ConfigError, data: dict, overrides: list[str] = ()) -> None:
    """``err.key`` is non-empty and names a key of the config: one in the (overridden) input, one of the
    schema, or the malformed override itself."""
    key = err.key
    assert isinstance(key, str) and key.strip(), f"ConfigError without a key: {err!r}"
    assert str(err).startswith(key), str(err)
    for o in overrides:
        k = o.partition("=")[0]
        if key in (o, k, repr(o)):
            return
    try:
        merged = apply_overrides(copy.deepcopy(data), list(overrides))
    except msrl.ConfigError:
        merged = data
    parts = _split_key(key)
    if _walk_key(merged, parts) or _walk_key(data, parts):
        return
    assert parts[0] in SECTIONS, f"key {key!r} names no section: {err}"
    assert len(parts) == 1 or parts[1] in SCHEMA[parts[0]], f"key {key!r} is not a config key: {err}"


def check_config(data: dict | None, overrides: list[str], tmp: Path, do_build: bool) -> str:
    """Load (and maybe build) the config; returns what happened. Any exception other than ConfigError /
    CompileError propagates and fails the test."""
    if data is not None:
        path = tmp / "config.yaml"
        path.write_text(yaml.safe_dump(data, sort_keys=False))
    else:
        path, data = EXAMPLE_FILES[0], BASE[EXAMPLE_FILES[0].name]
    try:
        cfg = load_config(path, overrides)
    except msrl.ConfigError as e:
        assert_names_a_key(e, data, overrides)
        return "config_error"
    # a config that loads validates the same from its dump
    assert validate_config(cfg.dump()).dump() == cfg.dump()
    if not do_build:
        return "loaded"
    try:
        build(cfg)
    except msrl.ConfigError as e:
        assert_names_a_key(e, data, overrides)
        return "build_config_error"
    except msrl.CompileError:
        return "compile_error"
    return "built"


@pytest.fixture(scope="module")
def cfg_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz_configs")


@fuzz_settings("config_yaml")
@given(data=mutated_config())
def test_fuzz_config_yaml(cfg_dir, data):
    GENERATED["config_yaml"] += 1
    OUTCOMES["yaml_" + check_config(data, [], cfg_dir, do_build=False)] += 1


RAW_VALUES = ["abc", "-1", "0", "1", "3", "2.5", "1e400", "-1e400", ".nan", ".inf", "[1, 2]", "{a: 1}", "{}",
              "[]", "null", "~", "true", "no", "'4'", "", "[unclosed", ": bad", "!!python/object:os.system", "0x10",
              "1_000", "2001-01-01", "&a 1", "*a", "- 1", "ppo", "fused", "threads", "ray", "jax",
              "gymnax:CartPole-v1", "gymnasium:CartPole-v1", "gymnasium:", str(2**64), str(-(2**63)), "{name: ppo}",
              "single_learner_coarse", "relu", "'x' 'y'", "%", "@", "`", "!!binary Zm9v", "!!set {1, 2}",
              "2001-12-14t21:59:43.10-05:00", "!!omap [a: 1]", "!!str 5", "!!int x", "!!float nan", "!!null ''",
              "{a: &x 1, b: *x}", "&a [*a]", "&a {b: *a}", "&a [1, {c: *a}]", "*undefined", "? a", "|\n x"]
override_keys = st.one_of(
    st.sampled_from(ALL_KEYS),
    st.sampled_from(SECTIONS),
    st.builds(lambda k, j: f"{k}.{j}", st.sampled_from(list(SECTIONS) + ALL_KEYS),
              st.sampled_from(["nope", "x", "name", "0", "actor", "num_cpus", "_", "Name"])),
    st.sampled_from(["policy.resources.actor.num_cpus", "policy.resources.central.num_gpus", "env.kwargs.foo",
                     "env.kwargs.max_episode_steps", "algorithm.hidden.0", "extra", "extra.x", "policy.name.x",
                     "algorithm.lr.x", "run.seed.x.y", "Algorithm.lr", "env.num_envs "]),
)


def _yaml_text(value: Any) -> str:
    """``value`` as one YAML flow document, as a user would type it after ``KEY=``."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10**6).strip()
    return text[: -len("...")].strip() if text.endswith("\n...") else text


well_formed_override = st.builds(lambda k, v: f"{k}={v}", override_keys,
                                 st.one_of(st.sampled_from(RAW_VALUES), any_value.map(_yaml_text)))
malformed_override = st.sampled_from(["run.seed", "=1", "", "==", ".x=1", "algorithm..lr=1", "algorithm.=1",
                                      " =2", "policy.=fused", ".=."])


@fuzz_settings("config_overrides")
@given(data=st.one_of(st.none(), mutated_config()),
       overrides=st.lists(st.one_of(well_formed_override, well_formed_override, malformed_override), min_size=1,
                          max_size=4))
def test_fuzz_config_overrides(cfg_dir, data, overrides):
    GENERATED["config_overrides"] += 1
    OUTCOMES["overrides_" + check_config(data, overrides, cfg_dir, do_build=False)] += 1


BUILD_VALUES = {  # mostly values that validate, so that most cases get as far as build()
    "env.id": ["gymnax:CartPole-v1", "gymnax:Pendulum-v1", "gymnax:Acrobot-v1", "gymnax:MountainCarContinuous-v0",
               "gymnax:Breakout-MinAtar", "gymnasium:CartPole-v1", "gymnasium:Pendulum-v1",
               "gymnasium:MountainCarContinuous-v0", "gymnasium:Acrobot-v1", "gymnasium:FrozenLake-v1"],
    "env.num_envs": [1, 2, 3, 4, 8, 2**31 - 1, 2**40],
    "env.kwargs": NAMES["env.kwargs"],
    "algorithm.rollout_len": [1, 2, 8, 2**31 - 1, 2**40],
    "algorithm.minibatches": [1, 2, 3, 4, 8, 1024, 2**40],
    "algorithm.epochs": [1, 2, 2**31 - 1, 2**40],
    "algorithm.hidden": [[8], [4, 4], [0], [-3], [2**31], [2**40]],
    "algorithm.activation": ["relu"],
    "algorithm.lr": [math.inf, 1e-300],
    "algorithm.max_grad_norm": [math.inf, 1e-300],
    "algorithm.anneal_lr": [False],
    "run.total_env_steps": [1, 100, 10**6, 2**31, 2**40, 2**70],
    "policy": [{"name": "fused"}, {"name": "single_learner_coarse", "actors": 2},
               {"name": "single_learner_fine", "actors": 4}, {"name": "single_learner_coarse", "actors": 3},
               {"name": "single_learner_coarse", "actors": 2, "envs_per_actor": 2},
               {"name": "single_learner_fine", "actors": 2, "envs_per_actor": 2**31},
               {"name": "single_learner_coarse", "actors": 2**40, "envs_per_actor": 1},
               {"name": "single_learner_coarse", "actors": 2**16, "envs_per_actor": 2**16},
               {"name": "single_learner_coarse", "actor_backend": "jax"},
               {"name": "single_learner_fine", "learner_backend": "jax", "actor_backend": "threads"},
               {"name": "single_learner_coarse", "backend": "ray", "learner_backend": "jax"},
               {"name": "single_learner_coarse", "resources": {"learner": {"num_gpus": 0.5}}},
               {"name": "single_learner_fine", "resources": {"actor": {"num_cpus": 1}}}],
}


@st.composite
def buildable_config(draw) -> dict:
    """An example config with 1-4 keys set from BUILD_VALUES (or, one time in four, a mutated_config)."""
    data = copy.deepcopy(BASE[draw(st.sampled_from(sorted(BASE)))])
    if draw(st.integers(0, 3)) == 0:
        return draw(mutated_config())
    for key in draw(st.lists(st.sampled_from(sorted(BUILD_VALUES)), min_size=1, max_size=4, unique=True)):
        value = copy.deepcopy(draw(st.sampled_from(BUILD_VALUES[key])))
        node, parts = data, key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return data


@fuzz_settings("config_build")
@given(data=buildable_config(),
       overrides=st.lists(st.builds(lambda k, v: f"{k}={v}", st.sampled_from(SIZE_KEYS[:6]),
                                    st.sampled_from(["1", "2", "3", "0", "-1", str(2**31), str(2**64)])),
                          max_size=1))
def test_fuzz_config_build(cfg_dir, data, overrides):
    """The same, on to build(): env, algorithm and the compiled program (jax tracing, no training)."""
    GENERATED["config_build"] += 1
    OUTCOMES["build_" + check_config(data, overrides, cfg_dir, do_build=True)] += 1


# ============================================================================================ loops
NUM_ENVS = 4


@dataclasses.dataclass(frozen=True)
class Snippet:
    code: str  # statements (relative indentation) using the loop's names: obs, out, reward, ...
    must_fail: bool = False  # rejected wherever it runs
    in_loop: bool = False  # only inside a loop (break/continue)
    first: bool = False  # only as the first statement (global)


def S(code: str, **kw) -> Snippet:
    return Snippet(code.strip("\n"), **kw)


VALID_SNIPPETS = [
    S("x = jnp.zeros(())"),
    S("obs = obs * 1.0"),
    S("out2 = msrl.agent_act(obs)"),
    S("obs, r2, d2 = msrl.env_step(msrl.agent_act(obs).action)"),
    S("if self.cfg.flag:\n    obs = msrl.env_observe()"),
    S("if not self.cfg.flag:\n    while True:\n        msrl.env_observe()"),
    S("for j in range(2):\n    o2 = msrl.agent_act(obs)"),
    S("obs = api.env_observe()"),
    S("x: jax.Array = msrl.env_observe()"),
    S("obs += 0 * msrl.env_observe()"),
    S("a, *b = msrl.env_step(msrl.agent_act(obs).action)"),
    S("msrl.env_reset()"),
    S("tmp = [o for o in range(3)]"),
    S("f = lambda v: v + 1"),
    S("for k in [1, 2]:\n    z = k"),
    S("while False:\n    pass"),
    S("try:\n    q = 1\nexcept Exception:\n    q = 2"),
    S("with contextlib.nullcontext():\n    q = 3"),
    S("dd = {'a': 1}\ndel dd['a']"),
    S("y = (w := msrl.env_observe())"),
    S('s = f"{msrl.env_observe()}"'),
    S("obs = msrl.env_observe() + msrl.env_observe()"),
    S("msrl.buffer_insert(item=Item(obs, obs[:, 0], obs[:, 0], obs[:, 0] > 0))"),
    S("batch = msrl.buffer_sample(batch_size=2)"),
    S("m = msrl.agent_learn(msrl.buffer_get(), extra=obs)"),
    S("m = msrl.agent_learn(msrl.buffer_get())"),
    S("b2 = msrl.buffer_get()"),
    S("import math"),
    S("pass"),
    S("assert True"),
    S("def inner(v):\n    return v + 1"),
    S("class K:\n    pass"),
    S("obs[0] = msrl.env_observe()"),
    S("obs = msrl.env_observe()[0]"),
    S("x = msrl.agent_act(obs).action.sum()"),
    S("x = jnp.where(True, msrl.env_observe(), 0)"),
    S("n = self.cfg.steps"),
    S("n = obs.shape[0]"),
    S("o3 = msrl.agent_act(obs=obs)"),
    S("msrl.agent_act(obs).action = 1"),
    S("x = getattr(msrl, 'agent_act')(obs)"),
    S("obs = self.collect(obs)"),
    S("obs = self.collect(obs, steps=self.cfg.steps)"),
    S("y = self.plain(obs)"),
    S("for j in range(2):\n    break"),
    S("obs = msrl.env_step(msrl.agent_act(msrl.env_observe()).action)[0]"),
    S("x = obs.undefined_attribute"),
    S("x = undefined_name + 1"),
    S("obs = obs @ jnp.ones((7, 3))"),
    S("raise ValueError('no API here')"),
    S("tot = [o * 2 for o in range(3)]"),
    S("d = {i: j for i, j in zip(range(2), range(2))}"),
    S("tmp = [v := 3 for _ in range(2)]"),
    S("def helper():\n    t = 1\n    return t"),
    S("def g2():\n    global G\n    G = 1"),
    S("async def af():\n    return 1"),
    S("class K2:\n    z = 1\n    w = z + 1"),
    S("sq = lambda v, w=2: v * w"),
    S("match 1:\n    case 1:\n        q = 1"),
    S("obs, r3, d3 = msrl.env_step(action=msrl.agent_act(obs).action)"),
    S("obs = self.collect(obs=obs)"),
    S("o4 = msrl.api.agent_act(obs)"),
    S("from msrl import env_step\nx = env_step(0)"),
    S("x = out.nope"),
    S("obs = self.act_comp(obs).action * 0 + obs"),
    S("for j in range(2):\n    for jj in range(2):\n        obs, r5, d5 = msrl.env_step(msrl.agent_act(obs).action)"),
    S("tot = sum(r for r in [obs.sum()])"),
    S("for o in range((m := 2)):\n    msrl.env_observe()"),
    S("x = [msrl.env_observe][0]", must_fail=True),
]

BAD_SNIPPETS = [
    S("while True:\n    obs = msrl.env_observe()", must_fail=True),
    S("while obs.sum() > 0:\n    msrl.env_step(msrl.agent_act(obs).action)", must_fail=True),
    S("try:\n    msrl.env_observe()\nexcept ValueError:\n    pass", must_fail=True),
    S("try:\n    pass\nfinally:\n    msrl.env_observe()", must_fail=True),
    S("with contextlib.nullcontext():\n    obs = msrl.env_observe()", must_fail=True),
    S("match 1:\n    case 1:\n        msrl.env_observe()", must_fail=True),
    S("f = lambda o: msrl.agent_act(o)", must_fail=True),
    S("outs = [msrl.agent_act(obs) for _ in range(2)]", must_fail=True),
    S("outs = {msrl.env_observe() for _ in range(2)}", must_fail=True),
    S("outs = {i: msrl.env_observe() for i in range(2)}", must_fail=True),
    S("outs = list(msrl.env_observe() for _ in range(2))", must_fail=True),
    S("x = msrl.env_observe() if self.cfg.flag else None", must_fail=True),
    S("x = msrl.env_observe() or obs", must_fail=True),
    S("x = obs is None and msrl.env_observe()", must_fail=True),
    S("yield obs", must_fail=True),
    S("x = yield", must_fail=True),
    S("yield from []", must_fail=True),
    S("global G", must_fail=True, first=True),
    S("self.x = obs", must_fail=True),
    S("del self.actor", must_fail=True),
    S("del x", must_fail=True),
    S("del obs", must_fail=True),
    S("if self.cfg.flag:\n    del obs", must_fail=True),
    S("self.cfg.steps = 3", must_fail=True),
    S("self.table[0] = 1", must_fail=True),
    S("(self.a, b) = (1, 2)", must_fail=True),
    S("msrl.agent_act()", must_fail=True),
    S("out = msrl.agent_act(obs, obs)", must_fail=True),
    S("out = msrl.agent_act(obs, foo=1)", must_fail=True),
    S("obs = msrl.env_observe(obs)", must_fail=True),
    S("msrl.env_step()", must_fail=True),
    S("msrl.env_step(action=1, extra=2)", must_fail=True),
    S("msrl.buffer_insert()", must_fail=True),
    S("b = msrl.buffer_get(1)", must_fail=True),
    S("m = msrl.agent_learn()", must_fail=True),
    S("out = msrl.agent_act(self.actor, obs)", must_fail=True),
    S("out = msrl.agent_act(*[obs])", must_fail=True),
    S("m = msrl.agent_learn(obs, **{})", must_fail=True),
    S("x = msrl.env_observe(msrl.agent_act)", must_fail=True),
    S("f = msrl.agent_act", must_fail=True),
    S("g = api.env_step", must_fail=True),
    S("_s_env = obs", must_fail=True),
    S("_api1 = obs", must_fail=True),
    S("_api2 = msrl.env_observe()", must_fail=True),
    S("_c_x = 1", must_fail=True),
    S("x = _s_env", must_fail=True),
    S("x = msrl.agent_act(msrl.env_observe())\n_api1 = obs", must_fail=True),
    S("_h1_y = 2", must_fail=True),
    S("_msrl_q = 3", must_fail=True),
    S("for _s_i in range(2):\n    pass", must_fail=True),
    S("return obs"),
    S("break", must_fail=True, in_loop=True),
    S("continue", must_fail=True, in_loop=True),
    S("if self.cfg.flag:\n    break", must_fail=True, in_loop=True),
    S("for j in range(2):\n    o = msrl.agent_act(obs)\n    break", must_fail=True),
    S("def step(o):\n    return msrl.agent_act(o)", must_fail=True),
    S("def bump():\n    nonlocal obs\n    obs = msrl.env_observe()", must_fail=True),
    S("class K:\n    o = msrl.env_observe()", must_fail=True),
    S("raise ValueError(msrl.env_observe())", must_fail=True),
    S("f = lambda x=msrl.env_observe(): x", must_fail=True),
    S("async def af():\n    return msrl.env_observe()", must_fail=True),
    S("def gen():\n    yield 1", must_fail=True),
    S("obs = self.act_del(obs)", must_fail=True),
    S("for j in range(2):\n    for jj in range(2):\n        msrl.env_observe()\n        continue", must_fail=True),
    S("assert msrl.env_observe() is not None", must_fail=True),
    S("for x in range(3):\n    msrl.env_observe()\nelse:\n    pass", must_fail=True),
    S("for (a, b) in range(3):\n    msrl.env_observe()", must_fail=True),
    S("for self.i in range(3):\n    msrl.env_observe()", must_fail=True),
    S("for o in [1, 2]:\n    msrl.env_observe()", must_fail=True),
    S("for o in reversed(range(2)):\n    msrl.env_observe()", must_fail=True),
    S("for o in range(obs.shape[0]):\n    msrl.env_observe()", must_fail=True),
    S("for o in range(0):\n    msrl.env_observe()", must_fail=True),
    S("for o in range(3, 1):\n    msrl.env_observe()", must_fail=True),
    S("for o in range(1, 4, 0):\n    msrl.env_observe()", must_fail=True),
    S("for o in range(2.5):\n    msrl.env_observe()", must_fail=True),
    S("for o in range('3'):\n    msrl.env_observe()", must_fail=True),
    S("for o in range(self.cfg.steps // 0):\n    msrl.env_observe()", must_fail=True),
    S("for o in range(self.nope):\n    msrl.env_observe()", must_fail=True),
    S("for o in range(*[3]):\n    msrl.env_observe()", must_fail=True),
    S("for o in range(stop=3):\n    msrl.env_observe()", must_fail=True),
    S("for o in range():\n    msrl.env_observe()", must_fail=True),
    S("for o in range(10**30):\n    msrl.env_observe()", must_fail=True),
    S("for o in range(-(10**30), 10**30, 7):\n    msrl.env_observe()", must_fail=True),
    S("if obs.sum() > 0:\n    msrl.env_step(msrl.agent_act(obs).action)", must_fail=True),
    S("if self.nope:\n    msrl.env_observe()", must_fail=True),
    S("if 1 / 0:\n    msrl.env_observe()", must_fail=True),
    S("obs = self.collect()", must_fail=True),
    S("obs = self.collect(obs, 1, 2)", must_fail=True),
    S("obs = self.collect(obs, nope=1)", must_fail=True),
    S("obs = self.collect(*[obs])", must_fail=True),
    S("obs = self.collect(obs, **{})", must_fail=True),
    S("obs = self.collect(obs, 0)", must_fail=True),
    S("obs = self.collect(obs, obs.shape[0])", must_fail=True),
    S("obs = self.act_rec(obs)", must_fail=True),
    S("obs = self.act_static(obs)", must_fail=True),
    S("obs = self.act_early(obs)", must_fail=True),
    S("obs = self.act_kwonly(obs)", must_fail=True),
    S("obs = self.act_while(obs)", must_fail=True),
]

HELPERS = '''
    def collect(self, obs, steps=2):
        for _ in range(steps):
            out = msrl.agent_act(obs)
            obs, reward, done = msrl.env_step(out.action)
            msrl.buffer_insert(Item(obs, out.action, reward, done))
        return obs

    def act_rec(self, obs):
        return self.act_rec(msrl.agent_act(obs).action)

    @staticmethod
    def act_static(obs):
        return msrl.agent_act(obs)

    def act_early(self, obs):
        if self.cfg.flag:
            return obs
        return msrl.agent_act(obs)

    def act_kwonly(self, obs, *, scale=1):
        return msrl.agent_act(obs)

    def act_while(self, obs):
        while obs.sum() > 0:
            obs = msrl.agent_act(obs)
        return obs

    def act_del(self, obs):
        o = obs
        del o
        return msrl.agent_act(obs)

    def act_comp(self, obs):
        scales = [v * 2 for v in range(2)]
        return msrl.agent_act(obs * scales[0])

    def plain(self, x):
        return x * 2
'''

LOOP_HEADERS = [
    ("for _ in range(self.cfg.steps):", False),
    ("for i in range(3):", False),
    ("for i in range(n):", False),  # n = self.cfg.steps, static
    ("for i in range(1, 4):", False),
    ("for i in range(len((1, 2))):", False),
    ("for i in range(int(2.0)):", False),
    ("for i in range(True):", False),
    ("for i in range(k):", True),  # k is assigned twice: not static
]
CORE = [  # the body of the main loop
    "out = msrl.agent_act(obs)",
    "next_obs, reward, done = msrl.env_step(out.action)",
    "msrl.buffer_insert(Item(obs, out.action, reward, done))",
    "obs = next_obs",
]
SUFFIXES = [  # after the loop
    ["metrics = msrl.agent_learn(msrl.buffer_get())", "return metrics"],
    ["return msrl.agent_learn(msrl.buffer_get(), last=obs.sum())"],
    ["msrl.agent_learn(msrl.buffer_get())"],
    ["return {'x': obs.sum()}"],
    ["return"],
    [],
]


@dataclasses.dataclass
class Program:
    source: str
    must_fail: bool


def _indent(code: str, level: int) -> list[str]:
    return ["    " * level + line for line in code.splitlines()]


@st.composite
def programs(draw) -> Program:
    """train_step: a static loop of act/step/insert between an observe and a learn, with 0-4 snippets
    (valid ones twice as often as bad ones) inserted before, inside or after the loop, and now and then a
    statement of the loop dropped."""
    header, must_fail = draw(st.sampled_from(LOOP_HEADERS))
    core = [[c] for c in CORE]
    if draw(st.integers(0, 4)) == 0:
        del core[draw(st.integers(0, len(core) - 1))]
    blocks = {"before": [["n = self.cfg.steps"], ["k = 1"], ["k = 2"], ["obs = msrl.env_observe()"]],
              "loop": core, "after": [[s] for s in draw(st.sampled_from(SUFFIXES))]}
    for _ in range(draw(st.integers(0, 4))):
        snip = draw(st.sampled_from(BAD_SNIPPETS if draw(st.integers(0, 2)) == 0 else VALID_SNIPPETS))
        must_fail |= snip.must_fail
        if snip.first:
            blocks["before"].insert(0, snip.code.splitlines())
            continue
        block = blocks["loop" if snip.in_loop else draw(st.sampled_from(["before", "loop", "after"]))]
        block.insert(draw(st.integers(0, len(block))), snip.code.splitlines())
    # a `return` anywhere but at the very end is rejected
    returns = [(where, i) for where, bl in blocks.items() for i, b in enumerate(bl) if b[0].startswith("return")]
    must_fail |= any(where != "after" or i != len(blocks["after"]) - 1 for where, i in returns)
    # `n` assigned again is no longer known at compile time
    if "range(n)" in header and sum(b[0].startswith("n = ") for bl in blocks.values() for b in bl) > 1:
        must_fail = True
    body = [ln for b in blocks["before"] for ln in b] + [header]
    body += ["    " + ln for b in blocks["loop"] for ln in b] or ["    pass"]
    body += [ln for b in blocks["after"] for ln in b]
    return Program(module_source(body), must_fail)


def module_source(train_step_body: list[str]) -> str:
    return "\n".join([
        "import contextlib",
        "",
        "import jax",
        "import jax.numpy as jnp",
        "",
        "import msrl",
        "from msrl import api",
        "from loops import Base, Item",
        "",
        "G = 0",
        "",
        "",
        "class Gen(Base):",
        *HELPERS.strip("\n").splitlines(),
        "",
        "    def train_step(self):",
        *_indent("\n".join(train_step_body), 2),
        "",
    ])


POLICIES = [Fused(), SingleLearnerCoarse(actors=2), SingleLearnerFine(actors=2),
            SingleLearnerCoarse(actors=4, learner_backend="jax"), SingleLearnerFine(actors=2, learner_backend="jax")]
_module_ids = itertools.count()


@pytest.fixture(scope="module")
def cartpole():
    return make_env("gymnax:CartPole-v1")


def compile_source(directory: Path, source: str, policy: msrl.Policy, env) -> tuple[Path, msrl.CompileError | None]:
    """Write ``source`` to a new module in ``directory``, import it (so that inspect finds the source) and
    compile its ``Gen``; returns the file and the CompileError, if any (other exceptions propagate)."""
    name = f"msrl_fuzz_loop_{next(_module_ids)}"
    path = directory / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        try:
            msrl.compile(module.Gen(), policy, env, NUM_ENVS)
        except msrl.CompileError as e:
            assert e.file is not None and Path(e.file).resolve() == path.resolve(), (str(e), source)
            assert isinstance(e.line, int) and 1 <= e.line <= len(source.splitlines()), str(e)
            assert f"{e.file}:{e.line}" in str(e)
            return path, e
        return path, None
    finally:
        del sys.modules[name]


@fuzz_settings("loops")
@given(prog=programs(), policy=st.sampled_from(POLICIES))
def test_fuzz_training_loops(tmp_path, cartpole, prog, policy):
    GENERATED["loops"] += 1
    _, err = compile_source(tmp_path, prog.source, policy, cartpole)
    OUTCOMES["loop_rejected" if err else "loop_compiled"] += 1
    assert err is not None or not prog.must_fail, "compiled a loop that must be rejected:\n" + prog.source


# ============================================================================================ regressions
# What the fuzzer found, pinned (each raised something other than ConfigError / CompileError, or compiled).
@pytest.mark.parametrize("example, overrides, key, text", [
    ("ppo_cartpole.yaml", ["algorithm.name=[1]"], "algorithm.name", "must be the name"),  # was TypeError
    ("ppo_cartpole.yaml", ["policy.name={a: 1}"], "policy.name", "must be the name"),  # was TypeError
    ("ppo_cartpole.yaml", ["algorithm.hidden=[-3]"], "algorithm.hidden.0", "greater than 0"),  # was ValueError
    ("ppo_cartpole.yaml", ["env.num_envs=2147483648"], "env.num_envs", "less than or equal"),
    ("ppo_cartpole.yaml", ["algorithm.rollout_len=2147483647"], "algorithm.rollout_len", "batch"),  # OverflowError
    ("ppo_cartpole.yaml", ["algorithm.epochs=2147483647"], "algorithm.epochs", "optimizer steps"),
    ("ppo_cartpole_threads.yaml", ["policy.actors=65536", "policy.envs_per_actor=65536"], "policy.envs_per_actor",
     "environments"),  # was OverflowError
    ("ppo_cartpole.yaml", ["run.seed=4294967296"], "run.seed", "less than or equal"),  # PRNGKey(2**32) == PRNGKey(0)
    ("ppo_cartpole_threads.yaml", ["env.kwargs={max_episode_steps: x}"], "env.kwargs", "AssertionError"),
    ("ppo_cartpole_threads.yaml", ["env.kwargs={render_mode: 5}"], "env.kwargs", "AttributeError"),
    ("ppo_cartpole.yaml", ["algorithm.rollout_len=!!int x"], "algorithm.rollout_len", "valid integer"),  # ValueError
    ("ppo_cartpole.yaml", [".x=1"], ".x", "empty parts"),  # was a ConfigError without a key
    ("ppo_cartpole.yaml", ["algorithm..lr=1"], "algorithm..lr", "empty parts"),
    ("ppo_cartpole.yaml", ["=1"], "'=1'", "KEY.PATH=VALUE"),
    ("ppo_cartpole.yaml", ["env.kwargs=&a {b: *a}"], "env.kwargs.b", "contains itself"),  # was RecursionError
])
def test_fuzz_found_config(example, overrides, key, text):
    with pytest.raises(msrl.ConfigError) as info:
        build(load_config(EXAMPLES / example, overrides))
    assert info.value.key == key and text in str(info.value), str(info.value)


def test_fuzz_found_config_files(tmp_path):
    for text, key in [("algorithm: {name: ppo}\n~: 1\n", "None"), ("algorithm: {name: ppo}\n1: x\nx: 1\n", "1"),
                      ("algorithm: {name: ppo, 2: 1}\n", "algorithm.2"),  # were TypeError / a key of None
                      ("algorithm: &a {name: ppo, x: [*a]}\n", "algorithm.x.0")]:  # was RecursionError
        (tmp_path / "c.yaml").write_text(text)
        with pytest.raises(msrl.ConfigError) as info:
            load_config(tmp_path / "c.yaml")
        assert info.value.key == key, str(info.value)
    (tmp_path / "c.yaml").write_text("algorithm: {name: ppo, lr: !!float x}\n")  # was ValueError
    with pytest.raises(msrl.ConfigError, match="not valid YAML"):
        load_config(tmp_path / "c.yaml")
    cfg = load_config(EXAMPLES / "ppo_cartpole.yaml", ["run.total_env_steps=1099511627776",  # was OverflowError
                                                       "algorithm.anneal_lr=false"])  # (annealed: too many steps)
    assert build(cfg).env_steps_per_iteration == 512


LOOP = ["obs = msrl.env_observe()", "for _ in range(3):", "    out = msrl.agent_act(obs)",
        "    next_obs, reward, done = msrl.env_step(out.action)",
        "    msrl.buffer_insert(Item(obs, out.action, reward, done))", "    obs = next_obs"]
LEARN = ["return msrl.agent_learn(msrl.buffer_get())"]


@pytest.mark.parametrize("body, error", [
    (["for _ in range(10**30):", "    msrl.env_observe()"] + LOOP + LEARN, "fit in int32"),  # was OverflowError
    (["for _ in range(1, 4, 0):", "    msrl.env_observe()"] + LOOP + LEARN, "step of 0"),  # was ValueError
    (["obs = msrl.env_observe()", "msrl.agent_act(obs)"], "never calls msrl.env_step"),  # had no file:line
    (LOOP + ["del obs"] + LEARN, "`del obs`"),  # was UnboundLocalError
    (LOOP + ["del self.actor"] + LEARN, "delete"),  # deleted the algorithm's actor while tracing
    (LOOP + ["x = _s_env"] + LEARN, "reserved"),  # read the compiler's env state
    (LOOP + ["x = msrl.agent_act(msrl.env_observe())", "_api1 = obs"] + LEARN, "reserved"),  # clobbered a temp
    (["tmp = [o for o in range(3)]"] + LOOP + LEARN, None),  # these were NameErrors
    (["def inner():", "    t = 1", "    return t", "class K:", "    z = 1"] + LOOP + ["return {'t': inner() + K.z}"],
     None),
    (LOOP + ["tot = [scale * r for r in [reward.sum()] for scale in (1, 2)]"] + ["return {'t': tot[0]}"], None),
])
def test_fuzz_found_loop(tmp_path, cartpole, body, error):
    _, err = compile_source(tmp_path, module_source(body), Fused(), cartpole)
    if error is None:
        assert err is None, str(err)
    else:
        assert err is not None and error in str(err), str(err)


@pytest.mark.parametrize("ret, key, shape", [
    ("return {'loss': jnp.zeros(()), 'per_env': reward}", "per_env", "[4]"),  # were averaged into one number
    ("return reward", "result", "[4]"),
    ("return {'loss': {'a': reward.sum(), 'b': reward.mean()}}", "loss", "a tree of 2 arrays"),
])
def test_a_metric_that_is_not_a_scalar_is_a_compile_error(tmp_path, cartpole, ret, key, shape):
    _, err = compile_source(tmp_path, module_source(LOOP + [ret]), Fused(), cartpole)
    assert err is not None and f"returns metric {key!r} of shape {shape}" in str(err), str(err)
    assert err.line == module_source(LOOP + [ret]).splitlines().index("        " + ret) + 1


def test_a_metric_that_is_not_a_number_is_a_compile_error_at_the_return(tmp_path, cartpole):
    ret = "return {'loss': reward.sum(), 'tag': 'hello'}"  # (jax's "traced for jit returned a value of type str")
    _, err = compile_source(tmp_path, module_source(LOOP + [ret]), Fused(), cartpole)
    assert err is not None and "returns metric 'tag' = 'hello' (str); every metric is one number" in str(err), str(err)
    assert err.line == module_source(LOOP + [ret]).splitlines().index("        " + ret) + 1


def test_print_in_train_step_warns_at_compile_time(tmp_path, cartpole):
    body = LOOP + ["print('reward', reward)"] + LEARN
    with pytest.warns(UserWarning, match=r"print\(\) in .*runs only while msrl traces the loop.*jax\.debug\.print"):
        _, err = compile_source(tmp_path, module_source(body), Fused(), cartpole)
    assert err is None, str(err)


def test_fuzz_case_count():
    """Runs last: every fuzz test above ran (nearly) all the cases it asked hypothesis for, at least 500 in
    all, and the cases reached both sides of what each one checks (accepted and rejected inputs), so none
    of them passed by testing nothing."""
    if set(GENERATED) != set(MAX_EXAMPLES):  # pragma: no cover
        pytest.skip("run the whole file to count the generated cases")
    print(dict(GENERATED), dict(OUTCOMES))
    for name, cases in MAX_EXAMPLES.items():
        wanted = max(1, int(cases * SCALE))
        # hypothesis may stop a little short (inputs it could not generate), never runs more when all pass
        assert 0.9 * wanted <= GENERATED[name] <= wanted, (name, dict(GENERATED))
    assert sum(GENERATED.values()) >= 500, dict(GENERATED)
    ended = {k: n for k, n in OUTCOMES.items() if n > 0}
    for fuzzer, accepted, rejected in [
        ("yaml", ["loaded"], ["config_error"]),
        ("overrides", ["loaded"], ["config_error"]),
        ("build", ["built"], ["config_error", "build_config_error", "compile_error"]),
        ("loop", ["compiled"], ["rejected"]),
    ]:
        assert any(f"{fuzzer}_{a}" in ended for a in accepted), (fuzzer, ended)
        assert any(f"{fuzzer}_{r}" in ended for r in rejected), (fuzzer, ended)
