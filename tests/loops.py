"""Training loops for the compiler tests: small real components, accepted and rejected loop shapes.

Each rejected loop marks its offending line with a comment ``# E:<name>`` so the tests can check that the
CompileError points at exactly that file:line.
"""

from __future__ import annotations

import itertools
import re
import threading
import time
from types import SimpleNamespace
from typing import Literal, NamedTuple

import gymnasium
import jax
import jax.numpy as jnp
import numpy as np

import msrl
from msrl import api
from msrl.api import agent_act as act_alias
from msrl.algorithms.ppo.ppo import PPO, PPOConfig, PPOLearner
from msrl.components import split_keys
from msrl.conformance_loops import ConformanceRecurrent, GRUActor, RecurrentConfig


def marked_line(marker: str) -> int:
    """The line of this file marked ``# E:<marker>``."""
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if re.search(rf"# E:{marker}\b", line))


class Item(NamedTuple):
    obs: jax.Array
    action: jax.Array
    reward: jax.Array
    done: jax.Array


class RandomActor(msrl.Actor):
    """Uniform random actions from per-env keys; adds the (zero) params so the params edge is real."""

    def __init__(self, n: int):
        self.n = n

    def act(self, state, params, obs):
        keys, use = split_keys(state["keys"])
        action = jax.vmap(lambda k: jax.random.randint(k, (), 0, self.n))(use)
        return {"keys": keys}, msrl.ActOutput(action=action + jnp.int32(params["w"] * 0))


class SumLearner(msrl.Learner):
    """A learner whose one parameter accumulates the mean reward (plus optional extras) it is given."""

    def init(self, key):
        return {"w": jnp.zeros((), jnp.float32), "updates": jnp.zeros((), jnp.int32)}

    def learn(self, state, batch, **extra):
        w = state["w"] + batch.reward.mean() + sum(jnp.mean(v) for v in extra.values())
        return {"w": w, "updates": state["updates"] + 1}, {"w": w}

    def policy_params(self, state):
        return {"w": state["w"]}


class PlainNumbersLearner(SumLearner):
    """Metrics that hold plain Python numbers beside arrays (a count, a flag, a constant)."""

    def learn(self, state, batch, **extra):
        state, metrics = super().learn(state, batch, **extra)
        return state, {**metrics, "inner": 2, "on": True, "hint": 0.5}


class Base(msrl.Algorithm):
    def __init__(self, steps: int = 3, flag: bool = True):
        super().__init__(SimpleNamespace(steps=steps, flag=flag, inner=2), None)
        self.actor = RandomActor(2)
        self.learner = SumLearner()
        self.buffer = msrl.TrajectoryBuffer(self.capacity())

    def capacity(self) -> int:
        return self.cfg.steps


# ------------------------------------------------------------------------------------------- accepted
class Simple(Base):
    def train_step(self):
        obs = msrl.env_observe()
        for _ in range(self.cfg.steps):
            out = msrl.agent_act(obs)
            next_obs, reward, done = msrl.env_step(out.action)
            msrl.buffer_insert(Item(obs, out.action, reward, done))
            obs = next_obs
        return msrl.agent_learn(msrl.buffer_get())


class LearnsInALoop(Base):
    """``agent_learn`` inside a loop, its metrics first assigned there and holding plain Python numbers."""

    def __init__(self):
        super().__init__()
        self.learner = PlainNumbersLearner()

    def train_step(self):
        obs = msrl.env_observe()
        for _ in range(self.cfg.steps):
            out = msrl.agent_act(obs)
            obs, reward, done = msrl.env_step(out.action)
            msrl.buffer_insert(Item(obs, out.action, reward, done))
        batch = msrl.buffer_get()
        for _ in range(self.cfg.inner):
            metrics = msrl.agent_learn(batch)
        return metrics


class FillsInAFunctionOfItsOwn(Base):
    """A function defined in the scanned loop fills a list of its own (its parameter, not a list made before the
    loop): accepted, and summed as Python sums it."""

    def train_step(self):
        obs, total = msrl.env_observe(), 0.0
        for _ in range(self.cfg.steps):
            out = msrl.agent_act(obs)
            obs, reward, done = msrl.env_step(out.action)

            def with_reward(parts, r):
                parts.append(r.sum())
                return parts

            total = total + sum(with_reward([], reward))
        return {"total": total}


class ActsOnly(Base):
    """Collects, never learns (a data-collection or evaluation loop)."""

    def train_step(self):
        obs = msrl.env_observe()
        out = msrl.agent_act(obs)
        msrl.env_step(out.action)
        return {"acted": jnp.float32(1.0)}

class Nested(Base):
    """Nested loops, the loop index used, statements between API calls, tuple and starred unpacking,
    aliases of the API, a static local, a variable first assigned inside a loop, a static `if` (its untaken branch
    unchecked)."""

    def capacity(self) -> int:
        return self.cfg.steps * self.cfg.inner

    def train_step(self):
        n = self.cfg.inner
        obs = api.env_observe()
        total = jnp.zeros(())
        for i in range(self.cfg.steps):
            scale = jnp.float32(i + 1)
            for j in range(n):
                out = act_alias(obs)
                next_obs, *rest = msrl.env_step(out.action)
                reward, done = rest
                total = total + scale * reward.sum() + j
                msrl.buffer_insert(Item(obs, out.action, reward * scale, done))
                last_reward = reward
                obs = next_obs
                if not self.cfg.flag:  # never taken: not compiled, and not refused (it refused both lines)
                    self.last = reward
                    rewards.append(reward)  # noqa: F821
        if self.cfg.flag:
            metrics = msrl.agent_learn(msrl.buffer_get(), bonus=total)
        else:
            metrics = {}
        if self.cfg.flag:  # without API calls, assigning a name nothing assigned before
            doubled = 2.0 * total
        return {**metrics, "total": total, "last": last_reward.sum(), "i": jnp.float32(i), "doubled": doubled}


class NestedPlainDef(Base):
    """A def of the loop's own that reads only the config: a function wherever a policy cuts the loop (it was a
    local a jitted piece returned nothing of, a NameError where the cut fell after it)."""

    def train_step(self):
        def halve(x, by=2.0):
            return x / by * self.cfg.steps

        obs = msrl.env_observe()
        for _ in range(self.cfg.steps):
            out = msrl.agent_act(obs)
            next_obs, reward, done = msrl.env_step(out.action)
            msrl.buffer_insert(Item(obs, out.action, halve(reward), done))
            obs = next_obs
        return msrl.agent_learn(msrl.buffer_get())


