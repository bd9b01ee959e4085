"""DQN: learns CartPole under `fused`; its n-step double-Q target, Ape-X epsilons, the loop's priority
update (buffer_update) compiled into the fused program, and config errors naming the key."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from msrl.algorithms.dqn import DQN, DQNConfig, Transition

import msrl
from msrl.config import load_config
from msrl.envs import make_env

from helpers import assert_reaches, reached

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "dqn_cartpole.yaml"
QUICK = ["run.progress=false", "run.tensorboard=false", "run.checkpoint_every_steps=0"]


def test_dqn_cartpole_reaches_475_within_200k_steps(tmp_path):
    summary = msrl.train(EXAMPLE, ["run.seed=0", *QUICK], run_dir=tmp_path, on_iteration=reached(475))
    assert summary["env_steps"] <= 200_000
    assert_reaches(tmp_path, 475, within=200_000)


def _algorithm(**overrides):
    env = make_env("gymnax:CartPole-v1")
    ctx = msrl.Context(env.spec, num_envs=4, total_env_steps=10_000)
    return DQN(DQNConfig(**overrides), ctx)


def test_n_step_double_q_target():
    dqn = _algorithm(n_step=3, gamma=0.9, double=True)
    learner = dqn.learner
    state = learner.init(jax.random.PRNGKey(0))
    target = learner.init(jax.random.PRNGKey(1))["params"]
    obs = jax.random.normal(jax.random.PRNGKey(2), (2, 4, 4))  # [batch, n + 1, obs]
    reward = jnp.array([[1.0, 2.0, 3.0, 9.0], [1.0, 2.0, 3.0, 9.0]])
    done = jnp.array([[False, False, False, True], [False, True, False, False]])  # 2nd: episode ends at step 1
    t = Transition(obs, jnp.zeros((2, 4), jnp.int32), reward, done)
    with jax.default_matmul_precision("highest"):  # GPUs multiply float32 at reduced precision by default
        y = jax.jit(learner._target)(state["params"], target, t)
        apply = jax.jit(learner.net.apply)
        q_next, q_online = apply(target, obs[0, 3]), apply(state["params"], obs[0, 3])
    best = q_next[jnp.argmax(q_online)]
    np.testing.assert_allclose(y, [1 + 0.9 * 2 + 0.81 * 3 + 0.729 * best, 1 + 0.9 * 2], rtol=1e-6)


def test_apex_epsilons_depend_on_global_env_index_only():
    actor = _algorithm(exploration="apex", apex_eps=0.4, apex_alpha=7.0).actor
    key = jax.random.PRNGKey(0)
    whole = actor.epsilon(actor.init(key, jnp.arange(4)))
    np.testing.assert_allclose(whole, 0.4 ** (1 + 7 * np.arange(4) / 3), rtol=1e-6)
    half = actor.epsilon(actor.init(key, jnp.arange(2, 4)))  # a replica holding envs 2 and 3
    np.testing.assert_array_equal(half, whole[2:])
    obs = jnp.zeros((4, 4))
    params = _algorithm().learner.init(key)["params"]
    act = jax.jit(actor.act)
    _, out = act(actor.init(key, jnp.arange(4)), params, obs)
    _, out_half = act(actor.init(key, jnp.arange(2, 4)), params, obs[2:])
    np.testing.assert_array_equal(out.action[2:], out_half.action)


def test_linear_epsilon_schedule():
    actor = _algorithm(eps_start=1.0, eps_end=0.1, eps_decay_steps=40).actor  # 4 envs: 10 calls
    state = actor.init(jax.random.PRNGKey(0), jnp.arange(4))
    np.testing.assert_allclose(actor.epsilon(state), 1.0)
    np.testing.assert_allclose(actor.epsilon({**state, "calls": jnp.int32(5)}), 0.55, rtol=1e-6)
    np.testing.assert_allclose(actor.epsilon({**state, "calls": jnp.int32(50)}), 0.1, rtol=1e-6)


def test_prioritized_loop_with_buffer_update_compiles_and_runs_fused():
    cfg = load_config(EXAMPLE, ["algorithm.prioritized=true", "algorithm.learning_starts=64",
                                "algorithm.buffer_size=2000", "algorithm.hidden=[16]", "run.total_env_steps=800"])
    program = msrl.build(cfg)
    assert "_c_buffer.update(_s_buffer, sample.indices, priorities)" in program.code()
    assert [f.mode for f in program.fragments.values()] == ["scan"]  # one jitted program
    with msrl.Session(program=program, seed=0, iterations_per_dispatch=25) as session:
        rows = session.run(100)  # 800 env steps, 200 updates
        (replicas,) = session.snapshot().values()  # one fragment, one replica: host arrays
    assert np.isfinite(rows[-1]["loss"]) and rows[-1]["env_steps"] == 800
    # learning: 0 until the buffer holds learning_starts=64 sampleable entries (8 envs, whose n-step windows of 4
    # steps are whole from their 4th step on: after the 11th iteration's inserts)
    assert [r["learning"] for r in rows] == [0.0] * 10 + [1.0] * 90
    buffer = program.components["buffer"]
    state = replicas[0]["buffer"]
    prio = np.asarray(buffer.priorities(state, jnp.arange(800)))
    assert int(state.count) == 100 and (prio[:776] > 0).all() and (prio[776:] == 0).all()  # last 3 rows: no window
    assert len(np.unique(prio[:776])) > 50  # updated from TD errors, not all the initial priority
    assert int(state.samples) == 200


@pytest.mark.parametrize("override, key", [
    ("algorithm.buffer_size=16", "algorithm.buffer_size"),
    (["algorithm.buffer_size=1000", "algorithm.batch_size=5000", "algorithm.learning_starts=100"],
     "algorithm.batch_size"),  # (swapped values: it ran)
    ("algorithm.learning_starts=300000", "algorithm.learning_starts"),
    ("run.total_env_steps=500", "algorithm.learning_starts"),  # the example starts learning after 1000
    ("algorithm.tau=0", "algorithm.tau"),
    ("algorithm.exploration=boltzmann", "algorithm.exploration"),
    ("env.id=gymnax:Pendulum-v1", "algorithm.name"),
    ("run.total_env_steps=1e11", "run.total_env_steps"),  # 2.5e10 updates: more than the schedules' int32 counts
])
def test_bad_config_names_the_key(override, key):
    with pytest.raises(msrl.ConfigError) as err:
        msrl.build(load_config(EXAMPLE, [override] if isinstance(override, str) else override))
    assert err.value.key == key


@pytest.mark.parametrize("config, overrides, message", [
    # 256 entries of 8 envs are 32 steps; 3-step returns' windows of 4 leave 29 steps whose windows are whole: 232
    ("dqn", ["algorithm.buffer_size=256", "algorithm.learning_starts=256"],
     r"^algorithm.learning_starts: 256 is more than the 232 transitions buffer_size 256 offers a sample \(32 whole "
     r"steps of 8 envs, less the last 3 of a window of 4 \(algorithm.n_step \+ 1\)\): learning would never start$"),
    # 2,000 steps are 62 whole iterations of 4 x 8: 248 steps of 8 envs, whose windows offer 245 x 8 = 1,960
    ("dqn", ["algorithm.buffer_size=200000", "algorithm.learning_starts=2000", "run.total_env_steps=2000",
             "algorithm.rollout_len=4"],
     r"^algorithm.learning_starts: 2,000 is more than the 1,960 transitions the run collects in its 62 whole "
     r"iterations \(248 steps of 8 envs, less the last 3 of a window of 4 \(algorithm.n_step \+ 1\); "
     r"run.total_env_steps=2,000\): learning would never start$"),
    # (a window longer than the run: it blamed learning_starts alone, naming no n_step)
    ("dqn", ["algorithm.n_step=100", "algorithm.learning_starts=8", "run.total_env_steps=80", "env.num_envs=4",
             "algorithm.rollout_len=2"],
     r"^algorithm.learning_starts: 8 is more than the 0 transitions the run collects in its 10 whole iterations "
     r"\(20 steps of 4 envs, less the last 100 of a window of 101 \(algorithm.n_step \+ 1\);"),
    ("dqn", ["algorithm.rollout_len=1", "algorithm.n_step=1", "algorithm.buffer_size=16", "algorithm.learning_starts=8"],
     r"^algorithm.buffer_size: 16 transitions are 2 steps of 8 envs; it must hold 3 steps"),  # (a ValueError mid-trace)
    ("sac", ["algorithm.buffer_size=100", "algorithm.learning_starts=100", "run.total_env_steps=1600"],
     r"^algorithm.learning_starts: 100 is more than the 96 transitions buffer_size 100 offers a sample"),
    ("sac", ["algorithm.buffer_size=8", "algorithm.learning_starts=8"],
     r"^algorithm.buffer_size: 8 transitions are 1 steps of 8 envs; it must hold 2 steps \(rollout_len, and at least "
     r"2\)$"),
    ("sac", ["algorithm.buffer_size=24", "algorithm.learning_starts=8", "algorithm.rollout_len=4"],
     r"^algorithm.buffer_size: 24 transitions are 3 steps of 8 envs; it must hold 4 steps"),  # (a replica inserts 4
    # rows at once where its envs run on the host: "inserting 4 rows at once into UniformBuffer of 3 rows" mid-run)
    ("recurrent_dqn", ["algorithm.buffer_size=400", "algorithm.learning_starts=390"],
     r"^algorithm.learning_starts: 390 is more than the 280 transitions buffer_size 400 offers a sample \(50 whole "
     r"steps of 8 envs, less the last 15 of a window of 16 \(algorithm.sequence_length\)\)"),  # (it counted DQN's
    # n-step window: 376)
])
def test_a_warm_up_the_buffer_never_reaches_is_refused(config, overrides, message):
    """(Each ran to its end with learning 0 in every row, or failed mid-trace inside the replay buffer: the
    checks compared learning_starts with buffer_size and run.total_env_steps, not with what a sample can draw.)"""
    path = EXAMPLE if config == "dqn" else EXAMPLE.parent / f"{config}_{'pendulum' if config == 'sac' else 'cartpole'}.yaml"
    with pytest.raises(msrl.ConfigError, match=message):
        msrl.build(load_config(path, ["env.num_envs=8", *overrides]))


def test_keys_the_config_makes_inert_are_noted(tmp_path, capsys):
    """(per_alpha without prioritized replay, the linear schedule's keys under Ape-X exploration, SAC's temperature
    keys with a fixed alpha: each was taken without a word and changed nothing.)"""
    msrl.train(EXAMPLE, ["algorithm.per_alpha=0.7", "algorithm.exploration=apex", "run.total_env_steps=64",
                         "algorithm.learning_starts=8", "run.progress=false", "run.tensorboard=false"],
               run_dir=tmp_path / "dqn")
    err = capsys.readouterr().err
    assert "msrl: note: algorithm.per_alpha only applies with algorithm.prioritized=true; ignored here\n" in err
    assert ("msrl: note: algorithm.eps_end, algorithm.eps_decay_steps only apply with algorithm.exploration=linear; "
            "ignored here\n") in err  # (the example's eps_start is the default: no word of it)
    msrl.train(EXAMPLE.parent / "sac_pendulum.yaml", ["algorithm.alpha=0.2", "algorithm.target_entropy=-2",
                                                      "run.total_env_steps=64", "algorithm.learning_starts=8",
                                                      "run.progress=false", "run.tensorboard=false"],
               run_dir=tmp_path / "sac")
    assert ("msrl: note: algorithm.alpha_lr, algorithm.target_entropy only apply with a learned temperature "
            "(algorithm.alpha=null); ignored here\n") in capsys.readouterr().err  # (the example sets alpha_lr)
