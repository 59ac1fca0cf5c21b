"""``FileSystemBase``: the contract every storage backend implements.

Method names follow torch's ``torch.distributed.checkpoint.filesystem.FileSystemBase``
(``create_stream``, ``concat_path``, ``rename``, ``init_path``, ``mkdir``,
``validate_checkpoint_id``, ``exists``, ``rm_file``, ``ls``); the rest is what a
checkpoint reader and a safe commit need. Paths are strings in the backend's own form
(an absolute local path, ``bucket/key`` for object stores) as returned by
:meth:`init_path` and :meth:`concat_path`; every method that takes a path also takes
it as a URL of the backend (``s3://bucket/key``, ``file:///tmp/x``) or an
``os.PathLike``, as callers of torch's filesystems pass them: the base class turns it
into the backend's form (:meth:`own_path`) before any backend code sees it.

Semantics every backend guarantees (checked by ``storage.testing.FileSystemTests``):

* Reading a missing path raises ``FileNotFoundError``; so do ``rm_file``, ``size``
  and ``ls`` of a missing path.
* Writing creates missing parent directories (where directories exist at all).
* ``create_stream(path, "wb")`` makes the object visible whole or not at all on object
  stores; on any backend, an exception inside the ``with`` block removes what was
  written, so a failed write leaves nothing of it behind. Whether an object that was
  already at that path survives a failed write is backend-specific (object stores keep
  it; local disk has already truncated it): the commit protocol never writes over a
  file that committed metadata points at. ``sync=True`` makes the bytes
  durable before the block exits (fsync on local disk; a completed upload elsewhere).
* Reading (``create_stream(path, "rb")``, ``open_slice``, ``read_bytes``) opens only
  regular files: where a backend has symbolic links and special files (local disk), a
  link as the last path component, a FIFO, a device, a socket or a directory raises
  ``UnsafeCheckpointError`` instead of being read (a checkpoint's files are plain names,
  so this is every link inside it; directories above it may be links).
* ``open_slice(path, offset, length)`` reads only ``[offset, offset + length)``: it
  never returns a byte outside that range, and a read that runs past the end of the
  object returns fewer bytes (the caller reports truncation).
* ``read_bytes(path, limit=N)`` returns the object's first ``N + 1`` bytes at most (all
  of it when shorter), and fetches no more than that from the store: a caller that
  refuses objects over ``N`` bytes (metadata) tells one from the bytes it got, without
  a size request first. On object stores it is one request, as without ``limit``.
* ``write_atomic`` publishes small objects (metadata) atomically; with
  ``exclusive=True`` it fails with ``FileExistsError`` if the path already exists,
  using the store's conditional create where it has one.
* ``create_stream_in(directory, name)`` and ``write_atomic_in`` write as
  ``create_stream`` and ``write_atomic`` do, never through a symbolic link at
  ``directory`` or below it where the backend has links (``UnsafeCheckpointError``,
  nothing written); ``rm_file_in``, ``rm_dir_in`` and ``rename_in`` remove and move so.
  ``resolve_link(path)``, what those are given as ``directory``, follows a link at the
  checkpoint path itself only where it can be trusted (the user's own, root's, or the
  owner's of the directory holding it, or any in a directory only its owner can write),
  refusing a neighbour's.
* ``rename(path, new_path)`` moves one object, replacing what is at ``new_path``:
  atomically where ``atomic_rename`` says so (local disk), elsewhere as fsspec does,
  a copy then a delete (object stores: another reader may see both, or neither if the
  delete fails after the copy). The commit protocol never uses it; user code does.
* A backend is picklable (process-based async save ships it to another process).
* Requests can be interrupted from another thread: a save or load past its deadline
  cancels the ``storage.backends.cancel.Cancel`` installed for the threads doing its
  storage work, and a backend whose requests (stream calls included) hang on
  ``cancel.current()`` stops them at once, raising ``StreamCancelled``; a failed write
  then cleans up without waiting on the stalled store. A backend that does not is
  stopped by the checkpoint layer at its next stream call (``S3FileSystem`` and
  ``GCSFileSystem`` do; local disk, other fsspec URLs and ``TorchFileSystem`` do not).
* ``pending_uploads(path)`` lists uploads begun under ``path`` and never completed
  or aborted (S3 multipart uploads: their parts are billed and no listing of objects
  shows them); backends without such uploads list none. ``abort_upload`` frees one.
"""

from __future__ import annotations

import abc
import contextlib
import functools
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import IO, Any, ClassVar, cast

from extensions.streams import SliceView, read_all


