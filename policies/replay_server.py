"""``replay_server`` (Ape-X, MSRL's replay-server placement): ``actors`` replicas step their environments
and act; their transitions go to ``shards`` replay-buffer replicas (actor ``i`` feeds shard
``i // (actors / shards)``); one learner samples a batch from every shard each update (``batch / shards``
from each, concatenated), learns, and sends each shard the new priorities of its part. Actors pull the
learner's parameters every ``param_sync_every`` iterations.

The loop is cut around the buffer: its calls (insert, sample, update) run on the shards, ``agent_learn``
and what follows from the sample on the learner, the rest on the actors. Every replica steps the same
iterations, so the ratio of samples to inserts is the loop's own (``updates * batch_size`` per
``rollout_len * num_envs``) and an actor runs at most ``param_sync_every`` iterations ahead of the
learner: a fast actor cannot drown it, and a run is reproducible for a seed.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from msrl.compiler.ir import leaves
from msrl.config import INT32_MAX
from msrl.errors import ConfigError
from msrl.policy import DistributedPolicy, FragmentSpec, downstream_of


class ReplayServer(DistributedPolicy):
    name: Literal["replay_server"] = "replay_server"
    backend: Literal["threads", "ray"] = "threads"
    actors: int = Field(2, gt=0, le=4096, description="actor replicas (env + act)")
    shards: int = Field(2, gt=0, le=4096, description="replay-buffer replicas; actors must be a multiple")
    envs_per_actor: int | None = Field(None, gt=0, le=INT32_MAX,
                                       description="environments per actor (default: env.num_envs / actors)")
    param_sync_every: int = Field(1, gt=0, le=INT32_MAX,
                                  description="iterations between the actors' parameter pulls")

    def total_envs(self, num_envs: int) -> int:
        return self.shard_envs(num_envs, "actors", "envs_per_actor")

    def fragments(self) -> list[FragmentSpec]:
        if self.actors % self.shards:
            raise ConfigError("policy.shards", f"{self.shards} shards cannot take the transitions of "
                              f"policy.actors={self.actors} actors evenly; use a divisor of {self.actors}")
        return self.check_roles([self.role("actor", self.actors, "backend"),
                                 self.role("replay", self.shards, "backend"),
                                 self.role("learner", 1, "backend")])

    def buffer_shards(self) -> int:
        return self.shards

    def assign(self, stmts, fdg: Any) -> dict[str, str]:
        api = {s.id: s.api for s in leaves(stmts) if s.kind == "api"}
        if not any(a.name == "buffer_sample" for a in api.values()):
            raise ConfigError("policy.name", "replay_server shards a replay buffer that the learner samples "
                              "(msrl.buffer_sample), but this loop never samples one; for on-policy loops "
                              "(buffer_get) use single_learner_coarse")
        buffer = {sid for sid, a in api.items() if a.component == "buffer"}
        sampled = {sid for sid, a in api.items() if a.name in ("agent_learn", "buffer_sample")}
        learner = downstream_of(fdg, sampled) - buffer
        return {s.id: "replay" if s.id in buffer else "learner" if s.id in learner else "actor"
                for s in leaves(stmts)}

    def comm_op(self, var: str, src: FragmentSpec, dst: FragmentSpec) -> str:
        if var == "@params":
            return "broadcast"
        return "scatter" if src.name == "learner" else "gather"

    def comm_axis(self, var: str, src: FragmentSpec, dst: FragmentSpec) -> str:
        """Samples and priorities are split and joined along their batch axis, transitions along envs."""
        return "batch" if "learner" in (src.name, dst.name) and var != "@params" else "env"

    def comm_every(self, var: str, src: FragmentSpec, dst: FragmentSpec) -> int:
        return self.param_sync_every if var == "@params" else 1
