"""A tiered manager's drain whose persist worker is held still (``SIGSTOP``: a
debugger, a scheduler's freezer): the drain's copy of a step runs in the worker, and
``wait()`` waited on it with no bound, so a training script (and its exit, which joins
the drain thread) hung. Now ``wait(timeout=)`` bounds the wait, and the manager's
``timeout=`` bounds each step's copy as it bounds a save; nothing is lost: a step not
drained stays local and a later pass drains it. The same bound holds for the local
commit of an asynchronous save, and for a manager without a local tier.

Each test says what happened before the fix it guards."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import storage
from extensions.errors import WorkerDiedError
from storage.checkpoint import persist
from storage.checkpoint.deadline import DeadlineExceededError
from storage.checkpoint.persist import _stuck
from storage.ops.manager import CheckpointManager
from tests.hostile.test_worker_stalls import HANG, _stopped


def _state(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((256, 256), value)}


@pytest.fixture
def worker() -> Iterator[persist.Worker]:
    handle = persist.worker()
    yield handle
    handle.close()


def test_a_drain_whose_worker_is_stopped_fails_its_step_which_drains_later(
    tmp_path: Path, worker: persist.Worker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, ``wait()`` after a save whose drain went to a stopped worker never
    returned, even with the manager's ``timeout=``. Now the worker is killed once the
    copy outlived that deadline and its grace: the drain fails with a deadline error
    naming the step, which stays local; the next save's drain pass copies it."""
    monkeypatch.setattr(_stuck, "STUCK_GRACE", 1.0)  # the worker's own deadline is moot here
    manager = CheckpointManager(
        tmp_path / "root", local=tmp_path / "local", persist="process", timeout=10, pace=None
    )
    manager.save(1, _state(1.0))
    manager.wait(timeout=HANG)
    pid = worker.pid
    assert pid is not None
    with _stopped(pid):
        manager.save(2, _state(2.0))  # committed locally (a blocking save writes here)
        with pytest.raises(DeadlineExceededError, match="persist worker did not answer") as info:
            manager.wait(timeout=HANG)
    assert isinstance(info.value, WorkerDiedError)
    assert "step 2" in str(info.value) and "local tier" in str(info.value)
    assert manager.durable_steps() == [1] and manager.steps() == [1, 2]
    assert manager.tiers is not None and manager.tiers.pending() == {2}
    manager.save(3, _state(3.0))
    manager.wait(timeout=HANG)
    assert manager.durable_steps() == [1, 2, 3]
    assert worker.pid not in (None, pid)
    out = _state(0.0)
    storage.load(out, tmp_path / "root" / "step-2")
    assert torch.equal(out["w"], _state(2.0)["w"])


def test_a_drain_that_goes_on_past_the_deadline_is_not_killed(
    tmp_path: Path, worker: persist.Worker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The manager's ``timeout=`` is a save's; a large step may take a slow root longer
    to drain. Before, the worker was killed once a drain's copy outlived that deadline
    and its grace, working or not: such a step never became durable, its worker killed
    every pass. Now the clock starts again while the worker goes on (its CPU time or the
    bytes it reads and writes grow): only a worker held still is killed."""
    monkeypatch.setattr(_stuck, "STUCK_GRACE", 2.0)  # 3 s windows: room for a niced worker
    state = {"w": torch.arange(2 << 20, dtype=torch.float32)}  # 8 MiB
    manager = CheckpointManager(
        tmp_path / "root",
        local=tmp_path / "local",
        persist="process",
        timeout=1,  # the blocking save writes the local tier itself, unthrottled
        pace=None,
        max_bandwidth=1_000_000,  # the worker's drain: about 8 s, past 1 s + 2 s
    )
    manager.save(1, state)
    pid = worker.pid
    manager.wait(timeout=HANG)
    assert manager.durable_steps() == [1]
    assert worker.pid == pid is not None  # the same worker: never killed
    out = {"w": torch.zeros(2 << 20)}
    storage.load(out, tmp_path / "root" / "step-1")
    assert torch.equal(out["w"], state["w"])


def test_wait_with_a_timeout_names_the_step_not_drained_and_the_drain_goes_on(
    tmp_path: Path, worker: persist.Worker
) -> None:
    """Before, ``wait()`` took no bound: a drain held by a stopped worker (with no
    ``timeout=`` on the manager, nothing kills it) held the caller too. Now
    ``wait(timeout=)`` raises a deadline error naming the step that is not durable,
    and leaves the drain running: once the worker goes on, the step is drained."""
    manager = CheckpointManager(
        tmp_path / "root", local=tmp_path / "local", persist="process", pace=None
    )
    manager.save(1, _state(1.0))
    manager.wait(timeout=HANG)
    pid = worker.pid
    assert pid is not None
    with _stopped(pid):
        manager.save(2, _state(2.0))
        with pytest.raises(DeadlineExceededError, match="step 2 is not done") as info:
            manager.wait(timeout=0.5)
        assert not isinstance(info.value, WorkerDiedError)
        assert str(tmp_path / "local") in str(info.value)
        assert manager.durable_steps() == [1]
        with pytest.raises(DeadlineExceededError, match="step 2 is not done"):
            manager.wait(timeout=0)  # a look that does not wait (it was refused before)
    manager.wait(timeout=HANG)  # the worker goes on: the drain lands
    assert manager.durable_steps() == [1, 2] and worker.pid == pid
    manager.wait(timeout=0)  # nothing in flight: it returns
    with pytest.raises(TypeError, match="timeout must be"):
        manager.wait(timeout=-1)


def test_wait_with_a_timeout_names_the_save_in_flight_without_a_local_tier(
    tmp_path: Path, worker: persist.Worker
) -> None:
    """A manager without a local tier waits for its asynchronous save alone: before,
    with no bound either. ``wait(timeout=)`` raises a deadline error naming the step
    its save writes, and the save goes on to commit."""
    manager = CheckpointManager(tmp_path / "root", persist="process", pace=None)
    manager.save(1, _state(1.0))
    manager.wait(timeout=HANG)
    pid = worker.call(os.getpid).result(timeout=HANG)
    with _stopped(pid):
        future = manager.save(2, _state(2.0), blocking=False)
        with pytest.raises(DeadlineExceededError, match="step 2 is not done"):
            manager.wait(timeout=0.5)
    manager.wait(timeout=HANG)
    assert future is not None and future.result(timeout=HANG) is None
    assert manager.steps() == [1, 2]


def test_wait_with_a_timeout_names_the_step_whose_local_commit_is_in_flight(
    tmp_path: Path, worker: persist.Worker
) -> None:
    """A tiered manager's asynchronous save commits locally through the worker: with
    the worker stopped, ``wait()`` waited for that commit with no bound. Now
    ``wait(timeout=)`` raises a deadline error naming the step, and the save goes on
    to commit and drain once the worker does."""
    manager = CheckpointManager(
        tmp_path / "root", local=tmp_path / "local", persist="process", pace=None
    )
    manager.save(1, _state(1.0))
    manager.wait(timeout=HANG)
    pid = worker.call(os.getpid).result(timeout=HANG)
    with _stopped(pid):
        future = manager.save(2, _state(2.0), blocking=False)
        with pytest.raises(DeadlineExceededError, match="step 2 is not done") as info:
            manager.wait(timeout=0.5)
        assert "its future" in str(info.value)
    manager.wait(timeout=HANG)
    assert future is not None and future.result(timeout=HANG) is None
    assert manager.durable_steps() == [1, 2]
