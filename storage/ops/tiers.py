"""Tiered checkpoints: a fast local tier in front of a manager's durable root.

``CheckpointManager(root, local=PATH_OR_URL, keep_local=N)`` saves each step to
``local/step-{N}`` (tmpfs, NVMe, any backend) and returns (or, with ``blocking=False``,
stages and commits locally in the background); a background drain then copies it to
``root/step-{N}`` byte for byte with the commit protocol (:mod:`storage.ops.drain`). A
step is committed in a tier once that tier's ``.metadata`` exists.

Local tiers are per node: the ranks on one host that name the same local location
share it. A save writes each rank's data files to its node's tier; once every rank's
files (and, with ``replicate``, the replicas it receives from its peers) are there,
the lowest rank of each node publishes the metadata there, and only then does the save
count as committed (:mod:`storage.ops.local_save`). Drains run one at a time, in a
thread of their own, with collectives on a process group of their own; loads are
planned and run in :mod:`storage.ops.restore`; ``keep_local`` is
:class:`storage.ops.local_retention.LocalRetention`, and a save waits for room under it
in :mod:`storage.ops.local_room`. Guarantees and limits: docs/operations.md
("Tiered checkpoints").
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from storage.checkpoint import api, persist
from storage.checkpoint.api import ReaderOptions
from storage.checkpoint.deadline import check_wait
from storage.checkpoint.layout import StepInfo
from storage.checkpoint.options import WriterSettings, resolve_location
from storage.checkpoint.writer import CheckpointWriter
from storage.ops import local_save, restore
from storage.ops._peers import Group, make_group
from storage.ops.drain import Drains
from storage.ops.local_retention import LocalRetention
from storage.ops.local_room import make_room
from storage.ops.pace import UploadPace
from storage.ops.restore import LoadedStep
from storage.ops.steps import StepRoot
from storage.ops.tier import overdue

log = logging.getLogger(__name__)


class LocalTier:
    """The local tier in front of ``root`` (a manager's ``tiers``, a
    :class:`~storage.ops.tier.Tier`; see the module docstring). ``transforms``, the writer
    ``settings``, ``incremental`` and ``full_every`` are the manager's save settings,
    ``reader`` its reader options; ``on_durable(step)``
    runs once a drained step is durable (the root's retention). Collective under a
    process group: it makes the groups its saves and drains run on."""

    def __init__(
        self,
        root: StepRoot,
        local: str | os.PathLike[str],
        *,
        transforms: list[Any],
        settings: WriterSettings,
        incremental: bool,
        full_every: int | None,
        reader: ReaderOptions,
        keep_local: int | None,
        replicate: bool | Callable[[int], int],
        storage_options: dict[str, Any] | None,
        filesystem: Any,
        on_durable: Callable[[int], None],
        pace: float | None = None,
    ) -> None:
        self.root = root
        self.local = StepRoot(*resolve_location(local, storage_options, filesystem))
        self.group: Group = make_group(self.local.url, replicate, own_pg=True)
        local_save.refuse_shared_tier(self.group, self.local)  # before it is listed
        local_save.claim_tier(self.group, self.local, root)
        self.retention = LocalRetention(
            self.local,
            keep_local,
            leader=self.group.leader,
            durable=self.durable,
            pending=self.pending,
        )
        self.transforms, self.settings = transforms, settings
        self.incremental, self.full_every, self.reader = incremental, full_every, reader
        self.pace = UploadPace(pace)  # of each step's drain
        self.replicated_bytes = 0  # bytes this rank sent to its peer
        self.restored_bytes = 0  # bytes this rank sent to restore other nodes' files (loads)
        self.last_commit: int | None = None  # the step this manager committed locally last
        self._pid = os.getpid()  # whose threads and process groups these are
        self._lock = threading.Lock()
        self._saves = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dcp-tier-save")
        self._committing: concurrent.futures.Future[None] | None = None
        self._committing_step: int | None = None  # the step it commits
        # Cleared while a save writes to the local tier: the drain's copy waits on it, so
        # the foreground save gets the disk and the cores (benchmarks/NOTES.md, "Tiered
        # checkpoints").
        self._idle = threading.Event()
        self._idle.set()
        self.drains = Drains(
            self.group,
            self.local,
            root,
            settings=settings,
            pace=self.pause,
            prune=self.retention.prune,
            on_durable=on_durable,
        )
        self.drains.schedule()  # after a restart: drain what is local but not durable

    # --- listing --------------------------------------------------------------------

    @property
    def keep_local(self) -> int | None:
        return self.retention.keep_local

    def durable(self, step: int) -> bool:
        """Whether the root holds this tier's copy of ``step`` committed, not as a
        symbolic link (a checkpoint from elsewhere) nor with a ``.metadata`` other than
        the one its drain published (:meth:`Drains.durable`)."""
        return self.drains.durable(step)

    def linked(self) -> set[int]:
        """Local steps whose directory is a symbolic link: someone else's checkpoints,
        listed and loaded like any step, but never drained, deleted or counted against
        ``keep_local`` (their owner keeps them)."""
        return set(self.local.linked_steps())

    def pending(self) -> set[int]:
        """Steps this manager saved whose drain has not landed yet."""
        return self.drains.pending()

    @property
    def saves_to(self) -> StepRoot:
        return self.local

    def steps(self) -> list[int]:
        """Committed steps, in this node's local tier or the root."""
        return sorted(set(self.local.steps()) | set(self.root.steps()))

    def durable_steps(self) -> list[int]:
        return self.root.steps()

    def entries(self) -> list[StepInfo]:
        """The root's entries merged with this node's local tier."""
        return restore.merge_entries(self.local.entries(), restore.durable_entries(self.root))

    def references(self, step: int) -> set[int]:
        """The local steps whose bytes local ``step`` references (incremental saves)."""
        return self.retention.references(step)

    # --- save -----------------------------------------------------------------------

    def save(
        self, step: int, state_dict: dict[str, Any], *, blocking: bool = True
    ) -> concurrent.futures.Future[None] | None:
        """Commit ``step`` in the local tier (every node) and queue its drain (which
        prunes the local tier first).

        Blocking: returns once committed, then raises the error of an earlier drain that
        failed before this save committed, if any (the step just saved is committed
        locally all the same, and its drain retries the failed steps).

        ``blocking=False``: raises such an error before anything is staged (nothing is
        saved then; save again), else stages ``state_dict`` to CPU memory and returns a
        future that resolves once the step is committed locally (or raises the
        commit's error); the write, replication and local commit run in a thread of
        their own, with their collectives on a process group of their own.

        Either way, the previous save's local commit is waited for first (at most one
        save in flight), and a paced drain in flight goes on at full speed: this step's
        drain queues behind it. This step's drain is paced (:mod:`storage.ops.pace`)."""
        self._check_process()
        persist.hurry()
        self.finish_commit()
        local_save.refuse_links(self.group, self.local, self.root, step, pg=None)
        if not blocking:
            self.drains.raise_error()
        make_room(self.group, self.retention, self.drains, self.root, step)
        in_worker = self.settings.persist_mode(self.local.fs, self.root.fs).name == "process"
        self.pace.begin(self.root.step_url(step), in_worker=in_worker)
        writer = self._start(step, None)
        if blocking:
            self._commit(step, writer, state_dict, None)
            earlier = self.drains.take_error()  # before this step's drain can fail
            if earlier is not None:
                raise earlier
            return None
        try:
            staged = writer.stage(api.plain_state_dict(state_dict))
            if isinstance(staged, concurrent.futures.Future):  # async_staging: returns
                staged = staged.result()  # once the copy is done, as documented
            inner = self._saves.submit(self._commit, step, writer, staged, self.group.save_pg)
        except BaseException:
            self._end()
            raise
        outer: concurrent.futures.Future[None] = concurrent.futures.Future()

        def finished(fut: concurrent.futures.Future[None]) -> None:
            error = fut.exception()
            if error is None:
                outer.set_result(None)
            else:
                log.error(
                    "asynchronous save of step %d to %s failed: %s", step, self.local.url, error
                )
                outer.set_exception(error)

        with self._lock:
            self._committing, self._committing_step = inner, step
        inner.add_done_callback(finished)
        return outer

    def save_by(
        self, step: int, state_dict: dict[str, Any], deadline: float
    ) -> concurrent.futures.Future[None]:
        """Commit ``step`` before ``deadline`` (a ``time.monotonic()`` time): the
        preemption save of :mod:`storage.ops.preemption`. Runs in the save thread, after
        the save in flight, with its collectives on the save group (the caller may wait
        with a timeout and leave), and writes ``state_dict``'s tensors as they are: no
        staging copy, so the caller must not change them until the future resolves. If
        any rank is past ``deadline`` once every file is written and replicated, every
        rank removes what it wrote and the future raises :class:`DeadlineExceededError`:
        nothing is published late. A step that is a symbolic link (here or under the
        root) is refused as :meth:`save` refuses it. No room is made first (the drain
        pass queued after the commit prunes): a tier over ``keep_local`` still takes
        this step."""

        self._check_process()
        persist.hurry()  # the job is ending: no drain waits for a deadline

        def run() -> None:
            local_save.refuse_links(self.group, self.local, self.root, step, pg=self.group.save_pg)
            writer = self._start(step, self.group.save_pg)
            self._commit(step, writer, state_dict, self.group.save_pg, deadline)

        future = self._saves.submit(run)
        with self._lock:
            self._committing, self._committing_step = future, step
        return future

    def finish_commit(self, timeout: float | None = None) -> bool:
        """Wait for the local commit of an asynchronous save in flight, if any (its
        error goes to that save's future, not to the caller), at most ``timeout``
        seconds; returns whether none is in flight any more."""
        with self._lock:
            committing = self._committing
        if committing is not None:
            done, _ = concurrent.futures.wait([committing], timeout)
            if not done:
                return False
            with self._lock:
                if self._committing is committing:
                    self._committing = None
        return True

    def _check_process(self) -> None:
        """A child made with ``fork`` has none of the save and drain threads, nor the
        process groups, of the manager it copied: its saves would wait for ever."""
        if os.getpid() != self._pid:
            raise RuntimeError(
                f"{self.root.url}: this tiered CheckpointManager was made in process "
                f"{self._pid}, and this process is a child forked from it: its save and "
                "drain threads and process groups are the parent's; make a CheckpointManager "
                "in the child"
            )

    def pause(self) -> None:
        """Block while a save of this manager writes to the local tier (the drain's
        copy calls this between reads, so the save gets the disk and the cores)."""
        self._idle.wait()

    def _start(self, step: int, pg: Any) -> CheckpointWriter:
        """Choose the base (collective on ``pg``), mark ``step`` as being written and
        return its writer."""
        with self.retention.lock:  # the base chosen is protected before retention can run
            base = local_save.base_for(
                self.group,
                self.local,
                step,
                incremental=self.incremental,
                full_every=self.full_every,
                transforms=self.transforms,
                pg=pg,
            )
            self.local.in_flight.begin(step, base)  # local retention leaves both alone
        self._idle.clear()  # after make_room, which may wait for the drain
        persist.worker().foreground(True)  # a drain copying in the worker pauses too
        try:
            settings = dataclasses.replace(
                self.settings,
                fingerprint=self.incremental,
                base=None if base is None else self.local.model(base),
                publish=False,  # each node publishes its own copy: local_save
            )
            return CheckpointWriter(
                self.local.step_url(step),
                transforms=self.transforms,
                filesystem=self.local.fs,
                **settings.writer_kwargs(),
            )
        except BaseException:
            self._end()
            raise

    def _end(self) -> None:
        self.local.in_flight.end()
        self._idle.set()
        persist.worker().foreground(False)

    def _commit(
        self,
        step: int,
        writer: CheckpointWriter,
        state_dict: dict[str, Any],
        pg: Any,
        deadline: float | None = None,
    ) -> None:
        """:func:`local_save.commit_step`, then queue the drain."""
        try:
            local_save.commit_step(
                self.group,
                self.local,
                step,
                writer,
                state_dict,
                pg=pg,
                sent=self._count_replicated,
                deadline=deadline,
            )
        finally:
            writer.close()
            self._end()
        self.drains.add(step)
        with self._lock:
            self.last_commit = step
        self.drains.schedule()  # which prunes the local tier first, off the save's path

    def _count_replicated(self, sent: int) -> None:
        self.replicated_bytes += sent

    # --- retention --------------------------------------------------------------------

    def delete_local(self, step: int) -> None:
        """Delete the local copy of ``step`` now, durable or not (the user's call)."""
        self.drains.discard(step)
        self.retention.deleting.delete(step)

    # --- drain and load -----------------------------------------------------------------

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the local commit of an asynchronous save in flight, then until every
        queued drain has finished (at full speed: a paced one is hurried); raise the
        error of a drain that failed. Past ``timeout`` seconds, raise
        :class:`DeadlineExceededError` naming the step not committed or not durable
        yet: the commit and the drains go on (:func:`storage.ops.tier.overdue`)."""
        self._check_process()
        timeout = check_wait(timeout)
        until = None if timeout is None else time.monotonic() + timeout
        if not self.finish_commit(timeout):
            assert timeout is not None
            with self._lock:
                step = self._committing_step
            url = self.local.url if step is None else self.local.step_url(step)
            raise overdue(timeout, step, url, "its save goes on; its future says how it ends")
        persist.hurry()
        if not self.drains.wait(None if until is None else max(0.0, until - time.monotonic())):
            assert timeout is not None
            step = self.drains.draining()
            url = self.root.url if step is None else self.root.step_url(step)
            fate = f"it stays in the local tier {self.local.url}; its drain goes on: wait() again"
            raise overdue(timeout, step, url, fate)
        self.drains.raise_error()

    def load(self, state_dict: dict[str, Any], step: int | None = None) -> LoadedStep:
        """Load ``step`` (default: the newest committed in any tier) from the nearest
        tier that holds it (:func:`storage.ops.restore.load`), once the local commit of
        an asynchronous save in flight is done; then queue a drain pass (a node restored
        from a peer drains)."""
        self._check_process()
        self.finish_commit()
        return restore.load(
            self.group,
            self.local,
            self.root,
            state_dict,
            step,
            reader=self.reader,
            pending=self.pending(),
            sent=self._count_restored,
            decided=self.drains.schedule,
        )

    def _count_restored(self, sent: int) -> None:
        self.restored_bytes += sent
