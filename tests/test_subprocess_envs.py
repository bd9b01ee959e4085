"""gymnasium: host envs stepped in worker processes (env.subprocesses): the same numbers as in-process, clear
errors, no process left behind."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import gymnasium
import jax
import numpy as np
import pytest

import msrl
from msrl.envs import make_env

import loops  # noqa: F401 - registers gymnasium's MsrlShifty-v0
from helpers import EXAMPLES, final_params, max_diff


def test_worker_envs_step_as_in_process_envs():
    key = jax.random.PRNGKey(3)
    here, there = make_env("gymnasium:CartPole-v1"), make_env("gymnasium:CartPole-v1", subprocesses=2)
    a, b = here.init(key, np.arange(2, 7)), there.init(key, np.arange(2, 7))
    try:
        assert [len(p) for p in b.workers.parts] == [3, 2] and not b.envs
        np.testing.assert_array_equal(a.obs, b.obs)
        actions = np.array([0, 1, 1, 0, 1])
        for _ in range(40):
            a, out_a = here.step(a, actions)
            b, out_b = there.step(b, actions)
            for x, y in zip((*out_a, out_a.final_obs), (*out_b, out_b.final_obs)):
                np.testing.assert_array_equal(x, y)
        assert here.stats(a) == there.stats(b) and there.stats(b)["episodes"] >= 5
        a, obs_a = here.reset(a)
        b, obs_b = there.reset(b)
        np.testing.assert_array_equal(obs_a, obs_b)
    finally:
        there.close(b)
    assert all(p.returncode is not None for p in b.workers.procs)


def test_ppo_with_worker_processes_gives_the_parameters_of_in_process_envs():
    config = EXAMPLES / "ppo_cartpole_threads.yaml"
    here, here_rows = final_params([], iterations=3, config=config)
    there, there_rows = final_params(["env.subprocesses=3"], iterations=3, config=config)  # 4 envs per actor: 2+1+1
    assert max_diff(here, there) == 0.0
    assert [r["episodes"] for r in here_rows] == [r["episodes"] for r in there_rows]
    assert there_rows[-1]["episodes"] > 0


@pytest.mark.parametrize("mode, message", [
    ("explode", r"MsrlShifty-v0 #0 at step 20, in its worker process, failed in step: RuntimeError: environment exploded on "
                r"purpose\nits traceback:\n  File \".*loops.py\", line \d+, in step\n"),
    ("nan", r"MsrlShifty-v0 #0 at step 39 returned a non-finite observation"),
    ("shape", r"MsrlShifty-v0 #0 at step 39 returned an observation of float32\[5\]"),
])
def test_worker_env_errors_name_the_env(mode, message):
    env = make_env("gymnasium:MsrlShifty-v0", subprocesses=2, mode=mode)
    state = env.init(jax.random.PRNGKey(0), np.arange(4))
    try:
        with pytest.raises(msrl.TrainingError, match=message):
            for _ in range(45):
                state, _ = env.step(state, np.zeros(4, np.int32))
    finally:
        env.close(state)


@pytest.mark.parametrize("gone", [True, False])
def test_a_dead_worker_is_a_training_error(gone):
    """Killed and gone before the step (the step's request meets a broken pipe), or dying as it starts (its
    answer never comes): the same error."""
    env = make_env("gymnasium:CartPole-v1", subprocesses=2)
    state = env.init(jax.random.PRNGKey(0), np.arange(4))
    state.workers.procs[1].kill()
    if gone:
        state.workers.procs[1].wait()
    try:
        with pytest.raises(msrl.TrainingError, match=r"worker process of environments gymnasium:CartPole-v1 #2..#3 "
                                                     r"\(env.subprocesses\) exited with code -9 during step"):
            env.step(state, np.zeros(4, np.int32))
    finally:
        env.close(state)


def test_workers_leave_a_terminals_ctrl_c_to_the_run():
    """A terminal's Ctrl-C reaches the whole process group: the workers ignore it (they died of it, and the run
    with them, before it could save its checkpoint); the run stops itself and closes them."""
    import signal

    env = make_env("gymnasium:CartPole-v1", subprocesses=2)
    state = env.init(jax.random.PRNGKey(0), np.arange(4))
    try:
        for proc in state.workers.procs:
            for sig in (signal.SIGINT, signal.SIGTERM):
                proc.send_signal(sig)
        time.sleep(0.5)
        state, out = env.step(state, np.zeros(4, np.int32))
        assert np.asarray(out.reward).tolist() == [1.0] * 4
    finally:
        env.close(state)
    assert [proc.returncode for proc in state.workers.procs] == [0, 0]


def test_workers_stuck_in_a_step_are_killed_on_close_and_end_with_their_process():
    """An env whose step hangs: closing its envs kills the worker (the thread waiting on the step then fails as on a
    dead worker), and a process that exits while the step hangs leaves no worker behind (they watch their parent;
    they ignore SIGINT and SIGTERM, so they outlived a stalled run)."""
    import psutil

    env = make_env("gymnasium:MsrlShifty-v0", subprocesses=2, mode="hang")
    state = env.init(jax.random.PRNGKey(0), np.arange(4))
    failed = []
    stepping = threading.Thread(target=lambda: failed.append(pytest.raises(msrl.TrainingError, env.step, state,
                                                                           np.zeros(4, np.int32))))
    stepping.start()
    time.sleep(0.5)
    env.close(state)
    stepping.join(timeout=10)
    assert failed and "exited with code -9 during step" in str(failed[0].value)
    code = f"""
        import os, sys, threading, time, jax, numpy as np
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import loops
        from msrl.envs import make_env
        env = make_env("gymnasium:MsrlShifty-v0", subprocesses=2, mode="hang")
        state = env.init(jax.random.PRNGKey(0), np.arange(4))
        print(*[p.pid for p in state.workers.procs], flush=True)
        threading.Thread(target=env.step, args=(state, np.zeros(4, np.int32)), daemon=True).start()
        time.sleep(0.5)
        os._exit(0)
    """
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    pids = [int(pid) for pid in out.stdout.split()]
    assert len(pids) == 2, out.stderr[-2000:]

    def alive(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + 10
    while any(map(alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(map(alive, pids))


def test_subprocess_config_errors():
    with pytest.raises(msrl.ConfigError, match="env.subprocesses.*only gymnasium:"):
        make_env("gymnax:CartPole-v1", subprocesses=2)
    gymnasium.register(id="MsrlLocal-v0", entry_point=lambda: loops.Shifty())
    env = make_env("gymnasium:MsrlLocal-v0", subprocesses=2)
    with pytest.raises(msrl.ConfigError, match="env.subprocesses.*cannot be sent to worker processes"):
        env.init(jax.random.PRNGKey(0), np.arange(2))


def test_an_env_defined_in_main_is_a_clear_error(tmp_path):
    script = tmp_path / "my_script.py"
    script.write_text(textwrap.dedent("""
        import gymnasium, jax, numpy as np
        import msrl
        from msrl.envs import make_env

        class Mine(gymnasium.Env):
            observation_space = gymnasium.spaces.Box(-1.0, 1.0, (4,), np.float32)
            action_space = gymnasium.spaces.Discrete(2)

        gymnasium.register("MsrlMine-v0", entry_point=Mine)
        if __name__ == "__main__":
            env = make_env("gymnasium:MsrlMine-v0", subprocesses=2)
            try:
                env.init(jax.random.PRNGKey(0), np.arange(2))
            except msrl.TrainingError as e:
                print(e)
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120).stdout
    assert "MsrlMine-v0 #0, in its worker process, failed in make" in out
    assert "defined in your script's __main__ is unknown to worker processes" in out
    assert "traceback" not in out, out  # (it showed multiprocessing's frames, unpickling the env: none of the env's)


