"""Test loops for the conformance matrix (:mod:`msrl.conformance`): shapes of algorithm that the built-in
ones do not have, each small enough that one run of a few iterations takes seconds.

- ``conf_sac``: discrete SAC. A local replay buffer (:class:`msrl.UniformBuffer`, windows of two steps for
  the next observation), twin critics, Polyak-averaged target critics, and three optimizers in one learner
  (actor, critics, temperature), each an optax chain that starts with the learner's ``grad_transforms``, so a
  policy's gradient transformation (an all-reduce, say) applies to every part.
- ``conf_recurrent``: a GRU actor. The hidden state of every environment lives in the actor's state and is
  reset at episode starts: the loop hands the actor the episode starts with the observation
  (``msrl.agent_act(obs, start)``: ``msrl.env_starts()`` first, then each step's done); the learner unrolls
  the GRU over the rollout from the first stored hidden state (backpropagation through time) and bootstraps
  from the state after it.
- ``conf_ema``: a learner whose state holds more than parameters and optimizer state: an update counter and an
  exponential moving average of the parameters (bias-corrected by the counter), which is what the actors act
  with (``policy_params``).

Only msrl's public names, flax, optax and jax are used here. Importing this module registers the three
algorithms by name (``algorithm.name: conf_sac`` ...).
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import msrl


# ------------------------------------------------------------------------------------------ shared pieces
class MLP(nn.Module):
    """Two tanh layers and a linear head of ``out`` units (``out`` 1: squeezed to a scalar per input)."""

    out: int
    hidden: int = 32

    @nn.compact
    def __call__(self, obs):
        x = obs.astype(jnp.float32).reshape((*obs.shape[:-1], -1))
        for _ in range(2):
            x = nn.tanh(nn.Dense(self.hidden)(x))
        y = nn.Dense(self.out)(x)
        return y.squeeze(-1) if self.out == 1 else y


def sample_categorical(keys: jax.Array, logits: jax.Array) -> jax.Array:
    """One action per environment, each from its own key (splitting environments changes no sample)."""
    return jax.vmap(jax.random.categorical)(keys, logits).astype(jnp.int32)


def discounted_returns(reward, done, bootstrap, gamma: float):
    """Returns-to-go of a ``[time, env]`` rollout, cut at episode ends, the last step bootstrapped."""

    def back(next_return, step):
        r, d = step
        g = r + gamma * (1.0 - d.astype(jnp.float32)) * next_return
        return g, g

    return jax.lax.scan(back, bootstrap, (reward, done), reverse=True)[1]


def n_actions(ctx: msrl.Context, algorithm: str) -> int:
    spec = ctx.env_spec
    if isinstance(spec, msrl.MultiAgentSpec) or not spec.discrete:
        raise msrl.ConfigError("env.id", f"{algorithm} needs one agent with discrete actions; {spec.id} has "
                               f"{'several agents' if isinstance(spec, msrl.MultiAgentSpec) else 'continuous actions'}")
    return spec.action_space.n


class Step(NamedTuple):
    obs: jax.Array
    action: jax.Array
    reward: jax.Array
    done: jax.Array


# ------------------------------------------------------------------------------------------ (a) discrete SAC
class SACConfig(msrl.AlgorithmConfig):
    name: Literal["conf_sac"] = "conf_sac"
    rollout_len: int = 4
    updates: int = 2
    batch_size: int = 32
    buffer_size: int = 512
    learning_starts: int = 32
    gamma: float = 0.99
    tau: float = 0.05
    actor_lr: float = 3e-4
    critic_lr: float = 1e-3
    alpha_lr: float = 1e-3
    init_alpha: float = 0.2
    target_entropy_scale: float = 0.5  # of the uniform policy's entropy log(|A|)
    hidden: int = 32


class CategoricalActor(msrl.Actor):
    """Samples from the logits of ``net`` with per-env keys; ``part``: the params' entry the net reads."""

    def __init__(self, net: MLP, part: str | None = None):
        self.net, self.part = net, part

    def logits(self, params, obs):
        return self.net.apply(params[self.part] if self.part else params, obs)

    def act(self, state, params, obs):
        keys, use = msrl.split_keys(state["keys"])
        return {"keys": keys}, msrl.ActOutput(sample_categorical(use, self.logits(params, obs)))

    def greedy(self, params, obs):
        return jnp.argmax(self.logits(params, obs), axis=-1).astype(jnp.int32)


