"""The gymnax adapter: real gymnax environments, batched, with per-environment keys."""

from __future__ import annotations

import csv
import inspect
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import msrl
from msrl.components import episode_metrics
from msrl.envs import make_env
from helpers import EXAMPLES, QUICK, UsersEnv, assert_reaches, reached

import loops

IDS = ["CartPole-v1", "Acrobot-v1", "Pendulum-v1", "MountainCar-v0", "MountainCarContinuous-v0", "Breakout-MinAtar"]


def test_in_tiles_computes_each_row_as_any_batch_does():
    """An env step's reductions in tiles: each row the same on 1, 32 or 64 rows as on 128 (XLA's CPU compiler
    emitted ``sum(square(x), -1)`` by its size, with a fused multiply-add for some sizes: rows 1e-7 apart)."""
    from msrl.envs.gymnax_env import in_tiles

    x = jax.random.normal(jax.random.PRNGKey(0), (128, 6, 6, 2))
    dist = jax.vmap(lambda d: jnp.sqrt(jnp.sum(jnp.square(d), -1)))
    tiled = jax.jit(in_tiles(dist, 8))
    ref = np.asarray(tiled(x))
    np.testing.assert_allclose(ref, np.asarray(jax.jit(dist)(x)), rtol=1e-6)  # (what it computes)
    for n in (1, 3, 32, 64):
        np.testing.assert_array_equal(np.asarray(tiled(x[:n])), ref[:n])


@pytest.mark.parametrize("name", IDS)
def test_gymnax_env_steps_and_resets(name):
    env = make_env(f"gymnax:{name}")
    spec = env.spec
    state = env.init(jax.random.PRNGKey(0), jnp.arange(4))
    state, obs = env.observe(state)
    assert obs.shape == (4, *spec.obs_shape)
    if spec.discrete:
        action = jnp.zeros(4, jnp.int32)
    else:
        action = jnp.broadcast_to(jnp.asarray(spec.action_space.high), (4, *spec.action_space.shape)) * 10
    step = jax.jit(env.step)
    for _ in range(3):
        state, (obs, reward, done) = step(state, action)
    assert obs.shape == (4, *spec.obs_shape) and reward.shape == (4,) and done.dtype == jnp.bool_
    assert np.isfinite(np.asarray(obs)).all()
    assert set(env.stats(state)) == {"return_sum", "length_sum", "finished", "episodes", "nonfinite"}
    assert int(env.stats(state)["nonfinite"]) == 0


@pytest.mark.parametrize("name", ["CartPole-v1", "Pendulum-v1", "Breakout-MinAtar", "Catch-bsuite"])
def test_gymnax_step_is_gymnax_own_step(name):
    """The adapter writes gymnax's step out (the auto-reset runs only when an episode ended): the same
    episodes, rewards and observations as gymnax's ``env.step`` with the same keys, over many resets."""
    env = make_env(f"gymnax:{name}")
    own = jax.jit(jax.vmap(env.env.step, in_axes=(0, 0, 0, None)))
    ours = jax.jit(env._step)
    n, key = 8, jax.random.PRNGKey(3)
    _, inner = env._reset(jax.random.split(key, n))
    theirs, ended = inner, 0
    for _ in range(200):
        key, k_env, k_act = jax.random.split(key, 3)
        keys = jax.random.split(k_env, n)
        space = env.spec.action_space
        action = (jax.random.randint(k_act, (n,), 0, space.n) if env.spec.discrete
                  else jax.random.uniform(k_act, (n, *space.shape), minval=space.low, maxval=space.high))
        obs, inner, reward, terminated, truncated, final_obs = ours(keys, inner, action)
        obs2, theirs, reward2, terminated2, truncated2, info = own(keys, theirs, action, env.params)
        np.testing.assert_array_equal(terminated | truncated, np.asarray(terminated2) | np.asarray(truncated2))
        for a, b in zip(jax.tree.leaves((obs, inner, reward, final_obs)),
                        jax.tree.leaves((obs2, theirs, reward2, info["final_observation"]))):
            np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=1e-5, atol=1e-5)
        theirs = inner  # (an ulp of physics apart at most: each goes on from the same state)
        ended += int(np.sum(np.asarray(terminated | truncated)))
    assert ended >= 8


def test_cartpole_episodes_end_and_are_counted():
    env = make_env("gymnax:CartPole-v1")
    state = env.init(jax.random.PRNGKey(1), jnp.arange(2))
    step = jax.jit(env.step)
    for _ in range(60):  # always pushing left ends every episode well before 60 steps
        state, _ = step(state, jnp.zeros(2, jnp.int32))
    stats = episode_metrics([env.stats(state)])
    assert stats["episodes"] >= 2
    assert 5 <= stats["episode_return"] <= 60


