"""The ``async`` policy (A3C): actor-learners send gradients to one parameter holder. One worker gives
exactly A2C's parameters (so a run is reproducible) on threads and on ray; several run concurrently
without losing a gradient; stale gradients are dropped and counted; checkpoints include the holder."""

from __future__ import annotations

import functools
import re
import shutil
from pathlib import Path
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import CARTPOLE, final_leaves, final_params, max_diff

import msrl
from msrl import ConfigError
from msrl.algorithms.a2c.a2c import A2C as A2CAlgorithm
from msrl.algorithms.a2c.a2c import A2CConfig, A2CLearner, Transition
from msrl.config import load_config
from msrl.policies.async_policy import ParameterHolder
from msrl.evaluate import evaluate
from msrl.runner import train

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
A2C = EXAMPLES / "a2c_cartpole.yaml"
ONE = ("policy.name=async", "policy.workers=1")


@functools.lru_cache(maxsize=None)
def run(*overrides: str, iterations: int = 6):
    return final_params([*overrides], iterations, A2C)


def test_one_worker_is_a2c_and_reproducible():
    fused, fused_rows = run()
    params, rows = run(*ONE)
    again, _ = final_params(list(ONE), 6, A2C)
    assert max_diff(params, again) == 0.0  # two runs, same seed: identical
    assert max_diff(fused, params) <= 1e-6  # the holder applies exactly A2C's updates
    assert max_diff(fused, jax.tree.map(np.zeros_like, fused)) > 1e-3
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in fused_rows], rel=1e-5)
    assert [r["policy_lag"] for r in rows] == [0] * 6
    # each row counts the gradients as of the end of its iteration (every row of a dispatch said 6)
    assert [(r["grads_applied"], r["stale_grads_dropped"]) for r in rows] == [(i, 0) for i in range(1, 7)]


def test_four_workers_apply_every_gradient_once():
    params, rows = run("policy.name=async", "policy.workers=4", iterations=8)
    last = rows[-1]
    assert last["grads_applied"] + last["stale_grads_dropped"] == 4 * 8  # none lost, none applied twice
    assert all(0 <= r["policy_lag"] < 4 * 8 for r in rows)
    assert np.isfinite(np.concatenate([np.ravel(x) for x in jax.tree.leaves(params)])).all()


def test_holder_drops_gradients_older_than_max_staleness():
    params = {"w": np.ones(3, np.float32)}
    holder = ParameterHolder(optax.sgd(1.0), params, max_staleness=1)
    grads = {"w": np.full(3, 0.5, np.float32)}
    assert holder.push(grads, 0)[2:] == (1, 0)  # fresh: applied, version 1
    assert holder.push(grads, 0)[2:] == (2, 1)  # one update old: still applied
    fresh, _, version, staleness = holder.push(grads, 0)  # two updates old: dropped
    assert (version, staleness) == (2, 2)
    np.testing.assert_allclose(fresh["w"], 0.0)  # 1 - 0.5 - 0.5: the dropped one left no trace
    assert holder.metrics([0]) == [{"grads_applied": 2.0, "stale_grads_dropped": 1.0}]  # (pushed outside a run)


def test_resume_restores_the_holder_exactly(tmp_path):
    overrides = [*ONE, "run.progress=false", "run.tensorboard=false", "run.total_env_steps=2400",
                 "run.checkpoint_every_steps=800", "run.iterations_per_dispatch=5", "run.keep_checkpoints=5"]
    train(A2C, overrides, run_dir=tmp_path / "straight")
    shutil.copytree(tmp_path / "straight", tmp_path / "resumed")
    for later in sorted((tmp_path / "resumed" / "checkpoints").glob("ckpt_*"))[1:]:
        later.unlink()  # as if it had died after its first checkpoint (iteration 20 of 60)
    train(tmp_path / "resumed" / "config.yaml", [], run_dir=tmp_path / "resumed", resume=True)
    (a, meta_a), (b, meta_b) = final_leaves(tmp_path / "straight"), final_leaves(tmp_path / "resumed")
    assert meta_a["iteration"] == meta_b["iteration"] == 60
    assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True) if x is not None)
    assert any(x is not None and x.shape == () and x == 60 for x in b)  # the holder's version came back
    assert evaluate(tmp_path / "resumed", episodes=2)["episodes"] == 2  # msrl eval reads the async checkpoint


