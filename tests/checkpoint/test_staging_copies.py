"""The persist worker's staging pool copying a state dict from CPU: spread over threads
where torch runs on one, space reserved before a byte is copied, and a ``/dev/shm``
that is full answered with an error naming the fix, never a ``SIGBUS``."""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from extensions.errors import CheckpointStorageError
from storage.checkpoint import persist
from storage.checkpoint.persist import _shm


def _state(seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {
        # Larger than a piece, and not a whole number of pieces or pages.
        "big": torch.randn(_shm.PIECE // 4 + 1000, generator=gen),
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


def _copier_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("dcp-staging-copy")]


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
    pool = _shm.StagingPool(copy_threads=3)
    try:
        state = _state(0)
        staged, _ = pool.stage(state)
        _assert_staged(staged, state)
        assert _copier_threads()
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
    assert not _copier_threads()


def test_with_several_torch_threads_copies_run_inline() -> None:
    """torch's own copy already spreads over its threads: the pool adds none of its
    own (threads of its own, each starting torch's, would oversubscribe the cores)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    pool = _shm.StagingPool(copy_threads=4)
    try:
        state = _state(1)
        staged, _ = pool.stage(state)
        _assert_staged(staged, state)
        assert not _copier_threads()
    finally:
        pool.close()
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_full_shared_memory_fails_the_stage_by_name_and_the_next_stage_reserves_again(
    monkeypatch: pytest.MonkeyPatch, one_torch_thread: None, threads: int
) -> None:
    """Space is reserved before anything is copied into it: when ``/dev/shm`` has no
    room (here the kernel's ENOSPC from ``posix_fallocate``), the stage raises naming
    the fix, and a stage once there is room reserves what was not and copies exactly."""
    real = os.posix_fallocate
    full = {"on": True}

    def fallocate(fd: int, offset: int, length: int) -> None:
        if full["on"]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, offset, length)

    monkeypatch.setattr(_shm.os, "posix_fallocate", fallocate)
    pool = _shm.StagingPool(copy_threads=threads)
    try:
        state = _state(2)
        with pytest.raises(CheckpointStorageError, match=r"--shm-size.*persist='thread'"):
            pool.stage(state)
        full["on"] = False
        staged, _ = pool.stage(state)
        _assert_staged(staged, state)
        unreserved = [s.name for s in pool._segments.values() if not s.reserved]
        assert unreserved == []
    finally:
        pool.close()


def test_copy_threads_are_this_processs_share_of_the_cores(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(persist, "usable_cpus", lambda: 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert persist.copy_threads() == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert persist.copy_threads() == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert persist.copy_threads() == 1
    monkeypatch.setattr(persist, "usable_cpus", lambda: 96)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert persist.copy_threads() == persist.MAX_COPY_THREADS
