"""``envpool:`` host environments (EnvPool's C++ pools): the env contract, same-step auto-reset with the true final
observation, seeds by global index, and PPO under the host policies."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

import msrl
from msrl.config import load_config
from msrl.envs import make_env
from msrl.evaluate import evaluate

from helpers import EXAMPLES, QUICK, assert_reaches, max_diff, reached

envpool = pytest.importorskip("envpool")  # the test extra installs it (the `envpool` extra)

from msrl.envs.envpool_env import env_seeds


def _actions(env, rng, n):
    if env.spec.discrete:
        return rng.integers(0, env.spec.action_space.n, n).astype(np.int32)
    space = env.spec.action_space
    return rng.uniform(space.low, space.high, (n, *space.shape)).astype(np.float32)


@pytest.mark.parametrize("name, obs_shape, obs_dtype, kwargs", [
    ("CartPole-v1", (4,), np.float32, {}), ("Acrobot-v1", (6,), np.float32, {"max_episode_steps": 100}),
    ("Pendulum-v1", (3,), np.float32, {"max_episode_steps": 100}),
    ("MountainCarContinuous-v0", (2,), np.float32, {"max_episode_steps": 100}),
    ("Breakout-v5", (4, 84, 84), np.uint8, {}),
])
def test_envpool_env_contract(name, obs_shape, obs_dtype, kwargs):
    """Shapes and dtypes as the spec says (Atari frames stay uint8), finite values, episode stats."""
    env = make_env(f"envpool:{name}", **kwargs)
    spec = env.spec
    assert spec.id == f"envpool:{name}" and spec.obs_shape == obs_shape and spec.obs_dtype == obs_dtype
    assert not env.jittable
    state = env.init(jax.random.PRNGKey(0), np.arange(3))
    state, obs = env.observe(state)
    assert obs.shape == (3, *obs_shape) and obs.dtype == obs_dtype
    assert env.starts(state)[1].all()
    rng = np.random.default_rng(0)
    for _ in range(5 if name == "Breakout-v5" else 300):
        state, out = env.step(state, _actions(env, rng, 3))
        assert out.obs.shape == out.final_obs.shape == (3, *obs_shape)
        assert out.obs.dtype == out.final_obs.dtype == obs_dtype
        assert out.reward.shape == out.terminated.shape == out.truncated.shape == (3,)
        assert out.reward.dtype == np.float32 and out.terminated.dtype == out.truncated.dtype == np.bool_
        assert not (out.terminated & out.truncated).any()
        assert np.isfinite(out.reward).all() and np.isfinite(out.obs).all() and np.isfinite(out.final_obs).all()
    stats = env.stats(state)
    assert set(stats) == {"return_sum", "finished", "length_sum", "episodes", "nonfinite"}  # (0: raised at a step)
    if name != "Breakout-v5":
        assert stats["episodes"] >= 1
    env.close(state)


def test_envpool_bad_ids_and_kwargs_are_config_errors():
    with pytest.raises(msrl.ConfigError, match=r"env\.id.*envpool:CartPol-v1 is not an EnvPool environment.*"
                                              r"did you mean envpool:CartPole-v1"):
        make_env("envpool:CartPol-v1")
    with pytest.raises(msrl.ConfigError, match=r"env\.id.*not an EnvPool environment.*list_all_envs"):
        make_env("envpool:NoSuchThing-v0")
    with pytest.raises(msrl.ConfigError, match=r"env\.kwargs.*nope"):
        make_env("envpool:CartPole-v1", nope=1)
    with pytest.raises(msrl.ConfigError, match=r"env\.kwargs.*max_episode_steps"):
        make_env("envpool:CartPole-v1", max_episode_steps="long")
    for steps in (0, -5):  # EnvPool itself takes them, and ends every episode after one step
        with pytest.raises(msrl.ConfigError, match=rf"env\.kwargs\.max_episode_steps: must be a whole number >= 1, "
                                                   rf"got {steps}"):
            make_env("envpool:CartPole-v1", max_episode_steps=steps)
    # Atari kwargs EnvPool takes and then crashes the process on (a segfault, an OpenCV abort) or ignores
    for key, value, text in [("noop_max", 0, "a whole number >= 1"), ("img_height", 0, "a whole number >= 1"),
                             ("img_width", -3, "a whole number >= 1"),
                             ("repeat_action_probability", 2.0, r"a probability in \[0, 1\]"),
                             ("num_threads", -3, r"a whole number >= 0 \(0: EnvPool's default\)")]:  # (an abort)
        with pytest.raises(msrl.ConfigError, match=rf"^env\.kwargs\.{key}: must be {text}, got {value}$"):
            make_env("envpool:Breakout-v5", **{key: value})
    # (pybind's TypeError was cut to "incompatible constructor arguments. The following argument types are ...:")
    with pytest.raises(msrl.ConfigError, match=r"^env\.kwargs\.episodic_life: envpool:Breakout-v5 takes a bool "
                                              r"\(default False\), got 'yes'$"):
        make_env("envpool:Breakout-v5", episodic_life="yes")
    with pytest.raises(msrl.ConfigError, match=r"^env\.kwargs\.episodic_lif: envpool:Breakout-v5 takes no "
                                              r"'episodic_lif' \(did you mean 'episodic_life'\?\); it takes "
                                              r"base_path, "):
        make_env("envpool:Breakout-v5", episodic_lif=True)  # (keyed env.kwargs, EnvPool's TypeError as it was)
    with pytest.raises(msrl.ConfigError, match=r"env\.kwargs.*\['num_envs', 'seed'\] are set by msrl"):
        make_env("envpool:CartPole-v1", seed=1, num_envs=3)
    with pytest.raises(msrl.ConfigError, match=r"env\.id.*Discrete observation space"):
        make_env("envpool:Taxi-v3")


def test_gymnasium_envs_envpool_lacks_keep_working():
    """An id EnvPool lacks is an error that points to ``gymnasium:``, where it runs."""
    import loops  # noqa: F401 - registers gymnasium's MsrlShifty-v0

    with pytest.raises(msrl.ConfigError, match=r"not an EnvPool environment.*write gymnasium:MsrlShifty-v0"):
        make_env("envpool:MsrlShifty-v0")
    env = make_env("gymnasium:MsrlShifty-v0")
    state = env.init(jax.random.PRNGKey(0), np.arange(2))
    state, out = env.step(state, np.zeros(2, np.int64))
    assert out.obs.shape == (2, 4)


def _raw_pool(name, seed, **kwargs):
    return envpool.make(name, env_type="gymnasium", num_envs=1, seed=[seed], **kwargs)


@pytest.mark.parametrize("name, kwargs, ends", [("CartPole-v1", {}, "terminated"),
                                                ("CartPole-v1", {"max_episode_steps": 7}, "truncated"),
                                                ("Pendulum-v1", {"max_episode_steps": 9}, "truncated"),
                                                ("Breakout-v5", {"episodic_life": True}, "terminated")])
def test_envpool_resets_in_the_same_step_with_the_final_observation(name, kwargs, ends):
    """EnvPool itself resets an env on the step *after* its episode ended (that step ignores its action and pays
    0). Through msrl the ending step already returns the next episode's first observation, with the ended one's
    last as final_obs, and every step applies its action. Checked against a raw one-env EnvPool pool with the same
    seed, given the same actions plus one extra (reset) step after each of its episodes: the observations,
    rewards and flags agree exactly, and the adapter's reset gives the very state EnvPool's auto-reset gives —
    with Breakout's episodic_life too, where it goes on with the same game after a lost life (a pool.reset
    would start a new one)."""
    env = make_env(f"envpool:{name}", **kwargs)
    key = jax.random.PRNGKey(5)
    state = env.init(key, np.arange(2))
    raws = [_raw_pool(name, s, **kwargs) for s in env_seeds(key, np.arange(2))]
    for i, raw in enumerate(raws):
        np.testing.assert_array_equal(raw.reset()[0][0], state.obs[i])
    rng = np.random.default_rng(1)
    ended_count = 0
    lives = []
    for _ in range(120):
        action = _actions(env, rng, 2)
        state, out = env.step(state, action)
        assert not getattr(out, "truncated" if ends == "terminated" else "terminated").any()
        for i, raw in enumerate(raws):
            o, r, te, tr, info = raw.step(action[i:i + 1])
            np.testing.assert_array_equal(o[0], out.final_obs[i])
            assert r[0] == out.reward[i] and bool(te[0] and not tr[0]) == out.terminated[i] and tr[0] == out.truncated[i]
            if te[0] or tr[0]:
                ended_count += 1
                o, r, *_, after = raw.step(action[i:i + 1])  # EnvPool's reset step: reward 0, the action ignored
                assert r[0] == 0.0
                lives += list(after.get("lives", []))
                np.testing.assert_array_equal(o[0], out.obs[i])
                assert not np.array_equal(out.obs[i], out.final_obs[i])
            else:
                np.testing.assert_array_equal(out.obs[i], out.final_obs[i])
    assert ended_count >= 4
    if name == "Breakout-v5":  # a life lost, the game goes on
        assert ended_count == len(lives) and all(0 < n < 5 for n in lives), lives
    if ends == "truncated":
        limit = kwargs["max_episode_steps"]
        assert env.stats(state)["episodes"] == 2 * (120 // limit)


@pytest.mark.parametrize("name", ["CartPole-v1", "Pendulum-v1"])
def test_envpool_streams_depend_on_global_index_only(name):
    """What holds: env g's seed is SeedSequence([run key, g]) and EnvPool seeds each env of a pool with its own
    seed from the list, so env g steps the same (bitwise) whether its pool holds envs 0..7 or 4..7 — splitting
    8 envs as 2 actors x 4 gives the streams of 1 x 8."""
    env = make_env(f"envpool:{name}")
    key = jax.random.PRNGKey(3)
    full = env.init(key, np.arange(8))
    halves = [env.init(key, np.arange(0, 4)), env.init(key, np.arange(4, 8))]
    np.testing.assert_array_equal(full.obs, np.concatenate([h.obs for h in halves]))
    rng = np.random.default_rng(2)
    for _ in range(250):
        action = _actions(env, rng, 8)
        full, out = env.step(full, action)
        parts = []
        for j, h in enumerate(halves):
            halves[j], o = env.step(h, action[4 * j:4 * j + 4])
            parts.append(o)
        for field in ("obs", "reward", "terminated", "truncated", "final_obs"):
            np.testing.assert_array_equal(getattr(out, field), np.concatenate([getattr(p, field) for p in parts]))
    assert env.stats(full)["episodes"] >= 1
    assert not np.array_equal(env.init(jax.random.PRNGKey(4), np.arange(8)).obs, env.init(key, np.arange(8)).obs)


@functools.cache
def _ppo_run(overrides: tuple[str, ...], iterations: int) -> tuple:
    cfg = load_config(EXAMPLES / "ppo_cartpole_envpool.yaml",
                      ["run.seed=0", "algorithm.rollout_len=16", "algorithm.epochs=2", "algorithm.minibatches=2",
                       *QUICK, *overrides])
    with msrl.Session(cfg, iterations_per_dispatch=iterations) as session:
        rows = session.run(iterations)
        return session.params(), rows


def _ppo_params(overrides, iterations=3):
    """Parameters and rows of the shrunk example (a run is made once per test module: tests only read them)."""
    return _ppo_run(tuple(overrides), iterations)


def test_ppo_envpool_same_parameters_however_the_envs_are_split_or_stepped():
    """The host-env conformance rule. On the host (``env.xla=false``): single_learner_coarse with 2 actors x 4 envs,
    with 1 actor x 8 envs, and single_learner_fine with 2 env workers. Stepped from inside the jitted programs
    (``env.xla=true``): fused (the reference), and coarse with 2 actors x 4 envs. All give the same parameters,
    bitwise, and see the same episodes."""
    host = ["env.xla=false"]
    runs = {"coarse 2x4": _ppo_params([*host, "policy.actors=2", "policy.envs_per_actor=4"]),
            "coarse 1x8": _ppo_params([*host, "policy.actors=1", "policy.envs_per_actor=8"]),
            "fine": _ppo_params([*host, "policy.name=single_learner_fine", "policy.actors=2", "policy.envs_per_actor=4"]),
            "fused xla": _ppo_params(["policy.name=fused", "policy.backend=jax"]),
            "coarse 2x4 xla": _ppo_params(["policy.actors=2", "policy.envs_per_actor=4"])}
    ref, ref_rows = runs["fused xla"]
    for name, (params, rows) in runs.items():
        assert max_diff(ref, params) == 0.0, name
        assert [r["episodes"] for r in rows] == [r["episodes"] for r in ref_rows], name
    assert max_diff(ref, jax.tree.map(np.zeros_like, ref)) > 1e-4  # it trained
    assert ref_rows[-1]["episodes"] > 0


def test_a_restored_envpool_xla_run_restarts_its_episodes_under_fused_as_under_coarse():
    """A restore (a resume) starts the pools' episodes afresh, seeded for the snapshot's iteration: fused did not
    (it kept the pools it had), so a resumed fused run left coarse's numbers."""
    def restored(overrides):
        cfg = load_config(EXAMPLES / "ppo_cartpole_envpool.yaml", ["run.seed=0", "algorithm.rollout_len=16",
                                                                    "algorithm.epochs=1", *QUICK, *overrides])
        with msrl.Session(cfg) as session:
            session.run(2)
            snap = session.snapshot(skip=("env",))
        with msrl.Session(cfg) as session:
            session.restore(snap)
            rows = session.run(2)
            return session.params(), rows

    (fused, fused_rows), (coarse, coarse_rows) = (restored(["policy.name=fused", "policy.backend=jax"]),
                                                  restored(["policy.actors=2", "policy.envs_per_actor=4"]))
    assert max_diff(fused, coarse) == 0.0
    assert [r["episode_return"] for r in fused_rows] == [r["episode_return"] for r in coarse_rows]


