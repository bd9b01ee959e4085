"""SAC and TD3 (built-in): learn Pendulum fused, bootstrap a truncated episode from its final observation and
not a terminated one; their conformance cells: ``python -m msrl.conformance --only sac_builtin td3_builtin``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import msrl
from msrl.algorithms.sac import Transition
from msrl.config import load_config
from msrl.runner import build

from helpers import EXAMPLES, QUICK, assert_reaches, final_params, reached

SAC = EXAMPLES / "sac_pendulum.yaml"
SMALL = ["algorithm.hidden=[64,64]", "algorithm.batch_size=128", "env.num_envs=4", "algorithm.updates=2"]


def test_sac_learns_pendulum_fused(tmp_path):
    # two rounds of 4 episodes (Pendulum's are 200 steps, all envs in step) at a mean >= -250; random: ~-1200
    msrl.train(SAC, ["run.seed=0", "run.total_env_steps=24000", *SMALL, *QUICK], run_dir=tmp_path,
               on_iteration=reached(-250, window=400))
    assert_reaches(tmp_path, -250, within=24000, window=400)


def test_the_critic_bootstraps_a_truncated_episode_and_not_a_terminated_one():
    cfg = load_config(SAC, ["algorithm.hidden=[16]"])
    learner = build(cfg).components["learner"]
    state = learner.init(jax.random.PRNGKey(0))
    params = state["params"]
    obs = jnp.zeros((2, 3))
    final = jnp.array([[1.0, 0.0, 0.5], [1.0, 0.0, 0.5]])

    def target(terminated, next_obs):
        t = Transition(obs, jnp.zeros((2, 1)), jnp.array([-1.0, -1.0]), jnp.array(terminated), next_obs)
        return np.asarray(learner.target(params["actor"], state["target"], jnp.float32(0.2), t, jax.random.PRNGKey(1)))

    y = target([True, False], final)
    assert y[0] == -1.0  # terminated: the reward alone
    assert y[1] != -1.0  # truncated: the reward plus the discounted soft value of the final observation
    moved = target([True, False], final + 1.0)
    assert moved[0] == -1.0 and moved[1] != y[1]  # ... which the truncated target reads


TD3 = EXAMPLES / "td3_pendulum.yaml"


def test_td3_learns_pendulum_fused(tmp_path):
    msrl.train(TD3, ["run.seed=0", "run.total_env_steps=32000", *SMALL, *QUICK], run_dir=tmp_path,
               on_iteration=reached(-250, window=400))
    assert_reaches(tmp_path, -250, within=32000, window=400)


def test_td3_bootstraps_a_truncated_episode_and_not_a_terminated_one():
    learner = build(load_config(TD3, ["algorithm.hidden=[16]"])).components["learner"]
    state = learner.init(jax.random.PRNGKey(0))
    obs, final = jnp.zeros((2, 3)), jnp.array([[1.0, 0.0, 0.5], [1.0, 0.0, 0.5]])

    def target(next_obs):
        t = Transition(obs, jnp.zeros((2, 1)), jnp.array([-1.0, -1.0]), jnp.array([True, False]), next_obs)
        return np.asarray(learner.target(state["target"], t, jax.random.PRNGKey(1)))

    y, moved = target(final), target(final + 1.0)
    assert y[0] == moved[0] == -1.0 and y[1] != -1.0 and moved[1] != y[1]


def test_td3_split_at_the_env_or_the_buffer_acts_and_learns_as_fused_bitwise():
    """The example's network (128 x 128): the acting noise, scaled by one product, rounds alike in every program
    (``n * 0.1 * scale`` rounded differently inside fused's program: 1 ulp in an action, 2e-8 in the parameters
    after 3 iterations, growing)."""
    small = ["algorithm.rollout_len=2", "algorithm.batch_size=32", "algorithm.buffer_size=1024",
             "algorithm.learning_starts=8", "env.num_envs=8", *QUICK]
    fused, _ = final_params(small, 3, TD3)
    for split in (["policy.name=single_learner_fine"], ["policy.name=replay_server", "policy.shards=1"]):
        params, _ = final_params([*small, *split, "policy.backend=threads", "policy.actors=2"], 3, TD3)
        assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(fused), jax.tree.leaves(params))), split


def test_random_acting_ends_where_each_learner_starts_learning_under_multi_learner():
    """Each of multi_learner's learners starts once its own buffer (its share of the envs) holds learning_starts;
    the random acting counted it over all the envs, so the learners' untrained policies acted until then."""
    cfg = load_config(SAC, ["algorithm.hidden=[8]", "algorithm.rollout_len=1", "algorithm.updates=1",
                            "algorithm.batch_size=8", "algorithm.learning_starts=8", "env.num_envs=4",
                            "policy.name=multi_learner", "policy.learners=2", *QUICK])
    with msrl.Session(cfg) as session:
        learning = [row["learning"] for row in session.run(6)]
        assert session.program.algorithm.random_steps == 4  # (8 transitions of a learner's 2 envs; it was 2)
    assert learning == [0.0] * 3 + [1.0] * 3  # (the 4th iteration acts at random, then learns)


