"""Named shared-memory segments: the files in ``/dev/shm`` that stage a checkpoint.

Segments are files in ``/dev/shm`` (the temporary directory where there is none), mode
0600, created with ``O_EXCL``. Their space is reserved (``posix_fallocate``) before a
byte is copied into it, so a full ``/dev/shm`` is an error naming the fix, never a
``SIGBUS`` while copying. The pool that stages into them is :mod:`._pool`.

Names and ownership. A pool (one per training process) is named
``dcp-storage-{uid}-{pid}-{token}``, ``token`` 96 random bits, so no other user can
take its names in advance (a name that is taken anyway is skipped), and its segments
``{pool}-{token}`` with 64 random bits each (anyone may list the directory, so a pool's
name is no secret). The pool holds an ``flock`` on its lock file ``{pool}.lock`` for its
whole life (:class:`_Owner`). The lock, not the pid, says whether the owner lives: a pid
means nothing to a process in another PID namespace that shares ``/dev/shm``
(containers with ``--ipc=host``), and the kernel drops the lock when the last holder
dies, whatever killed it. A child made with ``fork`` shares the lock (its parent's
segments stay while it lives) and never removes them: only the process that made a pool
removes its segments, when the pool is closed or the process exits.

A name is no proof of a file: once something removed a segment or the lock file
(RemoveIPC, a cleaner), anyone may create a file of that name. The pool knows its files
by inode (a replaced segment is made afresh, a file that is not its own never removed)
and the worker maps only this user's regular files.

:func:`sweep` removes the segments of pools whose lock nobody holds: the persist worker
runs it when it sees its training process die (so a ``kill -9`` leaves nothing behind
for long), and every new pool runs it first. It judges only files the calling user owns
and can lock, and it never fails: a file it cannot open, lock or remove (another user's,
a link, one that vanished) is left alone.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import re
import secrets
import stat
import tempfile
import time

import torch

from extensions.errors import CheckpointStorageError

log = logging.getLogger(__name__)

#: A lock file younger than this with no lock held may be a pool being born.
_BIRTH_GRACE = 60.0
#: Tries at an unused pool name before giving up (each collision is 2^-96 by chance).
_NAME_TRIES = 16
#: madvise(2) advice that faults a mapping's pages in, writable (Linux >= 5.14).
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _prefix() -> str:
    return f"dcp-storage-{os.getuid()}-"


#: ``{pid}-{token}`` then ``.lock`` (the pool's lock file) or ``-{token}`` (a segment).
_NAME = re.compile(r"(?P<pool>\d+-[0-9a-f]{24})(?:\.lock|-[0-9a-f]{16})")


def sweep() -> list[str]:
    """Remove the segments (and lock files) of this user's pools whose owner is gone;
    returns the names removed. Never raises for what it finds in the directory."""
    directory = shm_dir()
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    pools: dict[str, list[str]] = {}
    prefix = _prefix()
    for name in names:
        match = _NAME.fullmatch(name[len(prefix) :]) if name.startswith(prefix) else None
        if match is not None:
            pools.setdefault(match["pool"], []).append(name)
    removed: list[str] = []
    for pool, members in pools.items():
        removed += _sweep_pool(directory, f"{prefix}{pool}", members)
    return removed


def _sweep_pool(directory: str, pool: str, members: list[str]) -> list[str]:
    """Remove ``members`` of ``pool`` if no live process holds its lock."""
    lock_name = f"{pool}.lock"
    segments = [m for m in members if m != lock_name]
    try:
        fd = os.open(
            os.path.join(directory, lock_name),
            os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
        )
    except FileNotFoundError:
        fd = None  # segments outlive their lock file only when their owner is gone
    except OSError:
        return []  # another user's, or not a file: not ours to judge
    try:
        if fd is not None:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
                return []
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return []  # held: its owner (or a child it forked) lives
            if not segments and time.time() - info.st_mtime < _BIRTH_GRACE:
                return []  # a pool being made takes its lock right after creating it
            segments.append(lock_name)  # last: a segment never outlives its lock file
        return [name for name in segments if _unlink_own(directory, name)]
    except OSError as exc:
        log.debug("not sweeping staging pool %s: %s", pool, exc)
        return []
    finally:
        if fd is not None:
            os.close(fd)


def remove_pool(pool: str) -> list[str]:
    """Remove the files of ``pool`` (its segments, then its lock file) that this user
    owns, whoever holds its lock: for the persist worker, which knows that its training
    process, the pool's owner, is gone. Returns the names removed; never raises."""
    directory = shm_dir()
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    prefix = _prefix()
    ours = [
        name
        for name in names
        if name.startswith(pool)
        and (match := _NAME.fullmatch(name[len(prefix) :])) is not None
        and f"{prefix}{match['pool']}" == pool
    ]
    ours.sort(key=lambda name: name.endswith(".lock"))  # the lock file last
    return [name for name in ours if _unlink_own(directory, name)]