class SACLearner(msrl.Learner):
    """Twin soft Q critics with Polyak targets, a categorical actor and a learned temperature: three optax
    chains, each headed by the policy's ``grad_transforms``."""

    def __init__(self, actor: MLP, critic: MLP, cfg: SACConfig, example_obs, actions: int):
        self.actor, self.critic, self.cfg, self.obs = actor, critic, cfg, example_obs
        self.target_entropy = cfg.target_entropy_scale * math.log(actions)

    def optimizer(self):
        return optax.adam(self.cfg.critic_lr)

    def part_tx(self, lr: float) -> optax.GradientTransformation:
        """The chain of one part: the policy's gradient transforms, then adam at ``lr``."""
        return optax.chain(*self.grad_transforms, optax.adam(lr))

    def init(self, key):
        ka, k1, k2 = jax.random.split(key, 3)
        actor = self.actor.init(ka, self.obs)
        critic = {"q1": self.critic.init(k1, self.obs), "q2": self.critic.init(k2, self.obs)}
        log_alpha = jnp.log(jnp.float32(self.cfg.init_alpha))
        return {"actor": actor, "critic": critic, "target": critic, "log_alpha": log_alpha,
                "actor_opt": self.part_tx(self.cfg.actor_lr).init(actor),
                "critic_opt": self.part_tx(self.cfg.critic_lr).init(critic),
                "alpha_opt": self.part_tx(self.cfg.alpha_lr).init(log_alpha),
                "updates": jnp.zeros((), jnp.int32)}

    def policy_params(self, state):
        return state["actor"]

    def _q(self, critic, obs):
        return self.critic.apply(critic["q1"], obs), self.critic.apply(critic["q2"], obs)

    def learn(self, state, sample: msrl.Sample):
        cfg = self.cfg
        t = sample.item  # windows of 2 steps: [batch, 2, ...]
        obs, next_obs, action = t.obs[:, 0], t.obs[:, 1], t.action[:, 0]
        reward, done = t.reward[:, 0], t.done[:, 0].astype(jnp.float32)
        alpha = jnp.exp(state["log_alpha"])

        next_logp = jax.nn.log_softmax(self.actor.apply(state["actor"], next_obs))
        tq1, tq2 = self._q(state["target"], next_obs)
        v_next = jnp.sum(jnp.exp(next_logp) * (jnp.minimum(tq1, tq2) - alpha * next_logp), axis=-1)
        y = jax.lax.stop_gradient(reward + cfg.gamma * (1.0 - done) * v_next)

        def taken(q):
            return jnp.take_along_axis(q, action[:, None], axis=-1)[:, 0]

        def critic_loss(critic):
            q1, q2 = self._q(critic, obs)
            return 0.5 * jnp.mean((taken(q1) - y) ** 2 + (taken(q2) - y) ** 2)

        c_loss, c_grads = jax.value_and_grad(critic_loss)(state["critic"])
        c_updates, critic_opt = self.part_tx(cfg.critic_lr).update(c_grads, state["critic_opt"], state["critic"])
        critic = optax.apply_updates(state["critic"], c_updates)

        q1, q2 = self._q(critic, obs)
        q_min = jax.lax.stop_gradient(jnp.minimum(q1, q2))

        def actor_loss(actor):
            logp = jax.nn.log_softmax(self.actor.apply(actor, obs))
            pi = jnp.exp(logp)
            return jnp.mean(jnp.sum(pi * (alpha * logp - q_min), axis=-1)), -jnp.sum(pi * logp, axis=-1).mean()

        (a_loss, entropy), a_grads = jax.value_and_grad(actor_loss, has_aux=True)(state["actor"])
        a_updates, actor_opt = self.part_tx(cfg.actor_lr).update(a_grads, state["actor_opt"], state["actor"])
        actor = optax.apply_updates(state["actor"], a_updates)

        def alpha_loss(log_alpha):  # raise the temperature while the entropy is below its target
            return log_alpha * jax.lax.stop_gradient(entropy - self.target_entropy)

        al_grads = jax.grad(alpha_loss)(state["log_alpha"])
        al_updates, alpha_opt = self.part_tx(cfg.alpha_lr).update(al_grads, state["alpha_opt"], state["log_alpha"])
        log_alpha = optax.apply_updates(state["log_alpha"], al_updates)

        new = {"actor": actor, "critic": critic, "target": optax.incremental_update(critic, state["target"], cfg.tau),
               "log_alpha": log_alpha, "actor_opt": actor_opt, "critic_opt": critic_opt, "alpha_opt": alpha_opt,
               "updates": state["updates"] + 1}
        ready = sample.size >= max(cfg.learning_starts, 1)
        state = jax.tree.map(lambda a, b: jnp.where(ready, a, b), new, state)
        return state, {"critic_loss": c_loss, "actor_loss": a_loss, "entropy": entropy, "alpha": jnp.exp(log_alpha)}