def test_continuous_learners_refuse_discrete_actions():
    import pytest

    for config in (SAC, TD3):
        with pytest.raises(msrl.ConfigError, match="continuous"):
            build(load_config(config, ["env.id=gymnax:CartPole-v1"]))


def test_squashing_learners_refuse_unbounded_actions():
    import loops  # noqa: F401 - registers gymnasium's MsrlQuirky-v0
    import pytest

    for config in (SAC, TD3):
        with pytest.raises(msrl.ConfigError, match=r"env.id: .*MsrlQuirky-v0's actions are unbounded") as err:
            build(load_config(config, ["env.id=gymnasium:MsrlQuirky-v0", 'env.kwargs={"mode": "unbounded"}']))
        assert err.value.key == "env.id"


def test_sac_refuses_an_action_dimension_without_room_and_td3_takes_it():
    """SAC's squashed Gaussian divides by high - low: a dimension whose bounds are equal is refused by name (the
    message suggests TD3, which builds on it)."""
    import loops  # noqa: F401 - registers gymnasium's MsrlQuirky-v0
    import pytest

    fixed = ["env.id=gymnasium:MsrlQuirky-v0", 'env.kwargs={"mode": "fixed"}', "policy.name=replay_server",
             "policy.actors=1", "policy.backend=threads"]
    with pytest.raises(msrl.ConfigError, match=r"env.id: .*MsrlQuirky-v0's action bounds leave no room in "
                                               r"dimension\(s\) \[1\] .*or use td3") as err:
        build(load_config(SAC, fixed))
    assert err.value.key == "env.id"
    build(load_config(TD3, fixed))


def test_sac_on_mujoco_halfcheetah_through_gymnasium_under_replay_server(tmp_path):
    """The `mujoco` extra: Gymnasium's HalfCheetah-v5 (MuJoCo) stepped on the host by 2 actor replicas that
    hold the replay shards, one learner (replay_server on threads). Its episodes end only by truncation."""
    import pytest

    pytest.importorskip("mujoco")  # the test extra installs it (the `mujoco` extra)
    summary = msrl.train(SAC, [*QUICK, "env.id=gymnasium:HalfCheetah-v5", "env.num_envs=4",
                               'env.kwargs={"max_episode_steps": 40}', "policy.name=replay_server", "policy.actors=2",
                               "policy.backend=threads", "algorithm.hidden=[32]", "algorithm.batch_size=32",
                               "algorithm.learning_starts=64", "run.total_env_steps=400"], run_dir=tmp_path)
    rows = summary.rows
    assert rows[-1]["env_steps"] == 400 and rows[-1]["episodes"] == 4 * (100 // 40)
    assert rows[-1]["episode_length"] == 40 and np.isfinite(rows[-1]["critic_loss"])
    assert all(np.isfinite(r["actor_loss"]) for r in rows)


def test_flat_gives_optax_flatten_numbers_and_state():
    """msrl.rl.flat (every built-in optimizer) is optax.flatten written without its concatenation: the same
    updates bitwise, and the same optimizer state, so checkpoints of either load into the other."""
    from msrl.rl import flat
    import optax

    params = {"a": jnp.arange(6.0).reshape(2, 3), "b": {"c": jnp.ones(4), "d": jnp.full((1, 2), -0.5)}}
    make = lambda wrap: wrap(optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-2)))  # noqa: E731

    @jax.jit
    def run(params, key):
        states = [make(w).init(params) for w in (flat, optax.flatten)]
        outs = [params, params]
        for k in jax.random.split(key, 3):
            g = jax.tree.map(lambda x: jax.random.normal(k, x.shape), params)
            for i, w in enumerate((flat, optax.flatten)):
                u, states[i] = make(w).update(g, states[i], outs[i])
                outs[i] = optax.apply_updates(outs[i], u)
        return outs, states

    (ours, theirs), (s_ours, s_theirs) = run(params, jax.random.PRNGKey(0))
    assert jax.tree.structure(s_ours) == jax.tree.structure(s_theirs)
    for x, y in zip(jax.tree.leaves((ours, s_ours)), jax.tree.leaves((theirs, s_theirs)), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert not np.array_equal(np.asarray(ours["a"]), np.asarray(params["a"]))
