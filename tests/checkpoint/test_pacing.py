"""A manager's paced uploads: an asynchronous save written by the persist worker spreads
its upload over a share of the interval between saves, and whoever waits for it lifts
the pace. What these guard: a pace never makes a waiting caller wait for it (the
future's ``result()``, the next save, ``wait()``), a cap (``max_bandwidth``) still holds
after the pace is lifted, and the first save or ``pace=None`` is never paced."""

from __future__ import annotations

import concurrent.futures
import math
import threading
import time
import types
from typing import Any

import pytest
import torch

import storage
from extensions.errors import WorkerDiedError
from storage.checkpoint import persist
from storage.checkpoint.persist import _calls
from storage.checkpoint.persist._throttle import Bucket
from storage.ops.pace import MAX_PACED_SECONDS, UploadPace
from tests.checkpoint.test_worker import loaded
from tests.support.trees import assert_tree_equal

# Generous: a step that is lifted finishes in milliseconds; one that is not takes hours.
PROMPT = 60.0


def _taker(bucket: Bucket, n: int) -> threading.Thread:
    thread = threading.Thread(target=bucket.take, args=(n,), daemon=True)
    thread.start()
    return thread


def test_a_hurry_ends_the_wait_of_a_paced_write() -> None:
    bucket = Bucket()
    bucket.set_pace(1.0, math.inf)  # one byte a second: this write would wait ~11 days
    waiting = _taker(bucket, 1_000_000)
    bucket.hurry()
    waiting.join(PROMPT)
    assert not waiting.is_alive()
    assert bucket.pace is None
    bucket.take(1_000_000)  # and later writes are not paced


def test_a_hurry_leaves_the_bandwidth_cap_in_force() -> None:
    bucket = Bucket()
    bucket.rate = 1.0  # a cap of one byte a second, paced below it
    bucket.set_pace(0.5, math.inf)
    waiting = _taker(bucket, 1_000_000)
    bucket.hurry()
    waiting.join(0.5)
    assert waiting.is_alive()  # still under the cap: ~11 days
    with bucket._changed:  # a cap lifted by the next call's options
        bucket.rate = None
        bucket._changed.notify_all()
    waiting.join(PROMPT)
    assert not waiting.is_alive()