class HelperStatics(Base):
    """A helper whose own locals are compile-time values: a number, a condition, a lambda and a def that returns.
    Wherever a policy cut the helper they crossed as data: 100_000 as int32 (``(k * k) % 7`` was 3, not 4: the
    parameters silently apart from fused's), an `if` on one failed to trace, and the def's `return` was refused as
    the helper's own."""

    def collect_and_learn(self, obs):
        k = 100_000 * self.cfg.steps // self.cfg.steps
        keep = self.cfg.flag
        shrink = lambda x: x * 0.5  # noqa: E731

        def squash(x):
            return jnp.tanh(x)

        for _ in range(self.cfg.steps):
            out = msrl.agent_act(obs)
            obs, reward, done = msrl.env_step(out.action)
            msrl.buffer_insert(Item(obs, out.action, reward, done))
        batch = msrl.buffer_get()
        if not keep:
            batch = batch._replace(reward=-batch.reward)
        return msrl.agent_learn(batch._replace(reward=squash(shrink(batch.reward * ((k * k) % 7)))))

    def train_step(self):
        return self.collect_and_learn(msrl.env_observe())


class Helpers(Base):
    """Helper methods: one that uses the API (inlined, with params, defaults and a return), one that
    does not (called as is)."""

    def collect(self, obs, steps, scale=2.0):
        for _ in range(steps):
            out = msrl.agent_act(obs)
            obs, reward, done = msrl.env_step(out.action)
            msrl.buffer_insert(Item(obs, out.action, self.shape_reward(reward, scale), done))
        return obs

    def shape_reward(self, reward, scale):
        return reward * scale

    def train_step(self):
        obs = self.collect(msrl.env_observe(), 3)
        return msrl.agent_learn(msrl.buffer_get(), last=obs.sum())


# ------------------------------------------------------------------------------------------- rejected
class WhileLoop(Base):
    def train_step(self):
        obs = msrl.env_observe()
        k = 0
        while k < 3:  # E:while
            out = msrl.agent_act(obs)
            obs, reward, done = msrl.env_step(out.action)
            k += 1
        return k


class DataIf(Base):
    def train_step(self):
        obs = msrl.env_observe()
        if obs.sum() > 0:  # E:data_if
            msrl.env_step(msrl.agent_act(obs).action)
        return 0


class NonRange(Base):
    def train_step(self):
        obs = msrl.env_observe()
        for _ in [1, 2]:  # E:non_range
            msrl.env_step(msrl.agent_act(obs).action)
        return 0


class DynamicRange(Base):
    def train_step(self):
        obs = msrl.env_observe()
        n = obs.shape[0]
        for _ in range(n):  # E:dynamic_range
            msrl.env_step(msrl.agent_act(obs).action)
        return 0


class BoundAssignedTwice(Base):
    """(Said "only known at run time" of a bound known at compile time, but assigned twice.)"""

    def train_step(self):
        obs = msrl.env_observe()
        steps = self.cfg.steps
        steps = steps // 2
        for _ in range(steps):  # E:bound_twice
            msrl.env_step(msrl.agent_act(obs).action)
        return 0


class HelperAsValue(Base):
    """(Said "train_step() never calls msrl.env_step()", which the helper does.)"""

    def rollout(self, obs):
        msrl.env_step(msrl.agent_act(obs).action)
        return obs

    def train_step(self):
        roll = self.rollout  # E:helper_value
        roll(msrl.env_observe())
        return 0


class InLambda(Base):
    def train_step(self):
        obs = msrl.env_observe()
        f = lambda o: msrl.agent_act(o)  # E:lambda  # noqa: E731
        msrl.env_step(f(obs).action)
        return 0


class InComprehension(Base):
    def train_step(self):
        obs = msrl.env_observe()
        outs = [msrl.agent_act(obs) for _ in range(2)]  # E:comprehension
        msrl.env_step(outs[0].action)
        return 0


class InIfExp(Base):
    def train_step(self):
        obs = msrl.env_observe()
        out = msrl.agent_act(obs) if self.cfg.flag else None  # E:ifexp
        msrl.env_step(out.action)
        return 0


class BreakInLoop(Base):
    def train_step(self):
        obs = msrl.env_observe()
        for _ in range(3):
            obs, reward, done = msrl.env_step(msrl.agent_act(obs).action)
            break  # E:break
        return 0


class EarlyReturn(Base):
    def train_step(self):
        obs = msrl.env_observe()
        return obs  # E:early_return
        msrl.env_step(msrl.agent_act(obs).action)


class SelfMutation(Base):
    def train_step(self):
        obs = msrl.env_observe()
        self.last_obs = obs  # E:self_mutation
        msrl.env_step(msrl.agent_act(obs).action)
        return 0


class DrawsWithNumpy(Base):
    """np.random in the loop: drawn once, while the loop is traced (it trained on that one number)."""

    def train_step(self):
        obs = msrl.env_observe()
        for _ in range(self.cfg.steps):
            explore = np.random.rand() < 0.5  # E:numpy_random
            out = msrl.agent_act(obs)
            obs, reward, done = msrl.env_step(out.action * explore)
            msrl.buffer_insert(Item(obs, out.action, reward, done))
        return msrl.agent_learn(msrl.buffer_get())


class DrawsFromItsGenerator(Base):
    """A numpy Generator kept on self: its draw, like np.random's, is made once while the loop is traced (it ran,
    under fused and under single_learner_fine with another number: fine traces the loop once more)."""

    def __init__(self):
        super().__init__()
        self.rng = np.random.default_rng(0)

    def train_step(self):
        obs = msrl.env_observe()
        out = msrl.agent_act(obs)
        obs, reward, done = msrl.env_step(out.action)
        msrl.buffer_insert(Item(obs, out.action, reward * self.rng.random(), done))  # E:generator_draw
        return msrl.agent_learn(msrl.buffer_get())


class CountsWithNext(Base):
    """next() of an iterator kept on self: one number per trace, not per iteration."""

    def __init__(self):
        super().__init__()
        self.counter = itertools.count()

    def train_step(self):
        obs = msrl.env_observe()
        out = msrl.agent_act(obs)
        obs, reward, done = msrl.env_step(out.action)
        msrl.buffer_insert(Item(obs, out.action, reward + next(self.counter) % 3, done))  # E:next_counter
        return msrl.agent_learn(msrl.buffer_get())


class CountingActor(RandomActor):
    def __init__(self, n):
        super().__init__(n)
        self.count = itertools.count()

    def act(self, state, params, obs):
        state, out = super().act(state, params, obs)
        return state, out._replace(action=out.action * (next(self.count) % 2))  # E:actor_next


class ActsCounting(Simple):
    def __init__(self):
        super().__init__()
        self.actor = CountingActor(2)


class DrawsOnlyIfAsked(Simple):
    """np.random in an ``if`` on a compile-time condition that is false: that branch is neither compiled nor
    refused (it was refused, against the README)."""

    def train_step(self):
        if not self.cfg.flag:
            noise = np.random.rand()  # noqa: F841 (never runs: flag is true)
        return super().train_step()


class NumpyRandomActor(RandomActor):
    def act(self, state, params, obs):
        state, out = super().act(state, params, obs)
        return state, out._replace(action=out.action * (np.random.rand() < 0.5))  # E:actor_numpy_random


