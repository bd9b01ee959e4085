"""Checkpoints: a runtime's whole state (learner, actors, environments, buffers, keys) plus counters.

One file per checkpoint, ``RUN_DIR/checkpoints/ckpt_<iteration>.msgpack``, written atomically (temp file,
fsync, rename) with flax's msgpack (arrays and plain values only: loading never unpickles anything). The
file holds the serialized states and meta as one ``payload`` beside its sha256 and the config's hash;
:func:`load` refuses a file whose checksum does not match or whose learner state holds a non-finite
float, and :func:`latest_good` falls back from such a file to the newest older one that loads. Each replica's component
state is stored as its list of leaves under ``fragment/replica/component``; loading puts them back into the
structure of a freshly built runtime of the same config (or, for evaluation, of a fresh learner), checking
shape and dtype leaf by leaf. Leaves that are not arrays (a host environment's simulator objects) are not
stored: a resumed run takes them fresh from the new runtime.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np
import yaml

from msrl.errors import ConfigError, TrainingError

FORMAT = 2  # 2: {"format", "sha256", "config_hash", "payload": msgpack({"meta", "states"})}; 1: no checksum
# run keys that may change between a run and its resumption
RESUMABLE_RUN_KEYS = {"total_env_steps", "iterations_per_dispatch", "progress", "tensorboard", "compile_cache",
                      "log_every_steps", "checkpoint_every_steps", "keep_checkpoints", "wandb", "stall_timeout_s",
                      "imports"}  # (imports: a file that moved, or one a run of `python my_algorithm.py` did not list)
RESUMABLE_POLICY_KEYS = {"ray_address", "ray_dashboard", "max_actor_restarts"}  # where ray runs, how it recovers
CHECKED = ("learner", "params")  # components whose float leaves must be finite in a usable checkpoint


def _storable(x: Any) -> bool:
    return isinstance(x, (np.ndarray, np.generic, jax.Array, bool, int, float))


def config_hash(config: dict[str, Any]) -> str:
    """sha256 of a config dict (as JSON with sorted keys)."""
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temp file in the same folder (fsync, then rename), so ``path``
    holds either its old content or the new one, never a part. A full disk is a :class:`TrainingError`
    ("disk full writing PATH") and leaves no temp file behind."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            raise TrainingError(f"disk full writing {path}") from None
        raise


def save(run_dir: Path, snapshot: dict[str, list[dict[str, Any]]], meta: dict[str, Any], keep: int = 3) -> Path:
    """Write a runtime snapshot (fragment -> replicas -> component -> state) and ``meta`` (JSON-like) as the
    checkpoint of ``meta['iteration']``; each component's state is stored as its list of leaves. Temp files
    left by an earlier save that died are removed first."""
    from flax import serialization

    flat = {f"{frag}/{r}/{comp}": jax.tree_util.tree_flatten_with_path(state)[0]
            for frag, replicas in snapshot.items() for r, comps in enumerate(replicas) for comp, state in comps.items()}
    states = {key: [np.asarray(x) if _storable(x) else None for _, x in leaves] for key, leaves in flat.items()}
    paths = {key: [jax.tree_util.keystr(where) for where, _ in leaves] for key, leaves in flat.items()}
    folder = Path(run_dir) / "checkpoints"
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("ckpt_*.tmp"):
        stale.unlink(missing_ok=True)
    path = of_iteration(run_dir, meta["iteration"])
    payload = serialization.msgpack_serialize({"meta": meta, "states": states, "paths": paths})
    write_atomic(path, serialization.msgpack_serialize({
        "format": FORMAT, "sha256": hashlib.sha256(payload).hexdigest(),
        "config_hash": config_hash(meta.get("config", {})), "payload": payload}))
    for old in saved(run_dir)[:-keep]:
        old.unlink()
    return path


def of_iteration(run_dir: Path, iteration: int) -> Path:
    """The checkpoint file of ``iteration`` (whether there is one or not)."""
    return Path(run_dir) / "checkpoints" / f"ckpt_{iteration:09d}.msgpack"


def saved(run_dir: Path) -> list[Path]:
    """The checkpoint files msrl wrote in a run (``ckpt_<iteration>.msgpack``), oldest first: not a copy one
    made beside them (``ckpt_best.msgpack``), which is neither taken as the newest nor rotated away."""
    found = {int(m.group(1)): p for p in (Path(run_dir) / "checkpoints").glob("ckpt_*.msgpack")
             if (m := re.fullmatch(r"ckpt_(\d{9,})\.msgpack", p.name)) and not p.is_dir()}
    return [found[i] for i in sorted(found)]


def latest(run_dir: Path) -> Path | None:
    """The newest checkpoint file of a run (whether it loads or not: see :func:`latest_good`)."""
    found = saved(run_dir)
    return found[-1] if found else None


def latest_good(run_dir: Path, quiet: bool = False) -> tuple[Path, dict[str, list[Any]], dict[str, Any]] | None:
    """The newest checkpoint that :func:`load` accepts, with its states and meta; None if the run has no
    checkpoint. Each newer one that is corrupt or non-finite is skipped with a warning on stderr naming it,
    why, and the one used instead (``quiet``: no warning). If none loads: a :class:`TrainingError` naming each."""
    bad: list[str] = []
    for path in reversed(saved(run_dir)):
        try:
            states, meta = load(path)
        except TrainingError as e:
            bad.append(str(e))
            continue
        if path.name != of_iteration(run_dir, meta.get("iteration", -1)).name:
            bad.append(f"{path} holds iteration {meta.get('iteration')}, not the one its name says (copied in from "
                       "elsewhere?)")
            continue
        if bad and not quiet:
            for reason in bad:
                print(f"msrl: warning: skipping checkpoint {reason}", file=sys.stderr, flush=True)
            print(f"msrl: warning: using the newest good checkpoint instead: {path}", file=sys.stderr, flush=True)
        return path, states, meta
    if bad:
        raise TrainingError(f"no usable checkpoint in {Path(run_dir) / 'checkpoints'}: " + "; ".join(bad))
    return None


def load(path: Path) -> tuple[dict[str, list[Any]], dict[str, Any]]:
    """The stored component states (as leaf lists) and meta of a checkpoint file. Refused (a
    :class:`TrainingError`) unless it is an msrl checkpoint whose checksum matches and whose learner and
    policy-parameter leaves are all finite."""
    from flax import serialization

    try:
        data = serialization.msgpack_restore(Path(path).read_bytes())
        if isinstance(data, dict) and data.get("format") == FORMAT and isinstance(data.get("payload"), bytes):
            if hashlib.sha256(data["payload"]).hexdigest() != data.get("sha256"):
                raise TrainingError(f"{path} is corrupt (its sha256 checksum does not match its content)")
            data = serialization.msgpack_restore(data["payload"])
        elif isinstance(data, dict) and data.get("format") == 1:  # written before checksums
            data.pop("format")
    except TrainingError:
        raise
    except Exception as e:  # noqa: BLE001 - any decoding failure means the same thing to the user
        raise TrainingError(f"{path} is not an msrl checkpoint (it does not decode as msgpack: {e})") from None
    if not isinstance(data, dict) or set(data) - {"paths"} != {"meta", "states"} or \
            not isinstance(data["states"], dict):
        raise TrainingError(f"{path} is not an msrl checkpoint (format {FORMAT})")

    def as_list(v: Any) -> list:  # msgpack_restore turns lists into {"0": ..., "1": ...}
        return [v[str(i)] for i in range(len(v))] if isinstance(v, dict) else v

    paths = data.get("paths") or {}  # (none in a checkpoint written before they were stored)
    states = {k: Leaves(as_list(v), as_list(paths[k]) if k in paths else None) for k, v in data["states"].items()}
    for key, leaves in states.items():
        if key.rsplit("/", 1)[-1] in CHECKED:
            for i, x in enumerate(leaves):
                if isinstance(x, np.ndarray) and x.dtype.kind in "fc" and not np.isfinite(x).all():
                    raise TrainingError(f"{path} holds non-finite values (state {key!r}, array {i})")
    return states, data["meta"]


class Leaves(list):
    """A stored component state: its leaves, and where each sits in the state (``['params']['Dense_0']['kernel']``;
    None: not stored). A pytree whose leaves keep those places: saved again, it is saved as it was."""

    def __init__(self, leaves: Any, paths: list[str] | None = None):
        super().__init__(leaves)
        self.paths = paths


jax.tree_util.register_pytree_with_keys(
    Leaves, lambda x: (tuple(zip(x.paths or map(jax.tree_util.SequenceKey, range(len(x))), x)),
                       None if x.paths is None else tuple(x.paths)),
    lambda paths, leaves: Leaves(leaves, None if paths is None else list(paths)))


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
    # by name, not only by place: a layer renamed (two of one shape swapping places) must not load silently
    saved_paths, paths = getattr(saved_leaves, "paths", None), [jax.tree_util.keystr(where) for where, _ in flat]
    if saved_paths is not None and saved_paths != paths:
        there, here = next(((a, b) for a, b in zip(saved_paths + ["nothing"], paths + ["nothing"]) if a != b))
        raise TrainingError(f"{path}: state {key!r} holds {key}{there} where this program's has {key}{here}: it was "
                            "written by a different program")
    if len(flat) != len(saved_leaves):
        raise TrainingError(f"{path}: state {key!r} holds {len(saved_leaves)} arrays, but this program's has "
                            f"{len(flat)}: it was written by a different program")
    out = []
    for (where, fresh), saved in zip(flat, saved_leaves, strict=True):
        if saved is None:
            out.append(fresh)
            continue
        saved = np.asarray(saved)
        shape, dtype = (fresh.shape, fresh.dtype) if isinstance(fresh, jax.ShapeDtypeStruct) else \
            (np.shape(fresh), np.asarray(fresh).dtype)
        if saved.shape != shape or saved.dtype != dtype:
            raise TrainingError(f"{path}: {key}{jax.tree_util.keystr(where)} is {saved.dtype}{list(saved.shape)} "
                                f"there but {dtype}{list(shape)} here: it was written by a different program")
        out.append(saved)
    return jax.tree.unflatten(tree, out)


def config_differences(saved: dict[str, Any], now: dict[str, Any],
                       defaults: dict[str, Any] | None = None) -> list[tuple[str, Any, Any]]:
    """The keys (dotted, with the two values) in which config ``now`` changes the training of ``saved``: anything
    but the run keys above; the names first (another algorithm's or policy's keys are not keys msrl added since).
    A key ``saved`` does not hold (it was saved before msrl had the key) was trained at its value in ``defaults``
    (:meth:`ExperimentConfig.defaults`), where given."""
    def diffs(a: Any, b: Any, key: str):
        if isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(set(a) | set(b)):
                dotted = f"{key}.{k}" if key else k
                if k in {"run": RESUMABLE_RUN_KEYS, "policy": RESUMABLE_POLICY_KEYS}.get(key, ()) or \
                        k not in a and defaults is not None and b[k] == lookup(defaults, dotted, _ABSENT):
                    continue
                yield from diffs(a.get(k, _ABSENT), b.get(k, _ABSENT), dotted)
        elif a != b:
            yield key, a, b

    names = [(k, lookup(saved, k), lookup(now, k)) for k in ("algorithm.name", "policy.name")]
    return [n for n in names if n[1] != n[2]] or list(diffs(saved, now, ""))


def check_same_config(saved: dict[str, Any], now: dict[str, Any], path: Path,
                      defaults: dict[str, Any] | None = None, overridden: Any = (), edited: Path | None = None) -> None:
    """Refuse to resume under a config that changes the training itself (:func:`config_differences`), naming
    the first key that does: one of the ``overridden`` keys where one differs (a key derived from it, such as
    ``env.num_envs`` from ``policy.actors``, may differ too), else ``algorithm.name`` or ``env.id`` where one does
    (a config of another algorithm or env differs in its keys too). ``edited``: the run's own config.yaml, where the
    config is read from it (a difference not overridden is then an edit of that file)."""
    found = config_differences(saved, now, defaults)
    if found:
        key, a, b = next((f for f in found if f[0] in overridden), None) or next(
            (f for f in found if f[0] in ("algorithm.name", "env.id")), found[0])  # (another env: before its keys)
        known = defaults is not None and lookup(defaults, key, _ABSENT) is not _ABSENT  # (not a user's dict's)
        was = f"{key}={a!r}" if a is not _ABSENT else f"msrl before {key} was a key" if known else f"no {key}"
        now_has = "no such key" if b is _ABSENT else repr(b)
        if key in overridden:
            advice = f"resume without setting {key}, or start a new run"
        elif edited is not None:  # (or the checkpoint was copied in from another run: said, not guessed)
            now_has, advice = f"{now_has} ({edited} was edited since)", ("put its value back there, or start a new "
                                                                        "run (a checkpoint copied in from another "
                                                                        f"run: move it out of {path.parent})")
        else:
            advice = f"resume with the run's own config ({path.parent.parent / 'config.yaml'}) or start a new run"
        raise ConfigError(key, f"the checkpoint {path} was trained with {was}, this config has {now_has}; {advice}")


_ABSENT = object()  # a key one config has and the other does not


def sweep_order(meta: dict[str, Any], config_file: Path) -> list[str] | None:
    """The order of the swept keys of the run whose checkpoint has ``meta`` — its members' order, the first key
    varying slowest (msgpack stores the config's dicts with their keys sorted). A checkpoint saved before it
    recorded the order: that of the run's config.yaml, if it sweeps the same keys; None if neither tells."""
    if "sweep_order" in meta:
        return list(meta["sweep_order"])
    swept = set((meta.get("config", {}).get("run") or {}).get("sweep") or {})
    try:  # (a config.yaml edited by hand would give its own order)
        order = list(((yaml.safe_load(config_file.read_text()) or {}).get("run") or {}).get("sweep") or {})
    except (OSError, yaml.YAMLError, AttributeError):
        return None
    return order if set(order) == swept else None


def lookup(d: dict, dotted: str, missing: Any = None) -> Any:
    for k in dotted.split("."):
        if not isinstance(d, dict) or k not in d:
            return missing
        d = d[k]
    return d
