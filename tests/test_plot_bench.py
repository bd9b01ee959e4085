"""``msrl plot`` on real run directories; ``msrl bench`` on small benchmark scripts written here (the real
benchmarks take minutes and are never run by the tests)."""

from __future__ import annotations

import csv
import io
import json
import shutil
import textwrap
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest
import yaml
from rich.console import Console

import msrl
from msrl.bench import BENCHMARKS, Benchmark, benchmarks_dir, last_json, run_benchmarks, table
from msrl.cli import main
from msrl.errors import ConfigError
from msrl.plot import _group_key, _label, _shown, lines, mean_curve, moving_average, plot_runs, read_curve

CARTPOLE = str(Path(__file__).resolve().parent.parent / "examples" / "ppo_cartpole.yaml")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two run directories from one training: a real run, and a copy of it whose returns are halved (a second
    curve, apart from the first)."""
    root = tmp_path_factory.mktemp("runs")
    msrl.train(CARTPOLE, ["run.total_env_steps=20000", "run.progress=false", "run.tensorboard=false", "run.seed=0"],
               run_dir=root / "a")
    shutil.copytree(root / "a", root / "b")
    with open(root / "a" / "metrics.csv", newline="") as f:
        reader = csv.DictReader(f)
        fields, rows = reader.fieldnames, list(reader)
    assert sum(r["episode_return"] not in ("", "nan") for r in rows) >= 10  # a curve to draw
    with open(root / "b" / "metrics.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fields)
        writer.writeheader()
        writer.writerows({**r, "episode_return": str(float(r["episode_return"]) / 2) if r["episode_return"] else ""}
                         for r in rows)
    return root / "a", root / "b"


def test_plot_two_runs_on_one_figure(runs, tmp_path, capsys):
    out = tmp_path / "sub" / "curves.png"
    assert main(["plot", str(runs[0]), str(runs[1]), "-o", str(out), "--smooth", "3"]) == 0
    assert str(out) in capsys.readouterr().out
    image = matplotlib.image.imread(out)
    assert image.ndim == 3 and image.shape[0] >= 300 and image.shape[1] >= 800  # two axes side by side
    rgb = image[..., :3].reshape(-1, 3)
    assert len(np.unique(rgb, axis=0)) > 20  # lines, text and a legend, not a blank canvas
    # the two runs' lines are drawn in matplotlib's first two default colours, on both axes
    for color in ((0x1f, 0x77, 0xb4), (0xff, 0x7f, 0x0e)):
        hits = np.all(np.abs(image[..., :3] - np.array(color) / 255) < 0.02, axis=-1)
        cols = np.nonzero(hits.any(axis=0))[0]
        assert cols.size and cols.min() < image.shape[1] / 2 < cols.max(), color


def test_plot_skips_rows_without_a_return_and_smooths_and_draws_another_metric(tmp_path, capsys):
    run = tmp_path / "partial"
    run.mkdir()
    (run / "metrics.csv").write_text("iteration,env_steps,episode_return,sps,wall_time,loss\n"
                                     "1,512,,100,5.1,0.3\n2,1024,nan,100,5.2,0.2\n3,1536,10,100,5.3,0.1\n"
                                     "4,2048,20,100,5.4,0.1\n")
    assert plot_runs([run], tmp_path / "p.png").stat().st_size > 0
    assert read_curve(run, "loss")["loss"].tolist() == [0.3, 0.2, 0.1, 0.1]  # another metric: its every finite row
    assert main(["plot", str(run), "--metric", "loss", "-o", str(tmp_path / "loss.png")]) == 0
    assert main(["plot", str(run), "--metric", "los", "-o", str(tmp_path / "loss.png")]) == 2
    assert f"msrl: error: --metric: {run / 'metrics.csv'} has no column los; its columns: iteration, env_steps, " \
        "episode_return, sps, wall_time, loss" in capsys.readouterr().err
    assert moving_average(np.array([10.0, 20.0, 30.0, 40.0]), 2).tolist() == [10.0, 15.0, 25.0, 35.0]
    with pytest.raises(ConfigError, match="smooth"):
        plot_runs([run], tmp_path / "p.png", smooth=0)


def test_plot_reports_missing_or_empty_metrics(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="no metrics.csv"):
        plot_runs([empty], tmp_path / "x.png")
    assert main(["plot", str(empty), "-o", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("msrl: error:") and "no metrics.csv" in err and "Traceback" not in err
    (tmp_path / "afile").write_text("")
    with pytest.raises(ConfigError, match="afile: a file, not a directory"):
        plot_runs([tmp_path / "afile"], tmp_path / "x.png")
    (empty / "metrics.csv").write_text("")
    with pytest.raises(ConfigError, match="empty"):
        plot_runs([empty], tmp_path / "x.png")
    (empty / "metrics.csv").write_text("iteration,env_steps,episode_return,sps,wall_time\n1,512,,1,1\n2,1024,nan,1,1\n")
    with pytest.raises(ConfigError, match=r"no row with a finished episode \(its episode_return is empty or NaN in every "
                                          r"row: no episode ended yet\)"):  # (it said empty where the CSV held nan)
        plot_runs([empty], tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()
    # a row cut short by a kill is left out; a binary file, and an output that is a folder, are errors that say so
    (empty / "metrics.csv").write_text("iteration,env_steps,episode_return,sps,wall_time\n1,512,5,1,1\n2,1024,4")
    assert plot_runs([empty], tmp_path / "x.png").exists()
    (tmp_path / "folder.png").mkdir()
    assert main(["plot", str(empty), "-o", str(tmp_path / "folder.png")]) == 2
    assert f"msrl: error: [Errno 21] Is a directory: '{tmp_path / 'folder.png'}'" in capsys.readouterr().err
    (empty / "metrics.csv").write_bytes(bytes(range(256)))
    assert main(["plot", str(empty), "-o", str(tmp_path / "x.png")]) == 2
    assert f"msrl: error: {empty / 'metrics.csv'}: does not read as the CSV file msrl writes" in capsys.readouterr().err


FAKE = textwrap.dedent("""
    import argparse, json
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=1000)
    args = ap.parse_args()
    print("log noise {not json}")
    print(json.dumps({"steps": args.steps, "ours_sps": 3000.4, "theirs_sps": 1500, "nested": {"a": 1},
                      "results": {"small": {"o": 10, "t": 40}, "large": {"o": 90, "t": 30}}}, indent=2))
