"""multi_learner: replicas that all-reduce their gradients, on jax (vmap, forced host devices) and on ray."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from typing import Literal

import numpy as np
import pytest

import msrl
from msrl.algorithms.a2c.a2c import A2C as A2CAlgorithm
from msrl.algorithms.a2c.a2c import A2CConfig, A2CLearner
from msrl.config import load_config

from helpers import CARTPOLE, EXAMPLES, assert_reaches, final_params, max_diff

MULTI = ["policy.name=multi_learner", "env.num_envs=8"]


@pytest.fixture(scope="module")
def two_learners():
    """Parameters and rows of multi_learner(learners=2) on one jax device after 3 iterations."""
    return final_params([*MULTI, "policy.learners=2"], iterations=3)


def replica_params(session: msrl.Session) -> list:
    (states,) = session.snapshot().values()
    return [s["learner"]["params"] for s in states]


def test_one_learner_gives_the_parameters_of_fused_and_two_learn_differently(two_learners):
    fused, _ = final_params(["env.num_envs=8"], iterations=3)
    one, _ = final_params([*MULTI, "policy.learners=1"], iterations=3)
    assert max_diff(fused, one) <= 1e-5
    two, rows = two_learners  # separate minibatch statistics
    assert max_diff(fused, two) > 1e-4 and all(np.isfinite(r["loss"]) for r in rows)


def test_replicas_hold_identical_parameters_after_every_iteration():
    cfg = load_config(CARTPOLE, ["run.seed=0", *MULTI, "policy.learners=4"])
    with msrl.Session(cfg) as session:
        before = replica_params(session)[0]
        for _ in range(3):
            session.run(1)
            params = replica_params(session)
            assert len(params) == 4 and all(max_diff(params[0], p) == 0.0 for p in params[1:])
            assert max_diff(before, params[0]) > 1e-4  # they did learn
            before = params[0]


def test_an_algorithm_compiled_again_under_another_policy_leaves_the_first_program_as_it_was(two_learners):
    """msrl.compile(algorithm, ...) twice on one algorithm object (to compare policies, say): each program holds
    its own learner and buffer, so the second policy's gradient transforms (fused: none) and buffer shards do not
    replace the first's (before: the multi_learner program ran without its all-reduce, silently learning apart)."""
    from msrl.runner import build

    ml = load_config(CARTPOLE, ["run.seed=0", "run.total_env_steps=100000", *MULTI, "policy.learners=2"])
    first = build(ml)
    msrl.compile(first.algorithm, load_config(CARTPOLE).policy, first.env, first.num_envs)  # fused, same object
    with msrl.Session(program=first, seed=0, iterations_per_dispatch=3) as session:
        session.run(3)
        again, replicas = session.params(), replica_params(session)
    assert max_diff(two_learners[0], again) == 0 and max_diff(*replicas) == 0
    dqn = load_config(EXAMPLES / "dqn_replay_server.yaml")
    server = build(dqn)
    msrl.compile(server.algorithm, load_config(EXAMPLES / "dqn_cartpole.yaml").policy, server.env, server.num_envs)
    assert server.components["buffer"].shards == dqn.policy.shards > 1


def test_learners_on_forced_host_devices_match_vmap_and_reach_475(tmp_path, two_learners):
    """In a subprocess with 2 (forced) CPU devices the replicas are split over the devices (shard_map): the
    parameters equal the one-device (vmap) run's, and PPO CartPole reaches 475 within 300k steps."""
    code = f"""
        import json, jax, numpy as np, msrl
        from msrl.config import load_config
        cfg = load_config({CARTPOLE!r}, ["run.seed=0", "run.total_env_steps=100000", *{MULTI!r},
                                           "policy.learners=2"])
        with msrl.Session(cfg, iterations_per_dispatch=3) as session:
            session.run(3)
            np.savez({str(tmp_path / "params.npz")!r}, *jax.tree.leaves(session.params()))
            devices = session.runtime.mesh.devices.size
        summary = msrl.train({CARTPOLE!r}, ["policy.name=multi_learner", "policy.learners=2", "run.progress=false"],
                             run_dir={str(tmp_path / "run")!r})
        print(json.dumps({{"devices": devices, "summary": summary}}))
    """
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["devices"] == 2
    with np.load(tmp_path / "params.npz") as f:
        on_devices = [f[f"arr_{i}"] for i in range(len(f.files))]
    assert max_diff(two_learners[0], on_devices) <= 1e-5
    summary = result["summary"]
    assert summary["env_steps"] <= 300_000
    assert_reaches(tmp_path / "run", 475, within=300_000)


