"""The private Ray cluster's watchdog: when the driver that started the cluster dies (even by SIGKILL), kill
every process of that cluster within a second or two.

Ray's head processes share the fate of the driver that started them, but its agents (``RuntimeEnvAgent``,
``DashboardAgent``) outlive a killed raylet by a minute (they try to report its death to the dead GCS with a
60 s timeout), and a worker busy in native code may take a while to notice. This script imports nothing but
psutil, so it starts in a fraction of a second and costs ~20 MB.

    python ray_watchdog.py DRIVER_PID ROOT_PID...

ROOT_PID: the cluster's processes the driver started (GCS, raylet, monitors); their descendants (workers,
agents) are tracked as they appear. Its stdin is a pipe from the driver: end of file means the driver is gone
or closed it (after ``ray.shutdown``); either way, what is still running of the cluster is killed (after a
grace period when the driver is alive and shutting the cluster down itself).
"""

from __future__ import annotations

import os
import select
import signal
import sys
import time

import psutil

POLL_S = 0.25
GRACE_S = 10.0  # a clean ray.shutdown stops its processes within this


def main(driver_pid: int, roots: list[int]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle
    known: dict[int, psutil.Process] = {}
    for pid in roots:
        try:
            known[pid] = psutil.Process(pid)
        except psutil.NoSuchProcess:
            pass
    try:
        driver = psutil.Process(driver_pid)
    except psutil.NoSuchProcess:
        driver = None
    while driver is not None and driver.is_running() and driver.status() != psutil.STATUS_ZOMBIE:
        _track(known)
        ready, _, _ = select.select([sys.stdin], [], [], POLL_S)
        if ready and not os.read(sys.stdin.fileno(), 4096):  # end of file: shut down, or the driver died
            break
    _track(known)
    alive = driver is not None and driver.is_running() and driver.status() != psutil.STATUS_ZOMBIE
    victims = [p for p in known.values() if _running(p)]
    if alive:  # ray.shutdown() is stopping them: give it a moment
        _, victims = psutil.wait_procs(victims, timeout=GRACE_S)
    for p in victims:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(victims, timeout=5)


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _track(known: dict[int, psutil.Process]) -> None:
    """Add the descendants of every tracked process (is_running() also guards against reused pids)."""
    for p in list(known.values()):
        try:
            for child in p.children(recursive=True):
                known.setdefault(child.pid, child)
        except psutil.Error:
            pass


if __name__ == "__main__":
    main(int(sys.argv[1]), [int(a) for a in sys.argv[2:]])
