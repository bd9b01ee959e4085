"""Resource checks: the run directory is writable and the program's memory fits, checked before anything
compiles or allocates; out-of-memory, full-disk and XLA runtime errors become one-line TrainingErrors."""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path
from typing import Any, Iterator

from msrl.errors import ConfigError, TrainingError, arg, quote

OOM_HINT = "lower env.num_envs / algorithm.buffer_size"
# A GPU library that cannot get memory for its own handle says so in its words, not XLA's (cuSolver's QR in
# an orthogonal init, measured on an H200 with 8 processes sharing it: each took JAX's default 75 % of it).
GPU_LIBRARY_OOM = ("cuSolver internal error", "CUSOLVER_STATUS_ALLOC_FAILED", "CUBLAS_STATUS_ALLOC_FAILED",
                   "CUDA_ERROR_OUT_OF_MEMORY", "cudaErrorMemoryAllocation")
SHARED_GPU_HINT = ("; a GPU that other processes use too: JAX takes 75 % of its memory in each process "
                   "(XLA_PYTHON_CLIENT_MEM_FRACTION=.3, or XLA_PYTHON_CLIENT_PREALLOCATE=false, lets them share it)")


def check_writable(run_dir: Path, key: str) -> None:
    """The run directory (``key``: the flag that gave it) and its checkpoints/ folder, where there is one, must
    be folders msrl can write (a probe file is created and removed in each)."""
    for folder in (Path(run_dir), Path(run_dir) / "checkpoints"):
        probe = folder / f".msrl_probe_{os.getpid()}"
        try:
            if folder.is_dir():
                probe.write_bytes(b"")
                probe.unlink()
        except OSError as e:
            raise ConfigError(key, f"{folder} is not writable: {e.strerror}") from None


def _nbytes(tree: Any) -> int:
    import jax
    import numpy as np

    return sum(int(np.prod(x.shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize
               for x in jax.tree.leaves(tree) if hasattr(x, "shape") and hasattr(x, "dtype"))


def available_bytes() -> int:
    """Free memory of the default device: an accelerator's own, else the host's (psutil)."""
    import jax
    import psutil

    device = jax.devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    return int(psutil.virtual_memory().available)


def memory_estimate(program: Any) -> dict[str, int]:
    """Bytes the program holds, from shapes only (nothing is allocated): each component's state for all
    environments, and ``"values"``, the largest value the loop computes (a rollout, a sampled batch)."""
    import jax
    import jax.numpy as jnp

    from msrl.compiler import COMPONENTS, whole

    components = {**program.components, "env": program.env.shape_stand_in(), "learner": program.learner}
    if components.get("buffer") is not None:  # every shard's entries (the shards together hold buffer_size)
        components["buffer"] = whole(components["buffer"])
    names = [c for c in COMPONENTS if components.get(c) is not None]
    states = jax.eval_shape(lambda: program.init_states(names, 0, jnp.arange(program.num_envs), components=components))
    out = {c: _nbytes(states[c]) for c in names}
    out["values"] = max((_nbytes(v) for v in program.shapes.values()), default=0)
    return out


def _largest_is_a_sample(program: Any) -> bool:
    """Whether the largest value the loop computes is a replay buffer's sample."""
    from msrl.compiler.ir import leaves

    if not program.shapes:
        return False
    (stmt, _), _ = max(program.shapes.items(), key=lambda kv: _nbytes(kv[1]))
    found = [s for s in leaves(program.stmts) if s.id == stmt]
    return bool(found) and found[0].kind == "api" and found[0].api.name == "buffer_sample"


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:,.1f} {unit}"
        n /= 1024
    return ""  # pragma: no cover


def check_memory(program: Any, cfg: Any) -> None:
    """Refuse a config whose states and largest value need more memory than is free, naming the key that
    sets the biggest part: ``algorithm.buffer_size`` (a replay buffer), ``algorithm.batch_size`` (a sample),
    the network's width (``algorithm.memory_size`` or ``hidden``), ``env.num_envs``, or the number of members
    one program trains (``run.num_seeds``, ``run.sweep``)."""
    from msrl.sweep import members

    parts, runs = memory_estimate(program), len(members(cfg.run))  # one program state per seed x swept value
    need, free = sum(parts.values()) * runs, available_bytes()
    if need <= free:
        return
    if need // runs <= free:
        key = "run.sweep" if cfg.run.sweep else "run.num_seeds"
        raise ConfigError(key, f"{runs} members (seeds x swept values) need about {_size(need)} ({_size(need // runs)} "
                          f"each), but {_size(free)} are free; train fewer at once")
    fields, alg = type(cfg.algorithm).model_fields, cfg.algorithm
    widths = {k: max(getattr(alg, k)) if isinstance(getattr(alg, k), list) else getattr(alg, k)
              for k in ("memory_size", "hidden") if k in fields}  # (what sizes a network: its parameters)
    if parts.get("buffer", 0) * 2 >= need and "buffer_size" in fields:
        key = "algorithm.buffer_size"
    elif parts["values"] * 2 >= need and "batch_size" in fields and _largest_is_a_sample(program):
        key = "algorithm.batch_size"
    elif parts.get("learner", 0) * 2 >= need and widths:  # its parameters and the optimizer's moments
        key = f"algorithm.{max(widths, key=widths.get)}"
    else:
        key = "env.num_envs"
    value = getattr(alg, key.split(".")[1]) if key.startswith("algorithm.") else cfg.env.num_envs
    shown = value if isinstance(value, list) else f"{value:,}"
    raise ConfigError(key, f"{shown} needs about {_size(need)} ({need:,} bytes: "
                      + ", ".join(f"{k} {_size(v)}" for k, v in parts.items() if v)
                      + f"), but {_size(free)} are free; lower {key}")


@contextlib.contextmanager
def resource_errors(run_dir: Path) -> Iterator[None]:
    """Out of memory (MemoryError, XLA's RESOURCE_EXHAUSTED), a full disk, and any other error XLA raises
    while a program runs (a raising callback) become one-line TrainingErrors."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - anything else is re-raised as it is
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            raise TrainingError(f"disk full writing {e.filename or run_dir}") from None
        causes = [x for x in (e, e.__cause__, e.__context__) if x is not None]
        gpu = any(m in str(x) for x in causes for m in GPU_LIBRARY_OOM)
        if gpu or any(isinstance(x, MemoryError) or "RESOURCE_EXHAUSTED" in str(x) for x in causes):
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise TrainingError(f"out of memory ({first[:300]}); {OOM_HINT}{SHARED_GPU_HINT if gpu else ''}") from None
        if type(e).__name__ in ("JaxRuntimeError", "XlaRuntimeError"):  # a callback raised inside a program
            lines = str(e).strip().splitlines() or [type(e).__name__]
            first = lines[0].split("Traceback (most recent call last)")[0].strip().rstrip(":")
            what = f"{first}: {lines[-1].strip()}" if len(lines) > 1 else first
            raise TrainingError(f"the training program failed while running: {quote(what, 400)[1:-1]} "
                                "(--debug shows the full error)") from e
        raise


def mapped(fn: Any) -> Any:
    """``fn`` (``train``) with :func:`resource_errors` around the whole call."""
    import functools

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        with resource_errors(kwargs.get("run_dir") or "the run directory"):
            return fn(*args, **kwargs)

    return call