def test_gymnax_env_parameters_are_env_kwargs_too():
    """``env.kwargs`` also sets fields of the env's EnvParams (they went to the constructor only: a TypeError)."""
    env = make_env("gymnax:CartPole-v1", max_steps_in_episode=10)
    state = env.init(jax.random.PRNGKey(1), jnp.arange(2))
    step, lengths = jax.jit(env.step), []
    for _ in range(30):  # pushing left and right in turn keeps the pole up past 10 steps: the limit ends them
        state, _ = step(state, jnp.asarray([len(lengths) % 2] * 2, jnp.int32))
        lengths.append(episode_metrics([env.stats(state)])["episode_length"])
    assert lengths[-1] == 10 and episode_metrics([env.stats(state)])["episodes"] == 6
    with pytest.raises(msrl.ConfigError, match=r"^env.kwargs.max_steps_in_episode: gymnax:CartPole-v1's parameter "
                                               r"max_steps_in_episode is int \(default 500\), got 2.5$"):
        make_env("gymnax:CartPole-v1", max_steps_in_episode=2.5)
    with pytest.raises(msrl.ConfigError, match=r"^env.kwargs.max_steps_in_episode: must be a whole number >= 1 "):
        make_env("gymnax:CartPole-v1", max_steps_in_episode=0)  # (taken: every episode was one step long)
    with pytest.raises(msrl.ConfigError, match=r"^env.kwargs.nope: gymnax:CartPole-v1 takes no parameter 'nope'; "
                                               r"its parameters: max_steps_in_episode, gravity, "):
        make_env("gymnax:CartPole-v1", nope=1)


def test_a_gymnax_env_given_an_action_outside_its_discrete_actions_rewards_nan_for_the_nan_guard():
    """(gymnax takes any integer: CartPole's action 4 pushed 7x as hard, and a buggy actor trained on.)"""
    env = make_env("gymnax:CartPole-v1")
    state, out = jax.jit(env.step)(env.init(jax.random.PRNGKey(0), np.arange(4)), jnp.asarray([0, 1, 2, -1]))
    assert np.asarray(out.reward).tolist()[:2] == [1.0, 1.0] and np.isnan(np.asarray(out.reward)[2:]).all()
    assert int(env.stats(state)["nonfinite"]) == 2


def test_env_keys_depend_on_global_index_only():
    """Splitting envs over replicas changes no number: envs [2, 3] alone == envs [0..3] sliced."""
    env = make_env("gymnax:CartPole-v1")
    init, step = jax.jit(env.init), jax.jit(env.step)  # as the programs run them (and one compile per shape)
    key = jax.random.PRNGKey(7)
    full = init(key, jnp.arange(4))
    part = init(key, jnp.array([2, 3]))
    actions = jnp.array([0, 1, 1, 0], jnp.int32)
    for _ in range(20):
        full, (obs_f, rew_f, done_f) = step(full, actions)
        part, (obs_p, rew_p, done_p) = step(part, actions[2:])
    np.testing.assert_array_equal(np.asarray(obs_f[2:]), np.asarray(obs_p))
    np.testing.assert_array_equal(np.asarray(done_f[2:]), np.asarray(done_p))


def test_a_pickled_gymnax_env_loads_without_gymnax_plotting_imports(tmp_path):
    """A Ray actor or subprocess gets its env pickled: loading it imports gymnax as msrl does (without seaborn,
    pandas and scipy.stats, which gymnax's package import pulls in for a few envs' plots) and the env is the same."""
    import json
    import pickle
    import subprocess
    import sys
    import textwrap

    env = make_env("gymnax:Acrobot-v1")
    (tmp_path / "env.pkl").write_bytes(pickle.dumps(env))
    code = textwrap.dedent(f"""
        import json, pickle, sys, jax, numpy as np
        env = pickle.loads(open({str(tmp_path / "env.pkl")!r}, "rb").read())
        assert not {{"pandas", "scipy.stats", "matplotlib"}} & set(sys.modules), "plotting packages imported"
        print(json.dumps(np.asarray(jax.jit(env.init)(jax.random.PRNGKey(3), np.arange(2)).obs).tolist()))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    expected = np.asarray(jax.jit(env.init)(jax.random.PRNGKey(3), np.arange(2)).obs)
    assert np.array_equal(np.asarray(json.loads(out.stdout.strip().splitlines()[-1]), np.float32), expected)
    assert env.spec == pickle.loads(pickle.dumps(env)).spec
    # what gymnax's modules took for matplotlib is the real thing on first use, as for whoever imports it next
    code = textwrap.dedent("""
        from msrl.envs import make_env
        make_env("gymnax:CartPole-v1")
        import matplotlib.colors, matplotlib.pyplot as plt
        from gymnax.environments.misc import pong
        assert pong.colors.ListedColormap is matplotlib.colors.ListedColormap and pong.plt.figure is plt.figure
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-2000:]


def test_bad_env_ids_are_config_errors():
    with pytest.raises(msrl.ConfigError, match="env.id.*PREFIX:NAME"):
        make_env("CartPole-v1")
    with pytest.raises(msrl.ConfigError, match="env.id.*not a gymnax environment; did you mean 'CartPole-v1'"):
        make_env("gymnax:CartPole-v9")
    with pytest.raises(msrl.ConfigError, match="env.id.*not a gymnax environment; did you mean 'Breakout-MinAtar'"):
        make_env("gymnax:MinAtar-Breakout")  # its words in another order
    with pytest.raises(msrl.ConfigError, match="env.id.*not an environment id: no prefix 'gymnx' is registered; did "
                                               "you mean 'gymnax'"):
        make_env("gymnx:CartPole-v1")
    with pytest.raises(msrl.ConfigError, match=r"'my:Sign-v0' is not an environment id: no prefix 'my' is registered; "
                                               r"the prefixes: .* \(an env of your own registers 'my' when its module "
                                               r"is imported: `msrl ... --import FILE.py` or run.imports in the config\)"):
        make_env("my:Sign-v0")  # a user's own prefix, its module not imported (msrl eval without --import)
    with pytest.raises(msrl.ConfigError, match="env.id.*not a gymnax environment; known: CartPole-v1"):
        make_env("gymnax:NoSuchThing")  # nothing close: no guess
    with pytest.raises(msrl.ConfigError, match="env.kwargs"):
        make_env("gymnax:CartPole-v1", no_such_kwarg=1)
    with pytest.raises(msrl.ConfigError, match=r"gymnasium:MsrlNowhere-v0 .* doesn't exist.* --import FILE.py"):
        make_env("gymnasium:MsrlNowhere-v0")  # not registered: perhaps by a module not imported


