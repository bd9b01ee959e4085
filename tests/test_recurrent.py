"""Recurrent policies: ``msrl.agent_act(obs, done)`` with a per-env hidden state, recurrent PPO and IMPALA
(BPTT from the stored initial hidden state, minibatches by env), the same parameters under fused and
single_learner_coarse / single_learner_fine on threads, stateful evaluation, the ``mask_obs`` env option,
and the compile error for handing episode starts to an actor that keeps no state."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import QUICK, assert_reaches, final_params, max_diff, reached

import msrl
from msrl.cli import main
from msrl.config import load_config
from msrl.envs import make_env
from msrl.rl import RecurrentActorCritic, RecurrentActorCriticActor, unroll

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
RPPO = EXAMPLES / "recurrent_ppo_cartpole.yaml"
RPPO_IMPALA = EXAMPLES / "recurrent_impala_cartpole.yaml"
RDQN = EXAMPLES / "recurrent_dqn_cartpole.yaml"
SMALL = ["algorithm.rollout_len=8", "algorithm.epochs=2", "algorithm.minibatches=2", "algorithm.hidden=[16]",
         "algorithm.memory_size=8", "env.num_envs=8"]


def test_mask_obs_zeroes_the_named_entries_and_names_its_key():
    env = make_env("gymnax:CartPole-v1", mask_obs=[1, 3])
    state = env.init(jax.random.PRNGKey(0), jnp.arange(4))
    for _ in range(3):
        state, step = env.transition(state, jnp.ones(4, jnp.int32))
        assert np.all(np.asarray(step.obs)[:, [1, 3]] == 0) and np.all(np.asarray(step.final_obs)[:, [1, 3]] == 0)
        assert np.all(np.asarray(step.obs)[:, 0] != 0)
    with pytest.raises(msrl.ConfigError, match="env.kwargs.mask_obs.*outside"):
        make_env("gymnax:CartPole-v1", mask_obs=[4])
    with pytest.raises(msrl.ConfigError, match="env.kwargs.mask_obs.*single agent.*has 3 agents"):
        make_env("jaxmarl:MPE_simple_spread_v3", mask_obs=[0])


def test_env_starts_are_the_previous_steps_done():
    env = make_env("gymnax:CartPole-v1")
    starts, transition = jax.jit(env.starts), jax.jit(env.transition)  # as the programs run them
    state = jax.jit(env.init)(jax.random.PRNGKey(0), jnp.arange(8))
    assert bool(starts(state)[1].all())
    for _ in range(40):
        state, step = transition(state, jnp.zeros(8, jnp.int32))  # always left: episodes end early
        np.testing.assert_array_equal(np.asarray(starts(state)[1]), np.asarray(step.done))


def test_actor_resets_at_starts_and_the_learner_replays_the_same_steps():
    """The hidden state the actor records is the one each step started from; unrolling the window from the
    first recorded one, with the starts, gives every later recorded state and the same values."""
    net = RecurrentActorCritic(action_dim=2, discrete=True, obs_ndim=1, hidden=(16,), memory_size=8)
    actor = RecurrentActorCriticActor(net)
    params = jax.jit(net.init_params)(jax.random.PRNGKey(1), jnp.zeros(4))
    state = jax.jit(actor.init)(jax.random.PRNGKey(2), jnp.arange(3))
    act = jax.jit(actor.act)  # as the programs run it
    rng = np.random.default_rng(0)
    obs = jnp.asarray(rng.normal(size=(6, 3, 4)), jnp.float32)
    start = jnp.asarray(rng.uniform(size=(6, 3)) < 0.3).at[0].set(True)
    outs = []
    for t in range(6):
        state, out = act(state, params, obs[t], start[t])
        outs.append(out)
    hidden = jnp.stack([o.hidden for o in outs])
    assert np.all(np.asarray(hidden)[np.asarray(start)] == 0)  # reset where an episode starts
    assert np.any(np.asarray(hidden)[~np.asarray(start)] != 0)
    h, _, value = unroll(net, params, hidden[0], obs, start)
    np.testing.assert_allclose(value, jnp.stack([o.value for o in outs]), atol=1e-6)
    np.testing.assert_allclose(h, state["h"], atol=1e-6)


def test_the_gru_acts_alike_on_any_split():
    """msrl.rl.GRUCell: flax's GRUCell's parameters and learning numbers, but while acting each environment's
    hidden state has the same bits on any split of the batch, at a width of 8 too (flax's cell's does not: its
    narrow products round by batch size, which put recurrent splits 3e-8 from fused after 40 iterations)."""
    import functools

    import flax.linen as nn

    from msrl.components import acting
    from msrl.rl import GRUCell

    x = jax.random.normal(jax.random.key(0), (64, 16))
    for width in (8, 128):
        h = jax.random.normal(jax.random.key(2), (64, width))
        params = nn.GRUCell(width).init(jax.random.key(1), h, x)
        assert jax.tree.map(np.shape, GRUCell(width).init(jax.random.key(1), h, x)) == jax.tree.map(np.shape, params)
        assert (jax.jit(GRUCell(width).apply)(params, h, x)[0] == jax.jit(nn.GRUCell(width).apply)(params, h, x)[0]).all()
        act = jax.jit(functools.partial(acting, GRUCell(width).apply))
        whole = act(params, h, x)[0]
        for part in (1, 2, 4, 32):
            split = np.concatenate([act(params, h[i:i + part], x[i:i + part])[0] for i in range(0, 64, part)])
            assert (split == whole).all(), (width, part)


@pytest.fixture(scope="module")
def fused_rppo():
    return final_params(SMALL, 3, RPPO)[0]


@pytest.mark.parametrize("policy", [
    ["policy.name=single_learner_coarse", "policy.backend=threads", "policy.actors=2"],
    ["policy.name=single_learner_fine", "policy.backend=threads", "policy.actors=2"],
], ids=["coarse", "fine"])
def test_recurrent_ppo_under_threads_policies_equals_fused(fused_rppo, policy):
    other, _ = final_params([*SMALL, *policy], 3, RPPO)
    assert max_diff(fused_rppo, other) <= 1e-5


def test_recurrent_impala_under_coarse_threads_equals_fused():
    small = ["algorithm.rollout_len=8", "algorithm.hidden=[16]", "algorithm.memory_size=8", "env.num_envs=8"]
    fused, _ = final_params(small, 3, RPPO_IMPALA)
    coarse, _ = final_params([*small, "policy.name=single_learner_coarse", "policy.backend=threads",
                              "policy.actors=2"], 3, RPPO_IMPALA)
    assert max_diff(fused, coarse) <= 1e-5



def test_recurrent_dqn_under_replay_server_threads_equals_fused():
    """Sequence replay: windows with their stored initial hidden state, sampled by the learner from a replay
    shard fed by two actors, give fused's parameters."""
    small = ["algorithm.rollout_len=4", "algorithm.updates=2", "algorithm.batch_size=16", "algorithm.buffer_size=1024",
             "algorithm.learning_starts=16", "algorithm.sequence_length=6", "algorithm.burn_in=2",
             "algorithm.prioritized=true", "algorithm.hidden=[16]", "algorithm.memory_size=8", "env.num_envs=8"]
    fused, _ = final_params(small, 4, RDQN)
    server, _ = final_params([*small, "policy.name=replay_server", "policy.backend=threads", "policy.actors=2",
                              "policy.shards=1"], 4, RDQN)
    assert max_diff(fused, server) <= 1e-5


