"""Compiler: front end, FDG, partition, lowering. Real gymnax envs, real jit."""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import msrl
from msrl.compiler.ir import leaves
from msrl.envs import make_env
from msrl.policies.fused import Fused
from msrl.policy import FragmentSpec, Policy

import loops

NUM_ENVS = 3
A2C_CARTPOLE = Path(__file__).resolve().parent.parent / "examples" / "a2c_cartpole.yaml"


@pytest.fixture(scope="module")
def env():
    return make_env("gymnax:CartPole-v1")


class Eager(Policy):
    """One fragment lowered to plain Python loops (not jitted): the reference semantics."""

    name: Literal["eager"] = "eager"

    def fragments(self):
        return [FragmentSpec(name="main", jit=False)]

    def assign(self, loop):
        return loop.roles(lambda s: "main")


class ActorsLearner(Policy):
    """Cut at agent_learn: two actor replicas and one learner, host fragments."""

    name: Literal["actors_learner"] = "actors_learner"

    def fragments(self):
        return [FragmentSpec(name="actors", replicas=2, jit=False), FragmentSpec(name="learner", jit=False)]

    def assign(self, loop):
        learner = loop.calls("agent_learn")
        return loop.roles(lambda s: "learner" if s.kind == "return" or s.id in learner else "actors")


class SplitEnv(ActorsLearner):
    """A bad policy: env_observe and env_step in different fragments."""

    name: Literal["split_env"] = "split_env"

    def assign(self, loop):
        return {**super().assign(loop), **dict.fromkeys(loop.calls("env_observe"), "learner")}


def fused_vs_eager(alg_cls, env, iterations=2):
    """Run the same loop jitted (lax.scan) and eagerly (Python loops); return both final states."""
    jit_prog = msrl.compile(alg_cls(), Fused(), env, NUM_ENVS)
    with msrl.Session(program=jit_prog, seed=0, iterations_per_dispatch=iterations) as session:
        rows = session.run(iterations)
        (jit_state,) = session.snapshot()["main"]
    eager_prog = msrl.compile(alg_cls(), Eager(), env, NUM_ENVS)
    frag = eager_prog.fragments["main"]
    state = eager_prog.init_states(frag.state_keys, 0, jnp.arange(NUM_ENVS))
    results = []
    for _ in range(iterations):
        state, result = eager_prog.run_fragment(frag, state)
        results.append(result)
    return jit_prog, jit_state, rows, state, results


def assert_trees_close(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-6)


def test_simple_loop_scan_matches_python(env):
    prog, jit_state, rows, eager_state, results = fused_vs_eager(loops.Simple, env)
    assert prog.env_steps_per_iteration == 3 * NUM_ENVS
    assert_trees_close(jit_state, eager_state)
    assert rows[-1]["w"] == pytest.approx(float(results[-1]["w"]))
    assert float(jit_state["learner"]["updates"]) == 2
    src = prog.fragments["main"].source
    assert "_msrl_scan(" in src and "for " not in src  # the loop became lax.scan


def test_nested_loops_statements_unpacking_static_if(env):
    prog, jit_state, rows, eager_state, results = fused_vs_eager(loops.Nested, env)
    assert prog.env_steps_per_iteration == 3 * 2 * NUM_ENVS
    assert_trees_close(jit_state, eager_state)
    for key in ("w", "total", "last", "i"):
        assert rows[-1][key] == pytest.approx(float(results[-1][key]), rel=1e-6)
    assert rows[-1]["i"] == 2.0  # the loop variable keeps its last value after the loop
    assert rows[-1]["doubled"] == pytest.approx(2 * rows[-1]["total"])
    src = prog.fragments["main"].source
    assert src.count("_msrl_scan(") == 2  # both loops became scans
    assert "last_reward = _msrl_zeros('last_reward')" in src  # first assigned inside the loop
    # the learner got the extra keyword through the API call
    assert "bonus=total" in src


def test_metrics_of_plain_python_numbers_first_assigned_in_a_loop(env):
    """The carry of a value first assigned in a scanned loop starts from zeros of its shape: a plain Python
    number's too (it was an AttributeError, 'bool' object has no attribute 'shape', under fused only)."""
    prog, jit_state, rows, eager_state, results = fused_vs_eager(loops.LearnsInALoop, env)
    assert_trees_close(jit_state, eager_state)
    assert {k: rows[-1][k] for k in ("inner", "on", "hint")} == {"inner": 2.0, "on": 1.0, "hint": 0.5}
    assert rows[-1]["w"] == pytest.approx(float(results[-1]["w"]))


def test_a_function_defined_in_a_scanned_loop_may_fill_its_own_list(env):
    prog, jit_state, rows, eager_state, results = fused_vs_eager(loops.FillsInAFunctionOfItsOwn, env)
    assert rows[-1]["total"] == pytest.approx(float(results[-1]["total"]))
    assert "_msrl_scan(" in prog.fragments["main"].source


def test_helper_methods_are_inlined(env):
    prog, jit_state, rows, eager_state, results = fused_vs_eager(loops.Helpers, env)
    assert prog.env_steps_per_iteration == 3 * NUM_ENVS
    assert_trees_close(jit_state, eager_state)
    src = prog.fragments["main"].source
    assert "self.shape_reward(" in src  # helper without API calls stays a call
    assert "self.collect" not in src  # helper with API calls is inlined
    apis = [s.api.name for s in leaves(prog.stmts) if s.kind == "api"]
    assert apis == ["env_observe", "agent_act", "env_step", "buffer_insert", "buffer_get", "agent_learn"]


def test_fdg_has_api_nodes_loop_state_and_param_edges(env):
    prog = msrl.compile(loops.Simple(), Fused(), env, NUM_ENVS)
    g = prog.graph_dict()
    kinds = {n["api"] for n in g["nodes"] if n["kind"] == "api"}
    assert kinds == {"env_observe", "agent_act", "env_step", "buffer_insert", "buffer_get", "agent_learn"}
    loop = [n for n in g["nodes"] if n["kind"] == "loop"]
    assert len(loop) == 1 and loop[0]["trip_count"] == 3
    assert all(n["fragment"] == "main" for n in g["nodes"])
    by_id = {n["id"]: n for n in g["nodes"]}
    obs_edges = [e for e in g["edges"] if e["name"] == "obs" and by_id[e["dst"]].get("api") == "agent_act"]
    assert obs_edges and all(e["shape"] == [NUM_ENVS, 4] and e["dtype"] == "float32" for e in obs_edges)
    assert any(e["carry"] for e in obs_edges)  # obs = next_obs flows around the loop
    params = [e for e in g["edges"] if e["kind"] == "params"]
    assert params and by_id[params[0]["src"]]["api"] == "agent_learn" and by_id[params[0]["dst"]]["api"] == "agent_act"
    states = {e["name"] for e in g["edges"] if e["kind"] == "state"}
    assert {"@env", "@actor", "@buffer", "@learner"} <= states
    assert g["fragments"] == [{"name": "main", "replicas": 1, "backend": "jax", "devices": None, "jit": True,
                               "state": ["env", "actor", "learner", "buffer"]}]
    order = prog.topological_order()
    assert order.index("s1") < order.index(params[0]["src"])