@dataclass(frozen=True)
class PendingUpload:
    """An upload begun and never completed or aborted (an interrupted save's)."""

    path: str  #: the object it would have created, in the backend's path form
    upload_id: str
    started: float | None  #: POSIX seconds, ``None`` where the store does not say


class FileSystemBase(abc.ABC):
    """The storage backend contract; see the module docstring."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _own_paths(cls)

    #: ``rename`` is atomic and cheap on this backend.
    atomic_rename: ClassVar[bool] = False
    #: Concurrent requests that pay off on this backend (reads and uploads).
    io_concurrency: int = max(2, min(8, os.cpu_count() or 2))
    #: Largest read the checkpoint layer issues at a time while it checksums what it
    #: reads, so the checksum runs over bytes still in the CPU cache; None: one read per
    #: destination (ranged-request backends split big reads into parallel requests).
    read_block: ClassVar[int | None] = None
    #: Reads are served from this machine (its page cache, this process's memory): a
    #: small read costs no request, and reading beats fetching once and sharing.
    local_reads: ClassVar[bool] = False
    #: Requests made from a thread whose installed ``cancel.Cancel`` is cancelled raise
    #: ``StreamCancelled`` at once, stalled ones included (see "interrupted" above);
    #: without it the checkpoint layer stops the backend at its next stream call.
    interruptible: ClassVar[bool] = False

    def __init__(self, *, storage_options: dict[str, Any] | None = None) -> None:
        self.storage_options = dict(storage_options or {})

    @classmethod
    def from_url(
        cls, url: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None
    ) -> FileSystemBase:
        """The instance that serves ``url``; ``storage.filesystem_from_url`` builds
        backends with it. Backends whose instance depends on the URL itself (the named
        in-memory stores of ``dcpmem://NAME/...``) override it."""
        return cls(storage_options=storage_options)

    @abc.abstractmethod
    def init_path(self, path: str | os.PathLike[str]) -> str:
        """Normalise a user path or URL into this backend's path form."""

    @abc.abstractmethod
    def concat_path(self, path: str, suffix: str) -> str:
        """Join ``suffix`` (a name, never absolute) under ``path``."""

    @abc.abstractmethod
    def create_stream(
        self, path: str, mode: str, *, sync: bool = False
    ) -> contextlib.AbstractContextManager[IO[bytes]]:
        """Open ``path`` for ``"rb"`` or ``"wb"`` (see the module docstring)."""

    def open_slice(
        self, path: str, offset: int, length: int
    ) -> contextlib.AbstractContextManager[IO[bytes]]:
        """A readable view of ``[offset, offset + length)`` of ``path`` (seekable
        where the backend can; ranged-request backends stream forward only).

        Backends with ranged requests override this to fetch only that range."""
        return self._slice_of_stream(path, offset, length)

    def _empty_slice(self, path: str, offset: int, length: int) -> bool:
        """For backends that fetch ranges: refuse a negative bound, and for an empty
        slice check that ``path`` exists (a missing object raises FileNotFoundError);
        True when there is nothing to fetch."""
        if offset < 0 or length < 0:
            raise ValueError(f"invalid slice offset={offset} length={length}")
        if length == 0:
            self.size(path)
            return True
        return False

    @contextlib.contextmanager
    def _slice_of_stream(self, path: str, offset: int, length: int) -> Iterator[IO[bytes]]:
        with self.create_stream(path, "rb") as stream:
            yield cast(IO[bytes], SliceView(stream, offset, length))

    def read_bytes(self, path: str, *, limit: int | None = None) -> bytes:
        """The whole content of ``path``; with ``limit``, at most its first ``limit + 1``
        bytes, and no more fetched (see the module docstring).

        Backends with ranged requests override this to send one GET of that range."""
        self._read_length(limit)
        with self.create_stream(path, "rb") as stream:
            return stream.read() if limit is None else read_all(stream, limit=limit)

    @staticmethod
    def _read_length(limit: int | None) -> int | None:
        """For backends that override ``read_bytes``: refuse a negative ``limit``; the
        bytes to fetch (``limit + 1``; ``None``: all)."""
        if limit is None:
            return None
        if limit < 0:
            raise ValueError(f"invalid read limit {limit}: a byte count of 0 or more")
        return limit + 1

    def write_atomic(self, path: str, data: bytes, *, exclusive: bool = False) -> None:
        """Publish ``data`` at ``path`` whole or not at all, durably.

        The default writes through ``create_stream`` (atomic on object stores); with
        ``exclusive`` it checks ``exists`` first, which is only as good as the store's
        consistency. Backends with a conditional create override this."""
        if exclusive and self.exists(path):
            raise FileExistsError(path)
        with self.create_stream(path, "wb", sync=True) as stream:
            stream.write(data)

    @abc.abstractmethod
    def size(self, path: str) -> int:
        """Size in bytes of the object at ``path``."""

    @abc.abstractmethod
    def exists(self, path: str) -> bool: ...

    def modified(self, path: str) -> float | None:
        """Last-modified time of ``path`` in POSIX seconds, or ``None`` where the
        backend cannot tell. The checkpoint manager only removes leftovers of
        interrupted saves whose age it knows, so ``None`` keeps them."""
        return None

    @abc.abstractmethod
    def rm_file(self, path: str) -> None:
        """Delete one object; ``FileNotFoundError`` if it does not exist."""

    def rm_file_in(self, directory: str, name: str) -> None:
        """Delete the object ``name`` (relative to ``directory``, ``/``-separated):
        what every deletion of a checkpoint's files uses. Where the backend has symbolic
        links (local disk), nothing is deleted through one: ``directory`` and each
        directory below it are opened without following a link, so one there (swapped in
        by whoever can write its parent, even after a check) raises
        ``UnsafeCheckpointError`` and removes nothing, while a link at ``name`` is removed
        itself; the directories above ``directory`` are taken as given. This default
        deletes by path (backends without links). ``FileNotFoundError`` if missing."""
        self.rm_file(self.concat_path(directory, name))

    def rm_dir_in(self, directory: str, name: str = "") -> None:
        """:meth:`rm_dir` of ``directory/name`` (``directory`` itself when ``name`` is
        empty), never through a link, as :meth:`rm_file_in`."""
        self.rm_dir(self.concat_path(directory, name) if name else directory)

    def rename_in(self, directory: str, name: str, new_name: str) -> None:
        """:meth:`rename` of ``directory/name`` to ``directory/new_name``, never through
        a link, as :meth:`rm_file_in`."""
        self.rename(self.concat_path(directory, name), self.concat_path(directory, new_name))

    def create_stream_in(
        self, directory: str, name: str, mode: str = "wb", *, sync: bool = False
    ) -> contextlib.AbstractContextManager[IO[bytes]]:
        """:meth:`create_stream` of ``name`` (relative to ``directory``, ``/``-separated
        plain names: a key prefix may come first): what every write of a checkpoint's
        files uses, ``directory`` being the checkpoint directory as resolved once at the
        start (``heartbeat.resolved``). Where the backend has symbolic links (local
        disk), nothing is written through one: ``directory`` and each directory below it
        are opened without following a link (missing ones made inside the one above), so
        a link swapped in there (by whoever can write its parent, even after the save
        made the directory) raises ``UnsafeCheckpointError`` and writes nothing, and the
        file is opened inside the directory so reached, with every property of
        :meth:`create_stream` (no link, FIFO or other user's file at ``name``); the
        directories above ``directory`` are taken as given. Reads (``"rb"``) go by path.
        This default writes by path (backends without links)."""
        return self.create_stream(self.concat_path(directory, name), mode, sync=sync)

    def write_atomic_in(
        self, directory: str, name: str, data: bytes, *, exclusive: bool = False
    ) -> None:
        """:meth:`write_atomic` of ``directory/name``, never through a link, as
        :meth:`create_stream_in`: on local disk the temporary is created, renamed (or
        linked, ``exclusive``) and the directory made durable inside the directory
        reached by the walk."""
        self.write_atomic(self.concat_path(directory, name), data, exclusive=exclusive)

    def is_link(self, path: str) -> bool:
        """Whether ``path`` is a symbolic link (``False`` where the backend has none).
        Deletion paths never delete through one."""
        return False

    def realpath(self, path: str) -> str:
        """``path`` with its symbolic links resolved (``path`` itself where the backend
        has none): the name under which its files are really stored."""
        return path

    def resolve_link(self, path: str) -> str:
        """The directory a checkpoint path the user named leads to where it is itself a
        symbolic link (its files are written through it), else ``path``: what a save, a
        deletion or a safetensors write resolves once as it begins, then acts on with the
        ``*_in`` methods, never through a link below it; a load asks it too before it
        reads anything (its reads then go by path). Where links have owners (local
        disk), one is followed only where it can be trusted, as the kernel's
        ``protected_symlinks`` follows a link in a sticky world-writable directory: it is
        owned by this process's effective user, by root, or by the owner of the directory
        that holds it, or that directory is writable by its owner only (each link of a
        chain so); anyone else's (put there by a neighbour who can write that directory,
        to redirect a save or a load) raises
        ``UnsafeCheckpointError`` naming the path, the link's owner and the fix. The
        directories above ``path`` are taken as given. This default follows
        :meth:`is_link` and :meth:`realpath` (backends whose links have no owners)."""
        return self.realpath(path) if self.is_link(path) else path

    @abc.abstractmethod
    def ls(self, path: str) -> list[str]:
        """Sorted names (not paths) directly under ``path``, directories included."""

    def mkdir(self, path: str) -> None:
        """Create ``path`` and its parents if the backend has directories."""

    def rm_dir(self, path: str) -> None:
        """Remove ``path`` if it is an empty directory; a no-op where there are none."""

    def sync_dir(self, path: str) -> None:
        """Make the names of files written under ``path`` durable (local fsync)."""

    def rename(self, path: str, new_path: str) -> None:
        """Move ``path`` to ``new_path`` (see the module docstring); this default
        streams a copy, then deletes ``path``. ``FileNotFoundError`` if it is missing."""
        with self.create_stream(path, "rb") as source, self.create_stream(new_path, "wb") as out:
            while chunk := source.read(8 << 20):
                out.write(chunk)
        self.rm_file(path)

    def own_path(self, path: str | os.PathLike[str]) -> str:
        """``path`` in this backend's form: a URL (``scheme://...``) through
        :meth:`init_path`, anything else unchanged."""
        text = os.fspath(path)
        return self.init_path(text) if _URL.match(text) else text

    def pending_uploads(self, path: str) -> list[PendingUpload]:
        """Uploads begun under ``path`` (a directory or key prefix, at any depth) and
        never completed or aborted, oldest first. None on backends whose writes leave
        nothing invisible behind (local disk, memory; a GCS resumable session that is
        never finished expires by itself within a week and is not billed)."""
        return []

    def abort_upload(self, upload: PendingUpload) -> None:
        """Abort ``upload`` (from :meth:`pending_uploads`), freeing what it holds; one
        that is gone meanwhile (completed or aborted) is not an error."""
        raise NotImplementedError(f"{type(self).__name__} has no pending uploads")

    def url(self, path: str) -> str:
        """``path`` as the user would write it, for messages."""
        return path

    @property
    def in_process(self) -> bool:
        """Whether what this backend stores lives in this process's memory, where no
        other process (the persist worker) reaches it."""
        return False

    def stamps(self, path: str) -> dict[str, tuple[int, ...]] | None:
        """What identifies each entry directly under ``path`` right now (its inode,
        size, modification and change times), by name, where the backend tells it
        without a request (a changed stamp means a changed entry); ``None`` elsewhere or
        when ``path`` cannot be listed. Links are stamped, not followed."""
        return None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether this backend handles ``checkpoint_id`` (torch's auto-selection hook)."""
        return False


_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
# The methods that take paths, and how many of their leading arguments are paths.
_PATH_ARGUMENTS = {
    "concat_path": 1,
    "create_stream": 1,
    "open_slice": 1,
    "read_bytes": 1,
    "write_atomic": 1,
    "size": 1,
    "exists": 1,
    "modified": 1,
    "rm_file": 1,
    "rm_file_in": 1,
    "create_stream_in": 1,
    "write_atomic_in": 1,
    "rm_dir_in": 1,
    "rename_in": 1,
    "is_link": 1,
    "resolve_link": 1,
    "ls": 1,
    "mkdir": 1,
    "rm_dir": 1,
    "sync_dir": 1,
    "rename": 2,
    "url": 1,
    "pending_uploads": 1,
}
_KEYWORDS = ("path", "new_path")


def _own_paths(cls: type) -> None:
    """Wrap the path-taking methods ``cls`` defines so their paths go through
    ``own_path`` first (abstract ones are left to their implementations)."""
    for name, count in _PATH_ARGUMENTS.items():
        method = cls.__dict__.get(name)
        if method is None or getattr(method, "__isabstractmethod__", False):
            continue
        if not getattr(method, "_owns_paths", False):
            setattr(cls, name, _owning_paths(method, count))


def _owning_paths(method: Callable[..., Any], count: int) -> Callable[..., Any]:
    @functools.wraps(method)
    def wrapper(self: FileSystemBase, *args: Any, **kwargs: Any) -> Any:
        args = tuple(self.own_path(a) if i < count else a for i, a in enumerate(args))
        for key in _KEYWORDS:
            if key in kwargs:
                kwargs[key] = self.own_path(kwargs[key])
        return method(self, *args, **kwargs)

    wrapper._owns_paths = True  # type: ignore[attr-defined]
    return wrapper


_own_paths(FileSystemBase)
