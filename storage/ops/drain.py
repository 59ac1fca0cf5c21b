"""The drain: each step committed in a local tier copied to the durable root.

:class:`Drains` runs the passes of one local tier, one at a time in a thread of their
own: each drains every step saved here or committed locally and not durable, oldest
first, then prunes (the root's retention after each step, the local tier's after the
pass). :func:`drain_step` copies one step: each rank copies its own data files from its
node's tier (items keep their stored bytes; references to a base stay references where
the root holds that base, see :func:`storage.ops.copy_data.copy_data_files`), pausing while a
save of the same manager writes locally; a step whose root directory is a symbolic link
is never drained (through the link), and the pass fails with that after draining the
others. Rank 0 publishes the root's metadata once every
rank reports its files there, or removes them all when any rank failed, so the durable
copy exists only whole.

Whether a step is durable, once drained, is :mod:`storage.ops.drain_root`'s to judge (the
root's ``.metadata`` read back); a local step saved again or removed while its drain
reads it is :mod:`storage.ops.drain_source`'s (the drain starts again on the new save,
or leaves the removed step, and reports neither as a failure).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import uuid
from collections.abc import Callable

from extensions.errors import CheckpointNotFoundError
from storage.checkpoint import persist
from storage.checkpoint.attempt import SaveAttempt
from storage.checkpoint.commit import NotShownError
from storage.checkpoint.options import WriterSettings
from storage.checkpoint.persist import _stuck
from storage.ops._peers import Group
from storage.ops.copy import publish_copy
from storage.ops.copy_data import copy_data_files, stored_bytes
from storage.ops.drain_root import Published, RootCopies
from storage.ops.drain_source import SourceChanged, changed, save_of
from storage.ops.parts import read_metadata
from storage.ops.steps import StepRoot

log = logging.getLogger("storage.ops.tiers")  # one logger for everything tiers say


class Drains:
    """The drain passes of one local tier (see the module docstring).

    ``settings``: the manager's writer settings (``overwrite``, ``thread_count``,
    ``persist``, ``max_bandwidth``; ``timeout`` bounds a step's copy in the worker);
    ``pace``: called before each read of the copy (it blocks while a save writes);
    ``prune``: the local tier's retention, run before and after each pass;
    ``on_durable(step)``: once ``step`` is durable (the root's retention). A failed
    pass keeps its error for :meth:`take_error` / :meth:`raise_error`; the next pass
    retries every step not durable yet. Passes are collective on ``group.drain_pg``:
    every rank queues the same passes (one per save, one at start, one per load)."""

    def __init__(
        self,
        group: Group,
        local: StepRoot,
        root: StepRoot,
        *,
        settings: WriterSettings,
        pace: Callable[[], None],
        prune: Callable[[], None],
        on_durable: Callable[[int], None],
    ) -> None:
        self.group, self.local, self.root = group, local, root
        self.settings = settings
        self.pace, self.prune, self.on_durable = pace, prune, on_durable
        self.last_error: str | None = None  # kept after it is taken, for messages
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a step drained, a pass ended
        self._drained: set[int] = set()  # made durable by a pass here
        self._queued = self._finished = 0  # passes
        self._pending: set[int] = set()  # saved here, not drained yet
        self._current: int | None = None  # the step a pass drains now
        self.copies = RootCopies(local, root)  # what the root holds of each step
        self._error: BaseException | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dcp-drain")
        self._last: concurrent.futures.Future[None] | None = None

    def pending(self) -> set[int]:
        """Steps saved here whose drain has not landed yet."""
        with self._lock:
            return set(self._pending)

    def add(self, step: int) -> None:
        """``step`` was committed locally by this manager: drain it (again, where an
        earlier save of it was drained: the root's copy is then ``stale``)."""
        with self._lock:  # under it: a pass that lands the step sees this save
            self._pending.add(step)
            self._drained.discard(step)  # its new save is not
            self.copies.saved(step)

    def discard(self, step: int) -> None:
        with self._lock:
            self._pending.discard(step)

    def durable(self, step: int) -> bool:
        """Whether the root holds this tier's copy of ``step`` (``RootCopies.durable``)."""
        return self.copies.durable(step)

    def schedule(self) -> None:
        """Queue a pass (every rank queues the same ones: their collectives pair up)."""
        with self._lock:
            self._queued += 1
            self._last = self._pool.submit(self._pass)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every queued pass has finished, at most ``timeout`` seconds;
        returns whether they have."""
        with self._lock:
            last = self._last
        return last is None or bool(concurrent.futures.wait([last], timeout).done)

    def draining(self) -> int | None:
        """The step a pass drains now, else the oldest saved here and not drained."""
        with self._lock:
            return self._current if self._current is not None else min(self._pending, default=None)

    def wait_durable(self, steps: set[int]) -> None:
        """Wait until every one of ``steps`` is drained, or every queued pass has
        finished (one failed, or left a step local): a save that needs room waits for
        the oldest steps only, not for the steps queued after them."""
        with self._changed:
            self._changed.wait_for(lambda: steps <= self._drained or self._finished == self._queued)

    def take_error(self) -> BaseException | None:
        """The error of a pass that failed since the last call (then forgotten)."""
        with self._lock:
            error, self._error = self._error, None
        return error

    def raise_error(self) -> None:
        """Raise :meth:`take_error`'s error, if any."""
        error = self.take_error()
        if error is not None:
            raise error

    def _pass(self) -> None:
        g = self.group
        self.prune()
        refused: set[int] = set()  # linked at the root: never drained through the link
        landed: set[int] = set()  # drained by this pass (or removed): never again in it
        gone: Exception | None = None  # a step removed while it drained, not by delete_local
        try:
            while True:
                mine = self.pending()
                linked = set(self.local.linked_steps())
                held = {s for s in self.local.steps() if s not in linked}
                refused |= {s for s in mine | held if self.root.is_link(s)}
                # A step the root shows another .metadata for stays local: draining it
                # again would replace a checkpoint that may not be ours (and a store
                # that answers stale bytes serves them again), see root_copy.
                again = ("missing", "stale")
                mine |= {s for s in held - refused - mine if self.copies.root_copy(s) in again}
                views = g.all_gather(sorted(mine - refused - landed), pg=g.drain_pg)
                common = sorted(set.intersection(*(set(v) for v in views)))
                if not common:
                    break
                step = common[0]
                with self._lock:
                    self._current = step
                    commit = self.copies.current(step)  # the local save it starts on
                try:
                    published = drain_step(
                        g, self.local, self.root, step, settings=self.settings, pace=self.pace
                    )
                except SourceChanged as exc:  # on every rank alike: saved again or removed
                    lost = self._source_changed(exc)
                    gone = gone or lost
                    if exc.removed:
                        landed.add(step)  # nothing left to drain
                    continue  # saved again: still pending, drained again now
                with self._changed:  # add() takes the lock: a save of it now is seen here
                    newest = self.copies.published(step, published, commit)
                    self._current = None
                    if newest:
                        self._pending.discard(step)
                        self._drained.add(step)
                    self._changed.notify_all()
                if not newest:  # saved again while its copy was published: again, now
                    log.info("step %d was saved again while it drained: draining it again", step)
                    continue
                self.last_error = None
                landed.add(step)
                if self.copies.root_copy(step) == "missing":
                    # Else the pass would drain it again, and again: a store that lost
                    # or hides the metadata it acknowledged (a cached 404) re-uploaded
                    # the whole step for ever, and no later pass ran.
                    log.warning(
                        "step %d was published at %s, but the root does not show it "
                        "committed (a store whose reads lag behind its writes, or that "
                        "acknowledged a write it did not keep): it stays local, and the "
                        "next drain pass copies it again if the root still lacks it",
                        step,
                        self.root.step_url(step),
                    )
                self.on_durable(step)
                self.prune()
            for step in sorted(refused):  # the other steps drained; this one stays local
                self.root.refuse_link(step, _stays_local(self.local, step))
            if gone is not None:
                raise gone
        except Exception as exc:
            log.error(
                "draining %s to %s failed (it stays local): %s", self.local.url, self.root.url, exc
            )
            with self._lock:
                self._error, self.last_error = exc, _text(exc)
        finally:
            with self._changed:
                self._current = None
                self._finished += 1
                self._changed.notify_all()

    def _source_changed(self, exc: SourceChanged) -> Exception | None:
        """A step's local copy changed under its drain (:mod:`storage.ops.drain_source`):
        saved again, it stays pending and is drained again; removed by ``delete_local``
        (no longer pending), nothing is left to drain. Removed otherwise, it is no longer
        pending either (nothing can drain it), and the error returned says so."""
        step = exc.step
        with self._lock:
            pending = step in self._pending
            if exc.removed:
                self._pending.discard(step)
        if not exc.removed:
            log.info("step %d: %s; draining its new save", step, exc.why)
            return None
        if not pending:
            log.info("step %d: %s (delete_local): not drained", step, exc.why)
            return None
        return CheckpointNotFoundError(
            f"{self.local.step_url(step)}: {exc.why}, not by delete_local(): step {step} is "
            f"not durable, and no copy of it is left to drain to {self.root.url}; save it "
            "again if it is still wanted"
        )


def drain_step(
    g: Group,
    local: StepRoot,
    root: StepRoot,
    step: int,
    *,
    settings: WriterSettings,
    pace: Callable[[], None],
) -> Published:
    """Copy ``step`` from ``local`` to ``root``; collective (on the drains' group),
    raises on every rank if it failed on any, and commits nothing then (``SourceChanged``
    where the local step was saved again or removed under it on some rank, whatever else
    failed: :mod:`storage.ops.drain_source`); returns what rank 0 published, on every
    rank. Each rank's copy is a ``SaveAttempt`` of its own
    save id: a rank whose copy died with nothing to show (the persist worker killed
    mid-copy, or for not answering by ``settings.timeout`` and a grace) removes what
    that id left there (``SaveAttempt.lost``); rank 0's adopts every rank's files,
    which it publishes or, when any rank failed, removes."""
    fs = root.fs
    src, dst = local.step_path(step), root.step_path(step)
    copied, part, published, read = None, None, None, None
    error: Exception | None = None
    attempt = SaveAttempt(fs, dst, uuid.uuid4().hex[:12])  # this rank's own save id
    try:
        root.refuse_link(step, _stays_local(local, step))  # linked since the pass looked
        parts = read_metadata(local.fs, src, opened=local.model(step))
        if len(parts) != 1:  # the manager saves with collectives: one .metadata
            raise CheckpointNotFoundError(
                f"{local.step_url(step)} is committed by rank-local metadata "
                f"({', '.join(p.name for p in parts)}); only a checkpoint with one "
                ".metadata drains"
            )
        part = parts[0]
        read = save_of(part.metadata)  # the save copied: the step may be saved again
        ranks = None if g.world == 1 else {g.rank}
        copied = persist.run(
            settings.persist_mode(local.fs, fs),
            copy_data_files,
            local.fs,
            src,
            fs,
            dst,
            part,
            ranks=ranks,
            thread_count=settings.thread_count,
            pace=pace,
            keep_references=True,
            save_id=attempt.save_id,
            # Spread to the deadline the save of this step set, if any (storage.ops.pace):
            # the bytes it writes, its bases drained before it (a reference costs none).
            pace_bytes=stored_bytes(part, ranks, references=False),
            pace_for=root.step_url(step),
            kill_after=_stuck.kill_after(settings.timeout),  # bounded as the step's save is
        )
    except _stuck.Unanswered:
        fate = f"Step {step} stays in the local tier {local.url}; the next drain pass copies it"
        url, item = root.step_url(step), f"step {step}"
        doing = f"draining {item} to {url}"
        error = _stuck.stuck(url, settings.timeout, [], item=item, doing=doing, fate=fate)
        attempt.lost()
    except Exception as exc:
        error = exc
        attempt.lost()
    # Still the save that was read, on every rank? Else nothing of this copy is
    # published: the step is drained again, or was removed (drain_source).
    moves = g.all_gather((copied, _text(error), changed(local, step, read)), pg=g.drain_pg)
    moved = next((m for _, _, m in moves if m is not None), None)
    outcome = moved.why if moved else next((t for _, t, _ in moves if t is not None), None)
    if g.rank == 0:
        copies = [c for c, _, _ in moves if c is not None]
        for c in copies:
            attempt.adopt(c.names)
        if outcome is None:
            assert part is not None
            try:
                data = publish_copy(
                    fs, dst, part, copies, overwrite=settings.overwrite, home=attempt.home
                )
                published = Published.of(data, attempt.save_id)
                attempt.landed()
            except NotShownError as exc:  # published; root_copy judges what the root shows
                published = Published.of(exc.payload, attempt.save_id)
                attempt.landed()
            except Exception as exc:
                error, outcome = exc, _text(exc)
    outcome, published = g.broadcast((outcome, published), pg=g.drain_pg)
    if outcome is not None:
        attempt.abort(error)  # unless rank 0's publish may have landed
    if moved is not None:
        raise SourceChanged(step, moved.why, removed=moved.removed)
    if error is not None:
        raise error
    if outcome is not None:
        raise RuntimeError(f"draining step {step} to {root.url} failed: {outcome}")
    log.info("step %d is durable at %s", step, root.step_url(step))
    assert published is not None  # rank 0 published: no outcome
    return published


def _stays_local(local: StepRoot, step: int) -> str:
    """The fix for a step whose root directory is a symbolic link (``StepRoot.refuse_link``)."""
    return (
        f"step {step} stays in the local tier {local.url}, not durable; remove the link at "
        f"the root to let it drain, or delete_local({step}) if it is not wanted"
    )


def _text(error: BaseException | None) -> str | None:
    return None if error is None else f"{type(error).__name__}: {error}"
