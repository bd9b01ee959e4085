"""threads backend, single_learner_coarse / single_learner_fine, Gymnasium host envs, equivalence."""

from __future__ import annotations

import json
import logging
import re
import threading

import jax
import numpy as np
import pytest

import msrl
from msrl.cli import main
from msrl.config import load_config
from msrl.envs import make_env
from msrl.envs.gymnax_env import GymnaxEnv

import loops
from helpers import CARTPOLE, EXAMPLES, UsersEnv, assert_reaches, reached, final_params, max_diff

@pytest.mark.parametrize("unroll", [None, "8"])  # unset: none on CPU; 8: as on an accelerator
def test_fused_coarse_and_fine_give_the_same_parameters(monkeypatch, unroll):
    monkeypatch.setenv("MSRL_SCAN_UNROLL", unroll) if unroll else monkeypatch.delenv("MSRL_SCAN_UNROLL", raising=False)
    short = ["algorithm.rollout_len=16"]  # (fine goes to the actors every env step)
    fused, fused_rows = final_params([*short, "env.num_envs=8"])
    coarse, coarse_rows = final_params([*short, "policy.name=single_learner_coarse", "policy.actors=2",
                                        "policy.envs_per_actor=4"])
    fine, fine_rows = final_params([*short, "policy.name=single_learner_fine", "policy.actors=2",
                                    "policy.envs_per_actor=4"])
    assert max_diff(fused, coarse) == 0.0  # bitwise: acting on 4 envs rounds as on 8 (msrl.rl.Dense)
    assert max_diff(fused, fine) == 0.0
    # the parameters moved, and the runs saw the same episodes
    assert max_diff(fused, jax.tree.map(np.zeros_like, fused)) > 1e-3
    assert [r["episodes"] for r in fused_rows] == [r["episodes"] for r in coarse_rows] == \
        [r["episodes"] for r in fine_rows] and fused_rows[-1]["episodes"] > 0


def test_the_replicas_of_a_program_compile_each_init_once(caplog):
    """8 actors on threads, started together, compiled the env's and the actor's init 8 times each (Brax's
    ant: 2 s each); the replicas of a program in one process share one compiled init per component and shape."""
    was = jax.config.jax_log_compiles
    jax.config.update("jax_log_compiles", True)
    try:
        with caplog.at_level(logging.WARNING):
            final_params(["policy.name=single_learner_coarse", "policy.actors=8", "policy.envs_per_actor=1",
                          "algorithm.rollout_len=4"], 1)
    finally:
        jax.config.update("jax_log_compiles", was)
    inits = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Compiling jit(init)")]
    assert 3 <= len(inits) <= 4, inits  # env, actor, learner (and the buffer's, where the loop has one)


@pytest.mark.parametrize("policy, cut_op, roles", [
    ("single_learner_coarse", "gather", {"actor": 2, "learner": 1}),
    ("single_learner_fine", "scatter", {"env_worker": 2, "central": 1}),
])
def test_graph_shows_cut_comm_nodes_and_replicas(capsys, policy, cut_op, roles):
    assert main(["graph", CARTPOLE, f"policy.name={policy}", "policy.actors=2", "--format", "json"]) == 0
    g = json.loads(capsys.readouterr().out)
    assert {f["name"]: f["replicas"] for f in g["fragments"]} == roles
    comm = [n for n in g["nodes"] if n["kind"] == "comm"]
    assert any(n["op"] == cut_op for n in comm)
    assert any(n["op"] == "broadcast" for n in comm) or policy == "single_learner_fine"
    by_id = {n["id"]: n for n in g["nodes"]}
    for e in g["edges"]:  # every edge stays inside a fragment or passes through a comm node
        src, dst = by_id[e["src"]], by_id[e["dst"]]
        if "comm" not in (src["kind"], dst["kind"]) and "loop" not in (src["kind"], dst["kind"]):
            assert src["fragment"] == dst["fragment"], e
    assert main(["graph", CARTPOLE, f"policy.name={policy}", "policy.actors=2"]) == 0
    text = capsys.readouterr().out
    assert f"COMM {cut_op}" in text and "replicas=2" in text


def test_fine_policy_communicates_every_step():
    program = msrl.build(load_config(CARTPOLE, ["policy.name=single_learner_fine", "policy.actors=2"]))
    per_step = [c for c in program.plan.comms if program.fdg.nodes[c.point]["parent"] is not None]
    assert {c.op for c in per_step} == {"scatter", "gather"}
    assert "for _ in range(0, 128, 1)" in program.fragments["env_worker"].source


