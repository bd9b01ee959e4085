"""Functional replay buffers: on-policy trajectory storage, uniform and prioritized experience replay.

All three store **time-major rows**: an item passed to ``buffer_insert`` is batched over environments
(every leaf ``[width, ...]``, ``width`` = the environments of the inserting replica) and becomes one row of
``data`` (leaves ``[rows, width, ...]``), written round-robin. :class:`UniformBuffer` and
:class:`PrioritizedBuffer` sample *entries*: one environment's item at one time step, numbered
``row * width + env``. With ``sequence_length=k`` an entry is the window of that environment's ``k``
consecutive items starting there (leaves ``[batch, k, ...]``), which is how n-step returns are read
(DQN: ``k = n + 1``, the observation ``n`` steps later is the bootstrap state); an entry can be sampled
once its whole window is stored and until its first row is overwritten.

Every method is pure and jittable: inside a fused program or called from host code (``jax.jit`` them,
donating the state, to update in place).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from msrl.backend import rowwise
from msrl.components import ReplayBuffer


def _rows_of(items: Any) -> int:
    return jax.tree.leaves(items)[0].shape[0]


def _check_items(data: Any, items: Any) -> None:
    """Items stacked on a leading axis are rows of ``data``: the same structure, row shapes and dtypes (a smaller
    row would be written into a corner of one, another dtype cast), else a ValueError naming the leaf."""
    if jax.tree.structure(data) != jax.tree.structure(items):
        raise ValueError(f"buffer_insert: the item is built unlike the buffer's items ({jax.tree.structure(items)}; "
                         f"the buffer holds {jax.tree.structure(data)}, as its first inserted item or item_spec)")
    for (path, d), x in zip(jax.tree_util.tree_leaves_with_path(data), jax.tree.leaves(items)):
        if (x.shape[1:], x.dtype) != (d.shape[1:], d.dtype):
            raise ValueError(f"buffer_insert: the item's {jax.tree_util.keystr(path) or 'leaf'} is {x.dtype}"
                             f"{list(x.shape[1:])}; the buffer holds {d.dtype}{list(d.shape[1:])} there (as its "
                             "first inserted item or item_spec)")


def _ring_write(data: Any, start: jax.Array, items: Any, rows: int) -> Any:
    """Write ``items`` (stacked on a leading axis of at most ``rows``) at rows ``start, start+1, ...`` mod ``rows``."""
    _check_items(data, items)
    if _rows_of(items) == 1:  # in place, also under vmap
        return jax.tree.map(lambda d, x: put_row(d, x[0], start % rows), data, items)
    index = (start + jnp.arange(_rows_of(items))) % rows
    return jax.tree.map(lambda d, x: d.at[index].set(x), data, items)


def _scatter_rows(data: jax.Array, items: jax.Array, index: jax.Array) -> jax.Array:
    """``data[r, index[r]] = items[r]`` for every ``r`` (``data`` [R, T, ...]) as one scatter."""
    return data.at[jnp.arange(data.shape[0]), index].set(items.astype(data.dtype))


def _write_rows(data: jax.Array, items: jax.Array, index: jax.Array) -> jax.Array:
    """:func:`_scatter_rows`, in place. On CPU, where XLA runs a scatter as a loop over the whole array: one write
    when the indices agree (seeds in step), else one per row. On an accelerator, where a condition costs a round
    trip to the host at every step, the scatter."""
    at = (0,) * (data.ndim - 2)

    def together():
        return jax.lax.dynamic_update_slice(data, items[:, None].astype(data.dtype), (0, index[0], *at))

    def each(r, d):
        return jax.lax.dynamic_update_slice(d, items[r][None, None].astype(d.dtype), (r, index[r], *at))

    if data.shape[0] == 1:
        return together()
    return jax.lax.platform_dependent(data, items, index, default=_scatter_rows, cpu=lambda *_: jax.lax.cond(
        (index == index[0]).all(), together, lambda: jax.lax.fori_loop(0, data.shape[0], each, data)))


_put_rows = rowwise(_write_rows)


def put_row(data: jax.Array, item: jax.Array, index: jax.Array) -> jax.Array:
    """``data`` with ``item`` written at row ``index`` (``data[index] = item``), in place, also under ``vmap``
    (several seeds in one program), where the plain write is a scatter over the whole batched buffer."""
    return _put_rows(data[None], item[None], jnp.reshape(index, (1,)))[0]


def shard_part(buffer: Any, batch_size: Any) -> int:
    """One shard's part of a sample of ``batch_size`` from ``buffer``, split by a policy over ``buffer.shards``."""
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"{type(buffer).__name__}.sample needs a positive int batch_size, got {batch_size!r}")
    if batch_size % buffer.shards:
        raise ValueError(f"a sample of {batch_size} cannot be drawn evenly from {buffer.shards} replay shards "
                         f"(policy.shards); make the batch size a multiple of {buffer.shards}")
    return batch_size // buffer.shards


