"""The msrl command: graph (text/json/dot/png, --code) and train (run directory contents)."""

from __future__ import annotations

import ast
import csv
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import pytest
import yaml

from msrl.cli import main
from msrl.runner import lock_run_dir

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
CARTPOLE = str(EXAMPLES / "ppo_cartpole.yaml")


def test_graph_json_shows_api_nodes_loop_state_edges_and_shapes(capsys):
    assert main(["graph", CARTPOLE, "--format", "json"]) == 0
    g = json.loads(capsys.readouterr().out)
    apis = [n["api"] for n in g["nodes"] if n["kind"] == "api"]
    assert apis == ["env_observe", "agent_act", "env_step", "buffer_insert", "buffer_get", "agent_learn"]
    loops = [n for n in g["nodes"] if n["kind"] == "loop"]
    assert len(loops) == 1 and loops[0]["trip_count"] == 128
    assert {n["id"]: n["fragment"] for n in g["nodes"]} == {n["id"]: "main" for n in g["nodes"]}
    kinds = {e["kind"] for e in g["edges"]}
    assert kinds == {"data", "state", "params"}
    batch = [e for e in g["edges"] if e["kind"] == "data" and e["dtype"] == "Transition"]
    assert batch and batch[0]["shape"][0] == "float32[128, 4, 4]"  # [rollout, envs, obs]
    assert all({"src", "dst", "kind", "name", "shape", "dtype"} <= set(e) for e in g["edges"])
    assert g["fragments"][0] | {"state": None} == {"name": "main", "replicas": 1, "backend": "jax", "devices": None,
                                                   "jit": True, "state": None}


@pytest.mark.parametrize("overrides, shown", [
    (["policy.backend=jax", "policy.actor_devices=[0]", "policy.learner_devices=[0]"],
     {"actor": "devices=0 jit", "learner": "devices=0 jit"}),
    (["policy.backend=ray", "policy.resources.learner.num_gpus=0.5", "policy.resources.actor.num_cpus=2"],
     {"actor": "num_cpus=2 num_gpus=0 jit", "learner": "num_cpus=1 num_gpus=0.5 jit"}),
])
def test_graph_shows_where_the_fragments_are_placed(capsys, overrides, shown):
    """(It showed replica counts only; its JSON had an unused "device" field, null.)"""
    args = ["graph", CARTPOLE, "policy.name=single_learner_coarse", "policy.actors=1", *overrides]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert all(f"{name}: replicas=1 backend={overrides[0].split('=')[1]} {where}" in text
               for name, where in shown.items())
    assert main([*args, "--format", "json"]) == 0
    placed = {f["name"]: (f["devices"], f.get("num_cpus"), f.get("num_gpus"))
              for f in json.loads(capsys.readouterr().out)["fragments"]}
    assert placed == ({"actor": ([0], None, None), "learner": ([0], None, None)} if "jax" in overrides[0] else
                      {"actor": (None, 2.0, 0.0), "learner": (None, 1.0, 0.5)})


