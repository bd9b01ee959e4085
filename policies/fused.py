"""``fused``: the whole loop (env + act + insert + learn) as one jitted program, ``num_envs`` vmapped.

Anakin / PureJaxRL style: nothing is cut, nothing is communicated.
"""

from __future__ import annotations

from typing import Literal

from msrl.compiler.ir import leaves
from msrl.policy import FragmentSpec, Policy


class Fused(Policy):
    name: Literal["fused"] = "fused"
    backend: Literal["jax"] = "jax"

    def fragments(self) -> list[FragmentSpec]:
        return [FragmentSpec(name="main", replicas=1, backend=self.backend, jit=True)]

    def assign(self, stmts, fdg) -> dict[str, str]:
        return {s.id: "main" for s in leaves(stmts)}
