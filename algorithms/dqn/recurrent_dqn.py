"""Recurrent DQN with sequence replay (R2D2-style: Kapturowski et al. 2019), written once against the msrl API.

The actor keeps a GRU hidden state per environment (reset at episode starts: ``msrl.agent_act(obs, start)``)
and records with every step the hidden state it started from. The replay buffer stores steps time-major and
samples *windows* of ``sequence_length`` consecutive steps of one environment (``sequence_length`` of
:class:`msrl.UniformBuffer` / :class:`msrl.PrioritizedBuffer`); the learner replays each window from its
stored initial hidden state, with the online and the target network, lets the first ``burn_in`` steps only
warm the state up (no gradient, no loss), and regresses the n-step double-Q targets of the rest. A window's
priority mixes the max and the mean of its absolute TD errors (R2D2's eta = 0.9).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Literal, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from msrl.algorithms.dqn.dqn import DQN, DQNConfig, DQNLearner, EpsilonGreedy
from pydantic import Field

import msrl
from msrl.rl import Dense, GRUCell, action_dim, flatten, scan


class RecurrentDQNConfig(DQNConfig):
    """Recurrent DQN's keys: DQN's and the memory's (`msrl config algorithm.name=recurrent_dqn`)."""

    name: Literal["recurrent_dqn"] = "recurrent_dqn"
    batch_size: int = Field(128, gt=0, le=msrl.INT32_MAX, description="windows (of sequence_length steps) per update")
    memory_size: int = Field(128, gt=0, le=65_536, description="units of the GRU")
    sequence_length: int = Field(20, gt=1, le=msrl.INT32_MAX, description="steps of a replayed window")
    burn_in: int = Field(4, ge=0, le=msrl.INT32_MAX, description="first steps of a window that only warm up the "
                         "hidden state (no loss)")
    priority_eta: float = Field(0.9, ge=0, le=1, description="a window's priority: eta max|td| + (1 - eta) mean|td|")
    hidden: list[Annotated[int, Field(gt=0)]] = Field(default_factory=lambda: [64, 64], min_length=1,
                                                      description="the embedding's width (before the GRU), then the "
                                                      "Q head's layers")

    def inert(self) -> dict[str, str]:
        return {**super().inert(), **({} if self.prioritized else {"priority_eta": "algorithm.prioritized=true"})}


class Step(NamedTuple):
    obs: jax.Array
    start: jax.Array  # obs begins an episode
    action: jax.Array
    reward: jax.Array
    done: jax.Array
    hidden: jax.Array  # the hidden state the step started from


class RecurrentQNetwork(nn.Module):
    """``(h, obs, start) -> (h', q)``: an embedding, a GRU cell (reset where ``start``), ReLU layers, Q-values."""

    action_dim: int
    obs_ndim: int
    hidden: Sequence[int] = (128,)
    memory_size: int = 128

    def initial_carry(self, n: int) -> jax.Array:
        return jnp.zeros((n, self.memory_size), jnp.float32)

    @nn.compact
    def __call__(self, h, obs, start):
        h = jnp.where(start[:, None], 0.0, h)
        x = nn.relu(Dense(self.hidden[0])(flatten(obs, self.obs_ndim)))
        h, x = GRUCell(self.memory_size)(h, x)
        for width in self.hidden[1:]:
            x = nn.relu(Dense(width)(x))
        return h, Dense(self.action_dim)(x)


class RecurrentOut(NamedTuple):
    action: jax.Array
    hidden: jax.Array


class RecurrentEpsilonGreedy(EpsilonGreedy):
    """DQN's epsilon-greedy actor with a hidden state per environment in its state."""

    recurrent = True

    def init(self, key, env_ids):
        return {**super().init(key, env_ids), "h": self.net.initial_carry(len(env_ids))}

    def act(self, state, params, obs, done=None):
        keys, use = msrl.split_keys(state["keys"])
        h0 = state["h"] if done is None else jnp.where(done[:, None], 0.0, state["h"])
        h, q = self.net.apply(params, h0, obs, jnp.zeros(h0.shape[0], bool))
        greedy = jnp.argmax(q, axis=-1).astype(jnp.int32)

        def explore(key, eps, best):
            coin, pick = jax.random.split(key)
            return jnp.where(jax.random.uniform(coin) < eps, jax.random.randint(pick, (), 0, self.net.action_dim), best)

        action = jax.vmap(explore)(use, self.epsilon(state), greedy)
        return {**state, "keys": keys, "calls": state["calls"] + 1, "h": h}, RecurrentOut(action, h0)

    def initial_carry(self, n):
        return self.net.initial_carry(n)

    def greedy_step(self, params, carry, obs, done):
        h, q = self.net.apply(params, carry, obs, done)
        return h, jnp.argmax(q, axis=-1).astype(jnp.int32)