@msrl.register_algorithm("conf_sac")
class ConformanceSAC(msrl.Algorithm):
    Config = SACConfig

    def __init__(self, cfg: SACConfig, ctx: msrl.Context):
        super().__init__(cfg, ctx)
        actions = n_actions(ctx, "conf_sac")
        actor, critic = MLP(actions, cfg.hidden), MLP(actions, cfg.hidden)
        self.actor = CategoricalActor(actor)
        self.learner = SACLearner(actor, critic, cfg, ctx.env_spec.example_obs(), actions)
        self.buffer = msrl.UniformBuffer(cfg.buffer_size, sequence_length=2)  # (obs, next obs) windows

    def train_step(self):
        obs = msrl.env_observe()
        for _ in range(self.cfg.rollout_len):
            out = msrl.agent_act(obs)
            next_obs, reward, done = msrl.env_step(out.action)
            msrl.buffer_insert(Step(obs, out.action, reward, done))
            obs = next_obs
        for _ in range(self.cfg.updates):
            metrics = msrl.agent_learn(msrl.buffer_sample(self.cfg.batch_size))
        return metrics


# ------------------------------------------------------------------------------------------ (b) recurrent actor
class RecurrentConfig(msrl.AlgorithmConfig):
    name: Literal["conf_recurrent"] = "conf_recurrent"
    rollout_len: int = 8
    hidden: int = 32
    lr: float = 1e-3
    gamma: float = 0.99
    vf_coef: float = 0.5
    ent_coef: float = 0.01
    max_grad_norm: float = 0.5


class GRUPolicy(nn.Module):
    """``(h, obs) -> (h', logits, value)``: an embedding, a GRU cell, and policy and value heads."""

    actions: int
    hidden: int = 32

    @nn.compact
    def __call__(self, h, obs):
        x = nn.tanh(nn.Dense(self.hidden)(obs.astype(jnp.float32)))
        h, y = nn.GRUCell(self.hidden)(h, x)
        return h, nn.Dense(self.actions)(y), nn.Dense(1)(y).squeeze(-1)


class RecurrentOut(NamedTuple):
    action: jax.Array
    hidden: jax.Array  # the hidden state the action was taken from (the learner unrolls from the first)


class RecurrentStep(NamedTuple):
    obs: jax.Array
    start: jax.Array
    action: jax.Array
    reward: jax.Array
    done: jax.Array
    hidden: jax.Array


