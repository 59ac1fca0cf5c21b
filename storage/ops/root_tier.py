"""A manager's saves and loads straight to its root (a manager without a local tier).

Each save writes ``root/step-{N}`` with a :class:`CheckpointWriter` and the commit
protocol, marks the step (and the base of an incremental save) in flight at the root
while it runs, so retention and cleanup leave both alone, then applies retention.
An asynchronous save runs with DCP's asynchronous machinery on a gloo group of its own
and reports through its future; at most one is in flight. A load reads the step
rank 0 picks, once this manager's own save in flight is done.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
from typing import Any

import torch.distributed as dist

from extensions.errors import CheckpointNotFoundError
from storage.checkpoint import api, persist
from storage.checkpoint import storage_format as fmt
from storage.checkpoint.api import ReaderOptions
from storage.checkpoint.committed import CommittedCheckpoint
from storage.checkpoint.deadline import check_wait
from storage.checkpoint.layout import STEP_PREFIX, StepInfo
from storage.checkpoint.options import WriterSettings
from storage.checkpoint.writer import CheckpointWriter
from storage.ops._peers import decided_by_rank_zero
from storage.ops.base_choice import Candidate, choose_base
from storage.ops.pace import UploadPace
from storage.ops.restore import durable_entries
from storage.ops.retention import Retention
from storage.ops.steps import StepRoot
from storage.ops.tier import overdue

log = logging.getLogger("storage.ops.manager")


class _Hurried(concurrent.futures.Future[None]):
    """An asynchronous save's future: waiting on it lifts its upload's pace."""

    def result(self, timeout: float | None = None) -> None:
        if not self.done():
            persist.hurry()
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if not self.done():
            persist.hurry()
        return super().exception(timeout)


class RootTier:
    """The saves and loads of one manager at ``root`` (a :class:`~storage.ops.tier.Tier`)
    with its settings (``transforms``, the writer ``settings``, ``incremental``,
    ``full_every``, ``reader``); ``retention`` runs after each save."""

    def __init__(
        self,
        root: StepRoot,
        retention: Retention,
        *,
        transforms: list[Any],
        settings: WriterSettings,
        incremental: bool,
        full_every: int | None,
        reader: ReaderOptions,
        pace: float | None = None,
    ) -> None:
        self.root, self.retention, self.reader = root, retention, reader
        self.transforms, self.settings = transforms, settings
        self.incremental, self.full_every = incremental, full_every
        self.pace = UploadPace(pace)  # of asynchronous saves
        self._lock = threading.Lock()
        self._pending: concurrent.futures.Future[None] | None = None
        self._pending_step: int | None = None  # the step its save writes
        self._async_group: Any = None

    @property
    def saves_to(self) -> StepRoot:
        return self.root

    def steps(self) -> list[int]:
        return self.root.steps()

    def durable_steps(self) -> list[int]:
        return self.root.steps()

    def entries(self) -> list[StepInfo]:
        return durable_entries(self.root)

    def save(
        self, step: int, state_dict: dict[str, Any], *, blocking: bool
    ) -> concurrent.futures.Future[None] | None:
        """See :meth:`CheckpointManager.save`."""
        self.root.refuse_link(step)
        persist.hurry()  # a paced save in flight: this one waits for it
        self.wait()
        base, opened = self.incremental_base(step)
        # The base is read once, here: the writer does not read it again.
        settings = dataclasses.replace(self.settings, fingerprint=self.incremental, base=opened)
        if not blocking:
            return self._save_async(step, base, state_dict, settings)
        with self.root.in_flight.writing(step, base):
            url = self.root.step_url(step)
            writer = CheckpointWriter(
                url, transforms=self.transforms, filesystem=self.root.fs, **settings.writer_kwargs()
            )
            api.save_with(writer, state_dict)
            if writer.published is not None:
                self.root.remember(step, writer.published)
        self.retention.after_save(step)
        return None

    def _save_async(
        self, step: int, base: int | None, state_dict: dict[str, Any], settings: WriterSettings
    ) -> concurrent.futures.Future[None]:
        url = self.root.step_url(step)
        outer: concurrent.futures.Future[None] = _Hurried()
        began = self.pace.begin(
            url, in_worker=settings.persist_mode(self.root.fs).name == "process"
        )
        self.root.in_flight.begin(step, base)
        with self._lock:
            self._pending, self._pending_step = outer, step
        try:
            writer = CheckpointWriter(
                url, transforms=self.transforms, filesystem=self.root.fs, **settings.writer_kwargs()
            )
            inner = api.async_save_with(writer, state_dict, process_group=self._background_group())
        except BaseException:
            persist.hurry()  # its pace must not fall on a later, unrelated save
            self.root.in_flight.end()
            with self._lock:
                self._pending = None
            raise

        def finished(fut: concurrent.futures.Future[None]) -> None:
            error = fut.exception()
            self.pace.ended(began)
            self.root.in_flight.end()
            if error is None:
                if writer.published is not None:  # retention need not read it back
                    self.root.remember(step, writer.published)
                self.retention.after_save(step)
                outer.set_result(None)
            else:
                # Failed before its writes took the pace it set (in planning, say): the
                # pace must not fall on a later, unrelated save.
                persist.hurry()
                log.error("asynchronous save of %s failed: %s", url, error)
                outer.set_exception(error)

        inner.add_done_callback(finished)
        return outer

    def _background_group(self) -> Any:
        """Under a process group, a gloo group of this manager's own for the collectives
        of its asynchronous saves: they run in a background thread while the job's run
        on the default group (a DDP all-reduce), and gloo aborts when collectives from
        two threads interleave on one group. Made at the first asynchronous save, which
        every rank makes together."""
        if not (dist.is_available() and dist.is_initialized()):
            return None
        if self._async_group is None:
            self._async_group = dist.new_group(backend="gloo")
        return self._async_group

    def incremental_base(self, step: int) -> tuple[int | None, CommittedCheckpoint | None]:
        """The step an incremental save of ``step`` references and its read model
        (:func:`~storage.ops.base_choice.choose_base`; a candidate that cannot be a base,
        ``StepRoot.base_problem``, makes the save a full one, which is logged). Under a
        process group rank 0 chooses and every rank takes its choice: the choice lists
        the root, and listings seen by different ranks may disagree (an eventually
        consistent store, a listing that lags on one host), while one save must
        reference one base. The save is collective, so every rank is here."""
        if not self.incremental:
            return None, None

        def decide() -> int | None:
            choice = choose_base(
                step,
                self.root.steps,
                self._candidate,
                incremental=self.incremental,
                full_every=self.full_every,
            )
            if choice.note is not None:
                log.info("%s", choice.note)
            return choice.base

        base = decided_by_rank_zero(decide, f"the base of the incremental save of step {step}")
        return base, None if base is None else self.root.model(base)

    def _candidate(self, step: int) -> Candidate:
        why = self.root.base_problem(step, self.transforms)
        return Candidate(why, 0 if why is not None else self.root.model(step).chain)

    def load(self, state_dict: dict[str, Any], step: int | None) -> int:
        """See :meth:`CheckpointManager.load`."""
        self.wait()
        if step is None:
            step = decided_by_rank_zero(lambda: max(self.root.steps(), default=None))
            if step is None:
                raise CheckpointNotFoundError(
                    f"no committed checkpoint under {self.root.url} (looked for "
                    f"{STEP_PREFIX}<N>/{fmt.METADATA_NAME}); save one first or check the root URL"
                )
        elif not self.root.is_committed(step):
            raise CheckpointNotFoundError(
                f"{self.root.step_url(step)} is not a committed checkpoint; committed steps "
                f"under {self.root.url}: {self.root.steps() or 'none'}"
            )
        api.load(
            state_dict, self.root.step_url(step), filesystem=self.root.fs, **self.reader.as_kwargs()
        )
        return step

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the asynchronous save in flight, if any (its error is not raised),
        at most ``timeout`` seconds (see :meth:`CheckpointManager.wait`)."""
        timeout = check_wait(timeout)
        with self._lock:
            pending, step = self._pending, self._pending_step
        if pending is not None:
            persist.hurry()
            if not concurrent.futures.wait([pending], timeout).done:
                assert timeout is not None and step is not None
                fate = "its save goes on, and its future says how it ends"
                raise overdue(timeout, step, self.root.step_url(step), fate)
            with self._lock:
                if self._pending is pending:
                    self._pending = None
