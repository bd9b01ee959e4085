"""Reliability: environments that change, break or hang mid-run, and actors killed over and over (chaos)."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import msrl
from msrl.envs import register_env
from msrl.envs.gymnax_env import GymnaxEnv
from msrl.runner import train

import loops  # registers gymnasium's MsrlShifty-v0 and MsrlHang-v0

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
QUIET = ["run.progress=false", "run.tensorboard=false", "run.checkpoint_every_steps=0"]


@pytest.mark.parametrize("mode, expect", [
    ("shape", r"returned an observation of float32\[5\], but its observations are float32\[4\]"),
    ("dtype", r"returned an observation of float64\[4\], but its observations are float32\[4\]"),
    ("nan", r"returned a non-finite observation"),
])
def test_a_host_env_that_changes_midrun_is_named_with_its_step(tmp_path, mode, expect):
    with pytest.raises(msrl.TrainingError, match=expect) as info:
        train(EXAMPLES / "ppo_cartpole_threads.yaml",
              [*QUIET, "env.id=gymnasium:MsrlShifty-v0", f"env.kwargs.mode={mode}", "run.total_env_steps=4096"],
              run_dir=tmp_path)
    assert "environment gymnasium:MsrlShifty-v0 #0 at step 39" in str(info.value)


class PoisonedCartPole(GymnaxEnv):
    """gymnax CartPole whose observations turn NaN after ``after`` steps (jitted, like any gymnax env)."""

    def __init__(self, name: str, after: int = 300):
        super().__init__(name)
        self.after = after

    def init(self, key, env_ids):
        return {"inner": super().init(key, env_ids), "t": jnp.zeros((), jnp.int32)}

    def observe(self, state):
        return state, state["inner"].obs

    def step(self, state, action):
        inner, (obs, reward, done) = super().step(state["inner"], action)
        bad = state["t"] >= self.after
        inner = inner.replace(obs=jnp.where(bad, jnp.nan, inner.obs))
        return {"inner": inner, "t": state["t"] + 1}, (inner.obs, reward, done)

    def stats(self, state):
        return super().stats(state["inner"])


register_env("poisoned")(PoisonedCartPole)


def test_a_jitted_env_returning_nan_stops_the_run_naming_env_and_steps(tmp_path):
    with pytest.raises(msrl.TrainingError, match=r"environment poisoned:CartPole-v1 produced a non-finite observation "
                                                 r"or reward in iteration 3 \(env steps 1024..1536\)"):
        train(EXAMPLES / "ppo_cartpole.yaml", [*QUIET, "env.id=poisoned:CartPole-v1", "run.total_env_steps=20480",
                                               "run.iterations_per_dispatch=1"], run_dir=tmp_path)


@pytest.mark.usefixtures("ray_cluster")
def test_chaos_random_actor_kills_every_few_seconds():
    """At least five SIGKILLs of random actor processes during one run: it completes, no update is lost."""
    from msrl.config import load_config

    cfg = load_config(EXAMPLES / "ppo_cartpole.yaml", ["policy.name=single_learner_coarse", "policy.backend=ray",
                                                       "policy.actors=3", "env.num_envs=6",
                                                       "policy.max_actor_restarts=10"])
    with msrl.Session(cfg, seed=0, iterations_per_dispatch=4) as session:
        runtime = session.runtime  # the ray runtime: where() and restarts
        rng, kills, stop = random.Random(0), [], threading.Event()

        def back(victim):  # restarted as often as it was killed
            return runtime.restarts.get(victim, 0) == kills.count(victim)

        def chaos():  # a kill every 1-3 s, of an actor that is back from its last one (restarts overlap)
            while not stop.is_set() and len(kills) < 5:
                time.sleep(rng.uniform(1.0, 3.0))
                up = [("actor", i) for i in range(3) if back(("actor", i))]
                if not up:
                    continue
                victim = rng.choice(up)
                try:
                    os.kill(runtime.where()[victim][1], signal.SIGKILL)
                except ProcessLookupError:
                    continue
                kills.append(victim)
            while not stop.is_set() and not all(back(("actor", i)) for i in range(3)):
                time.sleep(0.05)

        killer = threading.Thread(target=chaos, daemon=True)
        killer.start()
        rows, deadline = [], time.time() + 300  # a hang guard: a restart takes 5-30 s on 2 busy cores
        try:
            while (killer.is_alive() or len(rows) < 20) and time.time() < deadline:
                rows += session.run(4)
            stop.set()
            assert len(kills) >= 5 and sum(runtime.restarts.values()) == len(kills)
            state = session.snapshot()["learner"][0]["learner"]
            counts = {int(x) for p, x in jax.tree_util.tree_leaves_with_path(state["opt_state"])
                      if "count" in jax.tree_util.keystr(p)}
            assert counts == {len(rows) * cfg.algorithm.epochs * cfg.algorithm.minibatches}
            assert all(np.isfinite(r["loss"]) for r in rows)
        finally:
            stop.set()


# ---------------------------------------------------------------------------------------------- stalls
def test_a_hung_host_env_step_stops_the_run_naming_env_and_step(tmp_path):
    """run.stall_timeout_s=3: an env whose step never returns ends a threads run with a TrainingError naming the
    replica, the env and its step, 3-10 s after it hung."""
    flag = tmp_path / "hung"
    try:
        with pytest.raises(msrl.TrainingError) as info:
            train(EXAMPLES / "ppo_cartpole_threads.yaml",
                  [*QUIET, "env.id=gymnasium:MsrlHang-v0", "env.kwargs.after=200", f"env.kwargs.flag={flag}",
                   "run.stall_timeout_s=3", "run.total_env_steps=4096"], run_dir=tmp_path / "run")
        took = time.time() - float(flag.read_text())
    finally:
        loops.HANG_RELEASE.set()  # let the stuck threads go
    assert re.fullmatch(r"fragment 'actor' replica [01] made no progress for [3-9] s in iteration 2: environment "
                        r"gymnasium:MsrlHang-v0 #[04] at step 200 has not returned from step\(\) "
                        r"\(run.stall_timeout_s=3\)\. The last complete iteration is 1 of 4; no checkpoint of it "
                        r"could be saved \(its state is lost or mid-iteration\); there is no checkpoint",
                        str(info.value)), str(info.value)
    assert 3 <= took <= 10, took


def test_sigint_ends_a_threads_run_with_a_hung_env_within_5_s(tmp_path):
    flag, run = tmp_path / "hung", tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "msrl.cli", "train", "--import", str(Path(loops.__file__)),
                             str(EXAMPLES / "ppo_cartpole_threads.yaml"), "env.id=gymnasium:MsrlHang-v0",
                             "env.kwargs.after=200", f"env.kwargs.flag={flag}", "run.tensorboard=false",
                             "run.total_env_steps=4096", "run.checkpoint_every_steps=1024", "--run-dir", str(run)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while not flag.exists():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.1)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    sent = time.time()
    try:
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert time.time() - sent <= 5, err[-3000:]
    assert proc.returncode == 130, err[-3000:]
    assert "environment gymnasium:MsrlHang-v0" in err and "has not returned from step()" in err, err[-3000:]
    assert f"the last checkpoint is {run}/checkpoints/ckpt_" in err and f"--resume {run}" in err, err[-3000:]
