"""IMPALA (Espeholt et al. 2018) with V-trace, written once against the msrl API.

The actor records the log-probability of every action under the policy it acted with (the *behaviour*
policy mu). The learner recomputes the log-probabilities and values of the *target* policy pi with its
current parameters and corrects for the difference with V-trace: truncated importance weights
``rho_t = min(rho_bar, pi/mu)`` and ``c_t = lambda * min(c_bar, pi/mu)`` give the value targets ``v_s`` and the
policy-gradient advantages ``rho_s (r_s + gamma v_{s+1} - V(x_s))``. Nothing assumes ``pi == mu``: actors may
act with parameters one or more updates old (``single_learner_coarse`` with asynchronous actors), and the
metrics record the mean importance ratio ``rho_mean`` (1 when actors and learner agree).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
from msrl.algorithms.a2c.a2c import A2CConfig, actor_critic, make_optimizer
from pydantic import Field

import msrl
from msrl.rl import ActorCritic, ActorCriticActor, minibatch_epochs, policy, scan


class IMPALAConfig(A2CConfig):
    """IMPALA's keys: A2C's and V-trace's clipping (`msrl config algorithm.name=impala`)."""

    name: Literal["impala"] = "impala"
    rollout_len: int = Field(20, gt=0, le=msrl.INT32_MAX, description="environment steps per iteration, per env (the "
                             "length of the trajectories V-trace runs over)")
    gae_lambda: float = Field(1.0, ge=0, le=1, description="V-trace's lambda: c_t = lambda * min(c_bar, pi/mu)")
    rho_bar: float = Field(1.0, gt=0, description="truncation of the importance weights rho_t (values and policy "
                           "gradient)")
    c_bar: float = Field(1.0, gt=0, description="truncation of the trace coefficients c_t")
    epochs: int = Field(1, gt=0, le=msrl.INT32_MAX, description="passes over each batch")
    minibatches: int = Field(1, gt=0, le=msrl.INT32_MAX, description="minibatches per pass, split over environments "
                             "(whole trajectories)")
    bootstrap_truncated: bool = Field(False, description="false only: V-trace ends the return at every episode end "
                                      "(ppo and a2c bootstrap a truncation)")


class Transition(NamedTuple):
    obs: jax.Array
    action: jax.Array
    reward: jax.Array
    done: jax.Array
    behaviour_log_prob: jax.Array  # log mu(action | obs): the policy the actor acted with


def vtrace(values, bootstrap_value, rewards, discounts, log_rhos, rho_bar=1.0, c_bar=1.0, lam=1.0):
    """V-trace over a time-major trajectory (``[time, ...]``). ``discounts[t]`` is gamma, or 0 where the episode
    ended at step t; ``log_rhos = log pi(a_t|x_t) - log mu(a_t|x_t)``; ``bootstrap_value = V(x_T)``.

    Returns ``(vs, pg_advantages)``: ``vs - V(x_s) = delta_s + discount_s c_s (v_{s+1} - V(x_{s+1}))`` with
    ``delta_s = rho_s (r_s + discount_s V(x_{s+1}) - V(x_s))``, and ``rho_s (r_s + discount_s v_{s+1} - V(x_s))``.
    """
    rhos = jnp.exp(log_rhos)
    clipped_rhos = jnp.minimum(rho_bar, rhos)
    cs = lam * jnp.minimum(c_bar, rhos)
    next_values = jnp.concatenate([values[1:], bootstrap_value[None]], axis=0)
    deltas = clipped_rhos * (rewards + discounts * next_values - values)

    def back(acc, t):
        delta, discount, c = t
        acc = delta + discount * c * acc
        return acc, acc

    _, vs_minus_v = scan(back, jnp.zeros_like(bootstrap_value), (deltas, discounts, cs), reverse=True)
    vs = values + vs_minus_v
    next_vs = jnp.concatenate([vs[1:], bootstrap_value[None]], axis=0)
    return vs, clipped_rhos * (rewards + discounts * next_vs - values)