def test_partition_inserts_comm_nodes(env):
    prog = msrl.compile(loops.Simple(), ActorsLearner(), env, NUM_ENVS)
    comms = {(c.var, c.op, c.src_fragment, c.dst_fragment) for c in prog.plan.comms}
    assert ("_api1", "gather", "actors", "learner") in comms  # the trajectory
    assert ("@params", "broadcast", "learner", "actors") in comms  # the new weights
    g = prog.graph_dict()
    comm_nodes = [n for n in g["nodes"] if n["kind"] == "comm"]
    assert len(comm_nodes) == len(prog.plan.comms)
    assert {f["name"]: f["replicas"] for f in g["fragments"]} == {"actors": 2, "learner": 1}
    actors = prog.fragments["actors"]
    assert "params" in actors.state_keys and "learner" not in actors.state_keys
    assert ".send(_api1)" in actors.source and "_s_params = _msrl_comm" in actors.source
    learner = prog.fragments["learner"]
    assert "_api1 = _msrl_comm" in learner.source and ".send(_s_params)" in learner.source
    assert learner.state_keys == ["learner"]


def test_given_the_analysis_another_process_compiles_the_same_program_without_tracing_the_loop(env):
    """What a Ray actor does with the driver's recipe: the program compiled from the pickled loop, policy, env and
    ``Program.analysis()`` has the same fragments and comms (the fingerprint each actor checks) and the same
    per-environment axes, and compiling it runs no JAX trace (the shape probes are the driver's)."""
    import cloudpickle

    from msrl.backends.ray_backend import fingerprint
    from msrl.compiler import compile as compile_program

    prog = msrl.compile(loops.Simple(), ActorsLearner(), env, NUM_ENVS)
    recipe = cloudpickle.dumps((prog.algorithm, prog.policy, prog.env, prog.num_envs, prog.analysis()))
    events, listening = [], [True]
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, seconds, **kw: listening and events.append(event))
    again = compile_program(*cloudpickle.loads(recipe))
    listening.clear()  # (the listener stays registered, silent from here on)
    assert not events
    assert fingerprint(again) == fingerprint(prog)
    assert again.env_axes == prog.env_axes and again.env_axes and again.item_axes == prog.item_axes


def test_policy_that_splits_component_state_is_rejected(env):
    with pytest.raises(msrl.CompileError, match=r"splits the state of component 'env'.*\n  hint: .* calls the env on "
                                                r"both sides of this policy's cut: .* single_learner_fine .* or fused"):
        msrl.compile(loops.Simple(), SplitEnv(), env, NUM_ENVS)


def test_a_split_buffer_says_when_a_learners_output_placed_the_insert(env):
    """A buffer insert that uses what agent_learn returned lands on coarse's learner side: the refusal names the
    learn that placed it there and the policies that run such a loop (the hint was replay_server's, which does not
    fit an on-policy loop); single_learner_fine runs it."""
    from msrl.policies.single_learner import SingleLearnerCoarse, SingleLearnerFine

    learn = f"loops.py:{loops.marked_line('first_learn')}"
    with pytest.raises(msrl.CompileError, match=rf"'learner' because it uses a value `first = msrl.agent_learn\("
                                                rf"msrl.buffer_get\(\)\)  # E:first_learn` \(.*{learn}\) computes "
                                                r"there\n  hint: .* or use single_learner_fine or fused") as info:
        msrl.compile(loops.LearnFeedsActing(), SingleLearnerCoarse(actors=1), env, NUM_ENVS)
    assert info.value.line == loops.marked_line("fed_insert")
    msrl.compile(loops.LearnFeedsActing(), SingleLearnerFine(actors=1), env, NUM_ENVS)
    # a replay buffer whose priorities the learner returns: replay_server's job, still
    from msrl.config import load_config

    from helpers import EXAMPLES

    with pytest.raises(msrl.CompileError, match=r"buffer_update\(sample.indices, priorities\).*'learner' because .*"
                                                r"agent_learn.*\n  hint: .* is policy.name=replay_server's job"):
        msrl.build(load_config(EXAMPLES / "dqn_cartpole.yaml", ["algorithm.prioritized=true",
                                                                "policy.name=single_learner_coarse"]))


def test_a_jax_error_that_introduces_its_detail_keeps_it_in_the_one_line_message(env):
    """JAX's "... but they differ:" is followed by what differs; the error keeps that line (it ended at "differ:")."""
    program = msrl.compile(loops.CarryChangesDtype(), Fused(), env, NUM_ENVS)
    message = (r"TypeError while tracing `for _ in range\(self.cfg.steps\):  # E:carry_dtype`: scan body .* but "
               r"they differ: The input carry .* has type float32\[3,4\] but the corresponding output carry component "
               r"has type float16\[3,4\], so the dtypes do not match\.\n")
    with pytest.raises(msrl.CompileError, match=message), msrl.Session(program=program, seed=0) as session:
        session.run(1)


def test_a_draw_in_a_branch_not_taken_is_not_refused_and_in_the_branch_taken_is(env):
    """An ``if`` on a compile-time condition compiles only its branch and checks only it (README): np.random in
    the branch not taken was refused all the same."""
    msrl.compile(loops.DrawsOnlyIfAsked(), Fused(), env, NUM_ENVS)
    loop = loops.DrawsOnlyIfAsked()
    loop.cfg.flag = False
    with pytest.raises(msrl.CompileError, match=r"`np.random.rand\(\)` in DrawsOnlyIfAsked.train_step runs once"):
        msrl.compile(loop, Fused(), env, NUM_ENVS)


