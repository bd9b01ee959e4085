"""``replay_server`` (Ape-X, MSRL's replay-server placement): ``actors`` replicas step their environments
and act; their transitions go to ``shards`` replay-buffer replicas (actor ``i`` feeds shard
``i // (actors / shards)``); one learner samples a batch from every shard each update (``batch / shards``
from each, interleaved row by row), learns, and sends each shard the new priorities of its part. Actors pull the
learner's parameters every ``param_sync_every`` iterations.

The loop is cut around the buffer: its calls (insert, sample, update) run on the shards, ``agent_learn``
and what follows from the sample on the learner, the rest on the actors. Every replica steps the same
iterations, so the ratio of samples to inserts is the loop's own (``updates * batch_size`` per
``rollout_len * num_envs``) and an actor runs at most ``param_sync_every`` iterations ahead of the
learner: a fast actor cannot drown it, and a run is reproducible for a seed.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

import msrl


class ReplayServer(msrl.DistributedPolicy):
    """Ape-X: ``actors`` replicas step their environments and fill a replay buffer split into ``shards``;
    the learner samples each shard's part of every batch and sends the priorities back."""

    name: Literal["replay_server"] = "replay_server"
    backend: Literal["threads", "ray"] = Field("threads", description="where the roles run: threads of this process, "
                                               "or Ray actors")
    actors: int = Field(2, gt=0, le=4096, description="actor replicas (env + act)")
    shards: int = Field(2, gt=0, le=4096, description="replay-buffer replicas (default 2; 1 where policy.actors is "
                        "odd); actors must be a multiple (1 gives fused's numbers; several draw the batch shard by "
                        "shard: different by design)")
    envs_per_actor: int | None = Field(None, gt=0, le=msrl.INT32_MAX,
                                       description="environments per actor (default: env.num_envs / actors)")
    param_sync_every: int = Field(1, gt=0, le=msrl.INT32_MAX,
                                  description="iterations between the actors' parameter pulls")

    @model_validator(mode="after")
    def _one_shard_for_odd_actors(self) -> ReplayServer:
        if "shards" not in self.model_fields_set and self.actors % 2:  # (2 cannot take them evenly)
            self.shards = 1
        return self

    def total_envs(self, num_envs: int) -> int:
        return self.shard_envs(num_envs, "actors", "envs_per_actor")

    def fragments(self) -> list[msrl.FragmentSpec]:
        if self.actors % self.shards:
            raise msrl.ConfigError("policy.shards", f"{self.shards} shards cannot take the transitions of "
                                   f"policy.actors={self.actors} actors evenly; use a divisor of {self.actors}")
        return self.check_roles([self.role("actor", self.actors, "backend"),
                                 self.role("replay", self.shards, "backend"),
                                 self.role("learner", 1, "backend")])

    def assign(self, loop: msrl.Loop) -> dict[str, str]:
        if not loop.calls("buffer_sample"):
            raise msrl.ConfigError("policy.name", "replay_server shards a replay buffer that the learner samples "
                                   "(msrl.buffer_sample), but this loop never samples one; for on-policy loops "
                                   "(buffer_get) use single_learner_coarse")
        buffer = loop.component_calls("buffer")
        learner = loop.downstream_of(loop.calls("agent_learn", "buffer_sample")) - buffer
        return loop.roles(lambda s: "replay" if s.id in buffer else "learner" if s.id in learner else "actor")

    def link(self, var: str, src: msrl.FragmentSpec, dst: msrl.FragmentSpec) -> msrl.Link:
        """Transitions are gathered to the shards along their environments; samples are gathered to the
        learner and priorities scattered back along their batch axis; parameters are pulled every
        ``param_sync_every`` iterations; anything else the actors hand the learner is per-environment."""
        if var == "@params":
            return msrl.Link(axis="replicated", every=self.param_sync_every)
        if {src.name, dst.name} == {"learner", "replay"}:
            return msrl.Link(op="scatter" if src.name == "learner" else "gather", axis="batch")
        return msrl.Link(op="gather") if dst.name in ("replay", "learner") else msrl.Link()
