"""Staging buffers in shared memory, reused from one save to the next.

The training process copies its state into these buffers (the only work an
asynchronous save does on the training thread) and the persist worker maps the same
pages, so the bytes cross processes without another copy. The buffers are segments,
sealed anonymous memory (:mod:`._shm`), each handed to the worker once, by descriptor,
over the socket that the pool's ``share`` callback writes to; a pool shares with one
worker process (its handle makes a new pool for a new worker).

A stage's copies from CPU, reservations of new segments included, run on the pool's
``copy_threads`` where torch runs on one thread (:mod:`._copies`).
"""

from __future__ import annotations

import atexit
import bisect
import contextlib
import itertools
import logging
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from storage.checkpoint.persist._copies import Copies
from storage.checkpoint.persist._cuda import InFlight, Pins, SideCopies
from storage.checkpoint.persist._shm import FDS_PER_MESSAGE, OUT_OF_DESCRIPTORS, Segment, no_room
from storage.checkpoint.stager import ValueStager

log = logging.getLogger(__name__)

#: Storages smaller than this are staged in private memory and sent by value.
SMALL = 64 << 10

#: How a pool hands segments to its worker: ``share(names, fds, dropped)`` sends the
#: descriptors of new segments (at most :data:`._shm.FDS_PER_MESSAGE`) and the names of
#: segments the pool no longer uses; raises ``OSError`` when it cannot.
Share = Callable[[list[str], list[int], list[str]], None]


class StagingPool:
    """The shared-memory staging buffers of this process, one segment per large storage.

    :meth:`stage` copies a state dict into buffers cached by source storage (the next
    stage of the same tensors copies into the same buffers); :meth:`locate` tells where
    a staged tensor's bytes are. Not thread-safe: the persist client serializes stages.
    A buffer staging a CUDA storage is pinned (``pins``, :mod:`._cuda`) and copied into
    without blocking, on a side stream; copies from CPU run on ``copy_threads`` threads
    (:class:`._copies.Copies`). New segments (and the names of dropped ones) go to the
    worker through ``share`` by the end of the stage that made them; without ``share``
    (no worker) their descriptors are closed then.
    """

    def __init__(
        self, pins: Pins | None = None, copy_threads: int = 1, share: Share | None = None
    ) -> None:
        self.pins = pins if pins is not None else Pins()
        self.side = SideCopies()
        self._copies = Copies(copy_threads)
        self._share = share
        self._pid = os.getpid()
        self._names = itertools.count()
        self._segments: dict[int, Segment] = {}  # by address
        self._addresses: list[int] = []  # sorted
        self._unsent: list[Segment] = []  # made, their descriptors not yet shared
        self._dropped: list[str] = []  # shared, then dropped: the worker forgets them
        self._stager = _Stager(self)
        self._in_flight: InFlight | None = None  # the last stage's copies from a device
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
                self._flush()
                failed = False
            finally:
                if failed:  # no copy may outlive a failed stage: the next one reuses
                    self._copies.finish(raising=False)  # the buffers (and its error
                copies = self.side.finish(state_dict)  # is the one raised)
                if failed and copies is not None:
                    copies.wait()
                self._in_flight = copies
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
            self._flush()

    def live(self) -> dict[str, int]:
        """The segments in use, by name: each one's size."""
        with self._lock:
            return {s.name: len(s.map) for s in self._segments.values()}

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
        """A staging buffer of ``nbytes``; ``pin``: page-locked for CUDA copies, where
        CUDA does not refuse it (pageable then: see :class:`._cuda.Pins`)."""
        if nbytes < SMALL:
            if pin and self.pins.refused is None:
                try:
                    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).untyped_storage()
                except RuntimeError as exc:  # no pinned memory left
                    self.pins.refuse(exc)
            return torch.UntypedStorage(nbytes)
        if len(self._unsent) >= FDS_PER_MESSAGE:
            self._flush()  # a stage of thousands of segments holds few descriptors at once
        segment = Segment(str(next(self._names)), nbytes)
        self._segments[segment.address] = segment
        bisect.insort(self._addresses, segment.address)
        self._unsent.append(segment)
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
            self.pins.pin(segment.address, nbytes)
        return segment.storage

    def copy_into(self, staged: torch.UntypedStorage, source: torch.UntypedStorage) -> None:
        """Copy ``source`` into its staging buffer ``staged`` (done when the stage is)."""
        segment = self._segments.get(staged.data_ptr())
        if segment is None:  # a small storage, in private memory
            staged.copy_(source)
        else:
            self._copies.add(segment, source)

    def _flush(self) -> None:
        """Hand the new segments' descriptors to the worker, and the names of the
        dropped ones, then close the descriptors (call with the lock). A worker that is
        gone is not an error here: its handle reports it, and makes a new pool for the
        next worker. No descriptor for one (the open-file limit) is
        :class:`._shm.SharedMemoryFull`."""
        while self._unsent or self._dropped:
            batch = self._unsent[:FDS_PER_MESSAGE]
            dropped, self._dropped = self._dropped, []
            try:
                if self._share is not None:
                    self._share([s.name for s in batch], [s.fd for s in batch], dropped)
            except OSError as exc:
                if exc.errno in OUT_OF_DESCRIPTORS:
                    self._dropped = dropped + self._dropped
                    raise no_room(sum(len(s.map) for s in batch), exc) from exc
                log.debug("cannot share staging segments with the persist worker: %s", exc)
            del self._unsent[: len(batch)]
            for segment in batch:
                segment.close()

    def _drop(self, address: int) -> None:
        """Forget a segment: unregistered from CUDA first; the worker forgets it at the
        next flush (the kernel frees its memory once neither maps it)."""
        self.pins.unpin(address)
        segment = self._segments.pop(address)
        self._addresses.remove(address)
        if segment.fd >= 0:  # never shared
            self._unsent.remove(segment)
            segment.close()
        else:
            self._dropped.append(segment.name)

    def _collect(self) -> None:
        # Segments whose source storage is gone (the cache dropped them) are dropped
        # before the next stage; no save reads them then (the client waits for that).
        live = {s.data_ptr() for s in self._stager.cached()}
        for address in [a for a in self._addresses if a not in live]:
            self._drop(address)

    def close(self) -> None:
        """Forget every segment (mappings stay valid until their tensors are gone; the
        kernel frees a segment with its last mapping), once the last stage's copies from
        a device are done: a save may still hold the buffers (the pools are closed at
        exit), and no buffer is unpinned while a copy fills it. In a child made with
        ``fork``, the copies and the CUDA registrations are its parent's: left alone."""
        with self._lock:
            copies, self._in_flight = self._in_flight, None
            if copies is not None and os.getpid() == self._pid:
                with contextlib.suppress(Exception):  # CUDA torn down at exit
                    copies.wait()
            self._copies.close()
            for address, segment in self._segments.items():
                if os.getpid() == self._pid:
                    self.pins.unpin(address)
                segment.close()
            self._segments.clear()
            self._addresses.clear()
            self._unsent.clear()
            self._dropped.clear()
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
            # Pinned in the context of the source's device, one the process uses.
            with torch.cuda.device(storage.device) if cuda else contextlib.nullcontext():
                staged = self._pool.new_storage(storage.nbytes(), touch=not self.copying, pin=cuda)
            self._cache[storage] = staged
        if self.copying and cuda:
            with self._pool.side.stream(storage.device):
                staged.copy_(storage, non_blocking=True)
        elif self.copying:
            self._pool.copy_into(staged, storage)
        return staged


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
