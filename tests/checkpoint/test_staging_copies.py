"""The persist worker's staging pool copying a state dict from CPU: spread over threads
where torch runs on one, memory reserved before a byte is copied, and no room for it
answered with an error naming the fix, never a ``SIGBUS``."""

from __future__ import annotations

import errno
import mmap
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from extensions.errors import CheckpointStorageError
from storage.checkpoint import persist
from storage.checkpoint.persist import _copies, _cores, _pool, _shm


def _state(seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {
        # Larger than a piece, and not a whole number of pieces or pages.
        "big": torch.randn(_copies.PIECE // 4 + 1000, generator=gen),
        "bf16": torch.randn(300, 301, generator=gen).to(torch.bfloat16),
        "small": torch.randn(8, generator=gen),  # in private memory
        "view": torch.randn(64, 1024, generator=gen)[::2],  # a strided view of a storage
        "step": seed,
    }


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _threads_of(pool: _pool.StagingPool) -> bool:
    """Whether the pool started copy threads of its own."""
    return pool._copies._executor is not None


def _assert_staged(staged: dict[str, Any], state: dict[str, Any]) -> None:
    assert staged.keys() == state.keys()
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            assert staged[key].dtype == value.dtype and torch.equal(staged[key], value), key
        else:
            assert staged[key] == value


def test_copies_spread_over_threads_are_exact_and_refreshed(one_torch_thread: None) -> None:
    """Where torch runs on one thread, the pool's threads copy in pieces: every byte
    lands where it belongs, on the first stage (new segments) and on the next ones
    (the same buffers, new values)."""
    pool = _pool.StagingPool(copy_threads=3)
    try:
        state = _state(0)
        staged, _ = pool.stage(state)
        _assert_staged(staged, state)
        assert _threads_of(pool)
        segments = pool.live()
        for step in (1, 2):
            state["big"].add_(step)
            state["bf16"].mul_(-1)
            state["view"].sub_(step)
            staged, _ = pool.stage(state)
            _assert_staged(staged, state)
            assert pool.live() == segments  # copied into the buffers of the first stage
    finally:
        pool.close()
    assert not _threads_of(pool)


def test_with_several_torch_threads_copies_run_inline() -> None:
    """torch's own copy already spreads over its threads: the pool adds none of its
    own (threads of its own, each starting torch's, would oversubscribe the cores)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    pool = _pool.StagingPool(copy_threads=4)
    try:
        state = _state(1)
        staged, _ = pool.stage(state)
        _assert_staged(staged, state)
        assert not _threads_of(pool)
    finally:
        pool.close()
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_full_shared_memory_fails_the_stage_by_name_and_the_next_stage_reserves_again(
    monkeypatch: pytest.MonkeyPatch, one_torch_thread: None, threads: int
) -> None:
    """Memory is reserved before anything is copied into it: when there is no room
    (here the kernel's ENOMEM from ``MADV_POPULATE_WRITE``), the stage raises naming
    the fix, and a stage once there is room reserves what was not and copies exactly."""
    real = _shm._populate
    full = {"on": True}

    def populate(mapping: mmap.mmap, address: int, offset: int, length: int) -> None:
        if full["on"]:
            raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))
        real(mapping, address, offset, length)

    monkeypatch.setattr(_shm, "_populate", populate)
    pool = _pool.StagingPool(copy_threads=threads)
    try:
        state = _state(2)
        with pytest.raises(CheckpointStorageError, match=r"more memory.*persist='thread'"):
            pool.stage(state)
        full["on"] = False
        staged, _ = pool.stage(state)
        _assert_staged(staged, state)
        unreserved = [s.name for s in pool._segments.values() if not s.reserved]
        assert unreserved == []
    finally:
        pool.close()


def test_a_piece_whose_space_cannot_be_reserved_is_never_written(
    monkeypatch: pytest.MonkeyPatch, one_torch_thread: None
) -> None:
    """Each piece of a new segment is reserved before its bytes are copied: a write
    into a page that was never reserved, where there is no room for it, kills the
    process (``SIGBUS`` under strict overcommit). Here only the second piece of the
    large tensor finds no room."""
    real = _shm._populate

    def populate(mapping: mmap.mmap, address: int, offset: int, length: int) -> None:
        if offset == _copies.PIECE:
            raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))
        real(mapping, address, offset, length)

    monkeypatch.setattr(_shm, "_populate", populate)
    pool = _pool.StagingPool(copy_threads=2)
    try:
        state = _state(3)
        with pytest.raises(CheckpointStorageError, match="cannot reserve"):
            pool.stage(state)
        big = max(pool._segments.values(), key=lambda segment: len(segment.map))
        assert not big.reserved
        second = big.map[_copies.PIECE : 2 * _copies.PIECE]
        assert second == bytes(len(second))  # never copied into
        first = torch.frombuffer(big.map, dtype=torch.float32, count=_copies.PIECE // 4)
        assert torch.equal(first, state["big"][: _copies.PIECE // 4])  # its room was there
    finally:
        pool.close()


def test_a_stage_under_inference_mode_copies_on_the_pools_threads(
    one_torch_thread: None,
) -> None:
    """Views the training thread made under ``inference_mode`` may not be written by
    another thread outside it: the pool's threads make their own."""
    pool = _pool.StagingPool(copy_threads=2)
    try:
        state = _state(4)
        with torch.inference_mode():
            staged, _ = pool.stage(state)
        _assert_staged(staged, state)
    finally:
        pool.close()


def test_copy_threads_are_this_processs_share_of_the_cores(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_cores, "usable_cpus", lambda: 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert persist.copy_threads() == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert persist.copy_threads() == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert persist.copy_threads() == 1
    monkeypatch.setattr(_cores, "usable_cpus", lambda: 96)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert persist.copy_threads() == _cores.MAX_COPY_THREADS
    # Bound by the launcher to 2 of the host's cores: those 2 are this rank's share.
    monkeypatch.setattr(_cores, "usable_cpus", lambda: 2)
    monkeypatch.setattr(_cores.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(_cores.os, "cpu_count", lambda: 96)
    assert persist.copy_threads() == 2


@pytest.mark.parametrize("error", [errno.ETOOMANYREFS, errno.EPIPE])
def test_segments_that_cannot_reach_the_worker(error: int) -> None:
    """A stage hands its new segments' descriptors to the worker. Too many in flight for
    the open-file limit (ETOOMANYREFS) fails the stage naming the fix (the default then
    persists in threads); a worker that is gone (EPIPE) is not this stage's error: its
    handle reports the death, and makes a new pool for the next worker."""
    sent: list[list[str]] = []

    def share(names: list[str], fds: list[int], dropped: list[str]) -> None:
        sent.append(names)
        raise OSError(error, os.strerror(error))

    pool = _pool.StagingPool(share=share)
    try:
        state = _state(4)
        if error == errno.ETOOMANYREFS:
            with pytest.raises(CheckpointStorageError, match=r"ulimit -n.*persist='thread'"):
                pool.stage(state)
            assert len(pool._unsent) == len(pool.live()) > 0  # kept, for the next try
        else:
            staged, _ = pool.stage(state)
            _assert_staged(staged, state)
            assert pool._unsent == []
        assert sent and all(sent)
    finally:
        pool.close()
    assert pool._unsent == []


def test_where_the_kernel_cannot_populate_a_segment_is_reserved_whole_when_made(
    monkeypatch: pytest.MonkeyPatch, one_torch_thread: None
) -> None:
    """Before Linux 5.14 there is no ``MADV_POPULATE_WRITE``: a segment's memory is
    reserved whole with ``posix_fallocate`` when it is made (its descriptor is gone
    once sent to the worker), and a stage or a prepare copies exactly."""
    monkeypatch.setattr(_shm, "_populates", lambda: False)

    def never(mapping: mmap.mmap, address: int, offset: int, length: int) -> None:
        raise AssertionError("populated")

    monkeypatch.setattr(_shm, "_populate", never)
    pool = _pool.StagingPool(copy_threads=2)
    try:
        state = _state(5)
        pool.reserve(state)
        assert all(s.reserved for s in pool._segments.values())
        staged, _ = pool.stage(state)
        _assert_staged(staged, state)
    finally:
        pool.close()


def _resident(address: int) -> int:
    """Bytes of the mapping at ``address`` in this process's memory (``Rss`` in
    ``/proc/self/smaps``)."""
    with open("/proc/self/smaps") as smaps:
        inside = False
        for line in smaps:
            head = line.split(maxsplit=1)[0]
            if "-" in head and ":" not in head:
                start, end = (int(part, 16) for part in head.split("-"))
                inside = start <= address < end
            elif inside and head == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError("no mapping at that address")


@pytest.mark.skipif(not _shm._populates(), reason="no MADV_POPULATE_WRITE")
def test_reserving_a_range_maps_exactly_its_pages_and_refuses_one_outside() -> None:
    """The reservation calls libc's madvise itself (Python's holds the GIL while the
    host hands out pages, stopping the training thread): it must act on the segment's
    own pages, those of the range asked for and no others, and a range past the
    segment's end is refused before any call (it would reach another mapping)."""
    page = mmap.PAGESIZE
    segment = _shm.Segment("probe", 64 * page)
    try:
        assert _resident(segment.address) == 0
        segment.reserve(8 * page, 16 * page)
        assert _resident(segment.address) == 16 * page
        with pytest.raises(ValueError, match="range"):
            segment.reserve(60 * page, 8 * page)
        with pytest.raises(ValueError, match="range"):
            segment.reserve(page // 2, page)
        segment.reserve()
        assert _resident(segment.address) == 64 * page
    finally:
        segment.close()