class GRUActor(msrl.Actor):
    """Keeps one GRU hidden state per environment in its state. ``act(obs, start)`` zeroes the hidden state of
    every environment whose episode starts with ``obs``, then acts and advances it."""

    recurrent = True

    def __init__(self, net: GRUPolicy):
        self.net = net

    def init(self, key, env_ids):
        return {**super().init(key, env_ids), "h": self.initial_carry(len(env_ids))}

    def initial_carry(self, n):
        return jnp.zeros((n, self.net.hidden), jnp.float32)

    def act(self, state, params, obs, done=None):
        keys, use = msrl.split_keys(state["keys"])
        h0 = state["h"] if done is None else jnp.where(done[:, None], 0.0, state["h"])
        h, logits, _ = self.net.apply(params, h0, obs)
        return {"keys": keys, "h": h}, RecurrentOut(sample_categorical(use, logits), h0)

    def greedy_step(self, params, carry, obs, done):
        h, logits, _ = self.net.apply(params, jnp.where(done[:, None], 0.0, carry), obs)
        return h, jnp.argmax(logits, axis=-1).astype(jnp.int32)


class RecurrentLearner(msrl.Learner):
    """Advantage actor-critic through the GRU: one optimizer step per rollout."""

    def __init__(self, net: GRUPolicy, cfg: RecurrentConfig, example_obs):
        self.net, self.cfg, self.obs = net, cfg, example_obs

    def optimizer(self):
        return optax.chain(optax.clip_by_global_norm(self.cfg.max_grad_norm), optax.adam(self.cfg.lr))

    def init(self, key):
        params = self.net.init(key, jnp.zeros((1, self.net.hidden), jnp.float32), self.obs[None])
        return {"params": params, "opt_state": self.tx.init(params)}

    def policy_params(self, state):
        return state["params"]

    def _loss(self, params, batch: RecurrentStep, last_obs, last_start):
        cfg = self.cfg

        def step(h, t):
            obs, start = t
            h, logits, value = self.net.apply(params, jnp.where(start[:, None], 0.0, h), obs)
            return h, (logits, value)

        h_last, (logits, values) = jax.lax.scan(step, batch.hidden[0], (batch.obs, batch.start))
        _, _, last_value = self.net.apply(params, jnp.where(last_start[:, None], 0.0, h_last), last_obs)
        returns = discounted_returns(batch.reward, batch.done, jax.lax.stop_gradient(last_value), cfg.gamma)
        logp = jax.nn.log_softmax(logits)
        taken = jnp.take_along_axis(logp, batch.action[..., None], axis=-1)[..., 0]
        adv = jax.lax.stop_gradient(returns - values)
        entropy = -jnp.sum(jnp.exp(logp) * logp, axis=-1).mean()
        policy_loss = -(taken * adv).mean()
        value_loss = 0.5 * ((returns - values) ** 2).mean()
        loss = policy_loss + cfg.vf_coef * value_loss - cfg.ent_coef * entropy
        return loss, {"loss": loss, "policy_loss": policy_loss, "value_loss": value_loss, "entropy": entropy}

    def learn(self, state, batch: RecurrentStep, last_obs, last_start):
        grads, metrics = jax.grad(self._loss, has_aux=True)(state["params"], batch, last_obs, last_start)
        updates, opt_state = self.tx.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}, metrics


@msrl.register_algorithm("conf_recurrent")
class ConformanceRecurrent(msrl.Algorithm):
    Config = RecurrentConfig

    def __init__(self, cfg: RecurrentConfig, ctx: msrl.Context):
        super().__init__(cfg, ctx)
        net = GRUPolicy(n_actions(ctx, "conf_recurrent"), cfg.hidden)
        self.actor = GRUActor(net)
        self.learner = RecurrentLearner(net, cfg, ctx.env_spec.example_obs())
        self.buffer = msrl.TrajectoryBuffer(cfg.rollout_len)

    def train_step(self):
        obs, start = msrl.env_observe(), msrl.env_starts()
        for _ in range(self.cfg.rollout_len):
            out = msrl.agent_act(obs, start)
            next_obs, reward, done = msrl.env_step(out.action)
            msrl.buffer_insert(RecurrentStep(obs, start, out.action, reward, done, out.hidden))
            obs, start = next_obs, done
        return msrl.agent_learn(msrl.buffer_get(), last_obs=obs, last_start=start)