def test_env_step_tells_termination_from_truncation_with_the_final_observation():
    """Pendulum's episodes end only by its 200-step limit (truncated, never terminated); CartPole's pole falls
    (terminated). Where an episode ends, obs is the next episode's first and final_obs the ended one's last."""
    import jax

    from msrl.envs import make_env

    for env_id, ends in (("gymnax:Pendulum-v1", "truncated"), ("gymnax:CartPole-v1", "terminated"),
                         ("gymnasium:CartPole-v1", "terminated")):
        env = make_env(env_id)
        state = env.init(jax.random.PRNGKey(0), np.arange(2))
        step = jax.jit(env.transition) if env.jittable else env.transition
        zero = np.zeros((2, *env.spec.action_space.shape), np.float32) if not env.spec.discrete else np.zeros(2, np.int32)
        seen = 0
        for t in range(1, 401):
            state, out = step(state, zero)
            obs, reward, done = out  # the classic unpacking still works
            assert np.array_equal(done, np.asarray(out.terminated) | np.asarray(out.truncated))
            ended = np.asarray(getattr(out, ends))
            other = np.asarray(out.truncated if ends == "terminated" else out.terminated)
            assert not other.any(), (env_id, t)
            if ended.any():
                seen += 1
                assert not np.allclose(np.asarray(out.final_obs)[ended], np.asarray(obs)[ended])
            # (XLA may round the two copies differently by an ulp)
            np.testing.assert_allclose(np.asarray(out.final_obs)[~done], np.asarray(obs)[~done], rtol=1e-6, atol=1e-6)
            if ends == "truncated":
                assert ended.all() == (t % 200 == 0)
        assert seen >= 2, env_id


def test_gymnasium_corners_a_terminal_time_limit_step_a_shifted_discrete_space_and_the_old_api():
    import loops  # noqa: F401 - registers gymnasium's MsrlQuirky-v0

    env = make_env("gymnasium:MsrlQuirky-v0")  # terminal on the step its time limit truncates: terminal
    state = env.init(jax.random.PRNGKey(0), np.arange(2))
    for _ in range(5):
        state, out = env.step(state, np.zeros(2, np.int32))
    assert out.terminated.all() and not out.truncated.any()
    env = make_env("gymnax:CartPole-v1", max_steps_in_episode=1, theta_threshold_radians=1e-9)  # gymnax's too
    state, out = env.step(env.init(jax.random.PRNGKey(0), np.arange(2)), np.zeros(2, np.int32))  # (it said cut)
    assert np.asarray(out.terminated).all() and not np.asarray(out.truncated).any()

    env = make_env("gymnasium:MsrlQuirky-v0", mode="start")  # Discrete(3, start=1): msrl's 0..2 are its 1..3
    assert env.spec.action_space.n == 3
    state = env.init(jax.random.PRNGKey(0), np.arange(3))
    state, out = env.step(state, np.array([0, 1, 2], np.int32))  # (the env raises on an action outside 1..3)
    assert np.asarray(out.reward).tolist() == [1.0] * 3

    # envs of one run whose action spaces differ (the first env's was the run's: actions of another, or never all)
    for subprocesses in (0, 1):
        env = make_env("gymnasium:MsrlQuirky-v0", mode="mixed", subprocesses=subprocesses)
        with pytest.raises(msrl.TrainingError, match=r"MsrlQuirky-v0 #\d(, in its worker process,)? failed in "
                                                     r"(reset|make): ValueError: its action space is Discrete\(\d\), "
                                                     r"but the run's \(its first environment's\) is Discrete\(\d\): "):
            env.init(jax.random.PRNGKey(0), np.arange(2))

    # uint8 observations stay uint8, as EnvPool's and jitted envs' frames (they were float32, which nature_cnn and
    # msrl.load's check of frames scaled twice took for floats); a space of uint8 keeps them so
    env = make_env("gymnasium:MsrlQuirky-v0", mode="pixels")
    assert env.spec.obs_dtype == np.uint8
    state = env.init(jax.random.PRNGKey(0), np.arange(2))
    for t in range(1, 6):
        state, out = env.step(state, np.zeros(2, np.int32))
        assert out.final_obs.dtype == np.uint8 and out.final_obs.tolist() == [[250 + t] * 2] * 2
    assert out.obs.dtype == np.uint8 and out.obs.tolist() == [[0, 0]] * 2  # (the next episode's first)
    with pytest.raises(msrl.TrainingError, match=r"returned an observation of float32\[2\], but its observation "
                                                 r"space is uint8\[2\] \(msrl keeps such frames as uint8\)"):
        make_env("gymnasium:MsrlQuirky-v0", mode="sloppy").init(jax.random.PRNGKey(0), np.arange(1))
    # a Box of int actions: msrl's float actions were cast, truncated toward 0 (its bounds never reached)
    with pytest.raises(msrl.ConfigError, match=r"env.id: gymnasium:MsrlQuirky-v0's actions are Box\(-2, 2, \(1,\), "
                                               r"int32\), a Box of int32: msrl's continuous actions are floats"):
        make_env("gymnasium:MsrlQuirky-v0", mode="ints")

    with pytest.raises(msrl.TrainingError, match=r"^environment gymnasium:MsrlQuirky-v0 #0 at step 0 failed in step: "
                                                 r"TypeError: Quirky.step\(\) returned what Gymnasium's wrappers cannot "
                                                 r"unpack; .*returns \(obs, reward, terminated, truncated, info\) \(an "
                                                 r"env of the old Gym API returns 4\)$"):
        env = make_env("gymnasium:MsrlQuirky-v0", mode="old_step")
        env.step(env.init(jax.random.PRNGKey(0), np.arange(1)), np.zeros(1, np.int32))
    with pytest.raises(msrl.TrainingError, match=r"^environment gymnasium:MsrlQuirky-v0 #0 failed in reset: TypeError: "
                                                 r"Quirky.reset\(\) returned a ndarray; Gymnasium's API returns \(obs, "
                                                 r"info\)"):
        make_env("gymnasium:MsrlQuirky-v0", mode="old_reset").init(jax.random.PRNGKey(0), np.arange(1))


