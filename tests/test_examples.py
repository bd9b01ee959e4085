"""The "write your own" guides: REINFORCE defined in examples/custom_algorithm.py and the `inference_server`
policy defined in examples/custom_policy.py, registered from user code and selected by config."""

from __future__ import annotations

import csv
import math
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml

import msrl
from msrl.config import ExperimentConfig, apply_overrides, validate_config
from msrl.registry import ALGORITHMS, POLICIES

from helpers import max_diff

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
# The examples import as modules by name (which registers them). On ray every process unpickles the
# algorithm and compiles its loop again: it imports the module the same way, as the driver's sys.path is
# passed on.
sys.path.insert(0, str(EXAMPLES))

import custom_algorithm
import custom_policy

CONFIG = EXAMPLES / "custom_algorithm.yaml"
POLICY_LINES = {  # the config's `policy:` line, and the alternatives its comments offer
    "fused": "policy: {name: fused}",
    "threads": "policy: {name: single_learner_coarse, backend: threads}",
    "ray": "policy: {name: single_learner_coarse, backend: ray}",
}


def example_config(policy_line: str, overrides: list[str] = ()) -> ExperimentConfig:
    """custom_algorithm.yaml with its one `policy:` line replaced, and ``overrides`` applied."""
    lines = [policy_line if line.startswith("policy:") else line for line in CONFIG.read_text().splitlines()]
    return validate_config(apply_overrides(yaml.safe_load("\n".join(lines)), list(overrides)))


def run(cfg, iterations: int = 3):
    """Compile the config's program, run ``iterations`` iterations; the final policy parameters and rows."""
    with msrl.Session(cfg, iterations_per_dispatch=iterations) as session:
        rows = session.run(iterations)
        return session.params(), rows


def check_rows(rows, iterations: int = 3) -> None:
    assert len(rows) == iterations
    for row in rows:
        assert {"loss", "policy_loss", "baseline_loss", "entropy"} <= set(row)
        assert all(math.isfinite(v) for k, v in row.items() if k != "episode_return"), row


@pytest.fixture(scope="module")
def fused():
    return run(example_config(POLICY_LINES["fused"]))


def test_the_config_switches_policy_in_one_line():
    text = CONFIG.read_text()
    assert sum(line.startswith("policy:") for line in text.splitlines()) == 1
    assert all(line in text for line in POLICY_LINES.values())  # documented in the file itself
    assert ALGORITHMS.get("reinforce") is custom_algorithm.Reinforce
    cfg = example_config(POLICY_LINES["threads"])
    assert (cfg.algorithm.name, cfg.policy.name, cfg.policy.backend, cfg.policy.actors) == \
        ("reinforce", "single_learner_coarse", "threads", 2)


def test_reinforce_fused_and_coarse_on_threads_give_the_same_parameters(fused):
    params, rows = fused
    check_rows(rows)
    assert max_diff(params, jax.tree.map(np.zeros_like, params)) > 1e-3  # it learned something
    coarse, coarse_rows = run(example_config(POLICY_LINES["threads"]))
    check_rows(coarse_rows)
    assert max_diff(params, coarse) <= 1e-5
    assert [r["episodes"] for r in rows] == [r["episodes"] for r in coarse_rows]


@pytest.mark.usefixtures("ray_cluster")
def test_reinforce_coarse_on_ray_gives_the_same_parameters(fused):
    params, rows = fused
    remote, remote_rows = run(example_config(POLICY_LINES["ray"]))
    check_rows(remote_rows)
    assert max_diff(params, remote) <= 1e-5
    assert [r["episodes"] for r in rows] == [r["episodes"] for r in remote_rows]