@pytest.mark.parametrize("marker", sorted(loops.REJECTED))
def test_rejected_construct_names_file_and_line(env, marker):
    with pytest.raises(msrl.CompileError) as info:
        msrl.compile(loops.REJECTED[marker](), Fused(), env, NUM_ENVS)
    err = info.value
    assert err.file == loops.__file__
    assert err.line == loops.marked_line(marker), str(err)
    assert f"loops.py:{err.line}" in str(err)


@pytest.mark.parametrize("loop, says", [(loops.LearnReturnsState, r"StateOnlyLearner.learn\(\) \(.*loops.py:\d+\) "
                                          r"returned a dict with keys \['w', 'updates'\]; it must return \(state, output\)"),
                                         (loops.LearnGrowsState, r"GrowingLearner.learn\(\) .* \(\['seen'\]: new\)"),
                                         (loops.InsertsTwoShapes, r"the item's .obs is float32\[3, 2\]; the buffer "
                                          r"holds float32\[3, 4\] there")])
def test_a_wrong_state_or_item_is_named(env, loop, says):
    with pytest.raises(msrl.CompileError, match=says):
        msrl.compile(loop(), Fused(), env, NUM_ENVS)


@pytest.mark.parametrize("policy", ["fused", "coarse", "fine"])
def test_a_python_if_on_the_index_of_a_scanned_loop_says_why_at_its_line(policy):
    """The shape probe runs the loop's body once in Python (the index is a number there); the jitted program
    scans it (the index is traced): the error comes when it compiles, at the line, with what to do. Alike from a
    split policy's replicas, which trace their fragments on their first step (it was a TrainingError there, with
    JAX's tracer report and the generated code's frames)."""
    from msrl.policies.single_learner import SingleLearnerCoarse, SingleLearnerFine

    split = {"fused": Fused(), "coarse": SingleLearnerCoarse(actors=2), "fine": SingleLearnerFine(actors=2)}[policy]
    program = msrl.compile(loops.IndexIf(), split, make_env("gymnax:CartPole-v1"), 4)
    with pytest.raises(msrl.CompileError, match=r"TracerBoolConversionError .*\n  hint: a Python `if`.* `i` too: "
                                                r"the loop runs as lax.scan\): select with jnp.where") as info, \
            msrl.Session(program=program, seed=0) as session:
        session.run(1)
    assert (info.value.file, info.value.line) == (loops.__file__, loops.marked_line("index_if"))

@pytest.mark.parametrize("loop", [loops.NestedPlainDef, loops.HelperStatics])
def test_a_def_or_a_compile_time_local_is_the_same_wherever_the_policy_cuts(loop):
    from msrl.policies.single_learner import SingleLearnerCoarse, SingleLearnerFine

    finals, env = [], make_env("gymnax:CartPole-v1")
    for policy in (Fused(), SingleLearnerCoarse(actors=2), SingleLearnerFine(actors=2)):
        with msrl.Session(program=msrl.compile(loop(), policy, env, 4), seed=0) as session:
            rows = session.run(2)
            finals.append(session.params())
    assert rows[-1]["w"] != 0
    if loop is loops.HelperStatics:  # CartPole's reward 1, times (k * k) % 7 == 4 as Python computes it, twice
        assert rows[-1]["w"] == pytest.approx(2 * np.tanh(0.5 * 4))
    for other in finals[1:]:
        assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(finals[0]), jax.tree.leaves(other),
                                                        strict=True))


def test_an_error_in_a_method_the_loop_calls_names_its_line_and_the_statement(env):
    with pytest.raises(msrl.CompileError) as info:
        msrl.compile(loops.LearnerRaises(), Fused(), env, NUM_ENVS)
    assert (info.value.file, info.value.line) == (loops.__file__, loops.marked_line("learner_raises"))
    assert f"ValueError in learn() while tracing `return msrl.agent_learn(msrl.buffer_get())  # E:calls_learner` " \
           f"(loops.py:{loops.marked_line('calls_learner')}): the learner's own bug" in str(info.value)


def test_a_bound_assigned_twice_and_a_helper_taken_as_a_value_say_so(env):
    for loop, says in ((loops.BoundAssignedTwice, r"the loop bound depends on steps, which is assigned more than once"),
                       (loops.HelperAsValue, r"self.rollout, a method that uses the API, is used as a value")):
        with pytest.raises(msrl.CompileError, match=says):
            msrl.compile(loop(), Fused(), env, NUM_ENVS)


def test_an_error_in_a_components_init_names_its_line(env):
    """(It leaked as a bare traceback through msrl's compiler: no statement of the loop raised it.)"""
    with pytest.raises(msrl.CompileError) as info:
        msrl.compile(loops.InitRaises(), Fused(), env, NUM_ENVS)
    assert (info.value.file, info.value.line) == (loops.__file__, loops.marked_line("init_raises"))
    assert info.value.reason == "AttributeError in init() while tracing the loop: module 'msrl' has no attribute " \
                                "'per_env_key'; did you mean 'per_env_keys'?"


def test_float_of_a_metric_says_to_keep_the_array(env):
    with pytest.raises(msrl.CompileError, match=r"ConcretizationTypeError while tracing `return \{\"mean_action\": "
                                                r"float\(out.action.mean\(\)\)\}  # E:floats_metric`.*\n  hint: "
                                                r"float\(x\) needs a value known at compile time; .* keep the array") \
            as info, msrl.Session(program=msrl.compile(loops.FloatsItsMetric(), Fused(), env, NUM_ENVS)) as session:
        session.run(1)
    assert (info.value.file, info.value.line) == (loops.__file__, loops.marked_line("floats_metric"))


def test_compile_of_an_algorithm_class_says_to_build_it(env):
    with pytest.raises(msrl.CompileError, match=r"takes an algorithm object, not the class Simple: build it first"):
        msrl.compile(loops.Simple, Fused(), env, NUM_ENVS)
    # a policy or env by name, no environments, another count than the algorithm was built for: said, not raw
    # AttributeErrors and a ZeroDivisionError, and not compiled for a count its schedules were not sized by
    for args, error in [(("fused", env, NUM_ENVS), r"^policy: msrl.compile takes a policy object .*got str 'fused'"),
                        ((Fused(), "gymnax:CartPole-v1", NUM_ENVS), r"^env: msrl.compile takes an environment object"),
                        ((Fused(), env, 0), r"^num_envs: a whole number >= 1 of environments, got 0$")]:
        with pytest.raises(msrl.ConfigError, match=error):
            msrl.compile(loops.Simple(), *args)
    from msrl.algorithms.ppo import PPO, PPOConfig

    ppo = PPO(PPOConfig(), msrl.Context(env_spec=env.spec, num_envs=4, total_env_steps=4096))
    with pytest.raises(msrl.ConfigError, match=r"^num_envs: the algorithm was built for 4 environments \(its "
                                               r"msrl.Context\(num_envs=4\)\), but is compiled for 8"):
        msrl.compile(ppo, Fused(), env, 8)

