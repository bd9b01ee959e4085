"""JAX devices as a transport: single_learner_coarse with the actors on some devices and the learner on
another, in one process (``policy.backend=jax``), equals the threads run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import msrl
import pytest
from msrl.config import load_config

from helpers import CARTPOLE

CODE = """
    import json, jax, numpy as np, msrl
    from msrl.config import load_config
    base = ["run.seed=0", "run.total_env_steps=100000", "policy.name=single_learner_coarse", "policy.actors=2",
            "policy.envs_per_actor=4"]

    def run(overrides):
        with msrl.Session(load_config({config!r}, base + overrides)) as s:
            rows = s.run(3)
            where = {{"/".join(map(str, k)): sorted({{x.device.id for x in jax.tree.leaves(d.state)}})
                     for k, d in getattr(s.runtime, "drivers", {{}}).items()}}
            return s.params(), rows, where

    threads, threads_rows, _ = run(["policy.backend=threads"])
    devices, devices_rows, where = run(["policy.backend=jax", "policy.actor_devices=[0,1]", "policy.learner_devices=[3]"])
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(jax.tree.leaves(threads), jax.tree.leaves(devices)))
    with msrl.Session(load_config({config!r}, ["policy.name=multi_learner", "policy.learners=6", "env.num_envs=12",
                                               "algorithm.rollout_len=8"])) as s:  # (a note: 3 of the 4 devices)
        s.run(1)
    print(json.dumps({{"devices": len(jax.devices()), "where": where, "diff": diff,
                      "episodes": [[r["episodes"] for r in threads_rows], [r["episodes"] for r in devices_rows]]}}))
"""


def test_coarse_on_four_forced_host_devices_equals_threads():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(CODE.format(config=CARTPOLE))], capture_output=True,
                         text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["devices"] == 4
    assert result["where"] == {"actor/0": [0], "actor/1": [1], "learner/0": [3]}  # each state on its device
    assert result["diff"] == 0.0  # bitwise: the same programs, only placed elsewhere
    assert result["episodes"][0] == result["episodes"][1]
    assert ("msrl: note: 6 replicas on 4 JAX devices run on 3 of them, 2 on each (as many devices as divide 6 evenly)"
            in out.stderr)  # (it said nothing of the idle device)


def test_devices_need_the_jax_backend_and_existing_devices():
    with pytest.raises(msrl.ConfigError, match="policy.actor_devices.*only policy.backend=jax"):
        msrl.build(load_config(CARTPOLE, ["policy.name=single_learner_coarse", "policy.actor_devices=[0]"]))
    cfg = load_config(CARTPOLE, ["policy.name=single_learner_coarse", "policy.backend=jax", "policy.learner_devices=[7]"])
    with pytest.raises(msrl.ConfigError, match=r"policy.learner_devices: device 7 of role .learner. does not exist: "
                                               r"this process has \d+ JAX devices \(cpu\); XLA_FLAGS=--xla_force_host_"
                                               r"platform_device_count=8 gives the CPU that many in a new process "):
        msrl.Session(cfg)
    # (an empty list is no sweep; 'jax' is offered once inside the jax backend)
    with pytest.raises(msrl.ConfigError, match=r"^policy.actor_devices: List should have at least 1 item after "
                                               r"validation, not 0 \(got \[\]\) — backend jax: the JAX devices"):
        load_config(CARTPOLE, ["policy.name=single_learner_coarse", "policy.backend=jax", "policy.actor_devices=[]"])
    with pytest.raises(msrl.ConfigError, match=r"^policy.actor_backend: 'threads' cannot run inside "
                                               r"policy.backend='jax'; use 'jax' \(one jitted program per step\)$"):
        msrl.build(load_config(CARTPOLE, ["policy.name=single_learner_coarse", "policy.backend=jax",
                                          "policy.actor_backend=threads"]))
    # (a device more than the replicas take would stay idle: refused, not dropped)
    jax_coarse = ["policy.name=single_learner_coarse", "policy.backend=jax"]
    with pytest.raises(msrl.ConfigError, match=r"^policy.learner_devices: \[1, 2\]: the one learner takes one device; "
                                               r"list one \(learners on several devices: policy.name=multi_learner\)$"):
        msrl.build(load_config(CARTPOLE, jax_coarse + ["policy.learner_devices=[1,2]"]))
    with pytest.raises(msrl.ConfigError, match=r"^policy.actor_devices: \[0, 1, 2\]: 2 actor replicas take one device "
                                               r"each, so devices \[2\] would stay idle"):
        msrl.build(load_config(CARTPOLE, jax_coarse + ["policy.actors=2", "policy.actor_devices=[0,1,2]"]))


def test_fine_on_the_jax_backend_is_refused_at_the_loop():
    """single_learner_fine communicates every env step: a role on jax runs as one program between comms."""
    with pytest.raises(msrl.CompileError, match=r"places fragment 'env_worker' on the jax backend "
                       r"\(policy.backend=jax\), but it communicates inside this loop") as info:  # (the key: probe)
        msrl.build(load_config(CARTPOLE, ["policy.name=single_learner_fine", "policy.backend=jax"]))
    assert "set policy.backend=threads (or ray)" in info.value.hint
