"""Shared RL math the built-in algorithms (and users' own) build on: actor-critic networks (flax) with
categorical and diagonal Gaussian policy distributions, an actor that samples from them, generalized advantage estimation, and the
epochs x minibatches SGD loop of PPO-style learners."""

from __future__ import annotations

import functools
import operator
from typing import Annotated, Any, Literal, NamedTuple, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from pydantic import BaseModel, Field

from msrl.backend import ravel, scan, unravel  # scan: the learners' lax.scan, unrolled where it pays
from msrl.components import ACTING, SHAPE_PROBE, ActOutput, Actor, MultiAgentSpec, split_keys
from msrl.errors import ConfigError, MsrlError

ROW_TILE = 16  # rows per product while acting (a batch of 16 costs about what a plain product does; see row_matmul)


def row_matmul(x: jnp.ndarray, kernel: jnp.ndarray, precision: Any = None) -> jnp.ndarray:
    """``x @ kernel``; while acting (:data:`msrl.components.ACTING`), each row's result the same whatever the
    number of rows. XLA's CPU dot picks its kernel by the product's shape, and the kernels round differently: a
    row came out ~1e-7 apart on 1 row vs 64 (a 32-column product on an AVX-512 machine), on 4 rows vs 8 (2 to 18
    columns on an AVX2 one), on 1 row vs 2 to 32 (256 x 256 on the AVX-512 one), which made acting on 2 actors x
    4 environments differ from acting on 8, or 8 x 1 from 8. Acting therefore pads the rows to whole tiles of
    ``ROW_TILE`` and computes one batched product of tiles, each ``(ROW_TILE, in) @ (in, out)``: the same kernel
    on any number of rows (a loop over tiles is not: XLA compiles a product inside a loop differently). The batch
    holds a copy of the kernel per tile: nothing measurable for PPO's 64-wide layers (fused CartPole at 64 and 256
    environments kept its speed), several times a plain product for a wide layer on hundreds of environments.
    Learning, which sees the same batches under every policy, is a plain product."""
    if not ACTING.get():
        return jnp.matmul(x, kernel, precision=precision)
    lead, rows = x.shape[:-1], int(np.prod(x.shape[:-1]))
    tiles = jnp.pad(x.reshape(rows, x.shape[-1]), ((0, -rows % ROW_TILE), (0, 0))).reshape(-1, ROW_TILE, x.shape[-1])
    y = jax.lax.dot_general(tiles, jnp.broadcast_to(kernel, (tiles.shape[0],) + kernel.shape),
                            (((2,), (1,)), ((0,), (0,))), precision=precision)
    return y.reshape(-1, kernel.shape[-1])[:rows].reshape(lead + kernel.shape[-1:])


class Dense(nn.Dense):
    """``nn.Dense`` computed with :func:`row_matmul`: acting on some environments computes each one's row as
    acting on all does. The same parameters as ``nn.Dense``, under the same names (``Dense_0``, ...), and its
    ``dtype`` and ``precision`` (not a custom ``dot_general``)."""

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        kernel = self.param("kernel", self.kernel_init, (x.shape[-1], self.features), self.param_dtype)
        bias = self.param("bias", self.bias_init, (self.features,), self.param_dtype) if self.use_bias else None
        x, kernel, bias = self.promote_dtype(x, kernel, bias, dtype=self.dtype)
        y = row_matmul(x, kernel, self.precision)
        return y if bias is None else y + jnp.reshape(bias, (1,) * (y.ndim - 1) + bias.shape)  # (explicit ranks)


