"""DQN written once against the msrl API; the distribution policy decides how it runs.

The loop steps the environments, inserts every transition into a replay buffer, then makes a few updates,
each sampling a batch, learning on it and handing the new priorities back to the buffer. Nothing else: a
policy that cuts at ``buffer_insert`` / ``buffer_sample`` (Ape-X's replay server) runs the same loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Literal, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from pydantic import Field

import msrl
from msrl.rl import Dense, action_dim, flat, flatten


class DQNConfig(msrl.AlgorithmConfig):
    """DQN's keys (`msrl config algorithm.name=dqn` lists each with its meaning, bounds and default)."""

    name: Literal["dqn"] = "dqn"
    rollout_len: int = Field(4, gt=0, le=msrl.INT32_MAX, description="environment steps per iteration, per env")
    updates: int = Field(1, gt=0, le=msrl.INT32_MAX, description="gradient updates per iteration")
    batch_size: int = Field(128, gt=0, le=msrl.INT32_MAX, description="transitions per update")
    buffer_size: int = Field(100_000, gt=0, le=msrl.INT32_MAX, description="replay capacity, in transitions (per "
                             "learner under multi_learner; split over replay_server's shards)")
    learning_starts: int = Field(1_000, ge=0, le=msrl.INT32_MAX,
                                 description="transitions in a learner's buffer before its first update")
    lr: float = Field(2.5e-4, gt=0, description="Adam's learning rate")
    anneal_lr: bool = Field(False, description="decay the learning rate linearly over the run's updates (none "
                            "before learning_starts: it ends above 0)")
    gamma: float = Field(0.99, gt=0, le=1, description="discount factor")
    n_step: int = Field(1, gt=0, le=msrl.INT32_MAX, description="steps of the n-step return")
    double: bool = Field(True, description="double DQN: the online network picks the bootstrap action")
    target_update_every: int = Field(500, gt=0, le=msrl.INT32_MAX, description="updates between target-network updates")
    tau: float = Field(1.0, gt=0, le=1, description="target <- tau * online + (1 - tau) * target (1: a copy)")
    huber_delta: float = Field(1.0, gt=0, description="the TD error's Huber loss is quadratic within ± this")
    max_grad_norm: float = Field(10.0, gt=0, description="gradients are clipped to this global norm")
    exploration: Literal["linear", "apex"] = Field(
        "linear", description="linear: epsilon from eps_start to eps_end over eps_decay_steps env steps; apex: "
        "fixed per env, apex_eps ** (1 + apex_alpha * i / (num_envs - 1)) for global env index i")
    eps_start: float = Field(1.0, ge=0, le=1, description="exploration=linear: epsilon at the start")
    eps_end: float = Field(0.05, ge=0, le=1, description="exploration=linear: epsilon after eps_decay_steps")
    eps_decay_steps: int = Field(10_000, gt=0, description="env steps (all envs) over which epsilon decays")
    apex_eps: float = Field(0.4, ge=0, le=1, description="exploration=apex: the base epsilon")
    apex_alpha: float = Field(7.0, ge=0, description="exploration=apex: the exponent's spread over the envs")
    prioritized: bool = Field(False, description="prioritized replay (else uniform)")
    per_alpha: float = Field(0.6, ge=0, description="prioritized: priority exponent (0: uniform)")
    per_beta: float = Field(0.4, ge=0, le=1, description="importance-sampling exponent, annealed to 1 over the run")
    hidden: list[Annotated[int, Field(gt=0)]] = Field(default_factory=lambda: [64, 64], min_length=1,
                                                      description="widths of the hidden layers")

    def inert(self) -> dict[str, str]:
        keys = {} if self.prioritized else dict.fromkeys(("per_alpha", "per_beta"), "algorithm.prioritized=true")
        other = "linear" if self.exploration == "apex" else "apex"
        return {**keys, **dict.fromkeys(("eps_start", "eps_end", "eps_decay_steps") if other == "linear" else
                                        ("apex_eps", "apex_alpha"), f"algorithm.exploration={other}")}


class Transition(NamedTuple):
    """One step of every environment. The buffer keeps them time-major and samples windows of n_step + 1
    steps: the observation n steps later is the bootstrap state (so no next_obs is stored)."""

    obs: jax.Array
    action: jax.Array
    reward: jax.Array
    done: jax.Array