class IMPALALearner(msrl.Learner):
    def __init__(self, net: ActorCritic, cfg: IMPALAConfig, example_obs, num_updates: int):
        self.net, self.cfg, self.num_updates = net, cfg, num_updates
        self.obs = example_obs

    def optimizer(self):
        return make_optimizer(self.cfg, self.num_updates * self.cfg.epochs * self.cfg.minibatches)

    def init(self, key):
        init_key, key = jax.random.split(key)
        params = self.net.init(init_key, self.obs)
        return {"params": params, "opt_state": self.tx.init(params), "key": key}

    def policy_params(self, state):
        return state["params"]

    def _forward(self, params, batch: Transition, last_obs):
        """The policy head and value of every step (``[time, env]``), and the value after the last."""
        head, value = self.net.apply(params, batch.obs)
        _, last_value = self.net.apply(params, last_obs)
        return head, value, last_value

    def _loss(self, params, batch: Transition, *last):
        cfg = self.cfg
        head, value, last_value = self._forward(params, batch, *last)
        pi = policy(self.net.discrete, head)
        log_prob = pi.log_prob(batch.action)
        log_rho = jax.lax.stop_gradient(log_prob) - batch.behaviour_log_prob
        discounts = cfg.gamma * (1.0 - batch.done.astype(jnp.float32))
        vs, pg_adv = jax.lax.stop_gradient(vtrace(value, last_value, batch.reward, discounts, log_rho,
                                                  cfg.rho_bar, cfg.c_bar, cfg.gae_lambda))
        if cfg.normalize_advantage:
            pg_adv = (pg_adv - pg_adv.mean()) / (pg_adv.std() + 1e-8)
        policy_loss = -(pg_adv * log_prob).mean()
        value_loss = 0.5 * ((vs - value) ** 2).mean()
        entropy = pi.entropy().mean()
        total = policy_loss + cfg.vf_coef * value_loss - cfg.ent_coef * entropy
        # E_mu[pi/mu] = 1 whatever the lag, so rho_mean drifts from 1 only with large lags; |log rho| is 0
        # on-policy and grows with the policy lag
        return total, {"loss": total, "policy_loss": policy_loss, "value_loss": value_loss, "entropy": entropy,
                       "rho_mean": jnp.exp(log_rho).mean(), "log_rho_abs": jnp.abs(log_rho).mean()}

    def learn(self, state, batch: Transition, last_obs):
        cfg = self.cfg

        def loss(params, mb):  # a minibatch of whole trajectories, env-major: back to time-major
            t, last = mb
            return self._loss(params, jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), t), last)

        data = (jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), batch), last_obs)  # env-major: split over envs
        return minibatch_epochs(self.tx, loss, state, data, cfg.epochs, cfg.minibatches,
                                shuffle=cfg.minibatches > 1)


class IMPALA(msrl.Algorithm):
    """IMPALA: an actor-critic whose learner corrects for actors acting with older parameters by V-trace
    (importance weights clipped by ``rho_bar`` and ``c_bar``)."""

    Config = IMPALAConfig

    def __init__(self, cfg: IMPALAConfig, ctx: msrl.Context):
        super().__init__(cfg, ctx)
        if cfg.bootstrap_truncated:
            raise msrl.ConfigError("algorithm.bootstrap_truncated", f"{cfg.name} ends the return at every episode end "
                                   "(bootstrapping a truncation is not built into V-trace yet): use ppo or a2c for that")
        if ctx.learner_envs % cfg.minibatches:
            raise msrl.ConfigError("algorithm.minibatches", f"{cfg.minibatches} does not divide the "
                                   f"{ctx.learner_envs} environments a learner sees (minibatches are whole "
                                   "trajectories of some environments)")
        net = actor_critic(ctx.env_spec, cfg, "IMPALA")
        self.actor = ActorCriticActor(net)  # samples, and returns the sampled action's log-probability
        steps = cfg.epochs * cfg.minibatches  # optimizer steps per update, which anneal_lr's schedule counts
        self.learner = IMPALALearner(net, cfg, ctx.env_spec.example_obs(),
                                     ctx.per_run(ctx.num_envs * cfg.rollout_len, steps) // steps)
        self.buffer = msrl.TrajectoryBuffer(cfg.rollout_len)

    def train_step(self):
        obs = msrl.env_observe()
        for _ in range(self.cfg.rollout_len):
            out = msrl.agent_act(obs)
            next_obs, reward, done = msrl.env_step(out.action)
            msrl.buffer_insert(Transition(obs, out.action, reward, done, out.log_prob))
            obs = next_obs
        batch = msrl.buffer_get()
        metrics = msrl.agent_learn(batch, last_obs=obs)
        return metrics
