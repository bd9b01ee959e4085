"""What several test modules share (no test module imports another): example paths, short runs, parameter
comparisons, and learning checks that hold on any machine."""

from __future__ import annotations

import csv
from pathlib import Path

import jax
import numpy as np

import msrl
from msrl import checkpoint
from msrl.config import load_config

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
CARTPOLE = str(EXAMPLES / "ppo_cartpole.yaml")
QUICK = ["run.progress=false", "run.tensorboard=false", "run.checkpoint_every_steps=0"]


def final_params(overrides: list[str], iterations: int = 5, config: str | Path = CARTPOLE):
    """Parameters and metric rows of ``config`` (seed 0) after ``iterations`` iterations."""
    cfg = load_config(config, ["run.seed=0", "run.total_env_steps=100000", *overrides])
    with msrl.Session(cfg, iterations_per_dispatch=iterations) as session:
        rows = session.run(iterations)
        return session.params(), rows


def short_run(config: str | Path, overrides: list[str], iterations: int):
    """Parameters before and after ``iterations`` iterations of ``config`` (seed 0, one dispatch), the
    metric rows and the env spec."""
    with msrl.Session(config, ["run.seed=0", *overrides], iterations_per_dispatch=iterations) as session:
        before = session.params()
        rows = session.run(iterations)
        return before, session.params(), rows, session.program.env.spec


# gymnax Pendulum-v1: 200-step episodes; a step costs theta^2 + 0.1 thdot^2 + 0.001 u^2 with |theta| <= pi,
# |thdot| <= 8, |u| <= 2 (clipped), so every episode's return lies in [PENDULUM_WORST, 0]
PENDULUM_WORST = -200 * (np.pi ** 2 + 0.1 * 8.0 ** 2 + 0.001 * 2.0 ** 2)


def assert_pendulum_run(before, after, rows: list[dict], episodes: int) -> None:
    """A short Gaussian-policy run on Pendulum: ``episodes`` 200-step episodes finished, their mean returns
    lie in Pendulum's range, every loss is finite, and every parameter array (the learned log std too)
    took updates."""
    assert rows[-1]["episodes"] == episodes, [r["episodes"] for r in rows]
    finished = [r["episode_return"] for r in rows if r["episodes"] > 0]
    assert finished and all(PENDULUM_WORST <= r < 0 for r in finished), finished  # NaN fails too
    assert all(np.isfinite(r["loss"]) for r in rows), [r["loss"] for r in rows]
    assert after["params"]["log_std"].shape == (1,)  # a Gaussian over Pendulum's one torque
    unchanged = [jax.tree_util.keystr(path) for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(before),
                                                                    jax.tree.leaves(after), strict=True)
                 if np.array_equal(np.asarray(x), np.asarray(y))]
    assert not unchanged, f"never updated: {unchanged}"


def max_diff(a, b) -> float:
    return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)), initial=0.0))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def returns(run_dir: Path) -> list[tuple[int, float]]:
    """(env steps, episode return) of every iteration in ``run_dir/metrics.csv``."""
    with open(Path(run_dir) / "metrics.csv", newline="") as f:
        return [(int(r["env_steps"]), float(r["episode_return"])) for r in csv.DictReader(f)]


def first_reached(run_dir: Path, threshold: float, window: int = 5) -> int | None:
    """The env steps at which the mean episode return over ``window`` consecutive iterations first reached
    ``threshold`` (None: never). A window, not the last row: the last row at an exact step budget rises or
    falls with the machine's float rounding."""
    rows = returns(run_dir)
    for i in range(window, len(rows) + 1):
        last = [r for _, r in rows[i - window:i]]
        if np.all(np.isfinite(last)) and np.mean(last) >= threshold:
            return rows[i - 1][0]
    return None


def reached(threshold: float, window: int = 5):
    """An ``on_iteration`` callback for :func:`msrl.train` that stops the run once the mean episode return over
    ``window`` consecutive iterations reaches ``threshold`` (what :func:`assert_reaches` then checks)."""
    last: list[float] = []

    def check(row: dict) -> bool:
        last.append(row["episode_return"])
        recent = last[-window:]
        return len(recent) == window and bool(np.all(np.isfinite(recent))) and float(np.mean(recent)) >= threshold

    return check


def assert_reaches(run_dir: Path, threshold: float, within: int, window: int = 5) -> int:
    """The run in ``run_dir`` reached a mean return of ``threshold`` over ``window`` iterations within
    ``within`` env steps; returns when."""
    at = first_reached(run_dir, threshold, window)
    curve = [round(r) if np.isfinite(r) else r for _, r in returns(run_dir)]  # nan: no episode finished yet
    assert at is not None and at <= within, f"never reached {threshold} over {window} iterations: {curve}"
    return at


