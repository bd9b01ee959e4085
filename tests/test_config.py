"""Config: YAML + overrides, and errors that name the key."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Literal

import pytest
import yaml

import msrl
from msrl.config import load_config, read_config
from msrl.errors import ConfigError

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_example_loads_with_overrides(tmp_path):
    cfg = load_config(EXAMPLES / "ppo_cartpole.yaml", ["run.seed=3", "algorithm.lr=1e-3", "env.num_envs=8"])
    assert cfg.run.seed == 3 and cfg.algorithm.lr == 1e-3 and cfg.env.num_envs == 8
    assert load_config(EXAMPLES / "ppo_cartpole.yaml", [" algorithm.lr =1e-3"]).algorithm.lr == 1e-3  # (spaces
    # around a key were part of it: "unknown key ' algorithm'; did you mean 'algorithm'?")
    assert cfg.policy.name == "fused" and cfg.policy.backend == "jax"
    dumped = cfg.dump()
    assert dumped["algorithm"]["name"] == "ppo" and dumped["run"]["seed"] == 3
    with pytest.raises(ConfigError, match=r"overrides: a list of KEY.PATH=VALUE strings, got one string: write \["):
        load_config(EXAMPLES / "ppo_cartpole.yaml", "run.seed=3")  # (it was read letter by letter)
    with pytest.raises(ConfigError, match=r"^overrides: a list of KEY.PATH=VALUE strings, got a dict: write "
                                          r"\['run.seed=3', 'algorithm.hidden=\[8\]'\]$"):
        msrl.train(EXAMPLES / "ppo_cartpole.yaml", {"run.seed": 3, "algorithm.hidden": [8]})
    for wrong, shown in [([5], "5"), (["run.seed=1", None], "None"), (7, "7")]:  # (a TypeError / AttributeError)
        with pytest.raises(ConfigError, match=rf"^overrides: a list of KEY.PATH=VALUE strings, got {shown}$"):
            load_config(EXAMPLES / "ppo_cartpole.yaml", wrong)
    assert load_config(EXAMPLES / "ppo_cartpole.yaml", None).run.seed == 0  # (None: none)
    for typo, meant in [("rundir", "run_dir"), ("on_iter", "on_iteration")]:  # (read as sections: "did you mean
        with pytest.raises(ConfigError, match=rf"^{typo}: not an argument of train\(\); did you mean '{meant}'\?"):
            msrl.train(EXAMPLES / "ppo_cartpole.yaml", **{typo: "x"})  # 'run'?", and no hint)
    # a mapping given to a key sets its keys, as train(..., run={...}) does (the command line replaced the section:
    # run={seed: 3} dropped the file's total_env_steps; algorithm={epochs: 1} its name)
    spread = load_config(EXAMPLES / "ppo_cartpole.yaml", ["run={seed: 3}", "algorithm={epochs: 1}",
                                                          "env.kwargs={}"])
    assert spread.run.seed == 3 and spread.run.total_env_steps == 300_000 and spread.algorithm.epochs == 1
    assert spread.algorithm.lr == 1e-3 and spread.env.kwargs == {}
    from msrl.config import spread as spread_overrides  # one level: a key's own mapping is given whole (run.sweep,

    assert spread_overrides(["run={seed: 3, sweep: {gamma: [0.9]}}", "env.kwargs={a: 1}", "policy.name={a: 1}"]) == [
        "run.seed=3", 'run.sweep={"gamma": [0.9]}', "env.kwargs={a: 1}", "policy.name={a: 1}"]  # env.kwargs replaced)
    # train()'s resume needs run_dir and does not overwrite (the CLI's --resume/--overwrite say so too)
    with pytest.raises(ConfigError, match=r"^resume: resuming needs the run's directory \(run_dir\)$"):
        msrl.train(None, resume=True)
    with pytest.raises(ConfigError, match=r"^overwrite: a resumed run continues its directory; overwrite=True would"):
        msrl.train(EXAMPLES / "ppo_cartpole.yaml", run_dir="anywhere", resume=True, overwrite=True)
    # a section a saved config writes as null (`wandb: null`) takes a dotted key (it was "is None, not a section")
    saved = tmp_path / "config.yaml"
    saved.write_text(yaml.safe_dump(load_config(EXAMPLES / "ppo_cartpole.yaml").dump()))
    assert "wandb: null" in saved.read_text()
    cfg = load_config(saved, ["run.wandb.project=p", "run.wandb.mode=offline", "run.wandb.tags=['1e3', '7']"])
    assert (cfg.run.wandb.project, cfg.run.wandb.mode, cfg.run.wandb.tags) == ("p", "offline", ["1e3", "7"])
    # written as msrl reads it: a string like a number quoted (1e3 was written bare, and read back as 1000.0)
    from msrl.config import commented, dump_yaml

    for text in (dump_yaml(cfg.dump()), commented(cfg)):
        saved.write_text(text)
        assert load_config(saved).run.wandb.tags == ["1e3", "7"]
    # a word ending in ':' is that text (YAML reads `envpool:` as {envpool: null}): the env id's own error follows
    with pytest.raises(ConfigError, match=r"env.id: envpool: is not an EnvPool environment"):
        msrl.build(load_config(EXAMPLES / "ppo_cartpole.yaml", ["env.id=envpool:"]))


def test_messages_for_slips_say_what_was_meant(tmp_path):
    """A section left out, a name in capitals, a swept typo, an empty file, another algorithm's keys after a switch."""
    cases = [(["lr=1e-3"], r"^lr: unknown key; allowed keys: algorithm, env, policy, run \(did you mean algorithm.lr\?\)$"),
             (["actors=2"], r"\(did you mean policy.actors, with policy.name [^?]*replay_server, single_learner_coarse "
                            r"or single_learner_fine\?\)$"),  # (other tests register policies of their own)
             (["backend=ray"], r"\(did you mean policy.backend\?\)$"),
             (["algorithm.name=PPO"], r"^algorithm.name: unknown algorithm 'PPO'; did you mean 'ppo'\? "),
             (["run.sweep.lrr=[1e-3,2e-3]"], r"^run.sweep.lrr: not a key of algorithm ppo; did you mean 'lr'\? "),
             (["algorithm.lr=[1e-3,0.001]"], r"^algorithm.lr: lists a value twice: \[0.001, 0.001\]$"),
             (["algorithm.name=a2c"], (r"^algorithm.epochs: a2c has no such key: the config gives it for ppo, which "
                                       r"algorithm.name=a2c replaces; drop epochs, minibatches, clip_eps from the "
                                       r"config, or start from a config of a2c \(`msrl config algorithm.name=a2c "
                                       r"-o a2c.yaml` writes one\)$"))]
    for overrides, message in cases:
        with pytest.raises(ConfigError, match=message):
            load_config(EXAMPLES / "ppo_cartpole.yaml", overrides)
    assert load_config(EXAMPLES / "ppo_cartpole.yaml", ["algorithm.name=a2c", "algorithm.name=ppo"]).algorithm.lr
    (tmp_path / "empty.yaml").write_text("")
    with pytest.raises(ConfigError, match=rf"^algorithm.name: missing: {tmp_path / 'empty.yaml'} is empty; available"):
        load_config(tmp_path / "empty.yaml")
    assert load_config(tmp_path / "empty.yaml", ["algorithm.name=a2c"]).algorithm.name == "a2c"
    (tmp_path / "typo.yaml").write_text("algorithm:\n  nmae: ppo\n")
    with pytest.raises(ConfigError, match=r"^algorithm.nmae: .*typo.yaml:2: unknown key; did you mean 'name'\? "
                       r"algorithm.name is missing; available: a2c, "):
        load_config(tmp_path / "typo.yaml")


