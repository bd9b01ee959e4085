"""Rejax beside msrl in one benchmark run: the peers' venv python, and a worker process (``rejax_worker.py``)
that a benchmark alternates with its own timed runs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SETUP = HERE.parent.parent / "shared" / "peers" / "setup.sh"


def add_peer_args(ap) -> None:
    """A benchmark's ``--peer-python PATH`` and ``--no-peer``."""
    ap.add_argument("--peer-python", default=None, metavar="PATH",
                    help="a python that has Rejax (default: the venv ../shared/peers/setup.sh builds, once, where "
                         "that script is there)")
    ap.add_argument("--no-peer", action="store_true", help="leave Rejax out")


def peer_python(args) -> str | None:
    """The peers' python: ``--peer-python``, or what ``../shared/peers/setup.sh`` prints (it builds the venv the
    first time, with a note saying so); None with ``--no-peer`` or where there is no such script."""
    if args.no_peer:
        return None
    if args.peer_python is not None:
        if shutil.which(args.peer_python) is None:
            raise SystemExit(f"--peer-python {args.peer_python!r}: no such program")
        return args.peer_python
    if not SETUP.exists():
        return None
    home = Path(os.environ.get("MSRL_PEERS_HOME", Path.home() / ".cache" / "msrl-peers"))
    if not (home / "venv" / "bin" / "python").exists():
        print(f"note: building the peers' venv (Rejax, about 1 GB) in {home} with {SETUP}, once; --no-peer leaves "
              "Rejax out", file=sys.stderr, flush=True)
    out = subprocess.run(["bash", str(SETUP)], capture_output=True, text=True)
    if out.returncode != 0 or not out.stdout.strip():
        raise SystemExit(f"{SETUP} failed: {(out.stderr.strip().splitlines() or ['(no output)'])[-1]} (--no-peer "
                         "leaves Rejax out)")
    return out.stdout.strip().splitlines()[-1]


class Peer:
    """A Rejax worker process: compiled once, then one timed training run per :meth:`run`."""

    def __init__(self, python: str, spec: dict, msrl_xla_flag: bool = False):
        """``msrl_xla_flag``: give Rejax the XLA CPU option ``import msrl`` sets (``msrl.XLA_CPU_FLAG``); by
        default it runs as its users run it, without."""
        import msrl

        flags = os.environ.get("XLA_FLAGS", "")
        env = {**os.environ, "XLA_FLAGS": flags if msrl_xla_flag else flags.replace(msrl.XLA_CPU_FLAG, "").strip()}
        self.python, self.stderr = python, tempfile.TemporaryFile("w+")  # read back if it ends without an answer
        self.proc = subprocess.Popen([python, str(HERE / "rejax_worker.py"), json.dumps(spec)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.stderr, text=True, env=env)
        self.ready = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            self.stderr.seek(0)
            why = (self.stderr.read().strip().splitlines() or ["(nothing on stderr)"])[-1]
            raise SystemExit(f"the Rejax worker ({self.python}) ended without an answer: {why}")
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