class _Stateless(msrl.Algorithm):
    """PPO's components (``built``'s) with a loop that hands episode starts to its stateless actor."""

    @staticmethod
    def built(cfg, ctx):
        from msrl.algorithms.ppo import PPO

        return PPO(cfg, ctx)

    def __init__(self, cfg, ctx):
        super().__init__(cfg, ctx)
        built = self.built(cfg, ctx)
        self.actor, self.learner, self.buffer = built.actor, built.learner, built.buffer

    def train_step(self):
        obs, start = msrl.env_observe(), msrl.env_starts()
        out = msrl.agent_act(obs, start)
        msrl.env_step(out.action)
        return msrl.agent_learn(msrl.buffer_get(), last_obs=obs)


def test_done_for_an_actor_without_state_is_a_compile_error_at_the_line():
    from msrl.algorithms.ppo import PPOConfig

    cfg = load_config(EXAMPLES / "ppo_cartpole.yaml", QUICK)
    env = make_env("gymnax:CartPole-v1")
    ctx = msrl.Context(env_spec=env.spec, num_envs=4, total_env_steps=10_000)
    alg = _Stateless(PPOConfig(), ctx)
    with pytest.raises(msrl.CompileError, match=r"test_recurrent.py:\d+.*agent_act\(obs, done\).*takes none"):
        msrl.compile(alg, cfg.policy, env, 4)


