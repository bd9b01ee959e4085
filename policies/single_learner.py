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

from typing import Any, Literal

from pydantic import Field

from msrl.compiler.ir import leaves
from msrl.config import INT32_MAX
from msrl.policy import DistributedPolicy, FragmentSpec, downstream_of


class _SingleLearner(DistributedPolicy):
    backend: Literal["threads", "ray"] = "threads"
    actors: int = Field(2, gt=0, le=INT32_MAX, description="actor (or env worker) replicas")
    envs_per_actor: int | None = Field(None, gt=0, le=INT32_MAX,
                                       description="environments per replica (default: env.num_envs / actors)")
    actor_backend: Literal["threads", "ray", "jax"] | None = Field(None, description="placement of the actor role")
    learner_backend: Literal["threads", "ray", "jax"] | None = Field(None, description="placement of the learner role")

    def total_envs(self, num_envs: int) -> int:
        return self.shard_envs(num_envs, "actors", "envs_per_actor")

    def _roles(self, actor_role: str, learner_role: str) -> list[FragmentSpec]:
        return self.check_roles([self.role(actor_role, self.actors, "actor_backend"),
                                 self.role(learner_role, 1, "learner_backend")])


class SingleLearnerCoarse(_SingleLearner):
    name: Literal["single_learner_coarse"] = "single_learner_coarse"
    sync: bool = Field(True, description="false: actors collect the next batch with the parameters of one "
                       "update before while the learner trains (policy lag 1, recorded as policy_lag)")

    def comm_lag(self, var: str, src: FragmentSpec, dst: FragmentSpec) -> int:
        return 0 if self.sync or var != "@params" else 1

    def fragments(self) -> list[FragmentSpec]:
        return self._roles("actor", "learner")

    def assign(self, stmts, fdg: Any) -> dict[str, str]:
        learn = {s.id for s in leaves(stmts) if s.kind == "api" and s.api.name == "agent_learn"}
        learner = downstream_of(fdg, learn)
        return {s.id: "learner" if s.id in learner else "actor" for s in leaves(stmts)}


class SingleLearnerFine(_SingleLearner):
    name: Literal["single_learner_fine"] = "single_learner_fine"

    def fragments(self) -> list[FragmentSpec]:
        return self._roles("env_worker", "central")

    def assign(self, stmts, fdg: Any) -> dict[str, str]:
        return {s.id: "env_worker" if s.kind == "api" and s.api.component == "env" else "central"
                for s in leaves(stmts)}
