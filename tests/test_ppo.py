"""PPO learns: CartPole to >= 475 within 300k steps under `fused`; continuous and image observations run;
PPO and A2C bootstrap a truncated episode when asked."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import msrl

from helpers import EXAMPLES, assert_pendulum_run, assert_reaches, final_params, reached, max_diff, short_run


def test_ppo_cartpole_reaches_475_within_300k_steps(tmp_path):
    summary = msrl.train(EXAMPLES / "ppo_cartpole.yaml", ["run.seed=0", "run.progress=false"], run_dir=tmp_path,
                         on_iteration=reached(475))
    assert summary["env_steps"] <= 300_000
    assert_reaches(tmp_path, 475, within=300_000)


def test_ppo_continuous_actions_pendulum():
    """4 iterations of 16 envs x 128 steps: each env finishes two 200-step episodes; the Gaussian policy
    narrows (its log std falls from 0, no entropy bonus) and the critic's loss falls."""
    before, after, rows, _ = short_run(EXAMPLES / "ppo_pendulum.yaml", ["run.total_env_steps=8192"], 4)
    assert_pendulum_run(before, after, rows, episodes=32)
    assert float(after["params"]["log_std"][0]) < -0.01  # seeds 0-4 end at -0.03 .. -0.11
    assert rows[-1]["value_loss"] < rows[0]["value_loss"]  # seeds 0-4: 10-28 % lower


def test_ppo_image_observations_minatar():
    """Breakout-MinAtar's 10x10x4 images reach both networks flattened, and the first layers' weights
    (the ones that see the pixels) learn."""
    before, after, rows, spec = short_run(EXAMPLES / "ppo_cartpole.yaml",
                                          ["env.id=gymnax:Breakout-MinAtar", "run.total_env_steps=1024",
                                           "algorithm.rollout_len=64"], 4)
    assert spec.obs_shape == (10, 10, 4) and spec.action_space.n == 3
    kernels = {jax.tree_util.keystr(path): (x, y) for (path, x), y in
               zip(jax.tree_util.tree_leaves_with_path(before), jax.tree.leaves(after), strict=True) if x.ndim == 2}
    first = {k: xy for k, xy in kernels.items() if xy[1].shape == (10 * 10 * 4, 64)}
    assert len(first) == 2, {k: y.shape for k, (_, y) in kernels.items()}  # the actor's and the critic's
    assert any(y.shape == (64, 3) for _, y in kernels.values())  # the logits of Breakout's 3 actions
    for name, (x, y) in first.items():  # the weights that see the pixels learn
        assert max_diff(x, y) > 1e-3, name
    assert rows[-1]["env_steps"] == 1024 and rows[-1]["episodes"] > 0
    assert all(np.isfinite(r["loss"]) and np.isfinite(r["entropy"]) for r in rows)
    finished = [r["episode_return"] for r in rows if r["episodes"] > 0]
    assert finished and all(np.isfinite(r) and r >= 0 for r in finished), finished  # a brick pays 1


def test_nature_cnn_refuses_what_is_not_a_frame_stack():
    import pytest

    from msrl.config import load_config

    for overrides, key in ((["algorithm.network=nature_cnn"], "algorithm.network"),  # CartPole: 4 numbers
                           (["algorithm.network=nature_cnn", "env.id=gymnax:Breakout-MinAtar"], "algorithm.network"),
                           (["algorithm.name=recurrent_ppo", "algorithm.network=nature_cnn"], "algorithm.network")):
        with pytest.raises(msrl.ConfigError) as e:
            msrl.build(load_config(EXAMPLES / "ppo_cartpole.yaml", overrides))
        assert e.value.key == key, e.value
    from types import SimpleNamespace

    from msrl.algorithms.ppo import PPO, PPOConfig

    images = msrl.EnvSpec("users:Img", (48, 48, 3), np.dtype(np.uint8), msrl.Discrete(2))  # Gymnasium's layout
    with pytest.raises(msrl.ConfigError, match=r"observations are \[48, 48, 3\], images with their channels last: "
                                               r"make the env give them channels first \(np.transpose"):
        PPO.network(SimpleNamespace(cfg=PPOConfig(network="nature_cnn")), images)


