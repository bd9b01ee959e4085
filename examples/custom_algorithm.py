"""Write your own algorithm: REINFORCE with a learned baseline, defined entirely in this file.

Run it (this file registers the algorithm "reinforce", then trains with custom_algorithm.yaml beside it;
arguments are `msrl train`'s: KEY=VALUE overrides, --run-dir DIR):

    python examples/custom_algorithm.py                                      # fused: one jitted program
    python examples/custom_algorithm.py policy.name=single_learner_coarse    # 2 actor threads + 1 learner
    python examples/custom_algorithm.py policy.name=single_learner_coarse policy.backend=ray

The algorithm itself knows nothing of policies, backends, replicas or communication: it is a config model,
an actor, a learner and `train_step`, the training loop, written with the msrl API.
"""

import sys
from pathlib import Path
from typing import Literal, NamedTuple

import distrax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from pydantic import Field

import msrl


class ReinforceConfig(msrl.AlgorithmConfig):
    """The `algorithm:` section of the config; unknown keys and bad values are errors naming the key."""

    name: Literal["reinforce"] = "reinforce"
    rollout_len: int = Field(32, gt=0, description="environment steps per iteration, per env")
    lr: float = Field(1e-3, gt=0)
    gamma: float = Field(0.99, gt=0, le=1)
    vf_coef: float = Field(0.5, ge=0, description="weight of the baseline's squared error")
    ent_coef: float = Field(0.01, ge=0)
    max_grad_norm: float = Field(0.5, gt=0)
    hidden: int = Field(64, gt=0)


class Step(NamedTuple):
    """What the loop stores per environment step."""

    obs: jax.Array
    action: jax.Array
    reward: jax.Array
    done: jax.Array


class PolicyAndBaseline(nn.Module):
    """Two MLPs: action logits, and the baseline (the state's value) that REINFORCE subtracts."""

    actions: int
    hidden: int

    @nn.compact
    def __call__(self, obs):
        def mlp(x, out):
            for _ in range(2):
                x = nn.tanh(nn.Dense(self.hidden)(x))
            return nn.Dense(out)(x)

        obs = obs.astype(jnp.float32)
        return mlp(obs, self.actions), mlp(obs, 1).squeeze(-1)


class ReinforceActor(msrl.Actor):
    """Samples actions from the policy. Its state is one PRNG key per environment (from msrl.Actor.init),
    so how environments are split over replicas changes no sample."""

    def __init__(self, net: PolicyAndBaseline):
        self.net = net

    def act(self, state, params, obs):
        keys, use = msrl.split_keys(state["keys"])
        logits, _ = self.net.apply(params, obs)
        action = jax.vmap(lambda z, k: distrax.Categorical(logits=z).sample(seed=k))(logits, use)  # per-env keys
        return {"keys": keys}, action

    def greedy(self, params, obs):  # `msrl eval` and `msrl.load`: the most likely action
        logits, _ = self.net.apply(params, obs)
        return jnp.argmax(logits, axis=-1)


def returns_to_go(reward, done, bootstrap, gamma):
    """Discounted returns of every step of a [time, env] rollout, cut at episode ends; an episode still
    running at the end of the rollout is completed by ``bootstrap``, the baseline's value of the last obs."""

    def back(next_return, step):
        r, d = step
        g = r + gamma * (1.0 - d) * next_return
        return g, g

    _, returns = jax.lax.scan(back, bootstrap, (reward, done.astype(jnp.float32)), reverse=True)
    return returns


class ReinforceLearner(msrl.Learner):
    """One policy-gradient step per rollout: log pi(a|s) weighted by the (normalized) advantage G - b(s)."""

    def __init__(self, net: PolicyAndBaseline, cfg: ReinforceConfig, env_spec: msrl.EnvSpec):
        self.net, self.cfg = net, cfg
        self.dummy_obs = jnp.zeros(env_spec.obs_shape, env_spec.obs_dtype)

    def optimizer(self):
        return optax.chain(optax.clip_by_global_norm(self.cfg.max_grad_norm), optax.adam(self.cfg.lr))

    def init(self, key):
        params = self.net.init(key, self.dummy_obs)
        return {"params": params, "opt_state": self.tx.init(params)}

    def policy_params(self, state):
        return state["params"]

    def loss(self, params, batch: Step, returns):
        logits, baseline = self.net.apply(params, batch.obs)
        pi = distrax.Categorical(logits=logits)
        advantage = jax.lax.stop_gradient(returns - baseline)
        advantage = (advantage - advantage.mean()) / (advantage.std() + 1e-8)
        policy_loss = -(pi.log_prob(batch.action) * advantage).mean()
        baseline_loss = 0.5 * ((returns - baseline) ** 2).mean()
        entropy = pi.entropy().mean()
        loss = policy_loss + self.cfg.vf_coef * baseline_loss - self.cfg.ent_coef * entropy
        return loss, {"loss": loss, "policy_loss": policy_loss, "baseline_loss": baseline_loss, "entropy": entropy}

    def learn(self, state, batch: Step, last_obs):
        params = state["params"]
        _, last_value = self.net.apply(params, last_obs)
        returns = returns_to_go(batch.reward, batch.done, last_value, self.cfg.gamma)
        grads, metrics = jax.grad(self.loss, has_aux=True)(params, batch, returns)
        updates, opt_state = self.tx.update(grads, state["opt_state"], params)
        return {"params": optax.apply_updates(params, updates), "opt_state": opt_state}, metrics


@msrl.register_algorithm("reinforce")  # `algorithm.name: reinforce` in a config selects it
class Reinforce(msrl.Algorithm):
    Config = ReinforceConfig

    def __init__(self, cfg: ReinforceConfig, ctx: msrl.Context):
        super().__init__(cfg, ctx)
        if not ctx.env_spec.discrete:
            raise msrl.ConfigError("env.id", f"reinforce needs discrete actions; {ctx.env_spec.id} has continuous ones")
        net = PolicyAndBaseline(actions=ctx.env_spec.action_space.n, hidden=cfg.hidden)
        self.actor = ReinforceActor(net)
        self.learner = ReinforceLearner(net, cfg, ctx.env_spec)
        self.buffer = msrl.TrajectoryBuffer(cfg.rollout_len)

    def train_step(self):
        obs = msrl.env_observe()
        for _ in range(self.cfg.rollout_len):
            action = msrl.agent_act(obs)
            next_obs, reward, done = msrl.env_step(action)
            msrl.buffer_insert(Step(obs, action, reward, done))
            obs = next_obs
        return msrl.agent_learn(msrl.buffer_get(), last_obs=obs)


if __name__ == "__main__":
    from msrl.cli import main

    sys.exit(main(["train", str(Path(__file__).with_suffix(".yaml")), *sys.argv[1:]]))
