"""The base class of an algorithm: a config model, components, and a training loop written with msrl.api."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

from msrl.components import Actor, EnvSpec, Learner, ReplayBuffer


class AlgorithmConfig(BaseModel):
    """Base of every algorithm's config. Unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    name: str

    def inert(self) -> dict[str, str]:
        """Keys that change nothing under this config's other values, each with the setting that gives it effect
        (a run notes those given a value other than their default)."""
        return {}


@dataclasses.dataclass(frozen=True)
class Context:
    """What an algorithm is told when it is built."""

    env_spec: EnvSpec
    num_envs: int  # total environments over all replicas
    total_env_steps: int
    updates_per_iteration: int = 1  # parameter updates per iteration (per agent_learn) over all replicas: 1 where
    # they average their gradients (multi_learner: one all-reduced update), one per worker under async
    learner_replicas: int = 1  # learners that each learn on an equal share of the envs (multi_learner, async)

    def per_run(self, env_steps: int, times: int = 1) -> int:
        """How often something done every ``env_steps`` env steps (an iteration, say), ``times`` each, happens in
        the run (at least ``times``): the length of a schedule over the run. It must fit the int32 counter JAX
        steps a schedule with (a ConfigError on ``run.total_env_steps`` otherwise)."""
        from msrl.config import INT32_MAX
        from msrl.errors import ConfigError

        count = max(1, self.total_env_steps // env_steps) * times
        if count > INT32_MAX:
            raise ConfigError("run.total_env_steps", f"{self.total_env_steps:,} env steps make {count:,} steps of a "
                              f"schedule (every {env_steps:,} env steps, {times} each), more than an int32 counter "
                              f"holds ({INT32_MAX:,}): fewer env steps per run")
        return count

    def check_learning_starts(self, learning_starts: int, buffer: Any, rollout_len: int,
                              batch_size: int | None = None, window_of: str = "") -> None:
        """A ConfigError if an off-policy warm-up of ``learning_starts`` transitions would never end: more than
        one learner's replay ``buffer`` can offer a sample (its whole steps of the learner's environments, less a
        sampled window's last steps; ``window_of``: the keys that set its length), or than it offers after the
        run's whole iterations of ``rollout_len`` steps; or if a sample of ``batch_size`` is more than the buffer
        holds (each would repeat transitions)."""
        from msrl.errors import ConfigError

        width, window = self.learner_envs, getattr(buffer, "window", 1)
        rows = buffer.capacity // width
        offered = lambda steps: max(min(steps, rows) - (window - 1), 0) * width  # as the buffer's size counts them
        per = f" per learner ({self.learner_replicas} learners)" if self.learner_replicas > 1 else ""
        less = f", less the last {window - 1} of a window of {window}{f' ({window_of})' if window_of else ''}" \
            if window > 1 else ""
        if learning_starts > offered(rows):
            raise ConfigError("algorithm.learning_starts", f"{learning_starts:,} is more than the {offered(rows):,} "
                              f"transitions buffer_size {buffer.capacity:,} offers a sample{per} ({rows:,} whole steps "
                              f"of {width:,} envs{less}): learning would never start")
        iterations = self.total_env_steps // (self.num_envs * rollout_len)
        if learning_starts > offered(iterations * rollout_len):
            raise ConfigError("algorithm.learning_starts", f"{learning_starts:,} is more than the "
                              f"{offered(iterations * rollout_len):,} transitions the run collects{per} in its "
                              f"{iterations:,} whole iteration{'s' * (iterations != 1)} ({iterations * rollout_len:,} "
                              f"step{'s' * (iterations * rollout_len != 1)} of {width:,} "
                              f"envs{less}; run.total_env_steps={self.total_env_steps:,}): learning would never start")
        if batch_size is not None and batch_size > buffer.capacity:
            raise ConfigError("algorithm.batch_size", f"{batch_size:,} is more than the {buffer.capacity:,} "
                              "transitions algorithm.buffer_size holds: every sample would repeat transitions (are the "
                              "two swapped?)")

    @property
    def learner_envs(self) -> int:
        """The environments one learner replica sees the steps of (its share of ``num_envs``)."""
        return self.num_envs // self.learner_replicas


class Algorithm:
    """Subclass, set ``Config``, build ``self.actor`` / ``self.learner`` / ``self.buffer`` in ``__init__``,
    and write ``train_step(self)`` with the interaction API. ``train_step`` returns the iteration's metrics
    (a dict of scalars is logged as is)."""

    Config: ClassVar[type[AlgorithmConfig]] = AlgorithmConfig
    default_env: ClassVar[str | None] = None  # env.id where a config names none (None: gymnax:CartPole-v1)
    actor: Actor | None = None
    learner: Learner | None = None
    buffer: ReplayBuffer | None = None

    def __init__(self, cfg: Any, ctx: Context):
        self.cfg, self.ctx = cfg, ctx

    def train_step(self) -> Any:
        raise NotImplementedError
