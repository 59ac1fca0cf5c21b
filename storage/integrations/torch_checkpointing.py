"""torch_checkpointing: a ``Storage`` for S3, GCS and any URL dcp-storage serves.

torch_checkpointing (0.1) writes every checkpoint through a ``Storage`` built from the
``StorageConfig`` in its ``CheckpointManager.Config``; it ships only local disk. Its
commit is a rename: ranks write under ``<parent>/tmp_<name>``, rank 0 renames that
directory onto ``<parent>/<name>`` after a barrier. On an object store a directory
rename is a copy of every object, one at a time, that a reader can catch half done.
:class:`ObjectStoreConfig` commits the other way, as dcp-storage does::

    from torch_checkpointing import CheckpointManager
    from storage.integrations.torch_checkpointing import ObjectStoreConfig

    manager = CheckpointManager(CheckpointManager.Config(
        storage_config=ObjectStoreConfig("s3://bucket/run1", storage_options={...}),
    ))
    manager.save("step_100", {"model": model.state_dict(), ...})

Checkpoint paths are relative to the config's URL (a leading ``/`` is ignored).

The commit protocol on any backend:

* Files written under ``<parent>/tmp_<name>/`` (the writer's temporary directory; the
  prefix is ``temp_dir_prefix``, the writer's default) go straight to ``<parent>/<name>/``,
  after a ``.dcp-storage-pending`` marker: no copy at commit.
* The writer's directory rename *is* the commit: one small object,
  ``.dcp-storage-commit`` (the names of the files it commits), published last with a
  conditional create. A checkpoint exists once it does, whole.
* A directory holding a pending marker and no commit marker is a save in progress or a
  failed one: ``exists`` and ``ls`` do not show it, so neither torch_checkpointing nor a
  user listing checkpoints can load half of one.
* Saving onto a committed checkpoint fails before anything is written (torch_checkpointing
  would refuse the rename onto it anyway, after writing); ``rmdir`` removes the commit
  marker first (after marking the directory pending), so a deletion that stops midway
  leaves an invisible directory, never a committed one with files missing.

With ``CheckpointWriterConfig(write_to_temp_dir=False)`` torch_checkpointing gives up
its commit protocol; files then land in place and nothing marks them committed.

On local disk no file is written, renamed or removed through a symbolic link below the
checkpoint directory it is staged into, or below the root for the others (a directory
swapped for one by whoever can write its parent is refused); the root, or a checkpoint
directory, that is itself the user's link is followed, as resolved once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import threading
from pathlib import Path, PurePosixPath
from typing import IO, Any

from storage.backends.base import FileSystemBase
from storage.backends.registry import filesystem_from_url
from storage.checkpoint import heartbeat
from storage.checkpoint.deletion import refuse_link
from storage.integrations._deps import require

require("torch_checkpointing.storage.base_storage", "torch-checkpointing")

from torch_checkpointing.checkpoint_writer import DEFAULT_TEMP_DIR_PREFIX  # noqa: E402
from torch_checkpointing.storage.base_storage import (  # noqa: E402
    ReadArgs,
    Storage,
    StorageConfig,
)

__all__ = ["COMMIT_NAME", "PENDING_NAME", "ObjectStoreConfig", "ObjectStoreStorage"]

COMMIT_NAME = ".dcp-storage-commit"
PENDING_NAME = ".dcp-storage-pending"
_MARKERS = (COMMIT_NAME, PENDING_NAME)
_COMMIT_FORMAT = "dcp-storage/torch_checkpointing-commit/1"


@dataclasses.dataclass
class ObjectStoreConfig(StorageConfig):
    """Where checkpoints live: ``url`` (``s3://bucket/prefix``, ``gs://...``, any fsspec
    URL or a local path) with the client's ``storage_options``. ``temp_dir_prefix``
    must equal the writer's (``CheckpointWriterConfig.temp_dir_prefix``). Picklable:
    the asynchronous saver builds its storage in a subprocess."""

    url: str
    storage_options: dict[str, Any] | None = dataclasses.field(default=None, repr=False)
    temp_dir_prefix: str = DEFAULT_TEMP_DIR_PREFIX

    def create_storage(self) -> ObjectStoreStorage:
        return ObjectStoreStorage(self)


class ObjectStoreStorage(Storage):
    """torch_checkpointing's ``Storage`` over a dcp-storage backend (module docstring)."""

    def __init__(self, config: ObjectStoreConfig) -> None:
        if not config.temp_dir_prefix:
            raise ValueError("temp_dir_prefix must not be empty (it is the writer's)")
        self.config = config
        self.fs: FileSystemBase
        self.fs, self.root = filesystem_from_url(config.url, config.storage_options)
        self._lock = threading.Lock()
        self._pending: set[str] = set()  # checkpoint directories this instance marked
        # Each one as resolved when this instance first made or wrote it (_home).
        self._homes: dict[str, str] = {}

    # --- paths ------------------------------------------------------------------------

    def _resolve(self, path: Path | str) -> tuple[str, str | None]:
        """The backend path for ``path``, and the checkpoint directory it is staged into
        when ``path`` lies under a temporary directory (else None)."""
        parts, staged = self._split(path)
        return self._join(parts), None if staged is None else self._join(parts[: staged + 1])

    def _split(self, path: Path | str) -> tuple[list[str], int | None]:
        """The names of ``path`` below the root, its temporary directory's prefix
        dropped, and the index of the checkpoint directory it is staged into (if any)."""
        parts = [p for p in PurePosixPath(path).parts if p != "/"]
        if ".." in parts:
            raise ValueError(f"{path}: '..' is not allowed in a checkpoint path")
        prefix = self.config.temp_dir_prefix
        for i, part in enumerate(parts):
            if part.startswith(prefix) and len(part) > len(prefix):
                parts[i] = part[len(prefix) :]
                return parts, i
        return parts, None

    def _place(self, path: Path | str) -> tuple[str, str]:
        """Where a write, rename or removal of the file ``path`` walks from and its name
        there: inside the checkpoint directory it is staged into, else inside the root,
        either as first resolved (:meth:`_home`): never through a link below it."""
        parts, staged = self._split(path)
        cut = 0 if staged is None or staged + 1 == len(parts) else staged + 1
        return self._home(self._join(parts[:cut])), "/".join(parts[cut:])

    def _join(self, parts: list[str]) -> str:
        return self.fs.concat_path(self.root, "/".join(parts)) if parts else self.root

    def _marker(self, directory: str, name: str) -> str:
        return self.fs.concat_path(directory, name)

    def _home(self, staged: str) -> str:
        """``staged`` (a checkpoint directory, or the root) as resolved the first time
        this instance made or wrote there (a link the user named there is followed then,
        none below it, never one swapped in since): where its files and markers are
        written and removed (``create_stream_in``, ``write_atomic_in``,
        ``rm_file_in``)."""
        with self._lock:
            home = self._homes.get(staged)
            if home is None:
                home = self._homes[staged] = heartbeat.resolved(self.fs, staged)
            return home

    def _hidden(self, directory: str) -> bool:
        """A save in progress or a failed one: pending and not committed."""
        return self.fs.exists(self._marker(directory, PENDING_NAME)) and not self.fs.exists(
            self._marker(directory, COMMIT_NAME)
        )

    def _target(self, path: Path | str) -> str:
        """Where a write of ``path`` goes; the first write staged into a checkpoint
        directory refuses a committed one and marks it pending."""
        key, staged = self._resolve(path)
        if staged is not None:
            with self._lock:
                first = staged not in self._pending
                self._pending.add(staged)
            if first:
                if self.fs.exists(self._marker(staged, COMMIT_NAME)):
                    with self._lock:
                        self._pending.discard(staged)
                    raise FileExistsError(
                        f"{self.fs.url(staged)} is a committed checkpoint; saving onto it is "
                        "refused before anything is written. Save under a new name, or "
                        "delete it first (Storage.rmdir)"
                    )
                self.fs.write_atomic_in(self._home(staged), PENDING_NAME, b"")
        return key

    def _create(self, path: Path | str) -> contextlib.AbstractContextManager[IO[bytes]]:
        """A write stream of ``path``, never through a link (:meth:`_place`)."""
        self._target(path)
        return self.fs.create_stream_in(*self._place(path), "wb")

    # --- writing ----------------------------------------------------------------------

    def stream_write(self, path: Path) -> io.IOBase:
        return _Upload(self._create(path))

    def write(self, path: Path, data: Any) -> None:
        with self._create(path) as out:
            out.write(memoryview(data).cast("B"))

    def mkdir(self, path: Path, recursive: bool = True) -> None:
        key, staged = self._resolve(path)
        # Resolved before it is made: a link swapped in afterwards is refused.
        self._home(self.root if staged is None else staged)
        self.fs.mkdir(key)

    def rename(
        self,
        src_path: Path,
        dst_path: Path,
        is_directory: bool = False,
        background_cleanup: bool = False,
    ) -> None:
        src, staged = self._resolve(src_path)
        dst = self._resolve(dst_path)[0]
        if staged is not None and staged == src == dst:
            self._commit(dst)
            return
        if is_directory or self._isdir(src):
            raise OSError(
                f"renaming directory {self.fs.url(src)} onto {self.fs.url(dst)}: an object "
                "store has no atomic directory rename; only the writer's temporary "
                f"directory ({self.config.temp_dir_prefix}<name>) commits, onto <name>"
            )
        if self._isdir(dst):
            raise IsADirectoryError(f"{self.fs.url(dst)} is a directory; not renaming onto it")
        data = self.fs.read_bytes(src)
        self.fs.write_atomic_in(*self._place(dst_path), data)  # never through a link
        self.fs.rm_file_in(*self._place(src_path))

    def _commit(self, directory: str) -> None:
        home = self._home(directory)  # where the markers go, as resolved at the start
        files = sorted(self._walk(directory))
        record = {"format": _COMMIT_FORMAT, "files": files}
        try:
            self.fs.write_atomic_in(home, COMMIT_NAME, json.dumps(record).encode(), exclusive=True)
        except FileExistsError as exc:
            raise FileExistsError(
                f"{self.fs.url(directory)}: another save committed there first; this "
                "save's files were written over its own in-progress ones, not over it"
            ) from exc
        with self._lock:
            self._pending.discard(directory)
            self._homes.pop(directory, None)
        try:
            self.fs.rm_file_in(home, PENDING_NAME)  # never through a link swapped in since
        except FileNotFoundError:
            pass

    # --- deleting ---------------------------------------------------------------------

    def delete(self, path: Path) -> None:
        self.fs.rm_file_in(*self._place(path))  # never through a link swapped in

    def rmdir(self, path: Path) -> None:
        directory = self._resolve(path)[0]
        refuse_link(self.fs, directory)  # its files are someone else's checkpoint
        commit = self._marker(directory, COMMIT_NAME)
        if self.fs.exists(commit):  # uncommit first: a partial deletion stays invisible
            self.fs.write_atomic_in(directory, PENDING_NAME, b"")  # never through a link
            self.fs.rm_file_in(directory, COMMIT_NAME)  # as every removal below
        for name in sorted(self._walk(directory), key=lambda n: n == PENDING_NAME):
            self.fs.rm_file_in(directory, name)  # never through a link swapped in meanwhile
        self.fs.rm_dir_in(directory)

    def _walk(self, directory: str) -> list[str]:
        """Every file under ``directory``, relative to it (markers included); a symbolic
        link (to a file or a directory) counts as a file."""
        found = []
        for name in self.fs.ls(directory):
            child = self.fs.concat_path(directory, name)
            # A link is a name of its own here, never walked into: ``rmdir`` removes the
            # link, not the files of whatever directory it points at.
            if not self.fs.is_link(child) and self._isdir(child):
                found += [f"{name}/{sub}" for sub in self._walk(child)]
            else:
                found.append(name)
        return found

    # --- reading and listing ----------------------------------------------------------

    def stream_read(self, path: Path, read_args: ReadArgs | None = None) -> io.RawIOBase:
        key = self._resolve(path)[0]
        if read_args is None or read_args.pre_read_full_file:
            return io.BytesIO(self.fs.read_bytes(key))  # type: ignore[return-value]
        size = read_args.known_size_bytes
        return _RangedReader(self.fs, key, self.fs.size(key) if size is None else size)

    def read(self, path: Path, read_args: ReadArgs | None = None) -> bytes:
        return self.fs.read_bytes(self._resolve(path)[0])

    def exists(self, path: Path) -> bool:
        key, staged = self._resolve(path)
        if not self.fs.exists(key):
            return False
        return staged is not None or not self._hidden(key)

    def ls(self, path: Path) -> list[str]:
        directory = self._resolve(path)[0]
        names = [n for n in self.fs.ls(directory) if n not in _MARKERS]
        return [n for n in names if not self._hidden(self.fs.concat_path(directory, n))]

    def getsize(self, path: Path) -> int:
        return self.fs.size(self._resolve(path)[0])

    def isdir(self, path: Path) -> bool:
        key = self._resolve(path)[0]
        return self._isdir(key) and not self._hidden(key)

    def _isdir(self, key: str) -> bool:
        # Object stores have no empty directories: a directory is a prefix with names.
        try:
            return bool(self.fs.ls(key))
        except (FileNotFoundError, NotADirectoryError):
            return False

    def remap_path(self, path: Path) -> str:
        return self.fs.url(self._resolve(path)[0])