class QNetwork(nn.Module):
    """An MLP from (flattened) observations to one Q-value per action."""

    action_dim: int
    obs_ndim: int
    hidden: Sequence[int] = (64, 64)

    @nn.compact
    def __call__(self, obs):
        x = flatten(obs, self.obs_ndim)
        for h in self.hidden:
            x = nn.relu(Dense(h)(x))
        return Dense(self.action_dim)(x)


class EpsilonGreedy(msrl.Actor):
    """Greedy in the Q-values but for a random action with probability epsilon, per environment."""

    def __init__(self, net: QNetwork, cfg: DQNConfig, num_envs: int):
        self.net, self.cfg, self.num_envs = net, cfg, num_envs  # num_envs: all of them, over every replica

    def init(self, key, env_ids):
        return {**super().init(key, env_ids), "env_ids": jnp.asarray(env_ids, jnp.int32),
                "calls": jnp.zeros((), jnp.int32)}

    def epsilon(self, state):
        """Each environment's epsilon now (a function of its global index and of the env steps so far)."""
        cfg = self.cfg
        if cfg.exploration == "apex":
            rank = state["env_ids"] / max(self.num_envs - 1, 1)
            return cfg.apex_eps ** (1.0 + cfg.apex_alpha * rank)
        done = jnp.minimum(state["calls"] * (self.num_envs / cfg.eps_decay_steps), 1.0)
        return jnp.broadcast_to(cfg.eps_start + done * (cfg.eps_end - cfg.eps_start), state["env_ids"].shape)

    def act(self, state, params, obs):
        keys, use = msrl.split_keys(state["keys"])
        greedy = self.greedy(params, obs)

        def explore(key, eps, best):
            coin, pick = jax.random.split(key)
            return jnp.where(jax.random.uniform(coin) < eps, jax.random.randint(pick, (), 0, self.net.action_dim), best)

        action = jax.vmap(explore)(use, self.epsilon(state), greedy)  # per-env keys: splits change no number
        return {**state, "keys": keys, "calls": state["calls"] + 1}, msrl.ActOutput(action)

    def greedy(self, params, obs):
        return jnp.argmax(self.net.apply(params, obs), axis=-1).astype(jnp.int32)


class DQNLearner(msrl.Learner):
    def __init__(self, net: QNetwork, cfg: DQNConfig, example_obs, num_updates: int):
        self.net, self.cfg, self.num_updates = net, cfg, num_updates
        self.obs = example_obs

    def optimizer(self):
        cfg = self.cfg
        lr = optax.linear_schedule(cfg.lr, 0.0, self.num_updates) if cfg.anneal_lr else cfg.lr
        return flat(optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm), optax.adam(lr)))

    def init(self, key):
        params = self.net.init(key, self.obs)
        return {"params": params, "target": params, "opt_state": self.tx.init(params),
                "updates": jnp.zeros((), jnp.int32)}

    def policy_params(self, state):
        return state["params"]

    def _target(self, params, target, t: Transition):
        """n-step double-Q target from windows of n + 1 steps: rewards until an episode ends, then the
        target network's value (of the online network's action, if double) n steps later."""
        cfg, n = self.cfg, self.cfg.n_step
        alive = jnp.cumprod(1.0 - t.done[:, :n].astype(jnp.float32), axis=1)  # no episode end up to step k
        before = jnp.concatenate([jnp.ones_like(alive[:, :1]), alive[:, :-1]], axis=1)
        ret = jnp.sum(before * cfg.gamma ** jnp.arange(n) * t.reward[:, :n], axis=1)
        q_next = self.net.apply(target, t.obs[:, n])
        choose = self.net.apply(params, t.obs[:, n]) if cfg.double else q_next
        best = jnp.take_along_axis(q_next, jnp.argmax(choose, axis=-1)[:, None], axis=-1)[:, 0]
        return ret + cfg.gamma ** n * alive[:, -1] * best

    def _loss(self, params, target, sample: msrl.Sample):
        t = sample.item
        y = jax.lax.stop_gradient(self._target(params, target, t))
        q = self.net.apply(params, t.obs[:, 0])
        q_taken = jnp.take_along_axis(q, t.action[:, 0, None], axis=-1)[:, 0]
        weights = sample.weights / jnp.maximum(sample.weights.max(), 1e-12)  # (all zero before any entry)
        loss = jnp.mean(weights * optax.huber_loss(q_taken, y, delta=self.cfg.huber_delta))
        return loss, (jnp.abs(q_taken - y), {"loss": loss, "q": q_taken.mean()})

    def learn(self, state, sample: msrl.Sample):
        """One update (once the buffer holds learning_starts transitions); returns the new state and (metrics,
        |TD errors|: the sample's new priorities)."""
        cfg = self.cfg
        grads, (td, metrics) = jax.grad(self._loss, has_aux=True)(state["params"], state["target"], sample)
        updates, opt_state = self.tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        count = state["updates"] + 1
        step = jnp.where(count % cfg.target_update_every == 0, cfg.tau, 0.0)  # 0: keep the target
        new = {"params": params, "target": optax.incremental_update(params, state["target"], step),
               "opt_state": opt_state, "updates": count}
        ready = sample.size >= max(cfg.learning_starts, 1)
        metrics = {**metrics, "learning": ready.astype(jnp.float32)}  # 0 until learning_starts: no update yet
        return jax.tree.map(lambda a, b: jnp.where(ready, a, b), new, state), (metrics, td)