def test_a_function_of_a_module_that_calls_the_api_is_named_with_what_to_do(env):
    """Only the algorithm's methods are inlined: a plain function's API calls were invisible (the loop "never
    calls msrl.env_step", or the API "was called directly" while tracing)."""
    with pytest.raises(msrl.CompileError, match=r"rollout\(\) \(.*loops.py:\d+\) calls the msrl API, but the "
                                                r"compiler inlines only methods of the algorithm.*\n  hint: make "
                                                r"rollout a method of ModuleFunction and call it as self.rollout"):
        msrl.compile(loops.ModuleFunction(), Fused(), env, NUM_ENVS)
    with pytest.raises(msrl.CompileError, match=r"Roller.rollout\(\) \(.*loops.py:\d+\) calls the msrl API, but the "
                                                r"compiler inlines only methods of the algorithm"):
        msrl.compile(loops.AnotherObjectsMethod(), Fused(), env, NUM_ENVS)


class LearnerWithoutPolicyParams(msrl.Learner):
    def init(self, key):
        return {"w": jnp.zeros(())}

    def learn(self, state, batch):
        return state, {}


class LearnerWithoutOptimizer(LearnerWithoutPolicyParams):
    def init(self, key):
        return {"w": jnp.zeros(()), "opt": self.tx.init(jnp.zeros(()))}

    def policy_params(self, state):
        return {"w": state["w"]}


class MisspeltTrainStep(loops.Base):
    def train_stepp(self):
        return msrl.env_step(0)


class MisspeltApi(loops.Base):
    def train_step(self):
        obs = msrl.env_observe()
        msrl.env_stepp(msrl.agent_act(obs).action)  # E:misspelt_api


def zeroed(fn):
    @functools.wraps(fn)
    def wrapper(*args):
        return jax.tree.map(lambda x: x * 0, fn(*args))
    return wrapper


class DecoratedHelper(loops.Base):
    @zeroed  # E:decorated_helper
    def collect(self, obs):
        return msrl.env_step(msrl.agent_act(obs).action).obs

    def train_step(self):
        return {"obs": self.collect(msrl.env_observe()).mean()}


class DecoratedLoop(loops.Base):
    @zeroed  # E:decorated_loop
    def train_step(self):
        return {"reward": msrl.env_step(msrl.agent_act(msrl.env_observe()).action).reward.mean()}


def _with(**components):
    alg = loops.Simple()
    vars(alg).update(components)
    return alg


@pytest.mark.parametrize("make, says, at", [
    (lambda: _with(learner=LearnerWithoutPolicyParams()), r"LearnerWithoutPolicyParams, Simple's learner, defines no "
     r"policy_params\(state\), which gives the actor its parameters$", LearnerWithoutPolicyParams),
    (lambda: _with(learner=LearnerWithoutOptimizer()), r"LearnerWithoutOptimizer defines no optimizer\(\), the optax "
     r"transformation its self.tx chains", LearnerWithoutOptimizer),
    (lambda: _with(actor=loops.RandomActor), r"Simple.actor is the class RandomActor, not an object of it\n  hint: "
     r"build one in __init__: self.actor = RandomActor\(...\)$", loops.Simple),
    (lambda: _with(learner=object()), r"Simple.learner must be an msrl.Learner \(an object of a subclass of it\), got "
     r"object$", loops.Simple),
    (MisspeltTrainStep, r"MisspeltTrainStep defines no train_step\(self\), the training loop msrl compiles \(did you "
     r"mean 'train_stepp'\?\)$", MisspeltTrainStep),
    (MisspeltApi, r"module 'msrl' has no attribute 'env_stepp' \(did you mean 'env_step'\?\)$", "misspelt_api"),
    (DecoratedHelper, r"DecoratedHelper.collect is wrapped by a decorator \(@zeroed\); msrl compiles a method that "
     r"uses the API from its source, where the wrapper would not run", "decorated_helper"),
    (DecoratedLoop, r"DecoratedLoop.train_step is wrapped by a decorator \(@zeroed\)", "decorated_loop")])
def test_a_component_or_method_msrl_needs_that_is_missing_is_named_at_the_users_line(env, make, says, at):
    """(Each was a bare traceback ending in NotImplementedError or AttributeError inside msrl, or an error blaming
    msrl's own algorithm.py, or "never calls msrl.env_step()" for a misspelt msrl.env_step; a decorator wrapping a
    method that uses the API was dropped without a word, the method compiled from its source alone.)"""
    import inspect

    with pytest.raises(msrl.CompileError, match=says) as info:
        msrl.compile(make(), Fused(), env, NUM_ENVS)
    if isinstance(at, str):  # the line marked "# E:<at>" in this file
        at = (__file__, next(i for i, text in enumerate(open(__file__), 1) if f"# E:{at}" in text))
    else:  # the class's definition
        at = (inspect.getsourcefile(at), inspect.getsourcelines(at)[1])
    assert (info.value.file, info.value.line) == at


class LearnerThatNeverLearns(msrl.Learner):
    """init and policy_params, no learn: enough for a loop that only acts."""

    def init(self, key):
        return {"w": jnp.zeros(())}

    def policy_params(self, state):
        return {"w": state["w"]}


class DuckActor:
    """An actor of no msrl class: its methods are what the loop needs."""

    def init(self, key, env_ids):
        return {"keys": jax.vmap(lambda i: jax.random.fold_in(key, i))(env_ids)}

    def act(self, state, params, obs):
        return state, msrl.ActOutput(action=jnp.zeros(obs.shape[0], jnp.int32) + jnp.int32(params["w"] * 0))


def test_components_are_judged_by_what_the_loop_calls(env):
    """(The first checks refused a learner without learn in a loop that never learns, and an actor of no msrl
    class, both of which compiled before.)"""
    acts = loops.ActsOnly()
    vars(acts).update(learner=LearnerThatNeverLearns(), buffer=msrl.TrajectoryBuffer)  # (an unused class: no error)
    msrl.compile(acts, Fused(), env, NUM_ENVS)
    with msrl.Session(program=msrl.compile(_with(actor=DuckActor()), Fused(), env, NUM_ENVS), seed=0) as session:
        assert session.run(1)


