"""One save's lifetime, from its plan to its commit or its abort (:class:`SaveAttempt`)."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

from extensions.errors import CheckpointStorageError
from storage.backends.base import FileSystemBase
from storage.checkpoint import heartbeat
from storage.checkpoint.commit import commit_may_have_landed
from storage.checkpoint.deadline import Budget
from storage.checkpoint.deletion import remove_data_files, remove_save


class SaveAttempt:
    """The owner of one save (a writer's save, a copy's or a drain's data files) into
    the checkpoint at ``path`` on ``fs``, named by ``save_id``, under ``budget`` (its
    deadline; ``None``: none). It answers, once for every path that writes checkpoint
    files, who removes what a failed save wrote, and when.

    :meth:`record` notes a file (its name relative to ``path``) before the first byte
    of it goes out, so a save that fails or is killed at any point leaves nothing this
    object does not know of; a name recorded but never created is no error. Files are
    written and removed in :attr:`home` (``path`` resolved once, as the attempt begins),
    never through a directory swapped for a link since. Work done
    in another process reports back with :meth:`adopt` (the names it wrote, the
    deadline it spent). :meth:`landed` says the commit published the metadata;
    :meth:`commit_failed` that it raised, keeping the files when the error says the
    metadata may have landed (``commit.commit_may_have_landed``); :meth:`lost` that the
    process writing for this save died, so what it wrote is known only by its save id.

    :meth:`abort` removes what was recorded unless the commit landed or may have landed
    (by this object's account or by ``error``'s, the verdict of the rank that
    committed): quietly (a failure is logged), never through a symbolic link (a file
    under a linked key-prefix directory stays, ``deletion.remove_data_files``), within
    what is left of the deadline and then in the background, so a stalled store never
    holds the error back. It is idempotent and thread-safe: the first call takes the
    recorded names, later calls find none, and a :meth:`record` after it raises (a
    writing thread that outlived the save opens no new file)."""

    def __init__(
        self, fs: FileSystemBase, path: str, save_id: str, budget: Budget | None = None
    ) -> None:
        self.fs, self.path, self.save_id = fs, path, save_id
        #: ``path`` as resolved once, now (``heartbeat.resolved``: a link the user named
        #: there is followed, none below it): where this save's files are written and
        #: removed, never through a directory swapped for a link since.
        self.home = heartbeat.resolved(fs, path)
        self.budget = budget if budget is not None else Budget(None)
        self._lock = threading.Lock()
        self._names: list[str] = []
        self._landed = False
        self._lost = False
        self._aborted = False

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()  # sent to the persist worker with its writer
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return self.fs.url(self.path)

    @property
    def names(self) -> list[str]:
        """The names recorded so far (relative to ``path``), in order."""
        with self._lock:
            return list(self._names)

    def record(self, name: str) -> str:
        """Note ``name`` (relative to ``path``) as written by this save, before its
        stream opens; returns its backend path. Raises once the save was aborted."""
        with self._lock:
            if self._aborted:
                raise CheckpointStorageError(
                    f"{self.url}: save {self.save_id} was aborted; {name!r} is not written"
                )
            if name not in self._names:
                self._names.append(name)
        return self.fs.concat_path(self.path, name)

    def adopt(self, names: Iterable[str], spent: float | None = None) -> None:
        """What another process wrote for this save (``names``, relative to ``path``)
        and, when given, the deadline budget it ``spent``."""
        with self._lock:
            self._names += [n for n in names if n not in self._names]
        if spent is not None:
            self.budget.spent = spent

    def landed(self) -> None:
        """The commit published this save's metadata: nothing is removed any more."""
        with self._lock:
            self._landed = True

    def commit_failed(self, error: BaseException) -> None:
        """The commit raised ``error``: when it says the metadata may have landed (or a
        publish left running still may), this save's files stay."""
        if commit_may_have_landed(error):
            self.landed()

    def lost(self) -> None:
        """The process writing for this save died: :meth:`abort` also removes what
        carries its save id (``deletion.remove_save``: data files, open uploads,
        heartbeats), whatever it had recorded there."""
        with self._lock:
            self._lost = True

    def abort(self, error: BaseException | None = None) -> None:
        """Remove what this save wrote (see the class docstring)."""
        with self._lock:
            if self._aborted:
                return
            self._aborted = True
            names, self._names = self._names, []
            keep = self._landed or commit_may_have_landed(error)
            lost = self._lost
        if keep or not (names or lost):
            return
        left = self.budget.left()
        if left is None:
            self._remove(names, lost)
            return
        # Storage may be stalled: wait for what is left of the deadline, then go on
        # in the background.
        cleanup = threading.Thread(
            target=self._remove, args=(names, lost), daemon=True, name="dcp-storage-abort"
        )
        cleanup.start()
        cleanup.join(left)

    def _remove(self, names: list[str], lost: bool) -> None:
        remove_data_files(self.fs, self.home, set(names))
        if lost:
            remove_save(self.fs, self.path, self.save_id)