# ------------------------------------------------------------------------------------------ trajectory
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
        return self.insert_batch(state, jax.tree.map(lambda x: x[None], item))

    def insert_batch(self, state: TrajectoryState, items: Any) -> TrajectoryState:
        n = _rows_of(items)
        if n > self.capacity:  # as inserting one by one: only the last `capacity` items remain
            skip = n - self.capacity
            items = jax.tree.map(lambda x: x[skip:], items)
            return self.insert_batch(TrajectoryState(state.data, state.count + skip), items)
        return TrajectoryState(_ring_write(state.data, state.count, items, self.capacity), state.count + n)

    def get(self, state: TrajectoryState):
        return state.replace(count=jnp.zeros((), jnp.int32)), state.data


# ------------------------------------------------------------------------------------------ replay
class Sample(NamedTuple):
    """What ``sample`` returns: everything a learner needs, prioritized replay included."""

    item: Any  # the sampled entries: leaves [batch, ...], or [batch, sequence_length, ...]
    indices: jax.Array  # [batch] int32 entry numbers, to hand back to buffer_update with new priorities
    weights: jax.Array  # [batch] importance weights, unnormalized (uniform: ones; zeros while nothing can be sampled)
    size: jax.Array  # how many entries could be sampled (int32)


@struct.dataclass
class ReplayState:
    data: Any  # pytree of [rows, width, *item_shape]
    count: jax.Array  # rows inserted so far (int32)
    key: jax.Array  # for sampling


