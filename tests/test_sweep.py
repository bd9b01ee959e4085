"""run.sweep: several values of an algorithm's float keys (x several seeds) trained in one fused program, each
member equal to its own run, logged, evaluated and plotted per member; keys one program cannot vary refused."""

from __future__ import annotations

import json
from typing import Literal

import jax
import optax
import pytest
import yaml

import msrl
from msrl.algorithms.ppo.ppo import PPO, PPOConfig, PPOLearner
from msrl.cli import main
from msrl.config import load_config
from msrl.errors import ConfigError

from helpers import CARTPOLE, EXAMPLES, QUICK, assert_reaches, max_diff

LOOP = ["policy.name=fused", "run.total_env_steps=16384", "run.seed_batching=sequential"]


def test_each_member_of_a_sweep_is_bitwise_its_own_run():
    """Two learning rates x two seeds in one program (members lr-major, seed-minor): each member's state and curve
    after 6 iterations are bitwise those of the run with its learning rate and seed alone (with observation
    normalization's running variance too). Bitwise on CPU; elsewhere only up to float rounding (README: the swept
    key is a traced value, which XLA may fold differently from the constant of a run alone; 6e-5 on an H200)."""
    loop = [*LOOP, "algorithm.normalize_obs=true"]
    rounding = 0.0 if jax.default_backend() == "cpu" else 1e-3
    with msrl.Session(CARTPOLE, [*loop, "algorithm.lr=[0.001,0.0003]", "run.num_seeds=2"]) as s:
        assert [m.name for m in s.members] == ["lr=0.001,seed_0", "lr=0.001,seed_1", "lr=0.0003,seed_0",
                                               "lr=0.0003,seed_1"]
        rows, after = s.run(6), s.snapshot()["main"][0]
    for i, (lr, seed) in ((1, (0.001, 1)), (2, (0.0003, 0))):
        with msrl.Session(CARTPOLE, [*loop, f"algorithm.lr={lr}", f"run.seed={seed}"]) as one:
            rows1, after1 = one.run(6), one.snapshot()["main"][0]
        assert max_diff(jax.tree.map(lambda x, i=i: x[i], after), after1) <= rounding
        assert [r["per_seed"][i]["loss"] for r in rows] == pytest.approx([r["loss"] for r in rows1], rel=rounding,
                                                                              abs=rounding)
    assert max_diff(jax.tree.map(lambda x: x[0], after["learner"]), jax.tree.map(lambda x: x[2], after["learner"])) > 0


