"""Files on local disk opened so that nobody else who can write the directory decides
what a save writes or a load reads: no symbolic link is followed at a checkpoint's own
names, no FIFO blocks, no file of another user's is written into. Every backend that
writes local files goes through here: :class:`~storage.backends._local.LocalFileSystem`,
``FsspecFileSystem`` on ``file://`` and ``TorchFileSystem`` over torch's local or
``file://`` filesystem."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import uuid
from collections.abc import Callable, Iterator
from typing import IO, cast

from extensions.errors import UnsafeCheckpointError, quote
from extensions.streams import SliceView
from storage.backends import _local_walk
from storage.backends._local_walk import is_link_at

# Where the platform lacks a flag, opening without it is the best it offers.
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_READ_FLAGS = (
    os.O_RDONLY
    | getattr(os, "O_NOFOLLOW", 0)
    | _NONBLOCK
    | getattr(os, "O_CLOEXEC", 0)
    | getattr(os, "O_BINARY", 0)
)
_WRITE_FLAGS = (
    os.O_WRONLY
    | os.O_CREAT
    | getattr(os, "O_NOFOLLOW", 0)
    | _NONBLOCK
    | getattr(os, "O_CLOEXEC", 0)
    | getattr(os, "O_BINARY", 0)
)
# New files get 0o666 less the umask, as ``open(path, "wb")`` gives them.
_FILE_MODE = 0o666
_TEMP_TRIES = 8  # random names taken in a row before giving up (48 bits each)


def open_regular(path: str, buffering: int = -1) -> IO[bytes]:
    """``path`` opened for reading, only if it is a regular file and not a symbolic link.

    ``O_NOFOLLOW`` refuses a link in the last component (a checkpoint's files are plain
    names, so that is every link inside the checkpoint; the directories above it may be
    links). ``O_NONBLOCK`` keeps a FIFO from blocking the open; ``fstat`` on what was
    opened then refuses FIFOs, devices, sockets and directories with no race."""
    try:
        fd = os.open(path, _READ_FLAGS)
    except OSError as exc:
        # Linux and macOS say ELOOP for a link under O_NOFOLLOW, FreeBSD EMLINK.
        if exc.errno in (errno.ELOOP, errno.EMLINK) and os.path.islink(path):
            raise UnsafeCheckpointError(
                _refusal(
                    path,
                    f"a symbolic link to {quote(_target(path))}",
                    "If you trust its target, replace the link with a copy of the file: "
                    f'cp --remove-destination "$(readlink -f {path})" {path}',
                )
            ) from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise UnsafeCheckpointError(
                _refusal(
                    path,
                    _kind(mode),
                    "Put the checkpoint's own file back, or re-save the checkpoint.",
                )
            )
        if _NONBLOCK:
            os.set_blocking(fd, True)
        return open(fd, "rb", buffering=buffering, closefd=True)  # noqa: SIM115
    except BaseException:
        os.close(fd)
        raise


@contextlib.contextmanager
def open_slice(path: str, offset: int, length: int) -> Iterator[IO[bytes]]:
    """``[offset, offset + length)`` of ``path``, opened as :func:`open_regular` opens
    it, unbuffered (the view reads what is asked, where it is asked)."""
    with open_regular(path, buffering=0) as stream:
        yield cast(IO[bytes], SliceView(stream, offset, length))


def open_for_writing(
    path: str, *, exclusive: bool = False, dir_fd: int | None = None, shown: str | None = None
) -> IO[bytes]:
    """``path`` opened for writing from its start, never through a symbolic link and only
    into a regular file this call created or one of this user's (``exclusive``: only one
    this call created, else ``FileExistsError``). With ``dir_fd``, ``path`` is a name
    inside that open directory (``shown``: its full path, for messages).

    Whoever else can write the directory (a shared ``/scratch``, a group-writable root)
    could otherwise put, at a name a save is about to write (the next data file of a save
    is named after its first), a link that makes the save overwrite a file of their
    choosing, a FIFO that blocks it forever, or a file of their own that stays theirs to
    rewrite once it holds our checkpoint. ``O_NOFOLLOW`` and ``O_NONBLOCK`` refuse the
    first two at the open; ``fstat`` on what was opened refuses the rest before anything
    is truncated. A file of the directory's owner is accepted too: where the store maps
    users (root on NFS with root squashing) what we write is not owned by us, and whoever
    owns the directory can replace its files anyway."""
    shown = shown or path
    try:
        try:
            flags = _WRITE_FLAGS | os.O_EXCL
            fd, created = os.open(path, flags, _FILE_MODE, dir_fd=dir_fd), True
        except FileExistsError:
            if exclusive:
                raise
            fd, created = os.open(path, _WRITE_FLAGS & ~os.O_CREAT, dir_fd=dir_fd), False
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EMLINK) and _is_link(path, dir_fd):
            what = f"a symbolic link to {quote(_target(path, dir_fd))}"
            raise UnsafeCheckpointError(_refusal(shown, what, _WRITE_FIX, "write")) from None
        if exc.errno == errno.ENXIO:  # a FIFO with no reader, under O_NONBLOCK
            what = "a FIFO (named pipe)"
            raise UnsafeCheckpointError(_refusal(shown, what, _WRITE_FIX, "write")) from None
        if exc.errno == errno.EISDIR:
            raise is_a_directory(exc, shown, "written") from None
        if dir_fd is not None and exc.filename == path:  # named in full, not inside dir_fd
            raise type(exc)(exc.errno, exc.strerror, shown) from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            what = _kind(info.st_mode)
            raise UnsafeCheckpointError(_refusal(shown, what, _WRITE_FIX, "write"))
        if not created and not _owned(info, path, dir_fd):
            what = f"a file of user id {info.st_uid}'s (who could rewrite what we save in it)"
            raise UnsafeCheckpointError(_refusal(shown, what, _WRITE_FIX, "write"))
        if _NONBLOCK:
            os.set_blocking(fd, True)
        if not created:
            os.ftruncate(fd, 0)
        return open(fd, "wb", closefd=True)  # noqa: SIM115
    except BaseException:
        os.close(fd)
        raise


def is_a_directory(exc: OSError, path: str, done: str) -> IsADirectoryError:
    """What a write or publish at ``path``, a directory, raises in place of ``exc``."""
    return IsADirectoryError(
        exc.errno,
        f"{path!r} is a directory, so no file can be written or published there; nothing "
        f"was {done}: move or remove that directory",
    )


def _is_link(path: str, dir_fd: int | None) -> bool:
    return os.path.islink(path) if dir_fd is None else is_link_at(path, dir_fd)


def _owned(info: os.stat_result, path: str, dir_fd: int | None = None) -> bool:
    if not hasattr(os, "geteuid") or info.st_uid == os.geteuid():
        return True
    try:
        if dir_fd is not None:
            return info.st_uid == os.fstat(dir_fd).st_uid
        return info.st_uid == os.stat(os.path.dirname(path) or ".").st_uid
    except OSError:
        return False


_WRITE_FIX = (
    "Someone who can write that directory put it there; remove it (and make the directory "
    "writable by you only), then save again."
)


def _refusal(path: str, what: str, fix: str, action: str = "read") -> str:
    return (
        f"refusing to {action} {path!r}: it is {what}, not a regular file inside the checkpoint "
        f"{os.path.dirname(path)!r} (a checkpoint's files must be regular files; the "
        f"checkpoint directory itself may be a link). {fix}"
    )


def _target(path: str, dir_fd: int | None = None) -> str:
    try:
        return os.readlink(path, dir_fd=dir_fd)[:200]
    except OSError:
        return "?"


def _kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def create_temporary(
    path: str, *, dir_fd: int | None = None, shown: str | None = None
) -> tuple[str, IO[bytes]]:
    """A new file next to ``path`` under a random name, created by this call (``O_EXCL``):
    a name taken already (by a neighbour who guessed it and put a link or a file there)
    is left alone and another drawn. With ``dir_fd``, ``path`` and the name returned are
    names inside that open directory (``shown``: ``path`` in full, for messages)."""
    for _ in range(_TEMP_TRIES):
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
        try:
            full = None if shown is None else os.path.join(os.path.dirname(shown), tmp)
            return tmp, open_for_writing(tmp, exclusive=True, dir_fd=dir_fd, shown=full)
        except FileExistsError:
            continue
    shown = shown or path
    raise UnsafeCheckpointError(
        f"could not create a temporary file next to {shown!r}: {_TEMP_TRIES} random names "
        "in a row were taken already, which only someone planting files there does; make "
        f"the directory {os.path.dirname(shown)!r} writable by you only, then save again"
    )


@contextlib.contextmanager
def named_errors(path: str) -> Iterator[None]:
    """An ``OSError`` raised inside the block with an errno but no file name (a write or
    an fsync that found the disk full, the quota spent, an I/O error) gets ``path`` as
    its file name, as an open's error has: "No space left on device" alone names
    neither the checkpoint nor the file."""
    try:
        yield
    except OSError as exc:
        if exc.errno is not None and exc.filename is None:
            exc.filename = path
        raise


@contextlib.contextmanager
def write_stream(path: str, *, sync: bool = False) -> Iterator[IO[bytes]]:
    """``path`` written from its start through :func:`open_for_writing` (its directory
    made first); fsynced with ``sync``; removed if the body raises, only while it is
    still the file written (:func:`_remove_written`); an error without a file name
    names ``path`` (:func:`named_errors`)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    out = open_for_writing(path)
    with written_or_removed(out, path, lambda w: _remove_written(path, w), sync=sync):
        yield out