def test_a_scripts_algorithm_compiles_again_where_ray_unpickles_it():
    """`python examples/custom_algorithm.py policy.backend=ray`: the script's classes travel by value and each Ray
    process compiles the loop from the source in the file their code names (a fresh process, so the script's
    `reinforce` does not replace the module's)."""
    import subprocess

    script = (f"import runpy, pickle, msrl\n"
              f"from msrl.backends import ray_backend\n"
              f"runpy.run_path({str(EXAMPLES / 'custom_algorithm.py')!r}, run_name='user_script')\n"
              f"program = msrl.build(msrl.load_config({str(CONFIG)!r}))\n"
              f"recipe = ray_backend.cloudpickle.dumps((program.algorithm, program.policy, program.env, "
              f"program.num_envs))\n"  # (as the backend sends it)
              f"again = msrl.compile(*pickle.loads(recipe))\n"
              f"assert again.fragments.keys() == program.fragments.keys()\n"
              f"print(type(again.algorithm).__module__)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "user_script"


def test_reinforce_learns_cartpole_under_fused(tmp_path):
    summary = msrl.train(CONFIG, ["run.total_env_steps=32768", "run.progress=false", "run.tensorboard=false"],
                         run_dir=tmp_path)
    with open(tmp_path / "metrics.csv") as f:
        returns = [float(r["episode_return"]) for r in csv.DictReader(f)]
    assert summary["iterations"] == len(returns) == 128
    assert returns[0] < 50, returns  # the untrained policy plays about randomly (~22)
    assert np.mean(returns[-10:]) >= 150, returns
    from msrl.evaluate import evaluate

    assert evaluate(tmp_path, episodes=4)["return_mean"] >= 100  # its greedy action, as `msrl eval` takes it


def test_eval_refuses_an_actor_without_a_greedy_action():
    import loops
    from msrl.evaluate import check_greedy

    with pytest.raises(msrl.ConfigError, match=r"algorithm.name: RandomActor \(sums's actor, .*loops.py\) defines no "
                                               r"greedy\(params, obs\)"):
        check_greedy(loops.RandomActor(2), "sums")
    check_greedy(custom_algorithm.ReinforceActor(None), "reinforce")


def test_custom_policy_registers_compiles_and_runs_from_config(fused):
    assert len((EXAMPLES / "custom_policy.py").read_text().splitlines()) < 60
    assert POLICIES.get("inference_server") is custom_policy.InferenceServer
    cfg = example_config(POLICY_LINES["fused"], ["policy.name=inference_server"])
    program = msrl.build(cfg)
    assert {f.name: (f.spec.replicas, f.state_keys) for f in program.fragments.values()} == {
        "env": (2, ["env"]), "inference": (1, ["actor", "buffer", "params"]), "learner": (1, ["learner"])}
    ops = {(c.src_fragment, c.dst_fragment, c.op) for c in program.plan.comms}
    assert {("inference", "env", "scatter"), ("env", "inference", "gather"), ("inference", "learner", "send"),
            ("learner", "inference", "broadcast")} <= ops
    params, rows = run(cfg)
    check_rows(rows)
    assert max_diff(fused[0], params) <= 1e-5
    with pytest.raises(msrl.ConfigError, match=r"^policy.env_workers: 3 env_workers cannot share env.num_envs=\d+ "
                                               r"environments evenly; set policy.envs_per_worker$"):
        example_config(POLICY_LINES["fused"], ["policy.name=inference_server", "policy.env_workers=3"])


def test_a_run_remembers_its_imports_for_eval_load_and_resume(tmp_path):
    """A run trained with --import, or by a script that registers its algorithm, lists the file in its config.yaml
    (run.imports), so `msrl eval RUN`, msrl.load and --resume, in a fresh process, import it again; a file that moved
    is named, and an import from its new place stands in for it (a resume too; renamed too); a file named as a module
    already imported (json.py) is refused: it would not run."""
    import subprocess

    def python(code: str) -> list[str]:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout.splitlines()

    run, mine = tmp_path / "run", str(EXAMPLES / "custom_algorithm.py")
    # the script run as a program (`--import` as other tests do it): it registered reinforce as __main__ and guards
    # its training with `if __name__ == "__main__"`, so the run lists it (the eval below was "unknown algorithm")
    out = subprocess.run([sys.executable, mine, "run.total_env_steps=2048", "run.progress=false",
                          "run.tensorboard=false", "--run-dir", str(run)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert yaml.safe_load((run / "config.yaml").read_text())["run"]["imports"] == [mine]
    lines = python(f"""import numpy as np, msrl
from msrl.cli import main
assert main(["eval", {str(run)!r}, "--episodes", "2"]) == 0
print(msrl.load({str(run)!r}).act(np.zeros((3, 4), np.float32)).tolist())
print(msrl.train(None, ["run.total_env_steps=3072"], run_dir={str(run)!r}, resume=True)["env_steps"])""")
    assert lines[0].startswith("return ") and len(yaml.safe_load(lines[1])) == 3 and lines[2] == "3072", lines
    moved = tmp_path / "moved" / "my_reinforce.py"  # moved and renamed
    moved.parent.mkdir()
    moved.write_text((EXAMPLES / "custom_algorithm.py").read_text())
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "json.py").write_text("print('never')")  # a name Python's own json module has
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["run"]["imports"] = ["/nowhere/custom_algorithm.py"]
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    line = (run / "config.yaml").read_text().splitlines().index("  imports:") + 1  # (where the file lists them)
    lines = python(f"""import msrl
from msrl.registry import import_user_module
for spec in ({str(run / "config.yaml")!r}, {str(tmp_path / "mine" / "json.py")!r}):
    try:
        msrl.load_config(spec) if spec.endswith(".yaml") else import_user_module(spec)
    except msrl.ConfigError as e:
        print(e)
import_user_module({str(moved)!r})  # (as --import does)
print(msrl.train(None, ["run.total_env_steps=4096"], run_dir={str(run)!r}, resume=True)["env_steps"])""")
    assert lines[:2] == [f"run.imports: {run / 'config.yaml'}:{line}: /nowhere/custom_algorithm.py: no such file (if "
                         "it is one a run's config.yaml "
                         "lists, and it has moved, give --import with its new place, or, from Python, "
                         "msrl.registry.import_user_module(its new place) before msrl.load or msrl.train)",
                         f"--import: {tmp_path / 'mine' / 'json.py'}: a module named 'json' exists already (Python's "
                         "own), so this file would not run, or would hide that module; rename it"], lines
    assert lines[-1] == "4096" and yaml.safe_load((run / "config.yaml").read_text())["run"]["imports"] == [str(moved)]


def test_cli_imports_user_modules(capsys):
    from msrl.cli import main

    root = Path(__file__).resolve().parent.parent
    assert main(["graph", "--import", str(root / "examples" / "custom_policy.py"),
                 str(root / "examples" / "ppo_cartpole.yaml"), "policy.name=inference_server"]) == 0
    assert "inference: replicas=1" in capsys.readouterr().out
    assert main(["graph", "--import", "no_such_module_xyz", str(root / "examples" / "ppo_cartpole.yaml")]) == 2
    assert "--import: cannot import 'no_such_module_xyz'" in capsys.readouterr().err
    assert main(["graph", "--import", "nowhere/mine.py", str(root / "examples" / "ppo_cartpole.yaml")]) == 2
    assert (f"--import: {Path.cwd() / 'nowhere' / 'mine.py'}: no such file (a relative path is taken from the working "
            f"directory, {Path.cwd()})") in capsys.readouterr().err


@pytest.mark.parametrize("top, listed", [("", True), ("print('training')\n", False), ("main()\n", False)])
def test_a_script_is_listed_in_run_imports_only_if_importing_it_runs_nothing(tmp_path, top, listed):
    """(A script that trains at its top level and also has an `if __name__ == "__main__":` was listed: msrl eval
    and --resume would have imported it, training again.)"""
    import subprocess

    script = tmp_path / "mine.py"
    script.write_text("from pathlib import Path\nimport msrl\nfrom msrl.envs import register_env\nHERE = "
                      "Path(__file__).parent\n\n@register_env('mine_script')\ndef maker(name, **kw):\n    ...\n\n"
                      "def main():\n    from msrl.registry import main_script\n    print(main_script())\n\n"
                      f"{top}if __name__ == '__main__':\n    main()\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines()[-1] == (str(script) if listed else "None")
