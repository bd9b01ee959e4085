"""What a run logs: rows at intervals of env steps (per-interval SPS, an episode-length column), checkpoints at
intervals of env steps, TensorBoard tags in groups with the config, and an offline Weights & Biases run."""

from __future__ import annotations

import csv
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import msrl

from helpers import CARTPOLE, EXAMPLES, QUICK

DQN = EXAMPLES / "dqn_cartpole.yaml"  # 8 env steps an iteration
SMALL_DQN = ["algorithm.buffer_size=20000", "algorithm.learning_starts=500", "run.progress=false"]


def read_rows(run_dir):
    with open(run_dir / "metrics.csv", newline="") as f:
        return [{k: float(v) if v not in ("", "nan") else float("nan") for k, v in r.items()}
                for r in csv.DictReader(f)]


def read_events(path):
    """The Event protos of a TensorBoard event file (TFRecord: length, crc, payload, crc)."""
    from tensorboardX.proto.event_pb2 import Event

    data, events, at = path.read_bytes(), [], 0
    while at < len(data):
        (length,) = struct.unpack("<Q", data[at:at + 8])
        events.append(Event.FromString(data[at + 12:at + 12 + length]))
        at += 12 + length + 4
    return events


def board(folder, tag):
    """(step, value) of ``tag`` as TensorBoard shows a folder's event files: read in order, a purge (a session
    started at step S) hiding the events of steps >= S read before it."""
    shown = []
    for path in sorted(folder.glob("events.out.tfevents.*")):
        for e in read_events(path):
            if e.HasField("session_log") and e.session_log.status == e.session_log.START:
                shown = [(step, v) for step, v in shown if step < e.step]
            shown += [(e.step, v.simple_value) for v in e.summary.value if v.tag == tag]
    return shown


def test_rows_and_checkpoints_at_intervals_of_env_steps(tmp_path):
    # default: at most 1000 rows (2000 iterations of 8 steps: a row every 2 iterations)
    msrl.train(DQN, [*SMALL_DQN, "run.tensorboard=false", "run.total_env_steps=16000",
                     "run.checkpoint_every_steps=4000", "run.keep_checkpoints=10"], run_dir=tmp_path / "auto")
    rows = read_rows(tmp_path / "auto")
    assert len(rows) == 1000 and [r["env_steps"] for r in rows[:3]] == [16, 32, 48]
    assert sorted(p.name for p in (tmp_path / "auto" / "checkpoints").glob("*.msgpack")) == \
        [f"ckpt_{i:09d}.msgpack" for i in (500, 1000, 1500, 2000)]
    # an explicit interval; the episode statistics are those at the row's end, other metrics its mean
    summary = msrl.train(DQN, [*SMALL_DQN, "run.tensorboard=false", "run.total_env_steps=8000",
                               "run.log_every_steps=800", "run.checkpoint_every_steps=0"], run_dir=tmp_path / "every")
    rows = read_rows(tmp_path / "every")
    assert [r["env_steps"] for r in rows] == list(range(800, 8001, 800)) and summary.rows[-1]["env_steps"] == 8000
    assert not (tmp_path / "every" / "checkpoints").exists()
    assert list(rows[0])[:6] == ["iteration", "env_steps", "episode_return", "episode_length", "sps", "wall_time"]
    finished = [r for r in rows if np.isfinite(r["episode_return"])]
    assert finished and all(r["episode_length"] == r["episode_return"] for r in finished)  # CartPole: +1 a step
    # sps is the interval's (steps since the last row over the time since it), not an average since the start
    walls = [0.0] + [r["wall_time"] for r in rows]
    assert all(np.isclose(r["sps"], 800 / (walls[i + 1] - walls[i])) for i, r in enumerate(rows))
    assert walls == sorted(walls) and len(set(walls)) == len(walls)


def test_host_env_rows_have_episode_lengths(tmp_path):
    msrl.train(EXAMPLES / "ppo_cartpole_threads.yaml", [*QUICK, "run.total_env_steps=4096"], run_dir=tmp_path)
    finished = [r for r in read_rows(tmp_path) if np.isfinite(r["episode_return"])]
    assert finished and all(r["episode_length"] == r["episode_return"] for r in finished)