# ------------------------------------------------------------------------------------------ (c) learner with extra state
class EMAConfig(msrl.AlgorithmConfig):
    name: Literal["conf_ema"] = "conf_ema"
    rollout_len: int = 8
    hidden: int = 32
    lr: float = 1e-3
    gamma: float = 0.99
    vf_coef: float = 0.5
    ema_decay: float = 0.9


class EMALearner(msrl.Learner):
    """REINFORCE with a baseline; its state also holds an update counter and an exponential moving average
    of the parameters (decay ``min(ema_decay, (1 + n) / (10 + n))`` after ``n`` updates), which the actors
    act with."""

    def __init__(self, policy: MLP, value: MLP, cfg: EMAConfig, example_obs):
        self.policy, self.value, self.cfg, self.obs = policy, value, cfg, example_obs

    def optimizer(self):
        return optax.adam(self.cfg.lr)

    def init(self, key):
        kp, kv = jax.random.split(key)
        params = {"policy": self.policy.init(kp, self.obs), "value": self.value.init(kv, self.obs)}
        return {"params": params, "opt_state": self.tx.init(params), "step": jnp.zeros((), jnp.int32), "ema": params}

    def policy_params(self, state):
        return state["ema"]

    def _loss(self, params, batch: Step, last_obs):
        value = self.value.apply(params["value"], batch.obs)
        last_value = self.value.apply(params["value"], last_obs)
        returns = discounted_returns(batch.reward, batch.done, jax.lax.stop_gradient(last_value), self.cfg.gamma)
        logp = jax.nn.log_softmax(self.policy.apply(params["policy"], batch.obs))
        taken = jnp.take_along_axis(logp, batch.action[..., None], axis=-1)[..., 0]
        adv = jax.lax.stop_gradient(returns - value)
        loss = -(taken * adv).mean() + self.cfg.vf_coef * 0.5 * ((returns - value) ** 2).mean()
        return loss, {"loss": loss}

    def learn(self, state, batch: Step, last_obs):
        grads, metrics = jax.grad(self._loss, has_aux=True)(state["params"], batch, last_obs)
        updates, opt_state = self.tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        step = state["step"] + 1
        decay = jnp.minimum(self.cfg.ema_decay, (1.0 + step) / (10.0 + step))
        ema = jax.tree.map(lambda e, p: decay * e + (1.0 - decay) * p, state["ema"], params)
        return {"params": params, "opt_state": opt_state, "step": step, "ema": ema}, {**metrics, "decay": decay}


@msrl.register_algorithm("conf_ema")
class ConformanceEMA(msrl.Algorithm):
    Config = EMAConfig

    def __init__(self, cfg: EMAConfig, ctx: msrl.Context):
        super().__init__(cfg, ctx)
        actions = n_actions(ctx, "conf_ema")
        policy, value = MLP(actions, cfg.hidden), MLP(1, cfg.hidden)
        self.actor = CategoricalActor(policy, "policy")
        self.learner = EMALearner(policy, value, cfg, ctx.env_spec.example_obs())
        self.buffer = msrl.TrajectoryBuffer(cfg.rollout_len)

    def train_step(self):
        obs = msrl.env_observe()
        for _ in range(self.cfg.rollout_len):
            out = msrl.agent_act(obs)
            next_obs, reward, done = msrl.env_step(out.action)
            msrl.buffer_insert(Step(obs, out.action, reward, done))
            obs = next_obs
        return msrl.agent_learn(msrl.buffer_get(), last_obs=obs)
