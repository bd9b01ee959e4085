"""Checkpoints: exact resume after a SIGKILL (fused), resume on a distributed policy, refusals, NaN guard."""

from __future__ import annotations

import csv
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import gymnasium
import numpy as np
import pytest
import yaml

import msrl
from msrl import checkpoint
from msrl.runner import train

import loops  # noqa: F401 - registers the "growth" algorithm
from helpers import max_diff

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
CARTPOLE = str(EXAMPLES / "ppo_cartpole.yaml")
QUIET = ["run.progress=false", "run.tensorboard=false"]


def killed_run(config: str, overrides: list[str], run_dir: Path, after: int) -> None:
    """``msrl train`` in a subprocess, SIGKILLed once the checkpoint of iteration ``after`` exists."""
    proc = subprocess.Popen([sys.executable, "-m", "msrl.cli", "train", config, *overrides, "--run-dir", str(run_dir)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    target = run_dir / "checkpoints" / f"ckpt_{after:09d}.msgpack"
    deadline = time.time() + 240
    while not target.exists():
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        assert time.time() < deadline
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (run_dir / "summary.json").exists()  # it really died mid-run


def final_leaves(run_dir: Path) -> tuple[list, dict]:
    states, meta = checkpoint.load(checkpoint.latest(run_dir))
    return [x for key in sorted(states) for x in states[key]], meta


def test_fused_resume_after_sigkill_ends_identical(tmp_path):
    overrides = [*QUIET, "run.total_env_steps=61440", "run.checkpoint_every_steps=10240", "run.iterations_per_dispatch=4"]
    killed_run(CARTPOLE, overrides, tmp_path / "resumed", after=40)
    train(tmp_path / "resumed" / "config.yaml", [], run_dir=tmp_path / "resumed", resume=True)
    train(CARTPOLE, overrides, run_dir=tmp_path / "straight")
    (a, meta_a), (b, meta_b) = final_leaves(tmp_path / "straight"), final_leaves(tmp_path / "resumed")
    assert meta_a["iteration"] == meta_b["iteration"] == 120
    assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True) if x is not None)
    rows = (tmp_path / "resumed" / "metrics.csv").read_text().splitlines()[1:]
    assert [int(r.split(",")[0]) for r in rows] == list(range(1, 121))  # rows after the checkpoint were redone


def test_threads_coarse_resume_continues(tmp_path):
    overrides = [*QUIET, "policy.name=single_learner_coarse", "policy.actors=2", "run.total_env_steps=40960",
                 "run.checkpoint_every_steps=5120", "run.iterations_per_dispatch=2"]
    killed_run(CARTPOLE, overrides, tmp_path, after=20)
    summary = train(tmp_path / "config.yaml", ["policy.max_actor_restarts=5"], run_dir=tmp_path, resume=True)
    assert summary["iterations"] == 80  # (how ray recovers may change: it was refused as a change of training)
    leaves, meta = final_leaves(tmp_path)
    assert meta["iteration"] == 80 and all(np.isfinite(x).all() for x in leaves if x is not None and x.dtype.kind == "f")
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["policy"]["name"] == "single_learner_coarse"
    # the learner made exactly 80 updates of 4 epochs x 4 minibatches (optimizer step counts)
    counts = {int(x) for x in leaves if x is not None and x.dtype == np.int32 and x.shape == ()}
    assert 80 * 4 * 4 in counts


def test_a_resumed_host_env_run_counts_episodes_on(tmp_path, capsys):
    """Gymnasium's envs start afresh on a resume (their simulators are not stored): the cumulative episode count
    goes on from the checkpoint's (it fell to 0), and a note says the episodes restart (it said nothing)."""
    overrides = [*QUIET, "algorithm.rollout_len=32", "run.checkpoint_every_steps=1024"]
    train(EXAMPLES / "ppo_cartpole_threads.yaml", [*overrides, "run.total_env_steps=2048"], run_dir=tmp_path)
    capsys.readouterr()
    train(None, [*overrides, "run.total_env_steps=4096"], run_dir=tmp_path, resume=True)
    assert "msrl: note: gymnasium:CartPole-v1's simulators are not in checkpoints: their episodes start afresh" in \
        capsys.readouterr().err
    rows = list(csv.DictReader((tmp_path / "metrics.csv").open()))
    episodes = [float(r["episodes"]) for r in rows]
    assert len(rows) == 16 and episodes[7] > 0 and episodes == sorted(episodes) and episodes[8] > episodes[7]