def test_gymnasium_env_under_fused_is_a_compile_error():
    with pytest.raises(msrl.CompileError, match="single_learner_coarse") as info:
        msrl.build(load_config(CARTPOLE, ["env.id=gymnasium:CartPole-v1"]))
    assert "host" in str(info.value)


def test_host_env_on_a_jax_placed_role_is_a_compile_error():
    with pytest.raises(msrl.CompileError, match="jax backend"):
        msrl.build(load_config(EXAMPLES / "ppo_cartpole_threads.yaml", ["policy.actor_backend=jax"]))


@pytest.mark.parametrize("marker", sorted(loops.MIXING))
def test_a_statement_mixing_environments_is_refused_where_replicas_hold_a_share(marker):
    """Actors that each hold a share of the environments would compute a mean, a slice, position-drawn noise or
    a count over their share only: refused at the statement, not run differently."""
    from msrl.policies.single_learner import SingleLearnerCoarse

    loop, reason = loops.MIXING[marker]
    with pytest.raises(msrl.CompileError, match=reason) as info:
        msrl.compile(loop(), SingleLearnerCoarse(actors=2), make_env("gymnax:CartPole-v1"), 4)
    assert (info.value.file, info.value.line) == (loops.__file__, loops.marked_line(marker))
    msrl.compile(loop(), SingleLearnerCoarse(actors=1), make_env("gymnax:CartPole-v1"), 4)  # one actor sees all


def test_an_error_at_run_time_in_a_method_the_loop_calls_names_the_replica_the_statement_and_its_line():
    from msrl.policies.single_learner import SingleLearnerCoarse

    loop = loops.LearnerRaises()
    loop.learner.armed = False
    program = msrl.compile(loop, SingleLearnerCoarse(actors=2), make_env("gymnax:CartPole-v1"), 4)
    program.learner.armed = True  # (the program's own learner) the learner fragment traces it when it first runs
    with pytest.raises(msrl.TrainingError) as info, msrl.Session(program=program, seed=0) as session:
        session.run(1)
    assert f"fragment 'learner' replica 0 failed at {loops.__file__}:{loops.marked_line('calls_learner')} `return " \
           f"msrl.agent_learn(msrl.buffer_get())  # E:calls_learner`, in learn() at {loops.__file__}:" \
           f"{loops.marked_line('learner_raises')}: ValueError: the learner's own bug" in str(info.value)


def test_replay_server_actors_mixing_environments_are_refused_too():
    from msrl.policies.replay_server import ReplayServer

    with pytest.raises(msrl.CompileError, match="2 'replay' replicas.*reduces over the environment axis") as info:
        msrl.compile(loops.MixesBeforeReplay(), ReplayServer(actors=2, shards=2), make_env("gymnax:CartPole-v1"), 4)
    assert (info.value.file, info.value.line) == (loops.__file__, loops.marked_line("mix_replay"))
    # the insert's item is built where the buffer is: one shard holds every environment's rows, as fused does
    from msrl.policies.fused import Fused

    fused, replay = (_final_w(loops.MixesBeforeReplay(), p) for p in (Fused(), ReplayServer(actors=2, shards=1)))
    assert fused == replay and fused != 0.0


def _final_w(loop, policy, env: msrl.Environment | None = None) -> float:
    """The learner's parameter after 3 iterations of ``loop`` under ``policy`` (4 CartPole envs, seed 0)."""
    program = msrl.compile(loop, policy, env or make_env("gymnax:CartPole-v1"), 4)
    with msrl.Session(program=program, seed=0, iterations_per_dispatch=3) as session:
        session.run(3)
        return float(session.params()["w"])


@pytest.mark.parametrize("mix, reason", [
    ("mean", (r"steps each of its 2 'actor' replicas' 2 of the 4 environments alone, but UsersEnv.step\(\) \(.*"
              r"helpers.py:\d+\), called here, reduces over the environment axis")),
    ("shared_key", "UsersEnv.step.*takes some environments' rows"),
    ("position", (r"initializes the env on each of its 2 replicas .* UsersEnv.init\(\) .* numbers the environments "
                  "by their position"))])
