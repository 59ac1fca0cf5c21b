"""The training process's handle on its persist worker (:class:`Worker`): the worker
process and its calls (:class:`._calls.WorkerCalls`), its warming for the saves to come,
and the staging into its buffers, each save holding them by a :class:`._lease.Lease`."""

from __future__ import annotations

import contextlib
import functools
import logging
import pickle
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from extensions.errors import WorkerDiedError
from storage.checkpoint.persist._calls import WorkerCalls
from storage.checkpoint.persist._lease import Lease
from storage.checkpoint.persist._messages import NotSendable
from storage.checkpoint.persist._pool import StagingPool
from storage.checkpoint.persist._shm import SharedMemoryFull
from storage.checkpoint.persist._whole import OwnedLock

log = logging.getLogger(__name__)


class Worker(WorkerCalls):
    """The training process's handle on its persist worker (see the module docstring)."""

    def __init__(self, copy_threads: int = 1) -> None:
        super().__init__()
        self.copy_threads = copy_threads  # its staging pool's (see StagingPool)
        self._free = threading.Event()
        self._free.set()
        # A stage's wait for the buffers and its taking them.
        self._taking = OwnedLock("staging, waiting for the previous save's buffers")
        self.pool: StagingPool | None = None
        self._pool_conn: Connection | None = None  # the worker the pool shares with
        self._warmed: set[tuple[int | None, type]] = set()  # (worker pid, storage type)

    def close(self) -> None:
        """Stop the worker (after the calls in flight) and remove the staging buffers."""
        super().close()
        if self.pool is not None:  # after the copies from a device still filling it
            self.pool.close()
            self.pool = None

    def warm(self, fn: Callable[[Any], None], filesystem: Any) -> None:
        """Send ``fn(filesystem)`` to the worker without waiting for it, once per worker
        process and type of storage: it prepares the worker for the saves to come. Its
        failure is the first save's to report (that save sends the same storage)."""
        with self._lock:
            key = (self.pid, type(filesystem))
            if key in self._warmed:
                return
            self._warmed.add(key)
        with contextlib.suppress(NotSendable, WorkerDiedError):
            self.call(fn, filesystem)

    # --- the staging buffers ----------------------------------------------------------

    def start(self) -> StagingPool:
        """Start the worker process and make the staging pool, if not yet done (a
        dead worker's error is raised here once); returns the pool, which may be a
        dead worker's (see :meth:`_stale`)."""
        with self._lock:
            conn = self._start()
            if self.pool is None:
                share = functools.partial(self._share, conn)
                self.pool = StagingPool(copy_threads=self.copy_threads, share=share)
                self._pool_conn = conn
            return self.pool

    def _stale(self, pool: StagingPool) -> bool:
        """Whether ``pool`` shared its segments with a worker that is gone, or that lost
        some of them (:meth:`restage`): a new worker never received them (their
        descriptors are closed once sent), so a new pool stages for it."""
        with self._lock:
            return self.pool is not pool or self._pool_conn is not self._conn

    def restage(self, pool: StagingPool) -> None:
        """The worker lost some of ``pool``'s segments (a save reading one failed with
        :class:`._mapped.SegmentLost`): the next stage drops ``pool`` and stages in a
        new one, whose segments go to the worker afresh (see :meth:`_stale`)."""
        with self._lock:
            if self.pool is pool:
                self._pool_conn = None

    def _share(
        self, conn: Connection, names: list[str], fds: list[int], dropped: list[str]
    ) -> None:
        """Send the worker behind ``conn`` new segments (their descriptors) and the names
        of dropped ones (the pool's ``share``): a message, then the descriptors."""
        message = pickle.dumps(("segments", names, dropped))
        with self._send_lock:
            self._send(conn, message, fds=fds if names else None)

    def reserve(self, state_dict: Any) -> None:
        """Start the worker and make the staging buffers for ``state_dict``'s tensors,
        their pages touched (:meth:`StagingPool.reserve`); stages nothing."""
        pool = self.start()
        if self._stale(pool):
            if not self._free.is_set():
                return  # a save holds the dead worker's buffers: the next stage replaces them
            self._drop_pool(pool)
            pool = self.start()
        try:
            pool.reserve(state_dict)
        except SharedMemoryFull:
            if self._free.is_set():  # no save holds the buffers: give their room back
                self._drop_pool(pool)
            raise

    def _drop_pool(self, pool: StagingPool) -> None:
        """Drop the staging buffers (no room for more, or their worker is gone): their
        memory goes back to the host once no staged tensor maps it; a later stage here
        makes a new pool."""
        with self._lock:
            if self.pool is pool:
                self.pool = None
        pool.close()

    def stage(self, state_dict: Any) -> tuple[Any, Lease]:
        """Copy ``state_dict`` into the staging buffers, once the previous save that
        holds them is done reading; returns the staged copy and its lease. Copies from
        CUDA are only enqueued when this returns: see :class:`._lease.Lease`."""
        pool = self.start()  # a dead worker is reported here, before anything is staged
        if not self._free.is_set():
            # Held by a save still writing, which may be paced (another manager's): this
            # save, on the training thread, waits for it now, so its pace is lifted.
            self.hurry()
        with self._taking:  # as one step: two threads' stages take the buffers in turn
            while not self._free.wait(60):
                log.warning("a checkpoint save waits for the previous one to release its buffers")
            self._free.clear()
        try:
            if self._stale(pool):  # no save holds its buffers now: this stage took them
                self._drop_pool(pool)
                pool = self.start()
            staged, copies = pool.stage(state_dict)
        except SharedMemoryFull:
            self._drop_pool(pool)  # no save holds the buffers: this stage waited for them
            self._free.set()
            raise
        except BaseException:
            self._free.set()
            raise
        return staged, Lease(self._free, copies)
