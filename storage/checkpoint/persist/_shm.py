"""Staging buffers in named shared memory, reused from one save to the next.

The training process copies its state into these buffers (the only work an
asynchronous save does on the training thread) and the persist worker maps the same
pages by name, so the bytes cross processes without another copy.

Segments are files in ``/dev/shm`` (the temporary directory where there is none) named
``dcp-storage-{uid}-{pid}-{n}``: ``pid`` is the training process that made them. Their
space is reserved when they are made (``posix_fallocate``), so a full ``/dev/shm`` is an
error at allocation, never a ``SIGBUS`` while copying. They are removed when the pool is
closed and at exit; a process killed before that leaves them behind, and the next
process of the same user that makes a pool removes every segment whose ``pid`` is gone.
"""

from __future__ import annotations

import atexit
import bisect
import itertools
import mmap
import os
import tempfile
import threading
import weakref
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from extensions._compat import StateDictStager
from extensions.errors import CheckpointStorageError

#: Storages smaller than this are staged in private memory and sent by value.
SMALL = 64 << 10


def shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _prefix() -> str:
    return f"dcp-storage-{os.getuid()}-"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep() -> list[str]:
    """Remove the segments of this user's processes that are gone; returns their names."""
    removed = []
    prefix = _prefix()
    for name in os.listdir(shm_dir()):
        if not name.startswith(prefix):
            continue
        pid = name[len(prefix) :].partition("-")[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
            try:
                os.unlink(os.path.join(shm_dir(), name))
            except FileNotFoundError:
                continue
            removed.append(name)
    return removed


def map_segment(name: str) -> mmap.mmap:
    """Map the segment ``name`` read-write (the persist worker's side)."""
    fd = os.open(os.path.join(shm_dir(), name), os.O_RDWR)
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


class _Segment:
    """One named segment holding one staged storage."""

    def __init__(self, name: str, size: int) -> None:
        path = os.path.join(shm_dir(), name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)
            self.map = mmap.mmap(fd, size)
        except OSError as exc:
            os.close(fd)
            os.unlink(path)
            raise CheckpointStorageError(
                f"cannot reserve {size} bytes of shared memory in {shm_dir()} for staging "
                f"a checkpoint ({exc}); give it more room (docker: --shm-size) or save with "
                "persist='thread'"
            ) from exc
        os.close(fd)
        self.name = name
        self.path = path
        self.storage = torch.frombuffer(self.map, dtype=torch.uint8).untyped_storage()
        self.address = self.storage.data_ptr()

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class StagingPool:
    """The shared-memory staging buffers of this process, one segment per large storage.

    :meth:`stage` copies a state dict into buffers cached by source storage (the next
    stage of the same tensors copies into the same buffers); :meth:`locate` tells where
    a staged tensor's bytes are. Not thread-safe: the persist client serializes stages.
    """

    def __init__(self) -> None:
        sweep()
        self._names = itertools.count()
        self._segments: dict[int, _Segment] = {}  # by address
        self._addresses: list[int] = []  # sorted
        self._stager = _Stager(self)
        self._lock = threading.Lock()
        _POOLS.add(self)

    def stage(self, state_dict: Any) -> Any:
        """A copy of ``state_dict`` whose large tensors live in shared memory."""
        with self._lock:
            self._collect()
            return self._stager.stage(state_dict)

    def live(self) -> list[str]:
        """The names of the segments in use (what the worker keeps mapped)."""
        with self._lock:
            return [s.name for s in self._segments.values()]

    def locate(self, tensor: torch.Tensor) -> tuple[str, int] | None:
        """``(segment, byte offset)`` of a contiguous staged tensor's bytes, or ``None``
        when they are not in a segment."""
        nbytes = tensor.numel() * tensor.element_size()
        if tensor.device.type != "cpu" or not tensor.is_contiguous() or nbytes == 0:
            return None
        start = tensor.data_ptr()
        with self._lock:
            i = bisect.bisect_right(self._addresses, start) - 1
            if i < 0:
                return None
            segment = self._segments[self._addresses[i]]
        offset = start - segment.address
        return (segment.name, offset) if offset + nbytes <= len(segment.map) else None

    def new_storage(self, nbytes: int) -> torch.UntypedStorage:
        if nbytes < SMALL:
            return torch.UntypedStorage(nbytes)
        segment = _Segment(f"{_prefix()}{os.getpid()}-{next(self._names)}", nbytes)
        self._segments[segment.address] = segment
        bisect.insort(self._addresses, segment.address)
        return segment.storage

    def _collect(self) -> None:
        # Segments whose source storage is gone (the cache dropped them) are removed
        # before the next stage; no save reads them then (the client waits for that).
        live = {s.data_ptr() for s in self._stager.cached()}
        for address in [a for a in self._addresses if a not in live]:
            self._segments.pop(address).unlink()
            self._addresses.remove(address)

    def close(self) -> None:
        """Remove every segment (mappings stay valid until their tensors are gone)."""
        with self._lock:
            for segment in self._segments.values():
                segment.unlink()
            self._segments.clear()
            self._addresses.clear()
            self._stager.reset()
        _POOLS.discard(self)


class _Stager(StateDictStager or object):  # type: ignore[misc]
    """torch's deep-copying stager (it keeps the structure of DTensors and other
    objects), allocating each copied storage from the pool and reusing it next time."""

    def __init__(self, pool: StagingPool) -> None:
        super().__init__(pin_memory=False, share_memory=False)
        self._pool = pool
        self._cache: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def cached(self) -> list[torch.UntypedStorage]:
        return list(self._cache.values())

    def reset(self) -> None:
        self._cache = WeakIdKeyDictionary()

    def _stage_untyped_storage(
        self, storage: torch.UntypedStorage, non_blocking: bool = False
    ) -> torch.UntypedStorage:
        staged = self._cache.get(storage)
        if staged is None or staged.nbytes() != storage.nbytes():
            staged = self._pool.new_storage(storage.nbytes())
            self._cache[storage] = staged
        staged.copy_(storage, non_blocking=non_blocking)
        return staged


_POOLS: weakref.WeakSet[StagingPool] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for pool in list(_POOLS):
        pool.close()