def test_an_algorithm_that_names_its_own_default_env_gets_it_where_the_config_names_none():
    """`msrl config algorithm.name=sac` writes a config that trains (SAC refuses CartPole's discrete actions)."""
    from msrl.config import commented

    for name, env in (("sac", "gymnax:Pendulum-v1"), ("td3", "gymnax:Pendulum-v1"),
                      ("mappo", "jaxmarl:MPE_simple_spread_v3"), ("ppo", "gymnax:CartPole-v1")):
        cfg = load_config(None, [f"algorithm.name={name}", "env.num_envs=2"])
        assert cfg.env.id == env and cfg.defaults()["env"]["id"] == env, name
        assert "default: gymnax:CartPole" not in commented(cfg)
    assert load_config(None, ["algorithm.name=sac", "env.id=gymnax:MountainCarContinuous-v0"]).env.id == \
        "gymnax:MountainCarContinuous-v0"


def test_a_key_given_twice_takes_the_last_value_with_a_note(capsys):
    cfg = load_config(EXAMPLES / "ppo_cartpole.yaml", ["run.seed=1", "algorithm.hidden=[32]", "run.seed=2",
                                                       "algorithm.hidden=[32]"])
    assert cfg.run.seed == 2 and cfg.algorithm.hidden == [32]
    assert capsys.readouterr().err == "msrl: note: run.seed is given 2 times (run.seed=1, run.seed=2): the last one holds\n"


