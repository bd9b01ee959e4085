"""Checkpoints: exact resume after a SIGKILL (fused), resume on a distributed policy, refusals, NaN guard."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

import msrl
from msrl import checkpoint
from msrl.runner import train

import loops  # noqa: F401 - registers the "growth" algorithm

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
    summary = train(tmp_path / "config.yaml", [], run_dir=tmp_path, resume=True)
    assert summary["iterations"] == 80
    leaves, meta = final_leaves(tmp_path)
    assert meta["iteration"] == 80 and all(np.isfinite(x).all() for x in leaves if x is not None and x.dtype.kind == "f")
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["policy"]["name"] == "single_learner_coarse"
    # the learner made exactly 80 updates of 4 epochs x 4 minibatches (optimizer step counts)
    counts = {int(x) for x in leaves if x is not None and x.dtype == np.int32 and x.shape == ()}
    assert 80 * 4 * 4 in counts


def test_resume_refuses_another_config_and_a_missing_checkpoint(tmp_path):
    train(CARTPOLE, [*QUIET, "run.total_env_steps=5120", "run.checkpoint_every_steps=2560"], run_dir=tmp_path)
    with pytest.raises(msrl.ConfigError, match=r"algorithm\.lr.*trained with algorithm\.lr=0\.001"):
        train(CARTPOLE, [*QUIET, "algorithm.lr=0.01"], run_dir=tmp_path, resume=True)
    with pytest.raises(msrl.ConfigError, match=r"env\.num_envs"):
        train(CARTPOLE, [*QUIET, "env.num_envs=8"], run_dir=tmp_path, resume=True)
    with pytest.raises(msrl.ConfigError, match="holds no checkpoint"):
        train(CARTPOLE, QUIET, run_dir=tmp_path / "empty", resume=True)


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

    train(CARTPOLE, [*QUIET, "run.total_env_steps=102400", "run.checkpoint_every_steps=25600"], run_dir=tmp_path / "fused")
    assert main(["eval", str(tmp_path / "fused"), "--episodes", "4"]) == 0
    mean = float(capsys.readouterr().out.split()[1])
    assert mean >= 150  # greedy CartPole after 100k steps of PPO (random play scores ~20)
    assert main(["eval", str(tmp_path / "fused"), "--render", str(tmp_path / "x")]) == 2  # gymnax: no renderer
    assert "--render" in capsys.readouterr().err

    train(EXAMPLES / "ppo_cartpole_threads.yaml", [*QUIET, "run.total_env_steps=2048", "run.checkpoint_every_steps=1024"],
          run_dir=tmp_path / "host")
    assert main(["eval", str(tmp_path / "host"), "--episodes", "2", "--render", str(tmp_path / "frames")]) == 0
    frames = sorted((tmp_path / "frames").glob("frame_*.png"))
    image = imread(frames[0])
    assert len(frames) >= 2 and image.shape[0] > 0 and image.std() > 0
    assert (tmp_path / "frames" / "episode.gif").stat().st_size > 0
