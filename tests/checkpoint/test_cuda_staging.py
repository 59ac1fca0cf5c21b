"""Staging from CUDA: the pieces that run without a GPU (registration bookkeeping with
an injected register, the order of waits with fake events, the ``async_staging``
contract's plumbing), and, marked ``gpu``, the real thing on a CUDA device."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

import storage
from storage.checkpoint import CheckpointWriter, persist
from storage.checkpoint.persist import _pool
from storage.checkpoint.persist._cuda import InFlight, Pins, SideCopies
from storage.checkpoint.persist._lease import Lease
from tests.support.trees import assert_tree_equal, zeros_like_tree

BIG = 4 * _pool.SMALL


class _Calls:
    """A register/unregister pair that records each call and whether the pool still
    held the segment (by address) when it was made."""

    def __init__(self) -> None:
        self.pool: _pool.StagingPool | None = None
        self.log: list[tuple[str, int, bool]] = []
        self.fail = False

    def register(self, address: int, nbytes: int) -> None:
        if self.fail:
            self.log.append(("refused", address, nbytes > 0))
            raise storage.CheckpointStorageError("cannot pin: cudaHostRegister error 2")
        self.log.append(("register", address, nbytes > 0))

    def unregister(self, address: int) -> None:
        assert self.pool is not None
        self.log.append(("unregister", address, address in self.pool._segments))


def _pinned_pool(calls: _Calls) -> _pool.StagingPool:
    calls.pool = _pool.StagingPool(pins=Pins(calls.register, calls.unregister))
    return calls.pool


def _segment_exists(pool: _pool.StagingPool, storage: torch.UntypedStorage) -> bool:
    return pool.locate(torch.empty(0, dtype=torch.uint8).set_(storage)) is not None


def test_a_pinned_segment_is_registered_once_and_unregistered_before_it_goes() -> None:
    """Guards the registration bookkeeping: each segment staging a CUDA storage is
    registered with the host allocator once, and unregistered before the pool lets it
    go (a segment dropped by the next stage, or at close)."""
    calls = _Calls()
    pool = _pinned_pool(calls)
    try:
        kept = pool.new_storage(BIG, pin=True)
        address = kept.data_ptr()
        pool.pins.pin(address, BIG)  # a later stage of the same storage: no second call
        assert calls.log == [("register", address, True)]
        assert pool.pins.pinned() == {address: BIG}
        pool.new_storage(100, pin=False)  # small, pageable: nothing to register
        unpinned = pool.new_storage(BIG, pin=False)
        assert address != unpinned.data_ptr()
        assert len(calls.log) == 1
        assert _segment_exists(pool, kept)
        pool.stage({})  # no cached source holds either segment: both are dropped
        assert calls.log[1:] == [("unregister", address, True)]
        assert not _segment_exists(pool, kept)
        assert pool.pins.pinned() == {}
        replaced = pool.new_storage(2 * BIG, pin=True)  # a segment replaced: registered anew
        assert calls.log[2] == ("register", replaced.data_ptr(), True)
    finally:
        pool.close()
    assert calls.log[3] == ("unregister", replaced.data_ptr(), True)
    assert pool.pins.pinned() == {}


def test_a_refused_registration_stages_in_pageable_memory_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Guards the fallback where CUDA refuses to page-lock a staging buffer (the
    locked-memory limit): the buffer is kept, pageable, and the save goes on with one
    warning; no later buffer asks CUDA again. Before, the refusal failed the save."""
    calls = _Calls()
    calls.fail = True
    pool = _pinned_pool(calls)
    try:
        with caplog.at_level("WARNING", logger="storage.checkpoint.persist._cuda"):
            first = pool.new_storage(BIG, pin=True)
            second = pool.new_storage(BIG, pin=True)
            small = pool.new_storage(100, pin=True)  # not pinned either: private, pageable
        assert calls.log == [("refused", first.data_ptr(), True)]
        assert _segment_exists(pool, first) and _segment_exists(pool, second)
        assert pool.live().keys() == {"0", "1"} and pool.pins.pinned() == {}
        assert not small.is_pinned() and small.nbytes() == 100
        assert caplog.text.count("pageable memory") == 1 and "error 2" in caplog.text
    finally:
        pool.close()
    assert [entry[0] for entry in calls.log] == ["refused"]  # nothing to unregister