def test_switching_the_policy_drops_the_files_policy_keys_with_a_note(capsys):
    cfg = load_config(EXAMPLES / "ppo_cartpole_threads.yaml", ["policy.name=single_learner_fine"])
    assert cfg.policy.name == "single_learner_fine"
    # (not backend='threads', actors=2: the new policy's defaults, which it keeps)
    assert "policy.name=single_learner_fine replaces policy 'single_learner_coarse': its keys envs_per_actor=4, " \
           "learner_backend='jax' are dropped (give the ones you want again, e.g. policy.envs_per_actor=...)" \
           in capsys.readouterr().err
    # keys given again with the switch are not noted as dropped (it said backend='threads' went, given policy.backend)
    load_config(EXAMPLES / "ppo_cartpole_threads.yaml", ["policy.name=single_learner_fine", "policy.actors=4"])
    err = capsys.readouterr().err
    assert "its keys envs_per_actor=4, learner_backend='jax' are dropped" in err and "actors=2" not in err, err
    load_config(EXAMPLES / "ppo_cartpole.yaml", ["policy.name=multi_learner"])  # (backend='jax' is its own too)
    assert "replaces policy" not in capsys.readouterr().err
    load_config(EXAMPLES / "ppo_cartpole.yaml", ["policy.name=single_learner_coarse", "policy.backend=threads"])
    assert "replaces policy" not in capsys.readouterr().err
    with pytest.raises(ConfigError, match="unknown policy 'bogus'"):  # (a note on the keys went first: noise)
        load_config(EXAMPLES / "ppo_cartpole_threads.yaml", ["policy.name=bogus"])
    assert "replaces policy" not in capsys.readouterr().err