class _Clock:
    """A clock that moves only when told."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_paced_upload_that_fell_behind_catches_up_at_full_speed() -> None:
    """Before, the pace was a token bucket that kept 50 ms of unused allowance: every
    stretch where the link or the cores were slower than the pace was lost for good, and
    the upload overran the deadline its rate was made for (the next save then waited for
    it). The pace is a schedule: bytes behind it go at once, bytes ahead of it wait."""
    clock = _Clock()
    bucket = Bucket(clock)
    bucket.set_pace(100.0, math.inf)  # the save's bytes due at 100 a second from now
    clock.now += 10.0  # ten seconds in, 1000 bytes due, none written (a busy link)
    behind = _taker(bucket, 900)
    behind.join(PROMPT)
    assert not behind.is_alive()  # behind the schedule: no wait
    ahead = _taker(bucket, 200)  # 1100 bytes by second 10: ahead of the schedule
    ahead.join(0.2)
    assert ahead.is_alive()  # held until second 11 (this clock never gets there)
    bucket.hurry()
    ahead.join(PROMPT)
    assert not ahead.is_alive()


def test_no_paced_write_waits_past_the_deadline() -> None:
    """Before, the schedule had no end: bytes beyond those the rate was made for (a
    heartbeat, an upload that was nearly empty) waited on past the save's deadline, for
    as long as their share of a tiny rate said (minutes for a 45-byte heartbeat)."""
    clock = _Clock()
    bucket = Bucket(clock)
    bucket.set_pace(1.0, clock.now + 5.0)  # one byte a second, due within 5 s
    clock.now += 5.0  # at the deadline: whatever is left goes now
    late = _taker(bucket, 1_000_000)
    late.join(PROMPT)
    assert not late.is_alive()
    bucket.take(0)  # and a write of nothing never waits


def test_a_small_upload_is_not_paced() -> None:
    """Pacing a few KB spreads nothing worth spreading and only makes it durable later."""
    w = persist.Worker()
    w.pace_next(time.monotonic() + 3600.0)
    with w._lock:
        assert w._take_pace(64 << 10) is None
    assert w._pace_until is None


def test_a_cap_keeps_only_a_short_burst() -> None:
    """The cap (``max_bandwidth``) is a limit on the rate, not a schedule: time it went
    unused does not buy a burst above it."""
    clock = _Clock()
    bucket = Bucket(clock)
    bucket.rate = 100.0
    clock.now += 10.0
    burst = _taker(bucket, 900)  # would be due by now on a schedule; the cap holds it
    burst.join(0.2)
    assert burst.is_alive()
    with bucket._changed:
        bucket.rate = None
        bucket._changed.notify_all()
    burst.join(PROMPT)
    assert not burst.is_alive()


def test_a_pace_that_is_no_limit_does_not_block() -> None:
    bucket = Bucket()
    bucket.take(1 << 30)  # neither a cap nor a pace


def _state(mb: int = 8) -> dict[str, Any]:
    return {"w": torch.arange(mb << 18, dtype=torch.float32)}


def _saved_long_ago(path: Any) -> storage.CheckpointManager:
    """A paced manager whose step 1 is committed and began long ago: its next
    asynchronous save may spread over MAX_PACED_SECONDS."""
    mgr = storage.CheckpointManager(str(path), pace=1.0, persist="process")
    first = mgr.save(1, _state(), blocking=False)
    assert first is not None
    first.result()
    mgr.root_tier.pace._last = time.monotonic() - 10 * MAX_PACED_SECONDS
    return mgr


def test_waiting_on_a_paced_save_lifts_its_pace(tmp_path: Any) -> None:
    """Before, nothing but the pace's own end would let it finish: a save paced over the
    minute since the previous one kept ``result()`` waiting that minute."""
    mgr = _saved_long_ago(tmp_path / "ck")
    try:
        began = time.monotonic()
        second = mgr.save(2, _state(), blocking=False)
        assert second is not None
        waited = time.monotonic() + PROMPT
        while not persist.worker()._paced:  # its writes went out with its pace
            assert time.monotonic() < waited, "the save's writes did not take its pace"
            time.sleep(0.01)
        second.result(timeout=MAX_PACED_SECONDS / 2)
        assert time.monotonic() - began < MAX_PACED_SECONDS / 2
        assert mgr.steps() == [1, 2]
        restored = _state()
        restored["w"].zero_()
        mgr.load(restored, step=2)
        assert torch.equal(restored["w"], _state()["w"])
    finally:
        mgr.wait()


def test_the_next_save_lifts_the_pace_of_the_one_in_flight(tmp_path: Any) -> None:
    mgr = _saved_long_ago(tmp_path / "ck")
    try:
        began = time.monotonic()
        mgr.save(2, _state(), blocking=False)
        mgr.save(3, _state(), blocking=True)  # waits for step 2 first
        assert time.monotonic() - began < MAX_PACED_SECONDS / 2
        assert mgr.steps() == [1, 2, 3]
    finally:
        mgr.wait()


def test_the_first_save_and_pace_none_are_not_paced() -> None:
    # A clock that moves only when told: read from the real one, the interval grew by
    # however long this thread was held between two reads (a loaded machine), and the
    # deadline with it.
    w = persist.worker()
    w.pace_next(None)
    clock = _Clock()
    pace = UploadPace(0.5, clock=clock)
    pace.begin("step-2", in_worker=True)  # the first: no interval yet to pace by
    assert w._pace_until is None
    clock.now += 10.0
    pace.begin("step-2", in_worker=True)
    assert w._pace_until == clock.now + 5.0
    assert w._pace_for == "step-2"
    w.pace_next(None)
    clock.now += 10.0
    pace.begin("step-3", in_worker=False)
    assert w._pace_until is None  # threads write in this process: nothing to pace
    unpaced = UploadPace(None, clock=clock)
    unpaced.begin("step-2", in_worker=True)
    clock.now += 10.0
    unpaced.begin("step-2", in_worker=True)
    assert w._pace_until is None


def test_an_upload_after_one_the_link_limited_goes_at_full_speed() -> None:
    """Where an upload took the whole window at full speed, or overran the window it was
    paced to, the link or the cores are the limit: a pace spreads nothing there, and in
    a loop on a capped bucket paced uploads ended ~0.4 s later than full-speed ones,
    so the next save waited for them. Uploads short beside the interval stay paced."""
    w = persist.worker()
    w.pace_next(None)
    now = [1000.0]
    pace = UploadPace(0.8, clock=lambda: now[0])

    def save(interval: float, took: float) -> float | None:
        """A save ``interval`` after the previous began, its upload taking ``took``;
        the window it was paced to, or None."""
        w.pace_next(None)
        now[0] += interval
        began = pace.begin("s3://b/step", in_worker=True)
        deadline = w._pace_until
        now[0] += took
        pace.ended(began)
        now[0] -= took
        return None if deadline is None else deadline - began

    assert save(0.0, 3.4) is None  # the first: nothing to pace by
    assert save(3.4, 3.0) is None  # the first took 3.4 s at full speed: > 0.8 x 3.4
    assert save(3.3, 3.0) is None  # still the whole window at full speed
    assert save(20.0, 3.0) == pytest.approx(16.0)  # short beside the interval: paced
    assert save(20.0, 16.5) == pytest.approx(16.0)  # on its schedule: paced again
    assert save(20.0, 18.0) == pytest.approx(16.0)  # this one overran its 16 s by 12%
    assert save(20.0, 3.0) is None  # so this one goes at full speed
    assert save(20.0, 3.0) == pytest.approx(16.0)  # and 3 s of 16: paced again
    # An upload whose end was never told (a tiered manager's drain) leaves the pace as it was.
    now[0] += 20.0
    pace.begin("s3://b/step", in_worker=True)
    now[0] += 20.0
    w.pace_next(None)
    began = pace.begin("s3://b/step", in_worker=True)
    assert w._pace_until == pytest.approx(began + 16.0)
    # An older save's end does not count as the latest's.
    pace.ended(began - 20.0)
    assert pace._took is None
    w.pace_next(None)


def test_a_manager_with_threads_sets_no_pace(tmp_path: Any) -> None:
    mgr = storage.CheckpointManager(str(tmp_path / "th"), pace=0.5, persist="thread")
    w = persist.worker()
    w.pace_next(None)
    mgr.root_tier.pace._last = time.monotonic() - 10.0
    done = mgr.save(2, _state(1), blocking=False)
    assert done is not None
    done.result()
    assert w._pace_until is None


def _tiered_saved_long_ago(tmp_path: Any) -> storage.CheckpointManager:
    """A paced tiered manager whose step 1 began long ago: the drain of its next step
    may spread over MAX_PACED_SECONDS (8 MB over a minute: ~140 KB/s)."""
    mgr = storage.CheckpointManager(
        str(tmp_path / "root"), local=str(tmp_path / "local"), pace=1.0, persist="process"
    )
    mgr.save(1, _state(), blocking=True)
    mgr.wait()
    assert mgr.tiers is not None
    mgr.tiers.pace._last = time.monotonic() - 10 * MAX_PACED_SECONDS
    return mgr


def _wait_for_a_paced_call() -> None:
    waited = time.monotonic() + PROMPT
    while not persist.worker()._paced:
        assert time.monotonic() < waited, "the drain's copy did not take its pace"
        time.sleep(0.01)


def test_a_tiered_managers_drain_is_paced_and_wait_lifts_it(tmp_path: Any) -> None:
    """A tiered manager's upload is its drain: that is what gets the pace, not the
    save's write to the local tier (the save returns at local speed), and ``wait()``
    (which waits for the drain) lifts it."""
    mgr = _tiered_saved_long_ago(tmp_path)
    try:
        began = time.monotonic()
        mgr.save(2, _state(), blocking=True)
        assert time.monotonic() - began < MAX_PACED_SECONDS / 2  # the local write: unpaced
        assert 2 in mgr.steps()
        _wait_for_a_paced_call()  # the drain of step 2 took the pace set for it
        mgr.wait()
        assert time.monotonic() - began < MAX_PACED_SECONDS / 2
        assert mgr.durable_steps() == [1, 2]
    finally:
        mgr.wait()


def test_the_next_tiered_save_lifts_the_pace_of_a_drain_in_flight(tmp_path: Any) -> None:
    """Drains run one after another: a paced one still running when the next save
    comes would hold that step's drain back; the save lifts its pace."""
    mgr = _tiered_saved_long_ago(tmp_path)
    try:
        began = time.monotonic()
        mgr.save(2, _state(), blocking=True)
        _wait_for_a_paced_call()
        third = mgr.save(3, _state(), blocking=False)
        assert third is not None
        third.result()
        mgr.tiers.drains.wait()  # type: ignore[union-attr]  # no hurry from here
        assert time.monotonic() - began < MAX_PACED_SECONDS / 2
        assert mgr.durable_steps() == [1, 2, 3]
    finally:
        mgr.wait()


