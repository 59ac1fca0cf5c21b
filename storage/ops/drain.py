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

Durable means more than "the root answers that ``.metadata`` exists": a store (or a
cache in front of it) may say so of an object it lost, or hold another save's object at
that name. Before a step counts as durable (:meth:`Drains.durable`, what lets the local
tier prune its copy) the root's ``.metadata`` is read back, bounded, once per step: it
must be the bytes the drain published (every rank learns their SHA-256 from rank 0), or,
for a step drained before this process started, the copy of the local step's save
(``format.save_of``). Missing, the step is drained again by the next pass; different,
it stays local (one warning says what differs) and the next pass looks again.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import logging
import threading
import uuid
from collections.abc import Callable
from typing import Literal

from extensions.errors import CheckpointNotFoundError, UnsafeCheckpointError
from storage.checkpoint import persist
from storage.checkpoint import storage_format as fmt
from storage.checkpoint.attempt import SaveAttempt
from storage.checkpoint.commit import NotShownError
from storage.checkpoint.committed import read_metadata_bytes
from storage.checkpoint.options import WriterSettings
from storage.checkpoint.persist import _stuck
from storage.ops._peers import Group
from storage.ops.copy import publish_copy
from storage.ops.copy_data import copy_data_files, stored_bytes
from storage.ops.parts import read_metadata
from storage.ops.steps import StepRoot

log = logging.getLogger("storage.ops.tiers")  # one logger for everything tiers say

#: What the root holds of a local step: ``durable`` (the copy this tier drained there),
#: ``missing`` (no ``.metadata``: drain it), ``differs`` (another ``.metadata``: keep the
#: local copy), ``linked`` (a symbolic link: never drained, never durable).
RootCopy = Literal["durable", "missing", "differs", "linked"]


@dataclasses.dataclass(frozen=True)
class Published:
    """The ``.metadata`` a drain published at the root: its size, SHA-256 and save id."""

    size: int
    sha256: str
    save_id: str

    @classmethod
    def of(cls, data: bytes, save_id: str) -> Published:
        return cls(len(data), hashlib.sha256(data).hexdigest(), save_id)

    def __str__(self) -> str:
        return f"{self.size} bytes, SHA-256 {self.sha256[:16]}..., save {self.save_id}"


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
        self._published: dict[int, Published] = {}  # by the passes here
        self._verified: set[int] = set()  # the root's .metadata read back and found ours
        self._warned: set[int] = set()  # told once that the root's .metadata differs
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

    def durable(self, step: int) -> bool:
        """Whether the root holds this tier's copy of ``step`` committed (see the module
        docstring): what lets the local tier delete its own."""
        return self.root_copy(step) == "durable"

    def root_copy(self, step: int) -> RootCopy:
        """What the root holds of ``step`` (:data:`RootCopy`). Its ``.metadata`` is read
        (bounded) until it is found to be this tier's copy, then only looked for; a
        different one is warned about once per step. Raises what reading the root
        raises (the root cannot say)."""
        if self.root.is_link(step):
            return "linked"
        with self._lock:
            verified = step in self._verified
        if verified:
            return "durable" if self.root.is_committed(step) else "missing"
        path = self.root.fs.concat_path(self.root.step_path(step), fmt.METADATA_NAME)
        try:
            data = read_metadata_bytes(self.root.fs, path)
        except (FileNotFoundError, NotADirectoryError):
            return "missing"
        except UnsafeCheckpointError as exc:  # past the bound: not what we published
            why: str | None = str(exc)
        else:
            why = self._differs(step, data)
        if why is None:
            with self._lock:
                self._verified.add(step)
            return "durable"
        with self._lock:
            warn = step not in self._warned
            self._warned.add(step)
        if warn:
            log.warning(
                "step %d at %s: the root's %s is not the copy this tier drained there (%s); "
                "the local copy is kept, and each drain pass looks again",
                step,
                self.root.step_url(step),
                fmt.METADATA_NAME,
                why,
            )
        return "differs"

    def _differs(self, step: int, data: bytes) -> str | None:
        """How ``data``, the root's ``.metadata`` of ``step``, differs from this tier's
        copy (``None``: it is that copy): the bytes a pass here published, else (drained
        before this process started) a copy of the local step's save."""
        with self._lock:
            ours = self._published.get(step)
        if ours is not None and Published.of(data, ours.save_id) == ours:
            return None
        try:
            theirs = fmt.load_metadata(data, self.root.step_url(step))
        except Exception as exc:  # unreadable: it differs, and says why
            save_id, origin = f"unreadable ({exc})", None
        else:
            save_id = str(getattr(getattr(theirs, "storage_meta", None), "save_id", None))
            origin = fmt.save_of(theirs)
        if ours is not None:
            return f"it holds {Published.of(data, save_id)}, the drain published {ours}"
        local = self.local.model(step).global_metadata
        mine = None if local is None else fmt.save_of(local)
        if mine is not None and origin == mine:
            return None
        return f"it holds a copy of save {origin}, the local step is save {mine}"

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
        landed: set[int] = set()  # drained by this pass: never again in it
        try:
            while True:
                mine = self.pending()
                linked = set(self.local.linked_steps())
                held = {s for s in self.local.steps() if s not in linked}
                refused |= {s for s in mine | held if self.root.is_link(s)}
                # A step the root shows another .metadata for stays local: draining it
                # again would replace a checkpoint that may not be ours (and a store
                # that answers stale bytes serves them again), see root_copy.
                mine |= {s for s in held - refused - mine if self.root_copy(s) == "missing"}
                views = g.all_gather(sorted(mine - refused - landed), pg=g.drain_pg)
                common = sorted(set.intersection(*(set(v) for v in views)))
                if not common:
                    break
                with self._lock:
                    self._current = common[0]
                published = drain_step(
                    g,
                    self.local,
                    self.root,
                    common[0],
                    settings=self.settings,
                    pace=self.pace,
                )
                with self._lock:
                    self._published[common[0]] = published
                    self._verified.discard(common[0])
                    self._warned.discard(common[0])
                self.last_error = None
                landed.add(common[0])
                if self.root_copy(common[0]) == "missing":
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
                    self._current = None
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
                self._current = None
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
) -> Published:
    """Copy ``step`` from ``local`` to ``root``; collective (on the drains' group),
    raises on every rank if it failed on any, and commits nothing then; returns what
    rank 0 published, on every rank. Each rank's copy is a ``SaveAttempt`` of its own
    save id: a rank whose copy died with nothing to show (the persist worker killed
    mid-copy, or for not answering by ``settings.timeout`` and a grace) removes what
    that id left there (``SaveAttempt.lost``); rank 0's adopts every rank's files,
    which it publishes or, when any rank failed, removes."""
    fs = root.fs
    src, dst = local.step_path(step), root.step_path(step)
    copied, part, published = None, None, None
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
    gathered = g.all_gather((copied, _text(error)), pg=g.drain_pg)
    outcome = next((t for _, t in gathered if t is not None), None)
    if g.rank == 0:
        copies = [c for c, _ in gathered if c is not None]
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