def test_a_list_value_is_a_sweep_and_what_cannot_be_swept_is_refused():
    cfg = load_config(CARTPOLE, ["algorithm.gamma=[0.99, 0.9]", "algorithm.hidden=[32, 32]"])
    assert cfg.run.sweep == {"gamma": [0.99, 0.9]} and cfg.algorithm.gamma == 0.99 and cfg.algorithm.hidden == [32, 32]
    assert load_config(cfg.dump()).run.sweep == cfg.run.sweep  # a run directory's config.yaml reads back the same
    # that config.yaml with the same list again (a resume's command line) is one sweep; another list is refused
    assert load_config(cfg.dump(), ["algorithm.gamma=[0.99, 9e-1]"]).run.sweep == cfg.run.sweep
    with pytest.raises(ConfigError, match=r"algorithm.gamma: is swept twice: \[0.99, 0.8\] here and \[0.99, 0.9\].*"
                                          r"keep one \(a resumed run sweeps the values it trained: sweep others in a "
                                          r"new run\)$"):
        load_config(cfg.dump(), ["algorithm.gamma=[0.99, 0.8]"])
    with pytest.raises(ConfigError, match=r"\[0.9, 0.99\] here .* in another order are another sweep .*: give them in "
                       r"run.sweep's order, or drop the list$"):
        load_config(cfg.dump(), ["algorithm.gamma=[0.9, 0.99]"])
    refused = {"algorithm.epochs=[1,2]": "algorithm.epochs: one program sweeps float keys only",
               "algorithm.lr=[0.001,-1]": r"algorithm.lr: .*greater than 0",
               "algorithm.lr=[0.001,abc]": r"algorithm.lr: Input should be a valid number.*\(got 'abc'\)",
               "algorithm.lr=[]": "^algorithm.lr: must be a non-empty list",  # (the key written: it said run.sweep.lr)
               "run.sweep={lr: []}": "^run.sweep.lr: must be a non-empty list",
               "algorithm.lr=[0.001,0.001]": "^algorithm.lr: lists a value twice",
               "algorithm.lr=[1e-3,0.001]": "^algorithm.lr: lists a value twice",  # one value, written two ways
               "run.seed=[0,1]": r"run.seed: .*\(got \[0, 1\]\); several seeds in one program: run.num_seeds=N",
               "run.sweep={lrr: [0.1]}": r"run.sweep.lrr: not a key of algorithm ppo; did you mean 'lr'\? its float keys: "
                                         "lr, gamma"}
    for override, message in refused.items():
        with pytest.raises(ConfigError, match=message):
            load_config(CARTPOLE, [override])
    sac, dqn = str(EXAMPLES / "sac_pendulum.yaml"), str(EXAMPLES / "dqn_cartpole.yaml")
    assert load_config(sac, ["algorithm.alpha=[0.1,0.2]"]).run.sweep == {"alpha": [0.1, 0.2]}  # float or null
    refused = {  # (each was a message about shapes, or pydantic's about one element, or trained identical members)
        (sac, "algorithm.hidden=[[64],[32]]"): r"^algorithm.hidden: a list of lists \(\[\[64\], \[32\]\]\) would sweep "
                                                r"it, but one program sweeps float keys only",
        (sac, "algorithm.alpha=[0.1,null]"): r"^algorithm.alpha: null and a number are two programs",
        (dqn, "algorithm.per_alpha=[0.6,0.3]"): r"^algorithm.per_alpha: is swept, but it only applies with "
                                                r"algorithm.prioritized=true: every member would train the same",
        (dqn, "algorithm.eps_decay_steps=[1000,2000]"): r"^algorithm.eps_decay_steps: one program sweeps float keys "
                                                        r"only \(.*; this key is int\)"}
    for (example, override), message in refused.items():
        with pytest.raises(ConfigError, match=message):
            load_config(example, [override])
    with pytest.raises(ConfigError, match=r"algorithm.lr: 0.0005 is given, but run.sweep sweeps it over \[0.001, 0"):
        load_config(CARTPOLE, ["run.sweep={lr: [0.001, 0.002]}", "algorithm.lr=5e-4"])  # (5e-4 was dropped)
    # run.sweep written out sweeps the file's own lr (1e-3) as a list value would
    assert load_config(CARTPOLE, ["run.sweep={lr: [0.0025, 0.0005]}"]).algorithm.lr == 0.0025
    with pytest.raises(ConfigError, match="run.num_seeds: seeds 4,294,967,295 .. 4,294,967,296 pass the largest seed"):
        load_config(CARTPOLE, ["run.seed=4294967295", "run.num_seeds=2"])  # (the second was seed 0)
    with pytest.raises(ConfigError, match=r"run.sweep: .*several swept values in one program need one jitted "
                                          r"program: the jax backend, with policy.name=fused \(or multi_learner "
                                          r"with policy.learners=1 there\)$"):
        msrl.Session(CARTPOLE, ["policy.name=single_learner_coarse", "policy.backend=threads",
                                "algorithm.lr=[0.001,0.0003]", *QUICK])