def test_a_users_jitted_env_mixing_environments_is_refused_where_replicas_hold_a_share(mix, reason):
    """Its step (or init) is traced at two environment counts as a loop statement is: refused at the loop's
    env_step (or first env call), not run differently; one actor, which holds every environment, runs it."""
    from msrl.policies.single_learner import SingleLearnerCoarse

    with pytest.raises(msrl.CompileError, match=reason) as info:
        msrl.compile(loops.Simple(), SingleLearnerCoarse(actors=2), UsersEnv(mix), 4)
    assert info.value.file == loops.__file__
    assert ("set the env's `rowwise = True`" in info.value.hint) == (mix != "position")
    msrl.compile(loops.Simple(), SingleLearnerCoarse(actors=1), UsersEnv(mix), 4)


def test_a_users_jitted_env_with_a_nan_constant_is_not_taken_for_one_mixing_environments():
    """The row check compares the constants of the env traced at two environment counts: NaN equals NaN there
    (it was refused as 'a number that depends on how many environments a replica holds')."""
    from msrl.policies.single_learner import SingleLearnerCoarse

    msrl.compile(loops.Simple(), SingleLearnerCoarse(actors=2), UsersEnv("nan_constant"), 4)


class MaxRewardCartPole(GymnaxEnv):
    """A user's subclass of msrl's gymnax adapter (vouched rowwise) whose step adds the max over environments."""

    def step(self, state, action):
        state, out = super().step(state, action)
        return state, msrl.EnvStep(out.obs, out.reward + jax.numpy.abs(out.obs[:, 0]).max(), out.terminated,
                                   out.truncated)


def test_a_users_subclass_of_an_adapter_that_overrides_step_is_checked_again():
    from msrl.policies.single_learner import SingleLearnerCoarse

    with pytest.raises(msrl.CompileError, match=r"MaxRewardCartPole.step\(\) .* reduces over the environment axis"):
        msrl.compile(loops.Simple(), SingleLearnerCoarse(actors=2), MaxRewardCartPole("CartPole-v1"), 4)
    msrl.compile(loops.Simple(), SingleLearnerCoarse(actors=2), make_env("gymnax:CartPole-v1"), 4)


class Wrapped(msrl.Wrapper):
    """A user's wrapper around msrl's gymnax adapter: its rewards scaled, or with the max over environments."""

    def __init__(self, mix: bool = False):
        super().__init__(make_env("gymnax:CartPole-v1"))
        self.mix = mix

    def step(self, state, action):
        state, out = self.env.step(state, action)
        reward = out.reward + jax.numpy.abs(out.obs[:, 0]).max() if self.mix else 0.5 * out.reward
        return state, msrl.EnvStep(out.obs, reward, out.terminated, out.truncated, out.final_obs)


def test_a_users_wrapper_of_an_adapter_is_checked_by_its_own_code_alone():
    """The adapter it wraps is taken on msrl's word (its own `done.any()` cond made every wrapper 'reduce over the
    environment axis', the wrapper named for it); the wrapper's own code is still checked."""
    from msrl.policies.fused import Fused
    from msrl.policies.single_learner import SingleLearnerCoarse

    fused, coarse = (_final_w(loops.Simple(), p, Wrapped()) for p in (Fused(), SingleLearnerCoarse(actors=2)))
    assert fused == coarse and fused != 0.0
    with pytest.raises(msrl.CompileError, match=r"Wrapped.step\(\) \(.*test_threads.py:\d+\), called here, reduces "
                                                r"over the environment axis"):
        msrl.compile(loops.Simple(), SingleLearnerCoarse(actors=2), Wrapped(mix=True), 4)
    assert "step" not in vars(Wrapped().env)  # (the trust lasts the check only)


def test_a_users_jitted_env_that_keeps_to_its_rows_runs_on_actors_as_under_fused():
    from msrl.policies.fused import Fused
    from msrl.policies.single_learner import SingleLearnerCoarse

    fused, coarse = (_final_w(loops.Simple(), p, UsersEnv()) for p in (Fused(), SingleLearnerCoarse(actors=2)))
    assert fused == coarse and fused != 0.0


def test_per_environment_statements_on_actors_equal_fused():
    from msrl.policies.fused import Fused
    from msrl.policies.single_learner import SingleLearnerCoarse

    fused, coarse = (_final_w(loops.PerEnvRows(), p) for p in (Fused(), SingleLearnerCoarse(actors=2)))
    assert fused == coarse and fused != 0.0


def test_gymnasium_env_seeds_depend_on_global_index_only():
    env = make_env("gymnasium:CartPole-v1")
    key = jax.random.PRNGKey(3)
    full, part = env.init(key, np.arange(4)), env.init(key, np.array([2, 3]))
    np.testing.assert_array_equal(full.obs[2:], part.obs)
    actions = np.array([0, 1, 1, 0])
    for _ in range(30):
        full, (obs_f, rew_f, done_f) = env.step(full, actions)
        part, (obs_p, rew_p, done_p) = env.step(part, actions[2:])
        np.testing.assert_array_equal(obs_f[2:], obs_p)
    assert env.stats(full)["episodes"] >= 1


