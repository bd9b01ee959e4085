"""Replay buffers: FIFO overwrite, windows, prioritized sampling and importance weights, priority updates,
exact sum-tree sums after many updates, jit with donation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import msrl
from msrl.replay import PrioritizedBuffer, UniformBuffer

KEY = jax.random.PRNGKey(0)  # never donated: states get a fresh copy (buf.init(key()))
_JIT = {}


def key():
    return jnp.array(KEY, copy=True)


def spec(width: int):
    return {"t": jax.ShapeDtypeStruct((width,), jnp.int32), "obs": jax.ShapeDtypeStruct((width, 2), jnp.float32)}


def row(t: int, width: int):
    """Row t: env e holds 100 * t + e."""
    v = 100 * t + jnp.arange(width, dtype=jnp.int32)
    return {"t": v, "obs": jnp.stack([v, -v], -1).astype(jnp.float32)}


def fill(buf, width: int, rows: int, state=None):
    """Insert rows one by one (jitted: eager calls of a few dozen small ops each are slow)."""
    insert = _JIT.setdefault((id(buf), "insert"), jax.jit(lambda s, t: buf.insert(s, row(t, width))))
    state = buf.init(key(), spec(width)) if state is None else state
    for t in range(int(state.count), int(state.count) + rows):
        state = insert(state, t)
    return state


def draw(buf, state, batch: int):
    """``buf.sample(state, batch)``, jitted."""
    return _JIT.setdefault((id(buf), "sample", batch), jax.jit(lambda s: buf.sample(s, batch)))(state)


def update(buf, state, indices, priorities):
    """``buf.update(state, indices, priorities)``, jitted."""
    return _JIT.setdefault((id(buf), "update"), jax.jit(buf.update))(state, indices, priorities)


@pytest.mark.parametrize("cls", [UniformBuffer, PrioritizedBuffer])
def test_fifo_overwrite_keeps_the_newest_rows(cls):
    buf = cls(capacity=8)  # 4 rows of 2 envs
    state = fill(buf, 2, 6)
    assert sorted(np.asarray(state.data["t"][:, 0]) // 100) == [2, 3, 4, 5]
    assert int(buf.size(state)) == 8
    _, sample = draw(buf, state, 512)
    seen = set(np.asarray(sample.item["t"]).tolist())
    assert seen == {200, 201, 300, 301, 400, 401, 500, 501}
    np.testing.assert_array_equal(sample.item["obs"][:, 0], sample.item["t"])
    assert (np.asarray(sample.weights) == 1).all()  # uniform priorities: equal weights


@pytest.mark.parametrize("cls", [UniformBuffer, PrioritizedBuffer])
def test_windows_are_consecutive_steps_of_one_env_and_never_cross_the_write_point(cls):
    buf = cls(capacity=15, sequence_length=3)  # 5 rows of 3 envs
    state = buf.init(key(), spec(3))
    _, empty = draw(buf, state, 4)
    assert int(empty.size) == 0 and (np.asarray(empty.weights) == 0).all()
    for t in range(12):
        state = fill(buf, 3, 1, state)
        state, sample = draw(buf, state, 256)
        stored = min(t + 1, 5)
        assert int(sample.size) == 3 * max(stored - 2, 0)
        if int(sample.size) == 0:
            continue
        w = np.asarray(sample.item["t"])  # [batch, 3]
        assert (np.diff(w, axis=1) == 100).all()  # the same env, consecutive steps
        assert w.min() // 100 >= t + 1 - stored and w.max() // 100 <= t  # only stored rows
        np.testing.assert_array_equal(np.asarray(sample.indices) % 3, w[:, 0] % 100)
        if cls is PrioritizedBuffer:
            assert len(set((w[:, 0] // 100).tolist())) == stored - 2  # every complete window is drawn


def test_insert_batch_equals_one_by_one_through_wrap_around():
    for buf in (UniformBuffer(capacity=14, sequence_length=3), PrioritizedBuffer(capacity=14, sequence_length=3)):
        one = fill(buf, 2, 9)  # 7 rows: wraps
        batched = buf.init(key(), spec(2))
        for chunk in ([0, 1, 2], [3, 4, 5, 6], [7, 8]):
            batched = jax.jit(buf.insert_batch)(batched, jax.tree.map(lambda *x: jnp.stack(x), *[row(t, 2) for t in chunk]))
        for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(batched), strict=True):
            np.testing.assert_array_equal(a, b)
        with pytest.raises(ValueError, match="at most 5 rows"):
            buf.insert_batch(batched, jax.tree.map(lambda *x: jnp.stack(x), *[row(t, 2) for t in range(6)]))


def test_prioritized_sampling_is_proportional_to_priority_alpha():
    buf = PrioritizedBuffer(capacity=8, alpha=0.5)
    state = fill(buf, 1, 8)
    prio = jnp.array([1.0, 4.0, 9.0, 0.0, 16.0, 25.0, 1.0, 0.0])  # ** 0.5 -> 1 2 3 0 4 5 1 0
    state = update(buf, state, jnp.arange(8), prio)
    sample_1000 = jax.jit(lambda s: buf.sample(s, 1000), donate_argnums=0)
    counts = np.zeros(8)
    for _ in range(40):
        state, sample = sample_1000(state)
        counts += np.bincount(np.asarray(sample.indices), minlength=8)
    expected = np.sqrt(np.asarray(prio) + 1e-6)
    expected /= expected.sum()
    np.testing.assert_allclose(counts / counts.sum(), expected, atol=0.01)


def test_importance_weights_and_beta_annealing():
    buf = PrioritizedBuffer(capacity=4, alpha=1.0, beta=0.5, beta_final=1.0, beta_steps=2, eps=1e-9)
    state = update(buf, fill(buf, 1, 4), jnp.arange(4), jnp.array([1.0, 2.0, 3.0, 4.0]))
    for beta in (0.5, 0.75, 1.0, 1.0):
        state, sample = draw(buf, state, 64)
        p = (np.asarray(sample.indices) + 1) / 10.0  # P(i) = p_i / sum p
        w = (4 * p) ** -beta
        np.testing.assert_allclose(sample.weights, w, rtol=1e-5)  # a learner divides them by their max


def test_update_sets_priorities_max_for_new_entries_and_ignores_unsampleable_ones():
    buf = PrioritizedBuffer(capacity=12, alpha=1.0, sequence_length=2, eps=1e-9)  # 6 rows of 2 envs
    state = fill(buf, 2, 3)  # rows 0, 1 complete; row 2 not yet
    np.testing.assert_allclose(buf.priorities(state, jnp.arange(6)), [1, 1, 1, 1, 0, 0])
    state = update(buf, state, jnp.array([0, 3, 4, 11]), jnp.array([5.0, 0.5, 7.0, 9.0]))
    np.testing.assert_allclose(buf.priorities(state, jnp.arange(6)), [5, 1, 1, 0.5, 0, 0], rtol=1e-6)
    assert float(state.max_priority) == 5.0  # 7 and 9 went to entries that cannot be sampled
    state = fill(buf, 2, 1, state)  # row 2 completes: it gets the largest priority seen
    np.testing.assert_allclose(buf.priorities(state, jnp.arange(6)), [5, 1, 1, 0.5, 5, 5], rtol=1e-6)
    assert float(buf.total(state)) == pytest.approx(17.5)


@pytest.mark.parametrize("bad", [float("nan"), -1.0, float("inf")])
def test_a_bad_priority_makes_the_sample_weights_nan(bad):
    """(One NaN or negative priority made the tree's total NaN: every later sample drew entry 0 with weight 0, so a
    DQN's loss was 0.0 for the rest of the run, without a word; the NaN guard stops at NaN weights.)"""
    buf = PrioritizedBuffer(capacity=12, alpha=0.6)
    state = fill(buf, 2, 4)
    state, before = draw(buf, state, 4)
    assert np.all(np.isfinite(before.weights)) and np.all(before.weights > 0)
    state = update(buf, state, jnp.array([0, 1]), jnp.array([2.0, bad]))
    _, after = draw(buf, state, 4)
    assert np.all(np.isnan(after.weights))


def test_sum_tree_stays_exact_over_a_million_updates():
    buf = PrioritizedBuffer(capacity=5000, alpha=0.7)  # 5000 leaves: 3 levels, padded
    state = fill(buf, 10, 500)

    def step(i, state):
        k1, k2 = jax.random.split(jax.random.fold_in(KEY, i))
        idx = jax.random.randint(k1, (256,), 0, 5000)
        state = buf.update(state, idx, jax.random.exponential(k2, (256,)) * 10.0 ** jax.random.randint(k2, (), -3, 4))
        return buf.insert(state, row(i, 10))  # and the range update of an insert, wrapping around

    state = jax.jit(lambda s: jax.lax.fori_loop(0, 4000, step, s))(state)  # 1,024,000 updated priorities
    leaves = np.asarray(state.tree[0], np.float64)
    for lower, upper in zip(state.tree[:-1], state.tree[1:]):
        sums = jnp.asarray(lower).reshape(-1, msrl.replay.FANOUT).sum(-1)
        # every node is its children's float32 sum (up to the order of the additions): no drift
        np.testing.assert_allclose(upper[: sums.shape[0]], sums, rtol=2e-6, atol=0)
        assert not np.asarray(upper[sums.shape[0]:]).any()
    assert float(buf.total(state)) == pytest.approx(leaves.sum(), rel=1e-5)


def test_sampling_never_draws_an_entry_of_priority_zero():
    buf = PrioritizedBuffer(capacity=4096, alpha=1.0)
    state = fill(buf, 64, 64)
    zero = jnp.arange(0, 4096, 3)
    tiny = jnp.arange(1, 4096, 3)
    state = update(buf, state, zero, jnp.zeros(zero.shape) - 1e-6)  # p + eps = 0
    state = update(buf, state, tiny, jnp.full(tiny.shape, 1e30))
    state, sample = draw(buf, state, 4096)
    assert (np.asarray(sample.indices) % 3 != 0).all()


def test_uniform_update_is_a_noop_and_bad_input_is_named():
    buf = UniformBuffer(capacity=8)
    state = fill(buf, 2, 2)
    assert buf.update(state, jnp.arange(2), jnp.ones(2)) is state
    with pytest.raises(ValueError, match="batch_size"):
        buf.sample(state)
    with pytest.raises(ValueError, match="batched over environments"):
        buf.init(key(), {"x": jax.ShapeDtypeStruct((), jnp.float32)})
    with pytest.raises(ValueError, match="needs at least 4"):
        UniformBuffer(capacity=8, sequence_length=3).init(key(), spec(4))
    with pytest.raises(ValueError, match="alpha"):
        PrioritizedBuffer(capacity=8, alpha=-1)


def test_jitted_with_donation_matches_jitted_without():
    buf = PrioritizedBuffer(capacity=64, sequence_length=2)
    plain = fill(buf, 4, 10)
    donated = buf.init(key(), spec(4))
    insert = jax.jit(buf.insert, donate_argnums=0)
    for t in range(10):
        donated = insert(donated, row(t, 4))
    plain, a = draw(buf, plain, 32)
    donated, b = jax.jit(buf.sample, static_argnums=1, donate_argnums=0)(donated, 32)
    plain = update(buf, plain, a.indices, jnp.arange(32.0))
    donated = jax.jit(buf.update, donate_argnums=0)(donated, b.indices, jnp.arange(32.0))
    for x, y in zip(jax.tree.leaves((plain, a)), jax.tree.leaves((donated, b)), strict=True):
        np.testing.assert_array_equal(x, y)


def test_row_writes_and_ravel_under_vmap_are_in_place_and_exact():
    """Several seeds in one program vmap the buffers' inserts and the optimizers' ravel: the values are those of
    the plain writes (seeds in step, seeds apart, nested vmaps, unbatched operands), the CPU program has no scatter
    (which XLA's CPU backend runs as loops over the whole batched buffer; an accelerator's scatters it), and
    gradients go through."""
    from msrl.backend import ravel
    from msrl.replay import _scatter_rows, put_row

    data = jnp.arange(4 * 6 * 3, dtype=jnp.float32).reshape(4, 6, 3)  # 4 seeds' buffers of 6 rows of 3
    items = -jnp.arange(4 * 3, dtype=jnp.float32).reshape(4, 3)
    plain = jax.vmap(lambda d, x, i: d.at[i].set(x))
    for index in (jnp.full(4, 2), jnp.array([0, 5, 2, 2])):  # in step (one write), apart (one per seed)
        assert np.array_equal(jax.jit(jax.vmap(put_row))(data, items, index), plain(data, items, index))
        assert np.array_equal(_scatter_rows(data, items, index), plain(data, items, index))  # an accelerator's way
    assert np.array_equal(jax.vmap(put_row, (None, 0, None))(data[0], items, 3),
                          jax.vmap(lambda x: data[0].at[3].set(x))(items))
    nested = jax.jit(jax.vmap(jax.vmap(put_row)))
    index = jnp.array([[1, 1], [4, 0]])
    assert np.array_equal(nested(data.reshape(2, 2, 6, 3), items.reshape(2, 2, 3), index),
                          jax.vmap(plain)(data.reshape(2, 2, 6, 3), items.reshape(2, 2, 3), index))
    on_cpu = {"lowering_platforms": ("cpu",)}
    assert "scatter" not in jax.jit(jax.vmap(put_row)).trace(data, items, index.reshape(-1)).lower(**on_cpu).as_text()

    tree = {"a": data, "b": items}
    concat = jax.vmap(lambda t: jnp.concatenate([x.reshape(-1) for x in jax.tree.leaves(t)]))
    assert np.array_equal(jax.jit(jax.vmap(ravel))(tree), concat(tree))
    deeper = jax.tree.map(lambda x: x.reshape(2, 2, *x.shape[1:]), tree)
    assert np.array_equal(jax.vmap(jax.vmap(ravel))(deeper).reshape(4, -1), concat(tree))
    assert "scatter" not in jax.jit(jax.vmap(ravel)).trace(tree).lower(**on_cpu).as_text()
    grads = jax.vmap(jax.grad(lambda t: (ravel(t) ** 2).sum()))(tree)
    assert np.array_equal(grads["a"], 2 * data) and np.array_equal(grads["b"], 2 * items)
    assert np.array_equal(jax.grad(lambda d: put_row(d, items[0], 1).sum())(data[0]),
                          jnp.ones((6, 3)).at[1].set(0.0))
