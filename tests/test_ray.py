"""ray backend: the single-learner policies as Ray actors, equivalence, multi-node, restarts, shutdown."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import CARTPOLE, assert_reaches, final_params, max_diff, reached

import msrl
from msrl.config import load_config

pytestmark = pytest.mark.usefixtures("ray_cluster")
ROOT = Path(__file__).resolve().parent.parent


def ray_session(overrides: list[str], iterations: int = 5) -> msrl.Session:
    cfg = load_config(CARTPOLE, ["run.seed=0", "run.total_env_steps=100000", "policy.backend=ray", *overrides])
    return msrl.Session(cfg, iterations_per_dispatch=iterations)


def test_ray_coarse_and_fine_match_fused():
    fused, fused_rows = final_params(["env.num_envs=8"], iterations=3)
    for policy in ("single_learner_coarse", "single_learner_fine"):
        params, rows = final_params([f"policy.name={policy}", "policy.backend=ray", "policy.actors=2",
                                     "policy.envs_per_actor=4"], iterations=3)
        assert max_diff(fused, params) <= 1e-5, policy
        assert [r["episodes"] for r in rows] == [r["episodes"] for r in fused_rows]


def test_killed_actors_restart_and_the_learner_loses_no_update():
    with ray_session(["policy.name=single_learner_coarse", "policy.actors=2",
                      "policy.max_actor_restarts=2"]) as session:
        cfg, runtime, kills = session.config, session.runtime, []

        def killer():
            for victim in (("actor", 1), ("actor", 0)):
                time.sleep(0.5)
                os.kill(runtime.where()[victim][1], signal.SIGKILL)
                kills.append(victim)
                while runtime.restarts.get(victim, 0) < 1:
                    time.sleep(0.05)

        rows = session.run(2)
        thread = threading.Thread(target=killer, daemon=True)
        thread.start()
        while thread.is_alive() or len(rows) < 20:
            rows += session.run(4)
        assert runtime.restarts == {("actor", 1): 1, ("actor", 0): 1} and len(kills) == 2
        state = session.snapshot()["learner"][0]["learner"]
        counts = {int(np.max(x)) for p, x in jax.tree_util.tree_leaves_with_path(state["opt_state"])
                  if "count" in jax.tree_util.keystr(p)}
        assert counts == {len(rows) * cfg.algorithm.epochs * cfg.algorithm.minibatches}
        assert all(np.isfinite(x).all() for x in jax.tree.leaves(session.params()))
        assert all(np.isfinite(r["loss"]) for r in rows)


def test_a_dead_learner_ends_the_run_with_a_clear_error():
    with ray_session(["policy.name=single_learner_coarse", "policy.actors=2"]) as session:
        session.run(1)
        os.kill(session.runtime.where()[("learner", 0)][1], signal.SIGKILL)
        with pytest.raises(msrl.TrainingError, match="'learner' replica 0 died and cannot be restarted: it holds "
                                                     "the learner"):
            session.run(50)


def test_ppo_cartpole_on_ray_reaches_475(tmp_path):
    summary = msrl.train(CARTPOLE, ["policy.name=single_learner_coarse", "policy.actors=2", "policy.backend=ray",
                                    "run.progress=false"], run_dir=tmp_path, on_iteration=reached(475))
    assert summary["env_steps"] <= 300_000 and summary["backend"] == "ray"
    assert_reaches(tmp_path, 475, within=300_000)


def test_resources_per_role_and_unknown_roles():
    cfg = load_config(CARTPOLE, ["policy.name=single_learner_coarse", "policy.backend=ray",
                                 "policy.resources.learner.num_cpus=2", "policy.resources.actor.num_gpus=0"])
    specs = {f.name: f for f in cfg.policy.fragments()}
    assert (specs["learner"].num_cpus, specs["actor"].num_cpus, specs["actor"].num_gpus) == (2, 1, 0)
    bad = load_config(CARTPOLE, ["policy.name=single_learner_coarse", "policy.resources.central.num_cpus=1"])
    with pytest.raises(msrl.ConfigError, match="policy.resources.central: not a role"):
        msrl.build(bad)
    with pytest.raises(msrl.ConfigError, match="policy.actor_backend"):
        msrl.build(load_config(CARTPOLE, ["policy.name=single_learner_coarse", "policy.backend=ray",
                                          "policy.actor_backend=threads"]))


def run_script(code: str, timeout: int = 300) -> dict:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                         timeout=timeout, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_three_node_cluster_spreads_actors_and_matches_one_node():
    """Three raylets on this machine (ray.cluster_utils.Cluster); each replica lands on its own node."""
    got = run_script("""
        import json, ray, jax, numpy as np
        from ray.cluster_utils import Cluster
        import msrl
        from msrl.config import load_config
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
        for _ in range(2):
            cluster.add_node(num_cpus=1)
        cfg = load_config("examples/ppo_cartpole.yaml", ["run.seed=0", "run.total_env_steps=100000",
            "policy.name=single_learner_coarse", "policy.backend=ray", "policy.actors=2", "policy.envs_per_actor=4",
            f"policy.ray_address={cluster.address}"])
        with msrl.Session(cfg, iterations_per_dispatch=3) as session:
            session.run(3)
            nodes = {"/".join(map(str, k)): v[0] for k, v in session.runtime.where().items()}
            params = jax.tree.map(lambda x: np.asarray(x).tolist(), session.params())
        assert not ray.is_initialized()  # we joined the cluster, so we leave it
        cluster.shutdown()
        print(json.dumps({"nodes": nodes, "params": params}))
    """)
    assert len(set(got["nodes"].values())) == 3, got["nodes"]
    single, _ = final_params(["policy.name=single_learner_coarse", "policy.actors=2", "policy.envs_per_actor=4"],
                             iterations=3)
    remote = jax.tree.map(np.asarray, got["params"], is_leaf=lambda x: isinstance(x, list))
    assert max_diff(jax.tree.map(np.asarray, single), remote) <= 1e-5


def test_private_cluster_is_local_without_dashboard_and_close_leaves_no_process_behind():
    got = run_script("""
        import json, time, psutil, ray, msrl
        from msrl.config import load_config
        cfg = load_config("examples/ppo_cartpole.yaml", ["policy.name=single_learner_coarse", "policy.backend=ray",
                                                         "policy.actors=2"])
        with msrl.Session(cfg, seed=0, iterations_per_dispatch=2) as session:
            session.run(2)
            procs = psutil.Process().children(recursive=True)
            pids, cmds = [p.pid for p in procs], [" ".join(p.cmdline()) for p in procs]
            addresses = sorted({n["NodeManagerAddress"] for n in ray.nodes()})
            mine = sorted({a.address for nic in psutil.net_if_addrs().values() for a in nic})
        print(json.dumps({"pids": pids, "cmds": cmds, "addresses": addresses, "mine": mine}))
    """)
    assert got["addresses"] and set(got["addresses"]) <= set(got["mine"])  # this machine's own addresses
    dashboards = [c for c in got["cmds"] if "dashboard/dashboard.py" in c]
    assert all("--disable-frontend" in c for c in dashboards)  # Ray's headless stats module at most: no UI
    assert len(got["pids"]) >= 4  # gcs, raylet, our three replicas, ...
    deadline = time.time() + 30
    while time.time() < deadline and any(alive(p) for p in got["pids"]):
        time.sleep(0.2)
    assert not [p for p in got["pids"] if alive(p)]


def alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_more_resources_than_the_cluster_has_is_a_config_error():
    import ray

    with pytest.raises(msrl.ConfigError, match=r"policy.resources: the replicas need 1001 CPUs in all, but the Ray "
                                               r"cluster has 4"):
        ray_session(["policy.name=single_learner_coarse", "policy.resources.learner.num_cpus=999"])
    assert ray.is_initialized()  # the shared session is left as it was


def test_an_address_where_nothing_answers_fails_fast_and_clearly():
    import socket

    import ray

    with socket.socket() as s:  # a port on this machine that nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = load_config(CARTPOLE, ["policy.name=single_learner_coarse", "policy.backend=ray",
                                 f"policy.ray_address=127.0.0.1:{port}"])
    ray.shutdown()  # as a fresh driver would be; the shared session starts again below
    try:
        started = time.time()
        with pytest.raises(msrl.ConfigError, match=rf"policy.ray_address: nothing answers at 127.0.0.1:{port}"):
            msrl.Session(cfg)
        assert time.time() - started < 30
    finally:
        _restart_shared_cluster()


def _restart_shared_cluster():
    import ray
    from msrl.backends.ray_backend import init_local

    if not ray.is_initialized():
        init_local(num_cpus=4)


def test_imported_user_modules_are_imported_in_every_ray_worker(tmp_path):
    """A Gymnasium env registered by a module given to --import trains on ray: each worker imports it too."""
    from msrl.cli import main

    (tmp_path / "my_envs.py").write_text(textwrap.dedent("""
        import gymnasium
        gymnasium.register(id="MsrlUserCartPole-v0", entry_point="gymnasium.envs.classic_control:CartPoleEnv",
                           max_episode_steps=500)
    """))
    assert main(["train", "--import", str(tmp_path / "my_envs.py"), str(ROOT / "examples" / "ppo_cartpole_threads.yaml"),
                 "env.id=gymnasium:MsrlUserCartPole-v0", "policy.backend=ray", "policy.actor_backend=ray",
                 "run.total_env_steps=2048",
                 "run.progress=false", "run.tensorboard=false", "--run-dir", str(tmp_path / "run")]) == 0
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["backend"] == "ray"


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
        for line in proc.stdout:
            if " SPS " in line:
                return
        raise AssertionError(f"no progress line; exit {proc.wait()}: {proc.stderr.read()[-3000:]}")
    finally:
        timer.cancel()


def family(pid: int) -> list:
    import psutil

    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


@pytest.mark.parametrize("policy", [["policy.name=single_learner_coarse", "policy.actors=2"],
                                    ["policy.name=multi_learner", "policy.learners=2", "env.num_envs=8"]],
                         ids=["coarse", "multi_learner"])
def test_a_private_cluster_listens_on_loopback_only_and_dies_with_a_killed_driver(tmp_path, policy):
    """Every socket the driver and the processes it started (GCS, raylet, agents, replicas, the jax.distributed
    coordinator and gloo of multi_learner) listen on is a loopback one; SIGKILL of the driver leaves no process
    of them alive 10 s later."""
    import ipaddress
    import socket

    import psutil

    proc = start_cli(tmp_path / "run", "run.total_env_steps=400000", "run.checkpoint_every_steps=0", *policy)
    try:
        wait_for_progress(proc)
        listening, procs = {}, {}
        for _ in range(10):  # a few looks while it trains
            procs.update({p.pid: p for p in family(proc.pid)})
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


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_on_ray_checkpoints_and_resume_finishes(tmp_path, sig):
    """SIGINT or SIGTERM to a ray driver: the dispatch under way finishes, a checkpoint and the summary are
    written, exit 130 naming the resume command, no native stack dump, no process left; resuming finishes."""
    run = tmp_path / "run"
    proc = start_cli(run, "policy.name=single_learner_coarse", "policy.actors=2", "run.total_env_steps=65536",
                     "run.iterations_per_dispatch=8", "run.checkpoint_every_steps=1000000")
    wait_for_progress(proc)
    pids = [p.pid for p in family(proc.pid)]
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
    if sig == signal.SIGTERM:
        return
    from msrl.cli import main

    assert main(["train", "--resume", str(run), "run.progress=false"]) == 0
    assert json.loads((run / "summary.json").read_text())["env_steps"] == 65536


def test_a_lost_raylet_ends_the_run_naming_the_fragment_and_the_last_checkpoint(tmp_path):
    """SIGKILL of the private cluster's raylet mid-run: a one-line error naming the replica that could not be
    reached, the last complete iteration and the last checkpoint (the replicas' state is gone with it); exit
    2; nothing left running 10 s later."""
    import psutil

    run = tmp_path / "run"
    proc = start_cli(run, "policy.name=single_learner_coarse", "policy.actors=2", "run.total_env_steps=400000",
                     "run.iterations_per_dispatch=4", "run.checkpoint_every_steps=2048")
    wait_for_progress(proc)
    deadline = time.time() + 60
    while not list((run / "checkpoints").glob("ckpt_*.msgpack")) and time.time() < deadline:
        time.sleep(0.1)
    procs = family(proc.pid)
    [raylet] = [p for p in procs if p.name() == "raylet"]
    raylet.kill()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err[-3000:]
    [line] = [x for x in err.splitlines() if x.startswith("msrl: error:")]
    assert re.fullmatch(rf"msrl: error: (fragment '(learner|actor)' replica \d (could not be reached|died)|the Ray "
                        rf"cluster failed while fragment).*\. The last complete iteration is \d+ of 781; no "
                        rf"checkpoint of it could be saved \(its state is lost or mid-iteration\); the last "
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
    took = time.time() - float(flag.read_text())
    assert proc.returncode == 2, err[-3000:]
    assert re.search(r"msrl: error: fragment 'actor' replica [01] made no progress for [3-9] s in iteration 2: "
                     r"environment gymnasium:MsrlHang-v0 #[04] at step 200 has not returned from step\(\) "
                     r"\(run.stall_timeout_s=3\)\. The last complete iteration is 1 of 4", err), err[-3000:]
    assert 3 <= took <= 12, took  # the error, then the cluster's shutdown