def test_worker_error_surfaces_with_its_traceback_and_no_thread_is_left():
    from msrl.policies.single_learner import SingleLearnerCoarse

    program = msrl.compile(loops.Simple(), SingleLearnerCoarse(actors=2), make_env("gymnasium:MsrlShifty-v0", mode="explode"), 4)
    with msrl.Session(program=program, seed=0, iterations_per_dispatch=20) as session:
        assert session.program.policy.backend == "threads"
        with pytest.raises(msrl.TrainingError, match="environment exploded on purpose") as info:
            session.run(20)
        assert "fragment 'actor'" in str(info.value) and re.search(r"its traceback:\n  File .*loops.py", str(info.value))
        # it does not run on (its replicas were stopped: it ran "iterations" that trained nothing, without a word)
        with pytest.raises(msrl.TrainingError, match=r"^this session stopped at a failure after iteration (\d+); "
                                                     r"snapshot\(\) and params\(\) read its replicas' states after "
                                                     r"iteration \1, which Session.restore\(\) puts into a new "
                                                     r"session; start a new session \(or resume the run from its "
                                                     r"checkpoint\)$"):
            session.run(1)
        assert "stopped by a failure" in repr(session) and session.snapshot().iteration == session.iteration > 0
        with msrl.Session(program=program, seed=0) as again:  # the replicas stopped after one iteration: it goes on
            again.restore(session.snapshot())
            assert again.iteration == session.iteration
    assert not [t for t in threading.enumerate() if t.name.startswith("msrl-") and t.is_alive()]


def test_ppo_gymnasium_cartpole_threads_reaches_475(tmp_path):
    summary = msrl.train(EXAMPLES / "ppo_cartpole_threads.yaml", ["run.progress=false"], run_dir=tmp_path,
                         on_iteration=reached(475))
    assert summary["env_steps"] <= 300_000 and summary["policy"] == "single_learner_coarse"
    assert_reaches(tmp_path, 475, within=300_000)


@pytest.mark.parametrize("env_id", ["gymnax:CartPole-v1", "gymnasium:CartPole-v1"])
def test_host_loop_details_match_fused(env_id):
    """Conditional assignments, keyword inserts and a loop without return, on jitted and host envs."""
    from msrl.policies.fused import Fused
    from msrl.policies.single_learner import SingleLearnerCoarse

    env = make_env(env_id)
    program = msrl.compile(loops.HostLoopDetails(), SingleLearnerCoarse(actors=2), env, 4)
    with msrl.Session(program=program, seed=0, iterations_per_dispatch=2) as session:
        assert session.program.policy.backend == "threads"
        rows = session.run(2)
        assert len(rows) == 2 and "episode_return" in rows[0]
        w = float(session.params()["w"])
    if env.jittable:
        fused = msrl.compile(loops.HostLoopDetails(), Fused(), env, 4)
        with msrl.Session(program=fused, seed=0, iterations_per_dispatch=2) as session:
            assert session.program.policy.backend == "jax"
            session.run(2)
            assert w == pytest.approx(float(session.params()["w"]), rel=1e-6)
    else:
        assert w == pytest.approx(2.0)  # CartPole pays 1 per step: mean reward 1, two updates


@pytest.mark.parametrize("config, overrides, dict_only", [
    (CARTPOLE, ["policy.name=single_learner_coarse", "policy.sync=false", "policy.actors=2", "env.num_envs=4",
                "algorithm.rollout_len=8", "algorithm.epochs=50", "algorithm.minibatches=4"], False),
    (EXAMPLES / "dqn_replay_server.yaml", ["policy.param_sync_every=3", "algorithm.learning_starts=8",
                                           "algorithm.eps_start=0.0", "algorithm.eps_end=0.0",
                                           "algorithm.batch_size=32", "algorithm.hidden=[16]", "env.num_envs=4"], True)])