class ActsWithNumpy(Simple):
    """np.random in the actor's act(): fixed by JAX's trace (the same action every step, without a word)."""

    def __init__(self):
        super().__init__()
        self.actor = NumpyRandomActor(2)


class ValueNamedMetric(Base):
    def train_step(self):
        obs = msrl.env_observe()
        for _ in range(self.cfg.steps):
            out = msrl.agent_act(obs)
            obs, reward, done = msrl.env_step(out.action)
            msrl.buffer_insert(Item(obs, out.action, reward, done))
        metrics = msrl.agent_learn(msrl.buffer_get())
        return {f"w_{metrics['w']}": metrics["w"]}  # E:value_key


class StepsATuple(Base):
    def train_step(self):
        obs = msrl.env_observe()
        out = msrl.agent_act(obs)
        msrl.env_step((out.action, out.action))  # E:action_tuple
        return {}


class StepsFewerEnvs(Base):
    def train_step(self):
        obs = msrl.env_observe()
        out = msrl.agent_act(obs)
        msrl.env_step(out.action[:2])  # E:action_count
        return {}


class JitsItsHelper(Base):
    """A helper that uses the API, wrapped by jax.jit (it said "train_step() never calls msrl.env_step()")."""

    @jax.jit
    def rollout(self):
        obs = msrl.env_observe()
        msrl.env_step(msrl.agent_act(obs).action)

    def train_step(self):
        self.rollout()  # E:jitted_helper
        return {}


class CountingLearner(SumLearner):
    def learn(self, state, batch, **extra):
        self.updates = getattr(self, "updates", 0) + 1  # E:learner_mutation
        return super().learn(state, batch, **extra)


class LearnsCounting(Simple):
    """A learner that counts its updates in itself: JAX traces learn() a few times (it counted 2 under fused and 4
    under a split policy, without a word)."""

    def __init__(self):
        super().__init__()
        self.learner = CountingLearner()


class HelperMutation(Base):
    """A helper without API calls, called as it is, that changes ``self``: its value would depend on how often
    the loop is traced."""

    def bump(self):
        self.calls = getattr(self, "calls", 0) + 1
        return 1.0 / self.calls

    def train_step(self):
        obs = msrl.env_observe()
        out = msrl.agent_act(obs)
        _, reward, done = msrl.env_step(out.action)
        msrl.buffer_insert(Item(obs, out.action, reward * self.bump(), done))  # E:helper_mutation
        return msrl.agent_learn(msrl.buffer_get())

class ClassAttributeMutation(Base):
    """(Accepted: each policy traced the loop another number of times, so each computed another reward.)"""

    scale = 1.0

    def train_step(self):
        obs = msrl.env_observe()
        for _ in range(self.cfg.steps):
            out = msrl.agent_act(obs)
            obs, reward, done = msrl.env_step(out.action)
            ClassAttributeMutation.scale = ClassAttributeMutation.scale * 0.5  # E:class_mutation
            msrl.buffer_insert(Item(obs, out.action, reward * ClassAttributeMutation.scale, done))
        return msrl.agent_learn(msrl.buffer_get())


class SelfListFill(Base):
    """A list held by ``self`` filled in the loop (its length counted the traces, not the steps)."""

    seen: list = []

    def train_step(self):
        obs = msrl.env_observe()
        for _ in range(self.cfg.steps):
            out = msrl.agent_act(obs)
            obs, reward, done = msrl.env_step(out.action)
            self.seen.append(1)  # E:self_fill
            msrl.buffer_insert(Item(obs, out.action, reward / len(self.seen), done))
        return msrl.agent_learn(msrl.buffer_get())


class AliasedDictWrite(Base):
    """A dict held by ``self``, written through a local bound to it."""

    stats = {"n": 0}

    def train_step(self):
        obs, stats = msrl.env_observe(), self.stats
        out = msrl.agent_act(obs)
        obs, reward, done = msrl.env_step(out.action)
        stats["n"] = stats["n"] + 1  # E:alias_write
        msrl.buffer_insert(Item(obs, out.action, reward / stats["n"], done))
        return msrl.agent_learn(msrl.buffer_get())


class HelperClassMutation(Base):
    """A helper without API calls that changes its class (``type(self).x = ...``)."""

    def bump(self):
        type(self).calls = getattr(type(self), "calls", 0) + 1
        return 1.0 / type(self).calls

    def train_step(self):
        obs = msrl.env_observe()
        out = msrl.agent_act(obs)
        _, reward, done = msrl.env_step(out.action)
        msrl.buffer_insert(Item(obs, out.action, reward * self.bump(), done))  # E:helper_class_mutation
        return msrl.agent_learn(msrl.buffer_get())


class WrongArity(Base):
    def train_step(self):
        obs = msrl.env_observe()
        out = msrl.agent_act()  # E:arity
        msrl.env_step(out.action)
        return 0


class StateArgument(Base):
    def train_step(self):
        obs = msrl.env_observe()
        out = msrl.agent_act(self.actor, obs)  # E:state_arg
        msrl.env_step(out.action)
        return 0


class ApiAsValue(Base):
    def train_step(self):
        obs = msrl.env_observe()
        act = msrl.agent_act  # E:api_value
        msrl.env_step(act(obs).action)
        return 0


class TryBlock(Base):
    def train_step(self):
        obs = msrl.env_observe()
        try:  # E:try
            msrl.env_step(msrl.agent_act(obs).action)
        except ValueError:
            pass
        return 0


class NestedDef(Base):
    def train_step(self):
        def step(o):  # E:nested_def
            return msrl.env_step(msrl.agent_act(o).action)

        obs = msrl.env_observe()
        step(obs)
        return 0


def rollout(obs):
    """A function of a module (not a method of the algorithm) that steps the environments itself."""
    return msrl.env_step(msrl.agent_act(obs).action)


class ModuleFunction(Base):
    def train_step(self):
        obs = msrl.env_observe()
        rollout(obs)  # E:module_function
        return 0


class Roller:
    def rollout(self, obs):
        return msrl.env_step(msrl.agent_act(obs).action)


class AnotherObjectsMethod(Base):
    """A method of an object the algorithm holds that steps the environments itself (it "never calls
    msrl.env_step")."""

    roller = Roller()

    def train_step(self):
        obs = msrl.env_observe()
        self.roller.rollout(obs)
        return 0


class NoEnvStep(Base):
    def train_step(self):
        obs = msrl.env_observe()
        return msrl.agent_act(obs)


class ShapeBug(Base):
    def train_step(self):
        obs = msrl.env_observe()
        out = msrl.agent_act(obs)
        bad = obs @ jnp.ones((7, 3))  # E:shape_bug
        msrl.env_step(out.action)
        return bad


class ReservedName(Base):
    def train_step(self):
        obs = msrl.env_observe()
        _s_env = obs  # E:reserved
        msrl.env_step(msrl.agent_act(_s_env).action)
        return 0