@pytest.mark.parametrize(
    "override, key, text",
    [
        ("algorithm.lr=abc", "algorithm.lr", "valid number"),
        ("algorithm.lr=-1", "algorithm.lr", "greater than 0"),
        ("algorithm.nope=1", "algorithm.nope", "allowed keys: name, rollout_len"),
        ("algorithm.lrr=1", "algorithm.lrr", "unknown key; did you mean 'lr'\\? allowed keys: name,"),
        ("algorithm.name=ppp", "algorithm.name", "unknown algorithm 'ppp'; did you mean 'ppo'\\? available:.* "
                                               "`msrl ... --import FILE.py`"),
        ("policy.name=single_learner_corse", "policy.name", "did you mean 'single_learner_coarse'"),
        ("envv.id=x", "envv", "did you mean 'env'\\? allowed keys: algorithm, env, policy, run"),
        ("algorithm.activation=gelu", "algorithm.activation", "'tanh' or 'relu'"),
        ("algorithm.name=dqn2", "algorithm.name", "available:.*ppo"),
        ("env.num_envs=0", "env.num_envs", "greater than 0"),
        ("env.colour=red", "env.colour", "allowed keys: id, num_envs, kwargs"),
        ("policy.name=nope", "policy.name", "available:.*fused"),
        ("policy.backend=threads", "policy.backend", "'jax'"),
        ("policy.actors=2", "policy.actors", "unknown key"),
        ("run.total_env_steps=ten", "run.total_env_steps", "valid integer"),
        ("extra.x=1", "extra", "allowed keys: algorithm, env, policy, run"),
        ("run.seed", "run.seed", "KEY.PATH=VALUE"),
        # a nested section's own keys, not its parent's; a typo named before the key it leaves missing
        ("run.wandb={projct: x}", "run.wandb.projct", "did you mean 'project'\\? allowed keys: project, entity"),
        ("run.wandb={project: x, tag: y}", "run.wandb.tag", "did you mean 'tags'"),
        ("algorithm.lr=[1e-3", "algorithm.lr", r"'\[1e-3' is not valid YAML: expected ',' or '\]'"),  # (it said
        # "unable to parse string as a number")
        ("run.wandb=true", "run.wandb", r"a mapping of its keys \(project, entity, name, tags, mode\) \(got True\)"),
        # (it said "a valid dictionary or instance of WandbConfig")
        # env's own keys given as the maker's (a TypeError, 'make_env() got multiple values for argument')
        ('env.kwargs={"xla": true}', "env.kwargs.xla", "a key of env itself, not of the env's maker: write env.xla"),
        ('env.kwargs={"subprocesses": 2}', "env.kwargs.subprocesses", "write env.subprocesses"),
    ],
)
def test_bad_values_name_the_key(override, key, text):
    with pytest.raises(msrl.ConfigError) as info:
        load_config(EXAMPLES / "ppo_cartpole.yaml", [override])
    assert info.value.key == key
    assert pytest.importorskip("re").search(text, str(info.value)), str(info.value)


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(msrl.ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("algorithm: [unclosed\n")
    with pytest.raises(msrl.ConfigError, match="not valid YAML") as info:
        load_config(bad)
    assert f'in "{bad}", line 2' in str(info.value)  # (it said "<unicode string>")
    (tmp_path / "noalgo.yaml").write_text("env: {id: gymnax:CartPole-v1}\n")
    with pytest.raises(msrl.ConfigError, match="algorithm.name: missing"):
        load_config(tmp_path / "noalgo.yaml")


def test_minibatches_must_divide_the_batch():
    cfg = load_config(EXAMPLES / "ppo_cartpole.yaml", ["algorithm.minibatches=3"])
    with pytest.raises(msrl.ConfigError, match="algorithm.minibatches.*does not divide"):
        msrl.build(cfg)


def test_sections_must_be_mappings(tmp_path):
    (tmp_path / "scalar.yaml").write_text("algorithm: ppo\n")
    with pytest.raises(msrl.ConfigError, match=r"^algorithm: .*scalar.yaml:1: must be a mapping.*name: ppo"):
        load_config(tmp_path / "scalar.yaml")


@pytest.mark.parametrize("text, got", [("- a\n- b\n", "list \\['a', 'b'\\]"), ("5\n", "int 5"), ("[]\n", "list \\[\\]"),
                                       ("false\n", "bool False")], ids=["list", "scalar", "empty list", "false"])
def test_a_file_that_is_not_a_mapping_is_named(tmp_path, text, got):
    (tmp_path / "top.yaml").write_text(text)
    for overrides in ([], ["run.seed=1"]):
        with pytest.raises(msrl.ConfigError, match=rf"top.yaml: a config must be a mapping .*, got {got}"):
            load_config(tmp_path / "top.yaml", overrides)


def test_whole_numbers_in_e_notation_go_where_an_integer_does():
    cfg = load_config(Path(__file__).resolve().parent.parent / "examples" / "ppo_cartpole.yaml",
                      ["run.total_env_steps=1e5", "algorithm.rollout_len=2.56e2", "algorithm.hidden=[1e2, 64]"])
    assert (cfg.run.total_env_steps, cfg.algorithm.rollout_len, cfg.algorithm.hidden) == (100_000, 256, [100, 64])
    with pytest.raises(msrl.ConfigError, match=r"algorithm.hidden.1: .*valid integer.*\(got 1.5\)"):  # (in a list
        load_config(None, ["algorithm.name=ppo", "algorithm.hidden=[1e2, 1.5e0]"])  # too: it was refused as text)
    with pytest.raises(msrl.ConfigError, match=r"run.total_env_steps: .*valid integer.*\(got 2.5\)"):
        load_config(None, ["algorithm.name=ppo", "run.total_env_steps=2.5e0"])
    # numbers with an exponent are numbers (YAML 1.1 read 1e-3 as text), in an env's keyword arguments too
    cfg = load_config(None, ["algorithm.name=ppo", 'env.kwargs={"a": 1e-3, "b": 2.5E+2, "c": -1e3, "d": "1e-3"}'])
    assert cfg.env.kwargs == {"a": 0.001, "b": 250.0, "c": -1000.0, "d": "1e-3"}


def test_duplicate_keys_booleans_for_numbers_and_non_finite_floats_are_refused(tmp_path):
    config = tmp_path / "dup.yaml"
    config.write_text("algorithm: {name: ppo}\nrun:\n  seed: 1\n  seed: 2\n")
    with pytest.raises(msrl.ConfigError, match=r"run.seed: .*dup.yaml: written twice in one mapping \(lines 3 and 4\)"):
        load_config(config)
    config.write_text("algorithm: {name: ppo, lr: 1.0e-3, lr: 2.0e-3}\n")  # a flow mapping: both on one line
    with pytest.raises(msrl.ConfigError, match=r"algorithm.lr: .*written twice in one mapping \(twice on line 1\)"):
        load_config(config)
    with pytest.raises(msrl.ConfigError, match=r"env.kwargs.a: .*written twice"):
        load_config(EXAMPLES / "ppo_cartpole.yaml", ["env.kwargs={a: 1, a: 2}"])
    config.write_text("defaults: &d {lr: 1.0e-3, gamma: 0.9}\nalgorithm:\n  <<: *d\n  name: ppo\n  lr: 2.0e-3\n")
    raw = read_config(config)  # a YAML merge key: the mapping's own keys override the merged ones
    assert raw["algorithm"] == {"name": "ppo", "lr": 2.0e-3, "gamma": 0.9}
    config.write_text("algorithm: ppo\nalgorithm: dqn\n")
    with pytest.raises(msrl.ConfigError, match="algorithm: .*written twice .*lines 1 and 2"):
        load_config(config)
    with pytest.raises(msrl.ConfigError, match="algorithm.rollout_len: must be a number, got true"):
        load_config(EXAMPLES / "ppo_cartpole.yaml", ["algorithm.rollout_len=true"])
    with pytest.raises(msrl.ConfigError, match="algorithm.lr: Input should be a finite number"):
        load_config(EXAMPLES / "ppo_cartpole.yaml", ["algorithm.lr=.inf"])
    assert load_config(EXAMPLES / "ppo_cartpole.yaml", ["algorithm.anneal_lr=false"]).algorithm.anneal_lr is False


LAUGHS = 'a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]\n' + "".join(
    f'{c}: &{c} [{", ".join(["*" + p] * 9)}]\n' for p, c in zip("abcdefgh", "bcdefghi"))  # 9**9 strings


def test_a_billion_laughs_is_refused_at_once_and_quoted_values_are_cut(tmp_path):
    import time

    config = tmp_path / "laughs.yaml"
    config.write_text("algorithm: {name: ppo}\nenv:\n  kwargs:\n" + "".join(f"    {line}\n" for line in LAUGHS.splitlines()))
    assert len(config.read_bytes()) < 600
    inline = "{" + ", ".join(LAUGHS.splitlines()) + "}"
    t0 = time.perf_counter()
    for source, overrides in [(config, []), (EXAMPLES / "ppo_cartpole.yaml", [f"env.kwargs={inline}"])]:
        with pytest.raises(msrl.ConfigError, match="holds more than 100,000 values once its YAML anchors and aliases") as info:
            load_config(source, overrides)
        assert info.value.key == "env.kwargs.i"
    assert time.perf_counter() - t0 < 5  # nothing was expanded
    small = load_config(EXAMPLES / "ppo_cartpole.yaml", ["env.kwargs={a: &x [1, 2], b: *x}"])  # aliases still work
    assert small.env.kwargs == {"a": [1, 2], "b": [1, 2]}

    for override in ["run.seed=" + "x" * 1_000_000, "algorithm.name=[" + "1, " * 2_000 + "1]",
                     "run={seed: [" + "[" * 50 + "]" * 50 + "]}", "env.id=gymnax:" + "x" * 3_000]:  # (an id was
        # quoted whole, three times, by the "compiling" line and the env maker's error)
        with pytest.raises(msrl.ConfigError) as info:
            load_config(EXAMPLES / "ppo_cartpole.yaml", [override])
        text = str(info.value).split("; available: ")[0]  # (the registered names: as many as tests registered)
        assert len(text) < 500 and ("…" in text or "..." in text), str(info.value)


def test_a_registered_name_is_not_taken_over_by_another_class():
    def define():
        class Mine(msrl.Algorithm):
            pass
        return Mine

    first = msrl.register_algorithm("mine_twice")(define())
    again = msrl.register_algorithm("mine_twice")(define())  # the same class, its module run again: fine
    assert msrl.registry.ALGORITHMS.get("mine_twice") is again is not first

    class Other(msrl.Algorithm):
        pass

    prefix = r"algorithm.name: 'mine_twice' is already the algorithm test_config:.*define.<locals>.Mine; register "
    with pytest.raises(msrl.ConfigError, match=prefix + "test_config:.*Other under another name"):
        msrl.register_algorithm("mine_twice")(Other)
    with pytest.raises(msrl.ConfigError, match=r"'ppo' is already the algorithm msrl.algorithms.ppo.*:PPO"):
        msrl.register_algorithm("ppo")(Other)  # an installed entry point's name
    class OtherPolicy(msrl.Policy):
        pass

    with pytest.raises(msrl.ConfigError, match=r"'fused' is already the policy msrl.policies.fused.*:Fused"):
        msrl.register_policy("fused")(OtherPolicy)
    assert msrl.registry.ALGORITHMS.get("mine_twice") is again
    assert type(load_config(None, ["algorithm.name=ppo"]).algorithm).__module__.startswith("msrl.algorithms.ppo")
    # what is not a class of its kind is refused, and stays unregistered (a later lookup found the int)
    for register, what, kind in [(msrl.register_algorithm, 42, "Algorithm"), (msrl.register_algorithm, dict, "Algorithm"),
                                 (msrl.register_policy, Other, "Policy"), (msrl.register_backend, "x", "Backend")]:
        with pytest.raises(msrl.ConfigError, match=rf"\('not_mine'\) decorates a subclass of msrl.{kind}, got "):
            register("not_mine")(what)
    assert "not_mine" not in msrl.registry.ALGORITHMS.names() + msrl.registry.POLICIES.names()


def test_a_subclass_whose_config_keeps_its_parents_name_is_refused_as_it_registers():
    from msrl.algorithms.ppo import PPO
    from msrl.policies.single_learner import SingleLearnerCoarse

    class MyPPO(PPO):  # its Config is PPO's, name: Literal["ppo"]: `algorithm.name: my_ppo` failed only at use
        pass

    with pytest.raises(msrl.ConfigError, match=r"^algorithm.name: register_algorithm\('my_ppo'\) of test_config:.*MyPPO, "
                       r"whose config's name is 'ppo': no config could select it; declare its own Config, e.g. "
                       r"`class Config\(PPO.Config\): name: Literal\['my_ppo'\] = 'my_ppo'`$"):
        msrl.register_algorithm("my_ppo")(MyPPO)

    class MyCoarse(SingleLearnerCoarse):
        pass

    with pytest.raises(msrl.ConfigError, match=r"^policy.name: .*MyCoarse, whose config's name is "
                       r"'single_learner_coarse': .* declare in it `name: Literal\['my_coarse'\] = 'my_coarse'`$"):
        msrl.register_policy("my_coarse")(MyCoarse)
    assert "my_ppo" not in msrl.registry.ALGORITHMS.names() and "my_coarse" not in msrl.registry.POLICIES.names()

    import pydantic

    class Plain(msrl.Algorithm):  # (an AttributeError deep in msrl: 'Cfg' object has no attribute 'inert')
        class Config(pydantic.BaseModel):
            name: str = "plain"

    with pytest.raises(msrl.ConfigError, match=r"its Config must subclass msrl.AlgorithmConfig"):
        msrl.register_algorithm("plain")(Plain)

    class BadDefault(msrl.Algorithm):  # (it trained until range(32.5) failed at the loop's line)
        class Config(msrl.AlgorithmConfig):
            name: Literal["bad_default"] = "bad_default"
            rollout_len: int = 32.5

    with pytest.raises(msrl.ConfigError, match=r"its Config's default rollout_len=32.5 is not a valid value of its "
                                               r"field: Input should be a valid integer"):
        msrl.register_algorithm("bad_default")(BadDefault)

    class Fixed(PPO):  # as the error says
        class Config(PPO.Config):
            name: Literal["my_ppo"] = "my_ppo"

    msrl.register_algorithm("my_ppo")(Fixed)
    assert type(load_config(None, ["algorithm.name=my_ppo"]).algorithm) is Fixed.Config


def test_an_env_prefix_is_not_taken_over_and_a_maker_must_make_an_environment():
    from msrl.envs import make_env, register_env

    def gymnax_of_mine(name, **kwargs):
        raise AssertionError("never called")

    with pytest.raises(msrl.ConfigError, match=r"^env.id: prefix 'gymnax' is already the maker msrl.envs:_gymnax; "
                                               r"register test_config:.*gymnax_of_mine under another prefix$"):
        register_env("gymnax")(gymnax_of_mine)  # (it replaced gymnax: without a word)
    assert make_env("gymnax:CartPole-v1").spec.id == "gymnax:CartPole-v1"
    for prefix in ("", "a:b", 3):
        with pytest.raises(msrl.ConfigError, match="register_env takes the prefix of ids PREFIX:NAME"):
            register_env(prefix)
    with pytest.raises(msrl.ConfigError, match=r"register_env\('numbers'\) decorates a function .*, got int"):
        register_env("numbers")(42)

    import gymnasium

    @register_env("test_config_makers")
    def maker(name, **kwargs):
        return None if name == "none" else gymnasium.make("CartPole-v1", **kwargs)

    with pytest.raises(msrl.ConfigError, match=r"^env.id: test_config:.*maker made test_config_makers:none as "
                                               r"NoneType, not an msrl.Environment$"):
        make_env("test_config_makers:none")
    with pytest.raises(msrl.ConfigError, match=r"made test_config_makers:cartpole as a gymnasium.Env: a Gymnasium env "
                                               r"of your own takes a gymnasium: id"):
        make_env("test_config_makers:cartpole")  # (PPO said: 'EnvSpec' object has no attribute 'discrete')
    with pytest.raises(msrl.ConfigError, match=r"^env.kwargs: test_config:.*maker \(test_config_makers:cartpole with "
                                               r"\{'bogus': 1\}\) raised TypeError: .*bogus"):
        make_env("test_config_makers:cartpole", bogus=1)


def test_a_plugin_registering_the_name_of_its_own_entry_point_loads(tmp_path):
    """An installed plug-in may both declare an entry point and decorate its class with the same name: loading
    it through the entry point runs the decorator while its module is half imported (a fresh process, a real
    dist-info on its path)."""
    (tmp_path / "plugin_both_ways.py").write_text(
        "import msrl\n\n@msrl.register_algorithm('both_ways')\nclass BothWays(msrl.Algorithm):\n    pass\n")
    info = tmp_path / "plugin_both_ways-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: plugin-both-ways\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[msrl.algorithms]\nboth_ways = plugin_both_ways:BothWays\n")
    code = "from msrl.registry import ALGORITHMS; c = ALGORITHMS.get('both_ways'); print(c.__module__, c.__name__)"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert (done.returncode, done.stdout) == (0, "plugin_both_ways BothWays\n"), done.stderr[-2000:]