class _Forgetful(_Stateless):
    """Recurrent PPO's components with a loop that hands its recurrent actor no episode starts."""

    @staticmethod
    def built(cfg, ctx):
        from msrl.algorithms.ppo.recurrent_ppo import RecurrentPPO

        return RecurrentPPO(cfg, ctx)

    def train_step(self):
        obs = msrl.env_observe()
        out = msrl.agent_act(obs)
        msrl.env_step(out.action)
        return msrl.agent_learn(msrl.buffer_get(), last_obs=obs)


def test_a_recurrent_actor_given_no_starts_is_a_compile_error_at_the_line():
    """It would carry one episode's memory into the next while acting, where the learner resets it (it trained
    7.8e-3 away from the loop that hands the starts, without a word)."""
    from msrl.algorithms.ppo.recurrent_ppo import RecurrentPPOConfig

    cfg = load_config(RPPO, SMALL)
    env = make_env("gymnax:CartPole-v1")
    ctx = msrl.Context(env_spec=env.spec, num_envs=8, total_env_steps=10_000)
    alg = _Forgetful(RecurrentPPOConfig(**cfg.algorithm.model_dump(exclude={"name"})), ctx)
    with pytest.raises(msrl.CompileError, match=r"test_recurrent.py:\d+.*RecurrentActorCriticActor is recurrent .*"
                                               r"msrl.agent_act\(obs\) hands it no episode starts"):
        msrl.compile(alg, cfg.policy, env, 8)


def test_eval_refuses_a_recurrent_actor_it_cannot_act_with_as_trained():
    """Checked before anything is loaded: ``greedy_step`` without ``initial_carry`` (it crashed in eval with an
    AttributeError), and a recurrent actor whose only ``greedy`` acts without its hidden state (it scored
    another policy)."""
    from msrl.evaluate import check_greedy

    class NoCarry(msrl.Actor):
        recurrent = True

        def greedy_step(self, params, carry, obs, done):
            return carry, obs

    class GreedyOnly(msrl.Actor):
        recurrent = True

        def greedy(self, params, obs):
            return obs

    net = RecurrentActorCritic(action_dim=2, discrete=True, obs_ndim=1, hidden=(16,), memory_size=8)
    check_greedy(RecurrentActorCriticActor(net), "recurrent_ppo")  # the built-in one acts as trained
    with pytest.raises(msrl.ConfigError, match=r"NoCarry \(mine's actor, .*test_recurrent.py\) defines "
                                               r"greedy_step.* but no initial_carry\(n\)"):
        check_greedy(NoCarry(), "mine")
    with pytest.raises(msrl.ConfigError, match=r"GreedyOnly .* is recurrent, but its greedy\(params, obs\) acts "
                                               r"without the hidden state"):
        check_greedy(GreedyOnly(), "mine")