def test_eval_and_load_act_with_the_holders_parameters_not_a_workers_copy(tmp_path):
    """A worker's copy is the holder's as of its last push: with several workers, some updates old. (Which
    worker's copy is older varies; the test makes worker 0's plainly different, as it would be after a run.)"""
    overrides = ["policy.name=async", "policy.workers=2", "run.progress=false", "run.tensorboard=false",
                 "run.total_env_steps=1600", "run.checkpoint_every_steps=1600"]
    train(A2C, overrides, run_dir=tmp_path)
    path, states, meta = msrl.checkpoint.latest_good(tmp_path)
    held = states["_services/0/parameters"]  # {dropped, opt_state, params, version}: its leaves in that order
    n = len(jax.tree.leaves(msrl.load(tmp_path).params))
    stale = states["worker/0/learner"]  # {opt_state, param_version, params}
    states = {**states, "worker/0/learner": stale[:-n] + [x - 1.0 for x in stale[-n:]]}
    by_fragment: dict = {}  # back to a snapshot (fragment -> replicas -> component -> state) to save it again
    for key, leaves in states.items():
        fragment, replica, component = key.split("/")
        by_fragment.setdefault(fragment, {}).setdefault(int(replica), {})[component] = leaves
    snapshot = {f: [replicas[r] for r in sorted(replicas)] for f, replicas in by_fragment.items()}
    assert msrl.checkpoint.save(tmp_path, snapshot, meta) == path
    loaded = jax.tree.leaves(msrl.load(tmp_path).params)
    assert all(np.array_equal(a, b) for a, b in zip(loaded, held[-1 - n:-1], strict=True))
    assert evaluate(tmp_path, episodes=1)["episodes"] == 1


class ClippedConfig(A2CConfig):
    name: Literal["a2c_clipped"] = "a2c_clipped"
    clip: float = 0.3  # 0: no clipping


class ClippedLearner(A2CLearner):
    """A2C with weight clipping after the optimizer's step, and a metric of the optimizer state it is given."""

    def learn(self, state, batch, last_obs):
        new, metrics = super().learn(state, batch, last_obs)
        if self.cfg.clip:
            new = {**new, "params": jax.tree.map(lambda p: jnp.clip(p, -self.cfg.clip, self.cfg.clip), new["params"])}
        return new, {**metrics, "opt_state_norm": optax.tree.norm(state["opt_state"])}


@msrl.register_algorithm("a2c_clipped")
class Clipped(A2CAlgorithm):
    Config = ClippedConfig

    def __init__(self, cfg, ctx):
        super().__init__(cfg, ctx)
        self.learner = ClippedLearner(self.learner.net, cfg, ctx.env_spec.example_obs(), self.learner.num_updates)


def test_a_learner_that_changes_its_optimizer_step_is_refused_and_one_that_reads_its_state_is_a2c():
    """The holder computes the optimizer's step and nothing else: a learn() that clips the new weights is refused
    (it used to train unclipped); one whose metric reads the optimizer state logs fused's numbers under one worker
    (the worker's optimizer state used to stay at its initial value)."""
    with pytest.raises(ConfigError, match=r"policy.name: async's parameter holder applies ClippedLearner.optimizer"
                                          r"\(\)'s step .* clipping, scaling.*single_learner_coarse"):
        final_params([*ONE, "algorithm.name=a2c_clipped"], 2, A2C)
    fused, fused_rows = final_params(["algorithm.name=a2c_clipped", "algorithm.clip=0"], 4, A2C)
    params, rows = final_params([*ONE, "algorithm.name=a2c_clipped", "algorithm.clip=0"], 4, A2C)
    assert max_diff(fused, params) <= 1e-6
    norms = [r["opt_state_norm"] for r in fused_rows]
    assert len(set(norms)) == 4 and [r["opt_state_norm"] for r in rows] == pytest.approx(norms, rel=1e-5)


class TwoPartConfig(A2CConfig):
    name: Literal["a2c_two_part"] = "a2c_two_part"


class TwoPartLearner(A2CLearner):
    """A2C's losses in two optimizer steps, told which by a keyword the loop gives as a literal."""

    def learn(self, state, batch, last_obs, part):
        def loss(params):
            metrics = self._loss(params, batch, last_obs)[1]
            return metrics[f"{part}_loss"], metrics

        grads, metrics = jax.grad(loss, has_aux=True)(state["params"])
        updates, opt_state = self.tx.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}, \
            {f"{part}_loss": metrics[f"{part}_loss"]}


@msrl.register_algorithm("a2c_two_part")
class TwoPart(A2CAlgorithm):
    Config = TwoPartConfig

    def __init__(self, cfg, ctx):
        super().__init__(cfg, ctx)
        self.learner = TwoPartLearner(self.learner.net, cfg, ctx.env_spec.example_obs(), self.learner.num_updates)

    def train_step(self):
        obs = msrl.env_observe()
        for _ in range(self.cfg.rollout_len):
            out = msrl.agent_act(obs)
            step = msrl.env_step(out.action)
            msrl.buffer_insert(Transition(obs, out.action, step.reward, step.done))
            obs = step.obs
        batch = msrl.buffer_get()
        value = msrl.agent_learn(batch, last_obs=obs, part="value")
        return {**value, **msrl.agent_learn(batch, last_obs=obs, part="policy")}


