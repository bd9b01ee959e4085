"""The private Ray cluster's watchdog: when the driver that started the cluster dies (even by SIGKILL), kill
every process of that cluster within a second or two.

Ray's head processes share the fate of the driver that started them, but its agents (``RuntimeEnvAgent``,
``DashboardAgent``) outlive a killed raylet by a minute (they try to report its death to the dead GCS with a
60 s timeout), and a worker busy in native code may take a while to notice. This script imports nothing but
psutil, so it starts in a fraction of a second and costs ~20 MB.

    python ray_watchdog.py DRIVER_PID [OTHER_CHILD_PID...]

It tracks the children the driver starts after it (OTHER_CHILD_PID: the driver's children before it, not
the cluster's) and all their descendants, until the driver writes a line on its stdin (the cluster is up):
from then on only the descendants of those children (workers, agents) are added. End of file on stdin
means the driver is gone or closed it (after ``ray.shutdown``); either way, what is still running of the
cluster is killed (after a grace period while the driver lives and shuts the cluster down itself).
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


def main(driver_pid: int, others: set[int]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle
    others.add(os.getpid())
    known: dict[int, psutil.Process] = {}
    try:
        driver = psutil.Process(driver_pid)
    except psutil.NoSuchProcess:
        return
    up = False
    while _running(driver):
        if not up:
            try:
                for child in driver.children():
                    if child.pid not in others:
                        known.setdefault(child.pid, child)
            except psutil.Error:
                break
        if not _track(known) and up:  # the cluster is gone though stdin is open (``ray.shutdown()`` called
            return  # directly): nothing of it is left that could start more processes
        ready, _, _ = select.select([sys.stdin], [], [], POLL_S)
        if ready:
            if not os.read(sys.stdin.fileno(), 4096):  # end of file: shut down, or the driver died
                break
            up = True
    _track(known)
    victims = [p for p in known.values() if _running(p)]
    deadline = time.monotonic() + GRACE_S
    while victims and _running(driver) and time.monotonic() < deadline:  # ray.shutdown() is stopping them
        time.sleep(POLL_S)
        victims = [p for p in victims if _running(p)]
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


def _track(known: dict[int, psutil.Process]) -> int:
    """Add the descendants of every tracked process, from one pass over the process table (``children()``
    reads all of /proc; called per tracked process, 4 polls a second, it took 10-15 % of a core during the
    Ray tests). A child is never older than its parent, so a reused pid is not followed. Returns how many
    tracked processes run."""
    kids: dict[int, list[psutil.Process]] = {}
    for p in psutil.process_iter(["ppid", "create_time"]):
        kids.setdefault(p.info["ppid"], []).append(p)
    todo = [p for p in known.values() if _running(p)]
    alive = len(todo)
    while todo:
        parent = todo.pop()
        try:
            born = parent.create_time()
        except psutil.Error:
            continue
        for child in kids.get(parent.pid, ()):
            if child.pid not in known and (child.info["create_time"] or born) >= born:
                known[child.pid] = child
                todo.append(child)
                alive += 1
    return alive


if __name__ == "__main__":
    main(int(sys.argv[1]), {int(a) for a in sys.argv[2:]})