def test_a_backend_of_one_seed_refuses_several_before_compiling(tmp_path, capsys):
    assert main(["train", CARTPOLE, "policy.name=single_learner_coarse", "policy.backend=ray", "run.num_seeds=2",
                 "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err  # (the stage lines: it compiled, started the backend, then refused)
    assert "run.num_seeds: the ray backend runs one member per program" in err and "msrl: compiling" not in err


class BranchLearner(PPOLearner):
    def learn(self, state, batch, last_obs):
        if self.cfg.vf_coef > 0:  # a Python branch on the value, while the loop runs
            pass
        return super().learn(state, batch, last_obs)


class MisuseConfig(PPOConfig):
    name: Literal["sweep_misuse"] = "sweep_misuse"


@msrl.register_algorithm("sweep_misuse")
class MisusePPO(PPO):
    """PPO that reads ent_coef once, when it is built, and branches on vf_coef in Python while it learns: one
    program can sweep neither."""

    Config = MisuseConfig

    def __init__(self, cfg, ctx):
        super().__init__(cfg, ctx)
        self.bonus = cfg.ent_coef * 2  # read when built
        old = self.learner
        self.learner = BranchLearner(old.net, cfg, old.obs, old.num_updates, old.num_envs)


def test_a_value_read_when_built_or_branched_on_is_refused_naming_the_line():
    """A sweep of a key the algorithm reads in __init__ (it would hold one value for every member), or uses as a
    Python value while its loop runs (it cannot be a traced number), is refused with the key and the line."""
    with pytest.raises(ConfigError, match=r"run.sweep.ent_coef: algorithm.ent_coef is read when the algorithm is "
                                          r"built \(used at .*test_sweep.py:\d+\)"):
        msrl.Session(CARTPOLE, [*LOOP, "algorithm.name=sweep_misuse", "algorithm.ent_coef=[0.01,0.0]"])
    with msrl.Session(CARTPOLE, [*LOOP, "algorithm.name=sweep_misuse", "algorithm.lr=[0.001,0.0003]"]) as s:
        assert len(s.members) == 2  # its other keys sweep
    with pytest.raises(ConfigError, match=r"run.sweep: algorithm.vf_coef is used as a Python value .* at "
                                          r".*test_sweep.py:\d+"):
        msrl.Session(CARTPOLE, [*LOOP, "algorithm.name=sweep_misuse", "algorithm.vf_coef=[0.5,1.0]"])


class InjectedLRLearner(PPOLearner):
    def optimizer(self):  # its state holds the learning rate, set when the state is made
        return optax.inject_hyperparams(optax.adam)(learning_rate=self.cfg.lr)


class InjectedLRConfig(PPOConfig):
    name: Literal["sweep_injected_lr"] = "sweep_injected_lr"


@msrl.register_algorithm("sweep_injected_lr")
class InjectedLRPPO(PPO):
    Config = InjectedLRConfig

    def __init__(self, cfg, ctx):
        super().__init__(cfg, ctx)
        old = self.learner
        self.learner = InjectedLRLearner(old.net, cfg, old.obs, old.num_updates, old.num_envs)


def test_a_swept_key_the_learners_init_reads_holds_each_members_value():
    """A learner whose optimizer state holds the learning rate from its init (optax.inject_hyperparams): each
    member of a sequential sweep starts with its own rate (the second member once started with the first's, its
    init compiled once for both), and ends as its own run."""
    loop = [*LOOP, "algorithm.name=sweep_injected_lr"]
    with msrl.Session(CARTPOLE, [*loop, "algorithm.lr=[0.001,0.003]"]) as s:
        s.run(2)
        after = s.snapshot()["main"][0]["learner"]
    rates = after["opt_state"][-1].hyperparams["learning_rate"]  # (after the policy's gradient transforms)
    assert rates.tolist() == pytest.approx([0.001, 0.003])
    with msrl.Session(CARTPOLE, [*loop, "algorithm.lr=0.003"]) as one:
        one.run(2)
        alone = one.snapshot()["main"][0]["learner"]
    assert max_diff(jax.tree.map(lambda x: x[1], after), alone) == 0.0


def test_a_sweep_logs_each_member_with_its_config_learns_resumes_and_evaluates_each(tmp_path, capsys):
    run = tmp_path / "run"
    result = msrl.train(CARTPOLE, ["algorithm.lr=[0.0025,0.001]", "run.total_env_steps=60000",
                                   "run.checkpoint_every_steps=30000", "run.progress=false"], run_dir=run)
    assert result["members"] == ["lr=0.0025", "lr=0.001"] and result["seeds"] == [0, 0]
    for name, lr in (("lr=0.0025", 0.0025), ("lr=0.001", 0.001)):
        member = yaml.safe_load((run / name / "config.yaml").read_text())
        assert member["algorithm"]["lr"] == lr and member["run"]["sweep"] == {}
        assert_reaches(run / name, 150.0, within=60000)  # each learns (a random policy scores ~22)
    assert json.loads((run / "summary.json").read_text())["members"] == result["members"]
    # TensorBoard's HParams: a session per member, none for the root (its mean mixes the values: no one trial)
    assert all(list((run / n / "tb" / "hparams").glob("events.*")) for n in result["members"])
    assert not (run / "tb" / "hparams").exists()

    # resumed: every member's table is cut back to the checkpoint and continues
    assert main(["train", "--resume", str(run), "run.total_env_steps=70000"]) == 0
    assert [len((run / n / "metrics.csv").read_text().splitlines()) for n in result["members"]] == [1 + 136] * 2

    assert main(["eval", str(run / "lr=0.001"), "--episodes", "2"]) == 0
    assert "lr=0.001)" in capsys.readouterr().out
    assert main(["eval", str(run), "--episodes", "2"]) == 0  # the run's root: its first member, named as such
    assert "lr=0.0025)" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="^run_seed: .* seed 0 with 2 swept values"):
        msrl.load(run, run_seed=0)
    assert main(["plot", str(run), "-o", str(tmp_path / "c.png")]) == 0
    assert (tmp_path / "c.png").stat().st_size > 0


def test_members_that_do_not_fit_in_memory_together_are_refused_before_allocating(tmp_path):
    with pytest.raises(ConfigError, match=r"run.sweep: 200 members \(seeds x swept values\) need about [\d.]+ [GT]B "
                                          r"\([\d.]+ [MG]B each\), but .* are free; train fewer at once"):
        msrl.train(EXAMPLES / "dqn_cartpole.yaml", ["algorithm.buffer_size=2e7", "run.num_seeds=100",
                                                    "algorithm.lr=[0.001,0.0005]", *QUICK], run_dir=tmp_path)


@pytest.mark.parametrize("seeds, hint", [(2, r", or give its folder, .*/run/lr=0.001,seed_1$"), (1, "$")])
def test_a_members_folder_with_another_seed_points_to_that_seeds_member(tmp_path, seeds, hint):
    """(It said to give the run with the seed, which a sweep then refuses: several members have that seed.)"""
    run, cfg = tmp_path / "run", {"algorithm": {"name": "ppo", "rollout_len": 16, "epochs": 1, "minibatches": 2,
                                                "hidden": [16]}, "env": {"num_envs": 4},
                                  "run": {"total_env_steps": 64, "progress": False, "tensorboard": False}}
    msrl.train(cfg, ["algorithm.lr=[0.001,0.0003]", f"run.num_seeds={seeds}"], run_dir=run)
    member = "lr=0.001,seed_0" if seeds > 1 else "lr=0.001"
    with pytest.raises(ConfigError, match=rf"^run_seed: .*{member} is the folder of seed 0, not 1: drop run_seed{hint}"):
        msrl.load(run / member, run_seed=1)
    # a checkpoint of one's choice: any member of it by name (a member's folder loads its newest checkpoint only)
    ckpt, other = next((run / "checkpoints").glob("ckpt_*.msgpack")), "lr=0.0003" + ",seed_1" * (seeds > 1)
    assert max_diff(msrl.load(ckpt, member=other).params, msrl.load(run / other).params) == 0.0
    if seeds > 1:  # its keys in any order
        assert max_diff(msrl.load(ckpt, member="seed_1,lr=0.0003").params, msrl.load(run / other).params) == 0.0
    with pytest.raises(ConfigError, match=rf"^run_seed: .* seed 0 with 2 swept values; give member instead \(e.g. "
                                          rf"{member}\)$"):
        msrl.load(ckpt, run_seed=0)
    with pytest.raises(ConfigError, match=rf"^member: .*{member} is the folder of member {member}, not {other}: give "
                                          "one of the two$"):
        msrl.load(run / member, member=other)


def test_members_of_a_sweep_of_two_keys_are_loaded_and_resumed_in_the_order_trained(tmp_path, capsys):
    """A sweep of lr then gamma names its members lr-major (not alphabetically: gamma before lr): each member's
    folder loads that member's parameters (those of its run alone), also from a checkpoint of an msrl that
    stored neither its sweep's order nor a key added since (algorithm.bootstrap_truncated), which resumes
    too. The run's root loads its first member, with a note. A resume that lists the swept keys in another order
    (its members in another order) is refused."""
    import hashlib

    from flax import serialization

    from msrl import checkpoint

    run, cfg = tmp_path / "run", {"algorithm": {"name": "ppo", "rollout_len": 16, "epochs": 1, "minibatches": 2,
                                                "hidden": [16]},
                                  "env": {"num_envs": 4}, "run": {"total_env_steps": 128, "progress": False}}
    sweep = ["algorithm.lr=[0.001,0.0003]", "algorithm.gamma=[0.9,0.99]", "run.tensorboard=false"]
    assert msrl.train(cfg, sweep, run_dir=run)["members"] == ["lr=0.001,gamma=0.9", "lr=0.001,gamma=0.99",
                                                              "lr=0.0003,gamma=0.9", "lr=0.0003,gamma=0.99"]
    msrl.train(cfg, ["algorithm.lr=0.0003", "algorithm.gamma=0.9", "run.tensorboard=false"], run_dir=tmp_path / "alone")
    alone = msrl.load(tmp_path / "alone").params

    path = checkpoint.latest(run)  # as an msrl before sweep_order and bootstrap_truncated wrote it
    data = serialization.msgpack_restore(path.read_bytes())
    inner = serialization.msgpack_restore(data["payload"])
    inner["meta"].pop("sweep_order", None)
    inner["meta"]["config"]["algorithm"].pop("bootstrap_truncated", None)
    data["payload"] = serialization.msgpack_serialize(inner)
    data["sha256"] = hashlib.sha256(data["payload"]).hexdigest()
    path.write_bytes(serialization.msgpack_serialize(data))
    for saved in ("old", "new"):
        member = msrl.load(run / "lr=0.0003,gamma=0.9")
        assert (member.config.algorithm.lr, member.config.algorithm.gamma) == (0.0003, 0.9)
        assert max_diff(member.params, alone) <= 1e-5, saved  # (another member: > 1e-3)
        assert max_diff(msrl.load(run / "lr=0.001,gamma=0.9").params, alone) > 1e-3
        if saved == "old":  # (a key added since, at its default in config.yaml, is no difference to note); both
            assert "is not the config" not in capsys.readouterr().err  # resumed to 192 steps
            for d in (run, tmp_path / "alone"):
                msrl.train(d / "config.yaml", ["run.total_env_steps=192"], run_dir=d, resume=True)
            alone = msrl.load(tmp_path / "alone").params
    capsys.readouterr()
    assert msrl.load(run).config.algorithm.lr == 0.001  # the run's root: its first member, with a note
    assert f"msrl: note: {run} trained 4 members; this is the first, lr=0.001,gamma=0.9 (another: give its folder, " \
           f"e.g. {run}/lr=0.001,gamma=0.99)" in capsys.readouterr().err
    reordered = yaml.safe_load((run / "config.yaml").read_text())
    reordered["run"]["sweep"] = dict(reversed(reordered["run"]["sweep"].items()))
    with pytest.raises(ConfigError, match=r"^run.sweep: the checkpoint .* swept lr, gamma in that order .*; this "
                                          r"config sweeps gamma, lr: give the keys in the run's order"):
        msrl.train(reordered, ["run.total_env_steps=256"], run_dir=run, resume=True)
    with pytest.raises(ConfigError, match=r"^run.sweep: the checkpoint .* swept lr, gamma; this config sweeps lr, "
                                          r"gamma, ent_coef: a resumed run keeps its members$"):
        msrl.train(run / "config.yaml", ["algorithm.ent_coef=[0.01,0.02]"], run_dir=run, resume=True)