def test_eval_and_load_carry_the_hidden_state(tmp_path, capsys, monkeypatch):
    import msrl.evaluate as msrl_evaluate

    run = tmp_path / "run"
    cfg = load_config(RPPO, [*SMALL, "run.total_env_steps=128", "run.checkpoint_every_steps=64",
                             "run.progress=false", "run.tensorboard=false"])
    msrl.train(cfg, run_dir=run)
    capsys.readouterr()
    assert main(["eval", str(run), "--episodes", "4"]) == 0
    assert re.search(r"return \d+\.\d+ ± \d+\.\d+ over 4 episodes of [\d,.]+ steps on average, [\d,]+ env steps "
                     r"\(greedy; ", capsys.readouterr().out)
    policy = msrl.load(run)
    assert policy.recurrent
    obs = np.zeros((2, 4), np.float32)
    with pytest.warns(UserWarning, match=r"^act: this recurrent policy carries its hidden state on from the last "
                                         r"call, across episode ends too: pass done"):  # (once: it carried silently)
        a = [policy.act(obs + 0.1 * i) for i in range(3)]
    policy.reset()
    assert all(np.array_equal(x, policy.act(obs + 0.1 * i)) for i, x in enumerate(a))  # a reset starts afresh
    carried = np.asarray(policy._carry)
    policy.reset()
    policy.act(obs)
    fresh = np.asarray(policy._carry)
    policy.reset()
    for i in range(3):
        policy.act(obs + 0.1 * i)
    policy.act(obs, done=np.array([True, False]))  # env 0 starts a new episode: its state as if fresh
    np.testing.assert_allclose(np.asarray(policy._carry)[0], fresh[0], atol=1e-6)
    assert not np.allclose(carried[1], fresh[1])
    with pytest.raises(ValueError, match=r"^act: this recurrent policy holds the hidden state of 2 environments, "
                                         r"got 1; call reset\(\) first"):  # (it forgot both without a word)
        policy.act(obs[:1])
    msrl.train(load_config(RPPO, [*SMALL, "algorithm.memory=none", "run.total_env_steps=64", "run.progress=false",
                                  "run.tensorboard=false"]), run_dir=tmp_path / "none")
    memoryless = msrl.load(tmp_path / "none")  # (it held a hidden state of zeros and refused another batch size)
    assert not memoryless.recurrent and memoryless.act(obs).shape == (2,) and memoryless.act(obs[0]).shape == ()
    with pytest.raises(ValueError, match=r"^act: done is one bool per environment, shaped \(2,\), got \(\)$"):
        policy.act(obs, done=True)
    with pytest.raises(ValueError, match=r"^act: done is one bool per environment, got <U2 values \['no', 'no'\]"):
        policy.act(obs, done=["no", "no"])  # (every one was true)
    policy.reset()
    assert policy.act(obs[0], done=True).shape == ()  # one observation's done may be one bool
    many = np.random.default_rng(0).normal(size=(5, 4)).astype(np.float32)
    policy.reset()
    whole, carry = [policy.act(many * i) for i in range(3)], np.asarray(policy._carry)
    monkeypatch.setattr(msrl_evaluate, "ACT_ROWS", 2)  # a batch acted on in parts: the same actions and states
    policy.reset()
    assert all(np.array_equal(x, policy.act(many * i)) for i, x in enumerate(whole))
    np.testing.assert_array_equal(np.asarray(policy._carry), carry)
    told = msrl.load(run)
    with warnings.catch_warnings():  # a policy told where episodes start warns of nothing
        warnings.simplefilter("error")
        for i in range(3):
            told.act(obs, done=np.full(2, i == 0))


def test_load_carries_a_hidden_state_that_is_a_pair(tmp_path):
    """An actor's ``initial_carry`` may be any pytree (an LSTM's ``(c, h)``): ``msrl.load``'s policy carries it
    from one ``act`` to the next and resets each environment's part where ``done`` says."""
    import loops  # noqa: F401 - registers "pair_carry"

    cfg = load_config({"algorithm": {"name": "pair_carry"}, "env": {"id": "gymnax:CartPole-v1", "num_envs": 2}},
                      ["run.total_env_steps=32", "run.progress=false", "run.tensorboard=false"])
    msrl.train(cfg, run_dir=tmp_path / "run")
    policy = msrl.load(tmp_path / "run")
    obs = np.zeros((2, 4), np.float32)
    for _ in range(3):
        policy.act(obs)
    policy.act(obs, done=np.array([True, False]))
    assert np.asarray(policy._carry[1]).tolist() == [1, 4]
    policy.reset()
    policy.act(obs[:1])  # another number of environments after a reset: a fresh carry
    assert np.asarray(policy._carry[1]).tolist() == [1]


def test_recurrent_ppo_learns_masked_cartpole_beyond_what_memory_allows(tmp_path):
    """With the velocities hidden, the same network without memory never got past 67 in 1M steps (README);
    the GRU passes 100 (5-iteration mean) within 150k steps. Stops when it gets there."""
    msrl.train(RPPO, ["run.seed=0", "run.total_env_steps=150000", *QUICK], run_dir=tmp_path,
               on_iteration=reached(100))
    assert_reaches(tmp_path, 100, 150_000)


def test_recurrent_ppo_refuses_normalization_it_does_not_apply():
    with pytest.raises(msrl.ConfigError, match="algorithm.normalize_obs"):
        msrl.Session(EXAMPLES / "recurrent_ppo_cartpole.yaml", ["algorithm.normalize_obs=true"])