class GRUCell(nn.GRUCell):
    """flax's ``GRUCell`` (its parameters, names and equations) with :class:`Dense` layers: acting gives each
    environment's hidden state the same bits on any split, at any ``features`` width."""

    @nn.compact
    def __call__(self, carry: jnp.ndarray, inputs: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
        h, width = carry, carry.shape[-1]
        common = dict(features=width, dtype=self.dtype, param_dtype=self.param_dtype, bias_init=self.bias_init)
        x_side = lambda name: Dense(name=name, kernel_init=self.kernel_init, **common)(inputs)
        h_side = lambda name, bias=False: Dense(name=name, use_bias=bias, kernel_init=self.recurrent_kernel_init,
                                                **common)(h)
        reset = self.gate_fn(x_side("ir") + h_side("hr"))
        update = self.gate_fn(x_side("iz") + h_side("hz"))
        candidate = self.activation_fn(x_side("in") + reset * h_side("hn", bias=True))
        h = (1.0 - update) * candidate + update * h
        return h, h


def _dense(features: int, scale: float, **kwargs) -> Dense:
    return Dense(features, kernel_init=nn.initializers.orthogonal(scale), bias_init=nn.initializers.zeros, **kwargs)


def action_dim(spec) -> int:
    """The policy head's width for an env spec's action space: its actions, or its action vector's size (a
    ConfigError on ``env.id`` for Box actions that are not one vector)."""
    if spec.discrete:
        return spec.action_space.n
    if len(spec.action_space.shape) != 1:
        raise ConfigError("env.id", f"{spec.id}'s actions are a Box shaped {list(spec.action_space.shape)}; msrl's "
                          "networks act with one vector of actions per step (a Box shaped [n]): flatten the env's "
                          "action space (a gymnasium.ActionWrapper that reshapes the vector, say)")
    return spec.action_space.shape[0]


class Categorical(NamedTuple):
    """A categorical distribution over the last axis of ``logits``. (These two distributions are written out
    rather than taken from distrax, whose import brings in TensorFlow Probability: ~1 s of every start.)"""

    logits: jnp.ndarray

    def sample(self, seed: jax.Array) -> jnp.ndarray:
        return jax.random.categorical(seed, self.logits)

    def log_prob(self, x: jnp.ndarray) -> jnp.ndarray:
        log_p = jax.nn.log_softmax(self.logits)
        return jnp.take_along_axis(log_p, x[..., None].astype(jnp.int32), axis=-1)[..., 0]

    def entropy(self) -> jnp.ndarray:
        log_p = jax.nn.log_softmax(self.logits)
        return -jnp.sum(jnp.exp(log_p) * log_p, axis=-1)

    def mode(self) -> jnp.ndarray:
        return jnp.argmax(self.logits, axis=-1)


class DiagGaussian(NamedTuple):
    """A diagonal Gaussian over action vectors (the last axis), from its mean and log standard deviation, in
    closed form (distrax's ``MultivariateNormalDiag`` is a bijector-transformed distribution: more XLA work per
    minibatch)."""

    mean: jnp.ndarray
    log_std: jnp.ndarray

    def sample(self, seed: jax.Array) -> jnp.ndarray:
        # the std computed on its own: fused with the normal draw, XLA's CPU code rounded exp(log_std) * noise
        # differently for one environment's row than in a batch (an actor of one env acted 6e-8 from fused)
        std = jax.lax.optimization_barrier(jnp.exp(self.log_std))
        return self.mean + std * jax.random.normal(seed, self.mean.shape, self.mean.dtype)

    def log_prob(self, x: jnp.ndarray) -> jnp.ndarray:
        z = (x - self.mean) * jnp.exp(-self.log_std)
        terms = -0.5 * z * z - self.log_std
        if ACTING.get():  # the terms added in order: XLA's CPU code summed them in another order inside fused's
            # rollout than in a replica's program (PPO on Brax's ant under single_learner_fine: 2 ulps apart)
            terms = jax.lax.optimization_barrier(terms)
            total = functools.reduce(operator.add, [terms[..., i] for i in range(terms.shape[-1])])
        else:
            total = jnp.sum(terms, axis=-1)
        return total - 0.5 * np.log(2 * np.pi) * self.mean.shape[-1]

    def entropy(self) -> jnp.ndarray:
        return jnp.sum(self.log_std, axis=-1) + 0.5 * (1 + np.log(2 * np.pi)) * self.mean.shape[-1]

    def mode(self) -> jnp.ndarray:
        return self.mean


def policy(discrete: bool, head: jnp.ndarray | tuple[jnp.ndarray, jnp.ndarray]) -> Categorical | DiagGaussian:
    """The action distribution of a network head: Categorical(logits) or diagonal Gaussian(mean, log_std)."""
    if discrete:
        return Categorical(head)
    return DiagGaussian(*head)


def flatten(x: jnp.ndarray, ndim: int) -> jnp.ndarray:
    """A batch of ``ndim``-dimensional observations as float32 vectors."""
    return x.astype(jnp.float32).reshape(x.shape[: x.ndim - ndim] + (-1,))


class ActorCritic(nn.Module):
    """Separate actor and critic MLPs. Returns ``(head, value)`` where ``head`` parameterizes the policy
    (see :func:`policy`): logits, or a Gaussian mean with a learned state-independent log std."""

    action_dim: int
    discrete: bool
    obs_ndim: int
    hidden: Sequence[int] = (64, 64)
    activation: str = "tanh"

    def inputs(self, obs) -> tuple[jnp.ndarray, jnp.ndarray]:
        """What the actor and the critic see of a batch of observations: both see all of it, flattened."""
        x = flatten(obs, self.obs_ndim)
        return x, x

    @nn.compact
    def __call__(self, obs: jnp.ndarray):
        act = {"tanh": nn.tanh, "relu": nn.relu}[self.activation]
        a, c = self.inputs(obs)
        for h in self.hidden:
            a = act(_dense(h, np.sqrt(2))(a))
        head = _dense(self.action_dim, 0.01)(a)
        if not self.discrete:
            log_std = self.param("log_std", nn.initializers.zeros, (self.action_dim,))
            head = (head, jnp.broadcast_to(log_std, head.shape))
        for h in self.hidden:
            c = act(_dense(h, np.sqrt(2))(c))
        value = _dense(1, 1.0)(c).squeeze(-1)
        return head, value


def conv_valid(x: jnp.ndarray, kernel: jnp.ndarray, stride: int) -> jnp.ndarray:
    """A 2-D convolution without padding, ``x`` [N, H, W, C] by ``kernel`` [kh, kw, C, O], as one matrix product
    of the image patches (strided slices, concatenated) and the flattened kernel. XLA's CPU backend runs the
    gradient of a native convolution inside a loop (a PPO epoch's minibatches) without its fast kernels, ~8x
    slower (jax 0.10); slices and a matrix product differentiate into slices, pads and matrix products."""
    kh, kw = kernel.shape[:2]
    ho, wo = (x.shape[1] - kh) // stride + 1, (x.shape[2] - kw) // stride + 1
    patches = jnp.concatenate([x[:, i: i + stride * (ho - 1) + 1: stride, j: j + stride * (wo - 1) + 1: stride]
                               for i in range(kh) for j in range(kw)], axis=-1)
    flat = kernel.reshape(-1, kernel.shape[-1])
    if ho * wo < ROW_TILE:  # few rows an image (small frames' last layer: 1 x 1): acting on one environment would be
        # a product of another shape, rounded otherwise (1e-7 at 36 px, 8 envs in parts of 1), as row_matmul says
        return row_matmul(patches, flat)
    return patches @ flat


class NatureCNN(nn.Module):
    """The convolutional torso of DQN's Nature paper (32 8x8/4, 64 4x4/2, 64 3x3/1, a dense 512; ReLU) shared by
    a policy head and a value head; returns ``(head, value)`` as :class:`ActorCritic` does. Observations are
    frame stacks ``[..., C, H, W]`` (EnvPool's Atari layout), usually uint8: the network scales them to [0, 1]
    itself, so frames travel and sit in buffers as bytes."""

    action_dim: int
    discrete: bool

    @nn.compact
    def __call__(self, obs: jnp.ndarray):
        batch = obs.shape[:-3]
        x = jnp.moveaxis(obs.reshape((-1, *obs.shape[-3:])), -3, -1).astype(jnp.float32) / 255.0
        for i, (features, size, stride) in enumerate(((32, 8, 4), (64, 4, 2), (64, 3, 1))):
            kernel = self.param(f"conv{i}", nn.initializers.orthogonal(np.sqrt(2)), (size, size, x.shape[-1], features))
            x = nn.relu(conv_valid(x, kernel, stride) + self.param(f"conv{i}_bias", nn.initializers.zeros, (features,)))
        x = nn.relu(_dense(512, np.sqrt(2))(x.reshape(x.shape[0], -1)))
        # both heads as one matrix product, each row rounded alike for any number of rows
        scale = jnp.concatenate([jnp.full(self.action_dim, 0.01), jnp.ones(1)])
        kernel = self.param("heads", lambda k, shape: nn.initializers.orthogonal()(k, shape) * scale,
                            (x.shape[-1], self.action_dim + 1))
        out = (row_matmul(x, kernel) + self.param("heads_bias", nn.initializers.zeros, (self.action_dim + 1,)))
        out = out.reshape(*batch, self.action_dim + 1)
        head = out[..., :-1]
        if not self.discrete:
            log_std = self.param("log_std", nn.initializers.zeros, (self.action_dim,))
            head = (head, jnp.broadcast_to(log_std, head.shape))
        return head, out[..., -1]


def mlp(x: jnp.ndarray, hidden: Sequence[int]) -> jnp.ndarray:
    """ReLU layers of the given widths."""
    for h in hidden:
        x = nn.relu(Dense(h)(x))
    return x


class TwinQ(nn.Module):
    """Two independent Q(obs, action) MLPs (the clipped double-Q of SAC and TD3)."""

    obs_ndim: int
    hidden: Sequence[int]

    @nn.compact
    def __call__(self, obs, action):
        x = jnp.concatenate([flatten(obs, self.obs_ndim), action], axis=-1)
        return tuple(Dense(1)(mlp(x, self.hidden))[..., 0] for _ in range(2))


def squash_of(space) -> tuple[jnp.ndarray, jnp.ndarray]:
    """``(scale, center)`` that map tanh's (-1, 1) onto a Box action space."""
    return (jnp.asarray((space.high - space.low) / 2, jnp.float32), jnp.asarray((space.high + space.low) / 2, jnp.float32))


def flat(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """``optax.flatten(inner)``, the same numbers: ``inner`` updates all parameters as one vector, one fused
    update instead of one per array. The vector is made by :func:`msrl.backend.ravel`, not ``optax.flatten``'s
    concatenation, which XLA's CPU backend runs erratically slowly: fused SAC (``benchmarks/sac_vs_sb3.py``)
    went from 270 to 435 steps per second with this."""
    inner = optax.with_extra_args_support(inner)

    def update(updates, state, params=None, **extra):
        vector, state = inner.update(ravel(updates), state, None if params is None else ravel(params), **extra)
        return unravel(updates, vector), state

    return optax.GradientTransformationExtraArgs(lambda params: inner.init(ravel(params)), update)


def several_updates(update, state, sample, updates: int):
    """``updates`` calls of ``update(state, sample) -> (state, metrics)`` in turn, each on an equal slice of
    ``sample``'s items (a :class:`msrl.Sample` of ``updates x batch`` entries); returns the last state and the
    metrics averaged over the updates."""
    slices = jax.tree.map(lambda x: x.reshape((updates, -1, *x.shape[1:])), (sample.item, sample.indices, sample.weights))

    def one(state, part):
        item, indices, weights = part
        return update(state, sample._replace(item=item, indices=indices, weights=weights))

    state, metrics = scan(one, state, slices)
    return state, jax.tree.map(jnp.mean, metrics)


def bootstrap_truncated_field() -> Any:
    """The ``bootstrap_truncated`` key of an on-policy algorithm's config (off: PureJaxRL's and CleanRL's way)."""
    return Field(False, description="an episode cut short (truncated: a time limit) is bootstrapped from the value "
                 "of its final observation instead of ending its return (the buffer keeps each step's final "
                 "observation)")


def truncation(step: Any, wanted: bool, key: str = "algorithm.bootstrap_truncated") -> dict[str, Any]:
    """What a transition keeps to bootstrap an episode cut short (``bootstrap_truncated``): ``truncated``, where
    one was (an end that is terminal too is not), and ``final_obs``, the observation it reached; nothing unless
    ``wanted`` (the config key ``key``, named if the environment reports no final observation). The learner adds
    ``gamma * V(final_obs)`` to the reward of such a step."""
    if not wanted:
        return {}
    try:
        final_obs = step.final_obs
    except MsrlError:  # (the key is what to change, not the algorithm's line)
        raise ConfigError(key, "this environment does not report the final observation "
                          "of an episode, which bootstrapping one cut short needs: set it to false for this "
                          "environment") from None
    return {"truncated": step.truncated & ~step.terminated, "final_obs": final_obs}


def gae(reward, done, value, last_value, gamma: float, lam: float):
    """Generalized advantage estimation over a time-major rollout (``[time, env]``): returns the advantages
    and the value targets (advantages + values). An episode end (``done``) cuts the bootstrap; the episode
    still running at the end is bootstrapped from ``last_value``. ``lam = 1``: n-step returns minus values."""

    def back(carry, t):
        adv, next_value = carry
        r, d, v = t
        not_done = 1.0 - d.astype(jnp.float32)
        delta = r + gamma * next_value * not_done - v
        adv = delta + gamma * lam * not_done * adv
        return (adv, v), adv

    _, adv = scan(back, (jnp.zeros_like(last_value), last_value), (reward, done, value), reverse=True)
    return adv, adv + value


def permutation(key: jax.Array, n: int) -> jax.Array:
    """A uniformly random order of ``range(n)`` (int32), as ``jax.random.permutation`` draws one but ~3-4x
    faster on CPU: each round sorts one array of random bits with the index packed into its low bits, which
    XLA's CPU backend sorts directly, where ``jax.random.permutation`` sorts (bits, index) pairs through a
    comparator (512 rows: ~35 vs ~100 us; 2048: ~180 vs ~750 us). Equal bits are ordered by index; as in
    ``jax.random.permutation``, there are enough rounds that the bits drawn number at least ``n**3``, so such
    ties change the order too rarely to matter."""
    width = max(1, (n - 1).bit_length())  # bits of the index
    if width > 16:  # too few random bits left in 32: the pairs' sort
        return jax.random.permutation(key, n).astype(jnp.int32)
    index = jnp.arange(n, dtype=jnp.uint32)
    order = jnp.arange(n, dtype=jnp.int32)
    for k in jax.random.split(key, -(-3 * width // (32 - width))):
        bits = jax.random.bits(k, (n,), jnp.uint32) >> width << width
        order = order[(jnp.sort(bits | index) & ((1 << width) - 1)).astype(jnp.int32)]
    return order


def minibatch_epochs(tx, loss, state, data, epochs: int, minibatches: int, shuffle: bool = True):
    """``epochs`` passes over ``data`` (leaves batched on their leading axis), each shuffling it (with
    ``shuffle``) and taking one ``tx`` step per equal slice of ``minibatches``; ``loss(params, minibatch) ->
    (loss, metrics)``. ``state`` holds ``params``, ``opt_state`` and ``key``; returns it updated and the
    metrics averaged over every step."""
    size = jax.tree.leaves(data)[0].shape[0]

    def epoch(carry, _):
        params, opt_state, key = carry
        key, perm_key = jax.random.split(key)
        if shuffle:  # one permutation for every leaf (XLA does not merge one drawn per leaf: 8 sorts, not 1)
            perm = permutation(perm_key, size)
            shuffled = jax.tree.map(lambda x: jnp.take(x, perm, axis=0), data)
        else:
            shuffled = data
        mbs = jax.tree.map(lambda x: x.reshape((minibatches, -1, *x.shape[1:])), shuffled)

        def step(carry, mb):
            params, opt_state = carry
            grads, metrics = jax.grad(loss, has_aux=True)(params, mb)
            updates, opt_state = tx.update(grads, opt_state, params)  # incl. a policy's grad_transforms
            return (optax.apply_updates(params, updates), opt_state), metrics

        (params, opt_state), metrics = scan(step, (params, opt_state), mbs)
        return (params, opt_state, key), metrics

    (params, opt_state, key), metrics = jax.lax.scan(
        epoch, (state["params"], state["opt_state"], state["key"]), None, length=epochs)
    return {"params": params, "opt_state": opt_state, "key": key}, jax.tree.map(jnp.mean, metrics)


class ActorCriticActor(Actor):
    """Samples from an :class:`ActorCritic`'s policy with per-env keys; returns the action, its
    log-probability and the value."""


    def __init__(self, net: ActorCritic):
        self.net = net

    def act(self, state, params, obs):
        keys, use = split_keys(state["keys"])

        head, value = self.net.apply(params, obs)
        action = jax.vmap(lambda h, k: policy(self.net.discrete, h).sample(seed=k))(head, use)  # per-env keys
        return {"keys": keys}, ActOutput(action, policy(self.net.discrete, head).log_prob(action), value)

    def greedy(self, params, obs):
        head, _ = self.net.apply(params, obs)
        return jnp.argmax(head, axis=-1) if self.net.discrete else head[0]


# ---------------------------------------------------------------------------------------- normalization
# Running statistics are learner state: they are updated inside ``learn`` from the batch the learner sees
# (every environment's steps, in global env order, whatever the policy), so how environments are split over
# actors changes no number; where several learners each see a share (multi_learner), the batch moments are
# averaged over them through the policy's gradient transforms (``Learner.mean_over_replicas``). Actors get the
# statistics with the parameters (``{"params": ..., "obs_rms": ...}``) and act on normalized observations.
NORM_EPS = 1e-8
NORM_CLIP = 10.0  # normalized observations and scaled rewards are clipped to +- this


def running_stats(example) -> dict:
    """Statistics of samples shaped like ``example`` (a pytree: one environment's observation, or ``0.0`` for
    a scalar): ``count`` 0, ``mean`` 0 and ``var`` 1 per element, float32."""
    return {"count": jnp.zeros((), jnp.float32),
            "mean": jax.tree.map(lambda x: jnp.zeros(jnp.shape(x), jnp.float32), example),
            "var": jax.tree.map(lambda x: jnp.ones(jnp.shape(x), jnp.float32), example)}


def update_stats(stats: dict, batch, reduce=lambda tree: tree) -> dict:
    """``stats`` merged with every sample of ``batch`` (each leaf: samples on its leading axes, then the
    statistics' shape), by Chan et al.'s parallel formula. The batch's mean, then its variance about that
    mean, go through ``reduce`` (``Learner.mean_over_replicas``): equal shares of a batch merge exactly as the
    whole would (up to float rounding), since only the ratio of the counts enters."""
    lead = lambda x, m: tuple(range(x.ndim - m.ndim))  # noqa: E731
    x = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), batch)
    leaf, ref = jax.tree.leaves(x)[0], jax.tree.leaves(stats["mean"])[0]
    n_b = float(np.prod(leaf.shape[: leaf.ndim - ref.ndim]))
    mean_b = reduce(jax.tree.map(lambda x, m: x.mean(lead(x, m)), x, stats["mean"]))
    var_b = reduce(jax.tree.map(lambda x, m: ((x - m) ** 2).mean(lead(x, m)), x, mean_b))
    count = stats["count"] + n_b
    w = n_b / count  # the batch's weight in the merged statistics
    delta = jax.tree.map(jnp.subtract, mean_b, stats["mean"])
    mean = jax.tree.map(lambda m, d: m + w * d, stats["mean"], delta)
    var = jax.tree.map(lambda v, vb, d: (1 - w) * v + w * vb + w * (1 - w) * d * d, stats["var"], var_b, delta)
    return {"count": count, "mean": mean, "var": var}


# Both multiply by ``rsqrt`` rather than divide by ``sqrt``: XLA's CPU compiler turns a division by a broadcast
# into a product with its reciprocal for a batch of 2 or more rows, not for 1 (a reshape then), so one
# environment's row was normalized 5e-7 apart from the same row in a batch (an actor of 1 env vs fused).
def normalize(stats: dict, x):
    """``x`` (a batch, leaves shaped ``[..., *stats' shape]``) standardized by ``stats``, clipped to +-10: each row
    bitwise alike in a batch of any size."""
    return jax.tree.map(lambda x, m, v: jnp.clip((jnp.asarray(x, jnp.float32) - m) * jax.lax.rsqrt(v + NORM_EPS),
                                                 -NORM_CLIP, NORM_CLIP), x, stats["mean"], stats["var"])


def scale_reward(stats: dict, reward):
    """``reward`` divided by the standard deviation in ``stats`` (not centred: a shift would change which
    policy is best where episodes end), clipped to +-10."""
    return jnp.clip(reward * jax.lax.rsqrt(stats["var"] + NORM_EPS), -NORM_CLIP, NORM_CLIP)


def discounted_returns(ret, reward, done, gamma: float):
    """The running discounted return of every env at every step of a time-major rollout (``[time, env]``),
    continuing ``ret`` (``[env]``, carried from the last rollout); it restarts after an episode's end.
    Returns the returns and the carry for the next rollout."""

    def step(ret, t):
        r, d = t
        ret = ret * gamma + r
        return ret * (1.0 - d.astype(jnp.float32)), ret

    ret, returns = scan(step, ret, (reward, done))
    return returns, ret


def per_env_carry(carry, num_envs: int):
    """A learner's per-environment carry (``[envs, ...]``) for a batch of ``num_envs`` environments: itself, or
    zeros while the compiler probes shapes with other numbers of environments; any other mismatch is an error
    (the policy did not tell the algorithm how many environments each learner sees)."""
    if carry.shape[0] == num_envs:
        return carry
    if SHAPE_PROBE.get():
        return jnp.zeros((num_envs, *carry.shape[1:]), carry.dtype)
    raise ConfigError("policy.name", f"the learner keeps state for each of {carry.shape[0]} environments, but its "
                      f"batch holds {num_envs}: size such state with Context.learner_envs (the environments one "
                      "learner sees; Context.num_envs counts every learner's), which a policy of your own sets by "
                      "declaring its learner replicas (LearnerPlan.learner_replicas)")


def normalization_state(example_obs, obs: bool, reward: bool, envs: int | None = None) -> dict:
    """A learner's normalization state: ``obs_rms`` (with ``obs``), ``reward_rms`` (with ``reward``) and, given
    ``envs``, every env's running discounted return ``ret`` (the learner sees those ``envs``' steps)."""
    state = {}
    if obs:
        state["obs_rms"] = running_stats(example_obs)
    if reward:
        state["reward_rms"] = running_stats(0.0)
        if envs is not None:
            state["ret"] = jnp.zeros((envs,), jnp.float32)
    return state


def with_obs_stats(params, stats: dict | None):
    """What actors get: the parameters alone, or with the observation statistics (``stats`` not None)."""
    return params if stats is None else {"params": params, "obs_rms": stats}


class NormalizedActor(Actor):
    """``actor`` acting on observations normalized by the statistics its parameters carry
    (``{"params", "obs_rms"}``, from :func:`with_obs_stats`)."""

    def __init__(self, actor: Actor):
        self.actor = actor

    def init(self, key, env_ids):
        return self.actor.init(key, env_ids)

    def act(self, state, params, obs):
        return self.actor.act(state, params["params"], normalize(params["obs_rms"], obs))

    def greedy(self, params, obs):
        return self.actor.greedy(params["params"], normalize(params["obs_rms"], obs))

# --------------------------------------------------------------------------------------------- recurrent
class MemoryConfig(BaseModel):
    """The config keys of a :class:`RecurrentActorCritic` (recurrent_ppo's and recurrent_impala's)."""

    memory: Literal["gru", "none"] = Field("gru", description="the recurrent cell; none: the same network without memory")
    memory_size: int = Field(128, gt=0, le=65_536, description="units of the recurrent cell")
    hidden: list[Annotated[int, Field(gt=0)]] = Field(default_factory=lambda: [128, 128], min_length=1,
                                                      description="the embedding's width, then the heads' layers")
    activation: Literal["tanh", "relu"] = Field("relu", description="the hidden layers' activation")

    def inert(self) -> dict[str, str]:
        return {**super().inert(), **({} if self.memory == "gru" else {"memory_size": "algorithm.memory=gru"})}


def recurrent_actor_critic(spec, cfg) -> "RecurrentActorCritic":
    """The :class:`RecurrentActorCritic` of a single-agent env spec and a config with :class:`MemoryConfig`'s keys."""
    if isinstance(spec, MultiAgentSpec):
        raise ConfigError("algorithm.name", f"{spec.id} has {spec.num_agents} agents; {cfg.name} acts for one",
                          also=("env.id",))
    return RecurrentActorCritic(action_dim=action_dim(spec), discrete=spec.discrete, obs_ndim=len(spec.obs_shape),
                                hidden=tuple(cfg.hidden), memory=cfg.memory, memory_size=cfg.memory_size,
                                activation=cfg.activation)


class RecurrentActorCritic(nn.Module):
    """An actor-critic with memory: ``(h, obs, start) -> (h', head, value)`` for a batch of environments.

    ``start`` (bool per env) marks an observation that begins an episode: the hidden state ``h`` is zeroed
    there before the observation goes in. The observation is embedded (one dense layer), goes through a GRU
    cell of ``memory_size`` units (``memory: "gru"``; ``"none"``: no memory, ``h`` stays zero, the same
    network otherwise), and separate actor and critic layers read the cell's output."""

    action_dim: int
    discrete: bool
    obs_ndim: int
    hidden: Sequence[int] = (128,)
    memory: str = "gru"
    memory_size: int = 128
    activation: str = "relu"

    def initial_carry(self, n: int) -> jnp.ndarray:
        return jnp.zeros((n, self.memory_size), jnp.float32)

    @nn.compact
    def __call__(self, h, obs, start):
        act = {"tanh": nn.tanh, "relu": nn.relu}[self.activation]
        h = jnp.where(start[:, None], 0.0, h)
        x = act(_dense(self.hidden[0], np.sqrt(2))(flatten(obs, self.obs_ndim)))
        if self.memory == "gru":
            h, x = GRUCell(self.memory_size)(h, x)
        a = c = x
        for width in self.hidden[1:]:
            a, c = act(_dense(width, np.sqrt(2))(a)), act(_dense(width, np.sqrt(2))(c))
        head = _dense(self.action_dim, 0.01)(a)
        if not self.discrete:
            log_std = self.param("log_std", nn.initializers.zeros, (self.action_dim,))
            head = (head, jnp.broadcast_to(log_std, head.shape))
        value = _dense(1, 1.0, name="RowDense_0")(c).squeeze(-1)  # the name checkpoints of earlier versions hold
        return h, head, value

    def init_params(self, key, example_obs):
        """Parameters, from one environment's observation."""
        return self.init(key, self.initial_carry(1), example_obs[None], jnp.zeros(1, bool))


def unroll(net: RecurrentActorCritic, params, h0, obs, start):
    """Backpropagation through time: the network over a time-major window (``obs [T, B, ...]``, ``start [T,
    B]``) from the stored initial hidden state ``h0 [B, M]``, resetting at episode starts. Returns the hidden
    state after the window and the heads and values of every step."""

    def step(h, t):
        o, s = t
        h, head, value = net.apply(params, h, o, s)
        return h, (head, value)

    h, (head, value) = scan(step, h0, (obs, start))
    return h, head, value


class RecurrentOutput(NamedTuple):
    action: jax.Array
    log_prob: jax.Array
    value: jax.Array
    hidden: jax.Array  # the hidden state the step started from (after the reset of an episode start)


class RecurrentActorCriticActor(Actor):
    """Samples from a :class:`RecurrentActorCritic`; its state holds each environment's hidden state.
    ``msrl.agent_act(obs, done)``: ``done`` marks the observations that start an episode (the previous step's
    done); the output records the hidden state the step started from, for the learner to replay the window."""

    recurrent = True

    def __init__(self, net: RecurrentActorCritic):
        self.net = net

    def init(self, key, env_ids):
        return {**super().init(key, env_ids), "h": self.net.initial_carry(len(env_ids))}

    def act(self, state, params, obs, done=None):
        keys, use = split_keys(state["keys"])
        start = jnp.zeros(state["h"].shape[0], bool) if done is None else done
        h0 = jnp.where(start[:, None], 0.0, state["h"])
        h, head, value = self.net.apply(params, h0, obs, start)
        action = jax.vmap(lambda hd, k: policy(self.net.discrete, hd).sample(seed=k))(head, use)
        out = RecurrentOutput(action, policy(self.net.discrete, head).log_prob(action), value, h0)
        return {"keys": keys, "h": h}, out

    def initial_carry(self, n: int):
        return self.net.initial_carry(n)

    def greedy_step(self, params, carry, obs, done):
        """The deterministic action of each environment, carrying the hidden state (``msrl eval``)."""
        h, head, _ = self.net.apply(params, carry, obs, done)
        return h, (jnp.argmax(head, axis=-1) if self.net.discrete else head[0])
