"""ray backend: the single-learner policies as Ray actors, equivalence, multi-node, shutdown (restarts: test_reliability.py)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
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


def test_ray_fine_matches_fused():
    """single_learner_fine on Ray (coarse on Ray: the three-node test below matches it with coarse on threads,
    which tests/test_threads.py matches with fused). Fine goes to the actors every env step: 16-step rollouts."""
    short = ["algorithm.rollout_len=16"]
    fused, fused_rows = final_params([*short, "env.num_envs=8"], iterations=3)
    params, rows = final_params([*short, "policy.name=single_learner_fine", "policy.backend=ray", "policy.actors=2",
                                 "policy.envs_per_actor=4"], iterations=3)
    assert max_diff(fused, params) <= 1e-5
    assert [r["episodes"] for r in rows] == [r["episodes"] for r in fused_rows] and rows[-1]["episodes"] > 0


def test_a_dead_learner_ends_the_run_with_a_clear_error():
    with ray_session(["policy.name=single_learner_coarse", "policy.actors=1"]) as session:
        session.run(1)
        os.kill(session.runtime.where()[("learner", 0)][1], signal.SIGKILL)
        with pytest.raises(msrl.TrainingError, match="'learner' replica 0 died and cannot be restarted: it holds "
                                                     "the learner"):
            session.run(50)
        for ask in (session.params, session.snapshot, lambda: session.run(1)):  # (params: KeyError ('learner', 0))
            with pytest.raises(msrl.TrainingError, match=r"^this session stopped at a failure after iteration 1, its "
                                                         r"replicas' states not those of one finished iteration; start "
                                                         r"a new session"):
                ask()


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


def test_a_private_cluster_offers_what_the_replicas_ask_and_notes_more_cpus_than_cores(capsys):
    from msrl.backends.ray_backend import local_cpus

    cores = os.cpu_count() or 1
    for resources, cpus, noted in [([], max(cores, 3), False),  # 2 actors + the learner, 1 CPU each by default
                                   ([f"policy.resources.actor.num_cpus={cores * 10}"], cores * 20 + 1, True)]:
        cfg = load_config(CARTPOLE, ["policy.name=single_learner_coarse", "policy.backend=ray", *resources])
        assert local_cpus(cfg.policy, msrl.build(cfg)) == cpus
        err = capsys.readouterr().err
        assert (f"the replicas ask for {cpus} CPUs in all (policy.resources; 1 per replica unless set) and this "
                f"machine has {cores}: the private Ray cluster offers {cpus} so that every replica starts, and they "
                f"share the {cores} cores" in err) == noted, err


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


def test_more_resources_than_the_cluster_has_is_a_config_error(capsys):
    import ray

    with pytest.raises(msrl.ConfigError, match=r"policy.resources: the replicas need 1001 CPUs in all \(1 per "
                                               r"replica unless set\), but the Ray cluster has 4;"):
        ray_session(["policy.name=single_learner_coarse", "policy.resources.learner.num_cpus=999",
                     "policy.ray_address=127.0.0.1:9"])
    assert ray.is_initialized()  # the shared session is left as it was
    assert re.search(r"note: policy.ray_address=127.0.0.1:9 is not used: this process is already connected to the "
                     r"Ray cluster at [\d.]+:\d+ \(its own ray.init\), where msrl runs", capsys.readouterr().err)


def test_an_address_where_nothing_answers_or_a_malformed_one_fails_fast_and_clearly():
    import socket

    import ray

    with socket.socket() as s:  # a port on this machine that nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    from msrl.backends import ray_backend

    watchdog = ray_backend._WATCHDOG
    ray.shutdown()  # as a fresh driver would be; the shared session starts again below
    try:
        for address, why in [("127.0.0.1", "Invalid address format: 127.0.0.1"),  # (ray.init: a ValueError)
                             (f"127.0.0.1:{port}", "nothing answers: Connection refused")]:
            cfg = load_config(CARTPOLE, ["policy.name=single_learner_coarse", "policy.backend=ray",
                                         f"policy.ray_address={address}"])
            started = time.time()
            with pytest.raises(msrl.ConfigError, match=rf"policy.ray_address: cannot join a Ray cluster at "
                                                       rf"{address} \({why}\); start the cluster"):
                msrl.Session(cfg)
            assert time.time() - started < 30
        for address, how in [(f"ray://127.0.0.1:{port}", "through Ray Client \\(ray://\\)"),
                             (f"http://127.0.0.1:{port}", "a http:// URL")]:  # (a hint about tokens, before)
            cfg = load_config(CARTPOLE, ["policy.name=single_learner_coarse", "policy.backend=ray",
                                         f"policy.ray_address={address}"])
            with pytest.raises(msrl.ConfigError, match=rf"^policy.ray_address: {address}: msrl joins a Ray cluster "
                                                       rf"at the address of its head node, host:port .*; not {how}$"):
                msrl.Session(cfg)
    finally:
        _restart_shared_cluster()
    # the shared cluster's watchdog saw it gone (ray.shutdown alone leaves its stdin open) and ended
    assert watchdog.wait(timeout=10) == 0


def test_sessions_side_by_side_share_the_private_cluster_and_one_that_cannot_fit_is_refused():
    """Two sessions open at once in a fresh process share the private cluster msrl started (the first to close
    leaves it to the other; the last stops it); a third that needs more CPUs than are free is refused at once,
    naming what is free, instead of waiting forever for Ray to place its replicas."""
    got = run_script("""
        import json, time, ray, msrl
        half = ["policy.name=single_learner_coarse", "policy.backend=ray", "policy.actors=1",
                "policy.resources.actor.num_cpus=0.5", "policy.resources.learner.num_cpus=0.5"]
        a = msrl.Session("examples/ppo_cartpole.yaml", half)
        b = msrl.Session("examples/ppo_cartpole.yaml", half + ["run.seed=1"])
        a.run(1), b.run(1)
        a.close()
        rows = b.run(1)  # on the cluster a started
        cores = int(ray.cluster_resources()["CPU"])
        started, error = time.time(), None
        try:
            msrl.Session("examples/ppo_cartpole.yaml", half[:-1] + [f"policy.resources.learner.num_cpus={cores - 0.5}"])
        except msrl.ConfigError as e:
            error = str(e)
        took, still = time.time() - started, ray.is_initialized()
        b.close()
        print(json.dumps({"rows": len(rows), "cores": cores, "error": error, "took": took, "still": still,
                          "after": ray.is_initialized()}))
    """)
    assert got["rows"] == 1 and got["still"] and not got["after"], got
    assert got["error"] == (f"policy.resources: the replicas need {got['cores']:g} CPUs in all (1 per replica unless "
                            f"set), but only {got['cores'] - 1:g} of the Ray cluster's {got['cores']} are free: others "
                            "hold the rest (another session on the cluster, msrl's or not, or your own actors); close "
                            "it, or lower policy.resources.<role>.num_cpus (fractions are fine)"), got
    assert got["took"] < 60, got  # its compile, then the refusal: no wait for Ray to place what cannot fit


def test_joins_a_cluster_on_this_machine_that_requires_ray_token_authentication(tmp_path):
    """Ray starts a cluster with token authentication where a token is at hand (``ray start`` with
    ~/.ray/auth_token, which Ray writes when it first starts a local cluster); ``ray.init`` sends the token to an
    explicit address only when told, so joining it failed as if nothing ran there."""
    got = run_script(f"""
        import json, os
        os.environ["HOME"] = {str(tmp_path)!r}
        from ray._private.authentication.authentication_token_setup import generate_and_save_token
        generate_and_save_token()
        os.environ["RAY_AUTH_MODE"] = "token"  # the cluster requires the token, as `ray start` then does
        from ray.cluster_utils import Cluster
        from ray._raylet import Config
        cluster = Cluster(initialize_head=True, head_node_args={{"num_cpus": 2, "include_dashboard": False}})
        address = cluster.address
        del os.environ["RAY_AUTH_MODE"]  # the driver is told nothing of it
        Config.initialize("")
        import msrl
        with msrl.Session("examples/ppo_cartpole.yaml", ["policy.name=single_learner_coarse", "policy.backend=ray",
                          "policy.actors=1", f"policy.ray_address={{address}}"]) as s:
            rows = s.run(2)
        cluster.shutdown()
        print(json.dumps({{"rows": len(rows)}}))
    """)
    assert got["rows"] == 2


def test_joins_a_cluster_without_token_authentication_though_a_token_is_held_and_stops_on_sigterm(tmp_path):
    """A cluster started from Python (``ray.cluster_utils``) requires no token even where this machine holds one
    (~/.ray/auth_token); msrl joined it with the token, and the cluster, whose calls to the driver then carried
    none, killed every replica as it started. On a joined cluster SIGTERM exited at once with Ray's native stack
    dump (ray.init had replaced msrl's handler), and a replica larger than every node waited forever."""
    got = run_script(f"""
        import json, os, signal, subprocess, sys, time
        os.environ.pop("RAY_AUTH_MODE", None)
        os.environ["HOME"] = {str(tmp_path)!r}
        from ray._private.authentication.authentication_token_setup import generate_and_save_token
        generate_and_save_token()
        from ray.cluster_utils import Cluster
        cluster = Cluster(initialize_head=True, head_node_args={{"num_cpus": 1, "include_dashboard": False}})
        cluster.add_node(num_cpus=1)
        import msrl
        try:
            msrl.train("examples/ppo_cartpole.yaml", ["policy.name=single_learner_coarse", "policy.backend=ray",
                       "policy.actors=1", "policy.resources.learner.num_cpus=1.5",
                       "policy.resources.actor.num_cpus=0.5", f"policy.ray_address={{cluster.address}}"],
                       run_dir={str(tmp_path / "big")!r})
            error = None
        except msrl.ConfigError as e:
            error = str(e)
        # 2 actors of half a CPU and a learner of one fit the two nodes only with both actors on one: Ray placing
        # them one by one (SPREAD) put an actor on each node, and the learner waited for a free CPU forever
        try:  # three of 0.6 CPUs: 1.8 of the 2 in all, each fits a node, but no two fit one
            msrl.train("examples/ppo_cartpole.yaml", ["policy.name=single_learner_coarse", "policy.backend=ray",
                       "policy.actors=2", "policy.resources.learner.num_cpus=0.6",
                       "policy.resources.actor.num_cpus=0.6", f"policy.ray_address={{cluster.address}}"],
                       run_dir={str(tmp_path / "three")!r})
            unplaced = None
        except msrl.ConfigError as e:
            unplaced = str(e)
        with msrl.Session("examples/ppo_cartpole.yaml", ["policy.name=single_learner_coarse", "policy.backend=ray",
                          "policy.actors=2", "policy.resources.learner.num_cpus=1",
                          "policy.resources.actor.num_cpus=0.5", f"policy.ray_address={{cluster.address}}"]) as s:
            s.run(1)
            nodes = {{k[0] + str(k[1]): v[0] for k, v in s.runtime.where().items()}}
        mode = os.environ.get("RAY_AUTH_MODE")
        run = {str(tmp_path / "run")!r}
        train = subprocess.Popen([sys.executable, "-m", "msrl.cli", "train", "examples/ppo_cartpole.yaml",
                                  "policy.name=single_learner_coarse", "policy.backend=ray", "policy.actors=1",
                                  f"policy.ray_address={{cluster.address}}", "run.progress=false",
                                  "run.tensorboard=false", "--run-dir", run], stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 200
        while time.time() < deadline and train.poll() is None and not (
                os.path.exists(run + "/metrics.csv") and len(open(run + "/metrics.csv").readlines()) > 2):
            time.sleep(0.5)
        train.send_signal(signal.SIGTERM)
        _, err = train.communicate(timeout=120)
        cluster.shutdown()
        print(json.dumps({{"error": error, "unplaced": unplaced, "nodes": nodes, "mode": mode, "rc": train.returncode,
                          "err": err[-2000:], "summary": os.path.exists(run + "/summary.json")}}))
    """)
    assert got["error"] == ("policy.resources: a replica of learner needs 1.5 CPUs, but no node of the Ray cluster has "
                            "that many (the largest has 1); lower policy.resources.learner.num_cpus or add a larger "
                            "node"), got
    assert got["unplaced"] == ("policy.resources: the replicas do not fit on the Ray cluster's nodes together: with "
                               "the larger ones placed, no node has the 0.6 CPUs a replica of learner needs (left per "
                               "node: 0.4 CPUs, 0.4 CPUs); lower policy.resources.<role>.num_cpus (fractions are fine) "
                               "or add a node"), got
    nodes = got["nodes"]
    assert nodes["actor0"] == nodes["actor1"] != nodes["learner0"], nodes
    assert got["mode"] is None  # the user's environment as it was
    assert got["rc"] == 130 and got["summary"] and "SIGTERM: stopped after iteration" in got["err"], got["err"]
    assert "SIGTERM received" not in got["err"], got["err"]  # (Ray's native stack dump)


def test_what_the_replicas_print_reaches_the_driver_whole_and_named(tmp_path):
    """A replica's output (a user's print, jax.debug.print) is forwarded by Ray: every line, prefixed with the
    replica's role and index, without colour codes when not on a terminal, the last ones too."""
    out = subprocess.run([sys.executable, "-m", "msrl.cli", "train", "--import", str(ROOT / "tests" / "loops.py"),
                          str(ROOT / "examples" / "ppo_cartpole_threads.yaml"), "env.id=gymnasium:MsrlChatty-v0",
                          "policy.backend=ray", "run.total_env_steps=4096", "run.progress=false",
                          "run.tensorboard=false", "--run-dir", str(tmp_path)], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [x for x in out.stdout.splitlines() if "chatty" in x]
    got = sorted(tuple(int(n) for n in re.fullmatch(r"\(actor (\d) pid=\d+\) chatty (\d) (\d+)", x).groups())
                 for x in lines)
    assert got == [(a, e, t) for a in range(2) for e in range(4) for t in range(0, 512, 64)], lines  # 4 envs each


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
                 "run.total_env_steps=2048", "env.subprocesses=2",  # and the Ray actors' worker processes make it too
                 "run.progress=false", "run.tensorboard=false", "--run-dir", str(tmp_path / "run")]) == 0
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["backend"] == "ray"


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize("mode, message", [
    ("wide", r"^environment gymnasium:MsrlQuirky-v0 #0 at step 0 returned an observation of float32\[2\], but its "
             r"observation space is float32\[3\]$"),  # msrl's own error, as on threads
    ("old_reset", r"^environment gymnasium:MsrlQuirky-v0 #0 failed in reset: TypeError: Quirky.reset\(\) returned a "
                  r"ndarray; Gymnasium's API returns \(obs, info\) \(an env of the old Gym API returns the observation "
                  r"alone\)$"),  # (no hint about --import: the import worked)
])
def test_a_replica_that_cannot_start_on_ray_says_why_in_a_line(mode, message):
    import loops  # noqa: F401 - registers gymnasium's MsrlQuirky-v0

    with pytest.raises(msrl.MsrlError, match=message):
        msrl.Session(CARTPOLE, ["policy.name=single_learner_coarse", "policy.backend=ray", "policy.actors=1",
                                "env.id=gymnasium:MsrlQuirky-v0", f"env.kwargs.mode={mode}"])