@contextlib.contextmanager
def written_or_removed(
    out: IO[bytes], shown: str, remove: Callable[[os.stat_result], None], *, sync: bool = False
) -> Iterator[None]:
    """The body writes ``out`` (a file just opened for writing, shown as ``shown`` in
    errors: :func:`named_errors`); then it is flushed, fsynced with ``sync`` and closed.
    If anything raises, it is closed and ``remove`` is given its ``fstat`` from before
    the body, to remove the file only while it is still that one."""
    written = os.fstat(out.fileno())
    try:
        with named_errors(shown):
            yield
            out.flush()
            if sync:
                os.fsync(out.fileno())
    except BaseException:
        out.close()
        with contextlib.suppress(FileNotFoundError):
            remove(written)
        raise
    out.close()


def _remove_written(path: str, written: os.stat_result) -> None:
    """Remove ``path`` if it is the file ``written`` (its ``fstat``). Its name is a
    checkpoint's, which another checkpoint has too: a directory on the way swapped for
    a link since the write opened it would make a removal by path land in that one.
    The directory is opened once and the name looked up and removed inside it, so what
    is compared is what is removed."""
    if not _local_walk.WALKS_SAFELY:  # by path, as this platform allows
        os.unlink(path)
        return
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(os.path.dirname(path) or os.curdir, flags)
    try:
        remove_written_at(fd, os.path.basename(path), written)
    finally:
        os.close(fd)


