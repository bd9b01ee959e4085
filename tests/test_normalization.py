"""Observation and reward normalization (``algorithm.normalize_obs`` / ``normalize_reward``): running statistics
in the learner's state, merged exactly over how environments are split. Tolerances: the statistics' merge
math to 1e-6 (relative, float32); a split of the same run (fused vs 4 actor threads) to 0.0 in every
parameter and statistic; learner replicas to 0.0 (they all-reduce the same numbers)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import msrl
from msrl.rl import discounted_returns, normalize, running_stats, update_stats

from helpers import EXAMPLES, final_params, max_diff

PPO_PENDULUM = EXAMPLES / "ppo_pendulum.yaml"
NORM = ["algorithm.normalize_obs=true", "algorithm.normalize_reward=true"]


def test_running_statistics_merge_batches_and_shards_exactly():
    rng = np.random.default_rng(0)
    batches = [rng.normal(3.0, 2.0, size=(16, 8, 3)).astype(np.float32) * [1, 10, 0.1] for _ in range(5)]
    stats = running_stats(jnp.zeros(3))
    for b in batches:  # one batch after another, each [time, env, obs]
        stats = update_stats(stats, b)
    whole = np.concatenate([b.reshape(-1, 3) for b in batches]).astype(np.float64)
    assert float(stats["count"]) == whole.shape[0]
    np.testing.assert_allclose(stats["mean"], whole.mean(0), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(stats["var"], whole.var(0), rtol=1e-5)

    # 4 learner replicas each seeing 2 of the 8 envs, their moments averaged (a pmean, as multi_learner's
    # all-reduce does): every replica ends with the statistics of the whole batch
    def shard(x):
        return update_stats(running_stats(jnp.zeros(3)), x, lambda t: jax.lax.pmean(t, "replica"))

    split = jax.vmap(shard, axis_name="replica")(jnp.stack(np.split(batches[0], 4, axis=1)))
    one = update_stats(running_stats(jnp.zeros(3)), batches[0])
    for r in range(4):
        np.testing.assert_allclose(split["mean"][r], one["mean"], rtol=1e-6)
        np.testing.assert_allclose(split["var"][r], one["var"], rtol=1e-6)
    assert np.all(np.abs(np.asarray(normalize(one, batches[0]))) <= 10.0)

    # one row normalizes as it does in a batch, bitwise (divided by a broadcast, it was 5e-7 apart on 1 row)
    rows = batches[1][0] * 3.0
    whole, alone = jax.jit(normalize)(one, rows), [jax.jit(normalize)(one, row[None]) for row in rows]
    np.testing.assert_array_equal(whole, np.concatenate(alone))


def test_discounted_returns_run_on_across_rollouts_and_restart_after_an_episode_end():
    reward = jnp.ones((3, 2))
    done = jnp.array([[False, True], [False, False], [False, False]])
    returns, carry = discounted_returns(jnp.array([10.0, 10.0]), reward, done, 0.5)
    np.testing.assert_allclose(returns, [[6.0, 6.0], [4.0, 1.0], [3.0, 1.5]])
    np.testing.assert_allclose(carry, [3.0, 1.5])


def test_normalized_ppo_is_the_same_whether_envs_are_fused_or_split_over_actors():
    """Bitwise with one environment per actor: its one row normalized 5e-7 apart from the same row in fused's
    batch, and its Gaussian draw 6e-8 apart (parameters 6e-8 apart after 3 iterations), until 2026-11-29."""
    small = [*NORM, "env.num_envs=4", "algorithm.rollout_len=8", "algorithm.epochs=1", "algorithm.minibatches=2",
             "algorithm.hidden=[16]"]
    fused, _ = final_params(small, 3, PPO_PENDULUM)
    split, _ = final_params([*small, "policy.name=single_learner_coarse", "policy.backend=threads",
                             "policy.actors=4"], 3, PPO_PENDULUM)
    assert float(fused["obs_rms"]["count"]) == 3 * 8 * 4  # every observation of every env, once
    assert max_diff(fused, split) == 0.0


def test_learner_replicas_hold_the_same_statistics_and_parameters():
    """multi_learner with 2 learners (each sampling its own envs' transitions): the batch moments are
    all-reduced like the gradients, so both replicas act with the same statistics."""
    cfg = ["run.seed=0", "run.total_env_steps=100000", *NORM, "env.num_envs=4", "algorithm.rollout_len=2",
           "algorithm.batch_size=16", "algorithm.buffer_size=256", "algorithm.learning_starts=8",
           "algorithm.hidden=[16]", "algorithm.updates=2", "policy.name=multi_learner", "policy.learners=2"]
    with msrl.Session(EXAMPLES / "sac_pendulum.yaml", cfg, iterations_per_dispatch=3) as s:
        s.run(3)
        replicas = [r["learner"] for r in s.snapshot(skip=("buffer",))["learner"]]
    assert float(replicas[0]["obs_rms"]["count"]) == 3 * 2 * 16  # its own samples (2 updates of 16): only ratios matter
    assert max_diff(replicas[0], replicas[1]) == 0.0
    assert float(np.max(np.asarray(replicas[0]["reward_rms"]["var"]))) != 1.0  # it moved



def test_per_env_learner_state_of_another_size_says_how_to_size_it():
    """(It blamed the policy alone, where an algorithm of one's own had sized its state with Context.num_envs.)"""
    from msrl.rl import per_env_carry

    carry = jnp.zeros((8, 3))
    assert per_env_carry(carry, 8) is carry
    with pytest.raises(msrl.ConfigError, match=r"^policy.name: the learner keeps state for each of 8 environments, "
                                               r"but its batch holds 4: size such state with Context.learner_envs "):
        per_env_carry(carry, 4)


def test_learner_replicas_keep_their_own_environments_running_returns_through_a_restore():
    """multi_learner's replicas share parameters and statistics, but the discounted return each accumulates for
    reward scaling is its own environments' (state that differs between replicas by design): a snapshot holds
    every replica's, and a restored session continues as the uninterrupted one does."""
    cfg = [*NORM, "run.seed=0", "run.total_env_steps=100000", "env.num_envs=4", "algorithm.rollout_len=8",
           "algorithm.epochs=1", "algorithm.minibatches=2", "algorithm.hidden=[16]", "policy.name=multi_learner",
           "policy.learners=2"]
    with msrl.Session(PPO_PENDULUM, cfg) as s:
        s.run(2)
        snap = s.snapshot()
        s.run(2)
        on = s.params()
    learners = [state["learner"] for state in next(iter(snap.values()))]
    assert max_diff(learners[0]["ret"], learners[1]["ret"]) > 0  # each replica's own
    with msrl.Session(PPO_PENDULUM, cfg) as s:
        s.restore(snap)
        s.run(2)
        assert max_diff(on, s.params()) == 0.0
