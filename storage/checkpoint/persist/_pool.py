"""Staging buffers in named shared memory, reused from one save to the next.

The training process copies its state into these buffers (the only work an
asynchronous save does on the training thread) and the persist worker maps the same
pages by name, so the bytes cross processes without another copy. The buffers are
segments, files in ``/dev/shm`` with their names, locks and sweeping in :mod:`._shm`.

A stage's copies from CPU, reservations of new segments included, run on the pool's
``copy_threads`` where torch runs on one thread (:mod:`._copies`).

Files removed from under a live pool (systemd-logind's ``RemoveIPC`` at logout, a
cleaner of old files) are made again at the next stage: a segment (the worker maps it
by name) and the lock file (without it, another pool's sweep would take the pool for a
dead one).
"""

from __future__ import annotations

import atexit
import bisect
import logging
import os
import threading
import weakref
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from storage.checkpoint.persist._copies import Copies
from storage.checkpoint.persist._cuda import InFlight, Pins, SideCopies
from storage.checkpoint.persist._shm import _Owner, _Segment, shm_dir, sweep
from storage.checkpoint.stager import ValueStager

log = logging.getLogger(__name__)

#: Storages smaller than this are staged in private memory and sent by value.
SMALL = 64 << 10


class StagingPool:
    """The shared-memory staging buffers of this process, one segment per large storage.

    :meth:`stage` copies a state dict into buffers cached by source storage (the next
    stage of the same tensors copies into the same buffers); :meth:`locate` tells where
    a staged tensor's bytes are. Not thread-safe: the persist client serializes stages.
    A buffer staging a CUDA storage is pinned (``pins``, :mod:`._cuda`) and copied into
    without blocking, on a side stream; copies from CPU run on ``copy_threads`` threads
    (:class:`._copies.Copies`).
    """

    def __init__(self, pins: Pins | None = None, copy_threads: int = 1) -> None:
        sweep()
        self.pins = pins if pins is not None else Pins()
        self.side = SideCopies()
        self._copies = Copies(copy_threads)
        self._owner = _Owner()
        self._segments: dict[int, _Segment] = {}  # by address
        self._addresses: list[int] = []  # sorted
        self._stager = _Stager(self)
        self._lock = threading.Lock()
        _POOLS.add(self)

    def stage(self, state_dict: Any) -> tuple[Any, InFlight | None]:
        """A copy of ``state_dict`` whose large tensors live in shared memory, and its
        copies from CUDA devices, still in flight (``None`` when there were none: the
        copy is complete). Its buffers must not be read before :meth:`InFlight.wait`."""
        with self._lock:
            self._collect()
            self.side.start()
            failed = True
            try:
                staged = self._stager.stage(state_dict)
                self._copies.finish()
                failed = False
            finally:
                if failed:  # no copy may outlive a failed stage: the next one reuses
                    self._copies.finish(raising=False)  # the buffers (and its error
                copies = self.side.finish(state_dict)  # is the one raised)
                if failed and copies is not None:
                    copies.wait()
            return staged, copies

    def reserve(self, state_dict: Any) -> None:
        """Make the buffers a later :meth:`stage` of ``state_dict``'s tensors copies
        into, their pages touched, copying nothing; buffers that exist are kept. Safe
        while a save holds the buffers: nothing it reads changes."""
        with self._lock:
            self._stager.copying = False
            try:
                self._stager.stage(state_dict)
            finally:
                self._stager.copying = True

    def live(self) -> dict[str, tuple[int, int]]:
        """The segments in use (what the worker keeps mapped), by name: each one's inode
        and size, which the worker checks the file it maps against."""
        with self._lock:
            return {s.name: s.shared for s in self._segments.values()}

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

    def new_storage(
        self, nbytes: int, *, touch: bool = False, pin: bool = False
    ) -> torch.UntypedStorage:
        """A staging buffer of ``nbytes``; ``pin``: page-locked for CUDA copies."""
        if nbytes < SMALL:
            if pin:
                return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).untyped_storage()
            return torch.UntypedStorage(nbytes)
        segment = _Segment(self._owner, nbytes)
        self._segments[segment.address] = segment
        bisect.insort(self._addresses, segment.address)
        if touch or pin:  # pages that are mapped (or locked) now: reserved first
            try:
                segment.reserve()
            except BaseException:
                self._drop(segment.address)
                raise
            segment.reserved = True
        if touch:
            segment.touch()
        if pin:
            try:
                self.pins.pin(segment.address, nbytes)
            except BaseException:
                self._drop(segment.address)
                raise
        return segment.storage

    def copy_into(self, staged: torch.UntypedStorage, source: torch.UntypedStorage) -> None:
        """Copy ``source`` into its staging buffer ``staged`` (done when the stage is)."""
        segment = self._segments.get(staged.data_ptr())
        if segment is None:  # a small storage, in private memory
            staged.copy_(source)
        else:
            self._copies.add(segment, source)

    def _drop(self, address: int) -> None:
        """Forget a segment: unregistered from CUDA first, then unlinked."""
        self.pins.unpin(address)
        self._segments.pop(address).unlink()
        self._addresses.remove(address)

    def _collect(self) -> None:
        # Segments whose source storage is gone (the cache dropped them) are removed
        # before the next stage; no save reads them then (the client waits for that).
        live = {s.data_ptr() for s in self._stager.cached()}
        for address in [a for a in self._addresses if a not in live]:
            self._drop(address)
        # Segments whose file something else removed (systemd-logind's RemoveIPC, a
        # cleaner of /dev/shm), replaced or truncated: the worker maps segments by name,
        # so it could never read them again, and a copy into a truncated one kills this
        # process with SIGBUS; forgotten here, they are made afresh by this stage.
        # Judged by inode, not by name: anyone may list the directory and take the name
        # of a removed segment (the worker would map that file in its place).
        try:
            with os.scandir(shm_dir()) as entries:
                present = {e.name: e for e in entries}
        except OSError:
            return
        if f"{self.name}.lock" not in present:
            self._owner.relock()
        gone = {
            a
            for a in self._addresses
            if not self._segments[a].is_at(_found(present.get(self._segments[a].name)))
        }
        if gone:
            log.warning(
                "%d staging buffers of %s were removed or truncated in %s by something else; "
                "making them again",
                len(gone),
                self.name,
                shm_dir(),
            )
            self._stager.forget(gone)
            for address in gone:
                self._drop(address)

    @property
    def name(self) -> str:
        """The pool's name: every segment's name starts with it."""
        return self._owner.name

    def close(self) -> None:
        """Remove every segment (mappings stay valid until their tensors are gone); in a
        child made with ``fork``, only forget them: they are its parent's."""
        with self._lock:
            self._copies.close()
            if os.getpid() == self._owner.pid:
                for address, segment in self._segments.items():
                    self.pins.unpin(address)
                    segment.unlink()
            self._owner.close()
            self._segments.clear()
            self._addresses.clear()
            self._stager.reset()
        _POOLS.discard(self)