@pytest.mark.skipif(torch.cuda.is_available(), reason="torch refuses pinned memory without CUDA")
def test_a_small_buffer_that_cannot_be_pinned_is_pageable(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The small buffers (private memory, from torch's pinned allocator): where torch
    cannot page-lock one (here: no CUDA), it is pageable, with the same one warning."""
    pool = _pool.StagingPool()
    try:
        with caplog.at_level("WARNING", logger="storage.checkpoint.persist._cuda"):
            small = pool.new_storage(100, pin=True)
            again = pool.new_storage(200, pin=True)
        assert not small.is_pinned() and (small.nbytes(), again.nbytes()) == (100, 200)
        assert caplog.text.count("pageable memory") == 1
        assert pool.pins.refused is not None
    finally:
        pool.close()


class _Event:
    """A fake CUDA event: complete once ``done`` is set; records who waited on it.
    ``moved`` is set when a wait on it begins (and by whatever else a test records)."""

    def __init__(self, log: list[str]) -> None:
        self.done = threading.Event()
        self.moved = threading.Event()
        self.log = log

    def query(self) -> bool:
        return self.done.is_set()

    def synchronize(self) -> None:
        self.moved.set()
        assert self.done.wait(60)
        self.log.append("copied")


def test_releasing_a_lease_waits_for_its_copies_first() -> None:
    """Guards the buffers' lifetime: the next save may take the buffers (and a dropped
    segment be unregistered) only after every copy into them completed; the source
    state dict is let go once they did."""
    log: list[str] = []
    event = _Event(log)

    class Source:
        pass

    source = Source()
    gone = weakref.ref(source)
    free = threading.Event()
    lease = Lease(free, InFlight([event], source))
    del source
    assert gone() is not None and not lease.copies.done()  # type: ignore[union-attr]
    releasing = threading.Thread(target=lease.release)
    releasing.start()
    assert not free.wait(0.2)  # not free while the copy runs
    event.done.set()
    releasing.join(60)
    assert free.is_set() and log == ["copied"]
    assert gone() is None


@pytest.mark.parametrize(
    ("module", "name", "options"),
    [
        (persist, "write_staged", {}),
        (persist, "write_staged", {"fingerprint": True}),
    ],
    ids=["writes", "fingerprints"],
)
def test_what_reads_the_staged_buffers_waits_for_the_copies(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    module: Any,
    name: str,
    options: dict[str, Any],
) -> None:
    """Guards the order on the read side: with the copies still in flight when the
    save's data phase begins, what reads the staged buffers waits for them: the writes,
    and an incremental save's fingerprints, which the writes take. Before, for the
    fingerprints: they were taken of buffers still being copied into, and an item could
    be recorded as unchanged from its base while its new values were on their way."""
    log: list[str] = []
    event = _Event(log)
    real = getattr(module, name)

    def recorded(*args: Any, **kwargs: Any) -> Any:
        log.append(name)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, recorded)
    writer = CheckpointWriter(tmp_path / "ck", persist="process", **options)
    state = {"w": torch.arange(BIG // 4, dtype=torch.float32)}
    staged = writer.stage(state)
    assert writer._lease is not None
    writer._lease.copies = InFlight([event], state)  # as if copied from a device
    saving = threading.Thread(target=dcp.save, args=(staged,), kwargs={"storage_writer": writer})
    saving.start()
    event.done.set()
    saving.join(120)
    assert log[:2] == ["copied", name]
    target = zeros_like_tree(state)
    storage.load(target, tmp_path / "ck")
    assert_tree_equal(target, state)


def _copies_in_flight_until(event: _Event, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every stage's copies look in flight from a device until ``event`` is done, and
    each segment unpinned is logged (as "unpinned", setting ``event.moved``)."""
    finish, unpin = SideCopies.finish, Pins.unpin

    def in_flight(self: SideCopies, source: Any) -> InFlight:
        finish(self, source)
        return InFlight([event], source)

    def unpinning(self: Pins, address: int) -> None:
        event.log.append("unpinned")
        event.moved.set()
        unpin(self, address)

    monkeypatch.setattr(SideCopies, "finish", in_flight)
    monkeypatch.setattr(Pins, "unpin", unpinning)


def _close_after_the_copies(close: Any, event: _Event) -> None:
    """``close()`` on a thread: it waits for the copy in flight before it unpins any
    segment, and finishes once the copy is done."""
    closer = threading.Thread(target=close)
    closer.start()
    try:
        assert event.moved.wait(60)  # it waits for the copy, or unpins: whichever is first
        assert event.log == []  # waiting: nothing unpinned while the copy runs
    finally:
        event.done.set()  # the copy completes (a failed test leaves no wait behind)
        closer.join(60)
    assert not closer.is_alive()
    assert event.log[0] == "copied" and set(event.log[1:]) == {"unpinned"}


def test_closing_the_worker_waits_for_copies_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    """Guards the buffers' registration at close: closing the worker (at exit, or a
    manager's close) right after a stage from a device waits for its copies before the
    pool unpins and drops the buffers they are filling."""
    event = _Event([])
    _copies_in_flight_until(event, monkeypatch)
    worker = persist.Worker()
    _, lease = worker.stage({"w": torch.arange(BIG // 4, dtype=torch.float32)})
    _close_after_the_copies(worker.close, event)
    lease.release()


def test_closing_the_pool_waits_for_copies_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    """Guards the buffers' registration when the staging pool itself is closed (every
    pool is, at interpreter exit) while a save still holds its buffers with copies from
    a device in flight: the pool waits for those copies before it unpins the buffers
    they are filling. Before, only the worker's close waited: a pool closed at exit
    unregistered memory a device copy was still writing into."""
    event = _Event([])
    _copies_in_flight_until(event, monkeypatch)
    pool = _pool.StagingPool()
    _, copies = pool.stage({"w": torch.arange(BIG // 4, dtype=torch.float32)})
    assert copies is not None
    lease = Lease(threading.Event(), copies)  # the save still holds the buffers
    _close_after_the_copies(pool.close, event)
    lease.release()


@pytest.mark.parametrize("persist", ["process", "thread"])
def test_async_staging_returns_torch_s_staging_future(tmp_path: Path, persist: str) -> None:
    """``async_staging=True`` makes ``stage`` return a future, so ``dcp.async_save``
    answers with torch's ``AsyncSaveResponse``, as with ``DefaultStager(StagingOptions())``;
    ``storage.async_save`` keeps its promise (it returns once the copy is done)."""
    state = {"w": torch.randn(BIG // 4), "step": 3}
    writer = CheckpointWriter(tmp_path / "a", persist=persist, async_staging=True)
    response = dcp.async_save(state, storage_writer=writer, no_dist=True)
    assert isinstance(response, AsyncSaveResponse)
    response.staging_completion.result(timeout=120)
    response.upload_completion.result(timeout=120)
    storage.async_save(state, tmp_path / "b", persist=persist, async_staging=True).result(120)
    for name in ("a", "b"):
        target = zeros_like_tree(state)
        storage.load(target, tmp_path / name)
        assert_tree_equal(target, state)
    with pytest.raises(TypeError, match="async_staging"):
        CheckpointWriter(tmp_path / "c", async_staging="yes")  # type: ignore[arg-type]


# --- on a CUDA device ---------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
#: GPU cycles the current stream is kept busy, so that the copies queued behind it
#: cannot have completed when the save returns (about a second on current GPUs).
_BUSY = 2_000_000_000


def _cuda_state() -> dict[str, Any]:
    g = torch.Generator(device="cuda").manual_seed(0)
    return {
        "w": torch.randn(1 << 20, device="cuda", generator=g).to(torch.bfloat16),
        "m": torch.randn(1 << 20, device="cuda", generator=g),
        "small": torch.randn(16, device="cuda", generator=g),
        "step": 7,
    }


def _cpu(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v.cpu().clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def _assert_saved(path: Path, expected: dict[str, Any]) -> None:
    target = zeros_like_tree(expected)
    storage.load(target, path)
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(target[key].view(torch.uint8), value.view(torch.uint8)), key
        else:
            assert target[key] == value


@pytest.mark.gpu
@cuda
def test_staging_a_cuda_state_dict_is_pinned() -> None:
    """The staging buffers of CUDA tensors are page-locked (registered with the CUDA
    host allocator), small ones too; the staged copy equals the source."""
    state = _cuda_state()
    pool = _pool.StagingPool()
    try:
        staged, copies = pool.stage(state)
        assert copies is not None
        copies.wait()
        for key in ("w", "m", "small"):
            assert staged[key].device.type == "cpu" and staged[key].is_pinned(), key
            assert torch.equal(staged[key], state[key].cpu()), key
        assert pool.pins.pinned()  # the two large ones, by their segments
        cpu_only, none = pool.stage({"c": torch.ones(BIG)})
        assert none is None and not cpu_only["c"].is_pinned()  # CPU: today's path
    finally:
        pool.close()
    assert pool.pins.pinned() == {}


@pytest.mark.gpu
@cuda
def test_an_async_staging_save_returns_before_the_copy_and_is_bit_exact(tmp_path: Path) -> None:
    """With the current stream busy, ``dcp.async_save`` returns while the copies queued
    behind it have not completed; the checkpoint still holds the tensors as they were
    when the save was asked for, bit for bit (the writes waited for the copies). A
    first save makes and pins the buffers (and starts the worker), so the one timed
    runs as every later save does, whatever those first steps cost or synchronize."""
    state = _cuda_state()
    writer = CheckpointWriter(tmp_path / "first", persist="process", async_staging=True)
    dcp.async_save(state, storage_writer=writer, no_dist=True).upload_completion.result(300)
    expected = _cpu(state)
    torch.cuda.synchronize()
    torch.cuda._sleep(_BUSY)
    response = dcp.async_save(
        state, storage_writer=writer, checkpoint_id=tmp_path / "ck", no_dist=True
    )
    assert isinstance(response, AsyncSaveResponse)
    assert not response.staging_completion.done()
    response.staging_completion.result(timeout=300)
    response.upload_completion.result(timeout=300)
    _assert_saved(tmp_path / "ck", expected)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("async_staging", [True, False])
def test_changing_the_tensors_once_staged_does_not_corrupt_the_save(
    tmp_path: Path, async_staging: bool
) -> None:
    """Training may change its tensors once ``staging_completion`` resolved (or, without
    ``async_staging``, once ``dcp.async_save`` returned): the checkpoint keeps the values
    of the save, repeatedly (the pinned buffers are reused)."""
    state = _cuda_state()
    writer = CheckpointWriter(tmp_path / "ck", async_staging=async_staging)
    for step in range(3):
        expected = _cpu(state)
        result = dcp.async_save(state, storage_writer=writer, checkpoint_id=tmp_path / f"s{step}")
        if isinstance(result, AsyncSaveResponse):
            result.staging_completion.result(timeout=300)
            upload = result.upload_completion
        else:
            upload = result
        for key in ("w", "m", "small"):
            state[key].add_(1)
        upload.result(timeout=300)
        _assert_saved(tmp_path / f"s{step}", expected)
    writer.close()


@pytest.mark.gpu
@cuda
def test_the_defaults_thread_staging_from_cuda_is_pinned_and_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the training processes fill the cores the default persists in threads and
    stages into pinned buffers kept between saves: each save holds the values it was
    asked for while training changes the tensors after it returned."""
    from storage.checkpoint import staging

    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(persist.usable_cpus()))
    state = _cuda_state()
    pointers = []
    for step in range(2):
        expected = _cpu(state)
        writer = CheckpointWriter(tmp_path / f"s{step}")
        staged = writer.stage(state)
        assert isinstance(staged, dict) and staged["w"].is_pinned()
        pointers.append(staged["w"].data_ptr())
        dcp.save(staged, storage_writer=writer, no_dist=True)
        for key in ("w", "m", "small"):
            state[key].add_(1)
        _assert_saved(tmp_path / f"s{step}", expected)
    assert pointers[0] == pointers[1]  # the same kept buffers
    local = staging.local_staging()
    assert local is not None and local._free.is_set()


@pytest.mark.gpu
@cuda
def test_a_failed_registration_leaves_no_cuda_error_for_the_next_kernel() -> None:
    """A registration CUDA refuses (here: memory registered already) fails the save
    only: torch checks each kernel launch with ``cudaGetLastError``, so an error left
    pending would fail the training thread's next, unrelated kernel."""
    from storage.checkpoint.persist._cuda import cuda_register, cuda_unregister
    from storage.checkpoint.persist._shm import Segment

    segment = Segment("twice", BIG)
    cuda_register(segment.address, BIG)
    try:
        with pytest.raises(storage.CheckpointStorageError, match="cudaHostRegister"):
            cuda_register(segment.address, BIG)
        x = torch.ones(4, device="cuda")
        x.add_(1)  # a kernel launch, checked
        torch.cuda.synchronize()
        assert x.sum().item() == 8
    finally:
        cuda_unregister(segment.address)
        segment.close()
    cuda_unregister(segment.address)  # not registered: reported quietly, no pending error
    torch.ones(4, device="cuda").mul_(2)
    torch.cuda.synchronize()


@pytest.mark.gpu
@cuda
def test_staging_from_cuda_where_pinning_is_refused_is_pageable_and_exact(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """CUDA refusing to register the staging buffers (here: a null address, as a
    locked-memory limit would) makes the stage pageable, with a warning, not a failed
    save; the copy is exact and no CUDA error is left for the next kernel."""
    from storage.checkpoint.persist._cuda import cuda_register, cuda_unregister

    state = _cuda_state()
    refusing = Pins(lambda address, nbytes: cuda_register(0, nbytes), cuda_unregister)
    pool = _pool.StagingPool(pins=refusing)
    try:
        with caplog.at_level("WARNING", logger="storage.checkpoint.persist._cuda"):
            staged, copies = pool.stage(state)
        assert copies is not None
        copies.wait()
        assert "pageable memory" in caplog.text and refusing.pinned() == {}
        for key in ("w", "m"):
            assert not staged[key].is_pinned() and torch.equal(staged[key], state[key].cpu())
        assert torch.ones(4, device="cuda").mul_(2).sum().item() == 8  # a kernel, checked
    finally:
        pool.close()


@pytest.mark.gpu
@cuda
def test_thread_staging_where_pinning_is_refused_leaves_no_cuda_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The default's thread staging pins through torch, whose refused registration
    leaves CUDA's error pending on the training thread: the fallback to pageable
    buffers consumes it, or the next, unrelated kernel launch would fail with it. So
    does ``cache_staged_state_dict``'s staging, whose refusal fails the save (as
    torch's does) and nothing after it."""
    import torch.cuda._pin_memory_utils as pin_memory_utils

    from storage.checkpoint import staging

    real = pin_memory_utils.pin_memory
    monkeypatch.setattr(pin_memory_utils, "pin_memory", lambda address, size: real(0, size))
    state = _cuda_state()
    local = staging.LocalStaging()
    with caplog.at_level("WARNING", logger="storage.checkpoint.staging"):
        staged, lease = local.stage(state)
    assert lease is not None and "staging unpinned" in caplog.text
    assert torch.ones(4, device="cuda").mul_(2).sum().item() == 8  # a kernel, checked
    assert torch.equal(staged["m"], state["m"].cpu()) and not staged["m"].is_pinned()
    lease.release()
    again, lease = local.stage(state)  # unpinned from now on, the buffers kept
    assert lease is not None and again["m"].data_ptr() == staged["m"].data_ptr()
    lease.release()
    cached = CheckpointWriter(tmp_path / "c", persist="thread", cache_staged_state_dict=True)
    with pytest.raises(RuntimeError, match="Registering memory failed"):
        cached.stage(state)
    assert torch.ones(4, device="cuda").mul_(2).sum().item() == 8


_ON_SECOND_DEVICE = """
import torch
from storage.checkpoint.persist import _pool
state = {"w": torch.randn(1 << 20, device="cuda:1"), "s": torch.randn(8, device="cuda:1")}
pool = _pool.StagingPool()
staged, copies = pool.stage(state)
copies.wait()
assert torch.equal(staged["w"], state["w"].cpu())
pool.stage({})
pool.close()
from storage.checkpoint.staging import LocalStaging
kept, lease = LocalStaging().stage(state)  # the default's thread staging, pinned by torch
assert kept["w"].is_pinned() and torch.equal(kept["w"], state["w"].cpu())
lease.release()
assert torch.cuda.current_device() == 0
assert not torch._C._cuda_hasPrimaryContext(0), "a CUDA context was made on cuda:0"
"""


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_staging_from_one_device_makes_no_context_on_another() -> None:
    """A process whose tensors live on cuda:1 (its current device left at 0, never
    used) stages, pins, copies and unpins without making a CUDA context on cuda:0:
    each costs hundreds of MB of that device's memory, once per process on the host.
    Into the worker's buffers, and into the default's thread staging buffers."""
    done = subprocess.run(
        [sys.executable, "-c", _ON_SECOND_DEVICE],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},
    )
    assert done.returncode == 0, done.stderr