class DQN(msrl.Algorithm):
    """Deep Q-learning with a target network, n-step returns and optional prioritized replay (double-DQN
    targets by default): epsilon-greedy rollouts into a replay buffer, ``updates`` sampled minibatch steps per
    iteration."""

    Config = DQNConfig
    WINDOW = "algorithm.n_step + 1"  # what sets the length of the buffer's windows

    def __init__(self, cfg: DQNConfig, ctx: msrl.Context):
        super().__init__(cfg, ctx)
        spec = ctx.env_spec
        if isinstance(spec, msrl.MultiAgentSpec) or not spec.discrete:
            has = "several agents" if isinstance(spec, msrl.MultiAgentSpec) else "continuous actions"
            raise msrl.ConfigError("algorithm.name", f"DQN needs one agent with discrete actions; {spec.id} has {has}",
                                   also=("env.id",))
        rows, needed = cfg.buffer_size // ctx.num_envs, max(cfg.rollout_len + cfg.n_step, cfg.n_step + 2)
        if rows < needed:
            raise msrl.ConfigError("algorithm.buffer_size", f"{cfg.buffer_size} transitions are {rows} steps of "
                                   f"{ctx.num_envs} envs; it must hold {needed} steps (rollout_len + n_step, and at "
                                   "least n_step + 2)")
        net = QNetwork(action_dim(spec), len(spec.obs_shape), tuple(cfg.hidden))
        updates = ctx.per_run(ctx.num_envs * cfg.rollout_len, cfg.updates)
        self.actor = EpsilonGreedy(net, cfg, ctx.num_envs)
        self.learner = DQNLearner(net, cfg, spec.example_obs(), updates)
        self.buffer = self.replay(cfg, updates, window=cfg.n_step + 1)  # n + 1 consecutive steps of one env
        ctx.check_learning_starts(cfg.learning_starts, self.buffer, cfg.rollout_len, cfg.batch_size, self.WINDOW)

    @staticmethod
    def replay(cfg: DQNConfig, updates: int, window: int) -> msrl.ReplayBuffer:
        """The replay buffer: entries of ``window`` consecutive steps of one environment."""
        return (msrl.PrioritizedBuffer(cfg.buffer_size, cfg.per_alpha, cfg.per_beta, 1.0, updates,
                                       sequence_length=window)
                if cfg.prioritized else msrl.UniformBuffer(cfg.buffer_size, sequence_length=window))

    def train_step(self):
        obs = msrl.env_observe()
        for _ in range(self.cfg.rollout_len):
            out = msrl.agent_act(obs)
            next_obs, reward, done = msrl.env_step(out.action)
            msrl.buffer_insert(Transition(obs, out.action, reward, done))
            obs = next_obs
        for _ in range(self.cfg.updates):
            sample = msrl.buffer_sample(self.cfg.batch_size)
            metrics, priorities = msrl.agent_learn(sample)
            msrl.buffer_update(sample.indices, priorities)
        return metrics