@pytest.mark.parametrize("env_id, kwargs, policies", [
    ("gymnax:Pendulum-v1", {}, ["policy.name=fused", "policy.name=single_learner_coarse policy.actors=2",
                                "policy.name=single_learner_fine policy.actors=2"]),
    ("gymnasium:CartPole-v1", {"max_episode_steps": 12}, ["policy.name=single_learner_coarse policy.actors=2",
                                                          "policy.name=single_learner_fine policy.actors=1"]),
])
def test_env_step_fields_cross_every_cut(env_id, kwargs, policies):
    """A loop reading terminated, truncated and final_obs computes the same under every policy."""
    import json

    import loops  # noqa: F401 - registers "step_fields"
    from msrl.config import load_config

    results = []
    for p in policies:
        cfg = load_config({"algorithm": {"name": "step_fields"}, "env": {"id": env_id, "num_envs": 2, "kwargs": kwargs}},
                          [*p.split(), "run.seed=3"] + ([f"env.kwargs={json.dumps(kwargs)}"] if kwargs else []))
        with msrl.Session(cfg, iterations_per_dispatch=30) as s:
            rows = s.run(30)
            results.append((float(s.params()["w"]), sum(r["truncations"] for r in rows)))
    assert results[0][1] > 0 and all(r == results[0] for r in results), results


def test_brax_env_runs_inside_the_fused_program(tmp_path):
    """Brax physics (`brax:` ids) jitted with PPO into one program; an episode cut by its length is a
    truncation, and the final observation is the one before the reset. PPO with observation and reward
    normalization (examples/ppo_brax_inverted_pendulum.yaml, smaller, 100-step episodes) learns: a random
    policy keeps the pole up ~6 steps; this run's 5-iteration mean first passes 20 near 20k steps (the
    example's 1M-step runs end near 1000, README). Most of the time is Brax's tracing and XLA compilation."""
    pytest.importorskip("brax")  # the test extra installs it (the `brax` extra)
    env = make_env("brax:inverted_pendulum", episode_length=5)
    steps = jax.jit(lambda key: jax.lax.scan(lambda s, _: env.transition(s, jnp.zeros((2, 1))),  # one compile
                                             env.init(key, jnp.arange(2)), None, 10)[1])(jax.random.PRNGKey(0))
    assert np.array_equal(np.asarray(steps.truncated).all(1), np.arange(1, 11) % 5 == 0)
    assert not np.asarray(steps.terminated).any()
    assert not np.allclose(np.asarray(steps.final_obs[4]), np.asarray(steps.obs[4]))  # the reset observation
    summary = msrl.train(EXAMPLES / "ppo_brax_inverted_pendulum.yaml",
                         [*QUICK, "run.seed=0", "run.total_env_steps=40000", 'env.kwargs={"episode_length": 100}',
                          "env.num_envs=8", "algorithm.hidden=[16]", "algorithm.rollout_len=16", "algorithm.epochs=2",
                          "algorithm.minibatches=2"], run_dir=tmp_path, on_iteration=reached(20, window=5))
    assert summary.rows[-1]["episode_length"] <= 100
    assert_reaches(tmp_path, 20, within=40000, window=5)


def test_a_misspelt_brax_keyword_is_named_with_the_one_meant_and_brax_imports_quietly():
    """In a fresh process (where Brax is imported): MuJoCo printed "Failed to import warp: No module named 'warp'"
    twice on its import, which reads as an error and is none; a misspelt keyword named Brax's PipelineEnv alone."""
    import subprocess
    import sys

    pytest.importorskip("brax")
    proc = subprocess.run([sys.executable, "-c", "from msrl.envs import make_env; "
                           "make_env('brax:inverted_pendulum', episode_lenght=100)"], capture_output=True, text=True)
    assert "Failed to import" not in proc.stdout + proc.stderr, proc.stdout
    assert re.search(r"ConfigError: env.kwargs: brax:inverted_pendulum rejected \{'episode_lenght': 100\}: TypeError: "
                     r".*\(did you mean 'episode_length'\? msrl's keys: episode_length, action_repeat; the env's: "
                     r"backend\)\n", proc.stderr), proc.stderr[-2000:]
    # a bad value of a key it has is no typo; what msrl checks itself is a whole number; one array observed
    for kwargs, says in (({"backend": "nope"}, r"^env.kwargs: brax:inverted_pendulum rejected \{'backend': 'nope'\}: "
                                               r"ValueError: backend should be in .* \(msrl's keys: "),
                         ({"episode_length": 2.5}, r"^env.kwargs.episode_length: must be a whole number >= 1, "
                                                   r"got 2.5$"),
                         ({"action_repeat": True}, r"^env.kwargs.action_repeat: must be a whole number >= 1, "
                                                   r"got True$"),
                         ({"obs_mode": "dict_state"}, r"^env.kwargs: brax:fast with \{'obs_mode': 'dict_state'\} "
                                                      r"observes a dict; msrl takes Brax envs whose observation")):
        with pytest.raises(msrl.ConfigError, match=says):
            make_env("brax:fast" if "obs_mode" in kwargs else "brax:inverted_pendulum", **kwargs)
    assert make_env("brax:fast", episode_length=20.0).env.episode_length == 20  # (YAML's 2e1)