@pytest.mark.parametrize("config", [[1, 2], 42])
def test_a_config_of_another_type_is_a_config_error(tmp_path, config):
    """(It was pathlib's bare TypeError.) The same for msrl.load's run directory."""
    with pytest.raises(msrl.ConfigError, match=rf"a config is a YAML file's path or a dict of its sections, got "
                                               rf"{type(config).__name__}"):
        msrl.train(config, run_dir=tmp_path / "run")
    with pytest.raises(msrl.ConfigError, match=r"run_dir: a run directory's path, got NoneType None"):
        msrl.load(None)


def test_the_submodules_a_users_code_names_are_reached_from_import_msrl_alone():
    """(`import msrl` then `msrl.rl.Dense`, as the README writes it, was an AttributeError in a fresh process.)"""
    import subprocess
    import sys

    code = "import msrl; print(msrl.rl.Dense.__name__, msrl.envs.register_env.__name__, msrl.replay.UniformBuffer.__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert out.stdout.split() == ["Dense", "register_env", "UniformBuffer"], out.stderr[-2000:]


@pytest.mark.parametrize("example, schedule", [("ppo_cartpole", "every 512 env steps, 16 each"),
                                               ("a2c_cartpole", "every 40 env steps, 1 each"),
                                               ("impala_cartpole", "every 64 env steps, 1 each"),
                                               ("dqn_cartpole", "every 8 env steps, 2 each")])