@pytest.mark.parametrize("name, kwargs", [("CartPole-v1", {}), ("Pendulum-v1", {}),
                                          ("HalfCheetah-v4", {"max_episode_steps": 100}),
                                          ("Breakout-v5", {"episodic_life": True, "reward_clip": True})])
def test_envpool_xla_steps_every_env_as_the_host_adapter_does(name, kwargs):
    """``env.xla``: the pool stepped from a jitted step gives bitwise the host adapter's observations, rewards,
    terminations, truncations (time limits) and final observations, the same episode starts (an Atari life) and
    the same episode statistics (Atari: whole games, raw scores). MuJoCo's pool takes float64 actions and returns
    float64 observations, which cross as uint32 word pairs (no x64)."""
    host, xla = make_env(f"envpool:{name}", **kwargs), make_env(f"envpool:{name}", xla=True, **kwargs)
    assert xla.jittable and xla.host_simulator and (xla.spec.id, xla.spec.obs_shape) == (host.spec.id, host.spec.obs_shape)
    key, ids, rng = jax.random.PRNGKey(3), np.arange(2, 7), np.random.default_rng(0)
    hs, xs, step, ends = host.init(key, ids), xla.init(key, ids), jax.jit(xla.transition), 0
    assert np.array_equal(host.observe(hs)[1], np.asarray(xla.observe(xs)[1]))
    for _ in range(450):
        action = _actions(host, rng, len(ids))
        hs, h = host.transition(hs, action)
        xs, x = step(xs, action)
        for field in ("obs", "reward", "terminated", "truncated", "final_obs"):
            assert np.array_equal(np.asarray(getattr(h, field)), np.asarray(getattr(x, field))), field
        assert np.array_equal(host.starts(hs)[1], np.asarray(xla.starts(xs)[1]))
        ends += int((h.terminated | h.truncated).sum())
    assert ends >= 5
    assert {k: float(v) for k, v in host.stats(hs).items()} == {k: float(v) for k, v in xla.stats(xs).items()}
    xla.close(xs)


