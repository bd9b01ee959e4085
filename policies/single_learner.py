"""Single-learner policies: many actors (or env workers) feeding one learner.

- ``single_learner_coarse`` (Acme, synchronous IMPALA, MSRL DP-SLC): cut at ``agent_learn``. ``actors``
  replicas each run env + act + insert on ``envs_per_actor`` environments; their trajectories are gathered
  (concatenated in global environment order) to one learner, whose new parameters are broadcast back.
  With ``sync: false`` the actors do not wait for them: they collect the next batch with the parameters
  of one update before while the learner trains on the last (IMPALA's asynchronous actors, pipelined
  deterministically: every batch is exactly one update behind).
- ``single_learner_fine`` (SEED RL): cut at ``env_step``. ``actors`` env-only workers step their
  environments; inference and learning run centrally, batched over every worker's observations; actions
  are scattered and observations/rewards/dones gathered every step.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

import msrl


class _SingleLearner(msrl.DistributedPolicy):
    backend: Literal["threads", "ray", "jax"] = Field("threads", description="where the roles run: threads of this "
                                                      "process, Ray actors, or jitted programs on JAX devices")
    actors: int = Field(2, gt=0, le=msrl.INT32_MAX, description="actor (or env worker) replicas")
    envs_per_actor: int | None = Field(None, gt=0, le=msrl.INT32_MAX,
                                       description="environments per replica (default: env.num_envs / actors)")
    actor_backend: Literal["threads", "ray", "jax"] | None = Field(
        None, description="the actor role's (fine: env_worker's) placement: null, policy.backend; jax, one jitted "
        "program between its comms")
    learner_backend: Literal["threads", "ray", "jax"] | None = Field(
        None, description="the learner role's (fine: central's) placement: null, policy.backend; jax, one jitted "
        "program between its comms")

    def total_envs(self, num_envs: int) -> int:
        return self.shard_envs(num_envs, "actors", "envs_per_actor")

    actor_devices: list[Annotated[int, Field(ge=0)]] | None = Field(
        None, min_length=1, description="backend jax: the JAX devices the actor replicas take in turn (default: all)")
    learner_devices: list[Annotated[int, Field(ge=0)]] | None = Field(
        None, min_length=1, description="backend jax: the learner's JAX device, a list of one (default: device 0)")

    def _roles(self, actor_role: str, learner_role: str) -> list[msrl.FragmentSpec]:
        if self.backend != "jax" and (self.actor_devices or self.learner_devices):
            raise msrl.ConfigError("policy.actor_devices" if self.actor_devices else "policy.learner_devices",
                                   f"places roles on JAX devices, which only policy.backend=jax does (not "
                                   f"{self.backend!r})")
        if self.learner_devices and len(self.learner_devices) > 1:
            raise msrl.ConfigError("policy.learner_devices", f"{self.learner_devices}: the one learner takes one device; "
                                   "list one (learners on several devices: policy.name=multi_learner)")
        if self.actor_devices and len(self.actor_devices) > self.actors:
            raise msrl.ConfigError("policy.actor_devices", f"{self.actor_devices}: {self.actors} actor replicas take "
                                   f"one device each, so devices {self.actor_devices[self.actors:]} would stay idle; "
                                   "list at most policy.actors devices")
        return self.check_roles([self.role(actor_role, self.actors, "actor_backend", self.actor_devices),
                                 self.role(learner_role, 1, "learner_backend", self.learner_devices)])


class SingleLearnerCoarse(_SingleLearner):
    """``actors`` replicas run the acting side of the loop (environments, actor, rollouts) on their share of
    the environments; one learner learns on what they send and broadcasts its parameters back."""

    name: Literal["single_learner_coarse"] = "single_learner_coarse"
    sync: bool = Field(True, description="false: actors collect the next batch with the parameters of one "
                       "update before while the learner trains (policy lag 1, recorded as policy_lag)")

    def link(self, var: str, src: msrl.FragmentSpec, dst: msrl.FragmentSpec) -> msrl.Link:
        if var == "@params":
            return msrl.Link(axis="replicated", lag=0 if self.sync else 1)
        return msrl.Link()

    def fragments(self) -> list[msrl.FragmentSpec]:
        return self._roles("actor", "learner")

    def assign(self, loop: msrl.Loop) -> dict[str, str]:
        learner = loop.downstream_of(loop.calls("agent_learn"))
        return loop.roles(lambda s: "learner" if s.id in learner else "actor")


class SingleLearnerFine(_SingleLearner):
    """``actors`` replicas only step the environments; one learner runs the rest of the loop (acting,
    buffers, learning), exchanging actions and observations with them every step."""

    name: Literal["single_learner_fine"] = "single_learner_fine"
    backend: Literal["threads", "ray", "jax"] = Field("threads", description="threads of this process or Ray actors "
                                                      "(jax is refused: fine communicates every env step)")

    def fragments(self) -> list[msrl.FragmentSpec]:
        return self._roles("env_worker", "central")

    def assign(self, loop: msrl.Loop) -> dict[str, str]:
        envs = loop.component_calls("env")
        return loop.roles(lambda s: "env_worker" if s.id in envs else "central")