def test_a_run_too_long_for_a_schedules_int32_counter_is_refused(example, schedule):
    """An annealed learning rate (or an exploration schedule) counts its steps in int32: past 2**31 - 1 the count
    stops (optax saturates it) and the schedule with it. (PPO checked only one update's epochs x minibatches: a run
    of 10**15 env steps was accepted, its annealing to stop after 2**31 optimizer steps.)"""
    with pytest.raises(msrl.ConfigError, match=rf"^run.total_env_steps: 1,000,000,000,000,000 env steps make [\d,]+ "
                                               rf"steps of a schedule \({schedule}\), more than an int32 counter"):
        msrl.build(load_config(EXAMPLES / f"{example}.yaml", ["run.total_env_steps=1000000000000000"]))


@msrl.register_algorithm("no_config_of_its_own")
class _NoConfigOfItsOwn(msrl.Algorithm):
    """(Config left as msrl.AlgorithmConfig: a config's keys for it were "unknown key; allowed keys: name".)"""


@msrl.register_algorithm("no_super_init")
class _NoSuperInit(msrl.Algorithm):
    """(Its loop's first use of self.cfg was "the loop bound could not be evaluated ... no attribute 'cfg'".)"""

    def __init__(self, cfg, ctx):
        self.rollout_len = 4