def test_graph_says_what_a_policy_adds_beside_its_nodes(capsys):
    """multi_learner's all-reduce and async's parameter holder were nowhere in the graph (probe): one fragment of
    N replicas, as if each learned alone. The DOT output dashes carried edges only, as the image does (it dashed
    every state edge)."""
    assert main(["graph", CARTPOLE, "--policy", "multi_learner"]) == 0
    assert ("beside the graph: the gradients of the 2 'learner' replicas are averaged (an all-reduce) before every "
            "optimizer step" in capsys.readouterr().out)
    assert main(["graph", str(EXAMPLES / "a3c_cartpole.yaml"), "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["beside_the_graph"] == [
        "service 'parameters': async's parameter holder, which every replica calls (its state is checkpointed)"]
    assert main(["graph", CARTPOLE]) == 0 and "beside the graph" not in capsys.readouterr().out
    assert main(["graph", CARTPOLE, "--format", "dot"]) == 0
    edges = [line for line in capsys.readouterr().out.splitlines() if "->" in line]
    assert edges and all(("style=dashed" in line) == ("constraint=false" in line) for line in edges)
    assert any("style=solid, color=" in line for line in edges)  # a state edge within the iteration


def test_a_reader_that_stops_reading_ends_the_command_quietly():
    """``msrl graph ... | head -1``: stdout closed before msrl writes (it printed "msrl: error: [Errno 32] Broken pipe",
    then a traceback at exit)."""
    proc = subprocess.Popen([sys.executable, "-m", "msrl.cli", "graph", CARTPOLE, "--code"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 1 and err == "", err


def test_graph_code_is_jittable_python(capsys):
    assert main(["graph", CARTPOLE, "--code"]) == 0
    out = capsys.readouterr().out
    code = out[out.index("def fragment_main"):]
    ast.parse(code)
    assert "_msrl_scan(_loop_" in code and "_c_learner.learn(_s_learner" in code


def test_graph_dot_and_png(tmp_path, capsys):
    assert main(["graph", CARTPOLE, "--format", "dot"]) == 0
    dot = capsys.readouterr().out
    assert dot.startswith("digraph fdg {") and "cluster_" in dot and "agent_learn" in dot
    png = tmp_path / "fdg.png"
    assert main(["graph", CARTPOLE, "-o", str(png)]) == 0  # the suffix picks the format
    image = matplotlib.image.imread(png)
    assert image.shape[0] > 100 and image.shape[1] > 100
    assert main(["graph", CARTPOLE, "-o", str(tmp_path / "fdg.jpg")]) == 0  # any image format matplotlib writes
    assert matplotlib.image.imread(tmp_path / "fdg.jpg").shape[0] > 100
    assert main(["graph", CARTPOLE, "--format", "text", "-o", str(png)]) == 2
    assert f"--format: -o {png} names an image, not text" in capsys.readouterr().err
    assert main(["graph", CARTPOLE, "--code", "-o", str(png)]) == 2  # (it wrote the image without the code)
    assert "--code: adds the generated code to text, JSON or DOT output, not to an image" in capsys.readouterr().err
    assert main(["graph", CARTPOLE, "--code", "-o", str(tmp_path / "fdg.dot")]) == 0  # the code as DOT comments
    dot = (tmp_path / "fdg.dot").read_text()
    after = dot[dot.index("\n}\n") + 3:]  # what follows the graph's closing brace
    assert "// def fragment_main" in after and all(line.startswith("//") for line in after.splitlines() if line)


def test_train_writes_run_directory(tmp_path):
    run = tmp_path / "run"
    assert main(["train", CARTPOLE, "run.total_env_steps=5120", "run.progress=false", "--run-dir", str(run)]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["env_steps"] == 5120 and summary["iterations"] == 10
    assert {"episode_return", "sps", "wall_time", "compile_time"} <= set(summary)
    rows = list(csv.DictReader((run / "metrics.csv").open()))
    assert len(rows) == 10
    assert {"env_steps", "episode_return", "sps", "wall_time", "loss"} <= set(rows[0])
    assert [int(r["env_steps"]) for r in rows] == list(range(512, 5121, 512))
    assert "algorithm:" in (run / "config.yaml").read_text()
    assert list((run / "tb").glob("events.out.tfevents.*"))


def test_console_script_reports_bad_config_without_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "msrl.cli", "train", CARTPOLE, "algorithm.lr=fast"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "algorithm.lr" in proc.stderr and "Traceback" not in proc.stderr


def test_unknown_cli_argument_is_rejected(capsys):
    with pytest.raises(SystemExit):
        main(["graph", CARTPOLE, "--bogus"])
    # said with the command's usage, a misspelt flag with its name (it showed `msrl [-h] [--version] {train,...}`)
    for argv, said in [(["train", CARTPOLE, "--run-dirr", "x"], "msrl train: error: unrecognized arguments: "
                                                                 "--run-dirr x; did you mean '--run-dir'?"),
                       (["eval", "x", "--run", "y"], "msrl eval: error: unrecognized arguments: --run"),
                       (["train", CARTPOLE, "--run", "x"], "msrl train: error: unrecognized arguments: --run")]:
        with pytest.raises(SystemExit):  # (a prefix was taken for the flag: --run for --run-dir, or --run-seed)
            main(argv)
        assert said in capsys.readouterr().err


def test_a_misplaced_config_a_folder_and_a_list_where_one_value_goes_are_named(tmp_path, capsys):
    for args, error in [(["run.seed=1", CARTPOLE], "needs a config file .*: it goes before the KEY=VALUE overrides"),
                        ([str(tmp_path)], f"config file '{tmp_path}' is a directory"),
                        ([CARTPOLE, "env.num_envs=[4,8]"], r"env.num_envs: .*\(got \[4, 8\]\); a list sweeps only")]:
        assert main(["train", *args]) == 2
        assert re.search(error, capsys.readouterr().err)
    assert main(["train", "algorithm.name=ppo", "algorithm.rollout_len=32", "run.total_env_steps=256",  # (as msrl
                 "run.progress=false", "run.tensorboard=false", "--run-dir", str(tmp_path / "bare")]) == 0  # config)
    assert yaml.safe_load((tmp_path / "bare" / "config.yaml").read_text())["env"]["id"] == "gymnax:CartPole-v1"
    (tmp_path / "base.yaml").write_text("algorithm: {name: ppo}\n")
    for args, error in [(["graph"], r"^msrl: error: config: msrl graph needs a config file"),  # (argparse's
                        # "required: config, overrides", though overrides are not)
                        (["train", "--import", str(tmp_path / "base.yaml"), CARTPOLE], r"^msrl: error: --import: "
                         r".*base.yaml is not a .py file")]:  # (was "No module named 'base'")
        assert main(args) == 2
        assert re.search(error, capsys.readouterr().err)
    (tmp_path / "config.yaml").write_text(Path(CARTPOLE).read_text())  # a run's folder: its config named (probe)
    assert main(["graph", str(tmp_path)]) == 2
    assert f"is a directory (a run's: its config is {tmp_path / 'config.yaml'})" in capsys.readouterr().err
    (tmp_path / "my.algo.py").write_text("")  # a file name Python cannot import as a module
    assert main(["train", "--import", str(tmp_path / "my.algo.py"), CARTPOLE]) == 2
    assert "my.algo.py: a module's name cannot hold a dot" in capsys.readouterr().err


def test_resume_names_the_runs_config_and_a_changed_algorithm_or_policy_first(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", CARTPOLE, "run.total_env_steps=1024", "run.progress=false", "--run-dir", str(run)]) == 0
    saved = run / "config.yaml"
    for args, error in [
        (["algorithm.name=dqn"], f"algorithm.name: the run in {run} was trained with algorithm.name='ppo', this "
                                 "resume asks for 'dqn'"),
        ([str(EXAMPLES / "dqn_cartpole.yaml")], "algorithm.name: .* asks for 'dqn'"),
        (["policy.name=single_learner_coarse"], "policy.name: .*policy.name='fused', .* 'single_learner_coarse'"),
        (["algorithm.lr=x"], "algorithm.lr: Input should be a valid number"),  # the override's, not the file's
        (["env.kwargs={max_steps_in_episode: 200}"], r"env.kwargs.max_steps_in_episode: the checkpoint .* was "
                                                    "trained with no env.kwargs.max_steps_in_episode, this config has "
                                                    "200"),  # (not "msrl before ... was a key": a kwarg of the env's)
    ]:
        assert main(["train", "--resume", str(run), *args]) == 2
        assert re.search(error, capsys.readouterr().err)
    saved.write_text(saved.read_text().replace("  lr: ", "  lr: fast #"))
    assert main(["train", "--resume", str(run)]) == 2
    line = next(i for i, text in enumerate(saved.read_text().splitlines(), 1) if text.startswith("  lr: fast #"))
    assert f"algorithm.lr: {saved}:{line}: Input should be a valid number" in capsys.readouterr().err


def test_eval_refuses_a_seed_a_prng_key_cannot_hold(tmp_path, capsys):
    for seed in ["-1", str(2**32), "9" * 20]:
        assert main(["eval", str(tmp_path), "--seed", seed]) == 2
        assert f"--seed: must be a whole number between 0 and 4,294,967,295, got {seed}" in capsys.readouterr().err


def test_eval_of_a_run_without_a_checkpoint_says_why_it_has_none(tmp_path, capsys):
    """(A run that stopped before its first checkpoint was told to train with checkpoint_every_steps > 0.)"""
    for every, why in [(None, r"it stopped before its first checkpoint\)"),
                       (5000, r"it stopped before its first checkpoint, due every 5,000 env steps\)"),
                       (0, r"train with run.checkpoint_every_steps > 0\)")]:
        text = Path(CARTPOLE).read_text()
        if every is not None:
            text = text.replace("run:\n", f"run:\n  checkpoint_every_steps: {every}\n", 1)
        (tmp_path / "config.yaml").write_text(text)
        assert main(["eval", str(tmp_path)]) == 2
        assert re.search(rf"RUN_DIR: {tmp_path} holds no checkpoint \({why}", capsys.readouterr().err)
    (tmp_path / "config.yaml").write_text(Path(CARTPOLE).read_text())
    (tmp_path / "config.yaml").unlink()
    with lock_run_dir(tmp_path, "run_dir"):  # a run starting in it: not a run directory, it said
        assert main(["eval", str(tmp_path)]) == 2
        assert f"holds no checkpoint (none yet: process {os.getpid()} is starting a run in it)" in \
            capsys.readouterr().err
    (tmp_path / "config.yaml").write_text(Path(CARTPOLE).read_text())
    with lock_run_dir(tmp_path, "run_dir"):  # a run training into it now (its lock names this process)
        assert main(["eval", str(tmp_path)]) == 2
        assert f"holds no checkpoint (none yet: process {os.getpid()} is training this run)" in capsys.readouterr().err
        assert main(["train", "--resume", str(tmp_path)]) == 2  # (it said: start it again with --overwrite)
        assert f"(none yet: process {os.getpid()} is training this run); wait for it to end, then resume it\n" in \
            capsys.readouterr().err
    assert main(["train", "--resume", str(tmp_path)]) == 2  # (it ended: whatever it was, --overwrite starts it anew)
    assert "holds no checkpoint (checkpoints/ckpt_*.msgpack) to resume from (it stopped before its first " \
        "checkpoint); start it again with --overwrite\n" in capsys.readouterr().err
    (tmp_path / "config.yaml").write_text(text.replace("checkpoint_every_steps: 0", "checkpoint_every_steps: 5000"))
    (tmp_path / "metrics.csv").write_text("iteration,env_steps\n1,5120\n2,10240\n")  # killed, checkpoints removed
    assert main(["eval", str(tmp_path)]) == 2  # (it said: it stopped before its first checkpoint)
    assert "(it logged 10,240 env steps (metrics.csv), past its first checkpoint, due every 5,000 env steps: they " \
        "were removed)" in capsys.readouterr().err
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "ckpt_000000010.msgpack.tmp").write_bytes(b"\x80")  # killed as it wrote the first
    assert main(["eval", str(tmp_path)]) == 2  # (it said: they were removed)
    assert "(its first checkpoint was being written when the run was killed (ckpt_000000010.msgpack.tmp is " \
        "incomplete))" in capsys.readouterr().err
    shutil.rmtree(tmp_path / "checkpoints")
    (tmp_path / "config.yaml").write_text(Path(CARTPOLE).read_text())
    (tmp_path / "summary.json").write_text('{"env_steps": 40960}')  # it ended; its checkpoints were removed
    assert main(["eval", str(tmp_path)]) == 2
    assert "(the run ended at 40,960 env steps, as its summary.json says; its checkpoints were removed)" in \
        capsys.readouterr().err
    assert main(["eval", str(tmp_path / "none")]) == 2
    assert f"RUN_DIR: {tmp_path / 'none'} does not exist" in capsys.readouterr().err
    assert main(["train", "--resume", str(tmp_path / "none")]) == 2  # (it said: not a run directory (no config.yaml))
    assert f"--resume: {tmp_path / 'none'} does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()  # (with the config given it said: "it stopped before its first checkpoint")
    assert main(["train", CARTPOLE, "--resume", str(tmp_path / "empty")]) == 2
    assert f"--resume: {tmp_path / 'empty'} is not a run directory (it holds none of config.yaml, metrics.csv" in \
        capsys.readouterr().err
    assert main(["config", "algorithm=ppo"]) == 2  # (its hint was the YAML `algorithm: {name: ppo}`)
    assert "algorithm: must be a mapping of keys, got 'ppo' (write `algorithm.name=ppo`, or in a file `algorithm: " \
        "{name: ppo}`)" in capsys.readouterr().err


def test_plot_and_graph_refuse_an_unknown_image_suffix_up_front_and_graph_makes_folders(tmp_path, capsys):
    for args in (["plot", str(tmp_path / "no-run")], ["graph", str(tmp_path / "no.yaml"), "--format", "png"]):
        assert main([*args, "-o", str(tmp_path / "out.xyz")]) == 2
        assert re.search(r"--output: .*out.xyz: cannot tell the image format .*\.pdf, .*\.png, .*\.svg",
                         capsys.readouterr().err)
    png = tmp_path / "new" / "dir" / "g.png"
    assert main(["graph", CARTPOLE, "--format", "png", "-o", str(png)]) == 0 and png.stat().st_size > 0


@pytest.mark.parametrize("code, error", [
    ("x = 1\ndef f(:\n", "2: SyntaxError: invalid syntax"),
    ("def f():\n    raise ValueError('no gpu')\n\nf()\n", "2: ValueError: no gpu"),
    ("import json\nimport no_such_package_of_mine\n", "2: ModuleNotFoundError: No module named 'no_such_package_of_mine'"),
], ids=["syntax", "raises", "imports"])
def test_an_import_that_fails_names_the_users_file_and_line(tmp_path, capsys, code, error):
    module = tmp_path / f"failing_{tmp_path.name}.py"  # (a fresh module name for each test)
    module.write_text(code)
    assert main(["graph", CARTPOLE, "--import", str(module)]) == 2
    assert capsys.readouterr().err == f"msrl: error: --import: {module}:{error}\n"


def test_an_installed_plugin_that_fails_to_import_names_its_file_and_line(tmp_path, capsys, monkeypatch):
    """A package's entry point (``msrl.algorithms``) whose module has a syntax error: one line, not a traceback."""
    from importlib.metadata import EntryPoint

    from msrl.registry import ALGORITHMS

    name = f"plugin_{tmp_path.name}"
    (tmp_path / f"{name}.py").write_text("import msrl\n\nclass Broken(msrl.Algorithm)\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    installed = EntryPoint(name, f"{name}:Broken", "msrl.algorithms")  # as pip install of a plug-in would list it
    monkeypatch.setitem(ALGORITHMS._entry_points(), name, installed)
    assert main(["graph", CARTPOLE, f"algorithm={{name: {name}}}"]) == 2
    assert capsys.readouterr().err == (f"msrl: error: algorithm.name: the algorithm '{name}' (entry point "
                                       f"{name}:Broken) did not load: {tmp_path / name}.py:3: SyntaxError: expected "
                                       "':'\n")


def test_an_algorithm_whose_constructor_raises_names_the_users_file_and_line(tmp_path, capsys):
    name = f"broken_{tmp_path.name}"
    module = tmp_path / f"{name}.py"
    module.write_text(f"import msrl\n\n\n@msrl.register_algorithm({name!r})\nclass Broken(msrl.Algorithm):\n"
                      f"    class Config(msrl.AlgorithmConfig):\n        name: str = {name!r}\n\n"
                      "    def __init__(self, cfg, ctx):\n        raise KeyError('hidden_size')\n")
    (tmp_path / "broken.yaml").write_text(f"algorithm:\n  name: {name}\nenv:\n  id: gymnax:CartPole-v1\n")
    assert main(["graph", str(tmp_path / "broken.yaml"), "--import", str(module)]) == 2
    assert capsys.readouterr().err == f"msrl: error: algorithm: {module}:10: KeyError: 'hidden_size'\n"


def test_total_env_steps_rounded_to_whole_iterations_is_noted(tmp_path, capsys):
    assert main(["train", CARTPOLE, "run.total_env_steps=1100", "run.progress=false", "--run-dir", str(tmp_path)]) == 0
    err = capsys.readouterr().err  # (a library's own warning may come too: only msrl's lines are checked)
    assert "msrl: note: run.total_env_steps=1,100 rounded down to 2 whole iterations of 512 env steps: 1,024\n" in err
    assert err.count("msrl:") == 1, err


def test_graph_refuses_policy_and_a_different_policy_name_override(capsys):
    assert main(["graph", CARTPOLE, "policy.name=single_learner_coarse", "--policy", "fused"]) == 2
    assert capsys.readouterr().err == ("msrl: error: --policy: --policy fused and policy.name=single_learner_coarse "
                                       "name different policies; give one\n")
    assert main(["graph", CARTPOLE, "policy.name=fused", "--policy", "fused"]) == 0
    capsys.readouterr()
    assert main(["graph", CARTPOLE, "--policy", "single_learner_coarse", "run.num_seeds=2"]) == 2  # as train refuses
    assert "msrl: error: run.num_seeds: the threads backend runs one member per program" in capsys.readouterr().err


def test_the_saved_config_holds_the_env_count_envs_per_actor_sets(tmp_path):
    assert main(["train", CARTPOLE, "policy.name=single_learner_coarse", "policy.envs_per_actor=3",
                 "run.total_env_steps=768", "run.progress=false", "--run-dir", str(tmp_path)]) == 0
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved["env"]["num_envs"] == 6 and saved["policy"]["actors"] == 2  # not the file's 4
    assert json.loads((tmp_path / "summary.json").read_text())["env_steps"] == 768


def test_ray_keys_under_another_backend_are_noted(tmp_path, capsys):
    assert main(["train", CARTPOLE, "policy={name: single_learner_coarse, backend: threads, actors: 2}",
                 "policy.ray_address=auto", "policy.max_actor_restarts=5", "policy.resources.learner.num_gpus=1",
                 "run.total_env_steps=1024", "run.progress=false", "--run-dir", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert ("msrl: note: policy.ray_address, policy.max_actor_restarts, policy.resources only apply with "
            "policy.backend=ray; ignored here\n") in err
    # the run's config.yaml lists every key: at their defaults they are not noted
    assert main(["train", str(tmp_path / "config.yaml"), "run.total_env_steps=1024", "run.progress=false",
                 "policy.ray_address=null", "policy.max_actor_restarts=3", "policy.resources={}", "--overwrite",
                 "--run-dir", str(tmp_path)]) == 0
    assert "apply with policy.backend=ray" not in capsys.readouterr().err


def test_config_explains_every_key_and_loads_back_as_the_same_config(tmp_path, capsys):
    """``msrl config``: every key of every example's config under a comment (its meaning, bounds, its default
    where it differs, what gives an inert key effect), as YAML that loads back as the same config."""
    from msrl.config import commented, load_config
    from msrl.registry import import_user_module

    for module in ("custom_algorithm.py", "custom_policy.py"):
        import_user_module(str(EXAMPLES / module))
    for path in sorted(EXAMPLES.glob("*.yaml")):
        cfg = load_config(path)
        text = commented(cfg)
        assert yaml.safe_load(text) == cfg.dump(), path
        lines = text.splitlines()
        keys = [i for i, line in enumerate(lines) if re.match(r" +\w+:( |$)", line) and "name:" not in line]
        assert len(keys) > 25 and all(lines[i - 1].lstrip().startswith("# ") for i in keys), path
    out = tmp_path / "new" / "dqn.yaml"  # (a folder not there yet is made)
    assert main(["config", "algorithm.name=dqn", "algorithm.lr=0.001", "-o", str(out)]) == 0
    text = out.read_text()
    assert "  # Adam's learning rate (>0; default: 0.00025)\n  lr: 0.001\n" in text
    assert "(≥0; no effect unless algorithm.prioritized=true)\n  per_alpha: 0.6\n" in text
    assert load_config(out).dump() == load_config(None, ["algorithm.name=dqn", "algorithm.lr=0.001"]).dump()
    assert main(["config", str(out), "policy.name=replay_server"]) == 0
    assert "  # replay-buffer replicas (default 2; 1 where policy.actors is odd); actors must be a multiple" in \
        capsys.readouterr().out
    assert main(["config", str(out), "policy={name: single_learner_coarse, actors: 2, envs_per_actor: 3}",
                 "algorithm.lr=[1e-3,1e-4]"]) == 0
    words = " ".join(w for w in capsys.readouterr().out.split() if w != "#")  # (comments wrap where they will)
    for says in ("(>0; set by single_learner_coarse: its replicas x envs per replica) num_envs: 6",
                 "(>0; default: 0.00025; swept: run.sweep holds its values) lr: 0.001",
                 "(default: start a private one) (no effect unless policy.backend=ray) ray_address: null"):
        assert says in words, says
    choices = words.split("policy: single_learner_coarse's keys (one of: ")[1].split(")")[0].split(", ")
    assert {"async", "fused", "multi_learner", "replay_server", "single_learner_fine"} <= set(choices)  # (+ tests')


def test_every_key_of_msrls_own_algorithms_policies_and_sections_says_what_it_means():
    import msrl.algorithms  # noqa: F401 - registers the built-in algorithms
    from msrl.config import EnvConfig, RunConfig, WandbConfig
    from msrl.policy import Resources
    from msrl.registry import ALGORITHMS, POLICIES

    models = [ALGORITHMS.get(n).Config for n in ALGORITHMS.names()
              if ALGORITHMS.get(n).__module__.startswith("msrl.algorithms.")]
    models += [POLICIES.get(n) for n in POLICIES.names() if POLICIES.get(n).__module__.startswith("msrl.policies.")]
    assert len(models) == 16
    undescribed = [f"{m.__name__}.{k}" for m in (*models, EnvConfig, RunConfig, WandbConfig, Resources)
                   for k, f in m.model_fields.items() if k != "name" and not f.description]
    assert undescribed == []