def _unlink_own(directory: str, name: str) -> bool:
    """Remove ``directory/name`` if it is a regular file this user owns."""
    path = os.path.join(directory, name)
    try:
        info = os.lstat(path)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            return False
        os.unlink(path)
    except OSError:
        return False
    return True


def map_segment(name: str, identity: tuple[int, int]) -> mmap.mmap:
    """Map the segment ``name`` read-write (the persist worker's side), checking that
    it is still the file the training process staged into: ``identity``, its inode and
    size there. A file of that name that is not this user's, another file, or a
    shorter one (read past its end, a mapping is a SIGBUS; short of a page, zeros) is
    refused: the segment was removed (RemoveIPC, a cleaner) and its name taken, or
    something truncated it."""
    path = os.path.join(shm_dir(), name)
    try:
        # O_NONBLOCK: a FIFO under the name never blocks the open (fstat refuses it below).
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:  # gone, or a link in its place (O_NOFOLLOW), or not ours
        raise CheckpointStorageError(
            f"cannot open staging segment {path} ({exc.strerror}): something removed it "
            "after the stage (RemoveIPC at logout, a cleaner of /dev/shm), or put another "
            "file in its place; this save fails, the next one stages afresh"
        ) from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            raise CheckpointStorageError(
                f"{path} is not a staging segment of this user (owner uid {info.st_uid}): "
                "the segment was removed and something else now has its name; this save "
                "fails, the next one stages afresh"
            )
        if info.st_ino != identity[0]:
            raise CheckpointStorageError(
                f"{path} is not the staging segment this save staged into: the segment "
                "was removed (RemoveIPC, a cleaner of /dev/shm) and another file of this "
                "user took its name; this save fails, the next one stages afresh"
            )
        check_size(path, info.st_size, identity[1])
        return mmap.mmap(fd, identity[1])
    finally:
        os.close(fd)


def check_mapped(name: str, identity: tuple[int, int]) -> None:
    """Raise if the segment ``name``, mapped earlier as ``identity`` (inode, size), was
    truncated since: reading the mapping past the file's new end would kill the worker
    with SIGBUS, or read zeros. A segment whose name is gone, or holds another file,
    is left to its mapping, which still holds the staged pages."""
    path = os.path.join(shm_dir(), name)
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if info.st_ino == identity[0]:
        check_size(path, info.st_size, identity[1])


def check_size(path: str, size: int, staged: int) -> None:
    if size < staged:
        raise CheckpointStorageError(
            f"staging segment {path} was truncated to {size} bytes after {staged} were "
            "staged into it (something else of this user writes to "
            f"{shm_dir()}: a cleaner?); this save fails, the next one stages afresh"
        )


def _create_unique(stem: str, random_bytes: int, suffix: str = "") -> tuple[str, int]:
    """Create ``{stem}{random hex}{suffix}`` (0600, never an existing file or link);
    returns the name without ``suffix`` and the open descriptor. A name that is taken
    (by chance, or by someone who listed the directory) is skipped for another."""
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(_NAME_TRIES):
        name = f"{stem}{secrets.token_hex(random_bytes)}"
        try:
            return name, os.open(os.path.join(shm_dir(), name + suffix), flags, 0o600)
        except FileExistsError:
            continue
    raise CheckpointStorageError(
        f"cannot create a staging file in {shm_dir()}: {_NAME_TRIES} random names were "
        "all taken; check who writes there, or save with persist='thread'"
    )