def test_an_algorithm_without_a_config_of_its_own_or_super_init_says_so():
    import inspect

    with pytest.raises(msrl.ConfigError, match=r"^algorithm.lr: _NoConfigOfItsOwn sets no Config of its own, so name "
                                               r"is its only key: give it one"):
        load_config(None, ["algorithm.name=no_config_of_its_own", "algorithm.lr=0.1"])
    with pytest.raises(msrl.CompileError, match=r"_NoSuperInit.__init__ never calls super\(\).__init__\(cfg, ctx\)") \
            as info:
        msrl.build(load_config(None, ["algorithm.name=no_super_init"]))
    assert (info.value.file, info.value.line) == (__file__, inspect.getsourcelines(_NoSuperInit)[1])


def test_an_algorithm_of_ones_own_with_nested_models_is_checked_and_noted_key_by_key(tmp_path, capsys):
    """A plug-in's config of nested pydantic models: a typo in one is refused (pydantic's default ignored it and
    left the key at its default), an error quotes the key's own description (not its parent's), and a nested key in
    ``inert()`` is noted when set (it was an AttributeError traceback out of ``msrl train``)."""
    from pydantic import BaseModel, Field

    from msrl.algorithms.ppo import PPO, PPOConfig

    class Schedule(BaseModel):
        kind: Literal["constant", "linear"] = "constant"
        warmup: int = Field(0, ge=0, description="warm-up updates")

    class Optim(BaseModel):
        lr: float = Field(1e-3, gt=0, description="Adam's learning rate")
        schedule: Schedule = Field(default_factory=Schedule, description="the schedule")

    class NestedConfig(PPOConfig):
        name: Literal["nested_ppo"] = "nested_ppo"
        optim: Optim = Field(default_factory=Optim, description="the optimizer")
        slip: str = "optim.schedule.warmup"  # (what inert() names: a key of a test below names none)

        def inert(self):
            return {self.slip: "algorithm.optim.schedule.kind=linear"}

    @msrl.register_algorithm("nested_ppo")
    class NestedPPO(PPO):
        Config = NestedConfig

    base = EXAMPLES / "ppo_cartpole.yaml"
    with pytest.raises(ConfigError, match=r"^algorithm.optim.lrr: unknown key; did you mean 'lr'\? allowed keys: lr, "
                                          r"schedule$"):
        load_config(base, ["algorithm.name=nested_ppo", "algorithm.optim.lrr=5"])
    with pytest.raises(ConfigError, match=r"^algorithm.optim.schedule.warmupp: unknown key; did you mean 'warmup'"):
        load_config(base, ["algorithm.name=nested_ppo", "algorithm.optim.schedule.warmupp=5"])
    with pytest.raises(ConfigError, match=r"^algorithm.optim.lr: Input should be greater than 0 \(got -1\) — Adam's "
                                          r"learning rate$"):
        load_config(base, ["algorithm.name=nested_ppo", "algorithm.optim.lr=-1"])
    run = ["algorithm.name=nested_ppo", "algorithm.optim.schedule.warmup=5", "run.total_env_steps=512",
           "run.progress=false", "run.tensorboard=false", "run.checkpoint_every_steps=0"]
    msrl.train(base, run, run_dir=tmp_path / "a")
    assert ("msrl: note: algorithm.optim.schedule.warmup only applies with algorithm.optim.schedule.kind=linear; "
            "ignored here\n") in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"^algorithm.optim.warm: .*NestedConfig.inert\(\) names it, but it is not a "
                                          r"key of algorithm nested_ppo$"):
        msrl.train(base, [*run, "algorithm.slip=optim.warm"], run_dir=tmp_path / "b")