def test_ppo_on_brax_ant_gives_fused_parameters_bitwise_on_any_split():
    """Brax's ant (8-dim actions) under single_learner_fine with 8 env workers of 1 env on threads, as fused(8)
    after 2 iterations. Fine's central acting stored log-probs 2 ulps from fused's: XLA's CPU code summed a
    Gaussian's 8 terms in another order inside fused's rollout than alone (acting now adds them in order); each
    worker steps its env alone (Brax steps in 16-env tiles: halfcheetah and ant rounded by the batch's size)."""
    pytest.importorskip("brax")
    from helpers import final_params, max_diff

    ppo = ["algorithm.name=ppo", "algorithm.rollout_len=2", "algorithm.epochs=1", "algorithm.minibatches=1",
           "algorithm.hidden=[16]", "env.id=brax:ant", 'env.kwargs={"episode_length": 1000}', "env.num_envs=8"]
    fused, _ = final_params(ppo, 2)
    fine, _ = final_params([*ppo, "policy.name=single_learner_fine", "policy.actors=8", "policy.backend=threads"], 2)
    assert max_diff(fused, fine) == 0.0


@pytest.mark.parametrize("mix, message", [
    ("obs_float16", (r"UsersEnv.step\(\) \(.*helpers.py:\d+\) returned observations float16\[4, 2\], but "
                     r"users:Walk's spec \(EnvSpec\) says float32\[2\] for each environment")),
    ("obs_3", r"returned observations float32\[4, 1\]"),
    ("obs_dict", r"returned observations a dict, but .*\n  hint: an observation is one array per environment: "
                 r"concatenate the parts"),
    ("reward_2d", r"returned rewards of shape \[4, 1\]; they must be one per environment: \[4\]"),
    ("done_float", r"returned episode ends \(done, or terminated and truncated\) of dtype float32; they must be bool"),
    ("four", r"returned \(state, 4 values\); its output must be an EnvStep or \(obs, reward, done\)"),
    ("python_bool", r"returned truncated flags of shape \[\]; they must be one per environment: \[4\]"),
    ("final_obs_1", r"returned final observations float32\[4, 1\], but observations float32\[4, 2\]: final_obs "
                    r"is each environment's last observation")])  # (a network's shape error in SAC/PPO's learner)
def test_a_users_env_that_breaks_its_contract_is_refused_naming_its_method(mix, message):
    """A jitted env's step is checked against its spec when the loop is compiled (not reported later as a
    network's shape error or a scan's carry mismatch); the error is raised at the loop's env_step."""
    from msrl.policies.fused import Fused

    with pytest.raises(msrl.CompileError, match=message) as info:
        msrl.compile(loops.Simple(), Fused(), UsersEnv(mix), 4)
    assert info.value.file == loops.__file__
    msrl.compile(loops.Simple(), Fused(), UsersEnv(), 4)


class _Counted(msrl.Wrapper):
    """A wrapper whose state is not the wrapped env's: it counts the steps beside it. ``reads`` its stats and
    episode counts reads through (a wrapper that forgets one: msrl.Wrapper hands the wrapped env its dict)."""

    def __init__(self, env, reads=("stats", "episode_counts")):
        super().__init__(env)
        self.reads = reads

    def init(self, key, env_ids):
        return {"inner": self.env.init(key, env_ids), "t": jnp.zeros((), jnp.int32)}

    def observe(self, state):
        return state, self.env.observe(state["inner"])[1]

    def step(self, state, action):
        inner, out = self.env.step(state["inner"], action)
        return {"inner": inner, "t": state["t"] + 1}, out

    def stats(self, state):
        return self.env.stats(state["inner"] if "stats" in self.reads else state)

    def episode_counts(self, state):
        return self.env.episode_counts(state["inner"] if "episode_counts" in self.reads else state)


@msrl.register_env("counted")
def _counted_stats_only(name, **kwargs):
    return _Counted(make_env(f"gymnax:{name}", **kwargs), ("stats",))