def test_tensorboard_groups_tags_and_holds_the_config(tmp_path):
    msrl.train(CARTPOLE, ["run.progress=false", "run.total_env_steps=4096"], run_dir=tmp_path)
    (events_file,) = (tmp_path / "tb").glob("events.out.tfevents.*")
    values = [v for e in read_events(events_file) for v in e.summary.value]
    tags = {v.tag for v in values}
    assert {"charts/episode_return", "charts/episode_length", "charts/episodes", "perf/sps", "perf/wall_time",
            "train/loss", "train/entropy"} <= tags
    (text,) = [v for v in values if v.tag.startswith("config")]
    assert b"name: ppo" in text.tensor.string_val[0] and b"total_env_steps: 4096" in text.tensor.string_val[0]
    hparams = list((tmp_path / "tb" / "hparams").glob("events.out.tfevents.*"))
    assert hparams and b"algorithm.lr" in hparams[0].read_bytes() and b"[64, 64]" in hparams[0].read_bytes()
    # a kill loses the events the writer had not flushed yet (here all: the file is cut to its first event);
    # the resumed run's TensorBoard holds metrics.csv's rows all the same, each once
    events_file.write_bytes(events_file.read_bytes()[:12 + struct.unpack("<Q", events_file.read_bytes()[:8])[0] + 4])
    msrl.train(None, ["run.progress=false", "run.total_env_steps=8192"], run_dir=tmp_path, resume=True)
    (resumed,) = (tmp_path / "tb" / "hparams").glob("events.out.tfevents.*")  # one session for the run (there were
    assert b"total_env_steps" in resumed.read_bytes()  # two: TensorBoard listed both)
    shown = board(tmp_path / "tb", "charts/episode_return")
    rows = [r for r in read_rows(tmp_path) if np.isfinite(r["episode_return"])]
    assert [step for step, _ in shown] == [int(r["env_steps"]) for r in rows]
    assert [v for _, v in shown] == pytest.approx([r["episode_return"] for r in rows])


def test_tensorboard_opens_at_the_first_row_not_before(tmp_path):
    """A run's TensorBoard writer (its import, a queue and a thread: ~0.15 s) opens when the first row is logged,
    which the jax backend hands over while it computes the next rows, not on the way to the first ones."""
    from msrl.config import load_config
    from msrl.runner import _Table

    cfg = load_config(CARTPOLE)
    table = _Table(tmp_path, cfg, None)
    assert not (tmp_path / "tb").exists()
    table.log({"iteration": 1, "env_steps": 512, "episode_return": 20.0, "loss": 0.5})
    table.close(cfg, 20.0)
    (events_file,) = (tmp_path / "tb").glob("events.out.tfevents.*")
    values = [v for e in read_events(events_file) for v in e.summary.value]
    assert {"charts/episode_return", "train/loss"} <= {v.tag for v in values}
    assert any(v.tag.startswith("config") for v in values)


def test_tensorboard_loads_without_pytorch_or_boto3_and_leaves_them_importable():
    """tensorboardX imports PyTorch where it is installed, for its type hints only, and boto3 for ``s3://`` log
    dirs: msrl's writer (local run dirs) comes without them, and afterwards ``import torch`` and ``import boto3``
    work (or fail) as they did before."""
    code = textwrap.dedent("""
        import importlib.util, sys
        from msrl.runner import tensorboard_writer
        assert tensorboard_writer().__name__ == "SummaryWriter"
        assert "torch" not in sys.modules and "boto3" not in sys.modules
        for name in ("torch", "boto3"):
            try:
                importlib.import_module(name)
            except ImportError:
                assert importlib.util.find_spec(name) is None  # not installed (the test extra needs neither)
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_weights_and_biases_offline(tmp_path):
    pytest.importorskip("wandb")  # the test extra installs it; `pip install msrl` alone does not
    loop, wandb = [*QUICK, "run.checkpoint_every_steps=4096"], {"wandb": {"project": "msrl-tests", "mode": "offline"}}
    msrl.train(CARTPOLE, [*loop, "run.total_env_steps=4096"], run_dir=tmp_path, run=wandb)
    (log,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    data = log.read_bytes()
    assert b"charts/episode_return" in data and b"train/loss" in data and b"total_env_steps" in data
    # a resumed run goes on in the same W&B run (the same id; `wandb sync` joins them), not in a second one
    msrl.train(CARTPOLE, [*loop, "run.total_env_steps=8192"], run_dir=tmp_path, run=wandb, resume=True)
    logs = sorted((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(logs) == 2 and len({p.name for p in logs}) == 1, logs


def test_weights_and_biases_follows_wandb_mode_and_a_start_that_fails_is_one_line(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    import psutil

    wandb.teardown()  # (wandb reads WANDB_MODE once per process, at its first run)
    run = {"wandb": {"project": "msrl-tests"}}  # no run.wandb.mode: WANDB_MODE says (msrl passed "online")
    # online without an account: wandb's UsageError as one line naming the key (it was a bare traceback), and
    # the run's metrics and TensorBoard files are closed again (their writer threads kept them open)
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # (no ~/.netrc holding a key)
    with pytest.raises(msrl.ConfigError, match=r"^run.wandb: Weights & Biases did not start: UsageError: .*API key.*"
                       r"\(run.wandb.mode=offline, or WANDB_MODE=offline, needs no account or network\)$"):
        msrl.train(CARTPOLE, [*QUICK, "run.total_env_steps=1024"], run_dir=tmp_path / "online", run=run)
    assert not [f.path for f in psutil.Process().open_files() if f.path.startswith(str(tmp_path / "online"))]
    wandb.teardown()
    monkeypatch.setenv("WANDB_MODE", "offline")
    msrl.train(CARTPOLE, [*QUICK, "run.total_env_steps=1024"], run_dir=tmp_path / "offline", run=run)
    assert list((tmp_path / "offline" / "wandb").glob("offline-run-*/run-*.wandb"))
