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
  window, never a wrong answer when no one else writes at that moment. So it does where
  another process has held a lock of the directory for :data:`LOCK_WAIT` seconds:
  anyone who can read the directory can lock it (``flock`` needs only a descriptor),
  and a lock held for ever would otherwise hang every save that publishes into it,
  after its commit.
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
import logging
import os
import time
from collections.abc import Iterator
from typing import Protocol, runtime_checkable

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

#: Longest a swap waits for a lock of its directory that another process holds (ours
#: hold it for one small read and write) before it runs unlocked.
LOCK_WAIT = 10.0


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
            _lock(fd, directory)
        yield  # closing the descriptor releases the lock
    finally:
        os.close(fd)


def _lock(fd: int, directory: str) -> None:
    """``flock(fd, LOCK_EX)``, waiting at most :data:`LOCK_WAIT` seconds for another
    holder; past that, or where the filesystem refuses locks, ``fd`` stays unlocked."""
    deadline = time.monotonic() + LOCK_WAIT
    delay = 0.001
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass  # held by another descriptor: wait for it, within the bound
        except OSError:  # ENOLCK, EBADF (NFS), EINVAL: no locks here
            return
        left = deadline - time.monotonic()
        if left <= 0:
            log.warning(
                "%s: another process has held a lock of this directory for %g s (anyone "
                "who can read the directory can take one); updating the latest-step "
                "pointer in it without the lock. Find the holder with `fuser -v %s`, or "
                "make the directory readable by your jobs only",
                directory,
                LOCK_WAIT,
                directory,
            )
            return
        time.sleep(min(delay, left))
        delay = min(delay * 2, 0.05)
