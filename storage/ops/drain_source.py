"""What a drain reads: a local step that may be saved again or removed while it is read.

A drain copies a step committed in the local tier, whose ``.metadata`` names data files
unique to that save. Saving the same step again (an asynchronous save of step N while
the drain of step N, saved just before, still reads it) commits a new ``.metadata`` and
then removes the files of the save it replaced; ``delete_local`` removes the step whole.
A drain that read the replaced save then finds a data file missing, or copies every
byte of a save that is no longer the step's. Neither is a failure of the drain: the
step's new save is drained next, and a removed step is no longer there to drain.

:func:`changed` tells the two apart from a real failure (a data file missing from a
step that was neither saved again nor removed is reported as before): the drain
(``storage.ops.drain.drain_step``) records the save it read (:func:`save_of`) and asks,
once every rank's copy is over and before anything is published at the root, whether
the local step is still that save; on any rank it is not, every rank raises
:class:`SourceChanged` and nothing of the copy stays at the root. A save that lands
after that look, while the copy is published, is caught by :class:`LocalSaves`: the
drain pass knows the root then holds an earlier save of the step and drains it again.
"""

from __future__ import annotations

import dataclasses

from torch.distributed.checkpoint.metadata import Metadata

from storage.ops.steps import StepRoot


class SourceChanged(Exception):
    """The local step a drain copied was saved again (``removed`` is false) or removed
    from the local tier (``removed``) on some rank while the drain read it; raised on
    every rank, with nothing of the copy left at the root."""

    def __init__(self, step: int, why: str, *, removed: bool) -> None:
        super().__init__(f"step {step}: {why}")
        self.step, self.why, self.removed = step, why, removed


def save_of(metadata: Metadata) -> str | None:
    """The save that wrote a local step's ``.metadata`` (``None``: unknown)."""
    save_id = getattr(getattr(metadata, "storage_meta", None), "save_id", None)
    return save_id if isinstance(save_id, str) else None


@dataclasses.dataclass(frozen=True)
class Change:
    """How a local step changed under its drain: ``why``, for messages; ``removed``:
    no longer committed (else saved again)."""

    why: str
    removed: bool


def changed(local: StepRoot, step: int, read: str | None) -> Change | None:
    """How ``step`` in ``local`` is no longer the save ``read`` that the drain read
    (``None`` where it still is, or where the drain could not read it: then the drain's
    own error stands). A step no longer committed was removed; one committed by another
    save's ``.metadata`` (or by one that cannot be read now) was saved again."""
    try:
        checkpoint = local.model(step)
    except Exception:  # the tier cannot say: whatever the drain met is its error
        return None
    if not checkpoint.committed:
        return Change(f"it was removed from the local tier {local.url} while it drained", True)
    if read is None:
        return None
    metadata = checkpoint.global_metadata
    now = None if metadata is None else save_of(metadata)
    if now == read:
        return None
    why = f"it was saved again while it drained (save {now or 'unknown'} replaced save {read})"
    return Change(why, False)


class LocalSaves:
    """Which save of each local step the root's copy holds, as far as this process
    knows: each local commit of a step by this manager (:meth:`saved`) and the one a
    drain pass here copied to the root (:meth:`copied`). A step saved again after its
    drain read it is :meth:`stale` at the root until a pass drains the new save. Not
    locked: the drains call it under their own lock."""

    def __init__(self) -> None:
        self._saved: dict[int, int] = {}  # local commits of each step by this manager
        self._copied: dict[int, int] = {}  # the commit the root's copy holds (drained here)

    def saved(self, step: int) -> None:
        """``step`` was committed locally again (its new save is the one to drain)."""
        self._saved[step] = self._saved.get(step, 0) + 1

    def current(self, step: int) -> int:
        """The local commit of ``step`` a drain starting now reads (or a later one)."""
        return self._saved.get(step, 0)

    def copied(self, step: int, commit: int) -> bool:
        """A pass published the copy of ``step`` it started at local commit ``commit``;
        returns whether that is still the step's newest local commit (``False``: saved
        again meanwhile, the root's copy is :meth:`stale`)."""
        self._copied[step] = commit
        return commit == self.current(step)

    def stale(self, step: int) -> bool:
        """Whether the root's copy of ``step``, drained here, is of an earlier save
        than the local step's (saved again since its drain read it)."""
        return step in self._copied and self._copied[step] != self.current(step)