def test_a_wrapper_that_forgets_a_method_reading_its_state_is_named(tmp_path):
    """(A raw AttributeError from msrl's gymnax adapter, 49 lines, when it compiled; without episode_counts, read
    by msrl eval only, it trained, and msrl eval failed so.)"""
    from msrl.evaluate import evaluate
    from msrl.policies.fused import Fused

    with pytest.raises(msrl.CompileError, match=r"_Counted.stats\(state\) raised AttributeError: .* \(a "
                                                r"msrl.Wrapper whose state is not the wrapped env's overrides "):
        msrl.compile(loops.Simple(), Fused(), _Counted(make_env("gymnax:CartPole-v1"), ("episode_counts",)), 4)
    msrl.train(EXAMPLES / "ppo_cartpole.yaml", ["env.id=counted:CartPole-v1", "algorithm.rollout_len=32",  # (it
                                                "run.total_env_steps=256", "run.progress=false"], run_dir=tmp_path)
    with pytest.raises(msrl.ConfigError, match=r"_Counted.episode_counts\(state\) raised AttributeError: .* \(a "
                                               r"msrl.Wrapper whose state is not the wrapped env's overrides it too\) "
                                               r"\(.*test_envs.py:\d+\)$"):  # trains: only msrl eval reads them)
        evaluate(tmp_path, episodes=2)


class _NoStats(UsersEnv):
    stats = msrl.Environment.stats  # (as an env that defines none)


class _OtherStats(UsersEnv):
    def stats(self, state):
        return {"return_sum": 0.0, "count": 1}


@pytest.mark.parametrize("env, message", [
    (_NoStats, r"_NoStats defines no stats\(state\), the episode statistics msrl logs \(return_sum, finished, "
               r"episodes; optionally length_sum, nonfinite\)"),
    (_OtherStats, r"_OtherStats.stats\(state\) returns no finished, episodes; msrl logs episodes from a dict of "
                  r"return_sum, finished, episodes")])
def test_a_jitted_env_without_the_episode_statistics_msrl_logs_is_named_at_its_class(env, message):
    """(A bare NotImplementedError, or a KeyError: 'finished', from inside msrl once the program ran.)"""
    from msrl.policies.fused import Fused

    with pytest.raises(msrl.CompileError, match=message) as info:
        msrl.compile(loops.Simple(), Fused(), env(), 4)
    assert (info.value.file, info.value.line) == (__file__, inspect.getsourcelines(env)[1])


class _ResetsAtStarts(loops.Base):
    """A recurrent loop's read of where episodes start."""

    def train_step(self):
        obs = msrl.env_observe()
        starts = msrl.env_starts()
        out = msrl.agent_act(obs)
        msrl.env_step(out.action)
        return {"starts": starts.mean()}


class _KeepsFinalObs(loops.Base):
    """SAC's and TD3's read of the observation an ended episode reached."""

    def train_step(self):
        obs = msrl.env_observe()
        out = msrl.agent_act(obs)
        step = msrl.env_step(out.action)
        return {"final": step.final_obs.mean()}


def test_a_jitted_env_without_what_a_loop_reads_says_what_to_add():
    """Recurrent PPO on an env without starts() said `NotImplementedError ...: UsersEnv does not tell episode
    starts`, at msrl's line; SAC on one whose EnvStep has no final_obs did not say how to give it."""
    from msrl.policies.fused import Fused

    with pytest.raises(msrl.CompileError, match=r"UsersEnv defines no starts\(state\), which msrl.env_starts\(\) "
                                                r"calls .*: it returns \(state, bool \[N\]\)") as info:
        msrl.compile(_ResetsAtStarts(), Fused(), UsersEnv(), 4)
    assert (info.value.file, info.value.line) == (inspect.getsourcefile(UsersEnv), inspect.getsourcelines(UsersEnv)[1])
    with pytest.raises(msrl.CompileError, match=r"does not report the final observation of an episode .*EnvStep's "
                                                r"fifth argument, msrl.EnvStep\(obs, reward, terminated, truncated, "
                                                r"final_obs\)") as info:
        msrl.compile(_KeepsFinalObs(), Fused(), UsersEnv(), 4)
    assert info.value.file == __file__


def test_a_box_takes_numbers_or_arrays_for_its_bounds():
    """SAC read `(space.high > space.low).all()` of a Box(-1.0, 1.0, (1,)) a user wrote: 'bool' object has no
    attribute 'all'."""
    box = msrl.Box(-1, 2.0, 2)
    assert box.shape == (2,) and box.low.dtype == box.high.dtype == np.float32
    assert box.low.tolist() == [-1.0, -1.0] and box.high.tolist() == [2.0, 2.0]
    assert msrl.Box(np.array([-1.0, 0.0]), 1, (2,)).low.tolist() == [-1.0, 0.0]
    with pytest.raises(msrl.MsrlError, match=r"msrl.Box\(low, high, shape\): low and high must be numbers or "
                                             r"arrays of shape \(2,\), got \(3,\) and \(\)"):
        msrl.Box(np.zeros(3), 1.0, (2,))


class _ActsAsAColumn(loops.Base):
    """Hands the env one action per environment as a column, [N, 1], where CartPole takes [N] (gymnax's CartPole
    broadcast it to [N, N] without a word)."""

    def train_step(self):
        obs = msrl.env_observe()
        out = msrl.agent_act(obs)
        msrl.env_step(out.action[:, None])
        return {"acted": jnp.float32(1.0)}


class _ActsWithFloats(loops.Base):
    """Hands a Discrete env float actions (gymnax's CartPole took them without a word, then the loss was NaN)."""

    def train_step(self):
        obs = msrl.env_observe()
        out = msrl.agent_act(obs)
        msrl.env_step(out.action.astype(jnp.float32) + 0.5)
        return {"acted": jnp.float32(1.0)}