RESUMED = {  # policies whose actors act with parameters of an earlier iteration than the learner's
    "pull_every_3": (EXAMPLES / "dqn_replay_server.yaml",
                     ["algorithm.hidden=[32]", "algorithm.learning_starts=64", "algorithm.buffer_size=4096",
                      "algorithm.batch_size=64", "algorithm.prioritized=true", "policy.param_sync_every=3"]),
    "sync_false": (EXAMPLES / "impala_cartpole.yaml", ["algorithm.hidden=[32]", "policy.name=single_learner_coarse",
                                                      "policy.actors=2", "policy.sync=false"]),
}


@pytest.mark.parametrize("case,backend", [("pull_every_3", "threads"), ("sync_false", "threads"),
                                          ("sync_false", "ray")])  # ray: a restore sends across processes
def test_a_restored_run_pulls_parameters_as_the_uninterrupted_one(case, backend, request):
    """Restored after iteration 4 (between two pulls of every 3rd iteration; with the actors one update
    behind), the run goes on as if never stopped: the same rows (policy_lag too) and the same states."""
    if backend == "ray":
        request.getfixturevalue("ray_cluster")
    config, overrides = RESUMED[case]
    overrides = [*overrides, f"policy.backend={backend}"]
    with msrl.Session(config, overrides, seed=0) as straight:
        rows = straight.run(4)
        snap = straight.snapshot()
        rows += straight.run(5)
        end = straight.snapshot()
    assert (snap.iteration, end.iteration) == (4, 9)
    with msrl.Session(config, overrides, seed=0) as resumed:
        resumed.restore(snap)  # the snapshot says it was taken after iteration 4
        again = resumed.run(5)
        assert max_diff(resumed.snapshot(), end) == 0.0
    same = ("iteration", "policy_lag", "episodes", "episode_return", "loss")
    assert [{k: r.get(k) for k in same} for r in again] == [{k: r.get(k) for k in same} for r in rows[4:]]
    assert [r["policy_lag"] for r in rows] == ([0, 0, 1, 2, 0, 1, 2, 0, 1] if case == "pull_every_3" else
                                               [0] + [1] * 8)


def test_a_restored_run_seeds_its_host_environments_afresh_for_the_iteration():
    """No snapshot holds a Gymnasium env's episodes: a restored run starts new ones, seeded for the iteration it
    goes on from (as a restarted Ray actor's are), not with the run's first seeds again (repeating its episodes)."""
    overrides = ["algorithm.rollout_len=8", "algorithm.hidden=[8]", "env.num_envs=4"]
    config = EXAMPLES / "ppo_cartpole_threads.yaml"
    with msrl.Session(config, overrides, seed=0) as straight:
        straight.run(2)
        snap = straight.snapshot()
    first = []
    for _ in range(2):
        with msrl.Session(config, overrides, seed=0) as resumed:
            first.append(resumed.snapshot()["actor"][0]["env"].item().obs.copy())  # a host env's state, as it is
            resumed.restore(snap)
            first.append(resumed.snapshot()["actor"][0]["env"].item().obs.copy())
            assert resumed.run(1)[0]["iteration"] == 3
    assert not np.allclose(first[0], first[1])  # other seeds than the run's start
    np.testing.assert_array_equal(first[1], first[3])  # the same ones each time

def test_resume_refuses_another_config_and_a_missing_checkpoint(tmp_path):
    train(CARTPOLE, [*QUIET, "run.total_env_steps=5120", "run.checkpoint_every_steps=2560"], run_dir=tmp_path)
    with pytest.raises(msrl.ConfigError, match=r"algorithm\.lr.*trained with algorithm\.lr=0\.001"):
        train(CARTPOLE, [*QUIET, "algorithm.lr=0.01"], run_dir=tmp_path, resume=True)
    with pytest.raises(msrl.ConfigError, match=r"env\.num_envs"):
        train(CARTPOLE, [*QUIET, "env.num_envs=8"], run_dir=tmp_path, resume=True)
    with pytest.raises(msrl.ConfigError, match=rf"^env\.id: .*ppo_pendulum.yaml:\d+: .* trained with env\.id='gymnax:"
                                               rf"CartPole-v1', .*; resume with the run's own config "
                                               rf"\({tmp_path / 'config.yaml'}\) or start a new run$"):
        train(EXAMPLES / "ppo_pendulum.yaml", QUIET, run_dir=tmp_path, resume=True)  # (it named ent_coef first, and
        # "RUN_DIR/config.yaml")
    with pytest.raises(msrl.ConfigError, match="empty does not exist$"):  # (it said: "holds no checkpoint ... (it
        train(CARTPOLE, QUIET, run_dir=tmp_path / "empty", resume=True)  # stopped before its first checkpoint)")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.yaml").write_text((tmp_path / "config.yaml").read_text())
    with pytest.raises(msrl.ConfigError, match="holds no checkpoint"):
        train(CARTPOLE, QUIET, run_dir=tmp_path / "empty", resume=True)
    saved = tmp_path / "config.yaml"  # the run's own config, edited since: that file is named, not the override
    saved.write_text(saved.read_text().replace("lr: 0.001", "lr: 0.005"))
    for cfg in (saved, None):
        with pytest.raises(msrl.ConfigError, match=rf"^algorithm\.lr: .* trained with algorithm\.lr=0\.001, this "
                           rf"config has 0\.005 \({saved} was edited since\); put its value back there, or start "
                           rf"a new run \(a checkpoint copied in from another run: move it out of "
                           rf"{tmp_path / 'checkpoints'}\)"):  # (its advice led a copied-in checkpoint's run astray)
            train(cfg, QUIET, run_dir=tmp_path, resume=True)


