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
from collections import Counter
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

import msrl
from msrl.envs import register_env
from msrl.envs.gymnax_env import GymnaxEnv
from msrl.runner import train

import loops  # registers gymnasium's MsrlShifty-v0 and MsrlHang-v0

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
QUIET = ["run.progress=false", "run.tensorboard=false", "run.checkpoint_every_steps=0"]


@pytest.mark.parametrize("mode, expect", [
    ("shape", r"returned an observation of float32\[5\], but its observation space is float32\[4\]"),
    ("dtype", r"returned an observation of float64\[4\], but its first one \(from reset\) was float32: an "
              r"environment's observations keep one dtype \(its observation space says float32\[4\]\)"),
    ("nan", r"returned a non-finite observation"),
    ("rewards", r"returned the reward array\(\[1., 1.\]\) \(ndarray\); step\(\) returns one number as its reward"),
    ("text", r"returned the reward '1.0' \(str\); step\(\) returns one number"),
    ("huge", r"returned a reward beyond float32's range \(msrl's observations and rewards are float32\): 1e\+300\. "),
    ("flag", r"failed in step: TypeError: Shifty.step\(\) returned truncated='no' \(str\); Gymnasium's API returns a "
             r"bool"),  # (it was read as True: an episode ended at every step)
])
def test_a_host_env_that_changes_midrun_is_named_with_its_step(tmp_path, mode, expect):
    """(A reward of two numbers was numpy's "setting an array element with a sequence", a string one was read as a
    number, a finite one beyond float32's range was called non-finite.) msrl's own message needs no traceback of the
    replica's."""
    with pytest.raises(msrl.TrainingError, match=expect) as info:
        train(EXAMPLES / "ppo_cartpole_threads.yaml",
              [*QUIET, "env.id=gymnasium:MsrlShifty-v0", f"env.kwargs.mode={mode}", "run.total_env_steps=4096"],
              run_dir=tmp_path)
    assert "environment gymnasium:MsrlShifty-v0 #0 at step 39" in str(info.value)
    assert "Traceback" not in str(info.value)
    assert str(info.value).endswith("The last complete iteration is 0 of 4; there is no checkpoint")
    assert not list(tmp_path.glob("checkpoints/*"))  # (it saved iteration 0's, untrained)


def test_a_wrapper_that_breaks_gymnasiums_api_is_named_around_its_env():
    """(A wrapper of one's own returning an array as ``terminated`` was reported as CartPoleEnv's doing.)"""
    import gymnasium

    from msrl.envs.gym_worker import step_one

    class BothFlags(gymnasium.Wrapper):
        def step(self, action):
            obs, reward, terminated, truncated, info = self.env.step(action)
            return obs, reward, np.array([terminated, terminated]), truncated, info

    env = BothFlags(gymnasium.make("CartPole-v1"))  # (inside make's own wrappers, which the name leaves out)
    env.reset(seed=0)
    with pytest.raises(TypeError, match=r"^BothFlags\(CartPoleEnv\).step\(\) returned terminated=array"):
        step_one(env, 0)


def test_an_env_that_fails_to_reset_in_process_is_named_with_its_own_frames(tmp_path):
    """(A threads replica's env that failed its first reset was a bare traceback through msrl's internals.)"""
    with pytest.raises(msrl.TrainingError, match=r"^environment gymnasium:MsrlQuirky-v0 #0 failed in reset: TypeError: "
                                                 r"Quirky.reset\(\) returned a ndarray; Gymnasium's API returns \(obs, "
                                                 r"info\) \(an env of the old Gym API returns the observation alone\)$"):
        train(EXAMPLES / "ppo_cartpole_threads.yaml", [*QUIET, "env.id=gymnasium:MsrlQuirky-v0",
                                                        "env.kwargs.mode=old_reset"], run_dir=tmp_path)
    with pytest.raises(msrl.TrainingError, match=r"#0 at step 20 failed in step: RuntimeError: environment exploded on "
                                                 r"purpose\nits traceback:\n  File \".*loops.py\", line \d+, in step\n") \
            as info:
        train(EXAMPLES / "ppo_cartpole_threads.yaml", [*QUIET, "env.id=gymnasium:MsrlShifty-v0",
                                                        "env.kwargs.mode=explode"], run_dir=tmp_path / "b")
    assert "msrl/" not in str(info.value) and "gymnasium/" not in str(info.value)  # the env's own frames only
    assert re.search(r"\nThe last complete iteration is 0 of \d+ \(iterations come back 16 at a time: "
                     r"run.iterations_per_dispatch\); there is no checkpoint$", str(info.value))