def test_loop_without_env_step_is_rejected(env):
    with pytest.raises(msrl.CompileError, match="never calls msrl.env_step"):
        msrl.compile(loops.NoEnvStep(), Fused(), env, NUM_ENVS)


def test_source_unavailable_is_a_compile_error(env):
    ns = {"msrl": msrl, "Base": loops.Base}
    exec("class Notebook(Base):\n    def train_step(self):\n        return msrl.env_step(0)\n", ns)
    with pytest.raises(msrl.CompileError, match="cannot read the source") as info:
        msrl.compile(ns["Notebook"](), Fused(), env, NUM_ENVS)
    assert "hint" in str(info.value)


def test_api_called_outside_a_loop_raises_naming_the_place():
    """(In an algorithm's __init__, say, it named no place, and said to run through `msrl train`, as the user did.)"""
    with pytest.raises(msrl.MsrlError, match=rf"^{re.escape(__file__)}:\d+: msrl.agent_act\(\) was called directly "
                                             r"\(here in test_api_called_outside_a_loop_raises_naming_the_place\(\)\)"):
        msrl.agent_act(jnp.zeros(3))


@pytest.mark.parametrize("fn, why", [
    (lambda x: jax.lax.conv_general_dilated(x, jnp.ones((2, 1, 1)), (1,), "VALID", dimension_numbers=("NWC", "WIO", "NWC")),
     None),
    (lambda x: jax.lax.conv_general_dilated(x, jnp.ones((2, 1, 1)), (1,), "VALID", dimension_numbers=("WNC", "WIO", "WNC")),
     "convolves across the environment axis"),
    (lambda x: jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 2, 1), (1, 1, 1), "VALID"), None),
    (lambda x: jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (2, 1, 1), (1, 1, 1), "VALID"), "pools over the environment"),
    (lambda x: jax.lax.top_k(x[..., 0], 2)[0], None),
    (lambda x: jax.lax.top_k(x[..., 0].T, 2)[0], "takes the top k along the environment axis"),
    (lambda x: x * x.sum(1, keepdims=True), None),
    (lambda x: x - x.mean(0), "reduces over the environment axis"),
    (lambda x: x / (x.std(0) + 1e-8), "reduces over the environment axis"),  # (was 'a number that depends on how
    # many environments a replica holds', the count var() compares with ddof, not the sum it divides)
    (lambda x: jax.nn.softmax(x, axis=1), None),
    (lambda x: jnp.fft.fft(x[..., 0], axis=1).real, None),
    (lambda x: jnp.fft.fft(x[..., 0], axis=0).real, "transforms along the environment axis"),
    (lambda x: jnp.linalg.solve(x * x.transpose(0, 2, 1) + jnp.eye(5), x), None),
    (lambda x: jax.lax.custom_linear_solve(lambda v: v + v.mean(0), x, lambda mv, b: b), "reduces over the environment"),
    (lambda x: jnp.linalg.cholesky(x[..., 0].T @ x[..., 0] + jnp.eye(5)), "takes a matrix product over the environment"),
    (lambda x: jax.lax.scan(lambda c, row: (c, row * 2 + row.sum()), 0.0, x)[1], None),
    (lambda x: jax.lax.scan(lambda c, row: (c + row.sum(), row * c), 0.0, x)[1], "loops over the environments"),
    (lambda x: jax.lax.scan(lambda c, row: (c, row[0, 0] * x[:, 0, 0]), 0.0, x)[1], "combines every environment"),
    (lambda x: x[:, None, 0, 0] * x[None, :, 0, 0], "combines every environment with every other"),
    (lambda x: jax.lax.dynamic_update_slice(x, x[:, :2], (0, 3, 0)), None),
    (lambda x: jax.lax.dynamic_update_slice(jnp.zeros((64, 5, 1)), x, (0, 0, 0)), "writes rows of several environments"),
    (lambda x: x.reshape(3, -1), "cannot be traced alone, at two environment counts"),  # 4 x 5 x 1 is not 3 x ...
    (lambda x: jax.pure_callback(np.asarray, jax.ShapeDtypeStruct(x.shape, x.dtype), x, vmap_method="sequential"),
     "uses `pure_callback` on an environment axis"),
    (lambda x: (jax.debug.callback(lambda v: None, x.sum()), jax.debug.print("{}", x))[0] or x * 2, None)])
def test_the_row_check_judges_network_layers_by_the_axis_they_work_along(fn, why):
    """[envs, width, channels]: a layer, a transform, a solve or a scan over each environment's own features passes;
    along environments, or by a primitive the walk does not know, refused. A callback that returns nothing (a
    `jax.debug.print` in a user's env) mixes nothing into the values (it was an IndexError)."""
    from msrl.compiler import rows

    shapes = [[jax.ShapeDtypeStruct((n, 5, 1), jnp.float32)] for n in (4, 8)]
    got = rows.mixing_fn(fn, *shapes)
    assert (got is None) if why is None else why in got, got


