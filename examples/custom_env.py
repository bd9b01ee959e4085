"""Your own jitted environment: a walk on a line towards a goal, ids ``walk:Line`` (``env.kwargs.length``: the
goal's distance). Import it where msrl can see it (``--import examples/custom_env.py`` or ``run.imports``, which a
run's config.yaml lists for ``msrl eval`` and ``--resume``; or an import before ``msrl.train``, which it does not):

    msrl train examples/ppo_cartpole.yaml --import examples/custom_env.py env.id=walk:Line env.kwargs.length=5

A batch of environments is functional and jittable: ``init`` makes the state of the environments with the given
global indices, ``observe``/``reset``/``step`` take the state and return it with their result, ``stats`` gives the
episode statistics msrl logs. Every environment's numbers come from its own key (``fold_in`` of its global
index), so a policy that splits the environments over replicas computes what ``fused`` computes.
"""

import jax
import jax.numpy as jnp
import numpy as np

import msrl

STEPS = 20  # an episode's steps at most


class Line(msrl.Environment):
    def __init__(self, length: float = 3.0):
        self.length = float(length)
        self.spec = msrl.EnvSpec("walk:Line", (2,), np.dtype(np.float32), msrl.Discrete(3))  # left, stay, right

    def init(self, key, env_ids):
        keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(env_ids)  # the environment's own key
        zeros = jnp.zeros(env_ids.shape[0])
        return {"x": zeros, "t": zeros, "keys": keys, "ret": zeros, "last": zeros, "length": zeros, "episodes": zeros}

    def _obs(self, state):
        return jnp.stack([state["x"], state["t"] / STEPS], axis=-1)

    def observe(self, state):
        return state, self._obs(state)

    def reset(self, state):
        state = {**state, "x": 0.0 * state["x"], "t": 0.0 * state["t"], "ret": 0.0 * state["ret"]}
        return state, self._obs(state)

    def step(self, state, action):
        keys, noise = jax.vmap(jax.random.split, out_axes=1)(state["keys"])
        slip = jax.vmap(lambda k: jax.random.uniform(k) < 0.1)(noise)  # 1 step in 10 the walker stays put
        x = state["x"] + jnp.where(slip, 0.0, action.astype(jnp.float32) - 1.0)
        t = state["t"] + 1.0
        reward = jnp.where(x >= self.length, 1.0, -0.01)
        terminated, truncated = x >= self.length, (t >= STEPS) & (x < self.length)
        done, ret = terminated | truncated, state["ret"] + reward
        state = {"x": jnp.where(done, 0.0, x), "t": jnp.where(done, 0.0, t), "keys": keys,  # auto-reset
                 "ret": jnp.where(done, 0.0, ret), "last": jnp.where(done, ret, state["last"]),
                 "length": jnp.where(done, t, state["length"]), "episodes": state["episodes"] + done}
        return state, msrl.EnvStep(self._obs(state), reward, terminated, truncated)

    def stats(self, state):  # sums over environments (replicas add theirs up)
        finished = state["episodes"] > 0
        return {"return_sum": jnp.where(finished, state["last"], 0.0).sum(), "finished": finished.sum(),
                "length_sum": jnp.where(finished, state["length"], 0.0).sum(), "episodes": state["episodes"].sum()}


@msrl.register_env("walk")
def make(name: str, **kwargs) -> msrl.Environment:
    if name != "Line":
        raise msrl.ConfigError("env.id", f"walk:{name}: the walk: environments are walk:Line")
    return Line(**kwargs)
