"""run.num_seeds: several seeds of a fused program in one XLA program (one after another, or vmapped), logged, checkpointed, resumed,
evaluated and plotted per seed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

import msrl
from msrl.cli import main
from msrl.errors import ConfigError

from helpers import CARTPOLE, QUICK, assert_reaches, max_diff

LOOP = ["policy.name=fused", "run.total_env_steps=2048"]


def test_each_seed_of_a_sequential_program_is_bitwise_its_own_run():
    """run.seed_batching=sequential (auto's choice on CPU): every seed's curve and parameters after 8 iterations
    are bitwise those of the run with that seed alone (observation normalization too: a running variance that a
    loop over the seeds inside one program rounded otherwise)."""
    overrides = ["policy.name=fused", "run.total_env_steps=16384", "run.seed_batching=sequential",
                 "algorithm.normalize_obs=true"]
    with msrl.Session(CARTPOLE, [*overrides, "run.seed=3", "run.num_seeds=2"]) as s:
        rows, after = s.run(8), s.snapshot()["main"][0]
    for i in range(2):
        with msrl.Session(CARTPOLE, [*overrides, f"run.seed={3 + i}"]) as one:
            rows1, after1 = one.run(8), one.snapshot()["main"][0]
        assert max_diff(jax.tree.map(lambda x, i=i: x[i], after), after1) == 0.0
        assert [r["per_seed"][i]["episode_return"] for r in rows] == [r["episode_return"] for r in rows1]
        assert [r["per_seed"][i]["loss"] for r in rows] == [r["loss"] for r in rows1]
    assert rows[-1]["episode_return"] == pytest.approx(np.mean([r["episode_return"] for r in rows[-1]["per_seed"]]))


@pytest.mark.parametrize("batching", ["sequential", "vmap"])
def test_the_params_of_several_seeds_are_each_members_policy_params(batching):
    """A learner's policy_params is written for one member's state (Session.params() gave it the members' stacked
    state: an evolution strategy's unravelling failed); Session.params() gives each member's on a leading axis."""
    import loops  # noqa: F401 - registers one_member

    overrides = [*LOOP, "algorithm.name=one_member", f"run.seed_batching={batching}"]
    with msrl.Session(CARTPOLE, [*overrides, "run.num_seeds=2"]) as s:
        s.run(1)
        params = s.params()
    for i in range(2):
        with msrl.Session(CARTPOLE, [*overrides, f"run.seed={i}"]) as one:
            one.run(1)
            alone = one.params()
        mine = jax.tree.map(lambda x, i=i: x[i], params)
        assert max_diff(mine, alone) <= (0 if batching == "sequential" else 1e-6)


def test_each_seed_of_a_vmapped_program_starts_and_rolls_out_as_its_own_run():
    """run.seed_batching=vmap: every seed's initial state and first rollout are bitwise those of the run with that
    seed alone on CPU (on an H200 the batched env step rounds an observation differently: 9e-8). The learner's
    update is equal up to float rounding: XLA on CPU sums a batch of rows in another order than one row (the
    advantage's mean differs in its last bit), so longer curves are the same in distribution, not bitwise
    (README; 1.6e-6 after an iteration on an H200)."""
    rollout_rounding, learner_rounding = (0.0, 1e-6) if jax.default_backend() == "cpu" else (1e-6, 1e-5)
    loop = [*LOOP, "run.seed_batching=vmap"]
    with msrl.Session(CARTPOLE, [*loop, "run.seed=3", "run.num_seeds=2"]) as s:
        init, rows, after = s.snapshot()["main"][0], s.run(1), s.snapshot()["main"][0]
    for i in range(2):
        with msrl.Session(CARTPOLE, [*loop, f"run.seed={3 + i}"]) as one:
            init1, rows1, after1 = one.snapshot()["main"][0], one.run(1), one.snapshot()["main"][0]
        def pick(tree, i=i):
            return jax.tree.map(lambda x: x[i], tree)
        assert max_diff(pick(init), init1) == 0.0
        assert max_diff(pick(after["buffer"]), after1["buffer"]) <= rollout_rounding  # the rollout the learner got
        assert max_diff(pick(after["env"]), after1["env"]) <= rollout_rounding
        assert max_diff(pick(after["learner"]), after1["learner"]) < learner_rounding
        seed_row = rows[0]["per_seed"][i]
        assert seed_row["episode_return"] == rows1[0]["episode_return"]
        assert seed_row["iteration"] == rows1[0]["iteration"] == 1


def test_a_run_of_three_seeds_logs_checkpoints_resumes_evaluates_and_plots_each(tmp_path, capsys):
    run = tmp_path / "run"
    seen = []  # what on_iteration gets: the mean row, and each seed's (it got the mean alone)
    result = msrl.train(CARTPOLE, ["run.num_seeds=3", "run.seed=5", "run.total_env_steps=60000",
                                   "run.checkpoint_every_steps=30000", "run.progress=false"], run_dir=run,
                        on_iteration=seen.append)
    assert seen == result.rows
    assert result["seeds"] == [5, 6, 7] and len(result["episode_return_per_seed"]) == 3
    assert result["episode_return"] == pytest.approx(np.mean(result["episode_return_per_seed"]))
    for seed in (5, 6, 7):  # every seed learns (a random policy scores ~22)
        assert_reaches(run / f"seed_{seed}", 200.0, within=60000)
        assert (run / f"seed_{seed}" / "tb").is_dir()
    header = (run / "metrics.csv").read_text().splitlines()[0].split(",")
    assert "episode_return_std" in header
    assert len(result.rows) == 117 and len(result.rows[-1]["per_seed"]) == 3

    # resumed: every seed's table is cut back to the checkpoint and continues
    assert main(["train", "--resume", str(run), "run.total_env_steps=70000"]) == 0
    lines = [(run / f"seed_{s}" / "metrics.csv").read_text().splitlines() for s in (5, 6, 7)]
    assert [len(x) for x in lines] == [1 + 136] * 3
    assert json.loads((run / "summary.json").read_text())["env_steps"] == 136 * 512

    # eval and load pick one seed's policy; another seed is refused, naming the trained ones
    assert main(["eval", str(run), "--run-seed", "6", "--episodes", "2"]) == 0
    one = capsys.readouterr().out.splitlines()[-1]
    assert "seed 6)" in one
    assert main(["eval", str(run), "--all", "--episodes", "2", "--json", str(tmp_path / "each.json")]) == 0
    out, written = capsys.readouterr().out.splitlines(), json.loads((tmp_path / "each.json").read_text())
    each = written["members"]
    assert [e["member"] for e in each] == ["seed_5", "seed_6", "seed_7"] and out[1].split()[1] == one.split()[1]
    means = [e["return_mean"] for e in each]
    assert out[3] == (f"the run: mean return {np.mean(means):.2f} ± {np.std(means):.2f} over its 3 seeds (the std is "
                      "that of the seeds' means)")
    assert written["over_seeds"] == {"the run": {"return_mean": pytest.approx(np.mean(means)),  # (printed only)
                                                 "return_std": pytest.approx(np.std(means)), "seeds": 3}}
    ckpt = sorted((run / "checkpoints").glob("ckpt_*"))[-1]  # (was "is not a run of several seeds")
    assert main(["eval", str(ckpt), "--all"]) == 2
    assert f"msrl: error: RUN_DIR: {ckpt} is a checkpoint file; each member is evaluated from a run directory (its " \
           "newest checkpoint); evaluate one member of this checkpoint with --member NAME\n" == capsys.readouterr().err
    policy = msrl.load(run, run_seed=7)
    assert policy.act(np.zeros(4, np.float32)).shape == () and policy.act([0.0] * 4).shape == ()  # (a list too)
    with pytest.raises(ValueError, match=r"shaped \(4,\) \(a batch: \(n, 4\)\), got \(5,\)"):
        policy.act(np.zeros(5))  # (not flax's error from inside the network)
    with pytest.raises(ConfigError, match=r"^run_seed: .* trained seeds 5..7, not 4"):
        msrl.load(run, run_seed=4)
    with pytest.raises(ConfigError, match=r"^run_seed: must be a whole number \(a seed the run trained\), got '7'$"):
        msrl.load(run, run_seed="7")  # (was "trained seeds 5..7, not 7")
    with pytest.raises(ConfigError, match=r"^run_seed: .*seed_6 is the folder of seed 6, not 5: drop run_seed, "):
        msrl.load(run / "seed_6", run_seed=5)
    # a seed's folder is the run's: resuming or training into it alone is refused, naming the run
    for args in (["--resume", str(run / "seed_6")], [CARTPOLE, "--overwrite", "--run-dir", str(run / "seed_6")]):
        assert main(["train", *args]) == 2
        assert f"seed_6 is one member's folder of the run in {run}" in capsys.readouterr().err
    assert main(["plot", str(run), "-o", str(tmp_path / "c.png")]) == 0
    assert (tmp_path / "c.png").stat().st_size > 0


@pytest.mark.parametrize("policy", ["single_learner_coarse", "multi_learner"])
def test_several_seeds_need_one_fused_program(policy):
    with pytest.raises(ConfigError, match="run.num_seeds"):
        msrl.Session(CARTPOLE, [f"policy.name={policy}", "policy.backend=" + ("threads" if "coarse" in policy else "jax"),
                                "run.num_seeds=2", *QUICK])


def test_several_seeds_under_one_learner_of_multi_learner_are_fused_s():
    """multi_learner with learners=1 compiles to one jitted program of one replica on the jax backend: it takes
    several seeds as fused does, with the same numbers for each."""
    seeds = [*LOOP, "run.num_seeds=2", "run.seed_batching=sequential"]
    with msrl.Session(CARTPOLE, seeds) as fused, msrl.Session(CARTPOLE, [
            *seeds, "policy.name=multi_learner", "policy.learners=1", "policy.backend=jax"]) as one:
        rows, rows1 = fused.run(3), one.run(3)
        assert max_diff(fused.params(), one.params()) == 0.0
    assert [r["per_seed"] for r in rows] == [r["per_seed"] for r in rows1]


def test_a_fresh_process_spreads_the_seeds_over_one_cpu_device_per_core_and_each_stays_its_own_run():
    """Where JAX has not started (``msrl train``), a run of several seeds gets one CPU device per core
    (``jax_num_cpu_devices``) and its program splits the seeds over them: every seed is still bitwise its own run."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core: nothing to spread over")
    code = f"""
        import json, jax, numpy as np, msrl
        from msrl.config import load_config
        from msrl.sweep import spread_over_cores
        loop = [*{LOOP!r}, "run.seed_batching=sequential"]
        cfg = load_config({CARTPOLE!r}, [*loop, "run.num_seeds=2"])
        spread = spread_over_cores(cfg)
        with msrl.Session(cfg) as s:
            s.run(4)
            devices, after = len(set(s.runtime.devices)), s.snapshot()["main"][0]
        diffs = []
        for i in range(2):
            with msrl.Session({CARTPOLE!r}, [*loop, f"run.seed={{i}}"]) as one:
                one.run(4)
                alone = one.snapshot()["main"][0]
            diffs.append(max(float(np.max(np.abs(np.asarray(a, float)[i] - np.asarray(b, float))))
                             for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(alone)) if np.size(b)))
        print(json.dumps({{"spread": spread, "devices": devices, "diffs": diffs}}))
    """
    env = {**{k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"}, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"spread": 2, "devices": 2, "diffs": [0.0, 0.0]}