def test_float64_words_convert_as_numpy_does():
    """``env.xla``'s 64-bit crossing: float32 -> float64 words exactly; float64 words -> float32 as numpy's ``astype``
    (round to nearest, ties to even; overflow to infinity; NaN stays NaN), except magnitudes below float32's smallest
    normal number, which become a zero of the same sign."""
    from msrl.envs.envpool_env import _from_wire, _to_wire

    f64 = np.dtype(np.float64)
    small = np.array([0.0, -0.0, 1.0, -1.5, 3.4028235e38, 1e-30, np.inf, -np.inf, np.nan, 1.1754944e-38, -7e-20],
                     np.float32)
    words = np.asarray(_to_wire(small, f64))
    assert np.array_equal(words.reshape(-1).view(np.float64), small.astype(np.float64), equal_nan=True)
    rng = np.random.default_rng(0)
    values = np.concatenate([rng.normal(size=50_000) * 10.0 ** rng.integers(-45, 45, 50_000),
                             [0.0, -0.0, 1e300, -1e300, np.inf, -np.inf, np.nan, 1 + 2**-24, 1 + 3 * 2**-24,
                              1 + 2**-24 + 2**-50, 3.4028235677973366e38, 3.4028235e38 * (1 + 2**-25)]])
    got = np.asarray(_from_wire(values.view(np.uint32).reshape(-1, 2), f64))
    with np.errstate(over="ignore"):
        want = values.astype(np.float32)
    want = np.where(np.abs(want) < np.finfo(np.float32).tiny, np.copysign(np.float32(0), want), want)
    assert np.array_equal(got, want, equal_nan=True) and np.array_equal(np.signbit(got), np.signbit(want))