def test_more_workers_than_a_replicas_envs_is_noted(tmp_path, capsys):
    """(3 worker processes for a replica's 2 environments started 2 without a word.)"""
    msrl.train(EXAMPLES / "ppo_cartpole_threads.yaml", ["env.subprocesses=6", "run.total_env_steps=1024",
                                                        "run.progress=false", "run.tensorboard=false"], run_dir=tmp_path)
    assert "msrl: note: env.subprocesses=6, but each replica steps 4 environments: 4 worker processes each\n" in \
        capsys.readouterr().err


@pytest.mark.usefixtures("ray_cluster")
def test_a_session_on_ray_with_worker_envs_snapshots_and_restores():
    """Its snapshot leaves the host env's state out (its worker processes stay with their replica), and a restore
    checks only what the snapshot holds: `--resume` of such a run failed with `TypeError: cannot pickle
    '_thread.lock' object`, restoring fetched every state, the env's too."""
    with msrl.Session(EXAMPLES / "ppo_cartpole_threads.yaml", ["policy.backend=ray", "env.subprocesses=2",
                                                                "run.progress=false"]) as session:
        session.run(1)
        snapshot = session.snapshot()
        assert "env" not in {name for state in snapshot["actor"] for name in state}
        session.restore(snapshot)
        assert len(session.run(1)) == 1
