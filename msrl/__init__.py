"""msrl: write an RL algorithm once as a training loop; run it under any distribution policy.

Import cost matters for the CLI, so heavy pieces (the compiler, the training driver) load on first use.
"""

import os as _os

# XLA's CPU compiler runs a while loop whose buffers total under 1 KB as one compiled call, and a larger one as a
# loop of separately dispatched thunks (~80 per threefry draw). jax.random's threefry is such a loop: with keys for
# 16 envs it is over the limit, and a rollout step pays for three of them. 16 KB keeps the key draws of up to ~128
# envs one call each (fused PPO, measured A/B: +6-13 % steps per second on Acrobot and 16-env CartPole, Pendulum
# mixed), far below the learner's loops. The same operations run, only dispatched as one call; it counts only if
# set before JAX starts its backend, and a user's own ``xla_backend_extra_options`` in XLA_FLAGS is left as it is.
XLA_CPU_FLAG = "--xla_backend_extra_options=xla_cpu_small_while_loop_byte_threshold=16384"
if "xla_backend_extra_options" not in _os.environ.get("XLA_FLAGS", ""):
    _os.environ["XLA_FLAGS"] = f"{_os.environ.get('XLA_FLAGS', '')} {XLA_CPU_FLAG}".strip()

from msrl.algorithm import Algorithm, AlgorithmConfig, Context
from msrl.api import (
    agent_act,
    agent_learn,
    buffer_get,
    buffer_insert,
    buffer_sample,
    buffer_update,
    env_observe,
    env_reset,
    env_starts,
    env_step,
)
from msrl.backend import Backend, Runtime
from msrl.components import (ActOutput, Actor, Box, Discrete, Environment, EnvSpec, EnvStep, Learner, MultiAgentObs,
                             MultiAgentSpec, ReplayBuffer, Wrapper, per_env_keys, split_keys)
from msrl.config import INT32_MAX
from msrl.errors import CompileError, ConfigError, Interrupted, MsrlError, TrainingError
from msrl.plan import CommSpec, FragmentSpec, LearnerPlan, Link, Loop, Plan
from msrl.policy import DistributedPolicy, Policy
from msrl.registry import register_algorithm, register_backend, register_policy
from msrl.replay import PrioritizedBuffer, Sample, TrajectoryBuffer, UniformBuffer
from msrl.services import PARAMETERS, Service

__version__ = "0.1.0"


def compile(algorithm, policy, env, num_envs):  # noqa: A001 - mirrors the paper's msrl.compile
    """Compile ``algorithm.train_step`` under ``policy`` for ``num_envs`` environments of ``env``; returns a
    :class:`msrl.compiler.Program` (run it with ``msrl.Session(program=...)``). It takes built objects: an
    algorithm (``PPO(cfg, msrl.Context(...))``, built for ``num_envs``), a policy (``msrl.load_config(...).policy``)
    and an environment (``msrl.envs.make_env(id)`` or your own); ``msrl.build(config)`` does all of it from a config."""
    from msrl.compiler import compile as _compile

    return _compile(algorithm, policy, env, num_envs)


def __getattr__(name):
    if name in ("train", "build", "TrainResult"):
        from msrl import runner

        return getattr(runner, name)
    if name == "load_config":
        from msrl.config import load_config

        return load_config
    if name == "component_keys":
        from msrl.compiler import component_keys

        return component_keys
    if name == "all_reduce_mean":
        from msrl.backend import all_reduce_mean

        return all_reduce_mean
    if name in ("load", "TrainedPolicy"):
        from msrl import evaluate

        return getattr(evaluate, name)
    if name in ("validate_config", "ExperimentConfig"):
        from msrl import config

        return getattr(config, name)
    if name == "register_env":
        from msrl.envs import register_env

        return register_env
    if name == "in_tiles":
        from msrl.envs.gymnax_env import in_tiles

        return in_tiles
    if name in ("Session", "session"):
        from msrl.runtime import session

        return getattr(session, name)
    if name in ("rl", "envs", "replay"):  # submodules a user's code names (msrl.rl.Dense) after `import msrl`
        import importlib

        return importlib.import_module(f"msrl.{name}")
    from msrl.errors import did_you_mean

    near = "" if name.startswith("_") else did_you_mean(name, __all__).strip()  # (msrl.per_env_key: a typo)
    raise AttributeError(f"module 'msrl' has no attribute {name!r}" + (f"; {near}" if near else ""), name=name)


__all__ = [
    "INT32_MAX", "Interrupted", "PARAMETERS", "Service", "ActOutput", "Actor", "Algorithm", "AlgorithmConfig", "Backend", "Box", "EnvStep", "CompileError", "ConfigError", "Context",
    "CommSpec", "Discrete", "DistributedPolicy", "LearnerPlan", "Link", "Loop", "Plan", "all_reduce_mean", "component_keys", "EnvSpec", "Environment", "FragmentSpec", "Learner", "MsrlError",
    "MultiAgentObs", "MultiAgentSpec", "Policy", "PrioritizedBuffer", "ReplayBuffer",
    "Runtime", "Sample", "Session", "TrainingError", "TrajectoryBuffer", "UniformBuffer", "agent_act", "agent_learn", "buffer_get",
    "buffer_insert", "buffer_sample", "buffer_update", "compile", "env_observe", "env_reset", "env_starts", "env_step",
    "register_algorithm", "register_backend",
    "register_policy", "session", "load", "TrainedPolicy", "validate_config", "ExperimentConfig", "register_env",
    "in_tiles", "per_env_keys", "split_keys",
    "train", "build", "load_config", "XLA_CPU_FLAG", "Wrapper", "TrainResult",
]


def __dir__():  # the names loaded on first use too (tab completion, dir(msrl))
    return sorted({*globals(), *__all__, "rl", "envs", "replay"})
