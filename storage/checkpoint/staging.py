"""How a :class:`~storage.checkpoint.writer.CheckpointWriter` stages for
``dcp.async_save`` (torch's ``AsyncStager``): into the persist worker's shared buffers or
through DCP's stager, and, from CUDA, without blocking the caller where asked to."""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any, cast

import torch
from torch.distributed.checkpoint.metadata import STATE_DICT_TYPE
from torch.distributed.checkpoint.staging import AsyncStager, DefaultStager

from storage.checkpoint import persist as _persist
from storage.checkpoint.options import staging_options
from storage.checkpoint.persist._cuda import InFlight


class WriterStaging(AsyncStager):
    """The writer's ``AsyncStager`` half (its docstring states the contract)."""

    persist_mode: _persist.Mode
    cache_staged_state_dict: bool
    async_staging: bool
    _lease: _persist.Lease | None
    _stager: DefaultStager | None

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
        ``async_staging`` this returns a future of the copy instead (see the writer)."""
        if self.persist_mode.name == "process":
            staged, self._lease = _persist.worker().stage(state_dict)
            copies = self._lease.copies
            if self.async_staging:
                return _when_copied(copies, cast(STATE_DICT_TYPE, staged))
            self._lease.wait_copied()
            return cast(STATE_DICT_TYPE, staged)
        staged = self._stage_in_thread_mode(state_dict)
        return _when_copied(None, staged) if self.async_staging else staged

    def _stage_in_thread_mode(self, state_dict: STATE_DICT_TYPE) -> STATE_DICT_TYPE:
        if self.cache_staged_state_dict:
            if self._stager is None:
                self._stager = DefaultStager(staging_options(pin=torch.cuda.is_available()))
            return cast(STATE_DICT_TYPE, self._stager.stage(state_dict))
        stager = DefaultStager(staging_options(pin=False))
        try:
            return cast(STATE_DICT_TYPE, stager.stage(state_dict))
        finally:
            stager.close()

    def synchronize_staging(self) -> None:
        """Return once the last :meth:`stage`'s copy is complete."""
        lease = self._lease
        if lease is not None:
            lease.wait_copied()

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