class RecurrentDQNLearner(DQNLearner):
    def init(self, key):
        params = self.net.init(key, self.net.initial_carry(1), self.obs[None], jnp.zeros(1, bool))
        return {"params": params, "target": params, "opt_state": self.tx.init(params),
                "updates": jnp.zeros((), jnp.int32)}

    def _unroll(self, params, t: Step):
        """Q-values of every step of the windows (``[time, batch, actions]``) from their stored initial hidden
        state; the burn-in steps carry no gradient."""
        cfg = self.cfg

        def step(h, x):
            obs, start = x
            h, q = self.net.apply(params, h, obs, start)
            return h, q

        h0 = t.hidden[:, 0]
        xs = (jnp.swapaxes(t.obs, 0, 1), jnp.swapaxes(t.start, 0, 1))
        if cfg.burn_in:
            h0, q_burn = scan(step, h0, jax.tree.map(lambda x: x[:cfg.burn_in], xs))
            h0, q_burn = jax.lax.stop_gradient((h0, q_burn))
            _, q = scan(step, h0, jax.tree.map(lambda x: x[cfg.burn_in:], xs))
            return jnp.concatenate([q_burn, q])
        return scan(step, h0, xs)[1]

    def _loss(self, params, target, sample: msrl.Sample):
        cfg, n = self.cfg, self.cfg.n_step
        t = sample.item  # windows: [batch, sequence_length, ...]
        q = self._unroll(params, t)  # [time, batch, actions]
        q_target = jax.lax.stop_gradient(self._unroll(target, t))
        q_choose = jax.lax.stop_gradient(q) if cfg.double else q_target
        length = cfg.sequence_length
        steps = jnp.arange(cfg.burn_in, length - n)  # steps with a loss: their n-step target lies in the window
        reward, done = jnp.swapaxes(t.reward, 0, 1), jnp.swapaxes(t.done, 0, 1).astype(jnp.float32)
        action = jnp.swapaxes(t.action, 0, 1)

        def target_of(s):
            alive = jnp.cumprod(1.0 - jax.lax.dynamic_slice_in_dim(done, s, n), axis=0)  # [n, batch]
            before = jnp.concatenate([jnp.ones_like(alive[:1]), alive[:-1]], axis=0)
            ret = jnp.sum(before * (cfg.gamma ** jnp.arange(n))[:, None] * jax.lax.dynamic_slice_in_dim(reward, s, n),
                          axis=0)
            best = jnp.argmax(q_choose[s + n], axis=-1)
            boot = jnp.take_along_axis(q_target[s + n], best[:, None], axis=-1)[:, 0]
            return ret + cfg.gamma ** n * alive[-1] * boot

        y = jax.lax.stop_gradient(jax.vmap(target_of)(steps))  # [steps, batch]
        q_taken = jnp.take_along_axis(q[steps], action[steps][..., None], axis=-1)[..., 0]
        weights = sample.weights / jnp.maximum(sample.weights.max(), 1e-12)
        loss = jnp.mean(weights[None] * optax.huber_loss(q_taken, y, delta=cfg.huber_delta))
        td = jnp.abs(q_taken - y)
        priority = cfg.priority_eta * td.max(0) + (1 - cfg.priority_eta) * td.mean(0)
        return loss, (priority, {"loss": loss, "q": q_taken.mean()})


class RecurrentDQN(DQN):
    """DQN with a GRU Q-network (R2D2-style): it replays windows of consecutive steps with the
    hidden state stored at their start, burned in before the loss."""

    Config = RecurrentDQNConfig
    WINDOW = "algorithm.sequence_length"

    def __init__(self, cfg: RecurrentDQNConfig, ctx: msrl.Context):
        if cfg.burn_in + cfg.n_step >= cfg.sequence_length:
            raise msrl.ConfigError("algorithm.sequence_length", f"{cfg.sequence_length} steps leave no step with a "
                                   f"loss after burn_in {cfg.burn_in} and before the last n_step {cfg.n_step}")
        rows = cfg.buffer_size // ctx.num_envs
        if rows < cfg.rollout_len + cfg.sequence_length:
            raise msrl.ConfigError("algorithm.buffer_size", f"{cfg.buffer_size} transitions are {rows} steps of "
                                   f"{ctx.num_envs} envs; it must hold rollout_len + sequence_length = "
                                   f"{cfg.rollout_len + cfg.sequence_length} steps")
        super().__init__(cfg, ctx)
        spec = ctx.env_spec
        net = RecurrentQNetwork(action_dim(spec), len(spec.obs_shape), tuple(cfg.hidden), cfg.memory_size)
        self.actor = RecurrentEpsilonGreedy(net, cfg, ctx.num_envs)
        self.learner = RecurrentDQNLearner(net, cfg, spec.example_obs(), self.learner.num_updates)

    @staticmethod
    def replay(cfg: RecurrentDQNConfig, updates: int, window: int) -> msrl.ReplayBuffer:
        """DQN's replay buffer, of whole sequences (``sequence_length`` steps) rather than n-step windows."""
        return DQN.replay(cfg, updates, cfg.sequence_length)

    def train_step(self):
        obs, start = msrl.env_observe(), msrl.env_starts()
        for _ in range(self.cfg.rollout_len):
            out = msrl.agent_act(obs, start)
            next_obs, reward, done = msrl.env_step(out.action)
            msrl.buffer_insert(Step(obs, start, out.action, reward, done, out.hidden))
            obs, start = next_obs, done
        for _ in range(self.cfg.updates):
            sample = msrl.buffer_sample(self.cfg.batch_size)
            metrics, priorities = msrl.agent_learn(sample)
            msrl.buffer_update(sample.indices, priorities)
        return metrics