def test_network_initialization_uses_lapack_without_importing_scipy_linalg():
    """Orthogonal initializers run a QR, which jaxlib computes on CPU with LAPACK that it finds in scipy; the
    compiler's jitted component init gives jaxlib LAPACK without importing all of scipy.linalg (~0.27 s of every
    start). The parameters are bitwise those of the ordinary path (scipy.linalg imported first), and
    scipy.linalg imported afterwards is whole."""
    import json
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import hashlib, json, sys
        if sys.argv[1] == "scipy-first":
            import scipy.linalg
        import jax, numpy as np
        from msrl.compiler import run_init
        from msrl.rl import ActorCritic
        imported_before = "scipy.linalg" in sys.modules
        params = run_init(ActorCritic(2, True, 1).init, jax.random.PRNGKey(7), np.zeros((1, 4), np.float32))
        linalg_imported = "scipy.linalg" in sys.modules
        import scipy.linalg
        a = np.eye(3) + 1
        q, r = scipy.linalg.qr(a)
        assert np.allclose(q @ r, a) and scipy.linalg.cython_lapack is sys.modules["scipy.linalg.cython_lapack"]
        print(json.dumps({"linalg_imported": linalg_imported, "imported_before": imported_before,
                          "params": [hashlib.sha256(np.asarray(x).tobytes()).hexdigest()
                                     for x in jax.tree.leaves(params)]}))
    """)
    runs = {}
    for mode in ("scipy-first", "default"):
        out = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, timeout=180, check=False)
        assert out.returncode == 0, out.stderr[-2000:]
        runs[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    assert not runs["default"]["imported_before"], "importing jax and msrl imported scipy.linalg already"
    assert runs["scipy-first"]["linalg_imported"] and not runs["default"]["linalg_imported"]
    assert runs["default"]["params"] == runs["scipy-first"]["params"]


@msrl.register_policy("test_yours")
class _Yours(msrl.DistributedPolicy):
    """A user's policy, each of whose answers a test may replace with a mistake (``mistake``)."""

    name: Literal["test_yours"] = "test_yours"
    backend: str = "threads"
    mistake: str = ""
    learners: int = 1

    def fragments(self):
        if self.mistake == "dicts":
            return [{"name": "actor", "replicas": 2}]
        if self.mistake == "twice":
            return [self.role("actor", 2, "backend"), self.role("actor", 4, "backend"), self.role("learner", 1, "backend")]
        if self.mistake == "learners":
            return [self.role("learner", self.learners, "backend")]
        if self.mistake == "elsewhere":
            return [self.role("actor", 2, "backend"), msrl.FragmentSpec(name="learner", backend="ray")]
        if self.mistake in ("devices", "eager"):
            return [msrl.FragmentSpec(name="actor", replicas=2, backend="threads", jit=self.mistake != "eager",
                                      devices=(0, 1) if self.mistake == "devices" else None),
                    self.role("learner", 1, "backend")]
        if self.mistake in ("dash", "many", "uneven"):
            return [self.role("my-actor" if self.mistake == "dash" else "actor",
                              {"dash": 2, "many": 16, "uneven": 3}[self.mistake], "backend"),
                    self.role("learner", 1, "backend")]
        if self.mistake == "bcast":
            return [self.role("sim", 1, "backend"), self.role("actor", 2, "backend"),
                    self.role("learner", 1, "backend")]
        return [self.role("actor", 2, "backend"), self.role("learner", self.learners, "backend")]

    def total_envs(self, num_envs):
        return num_envs * 2 if self.mistake == "doubles" else super().total_envs(num_envs)

    def assign(self, loop):
        if self.mistake == "typo":
            return {s.id: "actor" for s in loop.statments}
        if self.mistake == "partial":
            return {s.id: "actor" for s in loop.statements[1:]}
        if self.mistake == "stray":
            return {**loop.roles(lambda s: "actor"), "s_nowhere": "learner"}
        if self.mistake in ("learners", "idle"):
            return loop.roles(lambda s: "learner")
        if self.mistake in ("calltypo", "componenttypo"):  # (each left a role without its statements, silently)
            loop.calls("agent_lern") if self.mistake == "calltypo" else loop.component_calls("envs")
        learner = loop.downstream_of(loop.calls("agent_learn"))
        env = loop.component_calls("env") if self.mistake == "bcast" else set()
        return loop.roles(lambda s: "learner" if s.id in learner else "sim" if s.id in env else "actor")

    def link(self, var, src, dst):
        if self.mistake == "tuple":
            return ("gather", "env")
        if src.name == "sim" and dst.name == "actor":
            return msrl.Link(op="broadcast", axis="replicated")
        if var == "@params" and self.mistake in ("lag2", "lag_every"):
            return msrl.Link(axis="replicated", lag=2) if self.mistake == "lag2" else msrl.Link(lag=1, every=3)
        if var == "@params" and self.mistake == "params_env":
            return msrl.Link(axis="env")
        if var == "@params" and self.mistake == "params_default":
            return msrl.Link(every=2)  # (its axis unset: the parameters', replicated; it was refused as 'env')
        if var != "@params" and self.mistake in ("batch", "lag", "every", "replicated"):
            return {"batch": msrl.Link(axis="batch"), "lag": msrl.Link(lag=1), "every": msrl.Link(every=2),
                    "replicated": msrl.Link(axis="replicated")}[self.mistake]
        return super().link(var, src, dst)

    def learner_plan(self):
        if self.mistake == "updates":
            return msrl.LearnerPlan(updates_per_iteration=0)
        if self.mistake == "updates2":
            return msrl.LearnerPlan(updates_per_iteration=2)
        if self.mistake == "declares2":
            return msrl.LearnerPlan(grad_transforms=(msrl.all_reduce_mean(),), learner_replicas=2)
        if self.mistake == "transform":
            return msrl.LearnerPlan(grad_transforms=(lambda g: g,))
        if self.learners > 1 and self.mistake == "unaveraged":
            return msrl.LearnerPlan(learner_replicas=self.learners)
        if self.learners > 1 and self.mistake != "apart":
            return msrl.LearnerPlan(grad_transforms=(msrl.all_reduce_mean(),), learner_replicas=self.learners)
        return msrl.LearnerPlan()


