"""Run directories hold one run; SIGINT/SIGTERM checkpoint and say how to resume; callbacks stop a run."""

from __future__ import annotations

import csv
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Literal

import numpy as np
import pytest
import yaml

import msrl
from msrl import runner
from msrl.algorithms.ppo.ppo import PPO
from msrl.cli import main
from msrl.errors import ConfigError
from msrl.evaluate import evaluate

from helpers import CARTPOLE, EXAMPLES, QUICK, final_leaves

SHORT = [*QUICK[:2], "run.total_env_steps=4096"]


def test_a_used_run_dir_is_refused_and_overwrite_replaces_it(tmp_path, capsys):
    run = tmp_path / "run"
    with pytest.raises(msrl.ConfigError, match=r"^run_dir: .*/a{300}: File name too long$"):  # (was a bare OSError)
        msrl.train(CARTPOLE, SHORT, run_dir=tmp_path / ("a" * 300))
    assert main(["train", CARTPOLE, *SHORT, "run.checkpoint_every_steps=1024", "--run-dir", str(run)]) == 0
    first = json.loads((run / "summary.json").read_text())
    assert main(["train", CARTPOLE, *SHORT, "--run-dir", str(run)]) == 2
    assert f"{run} already holds a run; continue it with --resume {run}, or replace it with --overwrite" \
        in capsys.readouterr().err
    with pytest.raises(ConfigError) as info:  # from Python: train()'s keywords, not the CLI's flags
        msrl.train(CARTPOLE, SHORT, run_dir=run)
    with pytest.raises(ConfigError, match=rf"^run_dir: {run}/inner is inside the run in {run}: choose a run_dir "
                                          "outside it$"):  # (--overwrite would keep it as the user's files)
        msrl.train(CARTPOLE, SHORT, run_dir=run / "inner")
    assert str(info.value) == f"run_dir: {run} already holds a run; continue it with resume=True, or replace it " \
        "with overwrite=True"
    # a replacement the compiler refuses leaves the old run as it was
    assert main(["train", CARTPOLE, *SHORT, "algorithm.minibatches=3", "--overwrite", "--run-dir", str(run)]) == 2
    assert "algorithm.minibatches" in capsys.readouterr().err
    assert json.loads((run / "summary.json").read_text()) == first and evaluate(run, episodes=1)["iteration"] == 8
    # the replacement is the only run there: its checkpoints, its rows, and eval reads it; the user's files stay,
    # named like a member's folder or not
    (run / "seed_notes.txt").write_text("mine")
    (run / "plots_lr=1e-3").mkdir()
    assert main(["train", CARTPOLE, *SHORT, "run.total_env_steps=2048", "run.checkpoint_every_steps=512", "--overwrite",
                 "--run-dir", str(run)]) == 0
    second = json.loads((run / "summary.json").read_text())
    assert (first["iterations"], second["iterations"]) == (8, 4)
    assert (run / "seed_notes.txt").read_text() == "mine" and (run / "plots_lr=1e-3").is_dir()
    assert len((run / "metrics.csv").read_text().splitlines()) == 1 + 4
    assert evaluate(run, episodes=1)["iteration"] == 4
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    assert main(["train", CARTPOLE, *SHORT, "--overwrite", "--run-dir", str(tmp_path / "other")]) == 2
    assert "holds files but no run" in capsys.readouterr().err
    assert main(["train", CARTPOLE, *SHORT, "--run-dir", str(tmp_path / "other")]) == 2  # not: "--resume" it
    assert "--run-dir: " + str(tmp_path / "other") + " holds files but no run" in capsys.readouterr().err
    assert (tmp_path / "other" / "notes.txt").exists()
    assert main(["train", CARTPOLE, *SHORT, "--overwrite"]) == 2  # nothing to replace
    assert "--overwrite: replaces the run in --run-dir DIR" in capsys.readouterr().err
    shutil.rmtree(run / "checkpoints")  # as a run stopped (by an on_iteration that raised) before its first
    assert main(["train", CARTPOLE, *SHORT, "--run-dir", str(run)]) == 2
    assert f"{run} already holds a run that stopped before its first checkpoint; start it again with --overwrite" \
        in capsys.readouterr().err