def test_a_plain_value_the_loop_gives_learn_stays_a_python_value_as_under_fused():
    """``agent_learn(..., part="value")``: the workers' jitted gradient kept the literal a Python value, as fused's
    program does (it traced it: a string was a TypeError, an int an `if` on a tracer)."""
    overrides = ["algorithm.name=a2c_two_part", "algorithm.bootstrap_truncated=false"]
    fused, fused_rows = final_params(overrides, 4, A2C)
    params, rows = final_params([*ONE, *overrides], 4, A2C)
    assert max_diff(fused, params) <= 1e-6
    for key in ("value_loss", "policy_loss"):
        assert [r[key] for r in rows] == pytest.approx([r[key] for r in fused_rows], rel=1e-5)
    assert [r["grads_applied"] for r in rows] == [2, 4, 6, 8]  # two learn() calls an iteration, each one gradient


def test_a_learner_whose_state_the_holder_cannot_carry_is_refused():
    """PPO's learner state holds its shuffling key beside params and opt_state: the holder would drop it. DQN's
    holds its target network, and the policies named for it include those that run a loop that samples a replay
    buffer (single_learner_coarse refuses DQN's)."""
    ppo_init = f"PPOLearner.init() ({EXAMPLES.parent / 'algorithms' / 'ppo' / 'ppo.py'}:"  # (it named the class)
    with pytest.raises(ConfigError, match=re.escape(
            "policy.name: async's parameter holder carries a learner state of the parameters ('params') and the "
            f"optimizer's state ('opt_state') only, but the state {ppo_init}") + r"\d+\) returns also holds 'key'.*; "
            "if one is the optimizer's state, name it 'opt_state'; else use .*single_learner_coarse"):
        msrl.build(load_config(CARTPOLE, ["policy.name=async", "policy.workers=2", "env.num_envs=4"]))
    with pytest.raises(ConfigError, match=r"DQNLearner.init\(\) \(.*dqn.py:\d+\) returns also holds .*'target'.*; else "
                                          r"use policy.name=.* for an "
                                          r"on-policy loop \(msrl.buffer_get\), replay_server, single_learner_fine or "
                                          r"multi_learner for one that samples a replay buffer$"):
        msrl.build(load_config(EXAMPLES / "dqn_cartpole.yaml", ["policy.name=async", "policy.workers=2",
                                                                 "env.num_envs=4"]))
    with pytest.raises(ConfigError, match=r"SACLearner defines none; use policy.name=.*replay_server"):  # (it named none)
        msrl.build(load_config(EXAMPLES / "sac_pendulum.yaml", ["policy.name=async", "policy.workers=2",
                                                                 "env.num_envs=4"]))


class TwoStepsConfig(A2CConfig):
    name: Literal["a2c_two_steps"] = "a2c_two_steps"


class TwoStepsLearner(A2CLearner):
    """A2C's step, made twice per learn()."""

    def learn(self, state, batch, **kwargs):
        state, _ = super().learn(state, batch, **kwargs)
        return super().learn(state, batch, **kwargs)


@msrl.register_algorithm("a2c_two_steps")
class TwoSteps(A2CAlgorithm):
    Config = TwoStepsConfig

    def __init__(self, cfg, ctx):
        super().__init__(cfg, ctx)
        self.learner = TwoStepsLearner(self.learner.net, cfg, ctx.env_spec.example_obs(), self.learner.num_updates)


def test_a_learner_of_two_optimizer_steps_is_refused_naming_its_learn_and_the_policies_that_fit():
    cfg = load_config(A2C, [*ONE, "algorithm.name=a2c_two_steps"])
    with msrl.Session(cfg) as session, pytest.raises(ConfigError) as info:
        session.run(1)
    line = TwoStepsLearner.learn.__code__.co_firstlineno
    assert str(info.value).startswith(f"policy.name: async needs a learner that makes one optimizer step per learn(); "
                                      f"TwoStepsLearner.learn() ({__file__}:{line}) made 2; use policy.name="
                                      "single_learner_coarse or multi_learner for an on-policy loop"), str(info.value)


def test_ray_one_worker_matches_threads(ray_cluster):
    params, rows = run(*ONE)
    remote, remote_rows = final_params([*ONE, "policy.backend=ray"], 6, A2C)
    assert max_diff(params, remote) <= 1e-6
    assert [r["episodes"] for r in rows] == [r["episodes"] for r in remote_rows]
    assert remote_rows[-1]["grads_applied"] == 6


def test_a_dead_parameter_holder_on_ray_ends_the_run_in_one_line(ray_cluster):
    import os
    import signal

    import psutil

    cfg = load_config(A2C, [*ONE, "policy.backend=ray", "run.total_env_steps=100000"])
    with msrl.Session(cfg, iterations_per_dispatch=2) as session:
        session.run(2)
        [holder] = [p for p in psutil.process_iter(["cmdline"])
                    if p.info["cmdline"] and p.info["cmdline"][0].startswith("ray::ServiceHost")]
        os.kill(holder.pid, signal.SIGKILL)
        with pytest.raises(msrl.TrainingError) as info:  # (it was Ray's ActorDiedError report: ~45 lines)
            session.run(20)
    assert "TrainingError: async's parameter holder (a Ray actor) died and cannot be restarted: it holds the run's " \
           "shared state (ActorDiedError)" in str(info.value) and len(str(info.value).splitlines()) == 1, str(info.value)