@pytest.mark.parametrize("pace", [0, 1.5, -0.1, True, "0.5"])
def test_a_pace_outside_the_interval_is_refused(tmp_path: Any, pace: object) -> None:
    with pytest.raises(ValueError, match="pace must be a share of the interval"):
        storage.CheckpointManager(str(tmp_path / "ck"), pace=pace)  # type: ignore[arg-type]


def test_a_job_that_exits_with_a_paced_save_in_flight_exits_promptly(tmp_path: Any) -> None:
    """The interpreter finishes a save in flight before it exits (DCP's executor thread
    is joined): a paced one went on to its deadline, up to a minute after the job's
    end; at exit the pace is lifted, and the save still commits. The save is paced over
    a day (the longest pace raised for it): the job's exit waits on no clock, and one
    that waited for the pace fails by the timeout, not by a start-up that a loaded
    machine made slow."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        f"""
        import time, torch, storage
        from storage.ops import pace
        pace.MAX_PACED_SECONDS = 86400.0
        mgr = storage.CheckpointManager({str(tmp_path / "ck")!r}, pace=1.0, persist="process")
        state = {{"w": torch.arange(8 << 18, dtype=torch.float32)}}
        mgr.save(1, state, blocking=False).result()
        mgr.root_tier.pace._last = time.monotonic() - 10 * pace.MAX_PACED_SECONDS
        mgr.save(2, state, blocking=False)
        print("saved", flush=True)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=10 * PROMPT
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "saved\n"
    mgr = storage.CheckpointManager(str(tmp_path / "ck"), persist="thread")
    assert mgr.steps() == [1, 2]


