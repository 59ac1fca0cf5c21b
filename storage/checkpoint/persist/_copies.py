"""A stage's copies from CPU into the staging segments (:mod:`._shm`), spread over threads.

Where torch runs on one thread (a training process that leaves the host's other cores to
other work), the copies, and the reservation of each new segment's space, run on the
pool's ``copy_threads``: the training thread waits on them, so its stall is a copy over
that many cores, the first touch of new pages included. With more torch threads, torch's
own copy already spreads over them and the copies run inline; so do copies from another
device.
"""

from __future__ import annotations

import concurrent.futures
import os
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from storage.checkpoint.persist._shm import Segment

#: A stage's copies from CPU are spread over threads in pieces of at most this many bytes.
PIECE = 16 << 20


class Copies:
    """One stage's copies from CPU into segments, on ``threads`` threads (inline with
    one, where torch itself runs on more than one thread, or for a source on another
    device): each copy is cut into pieces of at most :data:`PIECE` bytes, a new
    segment's piece reserved just before it is copied. :meth:`finish` waits for every
    piece (interrupted or not: no piece outlives the stage) and raises the first
    failure; a segment is marked reserved only once all of its pieces were, so one whose
    reservation failed is reserved again by the next stage that copies into it.

    A child made with ``fork`` has none of its parent's copy threads: it neither hands
    them pieces (which would never run) nor shuts them down (which waits for a lock a
    thread of the parent may have held at the fork, inside ``submit``): it forgets them,
    and makes threads of its own where it copies."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._pid = os.getpid()  # the process whose threads ``_executor`` runs
        self._pending: list[concurrent.futures.Future[None]] = []
        self._fresh: list[Segment] = []

    def add(self, segment: Segment, source: torch.UntypedStorage) -> None:
        if self.threads == 1 or torch.get_num_threads() > 1 or source.device.type != "cpu":
            if not segment.reserved:
                segment.reserve()
                segment.reserved = True
            segment.storage.copy_(source)
            return
        self._forget_if_forked()
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                self.threads, thread_name_prefix="dcp-staging-copy"
            )
        fresh = not segment.reserved
        for start in range(0, source.nbytes(), PIECE):
            end = min(start + PIECE, source.nbytes())
            try:
                future = self._executor.submit(_copy_piece, segment, source, start, end, fresh)
            except RuntimeError:  # no new threads (the interpreter is exiting): copy here
                _copy_piece(segment, source, start, end, fresh)
            else:
                self._pending.append(future)  # waited for even if this loop is interrupted
        if fresh:
            self._fresh.append(segment)  # every piece is on its way

    def finish(self, *, raising: bool = True) -> None:
        """Wait for every piece; raise the first failure when ``raising``."""
        pending, self._pending = self._pending, []
        fresh, self._fresh = self._fresh, []
        interrupted: BaseException | None = None
        while True:
            try:
                concurrent.futures.wait(pending)
                break
            except BaseException as exc:  # noqa: BLE001 - pieces are short: wait, then raise
                interrupted = interrupted or exc
                for future in pending:
                    future.cancel()
        if interrupted is not None:
            raise interrupted
        if raising:
            for future in pending:
                future.result()  # the first failure
        if all(future.exception() is None for future in pending):
            for segment in fresh:
                segment.reserved = True

    def close(self) -> None:
        """Stop the threads (no stage is running: the pool's lock is held)."""
        self._forget_if_forked()
        if self._executor is not None:
            self._executor.shutdown()
            self._executor = None

    def _forget_if_forked(self) -> None:
        if self._pid != os.getpid():
            self._pid = os.getpid()
            self._executor = None
            self._pending, self._fresh = [], []


def _copy_piece(
    segment: Segment, source: torch.UntypedStorage, start: int, end: int, fresh: bool
) -> None:
    if fresh:
        segment.reserve(start, end - start)
    # Views made here, not by the caller: a tensor made under the caller's
    # ``inference_mode`` may not be written by this thread, outside it.
    into = torch.empty(0, dtype=torch.uint8, device="cpu").set_(segment.storage)
    out_of = torch.empty(0, dtype=torch.uint8, device="cpu").set_(source)
    into[start:end].copy_(out_of[start:end])