class UniformBuffer(ReplayBuffer):
    """Circular experience replay with uniform sampling (with replacement).

    ``capacity`` counts entries (transitions): it holds ``capacity // width`` rows of ``width``
    environments' items, the oldest overwritten first. ``update`` is a no-op, so a loop written for
    prioritized replay runs unchanged with uniform replay.

    ``shards`` (set by the distribution policy: ``replay_server``) is how many replicas hold the buffer,
    each fed by its own environments: each holds ``capacity / shards`` entries and draws ``batch_size /
    shards`` of a sample; ``size`` counts the entries of all of them.
    """

    shards = 1

    def __init__(self, capacity: int, sequence_length: int | None = None, item_spec: Any = None):
        if capacity < 1:
            raise ValueError(f"{type(self).__name__} capacity must be >= 1, got {capacity}")
        if sequence_length is not None and sequence_length < 1:
            raise ValueError(f"{type(self).__name__} sequence_length must be >= 1 or None, got {sequence_length}")
        self.capacity, self.sequence_length, self.item_spec = capacity, sequence_length, item_spec
        self.window = sequence_length or 1

    # ---- layout
    def layout(self, item_spec: Any) -> tuple[int, int]:
        """``(rows, width)`` of the storage for items of ``item_spec``."""
        widths = {s.shape[0] if len(s.shape) else None for s in jax.tree.leaves(item_spec)}
        if len(widths) != 1 or None in widths:
            raise ValueError(f"replay items must be batched over environments (one leading axis of the same size "
                             f"on every leaf); got leading sizes {sorted(widths, key=str)}")
        (width,) = widths
        rows = self.capacity // self.shards // width
        if rows < self.window + 1:
            raise ValueError(f"{type(self).__name__} capacity {self.capacity} holds {rows} rows of {width} "
                             f"environments; it needs at least {self.window + 1} (sequence_length + 1)")
        return rows, width

    def _shape(self, state: ReplayState) -> tuple[int, int]:
        return jax.tree.leaves(state.data)[0].shape[:2]

    def size(self, state: ReplayState) -> jax.Array:
        """How many entries can be sampled (in all shards: every shard holds as many)."""
        return self._local_size(state) * self.shards

    def _local_size(self, state: ReplayState) -> jax.Array:
        """Every stored row whose window is complete, times the width."""
        rows, width = self._shape(state)
        return jnp.maximum(jnp.minimum(state.count, rows) - (self.window - 1), 0) * width

    # ---- component methods
    def init(self, key: jax.Array, item_spec: Any) -> ReplayState:
        rows, _ = self.layout(item_spec)
        data = jax.tree.map(lambda s: jnp.zeros((rows, *s.shape), s.dtype), item_spec)
        return ReplayState(data, jnp.zeros((), jnp.int32), key)

    def insert(self, state: ReplayState, item: Any) -> ReplayState:
        return self.insert_batch(state, jax.tree.map(lambda x: x[None], item))

    def insert_batch(self, state: ReplayState, items: Any) -> ReplayState:
        rows, _ = self._shape(state)
        n = _rows_of(items)
        if n + self.window - 1 > rows:
            raise ValueError(f"inserting {n} rows at once into {type(self).__name__} of {rows} rows: insert at most "
                             f"{rows - self.window + 1} rows per call, or give it more capacity")
        return state.replace(data=_ring_write(state.data, state.count % rows, items, rows), count=state.count + n)

    def sample(self, state: ReplayState, batch_size: int | None = None) -> tuple[ReplayState, Sample]:
        rows, width = self._shape(state)
        key, use = jax.random.split(state.key)
        local = self._local_size(state)
        oldest = jnp.where(state.count > rows, state.count % rows, 0)
        entry = jax.random.randint(use, (shard_part(self, batch_size),), 0, jnp.maximum(local, 1))
        indices = ((oldest + entry // width) % rows) * width + entry % width
        weights = jnp.where(local > 0, jnp.ones(indices.shape), 0.0)
        return state.replace(key=key), Sample(self.gather(state, indices), indices, weights, self.size(state))

    def update(self, state: ReplayState, indices: jax.Array, priorities: jax.Array) -> ReplayState:
        return state

    # ---- helpers
    def sampleable(self, state: ReplayState, indices: jax.Array) -> jax.Array:
        """Whether the entries ``indices`` can be sampled: stored, and their window complete."""
        rows, width = self._shape(state)
        age = (state.count - 1 - indices // width) % rows  # rows written after the entry's
        return (age >= self.window - 1) & (age < jnp.minimum(state.count, rows))

    def gather(self, state: ReplayState, indices: jax.Array) -> Any:
        """The entries ``indices`` (their windows, with ``sequence_length``)."""
        rows, width = self._shape(state)
        row, env = indices // width, indices % width
        if self.sequence_length is None:
            return jax.tree.map(lambda d: d[row, env], state.data)
        window = (row[:, None] + jnp.arange(self.sequence_length)) % rows
        return jax.tree.map(lambda d: d[window, env[:, None]], state.data)


# ------------------------------------------------------------------------------------------ sum tree
# A wide sum tree: a tuple of levels, leaves first; every node of one level is the sum of FANOUT consecutive
# nodes of the level below (levels are padded with zeros to a multiple of FANOUT), up to a top level of at
# most FANOUT nodes. Wide nodes keep the tree shallow (1M leaves: 4 levels), so a walk or an update is a few
# vectorized gathers instead of 20 dependent ones. Every update rewrites its leaves and then recomputes each
# affected node from its children, so the sums stay exactly the float32 sums of the leaves however many
# updates run (no accumulated deltas).
FANOUT = 32


def _tree_init(leaves: int) -> tuple[jax.Array, ...]:
    sizes = [-(-leaves // FANOUT) * FANOUT]
    while sizes[-1] > FANOUT:
        sizes.append(-(-sizes[-1] // FANOUT ** 2) * FANOUT)
    return tuple(jnp.zeros((n,), jnp.float32) for n in sizes)


def _tree_fix(tree: tuple[jax.Array, ...], first: jax.Array, span: int, wraps: bool = False) -> tuple:
    """Recompute, level by level, the ancestors of the leaves ``first + arange(span)`` (for every element of
    ``first``); with ``wraps``, also those of leaves ``0 .. span-1`` (the part of a run that wrapped around)."""
    tree = list(tree)
    starts = [first] + ([jnp.zeros_like(first)] if wraps else [])
    for j in range(1, len(tree)):
        starts, span = [s // FANOUT for s in starts], -(-(span - 1) // FANOUT) + 1  # parents of a run of `span`
        below = tree[j - 1].reshape(-1, FANOUT)  # the rest of level j is padding: always 0
        if span >= below.shape[0]:
            tree[j] = tree[j].at[: below.shape[0]].set(below.sum(-1))
            continue
        for s in starts:
            p = jnp.clip(s[..., None] + jnp.arange(span), 0, below.shape[0] - 1).ravel()
            tree[j] = tree[j].at[p].set(below[p].sum(-1))
    return tuple(tree)


def _pick(children: jax.Array, values: jax.Array) -> tuple[jax.Array, jax.Array]:
    """For each row of ``children`` [B, n], the child whose prefix-sum interval holds ``values`` [B], and the
    value's offset into it. Never a zero child of a positive row: a value is kept below the row's sum (it
    may reach it by float rounding), and a zero child's interval is empty."""
    cum = jax.lax.associative_scan(jnp.add, children, axis=-1)  # much faster than jnp.cumsum on CPU
    values = jnp.minimum(values, jnp.nextafter(cum[:, -1], 0.0))
    child = jnp.sum(cum <= values[:, None], axis=-1)
    below = jnp.take_along_axis(cum - children, child[:, None], axis=-1)[:, 0]
    return child, values - below


def _tree_find(tree: tuple[jax.Array, ...], values: jax.Array) -> jax.Array:
    """The leaf whose prefix-sum interval holds each value, walking down from the top level."""
    node, values = _pick(jnp.broadcast_to(tree[-1], (values.shape[0], tree[-1].shape[0])), values)
    for level in reversed(tree[:-1]):
        child, values = _pick(level.reshape(-1, FANOUT)[node], values)
        node = node * FANOUT + child
    return node


@struct.dataclass
class PrioritizedState(ReplayState):
    tree: tuple[jax.Array, ...]  # sum tree (levels, leaves first) of priority**alpha per entry; 0: not sampleable
    max_priority: jax.Array  # the largest priority seen; new entries get it
    samples: jax.Array  # sample calls so far (int32), for annealing beta


class PrioritizedBuffer(UniformBuffer):
    """Prioritized experience replay (Schaul et al. 2016), proportional variant, on a jittable sum tree.

    An entry is drawn with probability ``P(i) = p_i**alpha / sum_k p_k**alpha`` (stratified: one draw per
    equal slice of the total), ``p_i = priority + eps``; new entries get the largest priority seen so far.
    Importance weights are ``(size * P(i))**-beta`` (divide them by the largest of the batch the learner
    sees: with a sharded buffer that is several shards' samples together); ``beta`` goes linearly
    from ``beta`` to ``beta_final`` over ``beta_steps`` sample calls (0: constant). ``update(state,
    indices, priorities)`` sets the priorities of sampled entries (ignored for entries that can no longer
    be sampled; an entry overwritten since it was sampled takes the update as its own). A priority that is
    NaN, infinite or below ``-eps`` makes every later sample's weights NaN (a run's NaN guard stops there).
    """

    def __init__(self, capacity: int, alpha: float = 0.6, beta: float = 0.4, beta_final: float = 1.0,
                 beta_steps: int = 0, eps: float = 1e-6, sequence_length: int | None = None, item_spec: Any = None):
        super().__init__(capacity, sequence_length, item_spec)
        if alpha < 0 or beta < 0 or beta_final < 0 or beta_steps < 0 or eps <= 0:
            raise ValueError(f"PrioritizedBuffer needs alpha, beta, beta_final, beta_steps >= 0 and eps > 0; got "
                             f"alpha={alpha}, beta={beta}, beta_final={beta_final}, beta_steps={beta_steps}, eps={eps}")
        self.alpha, self.beta, self.beta_final, self.beta_steps, self.eps = alpha, beta, beta_final, beta_steps, eps

    def _scaled(self, priority: jax.Array) -> jax.Array:
        return (priority.astype(jnp.float32) + self.eps) ** self.alpha

    def beta_at(self, samples: jax.Array) -> jax.Array:
        """The importance-sampling exponent after ``samples`` sample calls."""
        if self.beta_steps == 0:
            return jnp.float32(self.beta)
        return self.beta + jnp.minimum(samples / self.beta_steps, 1.0) * (self.beta_final - self.beta)

    def total(self, state: PrioritizedState) -> jax.Array:
        """The sum of ``p**alpha`` over the sampleable entries."""
        return state.tree[-1].sum()

    def priorities(self, state: PrioritizedState, indices: jax.Array) -> jax.Array:
        """``p**alpha`` of the entries ``indices`` (0 for those that cannot be sampled)."""
        return state.tree[0][indices]

    def init(self, key: jax.Array, item_spec: Any) -> PrioritizedState:
        base = super().init(key, item_spec)
        rows, width = self.layout(item_spec)
        return PrioritizedState(base.data, base.count, base.key, _tree_init(rows * width),
                                jnp.ones((), jnp.float32), jnp.zeros((), jnp.int32))

    def insert_batch(self, state: PrioritizedState, items: Any) -> PrioritizedState:
        rows, width = self._shape(state)
        n, lag = _rows_of(items), self.window - 1
        new = super().insert_batch(state, items)
        # rows count-lag .. count+n-1-lag complete their windows: sampleable, at the largest priority; the
        # last `lag` rows written start windows not yet complete (and the rows they overwrite leave): zero
        row = state.count - lag + jnp.arange(n + lag)
        value = jnp.where((jnp.arange(n + lag) < n) & (row >= 0), self._scaled(state.max_priority), 0.0)
        start = (row[0] % rows) * width
        leaf = (start + jnp.arange((n + lag) * width)) % (rows * width)
        tree = (state.tree[0].at[leaf].set(jnp.repeat(value, width)), *state.tree[1:])
        return new.replace(tree=_tree_fix(tree, start, (n + lag) * width, wraps=True))

    def sample(self, state: PrioritizedState, batch_size: int | None = None) -> tuple[PrioritizedState, Sample]:
        batch = shard_part(self, batch_size)
        key, use = jax.random.split(state.key)
        total = self.total(state)
        values = (jnp.arange(batch) + jax.random.uniform(use, (batch,))) * (total / batch)  # stratified
        indices = _tree_find(state.tree, values)
        # the chance of drawing an entry, relative to uniform over all shards' entries: with every shard
        # as full as the others and batch / shards drawn from each, that is local size * P(i) in its shard
        probs = self.priorities(state, indices) / jnp.where(total > 0, total, 1.0)
        relative = jnp.maximum(self._local_size(state), 1) * jnp.where(total > 0, probs, 1.0)
        weights = jnp.where(total > 0, relative ** -self.beta_at(state.samples), jnp.where(total == 0, 0.0, jnp.nan))
        # (a non-finite total, from a bad priority: NaN weights, which the run's NaN guard stops at, not zeros)
        state = state.replace(key=key, samples=state.samples + 1)
        return state, Sample(self.gather(state, indices), indices, weights, self.size(state))

    def update(self, state: PrioritizedState, indices: jax.Array, priorities: jax.Array) -> PrioritizedState:
        live = self.sampleable(state, indices)  # (not read from the leaves: that would copy them, not update)
        # NaN, infinite, or below -eps: made NaN, so that the weights are too (learning stopped without a word)
        bad = ~(jnp.isfinite(priorities) & (priorities + self.eps >= 0))
        scaled = jnp.where(bad, jnp.nan, self._scaled(priorities))
        leaves = state.tree[0].at[indices].set(jnp.where(live, scaled, 0.0))
        top = jnp.max(jnp.where(live, jnp.where(bad, jnp.nan, priorities), 0.0))
        return state.replace(tree=_tree_fix((leaves, *state.tree[1:]), indices, 1),
                             max_priority=jnp.maximum(state.max_priority, top))
