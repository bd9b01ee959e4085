"""Experiment configuration: pydantic v2 models, YAML files, ``key.path=value`` overrides.

``algorithm`` and ``policy`` are validated by the model their ``name`` registers, so every algorithm and
policy brings its own keys. Unknown keys and bad values raise :class:`ConfigError` naming the key.
"""

from __future__ import annotations

import copy
import json
import os
import re
import sys
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

from msrl.errors import ConfigError, did_you_mean, quote
from msrl.registry import ALGORITHMS, BACKENDS, POLICIES, USER_MODULES, import_user_module, main_script

MAX_YAML_VALUES = 100_000  # what a YAML text may expand to through anchors and aliases (a "billion laughs")
INT32_MAX = 2**31 - 1  # counts that become array sizes or indices (jax's default integers are int32)
SEED_MAX = 2**32 - 1  # a jax PRNG key holds a 32-bit seed
# what yaml.safe_load raises on bad input: PyYAML's own errors, and plain ones for a malformed explicit tag
# (`!!int x`: ValueError, `!!bool x`: KeyError, `!!timestamp x`: AttributeError) or absurd nesting
_YAML_ERRORS = (yaml.YAMLError, ValueError, TypeError, KeyError, AttributeError, RecursionError)


class EnvConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    id: str = Field("gymnax:CartPole-v1", max_length=200, description="SOURCE:ID: gymnax, gymnasium, envpool, brax, "
                    "jaxmarl, or a name registered with msrl.register_env (default: the algorithm's, "
                    "gymnax:CartPole-v1 unless it names another)")
    num_envs: int = Field(4, gt=0, le=INT32_MAX, description="environments in total, over all replicas")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="to the environment's maker (gymnasium.make, "
                                   "envpool.make, a gymnax env and its EnvParams); mask_obs: observation indices "
                                   "zeroed")
    subprocesses: int = Field(0, ge=0, le=1024, description="gymnasium: envs only: step each replica's envs in this "
                              "many worker processes, outside its GIL (0: in the replica's own thread)")
    xla: bool = Field(False, description="envpool: ids only: step each replica's pool from inside its jitted program "
                      "(EnvPool's XLA interface), so the env can be placed in jitted fragments (fused, or coarse actors) "
                      "and a rollout runs with no Python between steps")


class WandbConfig(BaseModel):
    """``run.wandb``: the metrics rows also go to a Weights & Biases run (``mode: offline`` needs no network;
    ``wandb sync`` uploads it later)."""

    model_config = ConfigDict(extra="forbid")

    project: str = Field(description="the W&B project")
    entity: str | None = Field(None, description="the W&B team or user (default: yours)")
    name: str | None = Field(None, description="the W&B run's name (default: the run directory's)")
    tags: list[str] = Field(default_factory=list, description="the W&B run's tags")
    mode: Literal["online", "offline", "disabled"] | None = Field(None, description="offline: upload later with "
                                                                  "`wandb sync` (default: $WANDB_MODE, else online)")


class RunConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    total_env_steps: int = Field(500_000, gt=0, le=2**63 - 1, description="env steps of the run (all envs), rounded "
                                 "down to whole iterations")
    seed: int = Field(0, ge=0, le=SEED_MAX, description="jax PRNG seed (32 bits)")
    num_seeds: int = Field(1, ge=1, le=4096, description="train seeds seed .. seed+num_seeds-1 at once, in one "
                           "program (fused, or multi_learner with learners=1, on jax); metrics per seed under "
                           "RUN_DIR/seed_N/")
    seed_batching: Literal["auto", "vmap", "sequential"] = Field(
        "auto", description="how the num_seeds seeds share the program: vmap (batched; on CPU a seed's numbers then "
        "match its run alone only to float rounding), sequential (the one-seed program, one seed after another "
        "on each device: every seed bitwise its run alone); auto: sequential on CPU, where it costs about as "
        "much, vmap on accelerators")
    sweep: dict[str, list[float]] = Field(
        default_factory=dict, description="algorithm float keys and their values, trained at once in one program "
        "(fused, or multi_learner with learners=1, on jax): every combination x num_seeds, each logged under "
        "RUN_DIR/KEY=VALUE/; also written as a list value of the key itself (algorithm.lr=[1e-3,5e-4])")
    iterations_per_dispatch: int | None = Field(
        None, gt=0, description="jax backend: training iterations per jitted dispatch (null: about 16k env "
        "steps, and at least 10 dispatches a run)")
    progress: bool = Field(True, description="show progress: a bar on a terminal, else a line every ~10 s")
    tensorboard: bool = Field(True, description="write the metrics rows as TensorBoard events in RUN_DIR/tb/")
    compile_cache: bool = Field(True, description="JAX persistent compilation cache beside the run directory")
    log_every_steps: int | None = Field(
        None, gt=0, description="env steps between metrics rows, rounded to whole iterations (null: every "
        "iteration, or fewer so that a run writes at most 1000 rows)")
    checkpoint_every_steps: int = Field(100_000, ge=0, description="env steps between checkpoints, rounded to "
                                        "whole logged rows (and one at the end); 0: none")
    keep_checkpoints: int = Field(3, gt=0, description="how many of the latest checkpoints to keep")
    checkpoint_buffer: bool = Field(True, description="store the buffers' content in checkpoints")
    wandb: WandbConfig | None = Field(None, description="log to Weights & Biases too (pip install -e '.[wandb]' in "
                                      "msrl's folder)")
    stall_timeout_s: float = Field(600.0, ge=0, description="seconds a replica, a host environment's step or a "
                                   "collective may make no progress before the run stops with an error naming it; "
                                   "0: wait forever")
    imports: list[str] = Field(default_factory=list, description="your modules that register what the config names "
                               "(as --import: a .py file's path, from the working directory, or a module's name), "
                               "imported before the rest is read; a run's config.yaml lists these and --import's, so "
                               "eval, resume and msrl.load import them too")


class ExperimentConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True, allow_inf_nan=False)

    algorithm: Any
    env: EnvConfig = Field(default_factory=EnvConfig)
    policy: Any
    run: RunConfig = Field(default_factory=RunConfig)
    _envs_asked: int | None = PrivateAttr(None)  # env.num_envs as given, where the policy set another count

    def dump(self) -> dict[str, Any]:
        return {s: v.model_dump(mode="json") if isinstance(v := getattr(self, s), BaseModel) else v for s in _SECTIONS}

    def checked(self) -> ExperimentConfig:
        """This config, validated as :func:`validate_config` does where it was built by hand (``ExperimentConfig(
        algorithm={...}, ...)`` checks neither its algorithm nor its policy, nor what they need of each other)."""
        if all(isinstance(getattr(self, s), BaseModel) for s in _SECTIONS):
            return self
        return validate_config(self.dump())

    def defaults(self) -> dict[str, Any]:
        """:meth:`dump` of this config's sections (its algorithm's, its policy's) with every key at its default."""
        defaults = {s: type(getattr(self, s)).model_construct().model_dump(mode="json") for s in _SECTIONS}
        algorithm = ALGORITHMS.get(self.algorithm.name)
        defaults["env"]["id"] = getattr(algorithm, "default_env", None) or defaults["env"]["id"]
        return defaults


_SECTIONS = ("algorithm", "env", "policy", "run")
_NOT_A_MAPPING = f"a config must be a mapping with keys {', '.join(_SECTIONS)}"


def _name(key: Any) -> str:
    """A key as written in an error's dotted path (repr() where the key itself would not show)."""
    return key if isinstance(key, str) and key.strip() and "." not in key else repr(key)


def _check_keys(data: dict | list, prefix: str, inside: tuple[int, ...] = ()) -> None:
    """Every key of a section (and of the mappings in it) is a string, and nothing in it contains itself
    (YAML can write that with an anchor and an alias)."""
    inside = (*inside, id(data))
    for k, v in data.items() if isinstance(data, dict) else enumerate(data):
        path = f"{prefix}.{_name(k) if isinstance(data, dict) else k}"
        if isinstance(data, dict) and not isinstance(k, str):
            raise ConfigError(path, f"keys must be strings, got {type(k).__name__} {quote(k)}")
        if isinstance(v, (dict, list)):
            if id(v) in inside:
                raise ConfigError(path, "contains itself (a YAML alias of an enclosing anchor)")
            _check_keys(v, path, inside)


def _integral(value: Any) -> int | None:
    """A string YAML leaves as text but that writes a whole number (``1e5``, ``2.5e5``, ``100_000``)."""
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return int(number) if number.is_integer() else None  # a huge one: the key's bound names the limit


def _number_or_repr(value: Any) -> Any:
    """A value as a float where it writes a number (YAML leaves ``1e-3`` as text), else its repr."""
    try:
        return float(value) if not isinstance(value, bool) else repr(value)
    except (TypeError, ValueError, OverflowError):
        return repr(value)


def unknown_key(key: str, allowed: Any) -> str:
    """The message for an unknown ``key``: the closest allowed key if it looks like a typo, and all of them."""
    return f"unknown key; {did_you_mean(key, allowed)}allowed keys: {', '.join(allowed)}"