def test_envpool_xla_refuses_what_it_cannot_do():
    """Clear errors on ``env.xla``: an id that is not EnvPool's, several seeds in one jax program (a pool cannot be
    batched) and a loop that resets every env."""
    with pytest.raises(msrl.ConfigError, match="env.xla"):
        msrl.build(load_config(EXAMPLES / "ppo_cartpole.yaml", ["env.xla=true"]))
    one_seed = "run.num_seeds: envpool:CartPole-v1's simulators train one seed per run"
    with pytest.raises(msrl.ConfigError, match=one_seed):  # (it said: place the envs on threads, where the hint
        _ppo_params(["policy.name=fused", "policy.backend=jax", "run.num_seeds=2"])  # was: use the jax backend)
    with pytest.raises(msrl.ConfigError, match=one_seed):
        _ppo_params(["run.num_seeds=2"])
    with pytest.raises(msrl.ConfigError, match="env.xla.*msrl.env_reset"):
        make_env("envpool:CartPole-v1", xla=True).reset(None)


def test_envpool_under_fused_is_a_compile_error():
    with pytest.raises(msrl.CompileError, match="single_learner_coarse"):
        msrl.build(load_config(EXAMPLES / "ppo_cartpole.yaml", ["env.id=envpool:CartPole-v1"]))