def test_a_snapshot_restored_into_a_session_that_ran_goes_on_as_in_a_fresh_session(config, overrides, dict_only):
    """Another seed's snapshot restored into a session that ran on: the same numbers as restored into a fresh one,
    also as a plain dict (which continues at the session's own iteration). (sync: false: the used session's last
    parameter message, sent for the iteration after, stayed in the actors' mailboxes and one acted on it;
    param_sync_every=3: a plain dict's restore kept the old parameters until the next pull.)"""
    overrides = [*overrides, "run.total_env_steps=100000"]
    with msrl.Session(config, [*overrides, "run.seed=1"]) as other:
        other.run(4)  # (not a multiple of param_sync_every: the next iterations pull no parameters)
        snap = other.snapshot()
    with msrl.Session(config, overrides) as fresh:
        fresh.run(4)  # (to the snapshot's iteration: a plain dict goes on from the session's own)
        fresh.restore(snap)
        fresh.run(4)
        expected = fresh.params()
    with msrl.Session(config, overrides) as used:
        used.run(4 if dict_only else 6)  # (its last message to the actors: for iteration 6)
        used.restore(dict(snap)) if dict_only else used.restore(snap)
        used.run(4)  # (an actor acting on stale parameters in iteration 6 shows in the learner's after 7)
        assert max_diff(used.params(), expected) == 0.0


def test_a_closed_session_and_another_programs_snapshot_are_clear_errors():
    small = ["algorithm.rollout_len=8", "env.num_envs=4", "policy.actors=2"]
    with msrl.Session(CARTPOLE, [*small, "policy.name=single_learner_coarse", "policy.backend=threads"]) as session:
        session.run(1)
        snap = session.snapshot()
    for use in (lambda: session.run(1), session.params, session.snapshot, lambda: session.restore(snap)):
        with pytest.raises(msrl.TrainingError, match="this session is closed"):
            use()
    with msrl.Session(CARTPOLE, [*small, "policy.name=single_learner_coarse", "policy.backend=threads",
                                 "algorithm.hidden=[8]"]) as other:
        with pytest.raises(msrl.ConfigError, match=r"'actor' replica 0's 'params' state differs in structure, "
                                                   r"shapes or dtypes from this program's"):
            other.restore(snap)
        with pytest.raises(msrl.ConfigError, match=r"holds fragment 'main' \(1 replica\); this program's are "
                                                   r"'actor' \(2\), 'learner' \(1\)"):
            other.restore({"main": [{}]})
        with pytest.raises(msrl.ConfigError, match=r"holds no fragment 'actor'; this program's fragments \(replicas\) "
                                                   r"are 'actor' \(2\), 'learner' \(1\)$"):
            other.restore({})  # (was a KeyError)
        with pytest.raises(msrl.ConfigError, match=r"'actor' replica 0 must be a dict of component -> state, got "
                                                   r"NoneType$"):
            other.restore({"actor": [None, None], "learner": [{}]})  # (was an AttributeError)
        other.restore(other.snapshot())  # its own: accepted


def test_the_params_of_a_loop_that_never_learns_are_a_clear_error():
    from msrl.policies.fused import Fused

    with msrl.Session(program=msrl.compile(loops.ActsOnly(), Fused(), make_env("gymnax:CartPole-v1"), 4), seed=0) as s:
        assert s.run(2)[-1]["acted"] == 1.0
        with pytest.raises(msrl.CompileError, match=r"ActsOnly.train_step never calls msrl.agent_learn"):
            s.params()

def test_a_host_env_placed_on_jax_is_refused_with_the_key_that_placed_it():
    threads = EXAMPLES / "ppo_cartpole_threads.yaml"
    with pytest.raises(msrl.CompileError, match="hint: policy.actor_backend=jax places it there: leave policy"):
        msrl.build(load_config(threads, ["policy.actor_backend=jax"]))
    with pytest.raises(msrl.CompileError, match="hint: use policy.name=single_learner_coarse .*policy.backend=threads"):
        msrl.build(load_config(threads, ["policy.name=fused"]))


def test_a_session_dropped_without_close_ends_its_replicas_when_collected_and_says_what_it_is():
    """(Its env worker processes, or a private Ray cluster, stayed until the process exited.)"""
    import gc

    import psutil

    session = msrl.Session(CARTPOLE, ["algorithm.rollout_len=8", "env.num_envs=4", "env.id=gymnasium:CartPole-v1",
                                      "env.subprocesses=1", "policy.name=single_learner_coarse", "policy.actors=2"])
    session.run(1)
    assert repr(session) == "<msrl.Session PPO under single_learner_coarse (threads), after iteration 1, open>"
    workers = [p for p in psutil.Process().children() if "gym_worker" in " ".join(p.cmdline())]
    assert len(workers) == 2
    del session
    gc.collect()
    assert not [p for p in workers if p.is_running()]  # (ended and reaped: they were zombies until the exit)
