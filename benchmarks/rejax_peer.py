"""Rejax beside msrl in one benchmark run: the peers' venv python, and a worker process (``rejax_worker.py``)
that a benchmark alternates with its own timed runs."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def peer_python(arg: str | None) -> str | None:
    """The peers' venv python: ``--peer-python``, or what ``../shared/peers/setup.sh`` prints."""
    if arg:
        return arg
    setup = HERE.parent.parent / "shared" / "peers" / "setup.sh"
    if not setup.exists():
        return None
    out = subprocess.run(["bash", str(setup)], capture_output=True, text=True)
    return out.stdout.strip().splitlines()[-1] if out.returncode == 0 and out.stdout.strip() else None


class Peer:
    """A Rejax worker process: compiled once, then one timed training run per :meth:`run`."""

    def __init__(self, python: str, spec: dict, msrl_xla_flag: bool = False):
        """``msrl_xla_flag``: give Rejax the XLA CPU option ``import msrl`` sets (``msrl.XLA_CPU_FLAG``); by
        default it runs as its users run it, without."""
        import msrl

        flags = os.environ.get("XLA_FLAGS", "")
        env = {**os.environ, "XLA_FLAGS": flags if msrl_xla_flag else flags.replace(msrl.XLA_CPU_FLAG, "").strip()}
        self.proc = subprocess.Popen([python, str(HERE / "rejax_worker.py"), json.dumps(spec)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        self.ready = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the Rejax worker ended without an answer")
        return json.loads(line)

    def run(self) -> tuple[float, float]:
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        out = self._read()
        return out["wall_s"], out["cpu_s"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def timed(fn) -> tuple[float, float]:
    t, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t, time.process_time() - c
