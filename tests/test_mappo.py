"""MAPPO and the JaxMARL adapter: agents as a batch axis, the same parameters under fused, threads and ray."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import msrl
from msrl.algorithm import Context
from msrl.algorithms.mappo import MAPPO
from msrl.config import load_config
from msrl.envs import make_env

from helpers import max_diff

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
SPREAD = EXAMPLES / "mappo_spread.yaml"
SPREAD_ID = "jaxmarl:MPE_simple_spread_v3"
TINY = ["run.seed=0", "run.total_env_steps=100000", "env.num_envs=4", "algorithm.rollout_len=16",
        "algorithm.epochs=2", "algorithm.minibatches=2", "algorithm.hidden=[16]"]


def final_params(overrides: list[str], iterations: int = 3):
    with msrl.Session(load_config(SPREAD, [*TINY, *overrides]), seed=0, iterations_per_dispatch=iterations) as s:
        rows = s.run(iterations)
        return s.params(), rows


# ------------------------------------------------------------------------------------------------ adapter
def test_spread_shapes_shared_reward_and_auto_reset():
    env = make_env(SPREAD_ID, num_agents=5, num_landmarks=4)
    spec = env.spec
    assert isinstance(spec, msrl.MultiAgentSpec) and spec.num_agents == 5 and spec.discrete
    assert spec.action_space.n == 5 and spec.obs_shape == (4 + 4 * 4 + 2 * 4,) and spec.state_shape == (5 * 28,)
    state, obs = env.observe(jax.jit(env.init)(jax.random.PRNGKey(0), jnp.arange(3)))
    assert obs.agents.shape == (3, 5, 28) and obs.state.shape == (3, 140)
    np.testing.assert_array_equal(np.asarray(obs.state), np.asarray(obs.agents).reshape(3, -1))
    step = jax.jit(env.step)
    total = np.zeros(3)
    for t in range(26):  # MPE episodes last 26 steps; every env ends on the last one and starts afresh
        state, (obs, reward, done) = step(state, jnp.full((3, 5), t % 5, jnp.int32))
        assert obs.agents.shape == (3, 5, 28) and reward.shape == (3,) and done.shape == (3,)
        assert bool(done.all()) == (t == 25)
        total += np.asarray(reward)
    assert (total < 0).all()  # distances to landmarks cost
    stats = env.stats(state)
    assert int(stats["episodes"]) == 3 and int(stats["finished"]) == 3 and int(stats["nonfinite"]) == 0
    np.testing.assert_allclose(float(stats["return_sum"]), total.sum(), rtol=1e-5)
    assert (np.asarray(state.inner.step) == 0).all() and (np.asarray(state.running_return) == 0).all()
    fresh = np.asarray(obs.agents)[:, :, :2]  # each agent's own velocity: zero after a reset
    np.testing.assert_array_equal(fresh, np.zeros_like(fresh))


def test_spread_steps_each_env_as_any_batch_does():
    """The example's 64 envs vs 2 actors x 32 and 64 x 1: the same observations and rewards, across an auto-reset
    (26 steps): an env's keys depend on its global index only (XLA's CPU compiler rounded MPE's contact
    distances by the batch's size, which made single_learner_coarse leave fused on the example's config)."""
    env = make_env(SPREAD_ID, num_agents=3, num_landmarks=3)
    init, step = jax.jit(env.init), jax.jit(env.step)
    key = jax.random.PRNGKey(0)
    parts = {64: [jnp.arange(64)], 32: [jnp.arange(32), jnp.arange(32, 64)], 1: [jnp.array([i]) for i in (0, 5, 41)]}
    states = {n: [init(key, ids) for ids in each] for n, each in parts.items()}
    for a in jax.random.randint(jax.random.PRNGKey(1), (60, 64, 3), 0, 5):  # (some agents touch by step 60)
        out = {}
        for n, each in parts.items():
            for j, ids in enumerate(each):
                states[n][j], (obs, rew, _) = step(states[n][j], a[ids])
                out[n, j] = np.asarray(obs.agents), np.asarray(rew)
        for k in range(2):
            np.testing.assert_array_equal(out[64, 0][k], np.concatenate([out[32, 0][k], out[32, 1][k]]))
            for j, i in enumerate((0, 5, 41)):
                np.testing.assert_array_equal(out[64, 0][k][i], out[1, j][k][0])
    other, first = init(jax.random.PRNGKey(8), parts[64][0]), init(key, parts[64][0])
    assert not np.array_equal(np.asarray(env.observe(other)[1].agents), np.asarray(env.observe(first)[1].agents))


def test_bad_multi_agent_configs_are_errors_naming_the_key():
    with pytest.raises(msrl.ConfigError, match="env.id.*not a JaxMARL environment.*MPE_simple_spread_v3"):
        make_env("jaxmarl:MPE_nothing_v0")
    with pytest.raises(msrl.ConfigError, match="env.kwargs.*no_such_kwarg"):
        make_env(SPREAD_ID, no_such_kwarg=1)
    with pytest.raises(msrl.ConfigError, match=r"env.kwargs: .*MPE_simple_spread_v3 made with \{'num_agents': 0\} "
                                               "has no agents"):
        make_env(SPREAD_ID, num_agents=0)
    with pytest.raises(msrl.ConfigError, match="env.id.*single-agent.*MAPPO"):
        msrl.build(load_config(SPREAD, ["env.id=gymnax:CartPole-v1", "env.kwargs={}"]))
    with pytest.raises(msrl.ConfigError, match="algorithm.name.*3 agents.*mappo"):
        msrl.build(load_config(EXAMPLES / "ppo_cartpole.yaml", [f"env.id={SPREAD_ID}"]))
    with pytest.raises(msrl.ConfigError, match="algorithm.agent_ids"):
        load_config(SPREAD, ["algorithm.agent_ids=maybe"])
    with pytest.raises(msrl.ConfigError, match="^algorithm.bootstrap_truncated: this environment does not report the "
                                               "final observation"):  # (was at ppo.py's line)
        msrl.build(load_config(SPREAD, ["algorithm.bootstrap_truncated=true", "env.num_envs=4"]))


def test_an_env_whose_spaces_give_their_shape_as_a_number_is_read_and_one_that_masks_actions_refused():
    """Hanabi's observation space says shape 658, not (658,) (it was "TypeError: 'numpy.int64' object is not
    iterable"); its legal moves are a mask msrl's agents do not read (it trained choosing illegal ones: refused,
    once its spaces are read)."""
    with pytest.raises(msrl.ConfigError, match=r"^env.id: jaxmarl:hanabi masks its agents' actions \(get_legal_moves"):
        make_env("jaxmarl:hanabi")


def test_an_mpe_env_is_made_and_unpickled_without_importing_every_jaxmarl_env(tmp_path):
    """JaxMARL's package import imports all its envs (STORM, SMAX, JaxNav, MABrax with Brax and MuJoCo: ~3 s);
    an MPE env is made, and unpickled in a fresh process (as a Ray actor does), with its MPE modules alone. A
    later ``import jaxmarl`` is the whole package, with the same classes, and msrl's MPE ids are jaxmarl.make's."""
    import subprocess
    import sys

    from msrl.envs.jaxmarl_env import MPE, _jaxmarl, _mpe_make

    heavy = ["jaxmarl.environments.storm", "jaxmarl.environments.smax", "jaxmarl.environments.mabrax", "brax"]
    made = f"""