def _validate(model: type[BaseModel], data: Any, prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(prefix, f"must be a mapping, got {type(data).__name__} {quote(data)}")
    _no_bools_for_numbers(model, data, prefix)
    _no_unknown_nested_keys(model, data, prefix)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        whole = [(err["loc"], n) for err in e.errors() if err["type"] == "int_parsing"
                 and isinstance(err.get("input"), str) and (n := _integral(err["input"])) is not None]
        if whole:  # `1e5` where a whole number goes (in a list too): those taken, the rest judged again
            fixed = copy.deepcopy(data)
            try:
                for loc, n in whole:
                    node = fixed
                    for part in loc[:-1]:
                        node = node[part]
                    node[loc[-1]] = n
            except (KeyError, IndexError, TypeError):  # (a loc through a union's member names no place in the data)
                pass
            else:
                return _validate(model, fixed, prefix)
        err = min(e.errors(), key=lambda err: err["type"] != "extra_forbidden")  # a typo before what it misses
        key = ".".join([prefix, *(_name(p) if isinstance(p, str) else str(p) for p in err["loc"])])
        loc, field = err["loc"], None
        for i in reversed([i for i, part in enumerate(loc) if isinstance(part, str)]):  # the key's own field
            if (field := _model_at(model, loc[:i]).model_fields.get(loc[i])) is not None:
                break
        msg = err["msg"]
        if err["type"] == "model_type" and field is not None:  # ("a valid dictionary or instance of WandbConfig")
            kind = next((k for k in (field.annotation, *get_args(field.annotation))
                         if isinstance(k, type) and issubclass(k, BaseModel)), None)
            if kind is not None:
                msg = f"Input should be a mapping of its keys ({', '.join(kind.model_fields)})"
        if err["type"] == "extra_forbidden":
            msg = unknown_key(str(loc[-1]), _model_at(model, loc[:-1]).model_fields)
            if prefix in ("algorithm", "policy") and len(loc) == 1:
                msg += _owners(prefix, str(loc[0]))
        elif "input" in err and err["type"] != "missing":
            msg += f" (got {quote(err['input'])})"
            listed = field is not None and "list" in str(field.annotation).lower()  # (a key that takes a list)
            if isinstance(err["input"], list) and key == "run.seed":
                msg += "; several seeds in one program: run.num_seeds=N (seeds run.seed .. run.seed + N - 1)"
            elif isinstance(err["input"], list) and prefix != "algorithm" and not listed:
                msg += "; a list sweeps only an algorithm's float keys (one program per value otherwise)"
        if field is not None and field.description and err["type"] != "extra_forbidden":
            msg += f" — {field.description}"
        raise ConfigError(key, msg) from None


def _no_unknown_nested_keys(model: type[BaseModel], data: dict, prefix: str) -> None:
    """A ConfigError for a key its nested model does not have: a model of one's own (``optim: Optim``) ignores
    unknown keys unless it says ``extra="forbid"`` (a typo, ``optim.lrr``, would leave ``lr`` at its default)."""
    for name, value in data.items():
        field = model.model_fields.get(name) if isinstance(name, str) else None
        kind = field.annotation if field is not None else None  # a model, or a model or None (not a dict of them)
        kinds = get_args(kind) if get_origin(kind) in (Union, UnionType) else (kind,)
        nested = next((k for k in kinds if isinstance(k, type) and issubclass(k, BaseModel)), None)
        if nested is None or not isinstance(value, dict):
            continue
        if nested.model_config.get("extra") in (None, "ignore"):
            known = {*nested.model_fields, *(f.alias for f in nested.model_fields.values() if f.alias)}
            unknown = [k for k in value if k not in known]
            if unknown:
                raise ConfigError(f"{prefix}.{name}.{_name(unknown[0])}", unknown_key(str(unknown[0]),
                                                                                     nested.model_fields))
        _no_unknown_nested_keys(nested, value, f"{prefix}.{name}")


def _model_at(model: type[BaseModel], loc: tuple) -> type[BaseModel]:
    """The model a nested key's ``loc`` (from ``model``) is in: through fields of models, and dicts of them."""
    for part in loc:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None:  # (a dict's key: the model stays its values')
            continue
        candidates = [field.annotation, *get_args(field.annotation)]
        nested = [a for c in candidates for a in (c, *get_args(c)) if isinstance(a, type) and issubclass(a, BaseModel)]
        if not nested:
            return model
        model = nested[0]
    return model


def _import_run_modules(imports: Any) -> None:
    """``run.imports``: each module imported (as ``--import`` does) before the names they register are looked up."""
    if imports is None:
        return
    if not isinstance(imports, list) or not all(isinstance(m, str) for m in imports):
        raise ConfigError("run.imports", f"a list of .py files or module names, got {quote(imports)}")
    for module in imports:
        import_user_module(module, "run.imports")


def validate_config(data: dict[str, Any]) -> ExperimentConfig:
    """Validate a plain dict (as from YAML) into an :class:`ExperimentConfig`."""
    if not isinstance(data, dict):
        raise ConfigError("", _NOT_A_MAPPING)
    data = {k: v.model_dump(mode="json") if isinstance(v, BaseModel) else v for k, v in data.items()}  # (PPOConfig())
    unknown = [k for k in data if k not in _SECTIONS]
    if unknown:
        raise ConfigError(_name(unknown[0]), unknown_key(str(unknown[0]), _SECTIONS) + _section_of(unknown[0], data))
    for section in _SECTIONS:
        if data.get(section) is not None and not isinstance(data[section], dict):
            raise ConfigError(section, f"must be a mapping of keys, got {quote(data[section])} "
                              f"(write `{section}.name={quote(data[section])[1:-1]}`, or in a file `{section}: "
                              f"{{name: {quote(data[section])[1:-1]}}}`)"
                              if section in ("algorithm", "policy") and isinstance(data[section], str)
                              else f"must be a mapping of keys, got {quote(data[section])}")
        if data.get(section) is not None:
            _check_keys(data[section], section)
    _import_run_modules((data.get("run") or {}).get("imports"))
    algo = dict(data.get("algorithm") or {})
    if "name" not in algo:
        typo = next((str(k) for k in algo if did_you_mean(k, ["name"])), None)  # (`nmae: ppo`)
        hint = "unknown key; did you mean 'name'? algorithm.name is " if typo else ""
        raise ConfigError(f"algorithm.{typo or 'name'}", f"{hint}missing; available: {', '.join(ALGORITHMS.names())}")
    algo_cls = ALGORITHMS.get(algo["name"])
    from msrl.algorithm import AlgorithmConfig  # (loaded with the algorithm's class)

    if algo_cls.Config is AlgorithmConfig and set(algo) - {"name"}:
        raise ConfigError(f"algorithm.{min(set(algo) - {'name'})}", f"{algo_cls.__name__} sets no Config of its own, "
                          "so name is its only key: give it one (class ...Config(msrl.AlgorithmConfig) with name: "
                          f"Literal[{algo['name']!r}] and its keys) and set Config = that class in {algo_cls.__name__}")
    policy = dict(data.get("policy") or {"name": "fused"})
    policy.setdefault("name", "fused")
    policy_cls = POLICIES.get(policy["name"])
    run = _swept(algo_cls.Config, algo, dict(data.get("run") or {}))
    for key, values in run.get("sweep", {}).items():  # each value as the key's own value would be
        for v in values:
            _validate(algo_cls.Config, {**algo, key: v}, "algorithm")
    script = main_script()  # (`python my_algorithm.py`: its own registrations)
    imports = [*USER_MODULES, *([script] if script and script not in USER_MODULES else [])]
    run = _validate(RunConfig, {**run, "imports": imports}, "run")
    if run.seed + run.num_seeds - 1 > SEED_MAX:
        raise ConfigError("run.num_seeds", f"seeds {run.seed:,} .. {run.seed + run.num_seeds - 1:,} pass the largest "
                          f"seed, {SEED_MAX:,} (a jax PRNG key holds 32 bits): lower run.seed")
    kwargs = (data.get("env") or {}).get("kwargs")
    clash = sorted({"subprocesses", "xla"} & set(kwargs)) if isinstance(kwargs, dict) else []
    if clash:  # (they went to make_env twice: a TypeError)
        raise ConfigError(f"env.kwargs.{clash[0]}", "is a key of env itself, not of the env's maker: write "
                          f"env.{clash[0]}")
    cfg = ExperimentConfig(
        algorithm=_validate(algo_cls.Config, algo, "algorithm"),
        env=_validate(EnvConfig, {"id": getattr(algo_cls, "default_env", None) or EnvConfig.model_fields["id"].default,
                                  **(data.get("env") or {})}, "env"),
        policy=_validate(policy_cls, policy, "policy"),
        run=run,
    )
    BACKENDS.check(cfg.policy.backend)  # (a policy of one's own may allow any name: refused before compiling)
    asked, cfg.env.num_envs = cfg.env.num_envs, cfg.policy.total_envs(cfg.env.num_envs)  # envs_per_actor x actors
    again = cfg.policy.total_envs(cfg.env.num_envs)
    if again != cfg.env.num_envs:  # (the run's config.yaml holds its answer: its resume ran another count)
        raise ConfigError("policy.name", f"policy {cfg.policy.name!r}: its total_envs({asked}) gives "
                          f"{cfg.env.num_envs}, but total_envs({cfg.env.num_envs}) gives {again}; given its own "
                          "answer it must give it again (the count of environments that run, whatever env.num_envs "
                          "says)")
    if asked != cfg.env.num_envs:
        cfg._envs_asked = asked
    inert = cfg.algorithm.inert()
    for key in cfg.run.sweep:
        if key in inert:  # (a single value of it is a note: msrl train says it is ignored)
            raise ConfigError(f"algorithm.{key}", f"is swept, but it only applies with {inert[key]}: every member "
                              "would train the same; set that, or sweep another key")
    return cfg


def _owners(section: str, key: str) -> str:
    """`` (a key of policy.name single_learner_coarse)``: the algorithms or policies that have ``key``."""
    registry = ALGORITHMS if section == "algorithm" else POLICIES

    def fields(name: str) -> Any:
        try:
            found = registry.get(name)
        except Exception:  # noqa: BLE001 - a plug-in that does not load has no say in this message
            return {}
        return getattr(found, "Config", found).model_fields

    has = [n for n in registry.names() if key in fields(n)]
    return f" (a key of {section}.name {_either(has)})" if has else ""


def _either(names: list[str]) -> str:
    """``a, b or c``."""
    return f"{', '.join(names[:-1])}{' or ' if names[1:] else ''}{names[-1]}"


def _section_of(key: Any, data: dict[str, Any]) -> str:
    """`` (did you mean algorithm.lr?)`` where a top-level ``key`` is a key of one of the sections."""
    algo = data.get("algorithm")
    models = {"run": RunConfig, "env": EnvConfig}
    if isinstance(algo, dict) and isinstance(algo.get("name"), str) and algo["name"] in ALGORITHMS.names():
        models["algorithm"] = ALGORITHMS.get(algo["name"]).Config
    found = [f"{section}.{key}" for section, model in models.items() if key in model.model_fields]
    policy = data.get("policy") if isinstance(data.get("policy"), dict) else {}
    name = policy.get("name", "fused")
    if isinstance(name, str) and name in POLICIES.names() and key in POLICIES.get(name).model_fields:
        found.append(f"policy.{key}")
    elif has := [p for p in POLICIES.names() if key in POLICIES.get(p).model_fields and p != "fused"]:
        found.append(f"policy.{key}, with policy.name {_either(has)}")
    return f" (did you mean {' or '.join(found)}?)" if found else ""


def _swept(model: type[BaseModel], algo: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    """``run`` with the algorithm's list-valued float keys (``lr: [1e-3, 5e-4]``) moved into ``run.sweep``;
    ``algo`` keeps each swept key's first value. Returns ``run``; refuses keys a sweep cannot vary."""
    sweep = run.get("sweep") or {}
    if not isinstance(sweep, dict):
        raise ConfigError("run.sweep", f"must be a mapping of algorithm keys to lists of values, got {quote(sweep)}")
    sweep, listed_here = dict(sweep), set()  # (the keys whose list the algorithm section gives: named so in errors)
    for key, value in algo.items():
        field = model.model_fields.get(key)
        listed = field is not None and "list" in str(field.annotation).lower()
        if listed and isinstance(value, list) and value and all(isinstance(v, list) for v in value):
            raise ConfigError(f"algorithm.{key}", f"a list of lists ({quote(value)}) would sweep it, but one program "
                              "sweeps float keys only (a width or a count changes the program's shapes): run one "
                              "program per value")
        if isinstance(value, list) and field is not None and not listed:
            same = key in sweep and isinstance(sweep[key], list) and \
                list(map(_number_or_repr, sweep[key])) == list(map(_number_or_repr, value))
            if key in sweep and not same:  # the same list twice (a sweep's config.yaml and its list again) is one
                values = lambda v: quote(list(map(_number_or_repr, v)) if isinstance(v, list) else v)
                reordered = isinstance(sweep[key], list) and \
                    sorted(map(_number_or_repr, sweep[key]), key=repr) == sorted(map(_number_or_repr, value), key=repr)
                raise ConfigError(f"algorithm.{key}", f"is swept twice: {values(value)} here and {values(sweep[key])} "
                                  "in run.sweep (a sweep's config.yaml holds its sweep there); "
                                  + ("the same values in another order are another sweep (its members in another "
                                     "order): give them in run.sweep's order, or drop the list" if reordered
                                     else "keep one (a resumed run sweeps the values it trained: sweep others "
                                     "in a new run)"))
            sweep[key] = value
            listed_here.add(key)
    for key, values in sweep.items():
        where = f"algorithm.{key}" if key in listed_here else f"run.sweep.{key}"
        field = model.model_fields.get(key)
        if field is None:
            floats = [k for k, f in model.model_fields.items() if float_key(f.annotation)]
            raise ConfigError(f"run.sweep.{_name(key)}", f"not a key of algorithm {algo.get('name')}; "
                              f"{did_you_mean(key, floats)}its float keys: " + ", ".join(floats))
        if not float_key(field.annotation):
            kind = getattr(field.annotation, "__name__", None) or str(field.annotation).replace("typing.", "")
            raise ConfigError(f"algorithm.{key}", "one program sweeps float keys only (a count, a size or a choice "
                              f"can change the program's shapes; this key is {kind}): run one program per value")
        if not isinstance(values, list) or not values:
            raise ConfigError(where, f"must be a non-empty list of values, got {quote(values)}")
        if None in values:  # (a float or null: null is another way of working, e.g. SAC's learned temperature)
            raise ConfigError(where, f"null and a number are two programs, not one swept value: run one program per "
                              f"value, got {quote(values)}")
        if len(set(map(_number_or_repr, values))) < len(values):  # 1e-3 and 0.001 are one value
            raise ConfigError(where, f"lists a value twice: {quote(list(map(_number_or_repr, values)))}")
        algo[key] = values[0]
    return {**run, "sweep": sweep} if sweep else run


def float_key(annotation: Any) -> bool:
    """A float key, or one that is a float or null (``float | None``)."""
    return annotation is float or (set(get_args(annotation)) == {float, type(None)})


def apply_overrides(data: dict[str, Any], overrides: list[str], switch_check: bool = True) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides (values parsed as YAML scalars) to a nested dict, in place.
    ``policy.name=...`` applies first and drops the file's keys of the previous policy (its backend too:
    each policy has its own default). A key given twice takes the last value, with a note. A mapping given to a
    section sets each of its keys (:func:`spread`: the section's other keys stay, as Python's
    ``train(..., run={"seed": 3})`` keeps them)."""
    overrides = spread(overrides)
    given: dict[str, list[str]] = {}
    for item in overrides:
        given.setdefault(item.partition("=")[0].strip(), []).append(item)
    for key, items in given.items():
        if len(items) > 1 and len(set(items)) > 1:
            print(f"msrl: note: {key} is given {len(items)} times ({', '.join(items)}): the last one holds",
                  file=sys.stderr, flush=True)
    file_algorithm = dict(data["algorithm"]) if isinstance(data.get("algorithm"), dict) else None
    for item in sorted(overrides, key=lambda o: not o.startswith("policy.name=")):
        key, sep, raw = item.partition("=")
        key = key.strip()  # (' algorithm.lr=1' was "unknown key ' algorithm'; did you mean 'algorithm'")
        if not sep or not key:
            raise ConfigError(key or repr(item), "overrides are written KEY.PATH=VALUE (e.g. run.seed=1)")
        try:
            value = yaml.load(raw, Loader=_StrictLoader) if raw else ""
        except ConfigError as e:  # a key written twice, or too many values through aliases
            raise ConfigError(".".join(filter(None, [key, e.key])), e.message) from None
        except _YAML_ERRORS as e:
            if raw.lstrip()[:1] in ("{", "["):  # (a mapping or list cut short: "Input should be a valid dictionary")
                why = getattr(e, "problem", None) or str(e).splitlines()[0]
                raise ConfigError(key.strip(), f"{raw!r} is not valid YAML: {why}") from None
            value = raw
        if re.fullmatch(r"[^\s:{}\[\],]+:", raw.strip()):  # `env.id=envpool:` is that text (YAML: {envpool: null})
            value = raw.strip()
        parts = key.split(".")
        if not all(parts):
            raise ConfigError(key, "a key path has no empty parts: KEY.PATH=VALUE (e.g. run.seed=1)")
        node = data
        for i, part in enumerate(parts[:-1]):
            nxt = node.setdefault(part, {})
            if nxt is None:  # a section the file leaves off (`wandb: null`, as a run's own config.yaml writes it)
                nxt = node[part] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(".".join(parts[: i + 1]), f"is {quote(nxt)}, not a section; cannot set {key}")
            node = nxt
        if parts[0] == "policy" and parts[-1] == "name" and len(parts) == 2 and node.get("name") != value:
            # switching policy: keys that belong to the old policy would be unknown to the new one
            dropped = {k: node.pop(k) for k in [k for k in node if k != "name"]}
            again = {o.partition("=")[0].strip() for o in overrides}
            dropped = {k: v for k, v in dropped.items() if f"policy.{k}" not in again}  # (noted: those not given)
            from msrl.registry import POLICIES

            known = value in POLICIES.names()  # (an unknown one is refused next; one of run.imports', known then)
            if known:  # a value the new policy has by default is not lost (multi_learner's backend jax)
                fields = POLICIES.get(value).model_fields
                dropped = {k: v for k, v in dropped.items() if k not in fields or fields[k].default != v}
            if dropped and (known or (data.get("run") or {}).get("imports")):
                print(f"msrl: note: {item} replaces policy {quote(node.get('name'))}: its keys "
                      f"{', '.join(f'{k}={quote(v)}' for k, v in dropped.items())} are dropped (give the ones you "
                      f"want again, e.g. policy.{next(iter(dropped))}=...)", file=sys.stderr, flush=True)
        node[parts[-1]] = value
    if switch_check:  # (a resume refuses another algorithm itself, naming the run's)
        _check_switched_algorithm(file_algorithm, data.get("algorithm"), overrides)
    return data


def spread(overrides: list[str]) -> list[str]:
    """The overrides with each that gives a section a mapping (``run={seed: 3}``) as one override per key in it
    (``run.seed=3``; a key's own mapping or list is given whole: ``run.sweep={...}`` replaces the sweep)."""
    out = []
    for item in overrides:
        key, sep, raw = item.partition("=") if isinstance(item, str) else ("", "", "")
        try:
            value = yaml.load(raw, Loader=_StrictLoader) if sep and key.strip() in _SECTIONS else None
            items = [f"{key.strip()}.{k}={json.dumps(v)}" if isinstance(v, (dict, list)) else
                     dotted(f"{key.strip()}.{k}", v)[0] for k, v in value.items()] if isinstance(value, dict) else None
        except (*_YAML_ERRORS, ConfigError, TypeError, ValueError):
            items = None
        out.extend(items or [item])
    return out


def _check_switched_algorithm(before: Any, after: Any, overrides: list[str]) -> None:
    """An override of ``algorithm.name`` to another algorithm: the keys the file gives the old one must be the new
    one's too (unlike a policy's, they are not dropped: an algorithm's keys change what it computes)."""
    old, new = (d.get("name") if isinstance(d, dict) else None for d in (before, after))
    if not isinstance(old, str) or not isinstance(new, str) or old == new or new not in ALGORITHMS.names():
        return
    fields, given = ALGORITHMS.get(new).Config.model_fields, {o.partition("=")[0].strip() for o in overrides}
    stale = [k for k in after if k in before and k not in fields and f"algorithm.{k}" not in given]  # (the file's)
    if stale:
        raise ConfigError(f"algorithm.{_name(stale[0])}", f"{new} has no such key: the config gives it for {old}, "
                          f"which algorithm.name={new} replaces; drop {', '.join(map(str, stale))} from the config, "
                          f"or start from a config of {new} (`msrl config algorithm.name={new} -o {new}.yaml` "
                          "writes one)")


def _expanded(node: Any, memo: dict[int, int], open_: set[int]) -> int:
    """How many values a YAML node stands for once its aliases are expanded (stops counting past
    ``MAX_YAML_VALUES``; a node inside itself counts once: validation reports it)."""
    if id(node) in memo or id(node) in open_:
        return memo.get(id(node), 1)
    open_.add(id(node))
    children = [x for pair in node.value for x in pair] if isinstance(node, yaml.MappingNode) else \
        node.value if isinstance(node, yaml.SequenceNode) else []
    n = 1
    for child in children:
        n += _expanded(child, memo, open_)
        if n > MAX_YAML_VALUES:
            break
    open_.discard(id(node))
    memo[id(node)] = n
    return n


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, but a key written twice in one mapping (block or ``{...}``) is an error naming its
    dotted path (not "the last one wins"), and a text that expands to more than ``MAX_YAML_VALUES`` values
    through aliases is refused before anything is built, naming the key that holds the most of them. A number
    with an exponent (``1e-3``, ``2.5e5``) is a float, as in YAML 1.2 and Python (PyYAML's YAML 1.1 reads the
    string '1e-3' unless it has a point and a signed exponent: it reached an environment's keyword arguments as a
    string)."""

    def construct_document(self, node: Any) -> Any:
        memo: dict[int, int] = {}
        if _expanded(node, memo, set()) > MAX_YAML_VALUES:
            path = []
            while isinstance(node, yaml.MappingNode) and node.value:  # down to the biggest part
                key, node = max(node.value, key=lambda kv: _expanded(kv[1], memo, set()))
                path.append(_name(key.value) if isinstance(key, yaml.ScalarNode) else "?")
            raise ConfigError(".".join(path), f"holds more than {MAX_YAML_VALUES:,} values once its YAML "
                              "anchors and aliases (&name, *name) are expanded; shorten it")
        self._no_key_twice(node, [], set())
        return super().construct_document(node)

    def _no_key_twice(self, node: Any, path: list[str], done: set[int]) -> None:
        if id(node) in done:  # an alias: checked where its anchor is
            return
        done.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            for item in node.value:
                self._no_key_twice(item, path, done)
        if not isinstance(node, yaml.MappingNode):
            return
        seen: dict[Any, int] = {}
        for key_node, value in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: its keys may be overridden here
                continue
            key = self.construct_object(key_node, deep=True) if isinstance(key_node, yaml.ScalarNode) else None
            here = [*path, _name(key) if key is not None else "?"]
            line = key_node.start_mark.line + 1
            if key is not None and key in seen:
                raise ConfigError(".".join(here), "written twice in one mapping (" + (
                    f"lines {seen[key]} and {line}" if seen[key] != line else f"twice on line {line}") + "); keep one")
            if key is not None:
                seen[key] = line
            self._no_key_twice(value, here, done)


_EXPONENT = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$")
_StrictLoader.add_implicit_resolver("tag:yaml.org,2002:float", _EXPONENT, list("-+0123456789."))


class _Dumper(yaml.SafeDumper):
    """PyYAML's safe dumper, knowing the numbers :class:`_StrictLoader` reads: a string like ``1e3`` is quoted (it
    was written bare, and a run's own config.yaml did not load back)."""


_Dumper.add_implicit_resolver("tag:yaml.org,2002:float", _EXPONENT, list("-+0123456789."))


def dump_yaml(value: Any, **options: Any) -> str:
    """``value`` as YAML that :func:`read_config` reads back as ``value`` (``yaml.safe_dump``'s options)."""
    return yaml.dump(value, Dumper=_Dumper, **options)


def _no_bools_for_numbers(model: type[BaseModel], data: dict, prefix: str) -> None:
    """``true``/``false`` where a number goes is an error (pydantic would read them as 1 and 0)."""
    for key, value in data.items():
        field = model.model_fields.get(key) if isinstance(key, str) else None
        if isinstance(value, bool) and field is not None and "bool" not in str(field.annotation) \
                and any(t in str(field.annotation) for t in ("int", "float")):
            raise ConfigError(f"{prefix}.{key}", f"must be a number, got {str(value).lower()}")


def load_config(path: str | Path | dict | None, overrides: list[str] = ()) -> ExperimentConfig:
    """A config from a YAML file (or a dict of its sections) with ``KEY.PATH=VALUE`` overrides applied."""
    data = read_config(path, overrides)
    try:
        return validate_config(data)
    except ConfigError as e:
        raise in_file(e, path, overrides) from None


def in_file(error: ConfigError, path: Any, overrides: list[str] = ()) -> ConfigError:
    """``error`` naming the file and line where its key is written (``y/my.yaml:3: ...``), unless the key is not
    the file's: an override sets it (or a key inside it), or the file does not write it; and naming one of the
    error's ``also`` keys instead of its own where an override sets that one and not its own."""
    given = [o.partition("=")[0].strip() for o in override_list(overrides)]

    def set_by_override(key: str) -> bool:
        return any(k == key or k.startswith(key + ".") or key.startswith(k + ".") for k in given)

    if error.key and not set_by_override(error.key):  # (the env.id given beside the YAML's algorithm.name)
        other = next((k for k in error.also if set_by_override(k)), None)
        if other is not None:
            return ConfigError(other, error.message, (error.key,))
    if not error.key or not isinstance(path, (str, os.PathLike)) or error.message.startswith(f"{path}:") or \
            re.match(r"\S+:\d+: ", error.message) or set_by_override(error.key):  # (a place of its own: user code)
        return error
    try:
        node = yaml.compose(Path(path).expanduser().read_text(), Loader=yaml.SafeLoader)
    except (yaml.YAMLError, OSError, ValueError):
        return error
    line = None
    for part in error.key.split("."):
        if isinstance(node, yaml.SequenceNode) and part.isdigit():  # (an item of a list: the list's line)
            break
        written = [(k, v) for k, v in (node.value if isinstance(node, yaml.MappingNode) else ())
                   if isinstance(k, yaml.ScalarNode) and k.value == part]
        if not written:
            return error
        line, node = written[-1][0].start_mark.line + 1, written[-1][1]
    return ConfigError(error.key, f"{path}:{line}: {error.message}")


def dotted(prefix: str, value: Any) -> list[str]:
    """``run={"seed": 1}`` as overrides: ``["run.seed=1"]`` (nested mappings become dotted paths; an empty one,
    a pydantic section and numpy values are given as they are; a string that YAML reads otherwise is quoted)."""
    if isinstance(value, BaseModel):  # (a whole section: PPOConfig(lr=...))
        value = value.model_dump(mode="json")
    if isinstance(value, dict) and value:
        return [o for k, v in value.items() for o in dotted(f"{prefix}.{k}", v)]
    if isinstance(value, str):
        try:
            same = yaml.load(value, Loader=_StrictLoader) == value  # ("lr sweep #2": a comment; "null": None)
        except (*_YAML_ERRORS, ConfigError):
            same = False
        return [f"{prefix}={value if same else json.dumps(value)}"]
    try:  # (np.float32(1e-3), np.arange(3): their Python values)
        return [f"{prefix}={json.dumps(value, default=lambda x: x.tolist() if hasattr(x, 'tolist') else quote(x))}"]
    except (TypeError, ValueError) as e:
        raise ConfigError(prefix, f"a config value is a number, string, list or mapping; got {quote(value)}: "
                          f"{e}") from None


def override_list(overrides: Any) -> list[str]:
    """``overrides`` as a list (one string is refused: it was read letter by letter)."""
    if isinstance(overrides, str):
        raise ConfigError("overrides", f"a list of KEY.PATH=VALUE strings, got one string: write [{overrides!r}]")
    if isinstance(overrides, dict):
        written = [o for k, v in overrides.items() for o in dotted(str(k), v)]
        raise ConfigError("overrides", f"a list of KEY.PATH=VALUE strings, got a dict: write {written!r}")
    if overrides is None:
        return []
    try:
        items = list(overrides)
    except TypeError:
        items = [overrides]
    wrong = [o for o in items if not isinstance(o, str)]
    if wrong:
        raise ConfigError("overrides", f"a list of KEY.PATH=VALUE strings, got {quote(wrong[0])}")
    return items


def read_config(path: str | Path | dict | None, overrides: list[str] = (),
                switch_check: bool = True) -> dict[str, Any]:
    """What :func:`load_config` validates: the file's (or dict's) sections with the overrides applied."""
    overrides = override_list(overrides)
    data: dict[str, Any] = {}
    if isinstance(path, dict):
        import copy

        data = copy.deepcopy(path)
    elif not isinstance(path, (str, os.PathLike, type(None))):
        raise ConfigError("", f"a config is a YAML file's path or a dict of its sections, got {type(path).__name__} "
                              f"{quote(path)}")
    elif path is not None:
        p = Path(path).expanduser()
        if not p.is_file():
            raise ConfigError("", f"config file {str(p)!r} " + ("is a directory" if p.is_dir() else "does not exist")
                              + (f" (a run's: its config is {p / 'config.yaml'})" if (p / "config.yaml").is_file()
                                 else ""))
        try:
            with open(p, encoding="utf-8") as f:  # (a syntax error's marks name the file)
                data = yaml.load(f, Loader=_StrictLoader)
        except ConfigError as e:
            raise ConfigError(e.key, f"{p}: {e.message}") from None
        except _YAML_ERRORS as e:
            raise ConfigError("", f"{p}: not valid YAML: {e}") from None
        if data is None and not any(o.partition("=")[0].strip() in ("algorithm.name", "algorithm")
                                    for o in overrides):  # an empty file, and nothing names an algorithm
            raise ConfigError("algorithm.name", f"missing: {p} is empty; available: {', '.join(ALGORITHMS.names())}")
        data = {} if data is None else data
        if not isinstance(data, dict):
            raise ConfigError("", f"{p}: {_NOT_A_MAPPING}, got {type(data).__name__} {quote(data)}")
    data = apply_overrides(data, overrides, switch_check)
    sweep = data.get("run", {}).get("sweep") if isinstance(data.get("run"), dict) else None
    for key in {o.partition("=")[0] for o in overrides if o.startswith("algorithm.")} & \
            {f"algorithm.{k}" for k in sweep or ()}:  # one value given for a swept key (a file's own yields)
        value, values = data["algorithm"][key.split(".", 1)[1]], sweep[key.split(".", 1)[1]]
        if not isinstance(value, list) and isinstance(values, list) and values and \
                _number_or_repr(value) != _number_or_repr(values[0]):  # (a sweep's config.yaml: its first value)
            raise ConfigError(key, f"{quote(value)} is given, but run.sweep sweeps it over {quote(values)}: drop one")
    return data


def _bounds(field: Any) -> str:
    """A field's choices and bounds as a note (``one of: a, b``, ``>0``); bounds that only keep a count in int32
    or a seed in 32 bits are left out."""
    choices = [a for t in (field.annotation, *get_args(field.annotation)) if getattr(t, "__origin__", None) is Literal
               for a in get_args(t)]
    signs = {"gt": ">", "ge": "≥", "lt": "<", "le": "≤", "min_length": "length≥"}  # (no space: not wrapped apart)
    bounds = [f"{sign}{getattr(m, attr)}" for m in field.metadata for attr, sign in signs.items()
              if hasattr(m, attr) and getattr(m, attr) not in (INT32_MAX, SEED_MAX, 2**63 - 1)]
    return "; ".join(([f"one of: {', '.join(map(str, choices))}"] if len(choices) > 1 else []) + bounds)


def _flow(value: Any) -> str:
    """``value`` as one line of YAML."""
    return dump_yaml(value, default_flow_style=True, width=float("inf"), allow_unicode=True).removesuffix(
        "\n...\n").strip()


def commented(cfg: ExperimentConfig, width: int = 100) -> str:
    """``cfg`` as YAML (what ``msrl config`` prints; it loads back as ``cfg``), every key under a comment that
    says what it means, its choices or bounds, its default where it holds another value, and what gives it effect
    where it has none."""
    import textwrap

    names = {"algorithm.name": ALGORITHMS.names(), "policy.name": POLICIES.names()}
    extra = {f"{section}.{key}": f"no effect unless {needs}" for section in ("algorithm", "policy")
             for key, needs in getattr(cfg, section).inert().items()}
    extra |= {f"algorithm.{k}": "swept: run.sweep holds its values" for k in cfg.run.sweep}
    set_by_policy = {"env.num_envs"} if cfg._envs_asked is not None else set()  # (no default to compare it with)
    extra |= dict.fromkeys(set_by_policy, f"set by {cfg.policy.name}: its replicas x envs per replica")
    defaults, lines = cfg.defaults(), []

    def walk(model: BaseModel, data: dict, default: dict, prefix: str, indent: str) -> None:
        for name, field in type(model).model_fields.items():
            key, value = f"{prefix}.{name}", data[name]
            notes = [_bounds(field)] + ([f"one of: {', '.join(names[key])}"] if key in names else [])
            if default is not None and name in default and default[name] != value and \
                    "default:" not in (field.description or "") and key not in set_by_policy:
                notes.append(f"default: {_flow(default[name])}")
            notes = "; ".join(n for n in [*notes, extra.get(key)] if n)
            text = " ".join(filter(None, (field.description, notes and f"({notes})")))
            if text:
                lines.extend(textwrap.wrap(text, width, initial_indent=f"{indent}# ", subsequent_indent=f"{indent}# "))
            nested = getattr(model, name)
            if isinstance(nested, BaseModel):
                lines.append(f"{indent}{name}:")
                walk(nested, value, None, key, indent + "  ")
            else:
                lines.append(f"{indent}{name}: {_flow(value)}")

    dump = cfg.dump()
    for section in _SECTIONS:
        model = getattr(cfg, section)
        lines.append(f"{section}:" + (f"  # {model.name}'s keys" if section in ("algorithm", "policy") else ""))
        walk(model, dump[section], defaults[section], section, "  ")
    return "\n".join(lines) + "\n"