def test_bad_multi_learner_configs_name_the_key():
    with pytest.raises(msrl.ConfigError, match="policy.learners"):
        msrl.build(load_config(CARTPOLE, ["policy.name=multi_learner", "policy.learners=3"]))
    with pytest.raises(msrl.ConfigError, match="policy.backend"):
        load_config(CARTPOLE, ["policy.name=multi_learner", "policy.backend=threads"])
    cfg = load_config(CARTPOLE, ["policy.name=multi_learner", "policy.learners=3", "policy.envs_per_learner=2"])
    assert msrl.build(cfg).num_envs == 6
    # minibatches that divide the whole batch but not a learner's share were a reshape error inside PPO's learn
    with pytest.raises(msrl.ConfigError, match=r"^algorithm.minibatches: 3 does not divide the batch of 1 envs x 128 "
                                               r"steps = 128 a learner sees$"):
        msrl.build(load_config(CARTPOLE, ["policy.name=multi_learner", "policy.learners=3", "env.num_envs=3",
                                          "algorithm.minibatches=3"]))
    # a Gymnasium env makes the learners' role a host fragment: Ray ran its replicas apart, averaging nothing (each
    # learned alone and the run reported one's parameters); refused before any Ray process starts
    with pytest.raises(msrl.ConfigError, match=r"^policy.backend: policy 'multi_learner' averages the gradients of its 2 "
                                               r"'learner' replicas .*but the ray backend runs a role as one program "
                                               r"over its replicas only when the role is jitted whole"):
        msrl.Session(CARTPOLE, ["policy.name=multi_learner", "policy.backend=ray", "env.id=gymnasium:CartPole-v1"])


@pytest.mark.usefixtures("ray_cluster")
def test_ray_learners_are_processes_that_match_jax_and_stay_identical(two_learners):
    on_jax, jax_rows = two_learners
    cfg = load_config(CARTPOLE, ["run.seed=0", "run.total_env_steps=100000", *MULTI, "policy.learners=2",
                                 "policy.backend=ray"])
    with msrl.Session(cfg) as session:
        assert len({pid for _, pid in session.runtime.where().values()}) == 2
        rows = []
        for _ in range(3):
            rows += session.run(1)
            params = replica_params(session)
            assert max_diff(params[0], params[1]) == 0.0
        assert max_diff(on_jax, session.params()) <= 1e-5
        assert [r["episodes"] for r in rows] == [r["episodes"] for r in jax_rows]
        assert abs(rows[-1]["loss"] - jax_rows[-1]["loss"]) <= 1e-4 * abs(jax_rows[-1]["loss"])


class UnchainedConfig(A2CConfig):
    name: Literal["a2c_unchained"] = "a2c_unchained"


class UnchainedLearner(A2CLearner):
    """A2C whose optimizer skips the policy's gradient transforms (built without ``self.chain``)."""

    @property
    def tx(self):
        return self.optimizer()


@msrl.register_algorithm("a2c_unchained")
class Unchained(A2CAlgorithm):
    Config = UnchainedConfig

    def __init__(self, cfg, ctx):
        super().__init__(cfg, ctx)
        self.learner = UnchainedLearner(self.learner.net, cfg, ctx.env_spec.example_obs(), self.learner.num_updates)


@pytest.mark.parametrize("backend", ["jax", "ray"])
def test_learners_whose_update_skips_the_average_are_told_so(backend, request):
    """(Each learner trained on its own share and the run reported replica 0's parameters without a word; on ray,
    params() and a checkpoint took learner 0's without comparing.)"""
    if backend == "ray":
        request.getfixturevalue("ray_cluster")
    with msrl.Session(EXAMPLES / "a2c_cartpole.yaml", [*MULTI, "policy.learners=2", "algorithm.name=a2c_unchained",
                                                       f"policy.backend={backend}", "run.total_env_steps=100000"]
                      ) as session:
        session.run(2)
        for read in (session.params, session.snapshot):
            with pytest.raises(msrl.CompileError, match=r"the 2 learner replicas of policy 'multi_learner' hold "
                                                        r"different parameters \(replica 1's are up to .* from "
                                                        r"replica 0's\): an update was not averaged over them. "
                                                        r"Build every optimizer of UnchainedLearner with self.chain"):
                read()
