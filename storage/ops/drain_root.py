"""What the root holds of a local step, as a local tier's drains judge it.

Durable means more than "the root answers that ``.metadata`` exists": a store (or a
cache in front of it) may say so of an object it lost, or hold another save's object at
that name. Before a step counts as durable (:meth:`RootCopies.durable`, what lets the
local tier prune its copy) the root's ``.metadata`` is read back, bounded, once per
step: it must be the bytes a drain here published (every rank learns their SHA-256 from
rank 0), or, for a step drained before this process started, the copy of the local
step's save (``format.save_of``). Missing, the step is drained again by the next pass;
different, it stays local (one warning says what differs) and the next pass looks again.
A step this manager saved again after its drain read it is ``stale`` at the root until
the new save is drained (:class:`storage.ops.drain_source.LocalSaves`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
from typing import Literal

from extensions.errors import UnsafeCheckpointError
from storage.checkpoint import storage_format as fmt
from storage.checkpoint.committed import read_metadata_bytes
from storage.ops.drain_source import LocalSaves
from storage.ops.steps import StepRoot

log = logging.getLogger("storage.ops.tiers")  # one logger for everything tiers say

#: What the root holds of a local step: ``durable`` (the copy this tier drained there),
#: ``missing`` (no ``.metadata``: drain it), ``stale`` (this tier's copy of an earlier
#: save of the step, saved again here since: drain it again), ``differs`` (another
#: ``.metadata``: keep the local copy), ``linked`` (a symbolic link: never drained, never
#: durable).
RootCopy = Literal["durable", "missing", "stale", "differs", "linked"]


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


class RootCopies:
    """What ``root`` holds of each step of the local tier ``local`` (see the module
    docstring): the copies drains here published, the steps this manager committed
    locally (:meth:`saved`), and which were read back."""

    def __init__(self, local: StepRoot, root: StepRoot) -> None:
        self.local, self.root = local, root
        self._lock = threading.Lock()
        self._published: dict[int, Published] = {}  # by the passes here
        self._verified: set[int] = set()  # the root's .metadata read back and found ours
        self._warned: set[int] = set()  # told once that the root's .metadata differs
        self._saves = LocalSaves()  # which save of a step the root's copy holds

    def saved(self, step: int) -> None:
        """``step`` was committed locally by this manager (again, maybe)."""
        with self._lock:
            self._saves.saved(step)

    def current(self, step: int) -> int:
        """The local commit of ``step`` a drain starting now reads (``LocalSaves``)."""
        with self._lock:
            return self._saves.current(step)

    def published(self, step: int, published: Published, commit: int) -> bool:
        """A drain published ``published`` as ``step``'s root ``.metadata``, a copy of
        local commit ``commit`` (:meth:`current` when it started); returns whether that
        is still the step's newest local save (else the root's copy is ``stale``)."""
        with self._lock:
            self._published[step] = published
            self._verified.discard(step)
            self._warned.discard(step)
            return self._saves.copied(step, commit)

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
            verified, stale = step in self._verified, self._saves.stale(step)
        if stale:
            return "stale"
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
