"""Numbered steps under one root: what a manager's root and a local tier both are.

A :class:`StepRoot` is the ``root/step-{N}`` directories at one location (``N`` a
non-negative integer in canonical decimal: ``step-7``, never ``step-07``): their paths,
which are committed (a step exists once its metadata does: docs/format.md, "Commit
protocol"), which are symbolic links, their read models (``committed.ReadModels``,
each metadata read once while unchanged) and the save in flight there
(:class:`InFlight`). It lists and reads; it deletes nothing (``storage.ops.retention``
does, through it).
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

from extensions.errors import IntegrityError, UnsafeCheckpointError
from storage.backends import LocalFileSystem
from storage.backends.base import FileSystemBase
from storage.checkpoint.committed import CommittedCheckpoint, ReadModels
from storage.checkpoint.incremental import missing_file
from storage.checkpoint.layout import (
    STEP_PREFIX,
    StepInfo,
    directory_info,
    is_committed,
    parse_step,
)
from storage.checkpoint.seal import base_verifies
from storage.checkpoint.siblings import names_under, saw

log = logging.getLogger("storage.ops.manager")

_SAVE_ELSEWHERE = "save under another step, or remove the link itself if it is no longer wanted"


class InFlight:
    """The save in flight at one root: the step being written and the step it
    references (its base, for an incremental save). Retention keeps both and cleanup
    leaves the step alone. The saving side marks them from the moment it chooses the
    base until the save is over (committed or failed): :meth:`writing`, or
    :meth:`begin` and :meth:`end` when the save ends in another thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._step: int | None = None
        self._base: int | None = None

    def begin(self, step: int, base: int | None) -> None:
        with self._lock:
            self._step, self._base = step, base

    def end(self) -> None:
        with self._lock:
            self._step, self._base = None, None

    @contextlib.contextmanager
    def writing(self, step: int, base: int | None) -> Iterator[None]:
        """Mark ``step`` (and ``base``) for the duration of the block."""
        self.begin(step, base)
        try:
            yield
        finally:
            self.end()

    @property
    def step(self) -> int | None:
        """The step being written, if any."""
        with self._lock:
            return self._step

    def held(self) -> set[int]:
        """The step being written and its base: neither may be deleted now."""
        with self._lock:
            return {s for s in (self._step, self._base) if s is not None}


