"""Writing a checkpoint's files on local disk without following a link on the way.

:mod:`~storage.backends._local_files` opens the file itself never through a link, never
into a FIFO or another user's file; the directories above it it follows by path. A save
makes its step directory, then writes into it: whoever can write the root (a shared
``/scratch/ckpts`` without the sticky bit) could rename the step away in between and put
a link to a directory of their choosing in its place, and the save would write its data
files, its metadata temporary and the rename over ``.metadata`` there (truncating files
of those names that the save's user owns). Here the file is opened inside the
directories walked as removals walk them (:mod:`~storage.backends._local_walk`): the
checkpoint directory's parent as given, the checkpoint directory and each directory
below it opened without following a link, missing ones made inside the one above; the
file opened, published (renamed) and made durable through those handles. A link swapped
in anywhere below the checkpoint directory fails the write before a byte lands
(``UnsafeCheckpointError`` naming the path and the fix). Where the platform cannot walk
(``WRITES_SAFELY`` false), writes go by path as before, their names refused as the walk
refuses them (``..``, absolute, NUL).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import IO

from storage.backends import _local_files, _local_walk


@contextlib.contextmanager
def write_stream_in(directory: str, name: str, *, sync: bool = False) -> Iterator[IO[bytes]]:
    """``directory/name`` written from its start as ``_local_files.write_stream`` writes
    it (its directories made first; fsynced with ``sync``; removed if the body raises,
    only while it is still the file written), reached by the walk (module docstring)."""
    if not _local_walk.WRITES_SAFELY:
        _local_walk.walk_plan(directory, name, False, "write")  # its names refused alike
        with _local_files.write_stream(os.path.join(directory, name), sync=sync) as out:
            yield out
        return
    shown = os.path.join(directory, name)
    with _local_walk.opened_parent(directory, name, create=True, action="write") as (fd, last):
        out = _local_files.open_for_writing(last, dir_fd=fd, shown=shown)

        def remove(written: os.stat_result) -> None:
            _local_files.remove_written_at(fd, last, written)

        with _local_files.written_or_removed(out, shown, remove, sync=sync):
            yield out


def write_atomic_in(directory: str, name: str, data: bytes, *, exclusive: bool = False) -> None:
    """``data`` at ``directory/name`` whole or not at all, as ``_local_files.write_atomic``
    publishes it (a new temporary of ours under a random name, fsynced, renamed over
    ``name``; ``exclusive``: hard-linked to it, ``FileExistsError`` if it exists; the
    directory and its parent fsynced), every step inside the directory reached by the
    walk."""
    if not _local_walk.WRITES_SAFELY:
        _local_walk.walk_plan(directory, name, False, "write")  # its names refused alike
        _local_files.write_atomic(os.path.join(directory, name), data, exclusive=exclusive)
        return
    shown = os.path.join(directory, name)
    with _local_walk.opened_parent(directory, name, create=True, action="write") as (fd, last):
        tmp, opened = _local_files.create_temporary(last, dir_fd=fd, shown=shown)
        try:
            with opened as stream, _local_files.named_errors(shown):
                stream.write(data)
                stream.flush()
                os.fsync(stream.fileno())
            if exclusive:  # fails with FileExistsError, atomically
                os.link(tmp, last, src_dir_fd=fd, dst_dir_fd=fd, follow_symlinks=False)
                os.unlink(tmp, dir_fd=fd)
            else:
                os.replace(tmp, last, src_dir_fd=fd, dst_dir_fd=fd)
        except BaseException as exc:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=fd)
            if isinstance(exc, IsADirectoryError):  # it named our temporary file
                raise _local_files.is_a_directory(exc, shown, "replaced") from exc
            raise
        _sync_with_parent(fd)


def _sync_with_parent(fd: int) -> None:
    """fsync the open directory ``fd`` and the directory holding it (as ``sync_dir`` does
    by path: a directory this save made is itself a name), the latter reached through
    ``fd`` itself."""
    os.fsync(fd)
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
    parent = os.open(os.pardir, flags, dir_fd=fd)
    try:
        os.fsync(parent)
    finally:
        os.close(parent)


def overridden(fs: object, backend: type, *names: str) -> bool:
    """Whether ``fs``'s class replaces one of ``backend``'s methods ``names`` (a subclass
    that wraps its writes: counting, failing, pacing them). Its ``*_in`` writes then go
    through those methods by path, as the contract's defaults do, so it sees every write."""
    cls = type(fs)
    return any(getattr(cls, n) is not getattr(backend, n) for n in names)
