"""How a :class:`~storage.checkpoint.writer.CheckpointWriter` stages for
``dcp.async_save`` (torch's ``AsyncStager``): into the persist worker's shared buffers,
into buffers of this process kept between saves (:class:`LocalStaging`), or through DCP's
stager, and, from CUDA, without blocking the caller where asked to; and how the save's
writes then take the staged state: once the copies into its buffers completed, in the
persist worker that holds them or here, and the buffers freed again after."""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
from typing import Any, cast

import torch
from torch.distributed.checkpoint.metadata import STATE_DICT_TYPE
from torch.distributed.checkpoint.planner import WriteItem
from torch.distributed.checkpoint.staging import AsyncStager, DefaultStager
from torch.distributed.checkpoint.storage import WriteResult

from storage.checkpoint import persist as _persist
from storage.checkpoint import savable
from storage.checkpoint.options import staging_options
from storage.checkpoint.persist._cuda import InFlight, drain_pending_error
from storage.checkpoint.stager import ValueStager

log = logging.getLogger(__name__)


class WriterStaging(AsyncStager):
    """The writer's ``AsyncStager`` half (its docstring states the contract)."""

    persist_mode: _persist.Mode
    cache_staged_state_dict: bool
    async_staging: bool
    _lease: _persist.Lease | None
    _stager: Any

    @property
    def url(self) -> str:
        """The checkpoint saved (the writer's)."""
        raise NotImplementedError

    def write_files(
        self, files: list[tuple[str, list[WriteItem]]], threads: int, planner: Any
    ) -> list[list[WriteResult]]:
        """Write ``files`` here (the writer's)."""
        raise NotImplementedError

    def abort(self, error: BaseException | None = None) -> None:
        """Remove what the current save wrote (the writer's)."""
        raise NotImplementedError

    # stage returns once the copy is complete, or a future of it: nothing to wait for.
    _synchronize_after_execute: bool = False

    def stage(
        self, state_dict: STATE_DICT_TYPE
    ) -> STATE_DICT_TYPE | concurrent.futures.Future[STATE_DICT_TYPE]:
        """A CPU copy of ``state_dict`` that training may not change (``dcp.async_save``).

        With ``persist="process"`` the copy goes into the persist worker's shared staging
        buffers (reused by every save of the same tensors; a save waits until the
        previous one's worker has read them) and the save's writes run in the worker;
        the buffers of CUDA tensors are pinned and copied into on a side stream. With
        the default ``persist=None`` in threads, the copy goes into this process's
        :class:`LocalStaging` buffers; with ``persist="thread"`` named, through DCP's
        stager as stock torch does. With ``async_staging`` this returns a future of the
        copy instead (see the writer). Where there is no room for the buffers (memory,
        or descriptors: :class:`~storage.checkpoint.persist.SharedMemoryFull`, naming
        the checkpoint), the default (not a named ``"process"``) copies and writes this
        save here, and every later one in threads
        (:func:`storage.checkpoint.persist.shm_full`).

        A writer saves once at a time (wait for one save's future before the next): a
        lease it still holds here is its previous save's, which failed before its
        writes (in planning, or on another rank) without DCP telling the writer, and
        is released first, or the next save would wait for it for ever.

        A tensor no checkpoint can hold (sparse, on the meta device) is refused here,
        naming it (:mod:`storage.checkpoint.savable`)."""
        self._release()
        savable.check_state_dict(state_dict, self.url)
        if self.persist_mode.name == "process":
            if self.persist_mode.explicit or _persist.shm_room():
                try:
                    return self._stage_in_worker(state_dict)
                except _persist.SharedMemoryFull as exc:
                    named = _persist.SharedMemoryFull(f"saving {self.url}: {exc}")
                    if self.persist_mode.explicit:
                        raise named from exc
                    _persist.shm_full(named)
            # The default, and no room for the buffers: a copy here, written here (no lease).
            staged = _fresh_copy(state_dict)
            return _when_copied(None, staged) if self.async_staging else staged
        staged = self._stage_in_thread_mode(state_dict)
        return _when_copied(None, staged) if self.async_staging else staged

    def _stage_in_worker(
        self, state_dict: STATE_DICT_TYPE
    ) -> STATE_DICT_TYPE | concurrent.futures.Future[STATE_DICT_TYPE]:
        staged, self._lease = _persist.worker().stage(state_dict)
        copies = self._lease.copies
        if self.async_staging:
            return _when_copied(copies, cast(STATE_DICT_TYPE, staged))
        self._lease.wait_copied()
        return cast(STATE_DICT_TYPE, staged)

    def _stage_in_thread_mode(self, state_dict: STATE_DICT_TYPE) -> STATE_DICT_TYPE:
        if not self.persist_mode.explicit and not self.cache_staged_state_dict:
            local = local_staging()
            if local is not None:
                staged, self._lease = local.stage(state_dict)
                return cast(STATE_DICT_TYPE, staged)
        if self.cache_staged_state_dict:
            if self._stager is None:
                self._stager = _stager(pin=torch.cuda.is_available())
            try:
                return cast(STATE_DICT_TYPE, self._stager.stage(state_dict))
            except RuntimeError:  # pinning refused, as torch's stager raises it: its
                drain_pending_error()  # CUDA error must not fail the next kernel too
                raise
        return cast(STATE_DICT_TYPE, _fresh_copy(state_dict))

    def synchronize_staging(self) -> None:
        """Return once the last :meth:`stage`'s copy is complete."""
        lease = self._lease
        if lease is not None:
            lease.wait_copied()

    def _take_staged(self) -> _persist.Lease | None:
        """The current save's hold on the buffers its state was staged into (``None``:
        none are held), once the copies into them from a device completed: nothing
        reads the staged buffers before (the writes, which fingerprint them too)."""
        lease, self._lease = self._lease, None
        if lease is not None:
            try:
                lease.wait_copied()
            except BaseException:
                lease.release()
                raise
        return lease

    def _write_staged(
        self,
        lease: _persist.Lease | None,
        files: list[tuple[str, list[WriteItem]]],
        threads: int,
        planner: Any,
    ) -> list[list[WriteResult]]:
        """Write ``files`` where the state was staged: in the persist worker, whose
        buffers hold it (a failure there aborts the save), or here, then freeing the
        buffers kept between saves (``lease``, from :meth:`_take_staged`)."""
        if lease is not None and self.persist_mode.name == "process":
            try:  # staged in the persist worker's buffers: it writes
                return _persist.write_staged(self, files, threads, planner, lease)
            except BaseException:
                self.abort()
                raise
        try:
            return self.write_files(files, threads, planner)
        finally:
            if lease is not None:  # staging buffers kept between saves: free again
                lease.release()

    def close(self) -> None:
        """Release the cached staging buffers (``cache_staged_state_dict``)."""
        self._release()
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    def __getstate__(self) -> dict[str, Any]:
        # A process-based async save ships the writer, never its staging buffers. torch's
        # executor pickles the staged state before the writer: the other process has its
        # own copy, so the persist worker's buffers are free for the next save.
        self._release()
        state = self.__dict__.copy()
        state["_stager"] = None
        return state

    def _release(self) -> None:
        lease, self._lease = self._lease, None
        if lease is not None:
            lease.release()


