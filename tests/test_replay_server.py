"""``replay_server`` (Ape-X): actors feed sharded replay buffers, one learner samples across them.

No transition is lost, duplicated or misrouted (the shards' contents, joined, are the fused buffer's); one
shard is the fused program exactly; actors pull parameters every ``param_sync_every`` iterations; ray
runs the same numbers as threads; errors name the key.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import max_diff

import msrl
from msrl.algorithms.dqn import DQN as DQNAlgorithm
from msrl.algorithms.dqn.dqn import Transition
from msrl.config import load_config
from msrl.conformance_loops import ConformanceSAC
from msrl.errors import CompileError, ConfigError
from msrl.resources import memory_estimate

import loops  # noqa: F401 - registers the "slices" algorithm

DQN = Path(__file__).resolve().parent.parent / "examples" / "dqn_cartpole.yaml"
SMALL = ["run.seed=0", "algorithm.buffer_size=4096", "algorithm.batch_size=32", "algorithm.hidden=[32]",
         "algorithm.rollout_len=2", "algorithm.updates=2", "algorithm.prioritized=true", "algorithm.eps_start=0.2",
         "algorithm.learning_starts=32", "algorithm.target_update_every=4"]


def server(actors: int, shards: int, *more: str) -> tuple[str, ...]:
    return ("policy.name=replay_server", f"policy.actors={actors}", f"policy.shards={shards}",
            f"policy.envs_per_actor={8 // actors}", *more)


@functools.lru_cache(maxsize=None)
def run(overrides: tuple[str, ...], iterations: int, steps: tuple[int, ...] = ()):
    """Learner parameters and component snapshots after ``iterations`` (and after each of ``steps``) of a
    short run, and its metrics rows. Cached: tests share runs."""
    with msrl.Session(load_config(DQN, [*SMALL, *overrides]), seed=0) as session:
        rows, params, snaps, done = [], {}, {}, 0
        for n in (*steps, iterations):
            rows += session.run(n - done)
            params[n], snaps[n], done = session.params(), session.snapshot(), n
        return params, snaps, rows


def test_one_shard_is_the_fused_program():
    fused, _, fused_rows = run((), 12)
    one, _, one_rows = run(server(2, 1), 12)
    assert max_diff(fused[12], one[12]) <= 1e-6
    assert [r["loss"] for r in fused_rows] == pytest.approx([r["loss"] for r in one_rows], rel=1e-5)


@msrl.register_algorithm("test_dqn_local_in_if")
class _DQNLocalInIf(DQNAlgorithm):
    """DQN's loop whose batch size is a local assigned from self.cfg inside an `if` on self.cfg (a probe's)."""

    class Config(DQNAlgorithm.Config):
        name: Literal["test_dqn_local_in_if"] = "test_dqn_local_in_if"

    def train_step(self):
        obs = msrl.env_observe()
        for _ in range(self.cfg.rollout_len):
            out = msrl.agent_act(obs)
            next_obs, reward, done = msrl.env_step(out.action)
            msrl.buffer_insert(Transition(obs, out.action, reward, done))
            obs = next_obs
        updates = self.cfg.updates
        if updates > 0:  # (on self.cfg alone, or on a constant local: both are decided at compile time)
            batch = self.cfg.batch_size
            for _ in range(updates):
                sample = msrl.buffer_sample(batch)
                metrics, priorities = msrl.agent_learn(sample)
                msrl.buffer_update(sample.indices, priorities)
        return metrics


def test_a_local_assigned_from_the_config_inside_an_if_on_it_is_a_constant_on_every_policy():
    """(Under fused it was; a split loop sent it from the actors as a traced value: "UniformBuffer.sample needs a
    positive int batch_size, got JitTracer" in the first iteration.)"""
    fused = run(("algorithm.name=test_dqn_local_in_if",), 3)[0][3]
    one = run(("algorithm.name=test_dqn_local_in_if", *server(2, 1)), 3)[0][3]
    assert max_diff(fused, one) <= 1e-6


@msrl.register_algorithm("test_dqn_item_spec")
class _DQNWithItemSpec(_DQNLocalInIf):
    """DQN whose buffer is given its item spec (all the loop's environments) and samples before it inserts."""

    class Config(DQNAlgorithm.Config):
        name: Literal["test_dqn_item_spec"] = "test_dqn_item_spec"

    def __init__(self, cfg, ctx):
        super().__init__(cfg, ctx)
        n = ctx.num_envs
        self.buffer.item_spec = Transition(jax.ShapeDtypeStruct((n, *ctx.env_spec.obs_shape), jnp.float32),
                                           jax.ShapeDtypeStruct((n,), jnp.int32),
                                           jax.ShapeDtypeStruct((n,), jnp.float32),
                                           jax.ShapeDtypeStruct((n,), jnp.bool_))


def test_a_buffer_given_its_item_spec_is_split_like_one_whose_spec_msrl_infers():
    """(Each shard, and the probes at twice the environments, got the spec of all of them: refused as 'the item's
    .obs is float32[16, 4]; the buffer holds float32[8, 4]'.)"""
    fused = run(("algorithm.name=test_dqn_item_spec",), 3)[0][3]
    one = run(("algorithm.name=test_dqn_item_spec", *server(2, 1)), 3)[0][3]
    assert max_diff(fused, one) <= 1e-6
    _, snaps, _ = run(("algorithm.name=test_dqn_item_spec", *server(2, 2)), 3)
    assert [s["buffer"].data.obs.shape[1] for s in snaps[3]["replay"]] == [4, 4]


@msrl.register_algorithm("test_dqn_env_metric")
class _DQNWithEnvMetric(DQNAlgorithm):
    """DQN's loop returning a value of one environment that the actors hand the learner's side."""

    class Config(DQNAlgorithm.Config):
        name: Literal["test_dqn_env_metric"] = "test_dqn_env_metric"

    def train_step(self):  # one step an iteration
        obs = msrl.env_observe()
        out = msrl.agent_act(obs)
        step = msrl.env_step(out.action)
        msrl.buffer_insert(Transition(obs, out.action, step.reward, step.done))
        sample = msrl.buffer_sample(self.cfg.batch_size)
        metrics, priorities = msrl.agent_learn(sample)
        msrl.buffer_update(sample.indices, priorities)
        return {**metrics, "second_env": step.obs[1, 0]}


def test_what_the_actors_hand_the_learner_besides_samples_joins_by_environment():
    """replay_server gave every value crossing to the learner the sample's batch axis: obs of 2 actors x 4 envs
    joined interleaved, so obs[1] was env 4's, not env 1's (fused's) — now refused for a policy of your own."""
    fused, server_ = ([r["second_env"] for r in run(("algorithm.name=test_dqn_env_metric", *more), 3)[2]]
                      for more in ((), server(2, 1)))
    assert fused == server_ and len(set(fused)) > 1


@msrl.register_policy("buffer_with_learner")
class BufferWithLearner(msrl.DistributedPolicy):
    """A policy of one's own: actors step and act; the learner also holds the replay buffer."""

    name: Literal["buffer_with_learner"] = "buffer_with_learner"
    backend: Literal["threads"] = "threads"
    actors: int = 2

    def fragments(self):
        return self.check_roles([self.role("actor", self.actors, "backend"), self.role("learner", 1, "backend")])

    def assign(self, loop):
        learner = set(loop.downstream_of(loop.calls("agent_learn"))) | set(loop.component_calls("buffer"))
        return loop.roles(lambda s: "learner" if s.id in learner else "actor")


def test_a_learner_holding_the_buffer_carries_its_parameters_through_its_loop_of_updates():
    """DQN's loop of updates sets the parameters the learner broadcasts after it: the loop, run on the host
    side of a threads replica, starts its carry from the parameters it had (it failed to compile)."""
    fused, _, _ = run((), 6)
    own, _, _ = run(("policy.name=buffer_with_learner",), 6)
    assert max_diff(fused[6], own[6]) == 0.0


def test_a_policy_of_ones_own_giving_a_role_no_replicas_is_a_config_error():
    with pytest.raises(msrl.ConfigError, match=r"^policy: policy 'buffer_with_learner' gives its role 'actor' 0 "
                       r"replicas in its fragments\(\); a role runs at least 1"):  # (it said a send cannot connect 0 replicas to 1)
        msrl.Session(load_config(DQN, [*SMALL, "policy.name=buffer_with_learner", "policy.actors=0"]), seed=0)

def test_no_transition_lost_duplicated_or_misrouted():
    """Learning held off: every run steps the same episodes, so the shards' buffers, joined along the env
    axis in shard order, must be exactly the fused program's buffer, and each shard must have counted
    exactly the rows its 2 actors sent."""
    iterations, hold = 9, ("algorithm.learning_starts=4000",)  # (its 4096 entries offer 4,072 to a sample)
    whole = run(hold, iterations)[1][iterations]["main"][0]["buffer"]
    assert np.abs(np.asarray(whole.data.obs[: iterations * 2])).sum() > 0  # real transitions were stored
    shards = [s["buffer"] for s in run((*server(4, 2), *hold), iterations)[1][iterations]["replay"]]
    for shard in shards:  # 2 steps per iteration, from every env of the shard's actors
        assert int(shard.count) == iterations * 2
        assert np.asarray(shard.data.obs).shape[1] == 4  # 8 envs over 2 shards
    for field in ("obs", "action", "reward", "done"):
        joined = np.concatenate([np.asarray(getattr(s.data, field)) for s in shards], axis=1)
        if field == "obs":  # XLA may round CartPole's physics for 4 envs and for 8 differently, by an ulp
            np.testing.assert_allclose(joined, np.asarray(whole.data.obs), rtol=1e-6, atol=1e-7)
        else:
            np.testing.assert_array_equal(joined, np.asarray(getattr(whole.data, field)))


SYNC4 = (server(2, 2, "policy.param_sync_every=4"), 12, (1, 4, 5))  # 2 shards, actors pull every 4 iterations


def test_two_shards_are_sampled_and_get_their_priorities_back():
    one, _, _ = run(server(2, 1), 12)
    two, snaps, rows = run(*SYNC4)
    assert max_diff(one[12], two[12]) > 1e-4 and np.isfinite(rows[-1]["loss"])  # a sharded sample differs
    for shard in snaps[12]["replay"]:  # both shards were sampled and had priorities set
        leaves = np.asarray(shard["buffer"].tree[0])
        assert len(np.unique(leaves[leaves > 0])) > 2
    # each shard draws its own samples (the keys were one: the same positions drawn in every shard)
    assert not np.array_equal(*(np.asarray(s["buffer"].key) for s in snaps[12]["replay"]))


def test_every_run_of_rows_of_a_sharded_sample_draws_from_every_shard():
    """A loop that learns on one sample in contiguous slices (SAC's and TD3's ``updates``): the shards' parts
    are interleaved, so each slice holds as many rows of each shard's environments (they were one shard's
    each when joined one after another)."""
    cfg = {"algorithm": {"name": "slices"}, "env": {"id": "gymnax:CartPole-v1", "num_envs": 8}}
    with msrl.Session(cfg, list(server(2, 2)), seed=0) as session:
        rows = session.run(3)
    assert all(r["slice0_low"] == r["slice1_low"] == 0.5 for r in rows)


def test_actors_pull_parameters_every_param_sync_every_iterations():
    """Pulls after iterations 1, 5, 9 (every 4th): after 4 iterations the actors still act with the
    learner's parameters of iteration 1; after 5 with the newest."""
    params, snaps, _ = run(*SYNC4)
    assert max_diff(params[4], params[1]) > 0  # the learner moved on meanwhile
    for actor in snaps[4]["actor"]:
        assert max_diff(actor["params"], params[1]) == 0.0
    for actor in snaps[5]["actor"]:
        assert max_diff(actor["params"], params[5]) == 0.0


def test_ray_runs_the_same_numbers_as_threads(ray_cluster):
    threads, _, threads_rows = run(*SYNC4)
    overrides, iterations, _ = SYNC4
    ray, snaps, ray_rows = run((*overrides, "policy.backend=ray", "policy.resources.replay.num_cpus=0.5"), iterations)
    assert max_diff(threads[12], ray[12]) <= 1e-6
    assert [r["episodes"] for r in threads_rows] == [r["episodes"] for r in ray_rows]
    assert [int(s["buffer"].count) for s in snaps[12]["replay"]] == [24, 24]


def test_errors_name_the_key():
    ppo = Path(__file__).resolve().parent.parent / "examples" / "ppo_cartpole.yaml"
    with pytest.raises(ConfigError, match="policy.shards"):
        msrl.build(load_config(DQN, [*server(4, 3), "algorithm.batch_size=48"]))
    with pytest.raises(CompileError, match=r"dqn.py:\d+: .*2 replay shards \(policy.shards\); .* multiple of 2"):
        msrl.build(load_config(DQN, [*server(2, 2), "algorithm.batch_size=33"]))  # at the loop's buffer_sample line
    with pytest.raises(ConfigError, match="buffer_sample"):
        msrl.build(load_config(ppo, ["policy.name=replay_server", "policy.shards=1"]))
    with pytest.raises(ConfigError, match="never samples one; for on-policy loops .* use single_learner_coarse"):
        msrl.build(load_config(ppo, ["policy.name=replay_server"]))  # 2 shards: refused before any split


def test_a_small_buffer_split_over_shards_compiles_and_is_counted_whole():
    """120 transitions over 2 shards of 4 envs: 15 steps each, enough for DQN's window. The shape probes trace
    every env at once (and twice as many): they used to split the capacity over shards too and refused it."""
    small = [*server(2, 2), "algorithm.buffer_size=120", "algorithm.learning_starts=8", "algorithm.batch_size=8"]
    with msrl.Session(load_config(DQN, small), seed=0) as session:
        session.run(2)  # one env step of each env an iteration
        assert [int(s["buffer"].count) for s in session.snapshot()["replay"]] == [2, 2]
    split, one = (memory_estimate(msrl.build(load_config(DQN, c)))["buffer"] for c in (small, small[4:]))
    assert split == one  # the shards together hold what one buffer of buffer_size does
    # 56 over 2 shards of 4 envs: 7 steps each, enough for a 3-step window (the probe of a shard's sample held all 8
    msrl.build(load_config(DQN, [*small, "algorithm.buffer_size=56", "algorithm.n_step=3"]))  # envs: 3 steps, refused)


class _Unsplit(msrl.ReplayBuffer):
    """A user's replay buffer with no ``shards``: msrl.UniformBuffer's storage, behind its own methods."""

    def __init__(self, capacity: int):
        self.inner = msrl.UniformBuffer(capacity, sequence_length=2)

    def init(self, key, item_spec):
        return self.inner.init(key, item_spec)

    def insert(self, state, item):
        return self.inner.insert(state, item)

    def sample(self, state, batch_size=None):
        return self.inner.sample(state, batch_size)


@msrl.register_algorithm("test_unsplit_sac")
class _UnsplitSAC(ConformanceSAC):
    """The conformance matrix's discrete SAC (a loop that samples its buffer and updates no priorities)."""

    class Config(ConformanceSAC.Config):
        name: Literal["test_unsplit_sac"] = "test_unsplit_sac"

    def __init__(self, cfg, ctx):
        super().__init__(cfg, ctx)
        self.buffer = _Unsplit(cfg.buffer_size)


@pytest.mark.parametrize("policy, hint", [
    ("replay_server", r"; use msrl.UniformBuffer or msrl.PrioritizedBuffer, or give yours `shards`"),
    ("single_learner_coarse", r"; a buffer that actors fill and the learner samples is policy.name=replay_server's job, "
                              r"with msrl.UniformBuffer"),  # (it said: use msrl.UniformBuffer, which coarse refuses)
])
def test_a_buffer_of_yours_that_cannot_be_split_says_which_policy_splits_one(policy, hint):
    overrides = ["algorithm.name=test_unsplit_sac", f"policy.name={policy}", "policy.backend=threads", "policy.actors=2"]
    with pytest.raises(ConfigError, match=rf"^policy.name: policy '{policy}' splits the replay buffer over 2 replicas, "
                                          rf"but _Unsplit cannot be split \(it has no `shards`\){hint}"):
        msrl.build(load_config(None, overrides + (["policy.shards=2"] if policy == "replay_server" else [])))


class _OwnSplit(msrl.ReplayBuffer):
    """A user's replay buffer that a policy may split: plain ``capacity`` and ``shards``, its storage msrl.UniformBuffer
    built from them (it has no ``_batch`` or other UniformBuffer internals)."""

    shards = 1

    def __init__(self, capacity: int):
        self.capacity = capacity

    def _storage(self) -> msrl.UniformBuffer:
        storage = msrl.UniformBuffer(self.capacity, sequence_length=2)
        storage.shards = self.shards
        return storage

    def init(self, key, item_spec):
        return self._storage().init(key, item_spec)

    def insert(self, state, item):
        return self._storage().insert(state, item)

    def sample(self, state, batch_size=None):
        return self._storage().sample(state, batch_size)


@msrl.register_algorithm("test_own_split_sac")
class _OwnSplitSAC(ConformanceSAC):
    class Config(ConformanceSAC.Config):
        name: Literal["test_own_split_sac"] = "test_own_split_sac"

    def __init__(self, cfg, ctx):
        super().__init__(cfg, ctx)
        self.buffer = _OwnSplit(cfg.buffer_size)


def test_a_buffer_of_yours_with_shards_is_split_like_msrls_own():
    """Over 2 shards, a user's buffer with ``shards`` runs as msrl.UniformBuffer does (the shape probe checked the
    sample's split with UniformBuffer's private helper, and failed on any other buffer)."""
    server_2x2 = ["policy.name=replay_server", "policy.backend=threads", "policy.actors=2", "policy.shards=2"]
    params = {}
    for name in ("conf_sac", "test_own_split_sac"):
        with msrl.Session(load_config(None, [f"algorithm.name={name}", *server_2x2]), seed=0) as session:
            params["initial"] = session.params()
            session.run(3)
            params[name] = session.params()
    assert max_diff(params["conf_sac"], params["test_own_split_sac"]) == 0
    assert max_diff(params["initial"], params["test_own_split_sac"]) > 1e-4  # (it sampled and learned)


class _IgnoresShards(_OwnSplit):
    def _storage(self) -> msrl.UniformBuffer:  # (each shard drew the whole batch: the learner's was twice as large)
        return msrl.UniformBuffer(self.capacity, sequence_length=2)


class _NoCapacity(_OwnSplit):
    def __init__(self, capacity: int):
        self.entries = capacity

    def _storage(self) -> msrl.UniformBuffer:
        return msrl.UniformBuffer(self.entries, sequence_length=2)


class _SampleGrows(_OwnSplit):
    def sample(self, state, batch_size=None):
        state, sample = super().sample(state, batch_size)
        return (state, jnp.zeros(())), sample


class _InsertsATuple(_OwnSplit):
    def insert(self, state, item):
        return super().insert(state, item), None


@msrl.register_algorithm("test_buffer_mistake_sac")
class _BufferMistakeSAC(ConformanceSAC):
    class Config(ConformanceSAC.Config):
        name: Literal["test_buffer_mistake_sac"] = "test_buffer_mistake_sac"
        mistake: str = ""

    def __init__(self, cfg, ctx):
        super().__init__(cfg, ctx)
        self.buffer = {"ignores": _IgnoresShards, "capacity": _NoCapacity, "grows": _SampleGrows,
                       "tuple": _InsertsATuple}[cfg.mistake](cfg.buffer_size)


@pytest.mark.parametrize("mistake, policy, message", [
    ("ignores", "replay_server", r"_IgnoresShards.sample\(\) \(.*\) draws 32 entries on each of its 2 shards, "
                                 r"64 joined, where a sample of the whole buffer has 32: the learner would see another "
                                 r"batch size"),
    ("capacity", "replay_server", r"_NoCapacity has `shards` but no `capacity` \(the entries it holds, an int\)"),
    ("grows", "single_learner_fine", r"_SampleGrows.sample\(\) \(.*\) returned a new state unlike the one it was "
                                     r"given"),  # (a raw scan-carry error; replay_server trained, its resume failed)
    ("tuple", "fused", r"_InsertsATuple.insert\(\) \(.*\) returned \(state, NoneType\); it returns its new state "
                       r"alone"),  # (a TypeError blaming sample)
])
def test_a_buffer_of_yours_that_breaks_the_protocol_is_named(mistake, policy, message):
    overrides = ["algorithm.name=test_buffer_mistake_sac", f"algorithm.mistake={mistake}", f"policy.name={policy}"]
    overrides += [] if policy == "fused" else ["policy.backend=threads", "policy.actors=2"]
    with pytest.raises(msrl.CompileError, match=message):
        msrl.build(load_config(None, overrides + (["policy.shards=2"] if policy == "replay_server" else [])))


def test_one_or_an_odd_number_of_actors_gets_one_shard_unless_told():
    """Two shards (the default) cannot take one actor's transitions: a run of one actor failed on a key the user
    never set. The default is 1 shard where policy.actors is odd; a shard count one sets is kept (and checked)."""
    shards = {actors: load_config(DQN, ["policy.name=replay_server", f"policy.actors={actors}",
                                        "env.num_envs=12"]).policy.shards for actors in (1, 2, 3, 4)}
    assert shards == {1: 1, 2: 2, 3: 1, 4: 2}
    cfg = load_config(DQN, ["policy.name=replay_server", "policy.actors=3", "policy.shards=2", "env.num_envs=12"])
    with pytest.raises(ConfigError, match=r"^policy\.shards: 2 shards cannot take the transitions of "
                                          r"policy\.actors=3 actors evenly"):
        cfg.policy.fragments()