class GetBeforeInsert(Base):
    def train_step(self):
        obs = msrl.env_observe()
        batch = msrl.buffer_get()  # E:get_first
        msrl.buffer_insert(Item(obs, obs[:, 0], obs[:, 0], obs[:, 0] > 0))
        msrl.env_step(msrl.agent_act(obs).action)
        return msrl.agent_learn(batch)


class InsertsTwoShapes(Base):
    """A second insert of a narrower observation (written into a corner of each row, were it not refused)."""

    def train_step(self):
        obs = msrl.env_observe()
        out = msrl.agent_act(obs)
        msrl.env_step(out.action)
        msrl.buffer_insert(Item(obs, out.action, obs[:, 0], obs[:, 0] > 0))
        msrl.buffer_insert(Item(obs[:, :2], out.action, obs[:, 0], obs[:, 0] > 0))  # E:insert_shape
        return msrl.agent_learn(msrl.buffer_get())


class IndexIf(Base):
    """Treats the first step of a rollout apart with a Python conditional on the loop's index (a traced value)."""

    def train_step(self):
        obs = msrl.env_observe()
        for i in range(self.cfg.steps):
            out = msrl.agent_act(obs)
            next_obs, reward, done = msrl.env_step(out.action)
            first = reward * 2.0 if i == 0 else reward  # E:index_if
            msrl.buffer_insert(Item(obs, out.action, first, done))
            obs = next_obs
        return msrl.agent_learn(msrl.buffer_get())

class HelperEarlyReturn(Base):
    def helper(self, obs):
        if self.cfg.flag:
            return obs  # E:helper_return
        return msrl.agent_act(obs)

    def train_step(self):
        obs = msrl.env_observe()
        msrl.env_step(self.helper(obs).action)
        return 0


class WithArgs(Base):
    def train_step(self, n):  # E:args
        obs = msrl.env_observe()
        msrl.env_step(msrl.agent_act(obs).action)
        return n


class NestedReturn(Base):
    def train_step(self):
        obs = msrl.env_observe()
        msrl.env_step(msrl.agent_act(obs).action)
        if self.cfg.flag:
            return obs  # E:nested_return
        return 0


class StaticHelper(Base):
    @staticmethod
    def act(obs):
        return msrl.agent_act(obs)

    def train_step(self):
        obs = msrl.env_observe()
        msrl.env_step(self.act(obs).action)  # E:static_helper
        return 0


def keep(fn):
    return fn


class Decorated(Base):
    @keep
    def train_step(self):
        obs = msrl.env_observe()
        while obs.sum() > 0:  # E:decorated
            msrl.env_step(msrl.agent_act(obs).action)
        return 0


class NoLearner(Base):
    def __init__(self):
        super().__init__()
        self.learner = None

    def train_step(self):
        obs = msrl.env_observe()
        out = msrl.agent_act(obs)  # E:no_learner
        msrl.env_step(out.action)
        return 0


class HostLoopDetails(Base):
    """A conditional assignment outside the API, a keyword insert, and no return."""

    def train_step(self):
        coef = 1.0
        if not self.cfg.flag:
            coef = 2.0
        obs = msrl.env_observe()
        for _ in range(self.cfg.steps):
            out = msrl.agent_act(obs)
            next_obs, reward, done = msrl.env_step(out.action)
            msrl.buffer_insert(item=Item(obs, out.action, reward * coef, done))
            obs = next_obs
        msrl.agent_learn(msrl.buffer_get())


class StateOnlyLearner(SumLearner):
    def learn(self, state, batch, **extra):
        return super().learn(state, batch)[0]  # the metrics forgotten


class GrowingLearner(SumLearner):
    def learn(self, state, batch, **extra):
        state, metrics = super().learn(state, batch)
        return {**state, "seen": batch.reward.sum()}, metrics  # a key init did not make


class LearnReturnsState(Simple):
    def __init__(self):
        super().__init__()
        self.learner = StateOnlyLearner()

    def train_step(self):
        obs = msrl.env_observe()
        out = msrl.agent_act(obs)
        next_obs, reward, done = msrl.env_step(out.action)
        msrl.buffer_insert(Item(obs, out.action, reward, done))
        return msrl.agent_learn(msrl.buffer_get())  # E:learn_state_only


class LearnGrowsState(LearnReturnsState):
    def __init__(self):
        super().__init__()
        self.learner = GrowingLearner()


class CarryChangesDtype(Base):
    """Traces, but its loop carries `obs` as float32 in and float16 out: JAX's scan refuses it when it runs."""

    def train_step(self):
        obs = msrl.env_observe()
        for _ in range(self.cfg.steps):  # E:carry_dtype
            out = msrl.agent_act(obs)
            next_obs, reward, done = msrl.env_step(out.action)
            msrl.buffer_insert(Item(obs, out.action, reward, done))
            obs = next_obs.astype(jnp.float16)
        return msrl.agent_learn(msrl.buffer_get())


class LearnFeedsActing(Base):
    """Two rollouts an iteration; the second's rewards add what the first learn returned: a buffer insert that uses
    a learner's output (single_learner_coarse would have to put it on the learner's side, away from the buffer)."""

    def rollout(self, obs, bonus):
        for _ in range(self.cfg.steps):
            out = msrl.agent_act(obs)
            next_obs, reward, done = msrl.env_step(out.action)
            msrl.buffer_insert(Item(obs, out.action, reward + bonus, done))  # E:fed_insert
            obs = next_obs
        return obs

    def train_step(self):
        obs = self.rollout(msrl.env_observe(), 0.0)
        first = msrl.agent_learn(msrl.buffer_get())  # E:first_learn
        self.rollout(obs, 0.1 * first["w"])
        return msrl.agent_learn(msrl.buffer_get())


class FillsAList(Base):
    """Monte-Carlo returns from a Python list of each step's reward: under lax.scan the list would hold one traced
    step (it compiled, then failed inside XLA with a count of inputs)."""

    def train_step(self):
        obs, rewards = msrl.env_observe(), []
        for _ in range(self.cfg.steps):
            out = msrl.agent_act(obs)
            obs, reward, done = msrl.env_step(out.action)
            if self.cfg.steps:  # (decidable: the append is in the loop's body all the same)
                rewards.append(reward)  # E:fills_list
        return jnp.stack(rewards).sum()