def test_a_resume_says_which_rows_a_cut_metrics_file_lost_and_drops_a_half_written_one(tmp_path, capsys):
    assert main(["train", CARTPOLE, *SHORT, "run.checkpoint_every_steps=1024", "--run-dir", str(tmp_path)]) == 0
    metrics = tmp_path / "metrics.csv"
    lines = metrics.read_text().splitlines(keepends=True)
    metrics.write_text("".join(lines[:4]) + lines[4][:len(lines[4]) // 2])  # rows 1-3 and half of row 4
    capsys.readouterr()
    assert main(["train", "--resume", str(tmp_path), "run.total_env_steps=5120"]) == 0
    assert f"note: {metrics}'s rows end at iteration 3, the checkpoint is of iteration 8: the rows of iterations " \
        "4..8 are lost" in capsys.readouterr().err
    with open(metrics, newline="") as f:
        assert [int(r["iteration"]) for r in csv.DictReader(f)] == [1, 2, 3, 9, 10]


def test_a_resumed_run_that_logs_a_new_metric_adds_its_column(tmp_path, capsys, monkeypatch):
    """A run written by an older msrl (or algorithm) that did not log a metric: resumed, the new metric was
    dropped from metrics.csv without a word (the header was the old one). Resumed by other versions than those
    that saved the checkpoint, it says so (it went on without a word)."""
    assert main(["train", CARTPOLE, *SHORT, "run.checkpoint_every_steps=2048", "--run-dir", str(tmp_path)]) == 0
    metrics = tmp_path / "metrics.csv"
    with open(metrics, newline="") as f:
        rows = list(csv.DictReader(f))
    old = [{k: v for k, v in r.items() if k != "entropy"} for r in rows]  # as a version without it wrote them
    with open(metrics, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(old[0]))
        writer.writeheader()
        writer.writerows(old)
    capsys.readouterr()
    saved = runner.versions()
    monkeypatch.setattr(runner, "versions", lambda: {**saved, "jax": "9.9.9"})  # (as a newer jax would answer)
    assert main(["train", "--resume", str(tmp_path), "run.total_env_steps=5120"]) == 0
    err = capsys.readouterr().err
    assert f"note: {metrics} gains the column entropy (the rows before the resumed checkpoint leave them empty)" in err
    assert (f"msrl: note: the checkpoint {tmp_path / 'checkpoints' / 'ckpt_000000008.msgpack'} was saved with msrl "
            f"{saved['msrl']}, jax {saved['jax']}, jaxlib {saved['jaxlib']}; this is msrl {saved['msrl']}, jax 9.9.9, "
            f"jaxlib {saved['jaxlib']}: the run goes on from it, but its numbers may differ") in err
    with open(metrics, newline="") as f:
        after = list(csv.DictReader(f))
    assert [int(r["iteration"]) for r in after] == list(range(1, 11))
    assert [r["entropy"] == "" for r in after] == [True] * 8 + [False] * 2
    assert all(float(r["entropy"]) > 0 for r in after[8:])


def test_resume_with_the_run_dir_alone(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", CARTPOLE, *SHORT, "run.checkpoint_every_steps=2048", "--run-dir", str(run)]) == 0
    # the run's own config (a watchdog's setting may change: it changes no number)
    assert main(["train", "--resume", str(run), "run.total_env_steps=6144", "run.stall_timeout_s=60",
                 "run.progress=true"]) == 0
    err = capsys.readouterr().err
    assert "run.total_env_steps changes from 4,096 to 6,144; anneal_lr's learning rate follows the new total" in err
    assert "was saved with" not in err  # (the same versions)
    # where it picks up (it went from "starting the jax backend" to a progress line past the checkpoint)
    assert f"msrl: resuming at iteration 8 (4,096 env steps) from {run / 'checkpoints' / 'ckpt_000000008.msgpack'}\n" \
        in err
    flat = tmp_path / "flat"
    assert main(["train", CARTPOLE, *SHORT, "algorithm.anneal_lr=false", "--run-dir", str(flat)]) == 0
    assert main(["train", "--resume", str(flat), "run.total_env_steps=6144"]) == 0
    assert "4,096 to 6,144; any schedule the algorithm builds from it follows the new total" \
        in capsys.readouterr().err
    assert json.loads((run / "summary.json").read_text())["iterations"] == 12
    # the newest checkpoint lost, a resume to the next one's steps ends there: its summary, rows and config (it
    # returned the lost checkpoint's summary, kept its rows and said the schedule follows a new total)
    max(run.glob("checkpoints/ckpt_*.msgpack")).unlink()
    summary = msrl.train(None, ["run.total_env_steps=4096"], run_dir=run, resume=True)
    assert (summary["iterations"], summary["env_steps"]) == (8, 4096)
    assert "follows the new total" not in capsys.readouterr().err
    assert len((run / "metrics.csv").read_text().splitlines()) == 1 + 8
    assert json.loads((run / "summary.json").read_text())["iterations"] == 8
    assert msrl.train(None, ["run.total_env_steps=4096"], run_dir=run, resume=True).rows == []  # (as it was)


def test_a_run_dir_named_like_a_seeds_folder_is_a_run_of_its_own(tmp_path):
    """Only a folder inside a run of several members is refused as one (seed_N/, KEY=VALUE/); a run directory of
    one seed named so, beside a config.yaml, resumes."""
    shutil.copy(CARTPOLE, tmp_path / "config.yaml")
    for name in ("seed_1", "lr=3e-4"):
        assert main(["train", str(tmp_path / "config.yaml"), *SHORT, "run.total_env_steps=2048",
                     "--run-dir", str(tmp_path / name)]) == 0
        assert main(["train", "--resume", str(tmp_path / name), "run.total_env_steps=3072"]) == 0


def test_a_policy_that_sets_another_count_of_environments_says_so(tmp_path, capsys):
    split = ["policy.name=single_learner_coarse", "policy.actors=2", "policy.envs_per_actor=3"]
    assert main(["train", CARTPOLE, *SHORT, *split, "--run-dir", str(tmp_path / "run")]) == 0
    assert "runs env.num_envs=6 environments (its replicas x envs per replica), not the 4 the config gives" \
        in capsys.readouterr().err
    assert main(["train", "--resume", str(tmp_path / "run"), "run.total_env_steps=6144"]) == 0
    assert "envs per replica" not in capsys.readouterr().err  # its config.yaml holds the count it ran


@msrl.register_algorithm("ppo_acting_only")
class ActingOnly(PPO):
    class Config(PPO.Config):
        name: Literal["ppo_acting_only"] = "ppo_acting_only"

    def train_step(self):
        obs = msrl.env_observe()
        out = msrl.agent_act(obs)
        msrl.env_step(out.action)
        return {}


def test_a_loop_that_never_learns_is_noted(tmp_path, capsys):
    """(A loop whose agent_learn was dropped trained without a word and learned nothing.)"""
    assert main(["train", CARTPOLE, *SHORT, "algorithm.name=ppo_acting_only", "--run-dir", str(tmp_path)]) == 0
    assert "msrl: note: ActingOnly.train_step never calls msrl.agent_learn: this run learns nothing\n" \
        in capsys.readouterr().err


def test_on_iteration_stops_the_run_after_the_iterations_under_way(tmp_path):
    seen = []
    summary = msrl.train(CARTPOLE, [*SHORT, "run.iterations_per_dispatch=2"], run_dir=tmp_path,
                         on_iteration=lambda row: seen.append(row["iteration"]) or row["iteration"] >= 3)
    assert summary["stopped_early"] and summary["iterations"] in (4, 5, 6) and seen[-1] == summary["iterations"]
    assert len((tmp_path / "metrics.csv").read_text().splitlines()) == 1 + summary["iterations"]


def test_an_on_iteration_that_raises_stops_the_run_saves_it_then_raises(tmp_path):
    def failing_logger(row):
        if row["iteration"] == 2:
            raise ValueError("my logger failed")

    run = tmp_path / "run"
    with pytest.raises(ValueError, match="my logger failed") as raised:
        msrl.train(CARTPOLE, [*SHORT, "run.iterations_per_dispatch=1"], run_dir=run, on_iteration=failing_logger)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stopped_early"] and summary["iterations"] in (2, 3)
    assert f"on_iteration raised this at iteration 2; the run stopped after iteration {summary['iterations']} of 8 " \
        f"and saved its checkpoint and summary in {run}" in "".join(raised.value.__notes__)
    assert evaluate(run, episodes=1)["iteration"] == summary["iterations"]
    assert msrl.train(None, run_dir=run, resume=True)["iterations"] == 8
    with pytest.raises(ValueError, match="truth value of an array") as raised:  # numpy's error, as one it raised
        msrl.train(CARTPOLE, SHORT, run_dir=tmp_path / "array", on_iteration=lambda row: np.array([1.0, 2.0]))
    assert "on_iteration raised this at iteration 1" in "".join(raised.value.__notes__)
    with pytest.raises(msrl.ConfigError, match="^on_iteration: a function of a metrics row .*, got int$"):
        msrl.train(CARTPOLE, SHORT, run_dir=tmp_path / "int", on_iteration=5)


_STRAIGHT: dict[tuple[str, ...], tuple] = {}


def _straight(overrides: tuple[str, ...], run_dir) -> tuple:
    """The final checkpoint of an uninterrupted run of ``overrides`` (SIGINT and SIGTERM share one)."""
    if overrides not in _STRAIGHT:
        msrl.train(CARTPOLE, list(overrides), run_dir=run_dir)
        _STRAIGHT[overrides] = final_leaves(run_dir)
    return _STRAIGHT[overrides]


@pytest.mark.parametrize("sig, policy", [(signal.SIGINT, []), (signal.SIGTERM, []),
                                         (signal.SIGINT, ["policy.name=single_learner_coarse", "policy.actors=2"])])
def test_a_signal_checkpoints_and_resume_ends_where_an_uninterrupted_run_does(tmp_path, sig, policy):
    overrides = [*SHORT, "run.total_env_steps=204800", "run.iterations_per_dispatch=2", "run.checkpoint_every_steps=204800",
                 *policy]
    run = tmp_path / "run"
    own = str(EXAMPLES / "custom_algorithm.py")  # a module of the user's: run.imports lists it for the resume
    proc = subprocess.Popen([sys.executable, "-m", "msrl.cli", "train", CARTPOLE, *overrides, "--run-dir", str(run),
                             "--import", own], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.time() + 240
    while not ((run / "metrics.csv").exists() and len((run / "metrics.csv").read_text().splitlines()) > 3):
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read() if proc.poll() else "slow"
        time.sleep(0.2)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert f"Continue with: msrl train --resume {run}\n" in err  # (it repeated --import, as given: a relative path
    # failed from another folder)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["interrupted"] == sig.name and summary["iterations"] < 400
    assert main(["train", "--resume", str(run)]) == 0
    (a, _), (b, meta) = _straight(tuple(overrides), tmp_path / "straight"), final_leaves(run)
    assert meta["iteration"] == 400 and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True) if x is not None)


def test_a_signal_that_lands_in_the_last_dispatch_leaves_a_complete_run(tmp_path, capsys):
    """A Ctrl-C while the run's last iteration ran: every iteration was done, yet it said `stopped after iteration
    4 of 4 ... Continue with: ... --resume` and summary.json kept "interrupted": "SIGINT" for good (a resume then
    had nothing to train)."""
    def signal_at_the_end(row):
        if row["iteration"] == 4:
            os.kill(os.getpid(), signal.SIGINT)

    summary = msrl.train(CARTPOLE, [*SHORT, "run.total_env_steps=2048", "run.log_every_steps=512"], run_dir=tmp_path,
                         on_iteration=signal_at_the_end)
    assert summary["iterations"] == 4 and summary["interrupted"] is None
    assert json.loads((tmp_path / "summary.json").read_text())["interrupted"] is None
    assert "msrl: note: SIGINT came as the run's last iteration ran; the run is complete" in capsys.readouterr().err


def test_a_second_signal_stops_at_once_without_waiting_for_the_dispatch_under_way(tmp_path):
    """The first SIGINT asks the run to finish the dispatch under way and save; the second stops it at once: it
    saved a checkpoint all the same, waiting for that dispatch (4.5 minutes of a heavy fused SAC one)."""
    script = textwrap.dedent(f"""
        import os, signal, threading, time, msrl
        sent = []
        def kill():
            os.kill(os.getpid(), signal.SIGINT)
            sent.append(time.time())
        def first(row):
            if not sent:  # the second dispatch (~4 s here) is under way: one signal now, one while the run waits
                kill()  # for that dispatch to save its checkpoint
                threading.Timer(1.0, kill).start()
        try:
            msrl.train({str(CARTPOLE)!r}, ["run.total_env_steps=10240000", "run.iterations_per_dispatch=1000",
                       "run.checkpoint_every_steps=0", "run.progress=false", "run.tensorboard=false"],
                       run_dir={str(tmp_path / "run")!r}, on_iteration=first)
        except KeyboardInterrupt as e:
            print(f"stopped {{time.time() - sent[-1]:.2f}} s after the second:", type(e).__name__, e, flush=True)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert "stopped" in proc.stdout, (proc.stdout, proc.stderr[-3000:])
    # (it said only "interrupted": the user did not learn that nothing was saved)
    assert proc.stdout.strip().endswith("Interrupted SIGINT again: stopped at once, saving nothing of the iterations "
                                        f"under way; {tmp_path / 'run'} holds no checkpoint: start it again with "
                                        "overwrite=True"), proc.stdout
    assert not list((tmp_path / "run" / "checkpoints").glob("ckpt_*"))  # (nothing saved after the second)
    assert float(proc.stdout.split("stopped ")[1].split()[0]) < 1.5, proc.stdout


def test_a_signal_while_starting_that_something_swallows_still_stops_the_run(tmp_path):
    """A Ctrl-C while XLA compiles raises KeyboardInterrupt where it lands; inside JAX's garbage-collector callback
    Python printed it as ignored and dropped it: the run trained to the end and exited 0 (2 of 9 tries). An env
    whose construction swallows it stands in for that callback."""
    script = textwrap.dedent(f"""
        import signal, gymnasium, msrl
        from gymnasium.envs.classic_control.cartpole import CartPoleEnv
        class Swallows(CartPoleEnv):
            def __init__(self, **kw):
                super().__init__(**kw)
                try:
                    signal.raise_signal(signal.SIGINT)
                except KeyboardInterrupt:
                    pass
        gymnasium.register("MsrlSwallows-v0", entry_point=Swallows, max_episode_steps=500)
        try:
            msrl.train({str(EXAMPLES / "ppo_cartpole_threads.yaml")!r}, ["env.id=gymnasium:MsrlSwallows-v0",
                       "run.total_env_steps=2048", "algorithm.rollout_len=64", "run.progress=false",
                       "run.tensorboard=false"], run_dir={str(tmp_path / "run")!r})
            print("finished", flush=True)
        except KeyboardInterrupt as e:
            print("stopped:", type(e).__name__, flush=True)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.stdout.startswith("stopped: KeyboardInterrupt"), (proc.stdout, proc.stderr[-3000:])
    assert not (tmp_path / "run" / "summary.json").exists()


def test_one_signal_delivered_twice_at_once_is_one_stop_that_saves(tmp_path):
    """coreutils' `timeout -s INT` signals the process, then its process group: two SIGINTs microseconds apart.
    They stopped the run at once, saving nothing (one time in four); the same signal within half a second is one."""
    script = textwrap.dedent(f"""
        import os, signal, msrl
        sent = []
        def twice(row):
            if not sent:
                sent.append(os.kill(os.getpid(), signal.SIGINT))
                os.kill(os.getpid(), signal.SIGINT)
        try:
            msrl.train({str(CARTPOLE)!r}, ["run.total_env_steps=10240000", "run.iterations_per_dispatch=10",
                       "run.checkpoint_every_steps=0", "run.progress=false", "run.tensorboard=false"],
                       run_dir={str(tmp_path / "run")!r}, on_iteration=twice)
        except KeyboardInterrupt as e:
            print("stopped:", type(e).__name__, e, flush=True)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert "stopped: Interrupted SIGINT: stopped after iteration" in proc.stdout, \
        (proc.stdout, proc.stderr[-3000:])
    assert list((tmp_path / "run" / "checkpoints").glob("ckpt_*"))


@pytest.mark.parametrize("config, overrides", [
    (CARTPOLE, []),
    (str(EXAMPLES / "dqn_cartpole.yaml"), []),
    (str(EXAMPLES / "mappo_spread.yaml"), ["env.num_envs=4", "algorithm.rollout_len=8", "algorithm.minibatches=2"]),
])
def test_load_gives_a_policy_that_acts_on_numpy_observations(tmp_path, config, overrides):
    import jax

    steps = 4096 if config == CARTPOLE else 2048
    msrl.train(config, [*SHORT, f"run.total_env_steps={steps}", *overrides],
               run_dir=tmp_path)
    policy = msrl.load(tmp_path)
    state = jax.jit(policy.env.init)(jax.random.PRNGKey(0), np.arange(3))  # (jitted: one compile, not dozens)
    state, obs = policy.env.observe(state)
    actions = policy.act(jax.tree.map(np.asarray, obs))
    assert isinstance(actions, np.ndarray) and actions.shape[0] == 3 and np.all(np.isfinite(actions))
    state, (obs, reward, done) = jax.jit(policy.env.step)(state, actions)  # the env takes them
    assert np.all(np.isfinite(np.asarray(reward)))
    if config == CARTPOLE:  # one observation alone gives one action
        assert policy.act(np.asarray(obs)[0]).shape == ()
        dict_of_one = r"an observation of gymnax:CartPole-v1 is an array shaped \(4,\), got dict"
        for bad, error, says in [(np.zeros((0, 4)), ValueError, r"got no observation \(an array shaped \(0, 4\)\)"),
                                 ({"obs": np.zeros(4)}, TypeError, dict_of_one),
                                 (np.array(["a"] * 4), ValueError, r"observations are numbers, got an array of <U1"),
                                 (np.array([0, np.nan, 0, 0]), ValueError,
                                  r"an observation holds a non-finite number \(nan\)")]:
            with pytest.raises(error, match=rf"^act: {says}$"):  # (jax's and numpy's own errors, or action 0)
                policy.act(bad)
    if isinstance(policy.env_spec, msrl.MultiAgentSpec):  # the agents' observations as one array, or one env's
        agents = np.asarray(obs.agents)
        np.testing.assert_array_equal(policy.act(agents), policy.act(jax.tree.map(np.asarray, obs)))
        assert policy.act(agents[0]).shape == actions.shape[1:]
        one = msrl.MultiAgentObs(agents[0], np.asarray(obs.state)[0])  # one environment's, as its array is taken
        np.testing.assert_array_equal(policy.act(one), policy.act(agents[0]))
        with pytest.raises(ValueError, match=r"its 3 agents' observations of .* are shaped \(3, 18\)"):
            policy.act(agents[..., :17])
        with pytest.raises(TypeError, match=r"^act: observations of .* are an array shaped \(n, 3, 18\) .*got dict$"):
            policy.act({f"agent_{i}": agents[:, i] for i in range(3)})  # (AttributeError inside the actor)
        with pytest.raises(ValueError, match=r"^act: a MultiAgentObs of .* holds agents shaped \(n, 3, 18\) and state "
                                             r"\(n, 54\) \(or one environment's: \(3, 18\) and \(54,\)\), got "
                                             r"\(3, 2, 18\) and \(3, 36\)$"):  # (flax's shape error)
            policy.act(msrl.MultiAgentObs(agents[:, :2], agents[:, :2].reshape(3, -1)))


def test_load_uses_the_config_the_checkpoint_was_trained_with(tmp_path, capsys):
    msrl.train(CARTPOLE, [*SHORT, "run.total_env_steps=2048"], run_dir=tmp_path)
    obs = np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32)
    actions = msrl.load(tmp_path).act(obs)
    config = tmp_path / "config.yaml"
    config.write_text(config.read_text().replace("activation: tanh", "activation: relu"))  # edited by hand
    policy = msrl.load(tmp_path)
    assert policy.config.algorithm.activation == "tanh"
    np.testing.assert_array_equal(policy.act(obs), actions)
    assert f"note: {config} is not the config the checkpoint {tmp_path}/checkpoints/ckpt_000000004.msgpack was " \
        "trained with (its algorithm.activation differs); using the checkpoint's own" in capsys.readouterr().err
    config.write_text(re.sub(r"(?m)^  lr: .*$", "  lr: 0.005", config.read_text()))  # each key named (was the first)
    msrl.load(tmp_path)
    assert "(its algorithm.activation, algorithm.lr differ)" in capsys.readouterr().err
    config.write_text("- a list\n")
    msrl.load(tmp_path)
    assert "was trained with (it does not read); using" in capsys.readouterr().err


def test_piped_progress_ends_with_where_a_stopped_run_stopped(tmp_path, capsys):
    msrl.train(CARTPOLE, ["run.total_env_steps=4096", "run.tensorboard=false", "run.iterations_per_dispatch=1"],
               run_dir=tmp_path, on_iteration=lambda row: row["iteration"] == 3)
    lines = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("msrl: ")]  # (a line every
    # 10 s: the first row's, then none until the end; on stderr, as the start-up lines)
    end = int(list(csv.DictReader((tmp_path / "metrics.csv").open()))[-1]["env_steps"])
    assert end < 4096 and lines[-1].startswith(f"ppo [fused] {end:,}/4,096 steps ") and len(lines) == 2, lines


def test_feedback_without_a_terminal_and_debug_tracebacks(tmp_path):
    """Piped output (nohup, CI, a notebook) gets stage lines and plain progress lines, not a silent bar."""
    out = subprocess.run([sys.executable, "-m", "msrl.cli", "train", CARTPOLE, "run.total_env_steps=4096",
                          "run.tensorboard=false", "--run-dir", str(tmp_path / "run")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "msrl: compiling ppo's loop under fused (gymnax:CartPole-v1)" in out.stderr
    assert "msrl: starting the jax backend" in out.stderr
    assert "ppo [fused] 4,096/4,096 steps" in out.stderr and " SPS  return " in out.stderr
    assert json.loads(out.stdout)["env_steps"] == 4096  # (stdout: the summary alone; the progress went there too)
    # the line's SPS is the run's average so far, not the last row's (a short last dispatch is slower)
    last_line = [line for line in out.stderr.splitlines() if "4,096/4,096 steps" in line][-1]
    shown = int(last_line.split(" steps ")[1].split(" SPS")[0].replace(",", ""))
    final = list(csv.DictReader((tmp_path / "run" / "metrics.csv").open()))[-1]
    assert abs(shown - 4096 / float(final["wall_time"])) <= 1, (last_line, final)
    quiet = subprocess.run([sys.executable, "-m", "msrl.cli", "train", str(tmp_path / "missing.yaml")],
                           capture_output=True, text=True, timeout=120)
    debug = subprocess.run([sys.executable, "-m", "msrl.cli", "train", str(tmp_path / "missing.yaml"), "--debug"],
                           capture_output=True, text=True, timeout=120)
    assert quiet.returncode == debug.returncode == 2 and "does not exist" in quiet.stderr
    assert "Traceback" not in quiet.stderr and "Traceback (most recent call last)" in debug.stderr


def test_train_takes_sections_or_a_dict_and_returns_the_rows(tmp_path):
    result = msrl.train(CARTPOLE, run={"total_env_steps": 2048, "progress": False, "tensorboard": False},
                        run_dir=tmp_path / "a")
    assert result["iterations"] == 4 and [r["iteration"] for r in result.rows] == [1, 2, 3, 4]
    assert {"env_steps", "episode_return", "sps", "loss"} <= set(result.rows[0])
    config = {"algorithm": {"name": "ppo", "rollout_len": 32}, "env": {"id": "gymnax:CartPole-v1", "num_envs": 2},
              "run": {"total_env_steps": 256, "progress": False, "tensorboard": False}}
    assert msrl.train(config, policy={"name": "single_learner_coarse", "actors": 2},
                      run_dir=tmp_path / "b")["policy"] == "single_learner_coarse"
    assert "policy" not in config  # the caller's dict is not changed


def test_sections_take_numpy_values_strings_as_given_an_emptied_mapping_and_pydantic_sections(tmp_path, monkeypatch):
    """(numpy values were a TypeError of json; a string went through YAML: "lr sweep #2" lost its comment-like end;
    env={"kwargs": {}} changed nothing; a pydantic section or an ExperimentConfig built by hand failed inside msrl.)
    The result names its run directory, also the one msrl made; resume and overwrite are booleans."""
    from msrl.algorithms.ppo.ppo import PPOConfig
    from msrl.config import EnvConfig, RunConfig, dotted, validate_config

    assert dotted("algorithm", {"lr": np.float32(0.5), "hidden": np.array([16]), "epochs": np.int64(2)}) == \
        ["algorithm.lr=0.5", "algorithm.hidden=[16]", "algorithm.epochs=2"]
    assert dotted("run.wandb", {"name": "lr sweep #2", "tags": ["a #b"], "entity": "null", "project": "p"}) == \
        ['run.wandb.name="lr sweep #2"', 'run.wandb.tags=["a #b"]', 'run.wandb.entity="null"', "run.wandb.project=p"]
    assert dotted("env", {"kwargs": {}}) == ["env.kwargs={}"]
    assert validate_config({"algorithm": PPOConfig(lr=1e-3), "run": RunConfig(seed=3)}).run.seed == 3
    run = {"total_env_steps": 256, "progress": False, "tensorboard": False}
    monkeypatch.chdir(tmp_path)
    result = msrl.train(CARTPOLE, ["env.kwargs.mask_obs=[1]"], env={"kwargs": {}, "num_envs": np.int64(2)},
                        algorithm=PPOConfig(rollout_len=32, minibatches=2), run={**run, "seed": np.int64(1)})
    assert result.run_dir.parent == Path("runs") and (tmp_path / result.run_dir / "summary.json").is_file()
    saved = yaml.safe_load((tmp_path / result.run_dir / "config.yaml").read_text())
    assert saved["env"]["kwargs"] == {} and saved["env"]["num_envs"] == 2 and saved["run"]["seed"] == 1
    made = msrl.ExperimentConfig(algorithm=PPOConfig(rollout_len=32, minibatches=3), env=EnvConfig(num_envs=2),
                                 policy={"name": "fused"}, run=RunConfig(**run))
    with pytest.raises(msrl.ConfigError, match=r"^algorithm.minibatches: 3 does not divide the batch"):
        msrl.train(made, run_dir=tmp_path / "made")
    with pytest.raises(msrl.ConfigError, match=r"^resume: true or false, got str 'no'$"):
        msrl.train(CARTPOLE, run_dir=tmp_path / "c", resume="no")


def test_a_run_where_no_episode_ended_writes_strict_json(tmp_path):
    """Pendulum's episodes last 200 steps: after one iteration of 128 none has ended, and the return is null."""
    config = {"algorithm": {"name": "ppo", "rollout_len": 128}, "env": {"id": "gymnax:Pendulum-v1", "num_envs": 2},
              "run": {"total_env_steps": 256, "progress": False, "tensorboard": False}}
    result = msrl.train(config, run_dir=tmp_path / "run")
    assert math.isnan(result["episode_return"])
    written = json.loads((tmp_path / "run" / "summary.json").read_text(), parse_constant=lambda c: pytest.fail(c))
    assert written["episode_return"] is None and written["iterations"] == 1


def test_a_run_that_fails_before_its_first_row_leaves_no_folder(tmp_path, capsys):
    assert main(["train", CARTPOLE, *SHORT, "env.id=gymnax:NoSuchEnv-v0", "--run-dir", str(tmp_path / "new")]) == 2
    assert "gymnax:NoSuchEnv-v0" in capsys.readouterr().err and not (tmp_path / "new").exists()
    (tmp_path / "mine").mkdir()  # a folder the user made stays
    assert main(["train", CARTPOLE, *SHORT, "env.id=gymnax:NoSuchEnv-v0", "--run-dir", str(tmp_path / "mine")]) == 2
    assert (tmp_path / "mine").is_dir()


def test_runs_started_together_without_a_run_dir_each_get_their_own(tmp_path, monkeypatch, capsys):
    from msrl.config import load_config
    from msrl.runner import _fresh_run_dir

    monkeypatch.chdir(tmp_path)
    cfg = load_config(CARTPOLE)
    first, second = _fresh_run_dir(cfg), _fresh_run_dir(cfg)  # (the same second: the name takes a suffix)
    assert first != second and first.is_dir() and second.is_dir()
    capsys.readouterr()
    assert main(["train", CARTPOLE, *SHORT, "env.id=gymnax:NoSuchEnv-v0", "run.progress=true"]) == 2
    assert sorted((tmp_path / "runs").iterdir()) == sorted([tmp_path / first, tmp_path / second])  # its own went
    # the folder msrl chose is named as the run starts (for eval, plot and --resume: it was named nowhere)
    assert re.search(r"\nmsrl: the run is written to runs/ppo-fused-\d{8}-\d{6}(-\d+)? \(--run-dir names another\)\n",
                    capsys.readouterr().err)


def test_a_project_folder_with_its_own_config_and_checkpoints_is_not_taken_for_a_run(tmp_path):
    project = tmp_path / "project"
    (project / "checkpoints").mkdir(parents=True)
    (project / "checkpoints" / "model.pt").write_bytes(b"")
    (project / "config.yaml").write_text("model: resnet50\n")
    assert msrl.train(CARTPOLE, SHORT, run_dir=project / "runs" / "a")["iterations"] == 8  # (was "inside the run")
    with pytest.raises(ConfigError, match="holds no checkpoint"):
        msrl.train(CARTPOLE, SHORT, run_dir=project, resume=True)
    assert sorted(p.name for p in project.iterdir()) == ["checkpoints", "config.yaml", "runs"]  # (no lock file left)


def test_a_run_dir_another_run_is_writing_is_refused(tmp_path):
    """Two runs into one directory at once (the second started while the first compiles, before it wrote a
    file; or two resumes) would interleave their metrics, checkpoints and events: the second is refused."""
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "msrl.cli", "train", CARTPOLE, *SHORT, "run.total_env_steps=10000000",
                             "run.checkpoint_every_steps=512", "--run-dir", str(run)], stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while not (run / ".msrl.lock").is_file() or not (run / ".msrl.lock").read_text().strip():
            assert proc.poll() is None and time.time() < deadline
            time.sleep(0.05)
        in_use = rf"{run} is in use by another run \(process {proc.pid}\) writing into it; wait for it to end, "
        with pytest.raises(ConfigError, match=rf"^run_dir: {in_use}or choose another run_dir$"):
            msrl.train(CARTPOLE, SHORT, run_dir=run)
        while not (run / "metrics.csv").is_file() or not list((run / "checkpoints").glob("ckpt_*")):
            assert proc.poll() is None and time.time() < deadline
            time.sleep(0.05)
        for resume in (False, True):  # (once it holds a run: not told to resume or overwrite a run under way)
            then = "then resume it" if resume else "or choose another run_dir"
            with pytest.raises(ConfigError, match=rf"^{'resume' if resume else 'run_dir'}: {in_use}{then}$"):
                msrl.train(CARTPOLE, SHORT, run_dir=run, resume=resume)
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()
    assert main(["train", CARTPOLE, *SHORT, "--run-dir", str(run), "--overwrite"]) == 0  # (its lock went with it)


def test_a_run_refused_by_anothers_lock_leaves_the_folder_it_found_missing(tmp_path, monkeypatch):
    """Both see the folder missing; the other makes and locks it first: the refused run must not remove it as a
    folder of its own that it did not use."""
    import msrl.runner

    run, check = tmp_path / "run", msrl.runner.prepare_run_dir
    other: list = []

    def check_then_the_other_starts(*args):
        out = check(*args)
        other.append(subprocess.Popen([sys.executable, "-c", "import fcntl, pathlib, sys, time\n"
                                       "p = pathlib.Path(sys.argv[1]); p.mkdir()\n"
                                       "f = open(p / '.msrl.lock', 'a+'); fcntl.flock(f, fcntl.LOCK_EX)\n"
                                       "f.write('4242'); f.flush(); print('held', flush=True); time.sleep(60)",
                                       str(run)], stdout=subprocess.PIPE, text=True))
        assert other[0].stdout.readline() == "held\n"
        return out

    monkeypatch.setattr(msrl.runner, "prepare_run_dir", check_then_the_other_starts)
    try:
        with pytest.raises(ConfigError, match=r"in use by another run \(process 4242\)"):
            msrl.train(CARTPOLE, SHORT, run_dir=run)
        assert (run / ".msrl.lock").is_file()  # (it was removed with the folder)
        # a resume of it, before it has written its config.yaml (it said "not a run directory")
        with pytest.raises(ConfigError, match=rf"^resume: {run} is in use by another run \(process 4242\) writing "
                                              r"into it, which has not written its config.yaml yet; wait for it"):
            msrl.train(None, run_dir=run, resume=True)
    finally:
        for proc in other:
            proc.kill()
            proc.wait()


def test_load_acts_as_the_environment_itself_takes_actions(tmp_path):
    """act() hands back what the environment's own step takes, as msrl's adapters hand actions on: a Gymnasium
    ``Discrete(3, start=1)``'s 1..3 (it returned msrl's 0..2, which the env refuses or takes as other actions; with
    ``mask_obs`` still so until 2026-11-29), and a Box's actions within its bounds (a Gaussian policy's mean is not:
    it returned those unclipped), in its dtype (a float64 Box's bounds were rounded to float32: in training and in
    act(), 0.0120000001 reached a Box whose bound is 0.012). Its render() raising NotImplementedError: a ConfigError."""
    import gymnasium
    import loops  # noqa: F401 - registers gymnasium's MsrlQuirky-v0

    msrl.train(CARTPOLE, [*SHORT, "run.total_env_steps=1024", "env.id=gymnasium:MsrlQuirky-v0",
                          "env.kwargs={mode: start, mask_obs: [1]}", "policy.name=single_learner_coarse",
                          "policy.backend=threads"], run_dir=tmp_path / "start")
    policy, env = msrl.load(tmp_path / "start"), gymnasium.make("MsrlQuirky-v0", mode="start")
    obs, _ = env.reset(seed=0)
    batch = np.stack([obs, obs + 1, obs - 3])
    actions = policy.act(batch)
    assert set(actions.tolist()) <= {1, 2, 3}
    greedy = policy.algorithm.actor.greedy(policy.params, batch * np.float32([1, 0]))  # (mask_obs hides obs[1])
    np.testing.assert_array_equal(actions, np.asarray(greedy) + 1)
    env.step(policy.act(obs))  # (it raises on an action outside 1..3)
    with pytest.raises(msrl.ConfigError, match=r"^render: gymnasium:MsrlQuirky-v0 has no renderer: its render\(\) "
                                               r"raised NotImplementedError$"):
        evaluate(tmp_path / "start", episodes=1, render=tmp_path / "frames")

    msrl.train(EXAMPLES / "ppo_pendulum.yaml", [*SHORT, "run.total_env_steps=1024", "env.num_envs=4",
                                                "env.id=gymnasium:MsrlQuirky-v0", "env.kwargs={mode: narrow}",
                                                "policy.name=single_learner_coarse", "policy.backend=threads"],
               run_dir=tmp_path / "box")
    policy, env = msrl.load(tmp_path / "box"), gymnasium.make("MsrlQuirky-v0", mode="narrow")
    obs = np.stack([env.reset(seed=0)[0] + i for i in range(8)])
    means = np.asarray(policy.algorithm.actor.greedy(policy.params, obs))
    assert np.abs(means).max() > 0.012, means  # the policy's own numbers leave the Box here
    np.testing.assert_array_equal(policy.act(obs), np.clip(means.astype(np.float64), -0.012, 0.012))
    env.step(policy.act(obs[0]))  # (it raises on an action outside [-0.012, 0.012])


def test_load_masks_as_training_did_acts_alike_on_one_or_many_and_takes_a_chosen_checkpoint(tmp_path, capsys):
    """act() hides what env.kwargs.mask_obs hid in training (it acted on the raw velocity a user's own env hands
    it: another policy than the one trained); one observation gets the action it gets in a batch, bitwise (the
    greedy head was a plain product: ~1e-8 apart here); a checkpoint file of one's choice loads and evaluates,
    and the newest one there being gone is noted."""
    msrl.train(EXAMPLES / "ppo_pendulum.yaml", [*QUICK[:2], "run.total_env_steps=2048", "env.num_envs=4",
                                                "env.kwargs={mask_obs: [2]}", "run.checkpoint_every_steps=1024"],
               run_dir=tmp_path)
    policy = msrl.load(tmp_path)
    obs = np.random.default_rng(0).normal(size=(37, 3)).astype(np.float32) * [1, 1, 8]
    masked = obs * [1, 1, 0]
    greedy = policy.algorithm.actor.greedy
    assert not np.array_equal(np.asarray(greedy(policy.params, obs)), np.asarray(greedy(policy.params, masked)))
    np.testing.assert_array_equal(policy.act(obs), policy.act(masked))
    np.testing.assert_array_equal(np.stack([policy.act(o) for o in obs]), policy.act(obs))

    first, *_, newest = sorted((tmp_path / "checkpoints").glob("ckpt_*.msgpack"))
    assert msrl.load(first).iteration < policy.iteration
    out = evaluate(first, episodes=2)
    assert out["checkpoint"] == str(first) and np.isfinite(out["return_mean"])
    newest.unlink()
    capsys.readouterr()
    assert msrl.load(tmp_path).iteration < policy.iteration
    assert re.search(r"note: .*ckpt_\d+.msgpack is of [\d,]+ env steps \(iteration \d+\); the run went on to 2,048 "
                     r"\(summary.json\)", capsys.readouterr().err)


def test_the_users_own_jax_settings_are_kept_or_refused_by_name(tmp_path):
    """In a process of the user's: a compile cache directory already set stays theirs (msrl set its own for the
    rest of the process); 64-bit mode and disabled jit are refused naming the setting (an int64 index error at a
    buffer_insert line, and a bare AOT error after minutes of tracing); numpy rank promotion set to "raise"
    trains (msrl's Dense added its bias by implicit rank promotion); ``~`` in paths is the home folder."""
    code = f"""
import os, sys, jax, msrl
from pathlib import Path
os.environ.pop("MSRL_COMPILE_CACHE", None)
os.environ["HOME"] = {str(tmp_path / 'home')!r}
os.makedirs(os.environ["HOME"])
os.chdir({str(tmp_path)!r})
jax.config.update("jax_compilation_cache_dir", {str(tmp_path / 'mine')!r})
jax.config.update("jax_numpy_rank_promotion", "raise")
short = ["run.progress=false", "run.tensorboard=false", "run.total_env_steps=1024", "algorithm.rollout_len=16"]
msrl.train({CARTPOLE!r}, short, run_dir="~/run")
assert (Path.home() / "run" / "metrics.csv").exists() and not Path("~").exists()
assert jax.config.jax_compilation_cache_dir == {str(tmp_path / 'mine')!r} and any(Path({str(tmp_path / 'mine')!r}).iterdir())
assert not (Path.home() / ".jax_cache").exists()
assert msrl.load("~/run").params is not None
for setting, key in (("jax_enable_x64", "jax_enable_x64"), ("jax_disable_jit", "policy.backend")):
    jax.config.update(setting, True)
    try:
        msrl.train({CARTPOLE!r}, short, run_dir="~/" + setting)
        raise SystemExit(setting + " trained")
    except msrl.ConfigError as e:
        assert e.key == key and setting in str(e), str(e)
    jax.config.update(setting, False)
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_ctrl_c_stops_a_loop_of_runs_that_goes_on_past_failed_ones(tmp_path):
    """The Interrupted a signal ends a run with is a KeyboardInterrupt, as Ctrl-C is in Python: a sweep written
    ``try: msrl.train(...) except Exception: continue`` stops at the Ctrl-C (it went on to the next seed)."""
    started = []

    def ctrl_c(row):
        if row["iteration"] == 2:
            os.kill(os.getpid(), signal.SIGINT)  # msrl's handler: the run stops, saves, raises Interrupted

    with pytest.raises(KeyboardInterrupt) as info:
        for seed in range(3):
            started.append(seed)
            try:
                msrl.train(CARTPOLE, [*SHORT, f"run.seed={seed}", "algorithm.rollout_len=16"],
                           run_dir=tmp_path / str(seed), on_iteration=ctrl_c)
            except Exception:  # noqa: BLE001 - the user's loop
                continue
    assert isinstance(info.value, msrl.Interrupted) and started == [0]
    # (in Python, the call that continues it; the CLI names its command)
    assert f"Continue with: msrl.train(None, run_dir={str(tmp_path / '0')!r}, resume=True)" in str(info.value)


def test_the_command_that_continues_a_run_quotes_its_folder():
    """(`Continue with: msrl train --resume sp ace/x y` failed when pasted: "config file 'ace/x' does not exist".)"""
    from msrl.errors import CLI_FLAGS
    from msrl.runner import _continue_with

    flags = CLI_FLAGS.set(True)
    try:
        assert _continue_with(Path("sp ace/x y")) == "msrl train --resume 'sp ace/x y'"
        assert _continue_with(Path("runs/a")) == "msrl train --resume runs/a"
    finally:
        CLI_FLAGS.reset(flags)