@pytest.mark.parametrize("env_id, loop, message", [
    ("gymnax:CartPole-v1", _ActsAsAColumn, r"msrl.env_step got actions shaped \[4, 1\], but gymnax:CartPole-v1's "
                                           r"actions are one integer for each environment"),
    ("gymnax:CartPole-v1", _ActsWithFloats, r"msrl.env_step got float32 actions, but gymnax:CartPole-v1's actions are "
                                            r"integers \(0..1\)\n  hint: hand it the sampled actions' indices"),
    ("gymnax:Pendulum-v1", loops.ActsOnly, r"msrl.env_step got actions shaped \[4\], but gymnax:Pendulum-v1's "
                                           r"actions are shaped \[1\] for each environment")])
def test_actions_not_shaped_as_the_env_takes_them_are_refused_at_the_loops_line(env_id, loop, message):
    from msrl.policies.fused import Fused

    with pytest.raises(msrl.CompileError, match=message) as info:
        msrl.compile(loop(), Fused(), make_env(env_id), 4)
    assert info.value.file.endswith(("test_envs.py", "loops.py")) and info.value.line


@pytest.mark.parametrize("example, hint", [("ppo_cartpole.yaml", "single_learner_coarse"),
                                           ("sac_pendulum.yaml", "replay_server")])  # (it said coarse, which
def test_a_host_env_under_fused_is_refused_naming_a_policy_that_runs_the_loop(example, hint):  # refuses SAC)
    from msrl.config import load_config

    cfg = load_config(EXAMPLES / example, ["env.id=gymnasium:" + ("CartPole-v1" if "ppo" in example else
                                                                  "Pendulum-v1")])
    with pytest.raises(msrl.CompileError, match=r"runs on the host \(numpy\), but policy 'fused' places it") as info:
        msrl.Session(cfg)
    assert info.value.hint.startswith(f"use policy.name={hint} (or single_learner_fine) with policy.backend=threads")


class TransitionOnly(UsersEnv):
    """Defines ``transition`` (what msrl.env_step calls) instead of ``step``."""

    def transition(self, state, action):
        return UsersEnv.step(self, state, action)

    def step(self, state, action):
        raise NotImplementedError


@pytest.mark.parametrize("env", [UsersEnv("int_done"), TransitionOnly()], ids=["int_done", "transition_only"])
def test_what_the_env_contract_check_lets_through(env):
    """Integer ends, and an env that defines ``transition`` itself, still run."""
    from msrl.policies.fused import Fused

    program = msrl.compile(loops.Simple(), Fused(), env, 4)
    with msrl.Session(program=program, seed=0) as session:
        assert np.isfinite(session.run(1)[0]["w"])


@pytest.mark.parametrize("name", ["Catch-bsuite", "FourRooms-misc"])
def test_gymnax_envs_whose_space_dtype_is_not_their_observations_compile_and_run(name):
    """Their spec says what reset gives (Catch's space says int32, its observations are float32)."""
    with msrl.Session(EXAMPLES / "ppo_cartpole.yaml", [f"env.id=gymnax:{name}", "algorithm.rollout_len=8",
                                                       *QUICK]) as session:
        assert np.isfinite(session.run(1)[0]["loss"])


def test_the_custom_env_example_learns_and_splits_over_actors_bitwise(tmp_path):
    """examples/custom_env.py, as the README shows it: registered by importing the file, it trains to the goal
    under fused, and 4 actors of 1 environment compute fused's parameters (msrl checks the env keeps to its rows)."""
    from helpers import final_params, max_diff

    example, base = str(EXAMPLES / "custom_env.py"), str(EXAMPLES / "ppo_cartpole.yaml")
    msrl.train(base, [f"run.imports=[{example}]", "env.id=walk:Line", "env.kwargs.length=5",
                      "run.total_env_steps=60000", "run.tensorboard=false", "run.progress=false"], run_dir=tmp_path)
    assert_reaches(tmp_path, 0.9, within=60000)  # the goal in 5 steps of 20: 1 - 4 x 0.01 at best, ~0.35 at first
    with open(tmp_path / "metrics.csv", newline="") as f:  # its stats give length_sum: episodes of 5 to 20 steps,
        lengths = [float(r["episode_length"]) for r in csv.DictReader(f)]  # at most 11 on average at a return of 0.9
    assert all(5 <= n <= 20 for n in lengths) and min(lengths) <= 11, lengths
    walk = [f"run.imports=[{example}]", "env.id=walk:Line", "algorithm.rollout_len=16"]
    fused, _ = final_params(walk, iterations=2, config=base)
    actors, _ = final_params([*walk, "policy.name=single_learner_coarse", "policy.backend=threads", "policy.actors=4",
                              "policy.envs_per_actor=1"], iterations=2, config=base)
    assert max_diff(fused, actors) == 0.0


def _wide_line(length: float = 3.0) -> msrl.Environment:
    """examples/custom_env.py's walk with 256 features an observation and a mean over them in the reward: XLA's CPU
    kernel of that mean depends on the rows' count (6.7e-8 in the parameters, 16 actors of 1 vs fused), which
    msrl.in_tiles makes one, as the README advises."""
    import sys

    from msrl.registry import import_user_module

    import_user_module(str(EXAMPLES / "custom_env.py"))  # (as run.imports does: once a process)
    line = sys.modules["custom_env"].Line

    class Wide(line):
        rowwise = True  # in tiles: each row the same on any batch

        def __init__(self, length):
            super().__init__(length)
            self.spec = msrl.EnvSpec("wide:Line", (256,), np.dtype(np.float32), msrl.Discrete(3))
            self.step = msrl.in_tiles(self.wide_step, 16)

        def _obs(self, state):
            return jnp.sin(state["x"][:, None] * jnp.arange(1, 257) * 0.37 + state["t"][:, None])

        def wide_step(self, state, action):
            state, out = line.step(self, state, action)
            reward = out.reward - jnp.mean(jnp.abs(out.obs - 0.3), axis=1)
            return state, msrl.EnvStep(out.obs, reward, out.terminated, out.truncated)

    return Wide(length)