REJECTED = {
    "while": WhileLoop,
    "data_if": DataIf,
    "non_range": NonRange,
    "dynamic_range": DynamicRange,
    "bound_twice": BoundAssignedTwice,
    "helper_value": HelperAsValue,
    "lambda": InLambda,
    "comprehension": InComprehension,
    "ifexp": InIfExp,
    "break": BreakInLoop,
    "early_return": EarlyReturn,
    "self_mutation": SelfMutation,
    "numpy_random": DrawsWithNumpy,
    "actor_numpy_random": ActsWithNumpy,
    "generator_draw": DrawsFromItsGenerator,
    "next_counter": CountsWithNext,
    "actor_next": ActsCounting,
    "learner_mutation": LearnsCounting,
    "action_tuple": StepsATuple,  # (an error from inside the env: "can't multiply sequence by non-int")
    "action_count": StepsFewerEnvs,  # (jax's "vmap got inconsistent sizes")
    "jitted_helper": JitsItsHelper,
    "value_key": ValueNamedMetric,  # (a column named "w_JitTracer(float32[])" was logged)
    "helper_mutation": HelperMutation,
    "class_mutation": ClassAttributeMutation,
    "self_fill": SelfListFill,
    "alias_write": AliasedDictWrite,
    "helper_class_mutation": HelperClassMutation,
    "arity": WrongArity,
    "state_arg": StateArgument,
    "api_value": ApiAsValue,
    "try": TryBlock,
    "nested_def": NestedDef,
    "module_function": ModuleFunction,
    "shape_bug": ShapeBug,
    "reserved": ReservedName,
    "get_first": GetBeforeInsert,
    "helper_return": HelperEarlyReturn,
    "args": WithArgs,
    "nested_return": NestedReturn,
    "static_helper": StaticHelper,
    "decorated": Decorated,
    "no_learner": NoLearner,
    "learn_state_only": LearnReturnsState,
    "insert_shape": InsertsTwoShapes,
    "fills_list": FillsAList,
}


# ------------------------------------------------------------- rows: per-environment, or mixing environments
def _returns_to_go(reward, done, gamma=0.9):
    def back(g, t):
        g = t[0] + gamma * g * (1.0 - t[1])
        return g, g

    return jax.lax.scan(back, jnp.zeros(reward.shape[1]), (reward, done), reverse=True)[1]


def _conv_pool_top(obs):
    """A network's per-environment layers: a convolution over features, max-pooling, the top 2."""
    conv = jax.lax.conv_general_dilated(obs[:, :, None], jnp.ones((2, 1, 3)), (1,), "VALID",
                                        dimension_numbers=("NWC", "WIO", "NWC"))
    pooled = jax.lax.reduce_window(conv, -jnp.inf, jax.lax.max, (1, 2, 1), (1, 1, 1), "VALID")
    return jax.lax.top_k(pooled.reshape(obs.shape[0], -1), 2)[0].sum(-1)


class PerEnvRows(Base):
    """Statements on the actor side that compute each environment's row from that environment alone, with
    what looks like mixing but is not: a count of environments used only for shapes, a scan over time, a
    product over features, indexing per row, a per-environment value broadcast over features, a stack along a
    new feature axis, a slice of the time axis; and a variable first assigned inside the loop (a replica starts
    it from zeros of its share's shape)."""

    def train_step(self):
        obs = msrl.env_observe()
        n = obs.shape[0]
        seen = jnp.zeros(n)
        w = jnp.arange(obs.shape[-1], dtype=jnp.float32)
        for _ in range(self.cfg.steps):
            out = msrl.agent_act(obs)
            next_obs, reward, done = msrl.env_step(out.action)
            feature = jnp.take_along_axis(obs, out.action[:, None], -1)[:, 0] + jnp.tanh(obs @ w)
            feature += jnp.stack([reward, seen], -1).sum(-1) + (obs * reward[:, None]).max(-1)
            feature += _conv_pool_top(obs)
            seen = jnp.where(done, 0.0, seen + 1.0)
            msrl.buffer_insert(Item(obs, out.action, reward + 0.01 * feature + 0.001 * seen, done))
            obs = next_obs
            last_reward = reward * 0.5
        batch = msrl.buffer_get()
        g = _returns_to_go(batch.reward, batch.done)
        first = jax.tree.map(lambda x: x[:1], batch)
        return msrl.agent_learn(batch._replace(reward=g), first=first.reward, last=last_reward)


class MixesMean(Base):
    def train_step(self):
        obs = msrl.env_observe()
        for _ in range(self.cfg.steps):
            z = (obs - obs.mean(axis=0)) / (obs.std(axis=0) + 1e-3)  # E:mix_mean
            out = msrl.agent_act(z)
            next_obs, reward, done = msrl.env_step(out.action)
            msrl.buffer_insert(Item(z, out.action, reward, done))
            obs = next_obs
        return msrl.agent_learn(msrl.buffer_get())


class MixesInArgument(Base):
    def train_step(self):
        obs = msrl.env_observe()
        for _ in range(self.cfg.steps):
            out = msrl.agent_act(obs)
            next_obs, reward, done = msrl.env_step(out.action)
            msrl.buffer_insert(Item(obs, out.action, reward - reward.max(), done))  # E:mix_argument
            obs = next_obs
        return msrl.agent_learn(msrl.buffer_get())


class MixesInActArgument(Base):
    def train_step(self):
        obs = msrl.env_observe()
        for _ in range(self.cfg.steps):
            out = msrl.agent_act(obs - obs.mean(axis=0))  # E:mix_act_argument
            next_obs, reward, done = msrl.env_step(out.action)
            msrl.buffer_insert(Item(obs, out.action, reward, done))
            obs = next_obs
        return msrl.agent_learn(msrl.buffer_get())


class MixesNoise(Base):
    def train_step(self):
        obs = msrl.env_observe()
        for t in range(self.cfg.steps):
            out = msrl.agent_act(obs)
            next_obs, reward, done = msrl.env_step(out.action)
            noise = jax.random.normal(jax.random.fold_in(jax.random.PRNGKey(7), t), reward.shape)  # E:mix_noise
            msrl.buffer_insert(Item(obs, out.action, reward + noise, done))
            obs = next_obs
        return msrl.agent_learn(msrl.buffer_get())