def test_nature_cnn_scales_bytes_and_acts_alike_on_any_split():
    """uint8 frame stacks [C, H, W] in, logits and values out; the rows of a batch come out the same whether
    acted on together or in parts, so actors' env splits change no number."""
    import jax.numpy as jnp

    from msrl.components import acting
    from msrl.rl import NatureCNN

    net = NatureCNN(action_dim=4, discrete=True)
    frames = jax.random.randint(jax.random.key(0), (6, 4, 36, 36), 0, 256).astype(jnp.uint8)  # the smallest it takes
    params = jax.jit(net.init)(jax.random.key(1), frames[0])  # one compile (eagerly: one per patch slice)
    apply = jax.jit(lambda p, x: acting(net.apply, p, x))
    logits, value = apply(params, frames)
    assert logits.shape == (6, 4) and value.shape == (6,) and np.isfinite(logits).all() and np.isfinite(value).all()
    np.testing.assert_allclose(apply(params, frames.astype(jnp.float32))[1], value, rtol=1e-6)  # bytes scaled inside
    for parts in ([2, 4], [3, 3], [1, 5], [1] * 6):  # (parts of 1 were 1e-7 apart: a 1 x 1 last layer's product)
        split = [apply(params, f) for f in np.split(np.asarray(frames), np.cumsum(parts)[:-1])]
        assert (np.concatenate([s[0] for s in split]) == logits).all() and (np.concatenate([s[1] for s in split]) == value).all()