@pytest.mark.parametrize("mistake, error, message", [
    ("dicts", msrl.ConfigError, r"^policy.name: policy 'test_yours': its fragments\(\) returned list \[\{'name': "
                                r"'actor', 'replicas': 2\}\]; it returns a list of msrl.FragmentSpec"),
    ("twice", msrl.ConfigError, r"its fragments\(\) give the role 'actor' 2 times; each role has one name"),
    ("elsewhere", msrl.ConfigError, r"its fragments\(\) place the role 'learner' on backend 'ray', but the policy runs "
                                    r"on policy.backend='threads'"),  # (it ran on threads without a word)
    ("typo", msrl.ConfigError, r"^policy.name: policy 'test_yours': its assign\(\) raised AttributeError: 'Loop' "
                               r"object has no attribute 'statments' \(at .*test_compiler.py:\d+\)$"),
    ("tuple", msrl.ConfigError, r"its link\(\) returned tuple \('gather', 'env'\); it returns an msrl.Link$"),
    ("updates", msrl.ConfigError, r"its learner_plan\(\) gives updates_per_iteration=0; it must be a whole number >= 1"),
    ("transform", msrl.ConfigError, r"its learner_plan\(\) has the gradient transform <function .*>; each is an "
                                    r"optax.GradientTransformation"),
    ("batch", msrl.CompileError, r"policy 'test_yours' sends `obs` from 'actor' to 'learner' along axis 'batch', but it "
                                 r"is not a replay buffer's sample: its replicas' rows would be interleaved"),
    ("lag", msrl.ConfigError, r"gives `obs` \(actor -> learner\) lag=1: only the parameters \(@params\) may arrive late"),
    ("every", msrl.ConfigError, r"gives `obs` \(actor -> learner\) every=2: only the parameters \(@params\) may "
                                r"arrive late or skip iterations"),
    ("dash", msrl.ConfigError, r"its fragments\(\) name a role 'my-actor'; a role's name is a Python identifier"),  # (a
    # SyntaxError in the generated code)
    ("doubles", msrl.ConfigError, r"^policy.name: policy 'test_yours': its total_envs\(8\) gives 16, but "
                                  r"total_envs\(16\) gives 32; given its own answer it must give it again"),  # (its
    # config.yaml said 16, and its resume refused the 32 it ran)
    ("partial", msrl.CompileError, r"the assign\(\) of policy 'test_yours' gives `.*` no role \(its roles: actor, "
                                   r"learner\); every statement of the loop has one"),  # (was "in fragment None")
    ("bcast", msrl.CompileError, r"policy 'test_yours' broadcasts `obs`, a per-environment value, from 'sim' to the 2 "
                                 r"'actor' replicas, each of which holds a share of the environments"),  # (a vmap
    # error in the first iteration)
    ("stray", msrl.ConfigError, r"^policy.name: policy 'test_yours': its assign\(\) places 's_nowhere', which is not a "
                                r"statement of the loop \(its statements: s1, s3, .*; `msrl graph` lists them\)$"),
    # (a KeyError deep in the compiler)
    ("calltypo", msrl.ConfigError, r"^policy.name: policy 'test_yours': its assign\(\) raised ValueError: "
                                   r"'agent_lern' is not an API function; did you mean 'agent_learn'\? they are: .*"
                                   r"\(at .*test_compiler.py:\d+\)$"),
    ("componenttypo", msrl.ConfigError, r"its assign\(\) raised ValueError: 'envs' is not a component of the API; did "
                                        r"you mean 'env'\? they are: actor, buffer, env, learner "
                                        r"\(at .*test_compiler.py:\d+\)$"),
    ("many", msrl.ConfigError, r"^env.num_envs: 8 environments cannot be split over 16 replicas of fragment 'actor'$"),
    ("uneven", msrl.ConfigError, r"^env.num_envs: 8 environments cannot be split over 3 replicas of fragment "
                                 r"'actor'$"),  # (refused once the backend had started: a Ray cluster, say)
    ("replicated", msrl.ConfigError, r"gives `obs` \(actor -> learner\) the axis 'replicated', but a gather joins a "
                                     r"value along its environments"),  # (the axis was ignored without a word)
    ("lag2", msrl.ConfigError, r"gives `@params` \(learner -> actor\) lag=2: the parameters may arrive at most 1 "
                               r"iteration late"),  # (it trained, and no checkpoint of it could be resumed)
    ("lag_every", msrl.ConfigError, r"gives `@params` \(learner -> actor\) every=3 with lag=1: each iteration that "
                                    r"receives the parameters \(one in 3\) would wait for those sent in the iteration "
                                    r"before, which sends none"),  # (it waited until the stall timeout)
    ("devices", msrl.ConfigError, r"its fragments\(\) give the role 'actor' the JAX devices \[0, 1\], but place it on "
                                  r"backend 'threads': only a role on 'jax' runs on JAX devices"),  # (ignored)
    ("params_env", msrl.ConfigError, r"^policy: policy 'test_yours': its link\(\) gives `@params` \(learner -> actor\) "
                                     r"the axis 'env'; the parameters are the same on every replica: 'replicated' \(a "
                                     r"broadcast\) \(at .*test_compiler.py:\d+\)$"),  # (ran as a broadcast)
    ("updates2", msrl.ConfigError, r"its learner_plan\(\) gives updates_per_iteration=2, but its 1 learner replica "
                                   r"updates the parameters 1 time per iteration"),  # (A2C's schedule was sized by it:
    # 2.5e-4 from fused, without a word)
    ("declares2", msrl.CompileError, r"runs `metrics = msrl.agent_learn\(.*\)` on its role 'learner' of 1 replica, "
                                     r"but its learner_plan\(\) declares 2 learner replicas"),  # (each learner was
    # told of half the environments: SAC's random warm-up twice as long, 1e-3 from fused)
])
def test_a_policy_of_yours_that_answers_wrongly_is_told_so(mistake, error, message):
    """(A wrong answer was an AttributeError deep in the compiler or optax; declaring per-environment values
    'batch' interleaved the replicas' rows, a lag on them was a KeyError mid-run, as `every` was after a restore; a
    zero update count changed the learning-rate schedule; a role given twice took its last replica count without a
    word.)"""
    with pytest.raises(error, match=message):
        msrl.build(msrl.load_config(A2C_CARTPOLE, ["policy.name=test_yours",
                                                                          f"policy.mistake={mistake}"]))


def test_a_link_of_the_parameters_with_its_axis_unset_is_a_broadcast():
    program = msrl.build(msrl.load_config(A2C_CARTPOLE, ["policy.name=test_yours", "policy.mistake=params_default"]))
    params = program.plan.comm("@params")
    assert (params.op, params.axis, params.every) == ("broadcast", "replicated", 2)


def test_a_role_run_eagerly_is_noted(capsys):
    """(FragmentSpec(jit=False) ran op by op, its numbers 2e-7 from fused's, without a word.)"""
    msrl.build(msrl.load_config(A2C_CARTPOLE, ["policy.name=test_yours", "policy.mistake=eager"]))
    assert ("msrl: note: policy 'test_yours' runs its role 'actor' eagerly (FragmentSpec(jit=False)): op by op, "
            "slower, and its floats may round differently from fused's (by ~1e-7)") in capsys.readouterr().err


def test_a_backend_no_one_registered_is_refused_with_the_config():
    """(A policy of one's own whose backend field takes any name: the loop compiled, and msrl said it was starting
    the 'gpu' backend, before the refusal.)"""
    with pytest.raises(msrl.ConfigError, match=r"^policy.backend: unknown backend 'gpu'; available: jax, ray, threads"):
        msrl.load_config(A2C_CARTPOLE, ["policy.name=test_yours", "policy.backend=gpu"])


def test_a_role_given_no_statement_is_noted(capsys):
    """(Its replicas started and did nothing, without a word: a role that a misspelt call left empty, say.)"""
    msrl.build(msrl.load_config(A2C_CARTPOLE, ["policy.name=test_yours", "policy.mistake=idle"]))
    assert ("msrl: note: policy 'test_yours' assigns no statement of the loop to its role 'actor': its replicas "
            "start and do nothing") in capsys.readouterr().err