class LocalStaging:
    """Staging buffers in this process's memory, kept from one save to the next, for
    asynchronous saves that persist in threads by default (``persist=None``).

    A fresh copy of the state at every save (what DCP's stager does without
    ``cache_staged_state_dict``) touches fresh memory each time: on a host that hands
    freed memory back, that is ~1 ms per MB of stall, where copying into buffers already
    touched costs a tenth of it. The buffers are torch's ``StateDictStager`` cache: one
    per tensor storage of the state, held while that storage lives, those of CUDA
    tensors pinned. One save holds them at a time (its :class:`~.persist.Lease`, released
    once its writes read them); a save that finds them held, because the previous save
    is still writing, gets a fresh copy instead: it never waits for another save."""

    def __init__(self) -> None:
        self._free = threading.Event()
        self._free.set()
        self._taking = threading.Lock()
        self._stager: Any = None
        self._pin = torch.cuda.is_available()

    def stage(self, state_dict: Any) -> tuple[Any, _persist.Lease | None]:
        """A CPU copy of ``state_dict`` and the lease on the buffers it lives in
        (``None`` when they were held and the copy is a fresh one)."""
        with self._taking:
            reuse = self._free.is_set()
            self._free.clear()
        if not reuse:
            return _fresh_copy(state_dict), None
        try:
            try:
                staged = self._kept().stage(state_dict)
            except RuntimeError as exc:
                if not self._pin:
                    raise
                # Page-locking refused (locked-memory limit, ``ulimit -l``): the copies
                # from CUDA are then slower, the save still made. torch's pinning
                # leaves CUDA's error pending on this thread: consumed, or the training
                # thread's next kernel launch would fail with it.
                drain_pending_error()
                log.warning("pinning the staging buffers failed (%s); staging unpinned", exc)
                self._pin, self._stager = False, None
                staged = self._kept().stage(state_dict)
        except BaseException:
            self._free.set()
            raise
        return staged, _persist.Lease(self._free)

    def _kept(self) -> Any:
        if self._stager is None:
            self._stager = ValueStager(pin_memory=self._pin)  # type: ignore[misc]
        return self._stager


def _stager(*, pin: bool) -> Any:
    """A stager of values (:mod:`storage.checkpoint.stager`; DCP's before torch 2.8)."""
    if ValueStager is None:  # pragma: no cover - torch 2.7
        return DefaultStager(staging_options(pin=pin))
    return ValueStager(pin_memory=pin)


def _fresh_copy(state_dict: Any) -> Any:
    stager = _stager(pin=False)
    try:
        return stager.stage(state_dict)
    finally:
        stager.close()


_local: LocalStaging | None = None
_local_lock = threading.Lock()


def local_staging() -> LocalStaging | None:
    """This process's :class:`LocalStaging` (``None`` before torch 2.8)."""
    global _local
    if ValueStager is None:
        return None
    with _local_lock:
        if _local is None:
            _local = LocalStaging()
        return _local


def _forget_local_staging_in_child() -> None:
    """A child made with ``fork`` starts without the parent's buffers (and its lock)."""
    global _local, _local_lock
    _local, _local_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_local_staging_in_child)


def _when_copied(
    copies: InFlight | None, staged: STATE_DICT_TYPE
) -> concurrent.futures.Future[STATE_DICT_TYPE]:
    """A future of ``staged``, resolved once ``copies`` completed."""
    future: concurrent.futures.Future[STATE_DICT_TYPE] = concurrent.futures.Future()
    if copies is None:
        future.set_result(staged)
        return future

    def wait() -> None:
        try:
            copies.wait()
        except BaseException as exc:  # noqa: BLE001 - handed to the save
            future.set_exception(exc)
        else:
            future.set_result(staged)

    threading.Thread(target=wait, name="dcp-staging-copies", daemon=True).start()
    return future
