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
count as committed. Drains run one at a time, in a thread of their own, with
collectives on a process group of their own; loads are planned and run in
:mod:`storage.ops.restore`. Guarantees and limits: docs/operations.md ("Tiered
checkpoints").
"""

from __future__ import annotations

import concurrent.futures
import errno
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.checkpoint.storage import WriteResult

from extensions.errors import CheckpointInUseError, TierFullError
from storage.checkpoint import api, incremental, persist
from storage.checkpoint import format as fmt
from storage.checkpoint._common import resolve_location
from storage.checkpoint.commit import publish_metadata
from storage.checkpoint.committed import CommittedCheckpoint
from storage.checkpoint.deadline import DeadlineExceededError
from storage.checkpoint.layout import StepInfo, is_committed, parse_step
from storage.checkpoint.writer import CheckpointWriter
from storage.ops import restore
from storage.ops._peers import Group, Move, gather_errors, make_group, transfer
from storage.ops.drain import drain_step
from storage.ops.manager import CheckpointManager
from storage.ops.restore import DURABLE, LOCAL, LoadedStep

log = logging.getLogger(__name__)


class _TierWriter(CheckpointWriter):
    """Writes a save's data files and keeps its metadata instead of publishing it: the
    coordinator's node-local tier does not hold the other nodes' files, so each node
    publishes its own copy once its files are there."""

    payload: bytes | None = None
    finished: Metadata | None = None  # what ``payload`` holds, unpickled

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        self.payload = self.metadata_payload(metadata, results)
        self.finished = metadata


class LocalTier:
    """The local tier of a :class:`CheckpointManager` (see the module docstring)."""

    def __init__(
        self,
        manager: CheckpointManager,
        local: str | os.PathLike[str],
        *,
        keep_local: int | None,
        replicate: bool | Callable[[int], int],
        storage_options: dict[str, Any] | None,
        filesystem: Any,
    ) -> None:
        if keep_local is not None and (
            not isinstance(keep_local, int) or isinstance(keep_local, bool) or keep_local < 1
        ):
            raise ValueError(f"keep_local must be an int >= 1 or None, got {keep_local!r}")
        self.manager = manager
        self.keep_local = keep_local
        fs, root = resolve_location(local, storage_options, filesystem)
        self.group: Group = make_group(fs.url(root), replicate, own_pg=True)
        self.local = CheckpointManager(
            root,
            filesystem=fs,
            coordinator=self.group.leader,
            transforms=manager.transforms,
            keys=manager.keys,
            registry=manager.registry,
            require_encryption=manager.require_encryption,
            **manager.writer_options,
        )
        if self.local.url.rstrip("/") == manager.url.rstrip("/"):
            raise ValueError(f"the local tier and the root are both {manager.url}")
        self.replicated_bytes = 0  # bytes this rank sent to its peer
        self.restored_bytes = 0  # bytes this rank sent to restore other nodes' files (loads)
        self.last_commit: int | None = None  # the step this manager committed locally last
        self._lock = threading.Lock()
        self._retain_lock = threading.Lock()
        self._pending: set[int] = set()  # saved by this manager, not drained yet
        self._error: BaseException | None = None
        self._last_error: str | None = None  # kept after it is surfaced, for messages
        self._drains = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dcp-drain")
        self._last: concurrent.futures.Future[None] | None = None
        self._saves = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dcp-tier-save")
        # Cleared while a save writes to the local tier: the drain's copy waits on it, so
        # the foreground save gets the disk and the cores (docs/benchmarks.md).
        self._idle = threading.Event()
        self._idle.set()
        self._committing: concurrent.futures.Future[None] | None = None
        self._schedule()  # after a restart: drain what is local but not durable

    # --- listing --------------------------------------------------------------------

    def durable(self, step: int) -> bool:
        return is_committed(self.manager.fs, self.manager.step_path(step))

    def linked(self) -> set[int]:
        """Local steps whose directory is a symbolic link: someone else's checkpoints,
        listed and loaded like any step, but never drained, deleted or counted against
        ``keep_local`` (their owner keeps them)."""
        return set(self.local.linked_steps())

    def pending(self) -> set[int]:
        """Steps this manager saved whose drain has not landed yet."""
        with self._lock:
            return set(self._pending)

    def tiers_by_step(self) -> dict[int, tuple[str, ...]]:
        """Committed steps (this node's local tier and the root) and the tiers holding each."""
        local, durable = set(self.local.steps()), set(self.manager.durable_steps())
        return {
            s: tuple(t for t, held in ((LOCAL, s in local), (DURABLE, s in durable)) if held)
            for s in sorted(local | durable)
        }

    def merge_entries(self, durable: list[StepInfo]) -> list[StepInfo]:
        """``durable`` (the root's entries) merged with this node's local tier."""
        return restore.merge_entries(self.local.entries(), durable)

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
        save in flight)."""
        self.finish_commit()
        if not blocking:
            self._surface()
        self._make_room(step)
        writer = self._start(step, None)
        if blocking:
            self._commit(step, writer, state_dict, None)
            with self._lock:
                earlier, self._error = self._error, None  # before this step's drain can fail
            if earlier is not None:
                raise earlier
            return None
        try:
            staged = writer.stage(_plain(state_dict))
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
            self._committing = inner
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
        nothing is published late. No room is made first (the drain pass queued after
        the commit prunes): a tier over ``keep_local`` still takes this step."""

        def run() -> None:
            writer = self._start(step, self.group.save_pg)
            self._commit(step, writer, state_dict, self.group.save_pg, deadline)

        future = self._saves.submit(run)
        with self._lock:
            self._committing = future
        return future

    def _start(self, step: int, pg: Any) -> _TierWriter:
        """Choose the base (collective on ``pg``), mark ``step`` as being written and
        return its writer."""
        with self._retain_lock:  # the base chosen is protected before retention can run
            base = self._base_for(step, pg)
            self._begin(step, base)
        try:
            return _TierWriter(
                self.local.fs.url(self.local.step_path(step)),
                transforms=self.manager.transforms,
                filesystem=self.local.fs,
                fingerprint=self.manager.incremental,
                base=None if base is None else self._model(base),
                **self.manager.writer_options,
            )
        except BaseException:
            self._end()
            raise

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

    def _base_for(self, step: int, pg: Any = None) -> int | None:
        """The base of an incremental save of ``step``: the newest step below it that is
        committed in every node's local tier (a reference is resolved in the tier that
        holds the referencing step) and not a symbolic link there (a reference names the
        step that holds the bytes, never a link to it), unless ``full_every`` asks for a
        full save. Collective on ``pg``."""
        if not self.manager.incremental:
            return None
        linked = self.linked()
        views = self.group.all_gather(
            [s for s in self.local.steps() if s < step and s not in linked], pg=pg
        )
        common = set.intersection(*(set(v) for v in views))
        if not common:
            return None
        base = max(common)
        chain = self._model(base).chain
        full_every = self.manager.full_every
        return None if full_every is not None and chain + 1 >= full_every else base

    def pause(self) -> None:
        """Block while a save of this manager writes to the local tier (the drain's
        copy calls this between reads, so the save gets the disk and the cores)."""
        self._idle.wait()

    def _begin(self, step: int, base: int | None) -> None:
        with self.local._lock:  # the local tier's retention and cleanup keep their hands off
            self.local._saving, self.local._saving_base = step, base
        self._idle.clear()  # after _make_room, which may wait for the drain
        persist.worker().foreground(True)  # a drain copying in the worker pauses too

    def _end(self) -> None:
        with self.local._lock:
            self.local._saving, self.local._saving_base = None, None
        self._idle.set()
        persist.worker().foreground(False)

    def _commit(
        self,
        step: int,
        writer: _TierWriter,
        state_dict: dict[str, Any],
        pg: Any,
        deadline: float | None = None,
    ) -> None:
        """Write, replicate and commit ``step`` in the local tier (collective on ``pg``;
        nothing is published if a rank is past ``deadline`` by then), then queue its
        drain."""
        g = self.group
        path = self.local.step_path(step)
        try:
            try:
                api.save_with(writer, state_dict, process_group=pg)
            except OSError as exc:
                full = _full_or(exc, self.local.url)
                if full is exc:
                    raise
                raise full from exc
            payload = g.broadcast(writer.payload, pg=pg)
            assert payload is not None
            # The coordinator wrote it: no need to unpickle what it holds already.
            meta = writer.finished or fmt.load_metadata(payload, self.local.fs.url(path))
            error: BaseException | None = None
            try:
                self._replicate(path, meta, pg)
                if deadline is not None and time.monotonic() > deadline:
                    raise DeadlineExceededError(
                        f"step {step} was not ready to commit in {self.local.url} before "
                        "its deadline; nothing is published"
                    )
            except Exception as exc:
                error = exc
            gather_errors(g, error, f"writing and replicating step {step}", pg=pg)
            if g.leader:
                try:
                    self._publish_local(path, payload, meta)
                except Exception as exc:
                    error = _full_or(exc, self.local.url)
            gather_errors(g, error, f"committing step {step} in the local tier", pg=pg)
        except BaseException:
            writer.abort()
            raise
        finally:
            writer.close()
            self._end()
        with self._lock:
            self._pending.add(step)
            self.last_commit = step
        self._schedule()  # which prunes the local tier first, off the save's path

    def _publish_local(self, path: str, payload: bytes, meta: Metadata) -> None:
        g = self.group
        here = set(g.node) | {r for r in range(g.world) if g.peer.get(r) in g.node}
        infos = list((meta.storage_data or {}).values())
        incremental.check_referenced_files(self.local.fs, path, infos)
        named = {i.relative_path for i in infos if fmt.REF not in fmt.item_extra(i)}
        publish_metadata(
            self.local.fs,
            path,
            self.local.fs.concat_path(path, fmt.METADATA_NAME),
            payload,
            new_files={n for n in named if fmt.file_rank(n) in here},
            overwrite=bool(self.manager.writer_options.get("overwrite", True)),
            sync=bool(self.manager.writer_options.get("sync_files", True)),
        )
        self.local.models.remember(self.local.fs, path, meta)

    def _replicate(self, path: str, meta: Metadata, pg: Any) -> None:
        g = self.group
        if not any(p is not None for p in g.peer.values()):
            return
        infos = (meta.storage_data or {}).values()  # a referenced item's file is the base's
        names = sorted({i.relative_path for i in infos if fmt.REF not in fmt.item_extra(i)})
        moves: list[Move] = []
        for rank, peer in sorted(g.peer.items()):
            if peer is not None and g.node_of(peer) != g.node_of(rank):
                moves.append((rank, peer, [n for n in names if fmt.file_rank(n) == rank]))
        sync = bool(self.manager.writer_options.get("sync_files", True))
        self.replicated_bytes += transfer(g, moves, self.local.fs, path, sync=sync, pg=pg)

    # --- retention --------------------------------------------------------------------

    def _make_room(self, step: int) -> None:
        """Keep at most ``keep_local`` committed steps besides the one being written: the
        oldest go once durable. While some node's tier is over that bound (its drain is
        behind or failing), queue a drain pass and wait for it (the one case where a
        save waits for a drain), then raise :class:`TierFullError` if the tier is still
        over. Collective: every rank takes the same path."""
        if self.keep_local is None:
            return
        self._retain_local(exclude=step)
        if self._fullest(step) is None:
            return
        log.warning(
            "local tier %s holds more than keep_local=%d steps not yet durable; "
            "draining before saving step %d",
            self.local.url,
            self.keep_local,
            step,
        )
        self._schedule()
        self._wait_drains()
        self._retain_local(exclude=step)
        held = self._fullest(step)
        if held is None:
            return
        with self._lock:
            failed, self._error = self._error, None  # reported here, as the cause
        kept = [s for s in held if self._durable_quietly(s)]
        waiting = [s for s in held if s not in kept]
        why = " and ".join(
            ([f"steps {waiting} are not durable yet"] if waiting else [])
            + ([f"steps {kept} are durable but could not be deleted (see the log)"] if kept else [])
        )
        raise TierFullError(
            f"the local tier {self.local.url} holds steps {held}, more than "
            f"keep_local={self.keep_local}: {why} (last drain error: "
            f"{self._last_error or 'none'}); nothing was deleted. Fix the root "
            f"{self.manager.url} and save again, or delete_local() what you can lose"
        ) from failed

    def _durable_quietly(self, step: int) -> bool:
        try:
            return self.durable(step)
        except Exception:  # the root cannot say: not durable as far as we know
            return False

    def _fullest(self, step: int) -> list[int] | None:
        """The committed local steps besides ``step`` of the fullest node's tier, if it
        holds more than ``keep_local`` (collective; node leaders report, after pruning).
        A durable step kept only because a step there references it does not count."""
        mine = self._restorable(exclude=step) if self.group.leader else []
        fullest = max(self.group.all_gather(mine), key=len)
        return fullest if self.keep_local is not None and len(fullest) > self.keep_local else None

    def _restorable(self, exclude: int) -> list[int]:
        linked = self.linked()
        steps = [s for s in self.local.steps() if s != exclude and s not in linked]
        based = {b for s in steps for b in self.references(s)}
        return [s for s in steps if s not in based or not self._durable_quietly(s)]

    def _model(self, step: int) -> CommittedCheckpoint:
        """The read model of local ``step`` (read once while unchanged)."""
        return self.local.models.open(self.local.fs, self.local.step_path(step))

    def references(self, step: int) -> set[int]:
        """The local steps whose bytes local ``step`` references (incremental saves), as
        far as its metadata can be read (deleting a local step is refused while one
        beside it cannot be read: ``committed.Siblings``)."""
        names = self._model(step).references()
        return {b for b in map(parse_step, names) if b is not None}

    def _retain_local(self, exclude: int | None = None) -> None:
        """Delete the oldest local steps beyond ``keep_local``, only those that are
        durable, not waiting for a drain, not the base of the save in flight, not
        referenced by a step kept here and not linked (:meth:`linked`: they are not
        counted either). Node leaders only; never raises: a step that cannot be deleted
        is logged and kept."""
        if self.keep_local is None or not self.group.leader:
            return
        with self._retain_lock:
            try:
                steps = self.local.steps()
                with self.local._lock:
                    writing = {self.local._saving, exclude}
                    held = (self.local._saving, self.local._saving_base, exclude)
                busy = {s for s in held if s is not None}
                with self._lock:
                    pending = set(self._pending)
                skip = writing | self.linked()
                ordered = [s for s in steps if s not in skip]
                keep = set(ordered[-self.keep_local :]) | busy | pending
                for s in ordered:
                    if s not in keep and not self.durable(s):
                        log.info("local step %d is not durable yet: kept", s)
                        keep.add(s)
                frontier = sorted(keep)
                while frontier:  # bases of bases: references are one hop, but be sure
                    for b in self.references(frontier.pop()):
                        if b not in keep:
                            keep.add(b)
                            frontier.append(b)
                for s in reversed([s for s in ordered if s not in keep]):  # users first
                    try:
                        self.local.delete(s)
                    except CheckpointInUseError as exc:
                        log.info("local step %d kept: %s", s, exc)
                    except Exception as exc:  # the next one may still go
                        log.warning("local step %d could not be deleted: %s", s, exc)
            except Exception as exc:
                log.warning("local retention under %s failed: %s", self.local.url, exc)

    def delete_local(self, step: int) -> None:
        """Delete the local copy of ``step`` now, durable or not (the user's call)."""
        with self._lock:
            self._pending.discard(step)
        self.local.delete(step)

    # --- drain ------------------------------------------------------------------------

    def wait(self) -> None:
        """Wait for the local commit of an asynchronous save in flight, then until every
        queued drain has finished; raise the error of a drain that failed."""
        self.finish_commit()
        self._wait_drains()
        self._surface()

    def _wait_drains(self) -> None:
        with self._lock:
            last = self._last
        if last is not None:
            concurrent.futures.wait([last])

    def _surface(self) -> None:
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            raise error

    def _schedule(self) -> None:
        # One pass per save (and one at start) on every rank: their collectives pair up.
        with self._lock:
            self._last = self._drains.submit(self._drain_pass)

    def _drain_pass(self) -> None:
        g = self.group
        self._retain_local()
        try:
            while True:
                with self._lock:
                    mine = set(self._pending)
                linked = self.linked()
                mine |= {s for s in self.local.steps() if s not in linked and not self.durable(s)}
                views = g.all_gather(sorted(mine), pg=g.drain_pg)
                common = sorted(set.intersection(*(set(v) for v in views)))
                if not common:
                    return
                drain_step(self, common[0])
                self._last_error = None
                with self._lock:
                    self._pending.discard(common[0])
                self.manager._retain_quietly(common[0])
                self._retain_local()
        except Exception as exc:
            log.error(
                "draining %s to %s failed (it stays local): %s",
                self.local.url,
                self.manager.url,
                exc,
            )
            with self._lock:
                self._error, self._last_error = exc, _text(exc)

    # --- load (storage/ops/restore.py) -------------------------------------------------

    def load(self, state_dict: dict[str, Any], step: int | None = None) -> LoadedStep:
        """Load ``step`` (default: the newest committed in any tier) from the nearest
        tier that holds it; see :func:`storage.ops.restore.load`."""
        return restore.load(self, state_dict, step)


def _plain(state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` with its ``Stateful`` values replaced by their state dicts, as
    ``dcp.async_save`` does before staging."""
    return {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state_dict.items()}


def _text(error: BaseException | None) -> str | None:
    return None if error is None else f"{type(error).__name__}: {error}"


def _full_or(exc: BaseException, url: str) -> BaseException:
    if (
        isinstance(exc, OSError)
        and exc.errno == errno.ENOSPC
        and not isinstance(exc, TierFullError)
    ):
        return TierFullError(
            f"the local tier {url} is full (ENOSPC: {exc}); nothing committed there was "
            "deleted. Free space, lower keep_local or point local= at a larger device"
        )
    return exc
