"""Checkpoints: a runtime's whole state (learner, actors, environments, buffers, keys) plus counters.

One file per checkpoint, ``RUN_DIR/checkpoints/ckpt_<iteration>.msgpack``, written atomically with flax's
msgpack (arrays and plain values only: loading never unpickles anything). Each replica's component
state is stored as its list of leaves under ``fragment/replica/component``; loading puts them back into the
structure of a freshly built runtime of the same config (or, for evaluation, of a fresh learner), checking
shape and dtype leaf by leaf. Leaves that are not arrays (a host environment's simulator objects) are not
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
                      "log_every_steps", "checkpoint_every_steps", "keep_checkpoints", "wandb"}


def _storable(x: Any) -> bool:
    return isinstance(x, (np.ndarray, np.generic, jax.Array, bool, int, float))


def save(run_dir: Path, snapshot: dict[str, list[dict[str, Any]]], meta: dict[str, Any], keep: int = 3) -> Path:
    """Write a runtime snapshot (fragment -> replicas -> component -> state) and ``meta`` (JSON-like) as the
    checkpoint of ``meta['iteration']``; each component's state is stored as its list of leaves."""
    from flax import serialization

    states = {f"{frag}/{r}/{comp}": [np.asarray(x) if _storable(x) else None for x in jax.tree.leaves(state)]
              for frag, replicas in snapshot.items() for r, comps in enumerate(replicas) for comp, state in comps.items()}
    folder = Path(run_dir) / "checkpoints"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"ckpt_{meta['iteration']:09d}.msgpack"
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(serialization.msgpack_serialize({"format": FORMAT, "meta": meta, "states": states}))
    os.replace(tmp, path)
    for old in sorted(folder.glob("ckpt_*.msgpack"))[:-keep]:
        old.unlink()
    return path


def latest(run_dir: Path) -> Path | None:
    found = sorted((Path(run_dir) / "checkpoints").glob("ckpt_*.msgpack"))
    return found[-1] if found else None


def load(path: Path) -> tuple[dict[str, list[Any]], dict[str, Any]]:
    """The stored component states (as leaf lists) and meta of a checkpoint file (refused unless it is an
    msrl checkpoint)."""
    from flax import serialization

    try:
        data = serialization.msgpack_restore(Path(path).read_bytes())
    except Exception as e:  # noqa: BLE001 - any decoding failure means the same thing to the user
        raise TrainingError(f"{path} is not an msrl checkpoint (it does not decode as msgpack: {e})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("states"), dict):
        raise TrainingError(f"{path} is not an msrl checkpoint (format {FORMAT})")
    # msgpack_restore turns lists into {"0": ..., "1": ...}
    states = {k: [v[str(i)] for i in range(len(v))] if isinstance(v, dict) else v for k, v in data["states"].items()}
    return states, data["meta"]


def restore(template: dict[str, list[dict[str, Any]]], states: dict[str, list[Any]], path: Path) -> dict:
    """Put stored states into the structure of ``template`` (a fresh runtime's snapshot), checking each leaf."""
    out: dict[str, list[dict[str, Any]]] = {}
    for frag, replicas in template.items():
        out[frag] = [{comp: restore_state(state, states, f"{frag}/{r}/{comp}", path) for comp, state in comps.items()}
                     for r, comps in enumerate(replicas)]
    return out


def restore_state(template: Any, states: dict[str, list[Any]], key: str, path: Path) -> Any:
    """One component's state (``key``: fragment/replica/component) in ``template``'s structure."""
    if key not in states:
        raise TrainingError(f"{path} holds no state {key!r} (it has {', '.join(sorted(states))}): it was written "
                            "by a different program")
    flat, tree = jax.tree_util.tree_flatten_with_path(template)
    saved_leaves = states[key]
    if len(flat) != len(saved_leaves):
        raise TrainingError(f"{path}: state {key!r} holds {len(saved_leaves)} arrays, but this program's has "
                            f"{len(flat)}: it was written by a different program")
    out = []
    for (where, fresh), saved in zip(flat, saved_leaves, strict=True):
        if saved is None:
            out.append(fresh)
            continue
        saved = np.asarray(saved)
        shape, dtype = np.shape(fresh), np.asarray(fresh).dtype
        if saved.shape != shape or saved.dtype != dtype:
            raise TrainingError(f"{path}: {key}{jax.tree_util.keystr(where)} is {saved.dtype}{list(saved.shape)} "
                                f"there but {dtype}{list(shape)} here: it was written by a different program")
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
