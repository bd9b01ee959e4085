"""Ray faults and exposure, each in a ``msrl train`` subprocess with its own private cluster: what it listens
on, SIGKILL of its driver, SIGTERM mid-run and resume, a lost raylet, a hung env (run.stall_timeout_s)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import alive

ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------------------------- reliability
def start_cli(run_dir: Path, *overrides: str) -> subprocess.Popen:
    """``msrl train`` of CartPole on ray in a subprocess (its own private cluster), progress lines on stdout."""
    return subprocess.Popen([sys.executable, "-m", "msrl.cli", "train", str(ROOT / "examples" / "ppo_cartpole.yaml"),
                             "policy.backend=ray", "run.tensorboard=false", "run.progress=true", *overrides,
                             "--run-dir", str(run_dir)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def wait_for_progress(proc: subprocess.Popen, timeout: float = 240) -> None:
    """Until the run prints its first progress line (its first dispatch is done)."""
    timer = threading.Timer(timeout, proc.kill)  # a hang guard
    timer.start()
    try:
        for line in proc.stderr:
            if " SPS " in line:
                return
        raise AssertionError(f"no progress line; exit {proc.wait()}: {proc.stderr.read()[-3000:]}")
    finally:
        timer.cancel()


def family(pid: int) -> list:
    import psutil

    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def test_a_private_cluster_listens_on_loopback_only_and_dies_with_a_killed_driver(tmp_path):
    """Every socket the driver and the processes it started (GCS, raylet, agents, replicas, the jax.distributed
    coordinator and gloo of multi_learner) listen on is a loopback one; SIGKILL of the driver leaves no process
    of them alive 10 s later."""
    import ipaddress
    import socket

    import psutil

    # multi_learner: replica processes (FragmentWorker), and its jax.distributed coordinator and gloo besides
    proc = start_cli(tmp_path / "run", "run.total_env_steps=400000", "run.checkpoint_every_steps=0",
                     "policy.name=multi_learner", "policy.learners=2", "env.num_envs=8")
    try:
        wait_for_progress(proc)
        listening, procs, cmds = {}, {}, {}
        for _ in range(10):  # a few looks while it trains
            procs.update({p.pid: p for p in family(proc.pid)})
            for p in procs.values():
                try:
                    cmds.setdefault(p.pid, " ".join(p.cmdline()))
                except psutil.Error:
                    pass
            for c in psutil.net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN and c.pid in procs:
                    listening[(c.laddr.ip, c.laddr.port)] = procs[c.pid].name()
            time.sleep(0.3)
    finally:
        proc.kill()
    proc.wait()
    # gloo (multi_learner's collectives) binds to the address this machine's hostname resolves to; jax has no
    # setting for it (README). On this machine that is loopback; elsewhere it is allowed for the replicas.
    hostname = socket.gethostbyname(socket.gethostname())

    def loopback(ip: str) -> bool:
        ip = ipaddress.ip_address(ip)
        return (getattr(ip, "ipv4_mapped", None) or ip).is_loopback

    dashboards = [c for c in cmds.values() if "dashboard/dashboard.py" in c]
    assert all("--disable-frontend" in c for c in dashboards)  # Ray's headless stats module at most: no UI
    names = set(listening.values())
    assert {"gcs_server", "raylet"} <= names and any("FragmentWorker" in n for n in names), listening
    exposed = {a: n for a, n in listening.items() if not loopback(a[0])
               and not (a[0] == hostname and "FragmentWorker" in n)}
    assert not exposed, f"listening beyond loopback: {exposed} (all: {listening})"
    deadline = time.time() + 10
    while time.time() < deadline and any(alive(p.pid) for p in procs.values()):
        time.sleep(0.2)
    left = [(p.pid, p.name()) for p in procs.values() if alive(p.pid)]
    assert not left, f"alive 10 s after the driver's SIGKILL: {left}"


@pytest.mark.parametrize("delay", [4.0, 5.0])
def test_a_ctrl_c_while_ray_starts_exits_130_not_with_a_segfault(tmp_path, delay):
    """A terminal's Ctrl-C (SIGINT to the process group) while ray.init connects: its half-connected core worker
    crashed the process's exit (SIGSEGV in Ray's metrics thread, about one start in three on the 2-core box, with
    the signal 4-5.5 s after the start line); the Ctrl-C now waits until ray.init returns, then stops the start."""
    proc = subprocess.Popen([sys.executable, "-m", "msrl.cli", "train", str(ROOT / "examples" / "ppo_cartpole.yaml"),
                             "policy.name=single_learner_coarse", "policy.backend=ray", "policy.actors=2",
                             "run.tensorboard=false", "--run-dir", str(tmp_path / "run")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    for line in proc.stderr:
        if "starting the ray backend" in line:
            break
    time.sleep(delay)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, (proc.returncode, err[-2000:])


def test_a_signal_on_ray_checkpoints_and_resume_finishes(tmp_path):
    """SIGTERM (handled as SIGINT; tests/test_runs.py sends both on fused and threads) to a ray driver: the dispatch under way finishes, a checkpoint and the summary are
    written, exit 130 naming the resume command, no native stack dump, no process left; resuming finishes."""
    run = tmp_path / "run"
    proc = start_cli(run, "policy.name=single_learner_coarse", "policy.actors=2", "run.total_env_steps=65536",
                     "run.iterations_per_dispatch=8", "run.checkpoint_every_steps=1000000")
    wait_for_progress(proc)
    pids = [p.pid for p in family(proc.pid)]
    sig = signal.SIGTERM
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert f"Continue with: msrl train --resume {run}" in err and "Traceback" not in err, err[-3000:]
    assert "*** SIG" not in err and "Stack trace" not in err  # no native crash report
    summary = json.loads((run / "summary.json").read_text())
    assert summary["interrupted"] == sig.name and 8 <= summary["iterations"] and summary["env_steps"] < 65536
    assert list((run / "checkpoints").glob("ckpt_*"))
    deadline = time.time() + 10
    while time.time() < deadline and any(alive(p) for p in pids):
        time.sleep(0.2)
    assert not [p for p in pids if alive(p)]
    from msrl.cli import main

    assert main(["train", "--resume", str(run), "run.progress=false"]) == 0
    assert json.loads((run / "summary.json").read_text())["env_steps"] == 65536


def test_a_lost_raylet_ends_the_run_naming_the_fragment_and_the_last_checkpoint(tmp_path):
    """SIGKILL of the private cluster's raylet mid-run: a one-line error naming the replica that could not be
    reached, the last complete iteration and the last checkpoint (the replicas' state is gone with it); exit
    2; nothing left running 10 s later."""
    import psutil

    for attempt in range(2):
        run = tmp_path / f"run{attempt}"
        proc = start_cli(run, "policy.name=single_learner_coarse", "policy.actors=2", "run.total_env_steps=400000",
                         "run.iterations_per_dispatch=4", "run.checkpoint_every_steps=16384")
        wait_for_progress(proc)
        deadline = time.time() + 60
        while not list((run / "checkpoints").glob("ckpt_*.msgpack")) and time.time() < deadline:
            time.sleep(0.1)
        procs = family(proc.pid)
        [raylet] = [p for p in procs if p.name() == "raylet"]
        raylet.kill()
        _, err = proc.communicate(timeout=120)
        # Ray's own C++ ends the driver (exit 1, "The connection to the plasma store is failed. Terminate the
        # process" in its log) when the raylet dies while the driver reads the object store (a checkpoint's
        # snapshot): msrl has no chance to report then. The replicas run on after the kill (they talk directly)
        # until the next snapshot, whose put fails in the learner; so the kill comes right after a checkpoint,
        # 8 dispatches before the next (with a checkpoint every dispatch, CI hit the race twice in a row). Should
        # it hit anyway, run once more.
        if not (proc.returncode == 1 and "msrl: error" not in err and "Traceback" not in err) or attempt:
            break
    assert proc.returncode == 2, err[-3000:]
    [line] = [x for x in err.splitlines() if x.startswith("msrl: error:")]
    assert re.fullmatch(rf"msrl: error: (fragment '(learner|actor)' replica \d (could not be reached|died)|the Ray "
                        rf"cluster failed while fragment).*\. The last complete iteration is \d+ of 781(?: "
                        rf"\(iterations come back \d+ at a time: run.iterations_per_dispatch\))?; (no checkpoint of it "
                        rf"could be saved \(its state is lost or mid-iteration\); the last|its) "
                        rf"checkpoint is {re.escape(str(run))}/checkpoints/ckpt_\d+\.msgpack", line), line
    deadline = time.time() + 10
    while time.time() < deadline and any(alive(p.pid) for p in procs):
        time.sleep(0.2)
    assert not [(p.pid, p.name()) for p in procs if alive(p.pid)]
    assert psutil.pid_exists(os.getpid())


def test_a_hung_env_on_ray_stalls_the_run_naming_env_and_step(tmp_path):
    """run.stall_timeout_s on ray: an actor whose Gymnasium env never returns from step() ends the run 3-10 s
    after it hung, naming the replica, the env and its step."""
    flag, run = tmp_path / "hung", tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "msrl.cli", "train", "--import", str(ROOT / "tests" / "loops.py"),
                             str(ROOT / "examples" / "ppo_cartpole_threads.yaml"), "env.id=gymnasium:MsrlHang-v0",
                             "env.kwargs.after=200", f"env.kwargs.flag={flag}", "policy.backend=ray",
                             "policy.actor_backend=ray", "run.stall_timeout_s=3", "run.total_env_steps=4096",
                             "run.tensorboard=false", "run.progress=false", "--run-dir", str(run)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    _, err = proc.communicate(timeout=300)
    assert flag.exists() and proc.returncode == 2, err[-3000:]  # (the env hung: it wrote the time it did)
    took = time.time() - float(flag.read_text())
    assert re.search(r"msrl: error: fragment 'actor' replica [01] made no progress for [3-9] s in iteration 2: "
                     r"environment gymnasium:MsrlHang-v0 #[04] at step 200 has not returned from step\(\) "
                     r"\(run.stall_timeout_s=3\)\. The last complete iteration is 1 of 4", err), err[-3000:]
    assert 3 <= took <= 12, took  # the error, then the cluster's shutdown
