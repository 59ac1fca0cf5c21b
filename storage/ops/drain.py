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
from storage.checkpoint.options import WriterSettings
from storage.ops._peers import Group
from storage.ops.copy import publish_copy
from storage.ops.copy_data import copy_data_files, stored_bytes
from storage.ops.parts import read_metadata
from storage.ops.steps import StepRoot

log = logging.getLogger("storage.ops.tiers")  # one logger for everything tiers say


class Drains:
    """The drain passes of one local tier (see the module docstring).

    ``settings``: the manager's writer settings (``overwrite``, ``thread_count``,
    ``persist``, ``max_bandwidth``);
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
        self._error: BaseException | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dcp-drain")
        self._last: concurrent.futures.Future[None] | None = None

    def pending(self) -> set[int]:
        """Steps saved here whose drain has not landed yet."""
        with self._lock:
            return set(self._pending)

    def add(self, step: int) -> None:
        """``step`` was committed locally by this manager: drain it."""
        with self._lock:
            self._pending.add(step)

    def discard(self, step: int) -> None:
        with self._lock:
            self._pending.discard(step)

    def schedule(self) -> None:
        """Queue a pass (every rank queues the same ones: their collectives pair up)."""
        with self._lock:
            self._queued += 1
            self._last = self._pool.submit(self._pass)

    def wait(self) -> None:
        """Wait until every queued pass has finished."""
        with self._lock:
            last = self._last
        if last is not None:
            concurrent.futures.wait([last])

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
        landed: set[int] = set()  # drained by this pass: never again in it
        try:
            while True:
                mine = self.pending()
                linked = set(self.local.linked_steps())
                held = {s for s in self.local.steps() if s not in linked}
                refused |= {s for s in mine | held if self.root.is_link(s)}
                mine |= {s for s in held if not self.root.is_committed(s)}
                views = g.all_gather(sorted(mine - refused - landed), pg=g.drain_pg)
                common = sorted(set.intersection(*(set(v) for v in views)))
                if not common:
                    break
                drain_step(
                    g,
                    self.local,
                    self.root,
                    common[0],
                    settings=self.settings,
                    pace=self.pace,
                )
                self.last_error = None
                landed.add(common[0])
                if not self.root.is_committed(common[0]):
                    # Else the pass would drain it again, and again: a store that lost
                    # or hides the metadata it acknowledged (a cached 404) re-uploaded
                    # the whole step for ever, and no later pass ran.
                    log.warning(
                        "step %d was published at %s, but the root does not show it "
                        "committed (a store whose reads lag behind its writes, or that "
                        "acknowledged a write it did not keep): it stays local, and the "
                        "next drain pass copies it again if the root still lacks it",
                        common[0],
                        self.root.step_url(common[0]),
                    )
                with self._changed:
                    self._pending.discard(common[0])
                    self._drained.add(common[0])
                    self._changed.notify_all()
                self.on_durable(common[0])
                self.prune()
            for step in sorted(refused):  # the other steps drained; this one stays local
                self.root.refuse_link(step, _stays_local(self.local, step))
        except Exception as exc:
            log.error(
                "draining %s to %s failed (it stays local): %s", self.local.url, self.root.url, exc
            )
            with self._lock:
                self._error, self.last_error = exc, _text(exc)
        finally:
            with self._changed:
                self._finished += 1
                self._changed.notify_all()


def drain_step(
    g: Group,
    local: StepRoot,
    root: StepRoot,
    step: int,
    *,
    settings: WriterSettings,
    pace: Callable[[], None],
) -> None:
    """Copy ``step`` from ``local`` to ``root``; collective (on the drains' group),
    raises on every rank if it failed on any, and commits nothing then. Each rank's
    copy is a ``SaveAttempt`` of its own save id: a rank whose copy died with nothing
    to show (the persist worker killed mid-copy) removes what that id left there
    (``SaveAttempt.lost``); rank 0's adopts every rank's files, which it publishes or,
    when any rank failed, removes."""
    fs = root.fs
    src, dst = local.step_path(step), root.step_path(step)
    copied, error, part = None, None, None
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
        )
    except Exception as exc:
        error = exc
        attempt.lost()
    gathered = g.all_gather((copied, _text(error)), pg=g.drain_pg)
    outcome = next((t for _, t in gathered if t is not None), None)
    if g.rank == 0:
        copies = [c for c, _ in gathered if c is not None]
        for c in copies:
            attempt.adopt(c.names)
        if outcome is None:
            assert part is not None
            try:
                publish_copy(fs, dst, part, copies, overwrite=settings.overwrite)
                attempt.landed()
            except Exception as exc:
                error, outcome = exc, _text(exc)
    outcome = g.broadcast(outcome, pg=g.drain_pg)
    if outcome is not None:
        attempt.abort(error)  # unless rank 0's publish may have landed
    if error is not None:
        raise error
    if outcome is not None:
        raise RuntimeError(f"draining step {step} to {root.url} failed: {outcome}")
    log.info("step %d is durable at %s", step, root.step_url(step))


def _stays_local(local: StepRoot, step: int) -> str:
    """The fix for a step whose root directory is a symbolic link (``StepRoot.refuse_link``)."""
    return (
        f"step {step} stays in the local tier {local.url}, not durable; remove the link at "
        f"the root to let it drain, or delete_local({step}) if it is not wanted"
    )


def _text(error: BaseException | None) -> str | None:
    return None if error is None else f"{type(error).__name__}: {error}"