def last_quarter_after_60k(example: Path, run_dir: Path) -> list[float]:
    """The returns of the last quarter of a 60k-step run of ``example`` (seed 0). A random policy scores
    ~22; the examples' full 500k-step runs end at 500 (README), but 60k steps are too few to settle."""
    summary = msrl.train(example, ["run.seed=0", "run.total_env_steps=60000", *QUICK], run_dir=run_dir)
    rows = [r for _, r in returns(run_dir)]
    assert len(rows) == len(summary.rows)  # one per logged row (at most 1000 a run)
    return rows[-len(rows) // 4:]


def final_leaves(run_dir: Path) -> tuple[list, dict]:
    """The leaves of the run's latest checkpoint and its metadata."""
    states, meta = checkpoint.load(checkpoint.latest(run_dir))
    return [x for key in sorted(states) for x in states[key]], meta


def alive(pid: int) -> bool:
    """Whether process ``pid`` is running (a zombie is not)."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class UsersEnv(msrl.Environment):
    """A user's own jitted environment (msrl's adapters are vouched `rowwise`; this one is not): a walk on a line,
    10 steps an episode, each environment's noise from its own key. ``mix`` breaks that: a mean over the
    environments in the reward, one key's noise for all of them, or keys from the environments' position in the
    batch instead of their global index. Other ``mix`` values break the env contract instead (tests/test_envs.py).
    """

    spec = msrl.EnvSpec("users:Walk", (2,), np.dtype(np.float32), msrl.Discrete(2))

    def __init__(self, mix: str | None = None):
        self.mix = mix

    def init(self, key, env_ids):
        ids = jax.numpy.arange(env_ids.shape[0]) if self.mix == "position" else env_ids
        keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(ids)
        zeros = jax.numpy.zeros(env_ids.shape[0])
        return {"obs": jax.numpy.zeros((env_ids.shape[0], 2)), "keys": keys, "t": zeros, "ret": zeros,
                "last": zeros, "episodes": zeros}

    def observe(self, state):
        return state, state["obs"]

    def reset(self, state):
        return {**state, "obs": jax.numpy.zeros_like(state["obs"]), "t": 0 * state["t"]}, 0 * state["obs"]

    def step(self, state, action):
        keys, noise_keys = jax.vmap(jax.random.split, out_axes=1)(state["keys"])
        noise = jax.vmap(lambda k: jax.random.normal(k, (2,)))(noise_keys)
        obs = state["obs"] + (2.0 * action - 1.0)[:, None] * 0.1 + 0.1 * noise
        reward = -jax.numpy.abs(obs[:, 0])
        if self.mix == "mean":
            reward = reward + obs[:, 0].mean()
        elif self.mix == "shared_key":
            reward = reward + jax.random.normal(state["keys"][0], reward.shape)
        elif self.mix == "nan_constant":  # (per environment: a NaN where an env's observation is out of range)
            reward = jax.numpy.where(jax.numpy.abs(obs[:, 1]) > 1e30, jax.numpy.nan, reward)
        t, ret = state["t"] + 1, state["ret"] + reward
        done = t >= 10
        where = jax.numpy.where
        state = {"obs": where(done[:, None], 0.0, obs), "keys": keys, "t": where(done, 0.0, t),
                 "ret": where(done, 0.0, ret), "last": where(done, ret, state["last"]),
                 "episodes": state["episodes"] + done}
        out = {"obs_float16": (state["obs"].astype(jax.numpy.float16), reward, done),
               "obs_3": (state["obs"][:, :1], reward, done), "reward_2d": (state["obs"], reward[:, None], done),
               "obs_dict": ({"position": state["obs"]}, reward, done),
               "done_float": (state["obs"], reward, done.astype(jax.numpy.float32)),
               "four": (state["obs"], reward, done, done),
               "int_done": (state["obs"], reward, done.astype(jax.numpy.int32)),
               "python_bool": msrl.EnvStep(state["obs"], reward, done, False),
               "final_obs_1": msrl.EnvStep(state["obs"], reward, done, done, obs[:, :1])}.get(self.mix)
        return state, out or msrl.EnvStep(state["obs"], reward, done, jax.numpy.zeros_like(done))

    def stats(self, state):
        finished = state["episodes"] > 0
        return {"return_sum": jax.numpy.where(finished, state["last"], 0.0).sum(), "finished": finished.sum(),
                "episodes": state["episodes"].sum()}
