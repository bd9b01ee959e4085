"""Functional replay buffers. The on-policy trajectory buffer; uniform and prioritized ones come later."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from msrl.components import ReplayBuffer


@struct.dataclass
class TrajectoryState:
    data: Any  # pytree of [capacity, *item_shape]
    count: jax.Array  # items inserted since the last get


class TrajectoryBuffer(ReplayBuffer):
    """On-policy rollout storage: ``capacity`` time steps of items batched over environments.

    ``get`` returns the whole ``[capacity, num_envs, ...]`` rollout and empties the buffer.
    """

    def __init__(self, capacity: int, item_spec: Any = None):
        if capacity < 1:
            raise ValueError(f"TrajectoryBuffer capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.item_spec = item_spec

    def init(self, key: jax.Array, item_spec: Any) -> TrajectoryState:
        data = jax.tree.map(lambda s: jnp.zeros((self.capacity, *s.shape), s.dtype), item_spec)
        return TrajectoryState(data, jnp.zeros((), jnp.int32))

    def insert(self, state: TrajectoryState, item: Any) -> TrajectoryState:
        index = state.count % self.capacity
        data = jax.tree.map(lambda d, x: jax.lax.dynamic_update_index_in_dim(d, x, index, 0), state.data, item)
        return TrajectoryState(data, state.count + 1)

    def insert_batch(self, state: TrajectoryState, items: Any) -> TrajectoryState:
        n = jax.tree.leaves(items)[0].shape[0]
        if n > self.capacity:  # as inserting one by one: only the last `capacity` items remain
            skip = n - self.capacity
            items = jax.tree.map(lambda x: x[skip:], items)
            return self.insert_batch(TrajectoryState(state.data, state.count + skip), items)
        index = (state.count + jnp.arange(n)) % self.capacity
        data = jax.tree.map(lambda d, x: d.at[index].set(x), state.data, items)
        return TrajectoryState(data, state.count + n)

    def get(self, state: TrajectoryState):
        return state.replace(count=jnp.zeros((), jnp.int32)), state.data