class _Owner:
    """A pool's name and the lock that says its owner lives (see the module docstring)."""

    def __init__(self) -> None:
        name, fd = _create_unique(f"{_prefix()}{os.getpid()}-", 12, ".lock")
        fcntl.flock(fd, fcntl.LOCK_SH)  # held until the last process holding fd is gone
        self.fd = fd
        self.name = name
        self.pid = os.getpid()

    def relock(self) -> None:
        """Make the lock file again, held, after something else removed it (the owning
        process only): without it another pool's sweep takes this pool for a dead one.
        Made under a random name no sweep reads (a fixed one, anyone who listed the
        directory could take first: the lock file would never come back), locked, then
        linked into place, so no sweep ever sees it unlocked."""
        if os.getpid() != self.pid or self.fd < 0:
            return
        path = os.path.join(shm_dir(), f"{self.name}.lock")
        try:
            name, fd = _create_unique(f"{self.name}.lock.", 8, ".new")
        except (OSError, CheckpointStorageError):
            return
        new = os.path.join(shm_dir(), f"{name}.new")
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            os.link(new, path)
        except OSError:
            os.close(fd)
            return
        finally:
            with contextlib.suppress(OSError):
                os.unlink(new)
        old, self.fd = self.fd, fd
        os.close(old)

    def close(self) -> None:
        """Remove the lock file (the owning process only) and close this process's hold
        on the lock; once for each process."""
        fd, self.fd = self.fd, -1
        if fd < 0:
            return
        if os.getpid() == self.pid:
            with contextlib.suppress(OSError):
                path = os.path.join(shm_dir(), f"{self.name}.lock")
                held, named = os.fstat(fd), os.lstat(path)
                # Never a file that took the name after something else removed the lock
                # file (another user's, say).
                if (held.st_dev, held.st_ino) == (named.st_dev, named.st_ino):
                    os.unlink(path)
        with contextlib.suppress(OSError):
            os.close(fd)


class _Segment:
    """One named segment holding one staged storage; its space is reserved by
    :meth:`reserve` (all of it, or piece by piece) before anything is written to it."""

    def __init__(self, owner: _Owner, size: int) -> None:
        name, fd = _create_unique(f"{owner.name}-", 8)
        path = os.path.join(shm_dir(), name)
        try:
            info = os.fstat(fd)
            #: The file this segment is: a file of its name that is another is not it.
            self.identity = (info.st_dev, info.st_ino)
            os.ftruncate(fd, size)
            self.map = mmap.mmap(fd, size)
        except OSError as exc:
            os.unlink(path)
            raise _no_room(size, exc) from exc
        finally:
            os.close(fd)
        self.name = name
        self.path = path
        self.reserved = False  # every page's space: set once all of it is reserved
        self.storage = torch.frombuffer(self.map, dtype=torch.uint8).untyped_storage()
        self.address = self.storage.data_ptr()

    def reserve(self, offset: int = 0, length: int | None = None) -> None:
        """Reserve the pages of bytes ``[offset, offset + length)`` (to the end when
        ``length`` is None); raises naming the fix when ``/dev/shm`` is full. The file
        is opened for the call: a stage of thousands of new segments holds no
        descriptor per segment."""
        size = len(self.map)
        length = size - offset if length is None else length
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise self._replaced() from exc
        try:
            info = os.fstat(fd)
            if (info.st_dev, info.st_ino) != self.identity:
                raise self._replaced()
            os.posix_fallocate(fd, offset, length)
        except OSError as exc:
            raise _no_room(size, exc) from exc
        finally:
            os.close(fd)

    def _replaced(self) -> CheckpointStorageError:
        return CheckpointStorageError(
            f"staging segment {self.path} was removed from under this process (RemoveIPC, "
            "a cleaner of /dev/shm); this save fails, the next one stages afresh"
        )

    def is_at(self, found: tuple[int, int] | None) -> bool:
        """Whether the file its name holds now in :func:`shm_dir` (``found``: its inode
        and size; ``None``: none) is this segment, whole. A truncated one is not: a copy
        into its mapping past the file's end kills this process with SIGBUS."""
        return found is not None and found[0] == self.identity[1] and found[1] >= len(self.map)

    @property
    def shared(self) -> tuple[int, int]:
        """What the worker checks the file it maps by :attr:`name` against: its inode
        and size (:func:`map_segment`)."""
        return self.identity[1], len(self.map)

    def touch(self) -> None:
        """Fault every page into this process's mapping now, so that the first copy
        into the segment runs at the speed of a copy into warm memory."""
        try:
            self.map.madvise(_MADV_POPULATE_WRITE)
        except (AttributeError, OSError, ValueError):  # before Linux 5.14: write them
            torch.frombuffer(self.map, dtype=torch.uint8).zero_()

    def unlink(self) -> None:
        """Remove the file, if its name still holds this segment (never a file that
        took its name after something else removed it: another user's, say)."""
        with contextlib.suppress(OSError):
            info = os.lstat(self.path)
            if (info.st_dev, info.st_ino) == self.identity:
                os.unlink(self.path)


class SharedMemoryFull(CheckpointStorageError):
    """``/dev/shm`` has no room for a staging segment (a small one, docker's 64 MB by
    default, or one that something else filled)."""


def _no_room(size: int, exc: OSError) -> SharedMemoryFull:
    return SharedMemoryFull(
        f"cannot reserve {size} bytes of shared memory in {shm_dir()} for staging "
        f"a checkpoint ({exc}); give it more room (docker: --shm-size) or save with "
        "persist='thread'"
    )