def test_ppo_envpool_cartpole_threads_reaches_475(tmp_path):
    """examples/ppo_cartpole_envpool.yaml learns: a 5-iteration mean return of 475 within 300k steps (seed 0 first
    gets there near 103k; the run stops there)."""
    summary = msrl.train(EXAMPLES / "ppo_cartpole_envpool.yaml", ["run.progress=false"], run_dir=tmp_path,
                         on_iteration=reached(475))
    assert summary["env_steps"] <= 300_000 and summary["policy"] == "single_learner_coarse"
    assert_reaches(tmp_path, 475, within=300_000)


def test_ppo_nature_cnn_on_envpool_breakout_trains(tmp_path):
    """examples/ppo_breakout_envpool.yaml, shrunk (2 actors x 2 envs, 8-step rollouts): uint8 frames from EnvPool
    through the actors into the jitted learner; finite losses and every parameter array updated."""
    overrides = ["run.seed=0", "algorithm.rollout_len=8", "algorithm.epochs=1", "algorithm.minibatches=2",
                 "env.num_envs=4", "policy.actors=2", "policy.envs_per_actor=2", *QUICK]
    with msrl.Session(EXAMPLES / "ppo_breakout_envpool.yaml", overrides, iterations_per_dispatch=2) as session:
        spec = session.program.env.spec
        assert spec.obs_dtype == np.uint8 and spec.obs_shape == (4, 84, 84)
        before = session.params()
        rows = session.run(2)
        after = session.params()
    assert len(rows) == 2 and all(np.isfinite(r["loss"]) for r in rows)
    moved = [np.array_equal(np.asarray(x), np.asarray(y)) for x, y in
             zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True)]
    assert not any(moved)


def test_eval_of_an_atari_run_scores_whole_games_as_its_rows_do(tmp_path):
    """With ``episodic_life`` the learner sees lives, but ``msrl eval`` scores whole games with the raw score, as
    the training's rows do (it stopped at the first lost life, with clipped rewards)."""
    overrides = ["run.seed=0", "algorithm.rollout_len=8", "algorithm.epochs=1", "algorithm.minibatches=1",
                 "env.num_envs=2", "policy.actors=1", "policy.envs_per_actor=2", "run.total_env_steps=16", *QUICK,
                 "run.checkpoint_every_steps=16"]
    msrl.train(EXAMPLES / "ppo_breakout_envpool.yaml", overrides, run_dir=tmp_path)
    out = evaluate(tmp_path, episodes=2)
    assert out["env_steps"] >= 2 * 100, out  # 5 lives each (a lost life takes ~24 steps); one life ended at 24-72
    policy = msrl.load(tmp_path)
    frames = np.random.default_rng(0).integers(0, 256, (3, 4, 84, 84), dtype=np.uint8)
    assert policy.act(frames).shape == (3,) and policy.act(frames.astype(np.float32)).shape == (3,)
    with pytest.raises(ValueError, match="pixels 0..255 as the env returns them .* pass them unscaled"):
        policy.act(frames.astype(np.float32) / 255)  # (acted on them, divided by 255 again, without a word)
    with pytest.raises(ValueError, match="pixels 0..255 as the env returns them .* pass them unscaled"):
        policy.act((frames[0] / 255).tolist())  # (a list was cut to uint8 first: 0s and 1s, acted on)
    assert policy.act(frames[0].tolist()) == policy.act(frames[0])
    with pytest.raises(ValueError, match=r"^act: observations of envpool:Breakout-v5 are pixels 0..255 as the env "
                                         r"returns them, got 765$"):  # (numpy's OverflowError, from a list)
        policy.act((frames[0].astype(int) * 3 + 3).clip(0, 765).tolist())