def remove_written_at(dir_fd: int, name: str, written: os.stat_result) -> None:
    """Remove ``name`` inside the open directory ``dir_fd`` if it is the file ``written``
    (its ``fstat``): what is compared is what is removed."""
    found = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    if (found.st_dev, found.st_ino) == (written.st_dev, written.st_ino):
        os.unlink(name, dir_fd=dir_fd)


def write_atomic(
    path: str,
    data: bytes,
    *,
    exclusive: bool = False,
    sync_directory: Callable[[str], None] | None = None,
) -> None:
    """``data`` at ``path`` whole or not at all: written to a new temporary file of ours
    (:func:`create_temporary`), fsynced, then renamed over ``path`` (``exclusive``:
    hard-linked to it, ``FileExistsError`` if it exists); the directory is then fsynced
    by ``sync_directory`` (a backend's own ``sync_dir``), :func:`sync_dir` if none."""
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    tmp, opened = create_temporary(path)
    try:
        with opened as stream, named_errors(path):
            stream.write(data)
            stream.flush()
            os.fsync(stream.fileno())
        if exclusive:
            os.link(tmp, path)  # fails with FileExistsError, atomically
            os.unlink(tmp)
        else:
            os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(exc, IsADirectoryError):  # it named our temporary file
            raise is_a_directory(exc, path, "replaced") from exc
        raise
    (sync_directory or sync_dir)(directory)


def sync_dir(path: str) -> None:
    """fsync ``path`` and its parent: a directory created by this save is itself a name."""
    for directory in (path, os.path.dirname(path.rstrip(os.sep)) or os.sep):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
