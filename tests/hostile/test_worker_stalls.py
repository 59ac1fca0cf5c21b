"""The persist worker held still: stopped with ``SIGSTOP`` (by this user, a debugger,
a job scheduler's freezer) while a save with a deadline waits on it. The training
process must not wait on it for ever: the save fails within its ``timeout`` (and a
grace for the worker's own deadline), the worker is killed, the committed checkpoint
stays as it was and the next save runs in a new worker. And the deadline itself: one
too far to wait for is none.

Each test says what happened before the fix it guards."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch

import storage
from extensions.errors import WorkerDiedError
from storage.checkpoint import persist
from storage.checkpoint.deadline import DeadlineExceededError
from storage.checkpoint.persist import _calls, _launch, _stuck
from storage.ops.manager import CheckpointManager

ROOT = Path(__file__).resolve().parents[2]
#: Bounds the failure of a test whose save hangs: far past the save's own deadline.
HANG = 120.0


def _state(value: float, kind: str = "staged") -> dict[str, torch.Tensor]:
    if kind == "staged":
        return {"w": torch.full((256, 256), value)}  # 256 KiB: staged in a segment
    # 64 tensors of 16 KiB, sent by value in the call's body: 1 MiB, more than the
    # socket holds, so the send itself waits on a stopped worker.
    return {f"t{i}": torch.full((64, 64), value) for i in range(64)}


def _equal(path: Path, expected: dict[str, torch.Tensor]) -> bool:
    out = {k: torch.zeros_like(v) for k, v in expected.items()}
    storage.load(out, path)
    return all(torch.equal(out[k], v) for k, v in expected.items())


@contextlib.contextmanager
def _stopped(pid: int) -> Iterator[None]:
    """Process ``pid`` stopped for the block (continued after, if it still lives)."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


@pytest.fixture
def worker() -> Iterator[persist.Worker]:
    handle = persist.worker()
    yield handle
    handle.close()