def test_dense_acts_alike_on_any_split():
    """msrl.rl.Dense, while acting, gives each row the same bits whatever the number of rows (XLA's CPU dot alone
    does not: its kernel, chosen by the product's shape, put a row 1.4e-9 apart on 4 rows vs 8 for CartPole's 2
    logits on an AVX2 machine, and ~1e-7 apart on 1 row vs 64 of a 32-column layer or 1 row vs 8 of a 256 x 256
    one on an AVX-512 machine, enough to make 2 actors x 4 envs, or 8 x 1, differ from 8 envs); learning is
    nn.Dense's plain product, under nn.Dense's names."""
    import functools

    import flax.linen as nn
    import jax.numpy as jnp

    from msrl.components import acting
    from msrl.rl import Dense

    for width in (4, 256):  # the observation, a hidden layer of SAC's
        x = jax.random.normal(jax.random.key(0), (64, width))
        for features in (1, 2, 18, 32, 64, 256):
            params = nn.Dense(features).init(jax.random.key(1), x)  # the same names and shapes
            act = jax.jit(functools.partial(acting, Dense(features).apply))
            assert (jax.jit(Dense(features).apply)(params, x) == jax.jit(nn.Dense(features).apply)(params, x)).all()
            for rows in (8, 64):
                whole = act(params, x[:rows])
                for part in (1, 2, 3, 4, rows // 2):
                    split = np.concatenate([act(params, x[i:min(i + part, rows)]) for i in range(0, rows, part)])
                    assert (split == whole).all(), (width, features, rows, part)
            # leading axes (environments x agents) are rows too
            assert (act(params, x.reshape(8, 8, width)) == act(params, x).reshape(8, 8, features)).all()
            half, half_flax = (jax.jit(cls(features, dtype=jnp.bfloat16).apply)(params, x) for cls in (Dense, nn.Dense))
            assert half.dtype == half_flax.dtype == jnp.bfloat16 and (half == half_flax).all()  # its dtype, as nn.Dense


def test_msrls_loops_unroll_as_the_environment_says_and_refuse_a_bad_value(monkeypatch):
    """On an accelerator msrl's scans (the loop's own, GAE, the minibatch updates) run several steps per iteration
    of XLA's while loop where a step is small (``msrl.backend.scan``); MSRL_SCAN_UNROLL chooses it anywhere."""
    from msrl.backend import UNROLL_MAX_EQNS
    from msrl.compiler import _scan
    from msrl.rl import gae, scan

    def unrolls(fn, *args):
        return [e.params["unroll"] for e in jax.make_jaxpr(fn)(*args).jaxpr.eqns if e.primitive.name == "scan"]

    x = np.ones((16, 4), np.float32)
    body = lambda c, x: (c + x, c)  # noqa: E731
    monkeypatch.delenv("MSRL_SCAN_UNROLL", raising=False)
    assert unrolls(lambda x: gae(x, x, x, x[0], 0.99, 0.95), x) == [1]  # on CPU: none
    monkeypatch.setenv("MSRL_SCAN_UNROLL", "8")
    assert unrolls(lambda x: gae(x, x, x, x[0], 0.99, 0.95), x) == [8]
    assert unrolls(lambda x: scan(body, x[0], x), x) == unrolls(lambda x: _scan(body, x[0], x, 16), x) == [8]
    monkeypatch.setenv("MSRL_SCAN_UNROLL", "auto")  # as on an accelerator: small steps only
    assert unrolls(lambda x: scan(body, x[0], x), x) == [8] and unrolls(lambda x: _scan(body, x[0], x, 16), x) == [4]

    def large(c, x):  # more operations than msrl.backend.UNROLL_MAX_EQNS: its loop is not unrolled
        for _ in range(UNROLL_MAX_EQNS + 1):
            c = c * x
        return c, c

    assert unrolls(lambda x: scan(large, x[0], x), x) == unrolls(lambda x: _scan(large, x[0], x, 16), x) == [1]
    monkeypatch.setenv("MSRL_SCAN_UNROLL", "0")
    with pytest.raises(msrl.ConfigError, match="MSRL_SCAN_UNROLL: '0' is neither a whole number of steps >= 1"):
        scan(body, x[0], x)


def test_minibatch_shuffle_is_a_uniform_permutation():
    """The learners' shuffle (msrl.rl.permutation, a packed sort): every size gives an order of all rows, and over
    60k keys each of the 6 orders of 3 rows comes up 1/6 of the time (within 4.4 standard deviations)."""
    import collections

    from msrl.rl import permutation

    for n in (1, 2, 3, 512, 2048, 65536, 70000):  # 70000: more than 16 index bits, jax.random.permutation's sort
        order = np.asarray(jax.jit(permutation, static_argnums=1)(jax.random.PRNGKey(n), n))
        assert order.dtype == np.int32 and np.array_equal(np.sort(order), np.arange(n))
    orders = jax.vmap(lambda k: permutation(k, 3))(jax.random.split(jax.random.PRNGKey(0), 60000))
    counts = collections.Counter(map(tuple, np.asarray(orders).tolist()))
    assert len(counts) == 6 and all(abs(c - 10000) < 400 for c in counts.values())


def test_a_session_run_past_the_total_holds_the_annealed_learning_rate_at_zero(capsys):
    """``anneal_lr`` decays the rate to 0 over run.total_env_steps; a Session run past it keeps the rate at 0 (it
    went negative: the policy climbed its loss), and says once that the schedules have ended."""
    with msrl.Session(EXAMPLES / "ppo_cartpole.yaml", ["run.seed=0", "run.total_env_steps=1024",
                                                       "env.num_envs=4"]) as session:
        session.run(2)  # 2 x 4 envs x 128 steps: the whole run
        end = session.params()
        assert "past run.total_env_steps" not in capsys.readouterr().err
        session.run(2)
        assert max_diff(end, session.params()) == 0.0
        assert capsys.readouterr().err.count("past run.total_env_steps=1,024") == 1
        session.run(1)
        assert "past run.total_env_steps" not in capsys.readouterr().err
        for bad in (-1, 2.5):  # (-1 ran nothing without a word, 2.5 was a bare TypeError)
            with pytest.raises(msrl.ConfigError, match="iterations: a whole number >= 0 of iterations to run"):
                session.run(bad)
        for bad in (-5, "x"):  # (-5 was taken: rows then counted from -4; "x" was a bare ValueError)
            with pytest.raises(msrl.ConfigError, match="iteration: the iteration the snapshot was taken after"):
                session.restore(session.snapshot(), iteration=bad)


def test_a_session_takes_what_the_config_says_and_refuses_what_it_cannot_take():
    cartpole = EXAMPLES / "ppo_cartpole.yaml"
    with msrl.Session(cartpole, ["run.iterations_per_dispatch=3"]) as session:  # (the config's key was dropped)
        assert session.runtime.k == 3
        with pytest.raises(msrl.ConfigError, match=r"^skip: a tuple of names of components to leave out \(actor, "
                                                   r"buffer, env, learner\), got 'nope'$"):  # (all in, without a word)
            session.snapshot(skip=("nope",))
        with pytest.raises(msrl.ConfigError, match=r"got 'env': write \('env',\)$"):
            session.snapshot(skip="env")
        with pytest.raises(msrl.ConfigError, match=r"^snapshot: is not a snapshot .*its 'params' holds dict"):
            session.restore(session.params())  # (it said: holds fragment 'params' (? replicas))
        for bad in (0, -1, 1.5):  # (0 and -1 spun at full CPU for ever)
            with pytest.raises(msrl.ConfigError, match="^chunk: a whole number >= 1 of iterations per list of rows"):
                list(session.stream(2, chunk=bad))
    with pytest.raises(msrl.TrainingError, match="this session is closed"):  # (entered again without a word)
        with session:
            pass
    for bad in (0, -3, "4", True):  # (clamped to 1, or "4" taken, without a word)
        with pytest.raises(msrl.ConfigError, match="iterations_per_dispatch: a whole number >= 1"):
            msrl.Session(cartpole, iterations_per_dispatch=bad)
    with pytest.raises(msrl.ConfigError, match=r"^overrides: a list of KEY.PATH=VALUE strings, got one string"):
        msrl.Session(cartpole, "run.seed=1")  # (read letter by letter: "r: overrides are written KEY.PATH=VALUE")
    with pytest.raises(TypeError, match="or a compiled program .program=...., got neither"):
        msrl.Session()  # (it said "not both")
    # Session's own arguments are checked as the config's keys are (probe: seed=2**32 ran seed 0, seeds=-1 ran
    # nothing, overrides beside a validated config or a program were dropped, a typo swept raised AttributeError)
    config = msrl.load_config(cartpole, [])
    for kwargs, error in [({"seed": 2**32}, r"^seed: Input should be less than or equal to 4294967295, got 4294967296 "
                                            r"\(as the config's run.seed\)$"),
                          ({"seeds": -1}, r"^seeds: Input should be greater than or equal to 1"),
                          ({"stall_timeout_s": "x"}, r"^stall_timeout_s: Input should be a valid number"),
                          ({"sweep": {"lrr": [1e-3, 1e-4]}}, r"^sweep: 'lrr' is no key of algorithm 'ppo'"),
                          ({"sweep": {"lr": []}}, r"^sweep: 'lr' must be a non-empty list of values, got \[\]$"),
                          ({"seeds": True}, r"^seeds: a number, got True \(as the config's run.num_seeds\)$"),
                          ({"seed_batching": "bogus"}, r"^seed_batching: Input should be 'auto', 'vmap' or "),
                          ({"overrides": ["run.seed=7"]}, r"^overrides: give overrides with a config file or dict, not "
                                                          r"with a validated config$")]:
        with pytest.raises(msrl.ConfigError, match=error):
            msrl.Session(config, **kwargs)
    with pytest.raises(msrl.ConfigError, match=r"^program: a compiled program \(msrl.build\(config\)\), got str"):
        msrl.Session(program=str(cartpole))


class Endless(msrl.Environment):
    """Reward 1 at every step and always the same observation; a time limit cuts every episode after 10 steps
    (truncated, never terminated). Its true value is 1 / (1 - gamma) = 10 for gamma 0.9; a return ended at the
    cut is worth (1 - 0.9^k) / 0.1 with k steps left, 4.14 on average over the episode's steps."""

    spec = msrl.EnvSpec("endless:x", (1,), np.dtype(np.float32), msrl.Discrete(2))

    def init(self, key, env_ids):
        return {"t": jax.numpy.zeros(env_ids.shape[0]), "episodes": jax.numpy.zeros(env_ids.shape[0])}

    def observe(self, state):
        return state, jax.numpy.ones((state["t"].shape[0], 1))

    def reset(self, state):
        return {**state, "t": 0 * state["t"]}, jax.numpy.ones((state["t"].shape[0], 1))

    def step(self, state, action):
        t = state["t"] + 1
        cut, obs = t >= 10, jax.numpy.ones((t.shape[0], 1))
        return ({"t": jax.numpy.where(cut, 0.0, t), "episodes": state["episodes"] + cut},
                msrl.EnvStep(obs, jax.numpy.ones_like(t), jax.numpy.zeros_like(cut), cut, obs))

    def stats(self, state):
        ended = (state["episodes"] > 0).sum()
        return {"return_sum": 10.0 * ended, "finished": ended, "episodes": state["episodes"].sum()}


@pytest.mark.parametrize("algorithm", ["ppo", "a2c"])
def test_bootstrap_truncated_learns_the_value_past_a_time_limit(algorithm):
    """``bootstrap_truncated: true`` adds gamma * V(final observation) to the reward of a truncated step: the
    value learned on Endless is its true 10, where ending the return at the cut (the default, as PureJaxRL)
    learns the average 4.14. A2C's coarse and fine splits agree bitwise with fused on CartPole cut at 12 steps,
    where a truncated step's final observation is not the next one (PPO's: the conformance matrix's
    ppo_truncated row)."""
    from msrl.envs import register_env
    from msrl.rl import ActorCritic

    register_env("endless")(lambda name, **kwargs: Endless())
    ppo = {"epochs": 4, "minibatches": 2, "clip_eps": 100.0, "anneal_lr": False}  # the value moves freely
    values = []
    for bootstrap in (True, False):
        cfg = {"algorithm": {"name": algorithm, "rollout_len": 20, "gamma": 0.9, "lr": 1e-2, "hidden": [8],
                             "bootstrap_truncated": bootstrap, **(ppo if algorithm == "ppo" else {})},
               "env": {"id": "endless:x", "num_envs": 4}, "run": {"seed": 0, "total_env_steps": 10**6}}
        with msrl.Session(cfg, iterations_per_dispatch=100) as session:
            session.run(100)
            net = ActorCritic(action_dim=2, discrete=True, obs_ndim=1, hidden=(8,), activation="tanh")
            values.append(float(net.apply(session.params(), jax.numpy.ones((1, 1)))[1][0]))
    assert values[0] == pytest.approx(10.0, abs=0.5) and values[1] == pytest.approx(4.14, abs=0.5), values
    if algorithm == "ppo":
        return
    cut = ["algorithm.bootstrap_truncated=true", 'env.kwargs={"max_steps_in_episode": 12}', "algorithm.hidden=[16]"]
    example = EXAMPLES / "a2c_cartpole.yaml"
    fused, rows = final_params(cut, 3, example)
    assert rows[-1]["episodes"] > 0
    for policy in ("single_learner_coarse", "single_learner_fine"):
        split, _ = final_params([*cut, f"policy.name={policy}", "policy.actors=2", "policy.backend=threads"], 3, example)
        assert max_diff(fused, split) == 0.0, policy


def test_bootstrap_truncated_is_refused_where_it_is_not_built():
    """IMPALA's V-trace and the recurrent algorithms refuse the key; MAPPO on JaxMARL (no final observations)
    refuses it too, naming the key (what to change) rather than the algorithm's line."""
    for name in ("impala", "recurrent_ppo", "recurrent_impala"):
        with pytest.raises(msrl.ConfigError, match=f"^algorithm.bootstrap_truncated: {name} ends the return"):
            msrl.Session({"algorithm": {"name": name, "bootstrap_truncated": True}})
    with pytest.raises(msrl.ConfigError, match="^algorithm.bootstrap_truncated: this environment does not report "
                                              "the final observation of an episode"):
        msrl.Session({"algorithm": {"name": "mappo", "bootstrap_truncated": True, "rollout_len": 4, "minibatches": 1},
                      "env": {"id": "jaxmarl:MPE_simple_spread_v3"}})
