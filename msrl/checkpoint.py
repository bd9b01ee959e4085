"""Checkpoints: a runtime's whole state (learner, actors, environments, buffers, keys) plus counters.

One file per checkpoint, ``RUN_DIR/checkpoints/ckpt_<iteration>.msgpack``, written atomically with flax's
msgpack (arrays and plain values only: loading never unpickles anything). The state is stored as its list
of leaves; loading puts them back into the structure of a freshly built runtime of the same config, leaf by
leaf checking shape and dtype. Leaves that are not arrays (a host environment's simulator objects) are not
stored: a resumed run takes them fresh from the new runtime.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
import numpy as np

from msrl.errors import ConfigError, TrainingError

FORMAT = 1
# run keys that may change between a run and its resumption
RESUMABLE_RUN_KEYS = {"total_env_steps", "iterations_per_dispatch", "progress", "tensorboard", "compile_cache",
                      "checkpoint_every", "keep_checkpoints"}


def _storable(x: Any) -> bool:
    return isinstance(x, (np.ndarray, np.generic, jax.Array, bool, int, float))


def save(run_dir: Path, state: Any, meta: dict[str, Any], keep: int = 3, skip: tuple[str, ...] = ()) -> Path:
    """Write ``state`` (any pytree) and ``meta`` (JSON-like) as the checkpoint of ``meta['iteration']``;
    subtrees under a dict key in ``skip`` (e.g. "buffer") are not stored."""
    from flax import serialization

    leaves = jax.tree_util.tree_leaves_with_path(state)
    stored = [None if not _storable(x) or any(getattr(k, "key", None) in skip for k in path) else np.asarray(x)
              for path, x in leaves]
    folder = Path(run_dir) / "checkpoints"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"ckpt_{meta['iteration']:09d}.msgpack"
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(serialization.msgpack_serialize({"format": FORMAT, "meta": meta, "leaves": stored}))
    os.replace(tmp, path)
    for old in sorted(folder.glob("ckpt_*.msgpack"))[:-keep]:
        old.unlink()
    return path


def latest(run_dir: Path) -> Path | None:
    found = sorted((Path(run_dir) / "checkpoints").glob("ckpt_*.msgpack"))
    return found[-1] if found else None


def load(path: Path) -> tuple[list[Any], dict[str, Any]]:
    """The stored leaves and meta of a checkpoint file (refused unless it is an msrl checkpoint)."""
    from flax import serialization

    try:
        data = serialization.msgpack_restore(Path(path).read_bytes())
    except Exception as e:  # noqa: BLE001 - any decoding failure means the same thing to the user
        raise TrainingError(f"{path} is not an msrl checkpoint (it does not decode as msgpack: {e})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("leaves"), (list, dict)):
        raise TrainingError(f"{path} is not an msrl checkpoint (format {FORMAT})")
    leaves = data["leaves"]
    if isinstance(leaves, dict):  # msgpack_restore turns lists into {"0": ..., "1": ...}
        leaves = [leaves[str(i)] for i in range(len(leaves))]
    return leaves, data["meta"]


def restore(template: Any, leaves: list[Any], path: Path) -> Any:
    """Put checkpoint leaves into ``template``'s structure (a fresh runtime's state), checking each."""
    flat, tree = jax.tree_util.tree_flatten_with_path(template)
    if len(flat) != len(leaves):
        raise TrainingError(f"{path} holds {len(leaves)} state arrays, but this program has {len(flat)}: it was "
                            "written by a different program")
    out = []
    for (where, fresh), saved in zip(flat, leaves, strict=True):
        if saved is None:
            out.append(fresh)
            continue
        saved = np.asarray(saved)
        shape, dtype = np.shape(fresh), np.asarray(fresh).dtype if _storable(fresh) else None
        if saved.shape != shape or (dtype is not None and saved.dtype != dtype):
            raise TrainingError(f"{path}: state {jax.tree_util.keystr(where)} is {saved.dtype}{list(saved.shape)} in "
                                f"the checkpoint but {dtype}{list(shape)} here: it was written by a different program")
        out.append(saved)
    return jax.tree.unflatten(tree, out)


def check_same_config(saved: dict[str, Any], now: dict[str, Any], path: Path) -> None:
    """Refuse to resume under a config that changes the training itself (anything but the run keys above)."""
    def diff(a: Any, b: Any, key: str) -> str | None:
        if isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(set(a) | set(b)):
                if key == "run" and k in RESUMABLE_RUN_KEYS:
                    continue
                found = diff(a.get(k), b.get(k), f"{key}.{k}" if key else k)
                if found:
                    return found
            return None
        return None if a == b else key

    key = diff(saved, now, "")
    if key:
        a, b = (_get(saved, key), _get(now, key))
        raise ConfigError(key, f"the checkpoint {path} was trained with {key}={a!r}, this config has {b!r}; "
                          "resume with the run's own config (RUN_DIR/config.yaml) or start a new run")


def _get(d: dict, dotted: str) -> Any:
    for k in dotted.split("."):
        d = d.get(k) if isinstance(d, dict) else None
    return d