class StepRoot:
    """The ``step-<N>`` directories under ``path`` on ``fs`` (see the module docstring)."""

    def __init__(self, fs: FileSystemBase, path: str) -> None:
        self.fs = fs
        self.path = path
        self.models = ReadModels()
        self.in_flight = InFlight()

    @property
    def url(self) -> str:
        return self.fs.url(self.path)

    def step_path(self, step: int) -> str:
        """The backend path of ``root/step-{step}``."""
        return self.fs.concat_path(self.path, f"{STEP_PREFIX}{check_step(step)}")

    def step_url(self, step: int) -> str:
        return self.fs.url(self.step_path(step))

    def place(self) -> str:
        """Where the steps really are: the URL once links are resolved, ``file://``
        dropped (one directory under every spelling)."""
        return self.fs.url(self.fs.realpath(self.path)).rstrip("/").removeprefix("file://")

    def names(self) -> list[str]:
        """The names under the root (empty when it does not exist): its listing and each
        step this process saw committed here that the listing misses, asked for by name
        (``siblings.names_under``). A listing that lags behind the store or misses
        objects so never hides a step this process knows of: it is still listed, still
        the latest, and what it references is still kept."""
        return names_under(self.fs, self.path)

    def saw(self, step: int) -> None:
        """``step`` is committed here (this process saw it so): :meth:`names`."""
        saw(self.fs, self.step_path(step))

    def step_dirs(self) -> list[tuple[int, str]]:
        """Every ``step-<N>`` name under the root (:meth:`names`), committed or not,
        with its step, ascending (empty when the root does not exist)."""
        return sorted((s, n) for n in self.names() if (s := parse_step(n)) is not None)

    def steps(self) -> list[int]:
        """Committed steps, ascending."""
        steps = [
            step
            for step, name in self.step_dirs()
            if is_committed(self.fs, self.fs.concat_path(self.path, name))
        ]
        for step in steps:
            self.saw(step)
        return steps

    def is_committed(self, step: int) -> bool:
        return is_committed(self.fs, self.step_path(step))

    def is_link(self, step: int) -> bool:
        """Whether ``step``'s directory is a symbolic link (never deleted through)."""
        return self.fs.is_link(self.step_path(step))

    def refuse_link(self, step: int, fix: str = _SAVE_ELSEWHERE) -> None:
        """Raise :class:`UnsafeCheckpointError` if ``step``'s directory is a symbolic
        link: the one check of every path that writes a step it chose by number (a
        manager's save, a local tier's, a preemption save, a drain, a heal's), before it
        writes anything. A linked step is a checkpoint from elsewhere (a shared
        pretrained one as ``step-0``); writing there would replace it, through the link,
        for everyone using it. ``fix``: what the caller can do instead. A path the user
        names itself (``storage.save``, ``cp``, ``export``) is theirs to link."""
        if self.is_link(step):
            raise UnsafeCheckpointError(
                f"{self.step_url(step)} is a symbolic link to a checkpoint elsewhere, which "
                "writing there would replace for everyone using it; nothing was written: "
                f"{fix}"
            )

    def open_to_others(self, *, owner: bool = True) -> str | None:
        """Why this root, on local disk, is open to other users of the host, or ``None``:
        it is writable by every user (even with the sticky bit: they may add a
        ``step-<N>`` of their own), it is not owned by this user nor root (``owner``), its
        path goes through a symbolic link another user may replace (``owner``: made first
        in a shared directory such as /dev/shm, it stays theirs to point elsewhere at
        any time), or a directory above it is writable by every user without the sticky
        bit (they may move the root away and put theirs in its place). Group write is
        allowed (a user's private group, a team's shared disk)."""
        if not isinstance(self.fs, LocalFileSystem) or not hasattr(os, "geteuid"):
            return None
        foreign = _foreign_link(self.path) if owner else None
        if foreign is not None:
            return (
                f"is reached through {foreign[0]!r}, a symbolic link of user id {foreign[1]}'s, "
                "who can point it elsewhere at any time"
            )
        with contextlib.suppress(OSError):  # missing: made by us, with the umask
            info = os.stat(self.path)
            if info.st_mode & stat.S_IWOTH:
                return f"is writable by every user (mode {stat.S_IMODE(info.st_mode):04o})"
            if owner and info.st_uid not in (os.geteuid(), 0):
                return f"belongs to user id {info.st_uid}, not to you"
        above = os.path.dirname(os.path.realpath(self.path))
        while True:
            try:
                mode = os.stat(above).st_mode
            except OSError:
                mode = 0
            if mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
                return (
                    f"lies under {above!r}, which every user can write and which has no "
                    f"sticky bit (mode {stat.S_IMODE(mode):04o})"
                )
            parent = os.path.dirname(above)
            if parent == above:
                return None
            above = parent

    def linked_steps(self) -> list[int]:
        """Steps whose directory is a symbolic link, ascending."""
        return [
            s for s, n in self.step_dirs() if self.fs.is_link(self.fs.concat_path(self.path, n))
        ]

    def entries(self) -> list[StepInfo]:
        """Every ``step-<N>`` directory, committed or not, with size and age."""
        infos = []
        for step, name in self.step_dirs():
            info = directory_info(self.fs, self.fs.concat_path(self.path, name), name, step)
            if info is not None:
                infos.append(info)
        return infos

    def model(self, step: int) -> CommittedCheckpoint:
        """The read model of ``step`` (read once while its metadata files are unchanged)."""
        return self.models.open(self.fs, self.step_path(step))

    def base_problem(self, step: int, transforms: Sequence[Any] = ()) -> str | None:
        """Why ``step`` cannot be the base of an incremental save with ``transforms``
        here, or ``None``: the one rule of the root and of a local tier, whose saves are
        then full ones. A base must not be a symbolic link (a reference names the step
        holding the bytes), its ``.metadata`` must commit it and be readable (rank-local
        metadata never makes a base), every data file its items keep bytes in must be
        there (its own and its own base's), and where the chain seals its metadata, the
        base's seal must not fail (``seal.base_verifies``: an altered base is logged as
        a warning, and the save made in full rather than failed)."""
        if self.is_link(step):
            return "it is a symbolic link"
        checkpoint = self.model(step)
        if not checkpoint.readable:
            return "its metadata cannot be read"
        metadata = checkpoint.global_metadata
        if metadata is None:
            if checkpoint.committing:
                return "it is committed only by rank-local metadata"
            return "it is no longer committed"
        missing = missing_file(self.fs, checkpoint.path, (metadata.storage_data or {}).values())
        if missing is not None:
            return f"{self.fs.url(missing[0])} lacks its file {missing[1]}"
        try:
            base_verifies(metadata, transforms, self.fs.url(checkpoint.path))
        except IntegrityError as exc:
            log.warning("%s", exc)
            return "its metadata's seal does not verify (see the warning before)"
        return None

    def save_id(self, step: int) -> str | None:
        """The save that wrote ``step``'s ``.metadata`` (``None``: unknown)."""
        metadata = self.model(step).global_metadata
        save_id = getattr(getattr(metadata, "storage_meta", None), "save_id", None)
        return save_id if isinstance(save_id, str) else None

    def remember(self, step: int, metadata: Metadata) -> None:
        """``metadata`` was just published as ``step``'s ``.metadata`` by this process."""
        self.models.remember(self.fs, self.step_path(step), metadata)


def _foreign_link(path: str) -> tuple[str, int] | None:
    """The first symbolic link that resolving ``path`` goes through that another user
    (not root) owns and may replace, with its owner; ``None`` when there is none. Its
    owner may replace it where they may remove names from the directory holding it:
    one every user can write (sticky or not: the link is theirs), or one of theirs."""
    pending = os.path.abspath(path).split(os.sep)[1:]
    current, hops = os.sep, 0
    while pending and hops <= 40:  # past that, resolving the path fails anyway
        name = pending.pop(0)
        if name in ("", "."):
            continue
        candidate = os.path.dirname(current) if name == ".." else os.path.join(current, name)
        try:
            info = os.lstat(candidate)
        except OSError:
            return None  # missing from here on: made by us
        if not stat.S_ISLNK(info.st_mode):
            current = candidate
            continue
        try:
            holder = os.stat(current)
            target = os.readlink(candidate)
        except OSError:
            return None  # changing under us: resolving it fails as it would have
        if info.st_uid not in (os.geteuid(), 0) and (
            holder.st_mode & stat.S_IWOTH or holder.st_uid == info.st_uid
        ):
            return candidate, info.st_uid
        hops += 1
        pending = target.split(os.sep) + pending
        if os.path.isabs(target):
            current = os.sep
    return None


def check_step(step: object) -> int:
    """``step`` if it is an int >= 0, else ``ValueError``."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    return step