def test_a_hurry_before_the_paced_call_goes_out_cancels_its_pace() -> None:
    """A save that waits, or fails, before its writes reach the worker leaves no pace
    behind for a later save to inherit."""
    w = persist.worker()
    w.pace_next(time.monotonic() + 3600.0)
    persist.hurry()
    assert w._pace_until is None


def test_a_pace_is_taken_with_one_read_of_the_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, the clock was read twice: a second read at the deadline divided by zero,
    one past it gave a negative rate (a bucket that never lets a byte through)."""
    reads = iter([100.0, 101.0])  # the first read is 1 s before the deadline
    monkeypatch.setattr(_calls, "time", types.SimpleNamespace(monotonic=lambda: next(reads)))
    w = persist.Worker()
    w.pace_next(101.0)
    with w._lock:
        pace = w._take_pace(1 << 20)
    assert pace == (float(1 << 20), 101.0)
    assert w._pace_until is None


@pytest.mark.parametrize("deadline", [math.nan, math.inf, -math.inf, True, "1.0"])
def test_a_pace_deadline_that_is_no_time_is_refused(deadline: object) -> None:
    w = persist.Worker()
    with pytest.raises(ValueError, match="a pace deadline must be a finite"):
        w.pace_next(deadline)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="a pace deadline must be a finite"):
        persist.pace_next(deadline)  # type: ignore[arg-type]
    assert w._pace_until is None
    w.pace_next(12)  # a whole number of seconds is a time too
    w.pace_next(None)


def test_a_paced_save_that_fails_before_its_writes_leaves_no_pace(tmp_path: Any) -> None:
    """The save fails in the background, in planning (its step's directory cannot be
    made), so its writes never take the pace it set: before, that pace stayed pending
    and the next save of any writer in the process (storage.async_save's) was paced."""
    mgr = _saved_long_ago(tmp_path / "ck")
    try:
        (tmp_path / "ck" / "step-2").write_bytes(b"")  # a file where the step goes
        second = mgr.save(2, _state(), blocking=False)
        assert second is not None
        # Not second.exception(): waiting on the future lifts the pace itself.
        concurrent.futures.wait([second], timeout=PROMPT)
        assert second.done() and second.exception() is not None
        assert persist.worker()._pace_until is None
    finally:
        mgr.wait()


def test_a_paced_call_to_a_dead_worker_leaves_no_pace() -> None:
    """The call that was to take the pace fails (its worker died idle): before, the pace
    stayed pending for whatever call came next."""
    w = persist.Worker()
    w._unreported = WorkerDiedError("the checkpoint persist worker (pid 1) died")
    w.pace_next(time.monotonic() + 3600.0)
    with pytest.raises(WorkerDiedError):
        w.call(print, pace_bytes=1 << 20)
    assert w._pace_until is None


def test_a_pace_set_for_one_checkpoint_is_not_taken_by_a_save_elsewhere() -> None:
    """The manager sets its save's pace before that save's writes reach the worker; a
    save another thread makes in between (a healing transfer, ``storage.async_save``)
    took it before, and ran paced to a deadline that was not its own."""
    w = persist.Worker()
    w.pace_next(time.monotonic() + 3600.0, "s3://bucket/run/step-2")
    with w._lock:
        assert w._take_pace(1 << 20, "s3://bucket/replica-0/step-2") is None
        assert w._pace_until is not None  # still pending for its own save
        pace = w._take_pace(1 << 20, "s3://bucket/run/step-2")
    assert pace is not None and 0 < pace[0] < (1 << 20)
    assert w._pace_until is None


def test_a_call_without_a_cap_does_not_lift_the_cap_of_one_in_flight() -> None:
    """The worker's writes share one bucket; before, each call set its rate, so a call
    with no cap (an uncapped save, a healing transfer) lifted the cap of a capped save
    still writing, and a higher cap replaced a lower one."""
    bucket = Bucket()
    with bucket.capped(1000.0):
        with bucket.capped(None):
            assert bucket.rate == 1000.0
        with bucket.capped(5000.0):
            assert bucket.rate == 1000.0
        with bucket.capped(500.0):
            assert bucket.rate == 500.0
        assert bucket.rate == 1000.0
    assert bucket.rate is None  # no call in flight: no cap


def test_a_pace_holds_only_the_writes_of_the_call_it_was_set_for() -> None:
    """The worker's writes share one bucket: before, a pace held every write it made
    while it was set, so a save running beside a paced one (another manager's, a
    ``storage.async_save`` elsewhere) waited for that save's deadline (up to a minute)."""
    bucket = Bucket()
    bucket.set_pace(1.0, math.inf, owner=1)  # call 1: one byte a second
    paced = threading.Thread(target=bucket.take, args=(1_000_000, 1), daemon=True)
    paced.start()
    other = threading.Thread(target=bucket.take, args=(1_000_000, 2), daemon=True)
    other.start()
    other.join(PROMPT)
    assert not other.is_alive()  # call 2 is not paced
    assert paced.is_alive()  # call 1 still is
    bucket.hurry(owner=2)  # a call that ends lifts only its own pace
    paced.join(0.2)
    assert paced.is_alive()
    bucket.hurry()
    paced.join(PROMPT)
    assert not paced.is_alive()


def write_zeros(fs: Any, path: str, nbytes: int) -> int:
    """Write ``nbytes`` zeros to ``path`` through ``fs`` (run in the persist worker)."""
    with fs.create_stream(path, "wb") as stream:
        for start in range(0, nbytes, 1 << 16):
            stream.write(bytes(min(1 << 16, nbytes - start)))
    return nbytes


def test_a_call_beside_a_paced_one_in_the_worker_goes_at_full_speed(tmp_path: Any) -> None:
    w = persist.worker()
    fs = storage.LocalFileSystem()
    w.pace_next(time.monotonic() + 3600.0, "paced")  # 2 MB over an hour: ~600 B/s
    paced = w.call(
        write_zeros, fs, str(tmp_path / "paced"), 2 << 20, pace_bytes=2 << 20, pace_for="paced"
    )
    try:
        other = w.call(
            write_zeros, fs, str(tmp_path / "other"), 2 << 20, pace_bytes=2 << 20, pace_for="other"
        )
        assert other.result(timeout=PROMPT) == 2 << 20  # before: an hour behind the pace
        assert not paced.done()
    finally:
        persist.hurry()
    assert paced.result(timeout=PROMPT) == 2 << 20


def test_a_save_elsewhere_beside_a_paced_one_is_not_held_to_its_deadline(tmp_path: Any) -> None:
    """The paced save holds the worker's staging buffers until its writes are done:
    before, another save in the process (``storage.async_save`` elsewhere, another
    manager's) waited on the training thread for them until the pace's deadline."""
    mgr = _saved_long_ago(tmp_path / "ck")
    try:
        second = mgr.save(2, _state(), blocking=False)
        assert second is not None
        _wait_for_a_paced_call()
        began = time.monotonic()
        elsewhere = {"x": torch.randn(2 << 20)}
        storage.async_save(elsewhere, tmp_path / "elsewhere", persist="process").result()
        assert time.monotonic() - began < MAX_PACED_SECONDS / 2
        assert_tree_equal(elsewhere, loaded(tmp_path / "elsewhere", elsewhere))
    finally:
        mgr.wait()