def test_resume_names_the_key_the_user_set_not_one_derived_from_it(tmp_path):
    coarse = [*QUIET, "policy.name=single_learner_coarse", "policy.actors=2", "policy.envs_per_actor=2",
              "run.total_env_steps=2048", "run.checkpoint_every_steps=1024"]
    train(CARTPOLE, coarse, run_dir=tmp_path)
    # (policy.actors=1 makes env.num_envs 2, which it named: a key the user had not touched)
    with pytest.raises(msrl.ConfigError, match=r"^policy\.actors: .* trained with policy\.actors=2, this config has 1; "
                       r"resume without setting policy\.actors, or start a new run"):
        train(None, ["policy.actors=1"], run_dir=tmp_path, resume=True)


def test_a_resume_without_the_buffer_in_checkpoints_says_the_replay_buffer_starts_empty(tmp_path, capsys):
    dqn = [*QUIET, "algorithm.buffer_size=2048", "algorithm.learning_starts=64", "run.checkpoint_buffer=false",
           "run.checkpoint_every_steps=400"]
    train(EXAMPLES / "dqn_cartpole.yaml", [*dqn, "run.total_env_steps=800"], run_dir=tmp_path)
    states, _ = checkpoint.load(checkpoint.latest(tmp_path))
    assert not any("buffer" in key for key in states)
    capsys.readouterr()
    summary = train(tmp_path / "config.yaml", ["run.total_env_steps=1200"], run_dir=tmp_path, resume=True)
    assert summary["iterations"] == 150
    assert "UniformBuffer starts empty again" in capsys.readouterr().err


def test_checkpoints_are_never_unpickled(tmp_path):
    class Boom:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    folder = tmp_path / "checkpoints"
    folder.mkdir()
    (folder / "ckpt_000000001.msgpack").write_bytes(pickle.dumps({"format": 1, "states": {"a": [Boom()]}}))
    with pytest.raises(msrl.TrainingError, match="not an msrl checkpoint"):
        checkpoint.load(checkpoint.latest(tmp_path))
    assert not (tmp_path / "pwned").exists()