class _Upload(io.RawIOBase):
    """A backend write stream as the file object torch_checkpointing writes into: the
    object is published when the ``with`` block ends cleanly and discarded when it
    raises (the backend's contract)."""

    def __init__(self, context: contextlib.AbstractContextManager[IO[bytes]]) -> None:
        super().__init__()
        self._context = context
        self._out = self._context.__enter__()

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._out.write(view)
        return view.nbytes

    def __exit__(self, *exc: Any) -> None:
        if not self.closed:
            super().close()
            self._context.__exit__(*exc)

    def close(self) -> None:
        self.__exit__(None, None, None)


class _RangedReader(io.RawIOBase):
    """A seekable reader that fetches ``[position, end)`` with one ranged request per
    seek, for the loader's parallel fill of a memory map."""

    def __init__(self, fs: FileSystemBase, key: str, size: int) -> None:
        super().__init__()
        self._fs, self._key, self._size = fs, key, size
        self._position = 0
        self._context: Any = None
        self._stream: Any = None

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._size}[whence]
        position = max(0, base + offset)
        if position != self._position:
            self._release()
            self._position = position
        return position

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        if self._position >= self._size or not view.nbytes:
            return 0
        if self._stream is None:
            self._context = self._fs.open_slice(
                self._key, self._position, self._size - self._position
            )
            self._stream = self._context.__enter__()
        count = int(self._stream.readinto(view) or 0)
        self._position += count
        return count

    def _release(self) -> None:
        if self._context is not None:
            self._context.__exit__(None, None, None)
        self._context = self._stream = None

    def close(self) -> None:
        if not self.closed:
            self._release()
        super().close()
