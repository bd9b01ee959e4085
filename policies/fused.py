"""``fused``: the whole loop (env + act + insert + learn) as one jitted program, ``num_envs`` vmapped.

Anakin / PureJaxRL style: nothing is cut, nothing is communicated.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

import msrl


class Fused(msrl.Policy):
    """The whole loop as one jitted program (``lax.scan`` over its steps): the reference every other
    policy is compared with."""

    name: Literal["fused"] = "fused"
    backend: Literal["jax"] = Field("jax", description="the whole loop as one jitted program")

    def fragments(self) -> list[msrl.FragmentSpec]:
        return [msrl.FragmentSpec(name="main", replicas=1, backend=self.backend, jit=True)]

    def assign(self, loop: msrl.Loop) -> dict[str, str]:
        return loop.roles(lambda s: "main")
