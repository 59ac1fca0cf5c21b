"""The checkpoints beside one: who references a checkpoint's bytes, for the paths that
delete or overwrite it (retention, ``rm``, a save over it). Each sibling is read through
the one read model (``committed``); :class:`Siblings` holds them for one pass, each opened
at most once, and refuses a deletion that would break one of them.

Which checkpoints lie beside one is :func:`names_under`: the parent's listing, the
checkpoints this process saw committed there (:func:`saw`: it published their metadata,
or a listing showed them committed) that the listing misses, asked for by name, and the
newest step the parent's latest-step pointer names (``latest``: a fresh process learns
the newest step so). A listing that lags behind the store or misses objects so hides no
checkpoint this process knows of, nor the newest step, from a deletion, an overwrite,
retention or a manager's steps. Another one this process never saw (another process
saved it, and no listing here showed it yet) it cannot know.
"""

from __future__ import annotations

import threading

from extensions.errors import CheckpointInUseError, printable
from storage.backends.base import FileSystemBase
from storage.checkpoint.committed import (
    CommittedCheckpoint,
    ReadModels,
    metadata_stamp,
    open_committed,
)
from storage.checkpoint.latest import unlisted as pointed_unlisted
from storage.checkpoint.layout import is_committed, split_location

_lock = threading.Lock()
_seen: dict[str, set[str]] = {}  # parent URL -> checkpoints this process saw committed


def _key(fs: FileSystemBase, parent: str) -> str:
    return fs.url(parent.rstrip("/") or parent)


def saw(fs: FileSystemBase, path: str) -> None:
    """The checkpoint at ``path`` is committed (this process published its metadata, or
    saw it committed): :func:`names_under` lists it from now on, while it stays so."""
    location = split_location(fs, path)
    if location is not None:
        with _lock:
            _seen.setdefault(_key(fs, location[0]), set()).add(location[1])


def forget(fs: FileSystemBase, path: str) -> None:
    """The checkpoint at ``path`` was deleted: :func:`names_under` no longer asks for it."""
    location = split_location(fs, path)
    if location is not None:
        with _lock:
            _seen.get(_key(fs, location[0]), set()).discard(location[1])


def names_under(fs: FileSystemBase, parent: str) -> list[str]:
    """The names under ``parent`` (empty when it does not exist): its listing, each
    checkpoint this process saw committed there (:func:`saw`) that the listing misses
    but that is still committed, asked for by name (those no longer committed are
    forgotten), and the step the parent's latest-step pointer names when the listing
    misses it and it is committed (``latest.unlisted``). Errors of the listing other
    than a missing directory propagate."""
    try:
        names = list(fs.ls(parent))
    except FileNotFoundError:
        names = []  # a listing that lags may not show the directory yet
    except NotADirectoryError:
        return []
    with _lock:
        unlisted = sorted(_seen.get(_key(fs, parent), set()) - set(names))
    for name in unlisted:
        path = fs.concat_path(parent, name)
        if is_committed(fs, path):
            names.append(name)
        else:
            forget(fs, path)
    pointed = pointed_unlisted(fs, parent, names)
    if pointed is not None:
        names.append(pointed)
    return names


class Siblings:
    """The checkpoints under ``parent`` (:func:`names_under`), each opened at most once:
    one pass of a path that deletes (retention, a refusal to delete or overwrite). What
    it read may change meanwhile; a save whose base is removed meanwhile fails before it
    commits (``incremental.check_referenced_files``). ``models``: the manager's read
    models, which serve what they hold."""

    def __init__(self, fs: FileSystemBase, parent: str, models: ReadModels | None = None) -> None:
        self.fs = fs
        self.parent = parent
        self._models = models
        self._names: list[str] | None = None
        self._opened: dict[str, CommittedCheckpoint] = {}

    def names(self) -> list[str]:
        """The names under the parent (listed once)."""
        if self._names is None:
            self._names = names_under(self.fs, self.parent)
        return self._names

    def open(self, name: str) -> CommittedCheckpoint:
        if name not in self._opened:
            path = self.fs.concat_path(self.parent, name)
            opened = (
                open_committed(self.fs, path)
                if self._models is None
                else self._models.open(self.fs, path)
            )
            self._opened[name] = opened
        return self._opened[name]

    def forget(self, name: str) -> None:
        """``name`` was deleted: it references nothing any more."""
        forget(self.fs, self.fs.concat_path(self.parent, name))
        self._opened.pop(name, None)
        if self._models is not None:
            self._models.forget(self.fs.concat_path(self.parent, name))
        if self._names is not None and name in self._names:
            self._names.remove(name)

    def recheck_users(self, name: str, action: str = "delete") -> None:
        """:meth:`refuse_if_referenced` again, once ``name``'s metadata is moved aside
        (``deletion.delete_checkpoint``): listed anew, what this pass saw uncommitted or
        did not see is opened afresh, and so is any checkpoint whose metadata files
        changed where the backend tells that without a request (``FileSystemBase.stamps``);
        the others are as this pass read them, so a pass still reads each at most once."""
        seen = self.names()
        self._names = None
        for other in self.names():
            held = self._opened.get(other)
            if other == name or held is None:
                continue
            path = self.fs.concat_path(self.parent, other)
            if other not in seen or not held.committed or metadata_stamp(self.fs, path) is not None:
                del self._opened[other]  # a save there may have committed since
        self.refuse_if_referenced(name, action)

    def users(self, name: str) -> list[CommittedCheckpoint]:
        """The checkpoints beside ``name`` that reference its bytes or, unreadable,
        might."""
        return [c for s in self.names() if s != name and (c := self.open(s)).may_reference(name)]

    def refuse_if_referenced(self, name: str, action: str = "delete") -> None:
        """Raise :class:`CheckpointInUseError` if checkpoints beside ``name`` reference
        its bytes or cannot be read: removing them could break those checkpoints."""
        users = self.users(name)
        if not users:
            return
        url = self.fs.url(self.fs.concat_path(self.parent, name))
        # Sibling names are whoever wrote the parent's: escaped, or one holding a line
        # break or an escape sequence would reach a terminal through the message.
        known = [printable(c.name) for c in users if c.readable]
        unknown = [c for c in users if not c.readable]
        parts = []
        if known:
            parts.append(
                f"incremental checkpoint(s) {', '.join(known)} beside it reference its bytes. "
                "Delete those first, or make them self-contained with `dcp-storage cp` (a "
                "copy holds every byte it needs)"
            )
        if unknown:
            parts.append(
                f"the metadata of {', '.join(printable(c.name) for c in unknown)} beside it "
                f"cannot be read ({'; '.join(c.why_unreadable() for c in unknown)}), so they may "
                "reference its bytes. Repair or remove those first"
            )
        raise CheckpointInUseError(f"refusing to {action} {url}: {'. Also, '.join(parts)}")


def refuse_if_referenced(fs: FileSystemBase, path: str, action: str = "delete") -> None:
    """:meth:`Siblings.refuse_if_referenced` for the checkpoint at ``path``, beside
    ``path`` and, when links resolve it elsewhere (``other/alias -> run/step-1``),
    beside what it resolves to: the checkpoints that reference its bytes lie beside
    the directory that holds them, not beside the alias."""
    for place in dict.fromkeys((path, fs.realpath(path))):
        location = split_location(fs, place)
        if location is not None:
            Siblings(fs, location[0]).refuse_if_referenced(location[1], action)