class MixesSlice(Base):
    def train_step(self):
        obs = msrl.env_observe()
        for _ in range(self.cfg.steps):
            out = msrl.agent_act(obs)
            next_obs, reward, done = msrl.env_step(out.action)
            msrl.buffer_insert(Item(obs, out.action, reward, done))
            obs = next_obs
        batch = msrl.buffer_get()
        half = jax.tree.map(lambda x: x[:, : x.shape[1] // 2], batch)  # E:mix_slice
        return msrl.agent_learn(half)


class MixesCount(Base):
    def train_step(self):
        obs = msrl.env_observe()
        n = obs.shape[0]
        for _ in range(self.cfg.steps):
            out = msrl.agent_act(obs)
            next_obs, reward, done = msrl.env_step(out.action)
            msrl.buffer_insert(Item(obs, out.action, reward / n, done))  # E:mix_count
            obs = next_obs
        return msrl.agent_learn(msrl.buffer_get())


class MixesInAFunction(Base):
    """A lambda of the loop's index, defined on the actors' side (it was "cannot be traced alone (TypeError: ...
    returned a value of type <class 'function'>)")."""

    def train_step(self):
        obs = msrl.env_observe()
        for t in range(self.cfg.steps):
            scale = lambda r: r * (t + 1)  # E:mix_function  # noqa: E731
            out = msrl.agent_act(obs)
            next_obs, reward, done = msrl.env_step(out.action)
            msrl.buffer_insert(Item(obs, out.action, scale(reward), done))
            obs = next_obs
        return msrl.agent_learn(msrl.buffer_get())


class BrokenLearner(SumLearner):
    armed = True  # False: only once the test arms it (after compiling: at run time)

    def learn(self, state, batch, **extra):
        if self.armed:
            raise ValueError("the learner's own bug")  # E:learner_raises
        return super().learn(state, batch, **extra)


class InitRaisingActor(RandomActor):
    def init(self, key, env_ids):
        return {"keys": msrl.per_env_key(key, env_ids)}  # E:init_raises (a typo: per_env_keys)


class InitRaises(Base):
    def __init__(self):
        super().__init__()
        self.actor = InitRaisingActor(2)

    def train_step(self):
        obs = msrl.env_observe()
        out = msrl.agent_act(obs)
        obs, reward, done = msrl.env_step(out.action)
        msrl.buffer_insert(Item(obs, out.action, reward, done))
        return msrl.agent_learn(msrl.buffer_get())


class LearnerRaises(Base):
    def __init__(self):
        super().__init__()
        self.learner = BrokenLearner()

    def train_step(self):
        obs = msrl.env_observe()
        for _ in range(self.cfg.steps):
            out = msrl.agent_act(obs)
            obs, reward, done = msrl.env_step(out.action)
            msrl.buffer_insert(Item(obs, out.action, reward, done))
        return msrl.agent_learn(msrl.buffer_get())  # E:calls_learner


class FloatsItsMetric(Base):
    """``float()`` of a metric: a value the program computes, not one known when it compiles."""

    def train_step(self):
        out = msrl.agent_act(msrl.env_observe())
        msrl.env_step(out.action)
        return {"mean_action": float(out.action.mean())}  # E:floats_metric


class MixesCappedCount(Base):
    """``min(n, 4)`` at the loop's 4 environments and at 8 is 4, but 2 on a replica holding 2 of them."""

    def train_step(self):
        obs = msrl.env_observe()
        for _ in range(self.cfg.steps):
            out = msrl.agent_act(obs)
            next_obs, reward, done = msrl.env_step(out.action)
            msrl.buffer_insert(Item(obs, out.action, reward * min(reward.shape[0], 4), done))  # E:mix_capped
            obs = next_obs
        return msrl.agent_learn(msrl.buffer_get())


class MixesCountBranch(Base):
    """A Python ``if`` on the count: true at 4 and 8 environments, false on a replica's 2."""

    def train_step(self):
        obs = msrl.env_observe()
        for _ in range(self.cfg.steps):
            out = msrl.agent_act(obs)
            next_obs, reward, done = msrl.env_step(out.action)
            reward = reward * 2.0 if reward.shape[0] > 2 else reward  # E:mix_branch
            msrl.buffer_insert(Item(obs, out.action, reward, done))
            obs = next_obs
        return msrl.agent_learn(msrl.buffer_get())


class CenteringActor(RandomActor):
    """Acts on observations centred over the environments it is given: a mean over a replica's share."""

    def act(self, state, params, obs):
        state, out = super().act(state, params, obs)
        return state, out._replace(action=out.action * (obs[:, 0] > obs[:, 0].mean()))


class SlotActor(RandomActor):
    """Numbers its environments by position (0, 1, ... in each replica), not by their global index."""

    def init(self, key, env_ids):
        return {**super().init(key, env_ids), "slot": jnp.arange(env_ids.shape[0])}

    def act(self, state, params, obs):
        new, out = super().act(state, params, obs)
        return {**new, "slot": state["slot"]}, out._replace(action=(out.action + state["slot"]) % self.n)


class MixesInAct(Base):
    actor_type = CenteringActor

    def __init__(self):
        super().__init__()
        self.actor = self.actor_type(2)

    def train_step(self):
        obs = msrl.env_observe()
        for _ in range(self.cfg.steps):
            out = msrl.agent_act(obs)  # E:mix_act
            obs, reward, done = msrl.env_step(out.action)
            msrl.buffer_insert(Item(obs, out.action, reward, done))
        return msrl.agent_learn(msrl.buffer_get())


class MixesInInit(MixesInAct):
    actor_type = SlotActor

    def train_step(self):
        obs = msrl.env_observe()
        for _ in range(self.cfg.steps):
            out = msrl.agent_act(obs)  # E:mix_init
            obs, reward, done = msrl.env_step(out.action)
            msrl.buffer_insert(Item(obs, out.action, reward, done))
        return msrl.agent_learn(msrl.buffer_get())


class HandsCount(Base):
    def train_step(self):
        obs = msrl.env_observe()
        n = obs.shape[0]  # E:hands_count
        for _ in range(self.cfg.steps):
            out = msrl.agent_act(obs)
            next_obs, reward, done = msrl.env_step(out.action)
            msrl.buffer_insert(Item(obs, out.action, reward, done))
            obs = next_obs
        return msrl.agent_learn(msrl.buffer_get(), scale=1.0 / n)


class MixesBeforeReplay(Base):
    def __init__(self):
        super().__init__()
        self.buffer = msrl.UniformBuffer(64)

    def train_step(self):
        obs = msrl.env_observe()
        for _ in range(self.cfg.steps):
            out = msrl.agent_act(obs)
            next_obs, reward, done = msrl.env_step(out.action)
            msrl.buffer_insert(Item(obs, out.action, reward * (obs[:, 0] - obs[:, 0].mean()), done))  # E:mix_replay
            obs = next_obs
        sample = msrl.buffer_sample(4)
        return msrl.agent_learn(sample.item)


class MixesInReturn(Base):
    """Learns, but returns numbers of its own: the return runs on the actor side, per replica."""

    def train_step(self):
        obs = msrl.env_observe()
        total = jnp.zeros(obs.shape[0])
        for _ in range(self.cfg.steps):
            out = msrl.agent_act(obs)
            next_obs, reward, done = msrl.env_step(out.action)
            msrl.buffer_insert(Item(obs, out.action, reward, done))
            total, obs = total + obs[:, 0], next_obs
        msrl.agent_learn(msrl.buffer_get())
        return {"first_env": total[0], "seen": jnp.float32(self.cfg.steps)}  # E:mix_return


MIXING = {  # marker: (loop, what the refusal says)
    "mix_mean": (MixesMean, "reduces over the environment axis"),
    "mix_argument": (MixesInArgument, "reduces over the environment axis"),
    "mix_noise": (MixesNoise, "draws random numbers for the environments by their position"),
    "mix_slice": (MixesSlice, "takes some environments' rows"),
    "mix_return": (MixesInReturn, "takes some environments' rows"),
    "mix_count": (MixesCount, "depends on how many environments a replica holds"),
    "mix_capped": (MixesCappedCount, "hold 2 of the 4 environments each, but it uses a number that depends on"),
    "mix_branch": (MixesCountBranch, "hold 2 of the 4 environments each, but it computes differently for different"),
    "hands_count": (HandsCount, "depends on how many environments a replica holds"),
    "mix_function": (MixesInAFunction, r"defines a function of t, known only as the loop runs, .* give t to it as "
                                       r"arguments \(`lambda x, t: ...`\)"),
    "mix_act_argument": (MixesInActArgument, "runs this statement on each .* reduces over"),  # not the actor's act
    "mix_act": (MixesInAct, r"runs CenteringActor.act\(\) \(.*loops.py:\d+\), called here, .* reduces over"),
    "mix_init": (MixesInInit, r"initializes the actor .* SlotActor.init\(\) \(.*loops.py:\d+\) numbers the "
                              "environments by their position"),
}


# ------------------------------------------------------------------------------------------- diverging
class GrowthConfig(msrl.AlgorithmConfig):
    name: str = "growth"
    lr: float = 0.1
    steps: int = 4
    fail_at: int = 0  # > 0: a host callback in the learner raises at that update


def _sensor_check(updates, fail_at):
    if int(updates) >= int(fail_at):
        raise RuntimeError(f"sensor offline at update {int(updates)}")


class GrowthLearner(SumLearner):
    """w <- w * (1 + lr): a learning rate of 1e9 overflows float32 in the fifth update."""

    def __init__(self, lr: float, fail_at: int = 0):
        self.lr, self.fail_at = lr, fail_at

    def init(self, key):
        return {"w": jnp.ones((), jnp.float32), "updates": jnp.zeros((), jnp.int32)}

    def learn(self, state, batch, **extra):
        if self.fail_at:
            jax.debug.callback(_sensor_check, state["updates"], self.fail_at)
        w = state["w"] * (1.0 + self.lr)
        return {"w": w, "updates": state["updates"] + 1}, {"loss": w - w + batch.reward.mean()}


@msrl.register_algorithm("growth")
class Growth(Simple):
    Config = GrowthConfig

    def __init__(self, cfg, ctx):
        msrl.Algorithm.__init__(self, cfg, ctx)
        self.actor = RandomActor(ctx.env_spec.action_space.n)
        self.learner = GrowthLearner(cfg.lr, cfg.fail_at)
        self.buffer = msrl.TrajectoryBuffer(cfg.steps)


# ------------------------------------------------------------------------------------------- sliced samples
class Tagged(NamedTuple):
    obs: jax.Array
    env: jax.Array  # the environment's global index


class TaggedAct(NamedTuple):
    action: jax.Array
    env: jax.Array


class TaggingActor(RandomActor):
    def init(self, key, env_ids):
        return {**super().init(key, env_ids), "env": jnp.asarray(env_ids, jnp.int32)}

    def act(self, state, params, obs):
        keys, out = super().act({"keys": state["keys"]}, params, obs)
        return {**state, **keys}, TaggedAct(out.action, state["env"])


class SlicingLearner(SumLearner):
    """Learns on one sample in ``updates`` contiguous slices (as msrl.rl.several_updates does); logs the share
    of each slice's rows that come from the first half of the environments."""

    def __init__(self, updates: int, num_envs: int):
        self.updates, self.num_envs = updates, num_envs

    def learn(self, state, sample):
        low = (sample.item.env < self.num_envs // 2).reshape(self.updates, -1).mean(axis=1)
        return state, {f"slice{i}_low": low[i] for i in range(self.updates)}


class SlicesConfig(msrl.AlgorithmConfig):
    name: str = "slices"
    batch_size: int = 16
    updates: int = 2


@msrl.register_algorithm("slices")
class Slices(msrl.Algorithm):
    """One sample of ``batch_size * updates`` transitions, learned on in slices."""

    Config = SlicesConfig

    def __init__(self, cfg, ctx):
        super().__init__(cfg, ctx)
        self.actor = TaggingActor(ctx.env_spec.action_space.n)
        self.learner = SlicingLearner(cfg.updates, ctx.num_envs)
        self.buffer = msrl.UniformBuffer(1024)

    def train_step(self):
        obs = msrl.env_observe()
        out = msrl.agent_act(obs)
        msrl.env_step(out.action)
        msrl.buffer_insert(Tagged(obs, out.env))
        return msrl.agent_learn(msrl.buffer_sample(self.cfg.batch_size * self.cfg.updates))


# ------------------------------------------------------------------------------------------- host envs
class Shifty(gymnasium.Env):
    """CartPole-shaped until its 40th step (20th for "explode"), then by ``mode``: a wrong observation shape,
    a wrong dtype, NaN, or an exception; a reward that is not one number ("rewards": two, "text": a string) or
    beyond float32's range ("huge"); or
    a ``truncated`` that is not a bool ("flag": a string). "slow": each step takes 0.5 s; "hang": an hour."""

    observation_space = gymnasium.spaces.Box(-1.0, 1.0, (4,), np.float32)
    action_space = gymnasium.spaces.Discrete(2)

    def __init__(self, mode: str = "shape"):
        self.mode = mode

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(4, np.float32), {}

    def step(self, action):
        self.t += 1
        obs = np.zeros(4, np.float32)
        if self.mode == "explode" and self.t > 20:
            raise RuntimeError("environment exploded on purpose")
        if self.mode == "slow":
            time.sleep(0.5)
        if self.mode == "hang":
            time.sleep(3600)
        if self.t >= 40 and self.mode == "flag":
            return obs, 1.0, False, "no", {}
        if self.t >= 40 and self.mode in ("rewards", "text", "huge"):
            return obs, {"rewards": np.ones(2), "text": "1.0", "huge": 1e300}[self.mode], False, False, {}
        if self.t >= 40:
            obs = {"shape": np.zeros(5, np.float32), "dtype": obs.astype(np.float64),
                   "nan": np.full(4, np.nan, np.float32)}[self.mode]
        return obs, 1.0, False, False, {}


gymnasium.register(id="MsrlShifty-v0", entry_point=Shifty)


class Quirky(gymnasium.Env):
    """Gymnasium-API corners, by ``mode``: "limit" ends in a terminal state on its 5th step, which its
    TimeLimit of 5 also truncates; "start" takes actions 1..3 (``Discrete(3, start=1)``) and refuses others;
    "old_step" and "old_reset" return what the old Gym API did; "wide" says its observations have 3 numbers;
    "unbounded" takes any real action (``Box(-inf, inf)``), "narrow" one in a float64 ``Box(-0.012, 0.012)`` (in float32
    0.0120000001) and refuses others; "fixed" two actions, the second fixed at 0.5 (low == high there); "ints" takes a
    Box of int32 actions; "pixels" observes uint8 (its space says
    so), "sloppy" float32 where its space says uint8; "mixed" takes 4 actions where it is the second, fourth ...
    instance made in its process, else 3."""

    made = 0

    def __init__(self, mode: str = "limit", render_mode: str | None = None):  # (it has no render())
        self.mode = mode
        Quirky.made += 1
        self.observation_space = gymnasium.spaces.Box(0, 255, (2,), np.uint8) if mode in ("pixels", "sloppy") else \
            gymnasium.spaces.Box(-10.0, 10.0, (3 if mode == "wide" else 2,), np.float32)
        self.dtype = np.uint8 if mode == "pixels" else np.float32
        bound = {"unbounded": np.inf, "narrow": 0.012}.get(mode)
        self.action_space = (gymnasium.spaces.Box(-bound, bound, (1,), np.float64) if bound else
                             gymnasium.spaces.Box(np.array([-1, 0.5], np.float32), np.array([1, 0.5], np.float32))
                             if mode == "fixed" else
                             gymnasium.spaces.Box(-2, 2, (1,), np.int32) if mode == "ints" else
                             gymnasium.spaces.Discrete(4 if mode == "mixed" and Quirky.made % 2 == 0 else 3,
                                                       start=1 if mode == "start" else 0))

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        obs = np.zeros(2, self.dtype)
        return obs if self.mode == "old_reset" else (obs, {})

    def step(self, action):
        if not self.action_space.contains(action):
            raise ValueError(f"action {action} is not in {self.action_space}")
        self.t += 1
        obs = np.full(2, 250 + self.t, self.dtype)
        if self.mode == "old_step":
            return obs, 1.0, False, {}
        return obs, 1.0, self.t >= 5, False, {}


gymnasium.register(id="MsrlQuirky-v0", entry_point=Quirky, max_episode_steps=5)


# ------------------------------------------------------------------------------------------- EnvStep fields
class Full(NamedTuple):
    obs: jax.Array
    reward: jax.Array
    terminated: jax.Array
    truncated: jax.Array
    final_obs: jax.Array
    next_obs: jax.Array


class AnyActor(msrl.Actor):
    """Uniform random actions of any action space, from per-env keys."""

    def __init__(self, space):
        self.space = space

    def act(self, state, params, obs):
        keys, use = split_keys(state["keys"])
        if isinstance(self.space, msrl.Discrete):
            action = jax.vmap(lambda k: jax.random.randint(k, (), 0, self.space.n))(use)
        else:
            action = jax.vmap(lambda k: jax.random.uniform(k, self.space.shape, minval=-2.0, maxval=2.0))(use)
        return {"keys": keys}, msrl.ActOutput(action=action)


class FieldsLearner(SumLearner):
    """``w`` sums every field of the transitions it is given (so it differs if any field does)."""

    def learn(self, state, batch):
        w = state["w"] + batch.reward.mean() + batch.terminated.mean() + 2 * batch.truncated.mean() \
            + 3 * (batch.final_obs - batch.next_obs).mean()
        return {"w": w, "updates": state["updates"] + 1}, {"w": w, "truncations": batch.truncated.sum() * 1.0}


class StepFieldsConfig(msrl.AlgorithmConfig):
    name: str = "step_fields"
    steps: int = 16


@msrl.register_algorithm("step_fields")
class StepFields(msrl.Algorithm):
    """The loop an off-policy algorithm writes: EnvStep's terminated, truncated and final_obs."""

    Config = StepFieldsConfig

    def __init__(self, cfg, ctx):
        super().__init__(cfg, ctx)
        self.actor = AnyActor(ctx.env_spec.action_space)
        self.learner = FieldsLearner()
        self.buffer = msrl.TrajectoryBuffer(cfg.steps)

    def train_step(self):
        obs = msrl.env_observe()
        for _ in range(self.cfg.steps):
            out = msrl.agent_act(obs)
            step = msrl.env_step(out.action)
            msrl.buffer_insert(Full(obs, step.reward, step.terminated, step.truncated, step.final_obs, step.obs))
            obs = step.obs
        return msrl.agent_learn(msrl.buffer_get())



class PairCarryActor(GRUActor):
    """The GRU actor whose greedy carry is a pair, as an LSTM's ``(c, h)``: the hidden state and the steps
    since the episode started (so a test can see what was reset)."""

    def initial_carry(self, n):
        return super().initial_carry(n), jnp.zeros(n, jnp.int32)

    def init(self, key, env_ids):
        return {**super().init(key, env_ids), "h": super().initial_carry(len(env_ids))}

    def greedy_step(self, params, carry, obs, done):
        h, action = super().greedy_step(params, carry[0], obs, done)
        return (h, jnp.where(done, 0, carry[1]) + 1), action


class PairCarryConfig(RecurrentConfig):
    name: str = "pair_carry"


@msrl.register_algorithm("pair_carry")
class PairCarry(ConformanceRecurrent):
    Config = PairCarryConfig

    def __init__(self, cfg, ctx):
        super().__init__(cfg, ctx)
        self.actor = PairCarryActor(self.actor.net)

HANG_RELEASE = threading.Event()  # set to let hung environments return (a test's cleanup)


class Hang(gymnasium.Env):
    """CartPole-shaped; its ``after``-th step (counted from 0) never returns (until HANG_RELEASE is set). When
    it hangs it writes ``time.time()`` to the file ``flag``, if given."""

    observation_space = gymnasium.spaces.Box(-1.0, 1.0, (4,), np.float32)
    action_space = gymnasium.spaces.Discrete(2)

    def __init__(self, after: int = 50, flag: str = ""):
        self.after, self.flag, self.t = after, flag, 0

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(4, np.float32), {}

    def step(self, action):
        if self.t == self.after:
            if self.flag:
                with open(self.flag, "w") as f:
                    f.write(str(time.time()))
            HANG_RELEASE.wait()
        self.t += 1
        return np.zeros(4, np.float32), 1.0, False, False, {}


gymnasium.register(id="MsrlHang-v0", entry_point=Hang)


class Chatty(Hang):
    """Prints ``chatty <its index> <step>`` at every ``every``-th step: what a user's print in an actor shows."""

    count = 0

    def __init__(self, every: int = 64):
        super().__init__(after=-1)
        self.every, self.index = every, Chatty.count
        Chatty.count += 1

    def step(self, action):
        if self.t % self.every == 0:
            print(f"chatty {self.index} {self.t}")
        return super().step(action)


gymnasium.register(id="MsrlChatty-v0", entry_point=Chatty)


# ------------------------------------------------------------------------------------- policy_params of one member
class OneMemberPPOLearner(PPOLearner):
    """A policy_params written for one member's state (an evolution strategy's unravelling of a flat vector, say,
    fails on several members' stacked state): a run of several seeds must call it member by member."""

    def policy_params(self, state):
        if any(x.ndim > 2 for x in jax.tree.leaves(state["params"])):  # (an MLP's kernels and biases)
            raise ValueError(f"policy_params of several members' state: {jax.tree.map(jnp.shape, state['params'])}")
        return super().policy_params(state)


class OneMemberConfig(PPOConfig):
    name: Literal["one_member"] = "one_member"


@msrl.register_algorithm("one_member")
class OneMember(PPO):
    Config = OneMemberConfig

    def __init__(self, cfg, ctx):
        super().__init__(cfg, ctx)
        self.learner.__class__ = OneMemberPPOLearner  # (PPO's learner, built as PPO builds it)
