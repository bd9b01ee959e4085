"""``multi_learner`` (DD-PPO, MSRL DP-ML): ``learners`` full replicas of the loop (env + act + learn), each
on its own shard of the environments; every gradient step all-reduces (averages) the gradients over the
replicas before the optimizer, so every replica holds the same parameters after every step.

The algorithm does not change: the policy adds the all-reduce to the learner's optax chain. On the jax
backend the replicas are one jitted program over the devices (``shard_map``; ``vmap`` on each device); on
ray each replica is a JAX process and the all-reduce runs over them (``jax.distributed``, CPU collectives).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

import msrl


class MultiLearner(msrl.DistributedPolicy):
    """``learners`` replicas each run the whole loop on their share of the environments and average their
    gradients every update (an all-reduce): with one learner, ``fused``'s numbers."""

    name: Literal["multi_learner"] = "multi_learner"
    backend: Literal["jax", "ray"] = Field("jax", description="jax: the learners on the JAX devices of this process; "
                                           "ray: as Ray actors")
    learners: int = Field(2, gt=0, le=4096, description="replicas, each acting and learning on its own envs")
    envs_per_learner: int | None = Field(None, gt=0, le=msrl.INT32_MAX,
                                         description="environments per learner (default: env.num_envs / learners)")

    def total_envs(self, num_envs: int) -> int:
        return self.shard_envs(num_envs, "learners", "envs_per_learner")

    def fragments(self) -> list[msrl.FragmentSpec]:
        return self.check_roles([self.role("learner", self.learners, "backend")])

    def assign(self, loop: msrl.Loop) -> dict[str, str]:
        return loop.roles(lambda s: "learner")

    def learner_plan(self) -> msrl.LearnerPlan:
        return msrl.LearnerPlan(grad_transforms=(msrl.all_reduce_mean(),), learner_replicas=self.learners)