def test_a_slow_env_step_is_progress_until_it_outlasts_the_slowest_before(tmp_path):
    """A simulator taking 0.5 s a step is not stalled 0.2 s into a step (a stop request gave a 2.5 s one 2 s, then
    lost the run's iterations since its last checkpoint)."""
    from msrl.envs import make_env
    from msrl.runtime.driver import stall_report

    env = make_env("gymnasium:MsrlShifty-v0", mode="slow")
    state = env.init(jax.random.PRNGKey(0), np.arange(1))
    state, _ = env.step(state, np.zeros(1, np.int32))
    second = threading.Thread(target=env.step, args=(state, np.zeros(1, np.int32)))
    second.start()
    while state.busy is None:  # (the thread has started its step)
        time.sleep(0.01)
    time.sleep(0.2)
    words, since, slowest = env.busy(state)
    found = {("actor", 0): ("env", time.monotonic() - since, words, 1, slowest)}
    second.join()
    assert words == "environment gymnasium:MsrlShifty-v0 #0 at step 1 has not returned from step()"
    assert slowest >= 0.5 and found[("actor", 0)][1] > 0.15  # (the seconds it has been in the step, all of them)
    assert stall_report(found, 0.1, [("actor", 0)]) is None  # 0.2 s in, with a limit of 0.1 s: it may take 0.6 s


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


@register_env("uncounted")
class UncountedPoison(PoisonedCartPole):
    """The same env written to the documented minimum: its stats count no non-finite numbers."""

    def stats(self, state):
        return {k: v for k, v in super().stats(state).items() if k != "nonfinite"}


@pytest.mark.parametrize("example", ["ppo_cartpole.yaml", "a3c_cartpole.yaml"])
def test_a_nan_metric_from_an_env_that_counts_no_nans_names_the_env_to_check(tmp_path, example):
    """Under async (A3C) the NaN update was read as a learner that is no plain optimizer step: a ConfigError
    telling to change the policy, at iteration 3."""
    with pytest.raises(msrl.TrainingError, match=r"metric '.*' is nan \(non-finite\); training stopped.*Check "
                                                 r"environment uncounted:CartPole-v1's observations and rewards.*, "
                                                 r"or lower algorithm\.lr\. \(A metric the loop sets to NaN on "
                                                 r"purpose stops the run too: log a finite value\.\)$"):
        train(EXAMPLES / example, [*QUIET, "env.id=uncounted:CartPole-v1", "run.total_env_steps=20480",
                                               "run.iterations_per_dispatch=1"], run_dir=tmp_path)


def test_a_nan_metric_names_the_algorithms_own_learning_rate_keys(tmp_path):
    """SAC has no algorithm.lr (the hint named it): its actor's, critics' and temperature's rates."""
    from msrl.config import load_config
    from msrl.runner import _check_finite

    cfg = load_config(EXAMPLES / "sac_pendulum.yaml")
    with pytest.raises(msrl.TrainingError, match=r"^iteration 2: metric 'actor_loss' is nan \(non-finite\); training "
                                                 r"stopped.*Lower algorithm\.actor_lr / algorithm\.critic_lr / "
                                                 r"algorithm\.alpha_lr or check the environment's rewards\. \(A "
                                                 r"metric the loop sets to NaN on purpose"):
        _check_finite({"env_nonfinite": 0, "actor_loss": float("nan")}, 2, cfg, 200, tmp_path)
    swept = load_config(EXAMPLES / "ppo_cartpole.yaml", ["algorithm.lr=[1e-3,1e20]", "run.num_seeds=2"])
    rows = [{"loss": 1.0}, {"loss": 1.0}, {"loss": float("nan")}, {"loss": float("inf")}]  # (the mean: NaN)
    with pytest.raises(msrl.TrainingError, match=r"^iteration 2: metric 'loss' is nan \(non-finite\) \(of members "
                                                 r"lr=1e\+20,seed_0, lr=1e\+20,seed_1: the members are one "
                                                 r"program\); "):
        _check_finite({"loss": float("nan"), "per_seed": rows}, 2, swept, 200, tmp_path)


def _sensor(total_return):
    if float(total_return) >= 300:
        raise RuntimeError("sensor offline")
    return np.float32(0)


