"""Write your own distribution policy: three roles, with inference and learning on separate replicas.

`inference_server`: `env_workers` replicas only step their environments; one `inference` replica acts for
all of them at once and fills the buffer; one `learner` replica learns on its own. Per step, actions are
scattered to the workers and observations gathered; per iteration, the rollout goes to the learner and its
parameters are broadcast back to inference. (The built-ins put acting with the envs, or with the learner.)

A policy is a pydantic model (its `policy:` config keys) with `fragments()`: the roles, their replica
counts and placement, and `assign(loop)`: the role of every statement of the loop. The base class's
`link()` says what crosses each cut edge: parameters are broadcast; anything else is per-environment, and
its op (gather / scatter / send) follows from the replica counts. The compiler checks every cut value keeps
its meaning. Select it
in any config; this file is the `msrl` command with the policy registered:

    python examples/custom_policy.py train examples/ppo_cartpole.yaml policy.name=inference_server
    python examples/custom_policy.py graph examples/ppo_cartpole.yaml policy.name=inference_server
"""

import sys
from typing import Literal

from pydantic import Field

import msrl


@msrl.register_policy("inference_server")  # `policy.name: inference_server` in a config selects it
class InferenceServer(msrl.DistributedPolicy):  # DistributedPolicy: per-role resources, the `ray` keys
    name: Literal["inference_server"] = "inference_server"
    backend: Literal["threads", "ray"] = "threads"
    env_workers: int = Field(2, gt=0, description="replicas that step environments (env.num_envs split evenly)")
    envs_per_worker: int | None = Field(None, gt=0, description="environments per worker (default: shared evenly)")

    def total_envs(self, num_envs: int) -> int:  # checked with the config: a count the workers cannot share is refused
        return self.shard_envs(num_envs, "env_workers", "envs_per_worker")

    def fragments(self) -> list[msrl.FragmentSpec]:
        return self.check_roles([self.role("env", self.env_workers, "backend"),
                                 self.role("inference", 1, "backend"), self.role("learner", 1, "backend")])

    def assign(self, loop: msrl.Loop) -> dict[str, str]:
        learner = loop.downstream_of(loop.calls("agent_learn"))  # agent_learn and what is computed from it
        envs = loop.component_calls("env")
        return loop.roles(lambda s: "learner" if s.id in learner else "env" if s.id in envs else "inference")


if __name__ == "__main__":
    from msrl.cli import main

    sys.exit(main(sys.argv[1:]))