@pytest.mark.parametrize("kind", ["staged", "by value"])
def test_a_stopped_worker_fails_a_save_with_a_deadline_instead_of_hanging_it(
    tmp_path: Path, worker: persist.Worker, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """Before, the training process waited for the worker's answer (or, for a call whose
    body the socket could not hold, in the send) with no bound: a save with
    ``timeout=2`` whose worker was stopped never returned (nor did every save after it,
    waiting for its staging buffers). Now the worker is killed once the deadline and
    its grace passed; the save fails with a deadline error naming the checkpoint and the
    worker, leaves no file behind, and the next save starts a new worker."""
    monkeypatch.setattr(_stuck, "STUCK_GRACE", 1.0)  # the worker's own deadline is moot here
    path = tmp_path / "ckpt"
    storage.async_save(_state(1.0, kind), path, persist="process").result(timeout=HANG)
    committed = sorted(os.listdir(path))
    pid = worker.pid
    assert pid is not None
    with _stopped(pid):
        future = storage.async_save(_state(2.0, kind), path, persist="process", timeout=2)
        with pytest.raises(DeadlineExceededError, match="persist worker did not answer") as info:
            future.result(timeout=HANG)
    assert isinstance(info.value, WorkerDiedError)
    assert str(path) in str(info.value) and "timeout=" in str(info.value)
    assert sorted(os.listdir(path)) == committed  # the failed save's files are gone
    assert _equal(path, _state(1.0, kind))
    storage.async_save(_state(3.0, kind), path, persist="process", timeout=60).result(timeout=HANG)
    assert worker.pid not in (None, pid)
    assert _equal(path, _state(3.0, kind))


def test_a_worker_that_answers_within_the_deadline_is_kept(
    tmp_path: Path, worker: persist.Worker
) -> None:
    """The guard kills only a worker that outlives the deadline: saves with a deadline
    whose worker answers in time keep their worker."""
    path = tmp_path / "ckpt"
    storage.async_save(_state(1.0), path, persist="process").result(timeout=HANG)
    pid = worker.pid
    for value in (2.0, 3.0):
        storage.async_save(_state(value), path, persist="process", timeout=300).result(timeout=HANG)
    assert worker.pid == pid
    assert _equal(path, _state(3.0))


class _HeldTimer:
    """Stands for ``threading.Timer``: holds its function for the test to fire."""

    made: list[_HeldTimer] = []

    def __init__(self, seconds: float, function: Callable[[], None]) -> None:
        self.seconds, self.function = seconds, function
        self.daemon = False
        _HeldTimer.made.append(self)

    def start(self) -> None:
        pass

    def cancel(self) -> None:
        pass


def test_a_kill_timer_that_fires_after_the_answer_leaves_the_worker_alone(
    worker: persist.Worker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The timer that kills a worker past a call's ``kill_after`` may fire just as the
    answer arrives. It must kill only for a call still unanswered: killing the idle
    worker then would fail the next save with the death of a worker that did nothing
    wrong."""
    worker.call(os.getpid).result(timeout=HANG)  # started
    pid = worker.pid
    monkeypatch.setattr(_stuck.threading, "Timer", _HeldTimer)
    _HeldTimer.made.clear()
    answer = worker.call(os.getpid, kill_after=1.0).result(timeout=HANG)
    assert answer == pid and len(_HeldTimer.made) == 1
    _HeldTimer.made[0].function()  # fires late, after the answer
    assert worker.call(os.getpid).result(timeout=HANG) == pid  # alive, the same worker


def test_a_paused_call_is_not_killed_while_a_save_is_in_the_foreground(
    worker: persist.Worker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tiered manager's drain copies in the worker with ``pace=PAUSE``: it waits while
    a save writes the local tier. Its kill clock must not run out on that wait (the
    worker was killed under the save in the foreground, failing it too): while a save
    is in the foreground the clock starts again; once none is, an unanswered call gets
    the worker killed. The worker is stopped here, so the call stays unanswered."""
    worker.call(os.getpid).result(timeout=HANG)  # started
    pid = worker.pid
    assert pid is not None
    monkeypatch.setattr(_stuck.threading, "Timer", _HeldTimer)
    _HeldTimer.made.clear()
    with _stopped(pid):
        worker.foreground(True)
        future = worker.call(dict, pace=persist.PAUSE, kill_after=1.0)
        _HeldTimer.made[0].function()  # runs out while the save is in the foreground
        assert not future.done() and worker.pid == pid and len(_HeldTimer.made) == 2
        worker.foreground(False)
        _HeldTimer.made[1].function()  # runs out again, with no save in the foreground
        with pytest.raises(_stuck.Unanswered):
            future.result(timeout=HANG)
    assert worker.call(os.getpid).result(timeout=HANG) not in (None, pid)  # a new worker


def test_a_paced_call_is_given_its_pace_before_its_kill_clock_runs_out(
    worker: persist.Worker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A paced call spreads its writes to the pace's deadline on purpose (a tiered
    manager's drain, up to a minute): its ``kill_after`` counts from that deadline, or a
    drain paced past the manager's ``timeout=`` had its worker killed mid-copy."""
    worker.call(os.getpid).result(timeout=HANG)  # started
    monkeypatch.setattr(_stuck.threading, "Timer", _HeldTimer)
    _HeldTimer.made.clear()
    worker.pace_next(time.monotonic() + 600.0, "there")
    worker.call(dict, pace_bytes=1 << 30, pace_for="there", kill_after=1.0).result(timeout=HANG)
    assert len(_HeldTimer.made) == 1 and _HeldTimer.made[0].seconds > 500.0


@pytest.mark.parametrize("timeout", [math.inf, 1e10])
def test_a_timeout_too_far_to_wait_for_is_no_deadline(
    tmp_path: Path, worker: persist.Worker, timeout: float
) -> None:
    """``timeout=math.inf`` (or 1e10 s) was accepted, then every save and load with it
    failed with ``OverflowError: timestamp out of range``, the first wait on the
    deadline being past what a lock can wait for. Such a deadline is none: they
    succeed, through the worker too. A preemption grace that long is refused up front
    (the scheduler's kill comes sooner)."""
    state = _state(4.0)
    storage.save(state, tmp_path / "blocking", timeout=timeout)
    storage.async_save(state, tmp_path / "async", persist="process", timeout=timeout).result(
        timeout=HANG
    )
    for name in ("blocking", "async"):
        out = {k: torch.zeros_like(v) for k, v in state.items()}
        storage.load(out, tmp_path / name, timeout=timeout)
        assert all(torch.equal(out[k], v) for k, v in state.items())
    manager = CheckpointManager(tmp_path / "root", local=tmp_path / "local")
    with pytest.raises(ValueError, match="grace must be"):
        manager.save_on_signal(dict, grace=timeout)


def test_a_transport_timeout_too_far_to_wait_for_is_no_deadline(tmp_path: Path) -> None:
    """``send_checkpoint(..., timedelta.max)`` (torchft's timeouts are timedeltas) wrote
    the step, then failed with ``OverflowError`` waiting for it. It now waits for as
    long as the write takes, and the step is received."""
    sender = storage.StorageTransport(tmp_path / "ft", rank=0)
    receiver = storage.StorageTransport(tmp_path / "ft", rank=1)
    try:
        state = _state(5.0)
        sender.send_checkpoint([1], 3, state, timedelta.max)
        got = receiver.recv_checkpoint(0, sender.metadata(), 3, timedelta.max)
        assert torch.equal(got["w"], state["w"])
    finally:
        sender.shutdown()
        receiver.shutdown()


_STOPPED_WITH_A_FORKED_CHILD = """
import os, signal, sys, time, torch, storage
from storage.checkpoint import persist
from storage.checkpoint.persist import _calls, _launch, _stuck

_stuck.STUCK_GRACE = 1.0
launch = _calls.launch
children = []


def launch_and_fork(fd):
    proc = launch(fd)
    child = os.fork()  # another thread's fork while the worker starts: holds its socket
    if child == 0:
        time.sleep(150)
        os._exit(0)
    children.append(child)
    return proc


_calls.launch = launch_and_fork
state = {f"t{i}": torch.full((64, 64), 1.0) for i in range(64)}  # 1 MiB sent by value
storage.async_save(state, sys.argv[1], persist="process").result(timeout=60)
worker = persist.worker()
os.kill(worker.pid, signal.SIGSTOP)
try:
    future = storage.async_save(state, sys.argv[1], persist="process", timeout=2)
    future.result(timeout=60)
    print("saved")
except BaseException as exc:
    print(type(exc).__name__)
finally:
    os.kill(children[0], signal.SIGKILL)
"""


def test_a_stopped_worker_whose_socket_a_forked_child_holds_fails_the_save_too(
    tmp_path: Path,
) -> None:
    """The save's call is sent while the worker is stopped (its body more than the
    socket holds), and a child forked while the worker started holds the worker's end
    of the socket. Before, killing the worker at the deadline did not end the send: the
    socket's peer was still open in the child, so the send waited for ever, and the
    save with it. The socket is now shut down once the worker is gone, which ends any
    send still writing to it."""
    proc = subprocess.run(
        [sys.executable, "-c", _STOPPED_WITH_A_FORKED_CHILD, str(tmp_path / "ckpt")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=HANG,
    )
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    assert proc.stdout.split() == ["WorkerStuckError"], proc.stdout


def test_a_worker_still_starting_is_not_killed_for_its_start_up(
    worker: persist.Worker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call's ``kill_after`` counts from when its worker serves, not from its launch:
    a save with a short ``timeout=`` that started the worker (torch's import takes
    seconds, tens of them on a host whose cores training keeps busy) had that worker
    killed for its own start-up, and every later save started and killed a new one.
    The worker here waits at a gate before it starts; the call's timer, fired while it
    waits, must leave it alone."""
    worker.close()
    read, write = os.pipe()

    def gated(fd: int) -> subprocess.Popen[bytes]:
        command = _launch._COMMAND.format(
            nice=0, fd=fd, trainer=os.getpid(), ignored=_launch.IGNORED
        )
        return subprocess.Popen(
            [sys.executable, "-c", f"import os; os.read({read}, 1); {command}"],
            pass_fds=[fd, read],
            stdin=subprocess.DEVNULL,
            env=_launch._environ(),
        )

    monkeypatch.setattr(_calls, "launch", gated)
    monkeypatch.setattr(_stuck.threading, "Timer", _HeldTimer)
    _HeldTimer.made.clear()
    try:
        future = worker.call(os.getpid, kill_after=1.0)
        for timer in list(_HeldTimer.made):
            timer.function()  # the clock ran out while the worker was still starting
    finally:
        os.write(write, b"x")
        os.close(write)
        os.close(read)
    assert future.result(timeout=HANG) == worker.pid  # answered by the worker it started


def test_a_kill_after_too_far_for_a_timer_starts_none(
    worker: persist.Worker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save's ``timeout=`` just under ``threading.TIMEOUT_MAX`` plus the grace made a
    ``kill_after`` no timer can wait for: its thread failed with ``OverflowError``
    (printed to stderr at every save). Such a call has no kill timer."""
    worker.call(os.getpid).result(timeout=HANG)  # started
    monkeypatch.setattr(_stuck.threading, "Timer", _HeldTimer)
    _HeldTimer.made.clear()
    assert worker.call(os.getpid, kill_after=threading.TIMEOUT_MAX + 15).result(timeout=HANG)
    assert _HeldTimer.made == []


def test_a_transport_timeout_that_is_not_a_number_is_refused(tmp_path: Path) -> None:
    """``float("nan")`` passed the check for a negative timeout: the send's wait (a
    bound too far to wait for is none there) took it for none, whatever bound was
    meant, and a receive's deadline never came, so one whose step was never sent polled
    for ever. It is refused as a negative one is."""
    transport = storage.StorageTransport(tmp_path / "ft", rank=0)
    try:
        with pytest.raises(ValueError, match="timeout must be"):
            transport.send_checkpoint([1], 3, _state(6.0), math.nan)
        with pytest.raises(ValueError, match="timeout must be"):
            transport.recv_checkpoint(1, transport.metadata(), 3, math.nan)
    finally:
        transport.shutdown()