class CallbackCartPole(GymnaxEnv):
    """gymnax CartPole whose step calls back to the host (jax.pure_callback), which raises after a while."""

    def step(self, state, action):
        state, (obs, reward, done) = super().step(state, action)
        extra = jax.pure_callback(_sensor, jax.ShapeDtypeStruct((), jnp.float32), jnp.sum(state.running_return))
        return state, (obs, reward + extra, done)


register_env("callback")(CallbackCartPole)


def test_a_callback_raising_inside_a_fused_program_is_a_one_line_error(tmp_path, capfd):
    from msrl.cli import main

    assert main(["train", str(EXAMPLES / "ppo_cartpole.yaml"), *QUIET, "env.id=callback:CartPole-v1",
                 "run.total_env_steps=20480", "--run-dir", str(tmp_path)]) == 2
    err = capfd.readouterr().err
    assert re.search(r"msrl: error: fragment 'main' failed: JaxRuntimeError: .*callback.*: RuntimeError: sensor "
                     r"offline, in _sensor\(\) at .*test_reliability.py:\d+ \(--debug logs the callback's "
                     r"traceback\)\. The last complete iteration is \d+ of 40", err), err  # (as a replica's: no line)
    assert "Traceback" not in err


def test_a_callback_raising_in_a_replica_is_reported_at_the_loop_line_with_its_own_traceback(tmp_path, capfd):
    """In a replica (threads here; ray reports the replica's error alike) a host callback's error is one line, as
    under fused: the first loop line of the jitted statements XLA ran (an env step's callback was reported `at`
    the loop's earlier `obs = msrl.env_observe()` line, as if it raised there), the error, and the callback's
    own line (not the whole stack of the replica's thread and msrl's frames, twice, and JAX's filtering note). XLA
    may report it only once the step's outputs are awaited: it is still the replica's (it was the generic "the
    training program failed" when another thread read the state first)."""
    from msrl.cli import main

    cfg = {"algorithm": {"name": "growth", "fail_at": 2}, "env": {"id": "gymnax:CartPole-v1", "num_envs": 2},
           "policy": {"name": "single_learner_coarse", "backend": "threads", "actors": 1},
           "run": {"total_env_steps": 80, "progress": False, "tensorboard": False}}
    (tmp_path / "growth.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["train", str(tmp_path / "growth.yaml"), "--run-dir", str(tmp_path / "run")]) == 2
    err = capfd.readouterr().err
    [line] = [x for x in err.splitlines() if x.startswith("msrl: error:")]
    assert re.fullmatch(r"msrl: error: fragment 'learner' replica 0 failed(?: in the jitted statements from "
                        r".*loops\.py:\d+ `return msrl.agent_learn\(msrl.buffer_get\(\)\)` on)?: JaxRuntimeError: "
                        r".*callback: RuntimeError: "
                        r"sensor offline at "
                        r"update 2, in _sensor_check\(\) at .*loops\.py:\d+ \(--debug logs the callback's "
                        r"traceback\)\. The last complete iteration is 2 of 10; (saved a checkpoint of it: .*|no "
                        r"checkpoint of it could be saved \(its state is lost or mid-iteration\); there is no "
                        r"checkpoint)",
                        line), err  # (saved where the actor had not yet gone past it when the learner failed: a race)
    assert "Traceback" not in err and "JAX has removed" not in err, err


@pytest.mark.usefixtures("ray_cluster")
def test_chaos_random_actor_kills_every_few_seconds():
    """Three SIGKILLs of random actor processes during one run, restarts overlapping: every killed actor is
    restarted once per kill, the run completes, no update is lost, the parameters stay finite
    (benchmarks/chaos.py kills 20)."""
    from msrl.config import load_config

    cfg = load_config(EXAMPLES / "ppo_cartpole.yaml", ["policy.name=single_learner_coarse", "policy.backend=ray",
                                                       "policy.actors=3", "env.num_envs=6",
                                                       "policy.max_actor_restarts=10"])
    with msrl.Session(cfg, seed=0, iterations_per_dispatch=4) as session:
        runtime = session.runtime  # the ray runtime: where() and restarts
        rng, kills, stop = random.Random(0), [], threading.Event()

        def back(victim):  # restarted as often as it was killed
            return runtime.restarts.get(victim, 0) == kills.count(victim)

        def chaos():  # a kill every 0.5-1.5 s, of an actor that is back from its last one (restarts overlap)
            while not stop.is_set() and len(kills) < 3:
                time.sleep(rng.uniform(0.5, 1.5))
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
            assert len(kills) >= 3 and runtime.restarts == Counter(kills)  # each killed actor, once per kill
            state = session.snapshot()["learner"][0]["learner"]
            counts = {int(x) for p, x in jax.tree_util.tree_leaves_with_path(state["opt_state"])
                      if "count" in jax.tree_util.keystr(p)}
            assert counts == {len(rows) * cfg.algorithm.epochs * cfg.algorithm.minibatches}
            assert all(np.isfinite(r["loss"]) for r in rows)
            assert all(np.isfinite(x).all() for x in jax.tree.leaves(session.params()))
        finally:
            stop.set()


@pytest.mark.usefixtures("ray_cluster")
def test_a_killed_actor_rejoins_a_run_whose_actors_act_one_update_behind(capsys):
    """``sync: false``: the parameters an actor takes in iteration i were sent in i - 1, to the process that died;
    the restarted one gets them (it waited for them until the stall limit before)."""
    from msrl.config import load_config

    cfg = load_config(EXAMPLES / "ppo_cartpole.yaml", ["policy.name=single_learner_coarse", "policy.backend=ray",
                                                       "policy.actors=2", "env.num_envs=4", "policy.sync=false"])
    with msrl.Session(cfg, seed=0, stall_timeout_s=60) as session:
        rows = session.run(3)
        os.kill(session.runtime.where()[("actor", 1)][1], signal.SIGKILL)
        rows += session.run(4)
        assert session.runtime.restarts == {("actor", 1): 1}
        assert re.search(r"msrl: note: fragment 'actor' replica 1's process died; Ray restarted it \(restart 1 of "
                         r"policy.max_actor_restarts=3\), and it rejoins at iteration (3|4 \(its episodes of "
                         r"iteration 3 were never reported: the metrics leave them out\))\n", capsys.readouterr().err)
        assert [r["policy_lag"] for r in rows] == [0] + [1] * 6 and all(np.isfinite(r["loss"]) for r in rows)
        episodes = [r["episodes"] for r in rows]  # the restarted actor's envs count from 0: its episodes before are
        assert episodes == sorted(episodes) and episodes[2] > 0  # added (the column dropped for good)


def _unwritable_dir(tmp_path: Path) -> Path | None:
    """An empty directory this process cannot write to (root ignores permissions: sysfs then), or None."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o500)
    for candidate in (folder, Path("/sys/kernel/software_nodes")):
        try:
            (candidate / "probe").write_bytes(b"")
            (candidate / "probe").unlink()
        except OSError:
            if candidate.is_dir() and not any(candidate.iterdir()):
                return candidate
    return None


def test_a_bad_run_dir_is_refused_before_anything_compiles(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    cases = [(tmp_path / "file", "is a file"), (tmp_path / "file" / "run", "cannot create"),
             (_unwritable_dir(tmp_path), "is not writable")]
    for run_dir, text in cases:
        if run_dir is None:
            continue  # pragma: no cover - no unwritable directory on this machine
        with pytest.raises(msrl.ConfigError, match=text) as info:
            train(EXAMPLES / "ppo_cartpole.yaml", ["run.tensorboard=false"], run_dir=run_dir)
        assert info.value.key == "run_dir" and "compiling" not in capsys.readouterr().err
    assert cases[2][0] is not None or os.geteuid() != 0
    from msrl.resources import check_writable  # a run whose checkpoints/ is read-only (it failed at the first save,

    (tmp_path / "run" / "checkpoints").parent.mkdir()  # a bare "[Errno 30] Read-only file system")
    (tmp_path / "run" / "checkpoints").symlink_to(cases[2][0], target_is_directory=True)
    with pytest.raises(msrl.ConfigError, match="checkpoints is not writable") as info:
        check_writable(tmp_path / "run", "--resume")
    assert info.value.key == "--resume"


@pytest.mark.parametrize("example, overrides, key", [
    ("dqn_cartpole.yaml", ["env.id=gymnax:Breakout-MinAtar", "algorithm.buffer_size=2e9"], "algorithm.buffer_size"),
    ("ppo_cartpole.yaml", ["env.id=gymnax:Breakout-MinAtar", "env.num_envs=10000000", "run.total_env_steps=2e9"],
     "env.num_envs"),
    ("sac_pendulum.yaml", ["algorithm.batch_size=1e9", "algorithm.buffer_size=1e9", "algorithm.updates=4"],
     "algorithm.batch_size"),  # (it named env.num_envs: the samples were the largest part)
    ("recurrent_ppo_cartpole.yaml", ["algorithm.memory_size=65536"], "algorithm.memory_size"),  # (the learner's
    ("ppo_cartpole.yaml", ["algorithm.hidden=[100000,100000]"], "algorithm.hidden"),  # parameters; it named num_envs)
])
def test_a_program_larger_than_memory_is_refused_before_allocating(tmp_path, capsys, example, overrides, key):
    with pytest.raises(msrl.ConfigError, match=r"needs about [\d.,]+ [GT]B \([\d,]+ bytes: .*are free; lower") as info:
        train(EXAMPLES / example, ["run.tensorboard=false", *overrides], run_dir=tmp_path)
    assert info.value.key == key and "starting the" not in capsys.readouterr().err  # no backend started


def test_out_of_memory_and_a_full_disk_are_one_line_errors(tmp_path):
    import errno

    from msrl.resources import resource_errors

    with pytest.raises(msrl.TrainingError, match=r"out of memory \(.*\); lower env\.num_envs / algorithm\.buffer_size"):
        with resource_errors(tmp_path):
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 80000000000 bytes.")
    with pytest.raises(msrl.TrainingError, match="out of memory"), resource_errors(tmp_path):
        raise MemoryError
    # what an H200 shared by 8 test processes raised in a program's init (cuSolver's handle for an orthogonal init)
    with pytest.raises(msrl.TrainingError, match=r"^out of memory \(INTERNAL: .*cuSolver internal error.*; lower env"
                                                 r".*other processes use too: .*XLA_PYTHON_CLIENT_MEM_FRACTION"):
        with resource_errors(tmp_path):
            raise jax.errors.JaxRuntimeError("INTERNAL: jaxlib/gpu/solver_handle_pool.cc:37: operation "
                                             "gpusolverDnCreate(&handle) failed: cuSolver internal error")
    with pytest.raises(ValueError, match="other"), resource_errors(tmp_path):  # anything else as it was
        raise ValueError("other")

    # a real full disk: summary.json's temp file leads to /dev/full (ENOSPC on write)
    train(EXAMPLES / "ppo_cartpole.yaml", [*QUIET[:2], "run.total_env_steps=1024", "run.checkpoint_every_steps=512"],
          run_dir=tmp_path / "run")
    (tmp_path / "run" / "summary.json").unlink()
    (tmp_path / "run" / "summary.json.tmp").symlink_to("/dev/full")
    with pytest.raises(msrl.TrainingError, match=r"^disk full writing .*summary\.json$"):
        train(None, [], run_dir=tmp_path / "run", resume=True)
    assert not (tmp_path / "run" / "summary.json.tmp").exists() and not (tmp_path / "run" / "summary.json").exists()
    assert errno.ENOSPC == 28


@pytest.mark.parametrize("episodes", ["0", "-1", "100001"])
def test_eval_refuses_a_number_of_episodes_out_of_range(tmp_path, capsys, episodes):
    from msrl.cli import main

    assert main(["eval", str(tmp_path), "--episodes", episodes]) == 2
    assert f"--episodes: must be a whole number between 1 and 100,000, got {episodes}" in capsys.readouterr().err


def test_python_calls_refuse_arguments_of_the_wrong_type(tmp_path):
    """(evaluate(episodes="2") was a bare TypeError; train(run_dir=5) took 5 for a file descriptor.)"""
    from msrl.evaluate import evaluate

    with pytest.raises(msrl.ConfigError, match="^episodes: must be a whole number between 1 and 100,000, got '2'"):
        evaluate(tmp_path, episodes="2")
    with pytest.raises(msrl.ConfigError, match="^seed: must be a whole number between 0 and 4,294,967,295, got 1.5"):
        evaluate(tmp_path, seed=1.5)
    with pytest.raises(msrl.ConfigError, match="^run_dir: a run directory's path, got int 5"):
        msrl.train(EXAMPLES / "ppo_cartpole.yaml", run_dir=5)


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


def test_sigint_ends_a_threads_run_with_a_hung_env_within_seconds(tmp_path):
    """2 s for the hung env to return, then the checkpoint and the exit: 5.03 s measured on a 2-core box at load 10."""
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
    assert time.time() - sent <= 8, err[-3000:]
    assert proc.returncode == 130, err[-3000:]
    assert "environment gymnasium:MsrlHang-v0" in err and "has not returned from step()" in err, err[-3000:]
    # (an iteration a checkpoint was saved of: that is its checkpoint; it said none could be saved, then named it)
    assert re.search(rf"The last complete iteration is (\d) of 4; its checkpoint is {run}/checkpoints/ckpt_00000000\1",
                     err) and f"--resume {run}" in err, err[-3000:]
