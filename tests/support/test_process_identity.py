"""A process waited on or signalled by pid and start time: another process that got its
pid (on a busy machine, soon after it is reaped) is not taken for it, nor is an exited
process that waits to be reaped."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.support.process_identity import kill, running, start_time, wait_gone


def test_another_process_on_the_pid_is_not_the_one_waited_on() -> None:
    # What a reused pid looks like: the pid runs, but a process that started at another
    # time. Before, a test polled /proc/PID and waited on it until its deadline failed it.
    me, started = os.getpid(), start_time(os.getpid())
    assert started is not None and running(me, started)
    other = str(int(started) - 1)
    assert not running(me, other)
    assert wait_gone(me, other, timeout=60)


def test_an_exited_process_not_yet_reaped_is_gone() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    started = start_time(proc.pid)
    assert started is not None
    assert proc.stdin is not None
    proc.stdin.close()  # it exits; not reaped until wait()
    try:
        assert wait_gone(proc.pid, started, timeout=60)
        assert os.path.exists(f"/proc/{proc.pid}")  # a zombie: what a /proc poll saw
    finally:
        proc.wait()


def test_kill_spares_another_process_on_the_pid() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        started = start_time(proc.pid)
        assert started is not None
        kill(proc.pid, str(int(started) + 1))  # the pid, but not the process recorded
        assert proc.poll() is None
        kill(proc.pid, started)
        assert proc.wait(timeout=60) == -9
    finally:
        proc.kill()
        proc.wait()