def test_ppo_envpool_on_ray_actors_matches_threads(ray_cluster):
    """EnvPool pools made inside Ray actor processes: single_learner_coarse 2 x 4 on ray gives the parameters of
    threads (to 1e-5, the ray backend's tolerance) and the same episodes. With ``env.xla`` each multi_learner
    replica on ray steps its own pool inside its program (a vmap of one replica per process)."""
    threads, threads_rows = _ppo_params(["policy.actors=2", "policy.envs_per_actor=4"])
    ray, ray_rows = _ppo_params(["policy.actors=2", "policy.envs_per_actor=4", "policy.backend=ray",
                                 "policy.actor_backend=ray"])
    assert max_diff(threads, ray) <= 1e-5
    assert [r["episodes"] for r in threads_rows] == [r["episodes"] for r in ray_rows]
    learners, rows = _ppo_params(["policy.name=multi_learner", "policy.backend=ray", "policy.learners=2"], iterations=2)
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(learners)) and max_diff(threads, learners) > 0
    assert rows[-1]["episodes"] > 0


def test_envpool_atari_logs_whole_games_while_the_learner_sees_lives():
    """With ``episodic_life`` each lost life is a ``terminated`` step for the learner (and an episode start), but the
    game goes on; the logged episodes are whole games, scored with the raw reward: several lives per game."""
    env = make_env("envpool:Breakout-v5", episodic_life=True, reward_clip=True)
    state, rng, lives_lost = env.init(jax.random.PRNGKey(0), np.arange(2)), np.random.default_rng(0), 0
    for _ in range(1000):
        state, out = env.step(state, _actions(env, rng, 2))
        assert (env.starts(state)[1] == (out.terminated | out.truncated)).all()
        lives_lost += int(out.terminated.sum())
    stats = env.stats(state)
    assert stats["episodes"] >= 2 and lives_lost >= 3 * stats["episodes"], (stats, lives_lost)
    assert stats["return_sum"] >= 0 and stats["length_sum"] > 100 * stats["finished"]


def test_a_users_env_over_an_xla_pool_is_refused_where_replicas_hold_a_share_unless_it_vouches():
    """Its simulators are on the host: the row check cannot trace it, and it was skipped (a wrapper drawing noise
    from one key for all environments trained differently under coarse than under fused, without a word)."""
    import loops
    from msrl.envs.envpool_env import EnvPoolXlaEnv
    from msrl.policies.single_learner import SingleLearnerCoarse

    class Noisy(EnvPoolXlaEnv):  # a subclass
        def observe(self, state):
            state, obs = super().observe(state)
            return state, obs + 0.01 * jax.random.normal(jax.random.PRNGKey(0), obs.shape)  # one key for all

    class NoisyWrapper(msrl.Wrapper):  # a wrapper: it forwards the pool's host simulators (what broke without it)
        def observe(self, state):
            state, obs = self.env.observe(state)
            return state, obs + 0.01 * jax.random.normal(jax.random.PRNGKey(0), obs.shape)

    for noisy in (Noisy("CartPole-v1"), NoisyWrapper(make_env("envpool:CartPole-v1", xla=True))):
        name = type(noisy).__name__
        with pytest.raises(msrl.CompileError, match=rf"steps each of its 2 'actor' replicas' share of the 4 "
                                                    rf"environments alone, but {name} \(.*test_envpool.py:\d+\) "
                                                    r"holds simulators of the host") as info:
            msrl.compile(loops.Simple(), SingleLearnerCoarse(actors=2), noisy, 4)
        assert "set the env's `rowwise = True` if it does" in info.value.hint
        msrl.compile(loops.Simple(), SingleLearnerCoarse(actors=1), noisy, 4)  # one actor holds them all
    msrl.compile(loops.Simple(), SingleLearnerCoarse(actors=2), make_env("envpool:CartPole-v1", xla=True), 4)
