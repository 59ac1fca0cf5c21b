"""Compare and swap of one small object: replacing or removing it only while it is
still the version that was read, so that two processes updating it concurrently (a
read, a decision, a write) never undo each other's update unseen.

A backend that replaces so implements :class:`Swapping`; one that removes so too
implements :class:`SwappingRemovals` (``isinstance`` tells):

* Local disk (``LocalFileSystem``), both: the version is the content read; the
  comparison and the write (or removal) run under an exclusive ``flock`` of the
  directory holding the object, which every swap in that directory takes, across
  processes and threads (no lock file). Where the filesystem refuses ``flock`` (some
  network filesystems), the comparison runs unlocked, right before the write: a narrow
  window, never a wrong answer when no one else writes at that moment.
* S3 (``S3FileSystem``), both: the version is the ETag of the GET; the PUT carries
  ``If-Match`` (``If-None-Match: *`` for an object that was absent) and the DELETE
  ``If-Match``, which S3, moto and SeaweedFS enforce (412); a store that answers 501 to
  the condition, or sent no ETag, gets the unconditional request (as before this
  existed). No request more than the plain read and write.
* GCS (``GCSFileSystem``), replacements only: the version is the generation of the
  GET; the upload carries ``ifGenerationMatch`` (``0`` for an object that was absent),
  which GCS and fake-gcs-server enforce (412). No request more than the plain read and
  write. Removals are not swapped: GCS documents ``ifGenerationMatch`` on deletes too,
  but fake-gcs-server ignores it there, so nothing here could check it; a removal is
  unconditional, as on a backend that swaps nothing.

Other backends (any fsspec URL, memory, torch-style filesystems) implement neither;
callers then write unconditionally and read the object back to notice an update they
undid (see ``storage.checkpoint.latest``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Protocol, runtime_checkable

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None  # type: ignore[assignment]


@runtime_checkable
class Swapping(Protocol):
    """A backend that replaces an object only while it is the version read."""

    def read_versioned(self, path: str, *, limit: int) -> tuple[bytes, str]:
        """What ``read_bytes(path, limit=limit)`` returns, and the version it read (an
        opaque string); ``FileNotFoundError`` where there is no object."""

    def replace_if(self, directory: str, name: str, data: bytes, version: str | None) -> bool:
        """``write_atomic_in(directory, name, data)`` if the object is still ``version``
        (``None``: if there is none); ``False``, nothing written, where it changed."""


@runtime_checkable
class SwappingRemovals(Swapping, Protocol):
    """A backend that also removes an object only while it is the version read."""

    def remove_if(self, directory: str, name: str, version: str) -> bool:
        """``rm_file_in(directory, name)`` if the object is still ``version``;
        ``False``, nothing removed, where it changed or is gone."""


@contextlib.contextmanager
def directory_locked(directory: str) -> Iterator[None]:
    """An exclusive ``flock`` of ``directory`` for the block (local disk); unlocked where
    the platform or the filesystem has no ``flock`` (see the module docstring)."""
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(directory, flags)
    try:
        if fcntl is not None:
            with contextlib.suppress(OSError):  # ENOLCK, EBADF (NFS), EINVAL
                fcntl.flock(fd, fcntl.LOCK_EX)
        yield  # closing the descriptor releases the lock
    finally:
        os.close(fd)