def test_a_reduction_over_many_features_in_tiles_splits_bitwise():
    from helpers import final_params, max_diff

    try:
        msrl.register_env("wide")(lambda name, **kwargs: _wide_line(**kwargs))
    except msrl.ConfigError:  # (registered by an earlier run of this test in the process)
        pass
    wide, base = ["env.id=wide:Line", "env.num_envs=16", "algorithm.rollout_len=16"], EXAMPLES / "ppo_cartpole.yaml"
    fused, _ = final_params(wide, iterations=2, config=base)
    actors, _ = final_params([*wide, "policy.name=single_learner_coarse", "policy.backend=threads", "policy.actors=16",
                              "policy.envs_per_actor=1"], iterations=2, config=base)
    assert max_diff(fused, actors) == 0.0


def test_a_mujoco_env_without_mujoco_names_msrls_extra():
    """(Gymnasium's own message named its extra alone: `pip install "gymnasium[mujoco]"`.)"""
    import subprocess
    import sys

    code = ("import sys; sys.modules['mujoco'] = None\n"
            "import msrl\nfrom msrl.envs import make_env\n"
            "try:\n    make_env('gymnasium:HalfCheetah-v5')\nexcept msrl.ConfigError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    assert out.startswith("env.id: gymnasium:HalfCheetah-v5 cannot be made: MuJoCo is not installed") and \
        out.rstrip().endswith("(msrl's extra: pip install -e '.[mujoco]' in msrl's folder)"), out


class _Paid(msrl.Environment):
    """Its reward is the action it is given, within Box(3, 7); four steps an episode."""

    spec = msrl.EnvSpec("paid:Box", (1,), np.dtype(np.float32), msrl.Box(3.0, 7.0, (1,)))

    def init(self, key, env_ids):
        zeros = jnp.zeros(env_ids.shape[0])
        return {"t": zeros, "ret": zeros, "last": zeros, "episodes": zeros}

    def observe(self, s):
        return s, s["t"][:, None]

    reset = observe

    def step(self, s, action):
        t, ret = s["t"] + 1, s["ret"] + action[:, 0]
        done = t >= 4
        s = {"t": jnp.where(done, 0.0, t), "ret": jnp.where(done, 0.0, ret), "last": jnp.where(done, ret, s["last"]),
             "episodes": s["episodes"] + done}
        return s, msrl.EnvStep(s["t"][:, None], action[:, 0], done, jnp.zeros_like(done))

    def stats(self, s):
        finished = s["episodes"] > 0
        return {"return_sum": jnp.where(finished, s["last"], 0.0).sum(), "finished": finished.sum(),
                "episodes": s["episodes"].sum()}


@msrl.register_env("paid")
def _make_paid(name, **kwargs):
    return _Paid()


def test_a_box_of_ones_own_env_gets_its_actions_within_its_bounds(tmp_path):
    """PPO's Gaussian samples (around 0 at first) reached an env of one's own outside its Box(3, 7), in training
    and `msrl eval` (probe: 941 of 1536 out of bounds), while msrl's adapters and `msrl.load(...).act` clip. Now
    msrl.env_step and eval clip for every jitted env: each step pays 3 to 7. A Box or Discrete that cannot be
    (low > high, NaN, n < 1) is refused where it is made."""
    from msrl.evaluate import evaluate

    cfg = ["env.id=paid:Box", "env.num_envs=4", "algorithm.rollout_len=8", "algorithm.hidden=[8]", "run.seed=0",
           "run.total_env_steps=128", "run.checkpoint_every_steps=128", "run.progress=false", "run.tensorboard=false"]
    msrl.train(EXAMPLES / "ppo_pendulum.yaml", cfg, run_dir=tmp_path)
    with open(tmp_path / "metrics.csv", newline="") as f:
        returns = [float(r["episode_return"]) for r in csv.DictReader(f)]
    assert returns and all(12.0 <= r <= 28.0 for r in returns), returns
    assert 12.0 <= evaluate(tmp_path, episodes=2)["return_mean"] <= 28.0
    for make, text in [(lambda: msrl.Box(5.0, -2.0, (1,)), r"every low must be <= its high .* got low \[5.0\]"),
                       (lambda: msrl.Box(np.nan, 1.0, (1,)), r"neither NaN"),
                       (lambda: msrl.Discrete(0), r"an int >= 1; got 0"), (lambda: msrl.Discrete(2.5), r"got 2.5"),
                       (lambda: msrl.Box(-1.0, 1.0, (1,), np.float64), r"dtype=float64\): actions are float32"),  # (it
                       # was dropped without a word; a jitted env's float64 obs blamed its observe(), not the spec)
                       (lambda: msrl.EnvSpec("mine", (3,), np.float64, msrl.Discrete(2)),
                        r"obs_dtype <class 'numpy.float64'>: msrl trains in 32 bits")]:
        with pytest.raises(msrl.MsrlError, match=text):
            make()