class _Stager(ValueStager or object):  # type: ignore[misc]
    """The deep-copying stager (:mod:`storage.checkpoint.stager`), allocating each
    copied storage from the pool and reusing it next time."""

    def __init__(self, pool: StagingPool) -> None:
        super().__init__(pin_memory=False, share_memory=False)
        self._pool = pool
        self._cache: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.copying = True  # False: make and touch the buffers only (StagingPool.reserve)

    def cached(self) -> list[torch.UntypedStorage]:
        return list(self._cache.values())

    def reset(self) -> None:
        self._cache = WeakIdKeyDictionary()

    def forget(self, addresses: set[int]) -> None:
        """Drop the cached buffers at ``addresses``: the next stage makes new ones."""
        for source, staged in list(self._cache.items()):
            if staged.data_ptr() in addresses:
                del self._cache[source]

    def _stage_untyped_storage(
        self, storage: torch.UntypedStorage, non_blocking: bool = False
    ) -> torch.UntypedStorage:
        cuda = storage.device.type == "cuda"
        staged = self._cache.get(storage)
        if staged is None or staged.nbytes() != storage.nbytes():
            staged = self._pool.new_storage(storage.nbytes(), touch=not self.copying, pin=cuda)
            self._cache[storage] = staged
        if self.copying and cuda:
            with self._pool.side.stream(storage.device):
                staged.copy_(storage, non_blocking=True)
        elif self.copying:
            self._pool.copy_into(staged, storage)
        return staged


def _found(entry: os.DirEntry[str] | None) -> tuple[int, int] | None:
    """The inode and size of the file ``entry`` names (``None``: none, or gone since)."""
    if entry is None:
        return None
    try:
        return entry.inode(), entry.stat(follow_symlinks=False).st_size
    except OSError:
        return None


_POOLS: weakref.WeakSet[StagingPool] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for pool in list(_POOLS):
        pool.close()


def _unlock_pools_in_child() -> None:
    """A child made with ``fork`` inherits each pool's lock as it was: held, when a
    thread of the parent held it (DCP's save thread locating tensors), with no thread
    left to release it, and its exit, closing the pools, would wait for ever."""
    for pool in list(_POOLS):
        pool._lock = threading.Lock()


os.register_at_fork(after_in_child=_unlock_pools_in_child)