def test_learners_on_several_replicas_must_average_their_gradients_together():
    """Replicas that each run agent_learn on their own environments end apart (2 threads replicas of the whole
    loop reported one replica's parameters, 0.0045 from fused), also where the policy declares them learner
    replicas but gives no all-reduce; msrl.all_reduce_mean() on the threads backend, which has no collectives,
    averaged nothing."""
    config = A2C_CARTPOLE
    with pytest.raises(msrl.CompileError, match=r"a2c.py:\d+: policy 'test_yours' runs `metrics = msrl.agent_learn\(.*\)` "
                                                r"on the 2 replicas of its role 'learner', but its learner_plan\(\) "
                                                r"declares 1 learner replica: each replica would learn alone"):
        msrl.build(msrl.load_config(config, ["policy.name=test_yours", "policy.learners=2", "policy.mistake=apart"]))
    with pytest.raises(msrl.CompileError, match=r"on the 2 replicas of its role 'learner', but its learner_plan\(\) does "
                                                r"not average their gradients: each replica would learn alone"):
        msrl.build(msrl.load_config(config, ["policy.name=test_yours", "policy.learners=2",
                                             "policy.mistake=unaveraged"]))  # (it ran, each learning alone)
    with pytest.raises(msrl.ConfigError, match=r"^policy.backend: policy 'test_yours' averages the gradients of its 2 "
                                               r"'learner' replicas \(msrl.all_reduce_mean\(\)\), but the threads "
                                               r"backend has no collectives: nothing would average them"):
        msrl.Session(config, ["policy.name=test_yours", "policy.learners=2", "policy.mistake=learners"])


def test_a_subclass_loop_that_calls_super_is_its_base_loop():
    """``return super().train_step()`` in a subclass of a built-in (README suggests subclassing them) was refused:
    "train_step() never calls msrl.env_step()". super().method() is inlined as a helper is: the next class's in the
    MRO, so the subclass computes its base's numbers; a super() call of no method is refused at its line."""
    from helpers import final_params, max_diff

    from msrl.algorithms.ppo import PPO

    @msrl.register_algorithm("ppo_via_super")
    class ViaSuper(PPO):
        class Config(PPO.Config):
            name: Literal["ppo_via_super"] = "ppo_via_super"

        def train_step(self):
            return super().train_step()

        def gone(self):
            return super().no_such_loop()

    small = ["algorithm.rollout_len=8", "algorithm.hidden=[8]", "env.num_envs=2"]
    base, _ = final_params(small, 2)
    via, _ = final_params([*small, "algorithm.name=ppo_via_super"], 2)
    assert max_diff(base, via) == 0.0
    from msrl.compiler.frontend import parse

    algorithm = ViaSuper(ViaSuper.Config(), msrl.Context(make_env("gymnax:CartPole-v1").spec, 2, 1000))
    with pytest.raises(msrl.CompileError, match=r"super\(\).no_such_loop\(\) names no plain method of a base class") \
            as info:
        parse(algorithm, "gone")
    assert info.value.file == __file__


def test_plain_python_beside_the_api_runs_alike_under_every_split():
    """Plain Python a user writes in train_step (probes): a `for` over range() with no API call in it failed to
    compile at all (its loop variable and temporaries were read before it ran: "UnboundLocalError while
    tracing"); `T = self.cfg.rollout_len` used as a shape, `cfg = self.cfg` and a lambda worked fused but crashed
    a fragment of jitted pieces (a jitted piece got them as traced arguments, or returned a function); `T, U = ...`
    was not known at compile time; a walrus on an API call read in its own statement was unbound. Now each trains
    and gives fused's parameters bitwise on single_learner_fine. A metric nested in a dict was dropped silently:
    refused."""
    from helpers import final_params, max_diff

    from msrl.algorithms.dqn import DQN
    from msrl.algorithms.dqn.dqn import Transition

    @msrl.register_algorithm("dqn_plain_python")
    class PlainPython(DQN):
        class Config(DQN.Config):
            name: Literal["dqn_plain_python"] = "dqn_plain_python"

        def train_step(self):
            cfg = self.cfg
            T, U = cfg.rollout_len, self.cfg.updates
            obs = msrl.env_observe()
            seen = jnp.zeros((T, obs.shape[0]))
            for t in range(T):
                out = msrl.agent_act(obs)
                shaped = (step := msrl.env_step(out.action)).reward + 0.0 * step.done
                scale = lambda x: 0.5 * x  # noqa: E731
                for _ in range(2):
                    half = scale(shaped)
                    shaped = shaped - half + 0.25
                seen = seen.at[t].set(shaped)
                msrl.buffer_insert(Transition(obs, out.action, shaped, step.done))
                obs = step.obs
            for _ in range(U):
                sample = msrl.buffer_sample(cfg.batch_size)
                metrics, priorities = msrl.agent_learn(sample)
                msrl.buffer_update(sample.indices, priorities)
            return {**metrics, "seen": seen.mean()}

    dqn = ["algorithm.name=dqn_plain_python", "algorithm.rollout_len=2", "algorithm.updates=2", "algorithm.hidden=[8]",
           "algorithm.batch_size=8", "algorithm.learning_starts=8", "env.num_envs=4"]
    dqn_yaml = Path(__file__).parents[1] / "examples" / "dqn_cartpole.yaml"
    fused, rows = final_params(dqn, 3, dqn_yaml)
    fine, fine_rows = final_params([*dqn, "policy.name=single_learner_fine", "policy.actors=2"], 3, dqn_yaml)
    assert max_diff(fused, fine) == 0.0 and np.isfinite(rows[-1]["loss"])
    assert [r["seen"] for r in rows] == [r["seen"] for r in fine_rows]

    @msrl.register_algorithm("dqn_nested_metric")
    class NestedMetric(DQN):
        class Config(DQN.Config):
            name: Literal["dqn_nested_metric"] = "dqn_nested_metric"

        def train_step(self):
            metrics = super().train_step()
            return {"learn": {"loss": metrics["loss"]}}

    with pytest.raises(msrl.CompileError, match=r"returns metric 'learn' as a dict holding one number; every metric "
                                                r"is one number under its own key"):
        final_params([*dqn, "algorithm.name=dqn_nested_metric"], 1, dqn_yaml)