def test_a_bad_value_in_ones_yaml_names_its_file_and_line(tmp_path):
    """(It named the key alone: with a file and overrides, which of them was wrong?) A key an override sets is the
    override's: no line."""
    path = tmp_path / "mine.yaml"
    path.write_text("algorithm:\n  name: ppo\n  epochs: four\n  hidden: [64, x]\nenv:\n  id: gymnax:CartPole-v1\n"
                    "policy:\n  name: fused\n  actors: 2\n")
    with pytest.raises(ConfigError, match=rf"^algorithm.epochs: {path}:3: Input should be a valid integer"):
        load_config(path)
    with pytest.raises(ConfigError, match=rf"^algorithm.hidden.1: {path}:4: Input should be a valid integer"):
        load_config(path, ["algorithm.epochs=4"])
    with pytest.raises(ConfigError, match=rf"^policy.actors: {path}:9: unknown key; allowed keys: name, backend \(a "
                                          r"key of policy.name (.*, )?replay_server, single_learner_coarse or "
                                          r"single_learner_fine\)$"):  # (whose key it is; a test's own policies too)
        load_config(path, ["algorithm.epochs=4", "algorithm.hidden=[64]"])
    with pytest.raises(ConfigError, match=r"^algorithm.epochs: Input should be a valid integer.*\(got 'five'\)"):
        load_config(path, ["algorithm.epochs=five"])


def test_what_the_environment_or_algorithm_refuses_names_the_line_of_ones_yaml(tmp_path):
    """(The env's own checks ran after the file was read, and named the key alone.) A gymnax parameter's typo is
    named with the closest one before the env is made."""
    path = tmp_path / "env.yaml"
    path.write_text("algorithm:\n  name: ppo\nenv:\n  id: gymnax:CartPole-v1\n  kwargs:\n    max_steps_in_episod: 3\n")
    with pytest.raises(ConfigError, match=rf"^env.kwargs.max_steps_in_episod: {path}:6: gymnax:CartPole-v1 takes no "
                                          r"parameter 'max_steps_in_episod'; did you mean 'max_steps_in_episode'\? "):
        msrl.train(path, run_dir=tmp_path / "run")
    with pytest.raises(ConfigError, match=r"^env.id: 'gymnax:CartPol-v1' is not"):  # (an override's: no line)
        msrl.train(path, ["env.id=gymnax:CartPol-v1"], run_dir=tmp_path / "run")
    path.write_text("algorithm:\n  name: sac\nenv:\n  id: gymnax:CartPole-v1\n")
    with pytest.raises(ConfigError, match=rf"^algorithm.name: {path}:2: SAC needs one agent with continuous.*as in "
                                          r"examples/sac_pendulum.yaml\)"):
        msrl.train(path, run_dir=tmp_path / "run")
    with pytest.raises(ConfigError, match=r"^algorithm.name: TD3 needs .*as in examples/td3_pendulum.yaml\)"):
        msrl.train(path, ["algorithm.name=td3"], run_dir=tmp_path / "run")  # (it said sac_...)
    path.write_text("algorithm:\n  name: sac\nenv:\n  id: gymnax:Pendulum-v1\n")
    with pytest.raises(ConfigError, match=r"^env.id: SAC needs one agent with continuous"):  # (the override, not the
        msrl.train(path, ["env.id=gymnax:CartPole-v1"], run_dir=tmp_path / "run")  # algorithm's line: 2)
    path.write_text("algorithm:\n  name: ppo\nenv:\n  id: gymnax:CartPole-v1\n")
    with pytest.raises(ConfigError, match=r"^algorithm.name: gymnax:CartPole-v1 is a single-agent environment; MAPPO"):
        msrl.train(path, ["algorithm.name=mappo"], run_dir=tmp_path / "run")  # (it named env.id at line 4)
    assert not (tmp_path / "run").exists()
