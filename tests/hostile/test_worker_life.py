"""The persist worker's life is its training process's: it must not outlive a trainer
killed with ``kill -9``, whatever else of the trainer's still holds their socket, nor
end before it, of a signal meant for the trainer.

Each test says what happened before the fix it guards."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import storage
from storage.checkpoint import persist
from tests.support.process_identity import kill, running, wait_gone
from tests.support.trees import assert_tree_equal

ROOT = Path(__file__).resolve().parents[2]

_FORK_DURING_START = """
import os, signal, sys, time, torch, storage
from storage.checkpoint import persist
from storage.checkpoint.persist import _calls
from tests.support.process_identity import start_time

launch = _calls.launch
children = []


def launch_and_fork(fd):
    proc = launch(fd)
    # Another thread of the trainer forks now (a DataLoader worker for the next epoch),
    # while this one starts the worker: the child gets the socket before the handle
    # records it, so the hook that closes it in children has nothing to close.
    child = os.fork()
    if child == 0:  # a child of the trainer's that outlives it (the test ends it)
        time.sleep(300)
        os._exit(0)
    children.append(child)
    return proc


_calls.launch = launch_and_fork
storage.async_save({"w": torch.ones(256, 256)}, sys.argv[1], persist="process").result()
pid = persist.worker().pid
print(pid, start_time(pid), children[0], start_time(children[0]), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_worker_stops_with_its_trainer_whatever_child_forked_while_it_started(
    tmp_path: Path,
) -> None:
    """Before, a child forked while another thread was starting the worker kept the
    socket to it (the hook that closes it in children ran before the handle knew it):
    the trainer killed, the worker went on, its segments mapped, for as long as that
    child lived. The worker now also watches its trainer's pid (a ``pidfd``)."""
    out = tmp_path / "out"
    script = textwrap.dedent(_FORK_DURING_START)
    with out.open("w") as stdout:
        argv = [sys.executable, "-c", script, str(tmp_path / "ckpt")]
        proc = subprocess.Popen(argv, stdout=stdout, stderr=subprocess.DEVNULL, cwd=ROOT)
        assert proc.wait(timeout=180) == -signal.SIGKILL
    # Each process by pid and start time: a pid freed meanwhile may be a stranger's.
    worker_pid, worker_start, child_pid, child_start = out.read_text().split()
    try:
        gone = wait_gone(int(worker_pid), worker_start, timeout=60)  # bounds a failure only
        assert gone, "the worker outlived its trainer"
        assert running(int(child_pid), child_start)  # the child lived on all along
    finally:
        kill(int(child_pid), child_start)


@pytest.mark.parametrize("signum", [signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2])
def test_a_signal_a_scheduler_sends_every_process_of_the_job_leaves_the_worker_writing(
    tmp_path: Path, signum: int
) -> None:
    """A scheduler warns a job before preempting it by signalling every process of the
    job (Slurm's ``--signal=USR1@90``, which ``save_on_signal(signals=[SIGUSR1])`` is
    made to answer; a hangup reaches a whole session). The worker inherits none of the
    training process's handlers, so before, it died of the signal's default action and
    took the save in flight with it, the one the handler waits for. It now ignores
    them, as it does SIGINT and SIGTERM."""
    from tests.checkpoint.test_worker import Gate, big_state, loaded, wait_for

    worker = persist.worker()
    try:
        gate = tmp_path / "gate"
        gate.mkdir()
        state = big_state(seed=5)
        path = tmp_path / "ckpt"
        future = storage.async_save(state, path, transforms=[Gate(str(gate))], persist="process")
        wait_for(gate / "started")
        pid = worker.pid
        assert pid is not None
        os.kill(pid, signum)
        (gate / "open").touch()
        future.result(timeout=120)
        assert worker.pid == pid
        assert_tree_equal(state, loaded(path, state))
    finally:
        worker.close()
