"""A process that is not the test's own child, named by its pid and its start time.

Once such a process has exited and been reaped (by its parent, or by init after its
parent died), its pid is free: on a busy machine another process soon gets it, and
``/proc/PID`` exists again. A test that waits for ``/proc/PID`` to go, or signals
``PID``, then waits on (or kills) a stranger. The start time (field 22 of
``/proc/PID/stat``, in clock ticks since boot) does not repeat with the pid: the pair
names one process. Record it while the process is surely alive (its parent has not
reaped it) and compare."""

from __future__ import annotations

import contextlib
import os
import signal
import time


def start_time(pid: int) -> str | None:
    """The start time of process ``pid``, or None if there is none (a zombie, which has
    exited and only waits for its parent to reap it, counts as none)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            # The name (field 2) is in parentheses and may hold spaces; field 3 follows.
            fields = stat.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


def running(pid: int, started: str) -> bool:
    """Process ``pid`` that started at ``started`` has not exited."""
    return start_time(pid) == started


def wait_gone(pid: int, started: str, timeout: float) -> bool:
    """True once process (``pid``, ``started``) has exited; False after ``timeout``
    seconds (a bound on a failure only)."""
    deadline = time.monotonic() + timeout
    while running(pid, started):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def kill(pid: int, started: str) -> None:
    """SIGKILL process (``pid``, ``started``) if it still runs, and never another
    process that got its pid: the signal goes through a pidfd opened on it, checked to
    be that process after it was opened."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        if running(pid, started):
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    finally:
        os.close(pidfd)