""")

FAKES = (
    Benchmark("fake", "fake.py", ("--steps", "7"), "ours_sps", "theirs_sps", "a peer"),
    Benchmark("crash", "crash.py", (), "ours_sps", "theirs_sps", "a peer"),
    Benchmark("needs_peer", "fake.py", (), "ours_sps", "theirs_sps", "absent peer",
              needs=("msrl_no_such_module_for_tests",)),
    Benchmark("configs", "fake.py", (), "ours_sps", "theirs_sps", "a peer", configs=("o", "t")),
)


def test_bench_runs_scripts_and_tabulates(tmp_path):
    (tmp_path / "fake.py").write_text(FAKE)
    (tmp_path / "crash.py").write_text("raise SystemExit('peer exploded')\n")
    records = {r["name"]: r for r in run_benchmarks(FAKES, tmp_path, quick=True)}
    assert records["fake"]["status"] == "ok"
    assert records["fake"]["result"]["steps"] == 7 and records["fake"]["result"]["nested"] == {"a": 1}
    assert records["crash"]["status"] == "failed" and "peer exploded" in records["crash"]["reason"]
    assert records["needs_peer"]["status"] == "skipped"
    assert "pip install -e '.[bench]'" in records["needs_peer"]["reason"]
    assert records["needs_peer"]["result"] is None

    full = run_benchmarks(FAKES, tmp_path, quick=False, only=["fake"])
    assert [r["name"] for r in full] == ["fake"] and full[0]["result"]["steps"] == 1000

    buf = io.StringIO()
    Console(file=buf, width=200).print(table(list(records.values()), FAKES))
    text = buf.getvalue()
    fake_row = next(line for line in text.splitlines() if "fake" in line)
    assert "3,000" in fake_row and "1,500" in fake_row and "2.00" in fake_row and "ok" in fake_row
    assert "needs_peer: pip install -e '.[bench]'" in text and "failed" in text and "crash: " in text
    # a benchmark of several configs: a row each (it showed the first's alone); at 80 columns (piped output) the
    # reason a benchmark was skipped wraps instead of being cut
    assert [line.split("│")[5].strip() for line in text.splitlines() if "configs: " in line] == ["0.25", "3.00"]
    buf = io.StringIO()
    Console(file=buf, width=80).print(table(list(records.values()), FAKES))
    assert "…" not in buf.getvalue() and "msrl_no_such_module_for_te" in buf.getvalue()
    # nor are the figures of a long benchmark name cut there (they read "45,0…")
    wide = {"name": "ppo_fused", "status": "ok", "reason": None, "seconds": 244.0, "result": {"results": {
        f"cartpole{n}": {"msrl_sps": 145025 + n, "handwritten_sps": 137142 + n} for n in (4, 16)}}}
    buf = io.StringIO()
    Console(file=buf, width=80).print(table([wide]))
    assert "…" not in buf.getvalue() and all(f"{145025 + n:,}" in buf.getvalue() for n in (4, 16))


def test_bench_cli_json_and_errors(tmp_path, capsys, monkeypatch):
    fused = textwrap.dedent("""
        import argparse, json
        ap = argparse.ArgumentParser()
        ap.add_argument("--total-env-steps", type=int, default=500000)
        ap.add_argument("--repeats", type=int, default=3)
        ap.add_argument("--no-peer", action="store_true")
        a = ap.parse_args()
        print(json.dumps({"msrl_fused_sps": 3000, "handwritten_sps": 1500, "ratio": 2.0, "peer_sps": float("nan"),
                          "env_steps": a.total_env_steps, "repeats": a.repeats, "rejax": not a.no_peer}))
    """)
    (tmp_path / "ppo_fused.py").write_text(fused)
    out = tmp_path / "bench.json"
    assert main(["bench", "--dir", str(tmp_path), "--only", "ppo_fused", "--json", str(out)]) == 0
    assert "ppo_fused" in capsys.readouterr().out
    data = json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))  # (a bare NaN)
    assert data["benchmarks"][0]["result"]["peer_sps"] is None
    assert data["mode"] == "quick" and [r["name"] for r in data["benchmarks"]] == ["ppo_fused"]
    assert data["benchmarks"][0]["result"]["handwritten_sps"] == 1500
    assert data["benchmarks"][0]["result"]["env_steps"] == 51200  # the quick flags were passed
    assert data["benchmarks"][0]["result"]["rejax"] is False  # (no peers' venv built for a quick look)

    (tmp_path / "afile").write_text("")  # a --json FILE that cannot be written: said before the benchmarks run
    unwritable = tmp_path / "afile" / "b.json"
    assert main(["bench", "--dir", str(tmp_path), "--only", "ppo_fused", "--json", str(unwritable)]) == 2
    captured = capsys.readouterr()
    assert f"msrl: error: --json: cannot write {unwritable}: " in captured.err
    assert "ppo_fused" not in captured.out
    assert main(["bench", "--dir", str(tmp_path / "nowhere")]) == 2
    assert "no benchmarks directory" in capsys.readouterr().err
    assert main(["bench", "--dir", str(tmp_path), "--only", "nope"]) == 2
    assert "unknown benchmark nope" in capsys.readouterr().err
    assert main(["bench", "--dir", str(tmp_path), "--only", "sac_vs_sb3"]) == 2  # a folder without its script
    assert f"{tmp_path} lacks the benchmark script sac_vs_sb3.py" in capsys.readouterr().err

    deep = tmp_path / "deep" / "benchmarks"  # a folder given relative, in two parts (its script was looked for in
    deep.mkdir(parents=True)  # deep/deep/benchmarks: scripts run from the folder's parent)
    (deep / "ppo_fused.py").write_text(fused)
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "--dir", "deep/benchmarks", "--only", "ppo_fused"]) == 0
    (deep / "ppo_fused.py").write_text("raise SystemExit('broken')\n")  # a failed benchmark: the exit status says so
    assert main(["bench", "--dir", "deep/benchmarks", "--only", "ppo_fused"]) == 1
    assert "broken" in capsys.readouterr().out


def test_last_json_takes_the_final_object():
    assert last_json('{"a": 1}\nwarning\n{\n  "b": {"c": 2}\n}\n') == {"b": {"c": 2}}
    with pytest.raises(ValueError):
        last_json("no json here\n")


def test_default_benchmarks_are_the_checkouts_scripts():
    d = benchmarks_dir()
    assert d == Path(__file__).resolve().parent.parent / "benchmarks"
    assert all((d / b.script).is_file() for b in BENCHMARKS)


def test_plot_aggregates_seeds_into_mean_and_std(runs, tmp_path, capsys):
    """Runs that differ only in run.* (here the seed) are one line: the mean of their returns, with a band
    of ± one standard deviation; another config is another line."""
    a = runs[0]
    shifted = tmp_path / "seed1"
    shutil.copytree(a, shifted)
    cfg = yaml.safe_load((a / "config.yaml").read_text())
    (shifted / "config.yaml").write_text(yaml.safe_dump({**cfg, "run": {**cfg["run"], "seed": 1}}))
    with open(a / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    with open(shifted / "metrics.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, list(rows[0]))
        writer.writeheader()
        writer.writerows({**r, "episode_return": str(float(r["episode_return"]) + 10) if r["episode_return"] else ""}
                         for r in rows)
    other = tmp_path / "other"
    shutil.copytree(a, other)
    (other / "config.yaml").write_text(yaml.safe_dump({**cfg, "algorithm": {**cfg["algorithm"], "lr": 0.5}}))

    assert _group_key(a) == _group_key(shifted) != _group_key(other)
    m = mean_curve([read_curve(a), read_curve(shifted)])
    base = np.interp(m["env_steps"], read_curve(a)["env_steps"], read_curve(a)["episode_return"])
    np.testing.assert_allclose(m["mean"], base + 5, rtol=1e-6)
    np.testing.assert_allclose(m["std"], 5, rtol=1e-6)
    out = tmp_path / "agg.png"
    assert main(["plot", str(a), str(shifted), str(other), "--aggregate", "-o", str(out)]) == 0
    image = matplotlib.image.imread(out)[..., :3]
    blue = np.array((0x1f, 0x77, 0xb4)) / 255  # the first group's line; its band is that colour, faded
    band = 0.8 * np.ones(3) + 0.2 * blue
    assert np.all(np.abs(image - blue) < 0.02, axis=-1).sum() > 100
    assert np.all(np.abs(image - band) < 0.03, axis=-1).sum() > 100
    assert "note" not in capsys.readouterr().err
    # runs of one line that end at different steps: the mean stops where the shortest does, and the plot says so
    with open(shifted / "metrics.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, list(rows[0]))
        writer.writeheader()
        writer.writerows(rows[:len(rows) // 2])
    assert main(["plot", str(a), str(shifted), "--aggregate", "-o", str(out)]) == 0
    end, last = int(float(rows[len(rows) // 2 - 1]["env_steps"])), int(float(rows[-1]["env_steps"]))
    assert (f"note: {shifted} ends at {end:,} env steps, another run of its line at {last:,}: their mean is drawn "
            f"up to {end:,}") in capsys.readouterr().err
    # runs of one line that share no env steps: refused (one run's last value and the other's first were averaged
    with open(shifted / "metrics.csv", "w", newline="") as f:  # into a point)
        writer = csv.DictWriter(f, list(rows[0]))
        writer.writeheader()
        writer.writerows({**r, "env_steps": str(float(r["env_steps"]) + 10 ** 7)} for r in rows)
    assert main(["plot", str(a), str(shifted), "--aggregate", "-o", str(out)]) == 2
    assert "--aggregate: the runs of one line share no env steps where episode_return is logged" in \
        capsys.readouterr().err


def test_a_run_of_several_seeds_is_one_line_and_another_run_its_own_unless_aggregated(runs, tmp_path, capsys):
    """Without --aggregate each run given is its own line (a run of several seeds: their mean), even when another
    run has the same config: a separate seed-0 run is not averaged into the two-seed run's line."""
    seeds = tmp_path / "seeds"
    msrl.train(CARTPOLE, ["run.total_env_steps=20000", "run.progress=false", "run.tensorboard=false",
                          "run.num_seeds=2"], run_dir=seeds)
    single = runs[0]
    assert lines([seeds, single]) == [[seeds / "seed_0", seeds / "seed_1"], [single]]
    assert lines([seeds, single], aggregate=True) == [[seeds / "seed_0", seeds / "seed_1", single]]
    out = tmp_path / "two.png"
    assert main(["plot", str(seeds), str(single), "-o", str(out)]) == 0
    # a column only the run's own metrics.csv has is drawn from it (it was refused as seed_0's missing column)
    assert main(["plot", str(seeds), "--metric", "episode_return_std", "-o", str(out)]) == 0
    # an aggregated line names the runs it joins (it was "seed_0, seed_1, run0")
    group, = lines([seeds, single], aggregate=True)
    assert _shown(group, {d: d.name for d in group}) == f"seeds, {single.name}"
    assert _shown(group[:2], {d: d.name for d in group}) == "seeds"
    # one seed's folder given alone is labelled with its run's folder (it was "seed_1 (ppo, fused)")
    assert _label(seeds / "seed_1", "seed_1") == "seeds/seed_1 (ppo, fused)"
    # a folder given twice, or on its own and with its run, is one run: drawn once, with a note (it counted twice)
    capsys.readouterr()
    assert lines([seeds, seeds / "seed_1", seeds], aggregate=True) == [[seeds / "seed_0", seeds / "seed_1"]]
    assert lines([seeds / "seed_1", seeds]) == [[seeds / "seed_0", seeds / "seed_1"]]  # (in either order)
    assert capsys.readouterr().err == (f"msrl plot: note: {seeds / 'seed_1'} is given on its own and with its run; it "
                                       f"is drawn once\nmsrl plot: note: {seeds} is given twice; it is drawn once\n"
                                       f"msrl plot: note: {seeds / 'seed_1'} is given on its own and with its run; it "
                                       f"is drawn once\n")
