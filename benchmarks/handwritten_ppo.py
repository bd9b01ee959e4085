"""Hand-written, single-function ``lax.scan`` PPO on gymnax CartPole-v1.

This is the speed/quality baseline the msrl framework is compared against.
Everything (rollout, GAE, PPO epochs/minibatches) lives in one jittable
``train(key)`` function whose body is a ``lax.scan`` over training iterations.

Run ``python benchmarks/handwritten_ppo.py`` to train 3 seeds for 300k env
steps each and print one JSON line per seed.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import NamedTuple

import distrax
import flax.linen as nn
import gymnax
import jax
import jax.numpy as jnp
import numpy as np
import optax


class ActorCritic(nn.Module):
    """Separate actor and critic MLPs (tanh), orthogonal init, zero biases."""

    action_dim: int
    hidden: int = 64

    @nn.compact
    def __call__(self, obs):
        zeros = nn.initializers.constant(0.0)
        hid_init = nn.initializers.orthogonal(np.sqrt(2.0))

        a = nn.tanh(nn.Dense(self.hidden, kernel_init=hid_init, bias_init=zeros)(obs))
        a = nn.tanh(nn.Dense(self.hidden, kernel_init=hid_init, bias_init=zeros)(a))
        logits = nn.Dense(
            self.action_dim, kernel_init=nn.initializers.orthogonal(0.01), bias_init=zeros
        )(a)

        c = nn.tanh(nn.Dense(self.hidden, kernel_init=hid_init, bias_init=zeros)(obs))
        c = nn.tanh(nn.Dense(self.hidden, kernel_init=hid_init, bias_init=zeros)(c))
        value = nn.Dense(1, kernel_init=nn.initializers.orthogonal(1.0), bias_init=zeros)(c)

        return distrax.Categorical(logits=logits), jnp.squeeze(value, axis=-1)


class Transition(NamedTuple):
    obs: jnp.ndarray
    action: jnp.ndarray
    reward: jnp.ndarray
    done: jnp.ndarray
    log_prob: jnp.ndarray
    value: jnp.ndarray


def make_train(total_env_steps: int, num_envs: int = 4, rollout_len: int = 128, epochs: int = 4,
               minibatches: int = 4, lr: float = 2.5e-4, anneal_lr: bool = True, gamma=0.99, gae_lambda=0.95,
               clip_eps=0.2, ent_coef=0.01, vf_coef=0.5, max_grad_norm=0.5, hidden=64, env_id="CartPole-v1"):
    """returns train(key) -> (final_params, per-iteration metrics dict with key 'episode_return' of shape [num_iterations])"""
    num_iterations = total_env_steps // (num_envs * rollout_len)
    batch_size = num_envs * rollout_len
    if num_iterations < 1:
        raise ValueError("total_env_steps must be >= num_envs * rollout_len")
    if batch_size % minibatches != 0:
        raise ValueError("num_envs * rollout_len must be divisible by minibatches")
    minibatch_size = batch_size // minibatches

    env, env_params = gymnax.make(env_id)
    action_dim = env.action_space(env_params).n
    network = ActorCritic(action_dim=action_dim, hidden=hidden)

    def lr_schedule(count):
        return lr * (1.0 - (count // (minibatches * epochs)) / num_iterations)

    tx = optax.chain(
        optax.clip_by_global_norm(max_grad_norm),
        optax.adam(lr_schedule if anneal_lr else lr, eps=1e-5),
    )

    def loss_fn(params, mb: Transition, advantages, targets):
        dist, value = network.apply(params, mb.obs)
        new_logp = dist.log_prob(mb.action)

        # value loss (clipped)
        v_clipped = mb.value + jnp.clip(value - mb.value, -clip_eps, clip_eps)
        value_loss = 0.5 * jnp.mean(
            jnp.maximum(jnp.square(value - targets), jnp.square(v_clipped - targets))
        )

        # policy loss (clipped surrogate, per-minibatch advantage normalization)
        adv = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
        ratio = jnp.exp(new_logp - mb.log_prob)
        pg1 = ratio * adv
        pg2 = jnp.clip(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv
        policy_loss = -jnp.mean(jnp.minimum(pg1, pg2))

        entropy = jnp.mean(dist.entropy())
        total = policy_loss + vf_coef * value_loss - ent_coef * entropy
        return total, (policy_loss, value_loss, entropy)

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    split_keys = jax.vmap(jax.random.split)

    def train(key):
        env_ids = jnp.arange(num_envs)
        env_keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.fold_in(key, 0), i))(env_ids)
        actor_keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.fold_in(key, 1), i))(env_ids)
        learner_key = jax.random.fold_in(key, 2)
        init_key = jax.random.fold_in(key, 3)

        obs_shape = env.observation_space(env_params).shape
        params = network.init(init_key, jnp.zeros(obs_shape, jnp.float32))
        opt_state = tx.init(params)

        # initial reset: each env uses its own key chain
        env_keys, reset_keys = _split_pair(split_keys(env_keys))
        obs, env_state = jax.vmap(env.reset, in_axes=(0, None))(reset_keys, env_params)

        zeros_f = jnp.zeros((num_envs,), jnp.float32)
        log_state = (zeros_f, zeros_f, jnp.zeros((num_envs,), bool))  # running, last, has_completed

        # ------------------------------------------------------------------ #
        def env_step(carry, _):
            params, obs, env_state, env_keys, actor_keys, log_state = carry
            env_keys, step_keys = _split_pair(split_keys(env_keys))
            actor_keys, act_keys = _split_pair(split_keys(actor_keys))

            dist, value = network.apply(params, obs)
            action = jax.vmap(lambda lg, k: distrax.Categorical(logits=lg).sample(seed=k))(
                dist.logits, act_keys
            )
            log_prob = dist.log_prob(action)

            # gymnax auto-resets; it reports termination and truncation separately.
            # "done" (episode boundary) is either of them, as in the classic gymnax API.
            out = jax.vmap(env.step, in_axes=(0, 0, 0, None))(
                step_keys, env_state, action, env_params
            )
            if len(out) == 6:  # gymnax >= 1.0: obs, state, reward, terminated, truncated, info
                next_obs, env_state, reward, terminated, truncated, _ = out
                done = jnp.logical_or(terminated, truncated)
            else:  # older gymnax: obs, state, reward, done, info
                next_obs, env_state, reward, done, _ = out
            reward = reward.astype(jnp.float32)
            done_f = done.astype(jnp.float32)

            running, last, has = log_state
            running = running + reward
            last = jnp.where(done, running, last)
            has = jnp.logical_or(has, done)
            running = jnp.where(done, 0.0, running)

            tr = Transition(obs, action, reward, done_f, log_prob, value)
            return (params, next_obs, env_state, env_keys, actor_keys, (running, last, has)), tr

        def gae(traj: Transition, last_value):
            def step(carry, t: Transition):
                gae_acc, next_value = carry
                delta = t.reward + gamma * next_value * (1.0 - t.done) - t.value
                gae_acc = delta + gamma * gae_lambda * (1.0 - t.done) * gae_acc
                return (gae_acc, t.value), gae_acc

            _, advantages = jax.lax.scan(
                step, (jnp.zeros_like(last_value), last_value), traj, reverse=True
            )
            return advantages, advantages + traj.value

        def update_epoch(carry, _):
            params, opt_state, learner_key, batch = carry
            learner_key, perm_key = jax.random.split(learner_key)
            perm = jax.random.permutation(perm_key, batch_size)
            shuffled = jax.tree_util.tree_map(lambda x: jnp.take(x, perm, axis=0), batch)
            mbs = jax.tree_util.tree_map(
                lambda x: x.reshape((minibatches, minibatch_size) + x.shape[1:]), shuffled
            )

            def update_minibatch(c, mb):
                params, opt_state = c
                traj, adv, tgt = mb
                (loss, aux), grads = grad_fn(params, traj, adv, tgt)
                updates, opt_state = tx.update(grads, opt_state, params)
                params = optax.apply_updates(params, updates)
                return (params, opt_state), (loss,) + aux

            (params, opt_state), losses = jax.lax.scan(update_minibatch, (params, opt_state), mbs)
            return (params, opt_state, learner_key, batch), losses

        def iteration(carry, _):
            params, opt_state, obs, env_state, env_keys, actor_keys, learner_key, log_state = carry

            (params, obs, env_state, env_keys, actor_keys, log_state), traj = jax.lax.scan(
                env_step, (params, obs, env_state, env_keys, actor_keys, log_state), None,
                length=rollout_len,
            )

            _, last_value = network.apply(params, obs)
            advantages, targets = gae(traj, last_value)

            flat = jax.tree_util.tree_map(
                lambda x: x.reshape((batch_size,) + x.shape[2:]), (traj, advantages, targets)
            )
            (params, opt_state, learner_key, _), losses = jax.lax.scan(
                update_epoch, (params, opt_state, learner_key, flat), None, length=epochs
            )

            _, last, has = log_state
            n_done = jnp.sum(has)
            ep_ret = jnp.where(n_done > 0, jnp.sum(jnp.where(has, last, 0.0)) / jnp.maximum(n_done, 1), 0.0)
            total, pl, vl, ent = losses
            metrics = {
                "episode_return": ep_ret,
                "loss": total.mean(),
                "policy_loss": pl.mean(),
                "value_loss": vl.mean(),
                "entropy": ent.mean(),
            }
            carry = (params, opt_state, obs, env_state, env_keys, actor_keys, learner_key, log_state)
            return carry, metrics

        carry = (params, opt_state, obs, env_state, env_keys, actor_keys, learner_key, log_state)
        carry, metrics = jax.lax.scan(iteration, carry, None, length=num_iterations)
        return carry[0], metrics

    return train


def _split_pair(keys):
    """[N, 2, ...] output of vmapped split -> (carry keys, use keys)."""
    return keys[:, 0], keys[:, 1]


def _run_seed(seed: int, total_env_steps: int, **kwargs):
    num_envs = kwargs.get("num_envs", 4)
    rollout_len = kwargs.get("rollout_len", 128)
    train = make_train(total_env_steps, **kwargs)
    key = jax.random.PRNGKey(seed)

    t0 = time.perf_counter()
    compiled = jax.jit(train).lower(key).compile()
    compile_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    params, metrics = compiled(key)
    jax.block_until_ready((params, metrics))
    run_s = time.perf_counter() - t0

    ret = np.asarray(metrics["episode_return"])
    steps_per_iter = num_envs * rollout_len
    hit = np.nonzero(ret >= 475.0)[0]
    first = int((hit[0] + 1) * steps_per_iter) if hit.size else None
    return {
        "seed": seed,
        "config": kwargs,
        "total_env_steps": int(ret.shape[0] * steps_per_iter),
        "compile_s": round(compile_s, 3),
        "run_s": round(run_s, 3),
        "sps": round(ret.shape[0] * steps_per_iter / run_s, 1),
        "final_episode_return": float(ret[-1]),
        "first_step_return_ge_475": first,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--total-env-steps", type=int, default=300_000)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--num-envs", type=int, default=4)
    parser.add_argument("--rollout-len", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--minibatches", type=int, default=4)
    parser.add_argument("--lr", type=float, default=2.5e-4)
    parser.add_argument("--no-anneal-lr", action="store_true")
    args = parser.parse_args()

    cfg = dict(num_envs=args.num_envs, rollout_len=args.rollout_len, epochs=args.epochs,
               minibatches=args.minibatches, lr=args.lr, anneal_lr=not args.no_anneal_lr)
    for s in args.seeds:
        print(json.dumps(_run_seed(s, args.total_env_steps, **cfg)), flush=True)