def test_nan_guard_names_the_iteration_and_keeps_the_last_good_checkpoint(tmp_path):
    cfg = {"algorithm": {"name": "growth", "lr": 1e9}, "env": {"id": "gymnax:CartPole-v1", "num_envs": 2},
           "policy": {"name": "fused"}, "run": {"total_env_steps": 80, "checkpoint_every_steps": 16,
                                                  "iterations_per_dispatch": 1, "progress": False}}
    (tmp_path / "growth.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.raises(msrl.TrainingError, match=r"iteration 5: metric 'loss' is nan.*last good checkpoint: .*ckpt_000000004"):
        train(tmp_path / "growth.yaml", [], run_dir=tmp_path / "run")
    leaves, meta = final_leaves(tmp_path / "run")
    assert meta["iteration"] == 4 and all(np.isfinite(x).all() for x in leaves if x is not None and x.dtype.kind == "f")


def test_eval_of_a_trained_run_and_rendered_frames(tmp_path, capsys):
    from matplotlib.image import imread

    from msrl.cli import main
    from msrl.evaluate import evaluate

    train(CARTPOLE, [*QUIET, "run.total_env_steps=102400", "run.checkpoint_every_steps=25600"], run_dir=tmp_path / "fused")
    assert main(["eval", str(tmp_path / "fused"), "--json", str(tmp_path)]) == 2  # (before evaluating, not after)
    assert f"--json: {tmp_path} is a folder; give the name of a file to write" in capsys.readouterr().err
    out = tmp_path / "figures" / "eval.json"  # (its folder made, as -o's are)
    assert main(["eval", str(tmp_path / "fused"), "--episodes", "4", "--json", str(out)]) == 0
    mean = float(capsys.readouterr().out.split()[1])
    assert mean >= 150  # greedy CartPole after 100k steps of PPO (random play scores ~20)
    figures = json.loads(out.read_text())
    assert figures["return_mean"] == pytest.approx(mean, abs=0.005) and figures["episodes"] == 4
    assert figures["length_mean"] == figures["return_mean"]  # (CartPole: 1 a step)
    assert main(["eval", str(tmp_path / "fused"), "--render", str(tmp_path / "x")]) == 2  # gymnax: no renderer
    assert "--render: msrl renders gymnasium: environments only, not gymnax:CartPole-v1" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()

    host = [*QUIET, "run.total_env_steps=2048", "run.checkpoint_every_steps=1024",
            "env.kwargs={render_mode: rgb_array}"]  # (--render gave gymnasium.make a render_mode twice)
    train(EXAMPLES / "ppo_cartpole_threads.yaml", host, run_dir=tmp_path / "host")
    (tmp_path / "frames").mkdir()
    (tmp_path / "frames" / "frame_9999.png").write_bytes(b"an earlier, longer episode's")
    assert main(["eval", str(tmp_path / "host"), "--episodes", "2", "--render", str(tmp_path / "frames")]) == 0
    frames = sorted((tmp_path / "frames").glob("frame_*.png"))
    assert frames[-1].name == f"frame_{len(frames) - 1:04d}.png"  # this episode's frames alone
    image = imread(frames[0])
    assert len(frames) >= 2 and image.shape[0] > 0 and image.std() > 0
    assert (tmp_path / "frames" / "episode.gif").stat().st_size > 0
    assert f"wrote {len(frames)} frames and episode.gif to {tmp_path / 'frames'} (the first episode: return " \
        in capsys.readouterr().out
    out = evaluate(tmp_path / "host", episodes=1, seed=3, render=tmp_path / "frames")  # the one scored, rendered
    assert out["render_return"] == out["return_mean"] == out["frames"] - 1  # (CartPole: 1 a step)
    assert main(["eval", str(tmp_path / "host"), "--render", str(frames[0])]) == 2  # before playing the episodes
    assert f"msrl: error: --render: {frames[0]} is a file; give a folder" in capsys.readouterr().err
    assert main(["eval", str(tmp_path / "host"), "--render", str(frames[0] / "sub")]) == 2
    assert f"msrl: error: --render: cannot create the folder {frames[0] / 'sub'}: Not a directory" in \
        capsys.readouterr().err


class _Bounded(gymnasium.Env):
    """Actions in [0.5, 0.7]^2 only (an untrained Gaussian's mean, near 0, is outside); a 4x4 picture."""

    observation_space = gymnasium.spaces.Box(-1.0, 1.0, (3,), np.float32)
    action_space = gymnasium.spaces.Box(0.5, 0.7, (2,), np.float32)
    metadata = {"render_modes": ("rgb_array",)}  # noqa: RUF012 - gymnasium's own attribute

    def __init__(self, render_mode=None, picture=True):
        self.render_mode, self.picture, self.t = render_mode, picture, 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(3, np.float32), {}

    def step(self, action):
        assert self.action_space.contains(np.asarray(action, np.float32)), action
        self.t += 1
        return np.full(3, self.t / 10, np.float32), float(action[0]), False, self.t >= 5, {}

    def render(self):
        return np.full((4, 4, 3), 40 * self.t, np.uint8) if self.picture else None


class _NoRenderMode(_Bounded):
    def __init__(self):
        super().__init__()


gymnasium.register("MsrlTestBounded-v0", entry_point=_Bounded)
gymnasium.register("MsrlTestNoRenderMode-v0", entry_point=_NoRenderMode)


def test_render_clips_actions_as_training_does_and_a_bad_renderer_is_one_line(tmp_path, capsys):
    from msrl.cli import main

    short = [*QUIET, "run.total_env_steps=512", "run.checkpoint_every_steps=512", "algorithm.rollout_len=64"]
    train(EXAMPLES / "ppo_cartpole_threads.yaml", [*short, "env.id=gymnasium:MsrlTestBounded-v0"], run_dir=tmp_path / "a")
    assert main(["eval", str(tmp_path / "a"), "--episodes", "2", "--render", str(tmp_path / "frames")]) == 0
    assert len(list((tmp_path / "frames").glob("frame_*.png"))) == 6  # (it stepped the env with the unclipped mean)
    train(EXAMPLES / "ppo_cartpole_threads.yaml", [*short, "env.id=gymnasium:MsrlTestBounded-v0",
                                                   "env.kwargs={picture: false}"], run_dir=tmp_path / "b")
    train(EXAMPLES / "ppo_cartpole_threads.yaml", [*short, "env.id=gymnasium:MsrlTestNoRenderMode-v0"],
          run_dir=tmp_path / "c")
    capsys.readouterr()
    for run, text in [("b", "MsrlTestBounded-v0's render() in render_mode='rgb_array' gave None, not an RGB image"),
                      ("c", "MsrlTestNoRenderMode-v0 did not make itself with render_mode='rgb_array': ")]:
        assert main(["eval", str(tmp_path / run), "--render", str(tmp_path / "frames")]) == 2  # (tracebacks)
        assert text in capsys.readouterr().err


def _spoil(path: Path, how: str) -> None:
    """Flip 1000 payload bytes of a checkpoint, or rewrite it (checkpoint.save) with NaN learner leaves."""
    if how == "flip":
        data = bytearray(path.read_bytes())
        for i in range(len(data) // 2, len(data) // 2 + 1000):
            data[i] ^= 0xFF
        path.write_bytes(bytes(data))
        return
    states, meta = checkpoint.load(path)
    snap: dict = {}
    for key, leaves in sorted(states.items()):
        frag, r, comp = key.split("/")
        if comp == "learner":
            leaves = [np.full_like(x, np.nan) if x.dtype.kind == "f" else x for x in leaves]
        snap.setdefault(frag, [{} for _ in range(int(r) + 1)])[int(r)][comp] = leaves
    checkpoint.save(path.parent.parent, snap, meta, keep=3)


@pytest.mark.parametrize("how, why", [("flip", "corrupt"), ("nan", "non-finite")])
def test_a_bad_newest_checkpoint_falls_back_to_the_previous_good_one(tmp_path, capsys, how, why):
    from msrl.cli import main
    from msrl.runner import _last_good

    train(CARTPOLE, [*QUIET, "run.total_env_steps=5120", "run.checkpoint_every_steps=2560"], run_dir=tmp_path)
    newest, older = tmp_path / "checkpoints" / "ckpt_000000010.msgpack", tmp_path / "checkpoints" / "ckpt_000000005.msgpack"
    _spoil(newest, how)
    with pytest.raises(msrl.TrainingError, match=why):
        checkpoint.load(newest)
    assert _last_good(tmp_path) == f" (last good checkpoint: {older})"  # what the NaN guard would name

    assert main(["eval", str(tmp_path), "--episodes", "2"]) == 0
    out, err = capsys.readouterr()
    assert f"{older}, iteration 5)" in out
    assert f"skipping checkpoint {newest}" in err and why in err and f"instead: {older}" in err

    summary = train(None, [], run_dir=tmp_path, resume=True)  # continues from iteration 5, saying so
    assert f"skipping checkpoint {newest}" in capsys.readouterr().err
    assert summary["iterations"] == 10 and checkpoint.load(newest)[1]["iteration"] == 10
    rows = (tmp_path / "metrics.csv").read_text().splitlines()[1:]
    assert [int(r.split(",")[0]) for r in rows] == list(range(1, 11))

    _spoil(newest, how)
    _spoil(older, how)  # none good: a clear error, and the NaN guard names none
    for bad in sorted((tmp_path / "checkpoints").glob("*.msgpack"))[:-2]:
        bad.unlink()
    with pytest.raises(msrl.TrainingError, match="no usable checkpoint"):
        train(None, [], run_dir=tmp_path, resume=True)
    assert main(["eval", str(tmp_path)]) == 2 and "no usable checkpoint" in capsys.readouterr().err
    assert _last_good(tmp_path) == " (no good checkpoint)"


def test_save_removes_stale_temp_files_and_a_full_disk_leaves_none(tmp_path, monkeypatch):
    import errno

    folder = tmp_path / "checkpoints"
    folder.mkdir()
    (folder / "ckpt_000000003.msgpack.tmp").write_bytes(b"left by a killed save")
    snap = {"learner": [{"learner": {"w": np.ones(3, np.float32)}}]}
    checkpoint.save(tmp_path, snap, {"iteration": 4, "config": {}})
    assert sorted(p.name for p in folder.iterdir()) == ["ckpt_000000004.msgpack"]

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)  # the disk fills up while the checkpoint is written
    with pytest.raises(msrl.TrainingError, match=r"disk full writing .*ckpt_000000005\.msgpack"):
        checkpoint.save(tmp_path, snap, {"iteration": 5, "config": {}})
    assert sorted(p.name for p in folder.iterdir()) == ["ckpt_000000004.msgpack"]


KILL_IN_REWRITE = """
import os, signal, sys
from msrl.runner import train

real = os.replace
def replace(src, dst):  # SIGKILL between writing the cut metrics.csv and putting it in place
    if str(dst).endswith("metrics.csv"):
        os.kill(os.getpid(), signal.SIGKILL)
    real(src, dst)
os.replace = replace
train(None, [], run_dir=sys.argv[1], resume=True)
"""


def test_a_kill_while_metrics_csv_is_cut_back_loses_no_row(tmp_path, capsys):
    train(CARTPOLE, [*QUIET, "run.total_env_steps=5120", "run.checkpoint_every_steps=2560", "run.compile_cache=false"],
          run_dir=tmp_path)
    (tmp_path / "checkpoints" / "ckpt_000000010.msgpack").unlink()  # resume from 5: rows 6-10 are cut
    before = (tmp_path / "metrics.csv").read_text()
    proc = subprocess.run([sys.executable, "-c", KILL_IN_REWRITE, str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert (tmp_path / "metrics.csv").read_text() == before  # untouched: the cut copy was never put in place
    assert (tmp_path / "metrics.csv.tmp").exists()
    summary = train(None, [], run_dir=tmp_path, resume=True)
    rows = (tmp_path / "metrics.csv").read_text().splitlines()
    assert rows[0] == before.splitlines()[0] and [int(r.split(",")[0]) for r in rows[1:]] == list(range(1, 11))
    assert summary["iterations"] == 10 and not (tmp_path / "metrics.csv.tmp").exists()

    with pytest.raises(msrl.ConfigError, match=r"run\.total_env_steps: 2048 is less than the 5120 env steps"):
        train(None, ["run.total_env_steps=2048"], run_dir=tmp_path, resume=True)
    written = (tmp_path / "summary.json").read_text()
    capsys.readouterr()
    same = train(None, ["run.progress=true"], run_dir=tmp_path, resume=True)  # nothing left: done at once, agreeing
    err = capsys.readouterr().err
    assert "compiling" not in err  # (nor a Ray cluster, TensorBoard or W&B files)
    assert "note: the run already ended at 5,120 env steps; nothing is left to train (a larger " \
        "run.total_env_steps continues it)" in err  # (it printed its summary alone)
    assert (tmp_path / "summary.json").read_text() == written and same == json.loads(written)  # (sps, wall_time)
    assert same["iterations"] == 10 and same["env_steps"] == 5120 == checkpoint.load(
        checkpoint.latest(tmp_path))[1]["env_steps"]
    assert len((tmp_path / "metrics.csv").read_text().splitlines()) == 11


def _events(folder: Path) -> list:
    """Every event of the TensorBoard files in ``folder`` (TFRecord: length, crc, event, crc), file by file."""
    import struct

    from tensorboardX.proto import event_pb2

    out = []
    for path in sorted(folder.glob("events.*"), key=lambda p: p.stat().st_mtime_ns):
        data, i = path.read_bytes(), 0
        while i + 12 <= len(data):
            (n,) = struct.unpack("<Q", data[i:i + 8])
            event = event_pb2.Event()
            event.ParseFromString(data[i + 12:i + 12 + n])
            out.append(event)
            i += 12 + n + 4
    return out


def test_a_resume_tells_tensorboard_to_drop_the_events_after_the_checkpoint(tmp_path):
    """It drops every earlier event and is given metrics.csv's rows again, those up to the checkpoint too (a kill
    loses the events its writer had not flushed: tests/test_logging.py)."""
    train(CARTPOLE, ["run.progress=false", "run.total_env_steps=5120", "run.checkpoint_every_steps=2560"], run_dir=tmp_path)
    (tmp_path / "checkpoints" / "ckpt_000000010.msgpack").unlink()  # resume from 5: iterations 6-10 again
    train(None, [], run_dir=tmp_path, resume=True)
    events = _events(tmp_path / "tb")
    start = [e.step for e in events if e.HasField("session_log") and e.session_log.status == e.session_log.START]
    assert start == [1]  # TensorBoard discards the earlier events at steps >= this one
    after = [e.step for e in events[[e.HasField("session_log") for e in events].index(True):] if e.HasField("summary")
             and e.summary.value[0].tag == "charts/episodes"]
    assert after == [i * 512 for i in range(1, 11)]  # each row once


SMALL = ["algorithm.rollout_len=16", "algorithm.hidden=[16]", "run.total_env_steps=100000"]


@pytest.mark.parametrize("policy", ["fused", "threads", "ray"])
def test_a_session_interrupted_mid_stream_holds_the_iteration_it_counts(policy, request):
    """A KeyboardInterrupt while a session streams (a notebook's interrupted cell): the fused program's chunk
    already dispatched still finishes, so the session counts it; the state it then holds, snapshots and goes on
    from is that iteration's (it counted 2 fewer: its snapshot said 88, holding 90's parameters). On ray, a reader
    that left between two chunks broke the session ("stopped in the middle of iteration 3"; threads went on)."""
    if policy == "ray":
        request.getfixturevalue("ray_cluster")
    overrides = [*SMALL] + (["policy.name=single_learner_coarse", f"policy.backend={policy}", "policy.actors=2"]
                            if policy != "fused" else [])
    with msrl.Session(CARTPOLE, overrides, seed=0, iterations_per_dispatch=2) as session:
        with pytest.raises(KeyboardInterrupt):
            for _ in session.stream(10, 2):  # the fused program has dispatched the next 2 when the first come
                raise KeyboardInterrupt
        done = 4 if policy == "fused" else 2
        assert session.iteration == done
        held, snap = session.params(), session.snapshot()
        assert snap.iteration == done and session.run(1)[0]["iteration"] == done + 1
    threads = [o.replace("=ray", "=threads") for o in overrides]  # (bitwise ray's: the conformance matrix)
    with msrl.Session(CARTPOLE, threads, seed=0, iterations_per_dispatch=2) as fresh:
        fresh.run(done)
        assert max_diff(fresh.params(), held) == 0.0


def test_a_keyboard_interrupt_from_on_iteration_keeps_a_resumable_run(tmp_path):
    """``on_iteration`` raising KeyboardInterrupt (or SystemExit) stops the run as any exception it raises does:
    checkpoint and summary saved, the exception raised again; the run resumes (it was left with none)."""
    def interrupt(row):
        if row["iteration"] == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt) as info:
        train(CARTPOLE, [*SMALL, "run.progress=false", "run.total_env_steps=4096"], run_dir=tmp_path,
              on_iteration=interrupt)
    assert "saved its checkpoint and summary" in "".join(getattr(info.value, "__notes__", []))
    assert checkpoint.latest(tmp_path) is not None and (tmp_path / "summary.json").exists()
    summary = train(None, ["run.progress=false", "run.total_env_steps=4096"], run_dir=tmp_path, resume=True)
    assert summary["iterations"] == 4096 // (16 * 4)


def test_a_run_that_trained_past_its_last_checkpoint_is_not_resumed_from_it(tmp_path):
    """run.checkpoint_every_steps=0 saves a checkpoint only when the run is stopped: stopped early, resumed and
    finished at 64 (no checkpoint at the end), a resume (with a larger total, or none) went back to the early
    checkpoint without a word, and cut metrics.csv back to it."""
    def interrupt(row):
        if row["iteration"] == 3:
            raise KeyboardInterrupt

    zero = [*SMALL, "run.progress=false", "run.checkpoint_every_steps=0", "run.total_env_steps=4096"]
    with pytest.raises(KeyboardInterrupt):
        train(CARTPOLE, zero, run_dir=tmp_path, on_iteration=interrupt)
    summary = train(None, ["run.progress=false"], run_dir=tmp_path, resume=True)
    assert summary["iterations"] == 64 and summary["checkpointed"] is False  # (no checkpoint holds its end)
    rows = (tmp_path / "metrics.csv").read_text()
    for more in ([], ["run.total_env_steps=8192"]):
        with pytest.raises(msrl.ConfigError, match=r"^resume: .* trained to iteration 64 \(its summary.json\), past "
                                                   r"its newest checkpoint, ckpt_0+(\d+).msgpack of iteration \1 "
                                                   r"\(run.checkpoint_every_steps=0 saves none at the end\): resuming "
                                                   r"would train again from there"):
            train(None, ["run.progress=false", *more], run_dir=tmp_path, resume=True)
    assert (tmp_path / "metrics.csv").read_text() == rows


def test_a_config_a_run_was_trained_with_that_no_longer_validates_names_the_checkpoint(tmp_path):
    """An algorithm's code changed since its run trained (a key's type): msrl eval and msrl.load said only
    `algorithm.hidden: Input should be a valid list` (a resume names the run's config.yaml)."""
    import re

    from msrl.config import load_config
    from msrl.evaluate import trained_config

    saved = load_config(EXAMPLES / "ppo_cartpole.yaml").dump()
    saved["algorithm"]["hidden"] = 32
    at = tmp_path / "checkpoints" / "ckpt_000001"
    with pytest.raises(msrl.ConfigError, match=rf"^algorithm.hidden: {re.escape(str(at))} \(the config the run was "
                                               r"trained with\): Input should be a valid list"):
        trained_config(tmp_path / "config.yaml", {"config": saved}, at)


def test_a_checkpoint_loads_by_name_not_only_by_place(tmp_path):
    """A checkpoint's arrays went back by position, checked by count and shape only: layers renamed in one's own
    algorithm (probe: the baseline head's name sorting before the policy head's, of one shape) loaded the baseline's
    weights into the policy without a word (eval 268 -> 9). Each array's place in the state is stored beside it
    and must be the same; checkpoints written before that load as they did."""
    from flax import serialization

    cfg = msrl.load_config(CARTPOLE, ["algorithm.hidden=[8]", "env.num_envs=2", "algorithm.rollout_len=4"])
    with msrl.Session(cfg) as session:
        session.run(1)
        snap = session.snapshot()
    path = checkpoint.save(tmp_path, snap, {"iteration": 1, "config": {}})
    states, _ = checkpoint.load(path)
    assert max_diff(checkpoint.restore(snap, states, path), snap) == 0.0

    def renamed(tree):  # what naming the layers does: Dense_0 -> policy_0, ... (same shapes, other names)
        if isinstance(tree, dict):
            return {k.replace("Dense_", "policy_"): renamed(v) for k, v in tree.items()}
        return tree

    other = {frag: [{comp: renamed(state) for comp, state in comps.items()} for comps in replicas]
             for frag, replicas in snap.items()}
    layer = r"main/0/learner\['params'\]\['params'\]\['{}'\]\['bias'\]"
    with pytest.raises(msrl.TrainingError, match=fr"state 'main/0/learner' holds {layer.format('Dense_0')} where this "
                                                 fr"program's has {layer.format('policy_0')}: it was written by a "
                                                 "different program"):
        checkpoint.restore(other, states, path)

    data = serialization.msgpack_restore(path.read_bytes())  # one written before the places were stored
    payload = serialization.msgpack_restore(data["payload"])
    del payload["paths"]
    checkpoint.write_atomic(path, serialization.msgpack_serialize({"format": 1, **payload}))
    old, _ = checkpoint.load(path)
    assert max_diff(checkpoint.restore(other, old, path), snap) == 0.0  # (by place, as then)


def test_a_copy_beside_the_checkpoints_is_neither_the_newest_nor_rotated_away(tmp_path, capsys):
    """`cp ckpt_000000005.msgpack ckpt_best.msgpack` (probe) made eval and resume take the copy as the newest (by
    name: the run silently went back to iteration 5), and rotation then deleted the real newer ones. Only msrl's
    own names count, by their iteration; a file whose iteration is not its name's is skipped, saying so."""
    import shutil

    train(CARTPOLE, [*QUIET, "run.total_env_steps=5120", "run.checkpoint_every_steps=2560"], run_dir=tmp_path)
    folder = tmp_path / "checkpoints"
    shutil.copy(folder / "ckpt_000000005.msgpack", folder / "ckpt_best.msgpack")
    shutil.copy(folder / "ckpt_000000005.msgpack", folder / "ckpt_000000099.msgpack")
    path, _, meta = checkpoint.latest_good(tmp_path)
    assert path == folder / "ckpt_000000010.msgpack" and meta["iteration"] == 10
    assert "ckpt_000000099.msgpack holds iteration 5, not the one its name says" in capsys.readouterr().err
    (folder / "ckpt_000000099.msgpack").unlink()
    summary = train(None, ["run.total_env_steps=10240", "run.keep_checkpoints=2"], run_dir=tmp_path, resume=True)
    assert summary["iterations"] == 20
    assert sorted(p.name for p in folder.iterdir()) == ["ckpt_000000015.msgpack", "ckpt_000000020.msgpack",
                                                         "ckpt_best.msgpack"]
    from msrl.cli import main  # (what resume says when given a checkpoint, or a run that lost its config.yaml)

    assert main(["train", "--resume", str(folder / "ckpt_000000015.msgpack")]) == 2
    assert (f"ckpt_000000015.msgpack is a checkpoint; a run resumes from its newest good one: give its directory, "
            f"{tmp_path} (to go on from an older checkpoint, move the newer ones out of checkpoints/ first)"
            in capsys.readouterr().err)
    (tmp_path / "config.yaml").unlink()
    assert main(["train", "--resume", str(tmp_path)]) == 2
    assert (f"is not a run directory (no config.yaml); its checkpoints are there: give the config file it was trained "
            f"with too (msrl train CONFIG --resume {tmp_path}" in capsys.readouterr().err)
    (tmp_path / "config.yaml").write_text("")  # (an older msrl killed while writing it: 'algorithm.name: missing')
    assert main(["train", "--resume", str(tmp_path)]) == 2
    assert (f"config.yaml is empty; its checkpoints are there: give the config file it was trained with too (msrl "
            f"train CONFIG --resume {tmp_path}" in capsys.readouterr().err)