import json, sys, cloudpickle
from msrl.envs import make_env
open(sys.argv[1], "wb").write(cloudpickle.dumps(make_env("{SPREAD_ID}")))
print(json.dumps([m for m in {heavy!r} if m in sys.modules]))
"""
    loaded = f"""
import json, sys, cloudpickle
env = cloudpickle.loads(open(sys.argv[1], "rb").read())
print(json.dumps([[m for m in {heavy!r} if m in sys.modules], type(env.env).__name__, list(env.spec.obs_shape)]))
"""
    outs = []
    for code in (made, loaded):
        out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "env.pkl")], capture_output=True, text=True,
                             check=False, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        outs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    assert outs == [[], [[], "SimpleSpreadMPE", [18]]]
    jaxmarl = _jaxmarl()
    assert set(MPE) == {name for name in jaxmarl.registered_envs if name.startswith("MPE_")}
    assert all(type(jaxmarl.make(name)) is type(_mpe_make(name)()) for name in MPE)
    assert type(make_env(SPREAD_ID).env) is type(jaxmarl.make(SPREAD_ID.split(":")[1]))


# ------------------------------------------------------------------------------------------------ MAPPO
def test_mappo_acts_per_agent_with_a_shared_actor_and_one_value_per_env():
    cfg = load_config(SPREAD, TINY)
    env = make_env(cfg.env.id, **cfg.env.kwargs)
    algo = MAPPO(cfg.algorithm, Context(env.spec, num_envs=4, total_env_steps=1000))
    params = algo.learner.policy_params(algo.learner.init(jax.random.PRNGKey(0)))
    obs = algo.ctx.env_spec.example_obs()
    obs = jax.tree.map(lambda x: jnp.stack([x + 1, x - 1]), obs)  # two environments
    _, out = algo.actor.act(algo.actor.init(jax.random.PRNGKey(1), jnp.arange(2)), params, obs)
    assert out.action.shape == (2, 3) and out.log_prob.shape == (2, 3) and out.value.shape == (2,)
    # one set of actor weights for all agents: the first layer sees an agent's observation + its one-hot id
    assert params["params"]["Dense_0"]["kernel"].shape == (18 + 3, 16)
    assert params["params"]["Dense_2"]["kernel"].shape == (3 * 18, 16)  # the critic sees the global state


@pytest.fixture(scope="module")
def fused_run():
    return final_params([])


@pytest.mark.parametrize("backend", ["threads", "ray"])
def test_coarse_matches_fused_parameters(backend, fused_run, request):
    if backend == "ray":
        request.getfixturevalue("ray_cluster")
    fused, fused_rows = fused_run
    coarse, rows = final_params(["policy.name=single_learner_coarse", "policy.actors=2", f"policy.backend={backend}"])
    assert max_diff(fused, coarse) <= (0.0 if backend == "threads" else 1e-5)
    assert max_diff(fused, jax.tree.map(np.zeros_like, fused)) > 1e-3  # the parameters moved
    assert [r["episodes"] for r in rows] == [r["episodes"] for r in fused_rows] and rows[-1]["episodes"] > 0
    np.testing.assert_allclose([r["loss"] for r in rows], [r["loss"] for r in fused_rows], rtol=1e-4)


# ------------------------------------------------------------------------------------------------ a user's env
class _Meet(msrl.Environment):
    """A multi-agent env of one's own, as README's MAPPO section writes one: two agents on a line move from 0
    toward 1 (actions 0, 1, 2: -0.25, stay, +0.25) and share the reward -(their mean distance to 1); an episode
    ends when both are there (the best return, -1.5, in 4 steps), or after 8 steps."""

    spec = msrl.MultiAgentSpec("usersmeet:Meet", (2,), np.dtype(np.float32), msrl.Discrete(3), num_agents=2,
                               state_shape=(4,))

    def init(self, key, env_ids):
        zeros = jnp.zeros(env_ids.shape[0])
        return {"x": jnp.zeros((env_ids.shape[0], 2)), "t": zeros, "ret": zeros, "last": zeros, "length": zeros,
                "episodes": zeros}

    def _obs(self, s):
        agents = jnp.stack([s["x"], jnp.broadcast_to(s["t"][:, None] / 8, s["x"].shape)], -1)  # [N, 2, 2]
        return msrl.MultiAgentObs(agents, agents.reshape(-1, 4))

    def observe(self, s):
        return s, self._obs(s)

    def reset(self, s):
        s = {**s, "x": jnp.zeros_like(s["x"]), "t": jnp.zeros_like(s["t"]), "ret": jnp.zeros_like(s["ret"])}
        return s, self._obs(s)

    def step(self, s, action):
        x, t = jnp.clip(s["x"] + 0.25 * (action - 1), 0.0, 1.0), s["t"] + 1
        reward = -jnp.abs(1.0 - x).mean(-1)
        terminated = (x >= 1.0).all(-1)
        truncated = (t >= 8) & ~terminated
        done, ret = terminated | truncated, s["ret"] + reward
        s = {"x": jnp.where(done[:, None], 0.0, x), "t": jnp.where(done, 0.0, t), "ret": jnp.where(done, 0.0, ret),
             "last": jnp.where(done, ret, s["last"]), "length": jnp.where(done, t, s["length"]),
             "episodes": s["episodes"] + done}
        return s, msrl.EnvStep(self._obs(s), reward, terminated, truncated)

    def stats(self, s):
        finished = s["episodes"] > 0
        return {"return_sum": jnp.where(finished, s["last"], 0.0).sum(), "finished": finished.sum(),
                "length_sum": jnp.where(finished, s["length"], 0.0).sum(), "episodes": s["episodes"].sum()}


@msrl.register_env("usersmeet")
def _make_meet(name, **kwargs):
    return _Meet(**kwargs)


def test_a_multi_agent_env_of_ones_own_learns_and_splits_over_actors_bitwise(tmp_path):
    """Acting at random scores -6.2 an episode; MAPPO reaches -2 (near 2k steps here; the best is -1.5)."""
    from helpers import QUICK, assert_reaches, reached

    meet = ["env.id=usersmeet:Meet", "env.kwargs={}"]
    fused, _ = final_params(meet, 2)
    coarse, _ = final_params([*meet, "policy.name=single_learner_coarse", "policy.actors=2",
                              "policy.backend=threads"], 2)
    assert max_diff(fused, coarse) == 0.0
    msrl.train(SPREAD, [*TINY, *meet, *QUICK, "run.total_env_steps=10000"], run_dir=tmp_path,
               on_iteration=reached(-2.0))
    assert_reaches(tmp_path, -2.0, within=10000)


class _MeetOfThree(_Meet):
    """_Meet with a spec that says three agents (its observations hold two)."""

    spec = msrl.MultiAgentSpec("usersmeet:Three", (2,), np.dtype(np.float32), msrl.Discrete(3), num_agents=3,
                               state_shape=(4,))


def test_a_multi_agent_env_unlike_its_spec_is_refused_naming_its_method():
    """A multi-agent env of one's own was never checked against its spec (probe): one whose spec said 3 agents and
    whose observations held 2 trained without a word (`msrl.load` then said 3 agents); an observation of another
    size failed as a flax shape error naming neither the env nor its spec; a spec of one action space per agent
    failed as an AttributeError inside MAPPO."""
    from msrl.policies.fused import Fused

    algorithm = MAPPO(MAPPO.Config(**{"rollout_len": 4, "hidden": [8]}), Context(_MeetOfThree.spec, 4, 1000))
    with pytest.raises(msrl.CompileError, match=r"_MeetOfThree.observe\(\) \(.*test_mappo.py:\d+\) returned "
                       r"observations MultiAgentObs\(agents=float32\[4, 2, 2\], state=float32\[4, 4\]\), but "
                       r"usersmeet:Three's spec \(MultiAgentSpec\) says MultiAgentObs\(agents=float32\[3, 2\], "
                       r"state=\[4\]\) for each environment"):
        msrl.compile(algorithm, Fused(), _MeetOfThree(), 4)
    with pytest.raises(msrl.MsrlError, match=r"^msrl.MultiAgentSpec\('mine', \.\.\.\): action_space must be an "
                       r"msrl.Discrete or msrl.Box \(every agent's is the same: agents are a batch axis\); got \["):
        msrl.MultiAgentSpec("mine", (2,), np.dtype(np.float32), [msrl.Discrete(3), msrl.Discrete(5)], num_agents=2)
    with pytest.raises(msrl.MsrlError, match=r"obs_shape must be a tuple of ints, one observation's shape \(every "
                       r"agent's is the same: agents are a batch axis\); got \(\(2,\), \(1,\)\)"):
        msrl.MultiAgentSpec("mine", ((2,), (1,)), np.dtype(np.float32), msrl.Discrete(3), num_agents=2)
    for agents in (0, -1, "3", True, 2.5):  # (0 was a ZeroDivisionError deep inside MAPPO's network)
        with pytest.raises(msrl.MsrlError, match=rf"^msrl.MultiAgentSpec\('mine', \.\.\.\): num_agents must be a "
                           rf"whole number >= 1; got {re.escape(repr(agents))}$"):
            msrl.MultiAgentSpec("mine", (2,), np.dtype(np.float32), msrl.Discrete(3), num_agents=agents)
