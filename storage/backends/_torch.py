"""``TorchFileSystem``: any torch-style ``FileSystemBase`` as one of our backends."""

from __future__ import annotations

import contextlib
import io
import os
import uuid
from collections.abc import Iterator
from typing import IO, Any, cast

from storage.backends import _local_files, _local_links, _local_removal, _local_writes
from storage.backends.base import FileSystemBase

# torch.distributed.checkpoint.filesystem.FileSystemBase's abstract methods (torch 2.x).
_TORCH_METHODS = (
    "create_stream",
    "concat_path",
    "init_path",
    "mkdir",
    "exists",
    "rm_file",
    "rename",
)


class TorchFileSystem(FileSystemBase):
    """Adapt an implementation of torch's ``FileSystemBase`` (torch's own local
    ``FileSystem`` or fsspec ``FileSystem``, s3torchconnector's ``S3FileSystem``, ...)
    to this contract, so a checkpoint written through it gets our transforms,
    checksums and commit protocol::

        from s3torchconnector.dcp import S3FileSystem
        fs = storage.TorchFileSystem(S3FileSystem(region="us-east-1"))
        writer = storage.CheckpointWriter("s3://bucket/ckpt", filesystem=fs)

    Paths are the wrapped filesystem's, as strings. What torch's contract cannot give,
    the adapter gives as follows (docs/backends.md):

    * ranged reads: ``open_slice`` opens the whole object and seeks (the wrapped
      stream must be seekable); nothing is fetched by byte range;
    * atomic publish: ``write_atomic`` writes a temporary object and renames it over
      the target, as stock DCP commits its metadata; ``exclusive=True`` checks
      ``exists`` first, so two concurrent saves with ``overwrite=False`` can both win
      (on local disk it publishes as the local backend does, with no such race);
    * durability: ``sync=True`` fsyncs streams that have a file descriptor; directory
      entries are not synced, and ``rm_dir`` does nothing;
    * writes create parent directories with ``mkdir``, and a failed write removes
      its object with ``rm_file``; ``size`` opens the object and seeks to its end;
    * ``ls`` needs the wrapped filesystem's ``ls`` (not in torch's abstract contract);
      ``rm_file`` of a missing path raises whatever the wrapped filesystem raises;
    * ``rename`` is the wrapped filesystem's, its atomicity unknown (``atomic_rename``
      is ``False``), except on local disk: ``os.replace``, which never moves a file
      into a directory found at the new name;
    * symbolic links: told (``is_link``, ``realpath``, ``resolve_link``) on local disk
      (torch's own ``FileSystem``, torch's fsspec ``FileSystem`` on ``file://``), so
      deletion never goes through one and a neighbour's link at the checkpoint path
      is refused there; other wrapped filesystems are taken to have none.
    """

    def __init__(self, torch_fs: Any, *, storage_options: dict[str, Any] | None = None) -> None:
        missing = [m for m in _TORCH_METHODS if not callable(getattr(torch_fs, m, None))]
        if missing:
            raise TypeError(
                f"{torch_fs!r} is not a torch FileSystemBase implementation: it has no "
                f"{', '.join(missing)}"
            )
        super().__init__(storage_options=storage_options)
        self.torch_fs = torch_fs

    def init_path(self, path: str | os.PathLike[str]) -> str:
        text = os.fspath(self.torch_fs.init_path(path))
        # Torch keeps a relative local path (or file:// URL) relative: resolved now, as
        # the local backend resolves it, it names one directory for the whole save,
        # whatever the process (or its persist worker, started elsewhere) takes as
        # current meanwhile.
        local = self._local_file(text)
        scheme, sep, rest = text.rpartition("://")
        if local is None or os.path.isabs(rest):
            return text
        return f"{scheme}{sep}{os.path.abspath(local)}"

    def own_path(self, path: str | os.PathLike[str]) -> str:
        return os.fspath(path)  # the wrapped filesystem's own forms, URLs included

    def rename(self, path: str, new_path: str) -> None:
        local, new_local = self._local_file(path), self._local_file(new_path)
        if local is not None and new_local is not None:  # fsspec's mv moves into a directory
            os.replace(local, new_local)
            return
        self.torch_fs.rename(path, new_path)

    def rm_file_in(self, directory: str, name: str) -> None:
        local = self._local_file(directory)
        if local is not None:  # never through a link (_local_removal.remove_file)
            _local_removal.remove_file(local, name)
            return
        super().rm_file_in(directory, name)

    def rename_in(self, directory: str, name: str, new_name: str) -> None:
        local = self._local_file(directory)
        if local is not None:
            _local_removal.rename_in(local, name, new_name)
            return
        super().rename_in(directory, name, new_name)

    def create_stream_in(
        self, directory: str, name: str, mode: str = "wb", *, sync: bool = False
    ) -> contextlib.AbstractContextManager[IO[bytes]]:
        local = self._walked(directory, "create_stream")
        if mode == "wb" and local is not None:  # never through a link on the way
            return _local_writes.write_stream_in(local, name, sync=sync)
        return super().create_stream_in(directory, name, mode, sync=sync)

    def write_atomic_in(
        self, directory: str, name: str, data: bytes, *, exclusive: bool = False
    ) -> None:
        local = self._walked(directory, "write_atomic")
        if local is not None:
            _local_writes.write_atomic_in(local, name, bytes(data), exclusive=exclusive)
            return
        super().write_atomic_in(directory, name, data, exclusive=exclusive)

    def _walked(self, directory: str, method: str) -> str | None:
        """``directory`` on local disk where writes there walk directory handles (unless
        a subclass wraps ``method``: it then sees them by path), else ``None``."""
        if _local_writes.overridden(self, TorchFileSystem, method):
            return None
        return self._local_file(directory)

    def is_link(self, path: str) -> bool:
        local = self._local_file(path)
        return local is not None and os.path.islink(local)

    def realpath(self, path: str) -> str:
        local = self._local_file(path)
        return path if local is None else _as_given(path, local, os.path.realpath(local))

    def resolve_link(self, path: str) -> str:
        local = self._local_file(path)
        if local is None:
            return path
        return _as_given(path, local, _local_links.trusted_target(local))

    def _local(self) -> bool:
        from torch.distributed.checkpoint.filesystem import FileSystem

        return type(self.torch_fs) is FileSystem  # torch's local disk, not a subclass

    def _local_file(self, path: str) -> str | None:
        """``path`` on local disk where the wrapped filesystem writes there (torch's own
        ``FileSystem``, torch's fsspec ``FileSystem`` on ``file://``), else ``None``: its
        files are then written as the local backend writes them, never through a link,
        into a FIFO or into another user's file planted at the name, and read never
        through a link or from a FIFO (torch opens with ``open(path, "wb")`` and
        ``open(path, "rb")``)."""
        if self._local():
            return path
        if not _is_torch_fsspec(self.torch_fs):
            return None
        # fsspec is optional here; torch's fsspec filesystem has imported it already.
        from fsspec.implementations.local import LocalFileSystem as FsspecLocalFileSystem

        client = getattr(self.torch_fs, "fs", None)
        if isinstance(client, FsspecLocalFileSystem):
            return str(client._strip_protocol(path))
        return None

    def concat_path(self, path: str, suffix: str) -> str:
        return os.fspath(self.torch_fs.concat_path(path, suffix))

    @contextlib.contextmanager
    def create_stream(self, path: str, mode: str, *, sync: bool = False) -> Iterator[IO[bytes]]:
        local = self._local_file(path)
        if mode == "rb":
            if local is not None:
                with _local_files.open_regular(local) as stream:
                    yield stream
                return
            with self.torch_fs.create_stream(path, "rb") as stream:
                yield cast(IO[bytes], stream)
            return
        if mode != "wb":
            raise ValueError(f"unsupported mode {mode!r}: use 'rb' or 'wb'")
        if local is not None:
            with _local_files.write_stream(local, sync=sync) as stream:
                yield stream
            return
        parent = os.path.dirname(path)
        if parent:
            self.torch_fs.mkdir(parent)
        try:
            with self.torch_fs.create_stream(path, "wb") as stream:
                yield cast(IO[bytes], stream)
                stream.flush()
                if sync:
                    _fsync(stream)
        except BaseException:
            with contextlib.suppress(Exception):
                self.torch_fs.rm_file(path)
            raise

    def write_atomic(self, path: str, data: bytes, *, exclusive: bool = False) -> None:
        local = self._local_file(path)
        if local is not None:  # as the local backend publishes: no race on exclusive
            _local_files.write_atomic(local, bytes(data), exclusive=exclusive)
            return
        if exclusive and self.exists(path):
            raise FileExistsError(path)
        temporary = f"{path}.{uuid.uuid4().hex[:12]}.tmp"
        with self.create_stream(temporary, "wb", sync=True) as stream:
            stream.write(data)
        try:
            self.torch_fs.rename(temporary, path)
        except BaseException:
            with contextlib.suppress(Exception):
                self.torch_fs.rm_file(temporary)
            raise

    def open_slice(
        self, path: str, offset: int, length: int
    ) -> contextlib.AbstractContextManager[IO[bytes]]:
        local = self._local_file(path)
        if local is not None:
            return _local_files.open_slice(local, offset, length)
        return super().open_slice(path, offset, length)

    def size(self, path: str) -> int:
        with self.create_stream(path, "rb") as stream:
            stream.seek(0, os.SEEK_END)
            return int(stream.tell())

    def exists(self, path: str) -> bool:
        return bool(self.torch_fs.exists(path))

    def rm_file(self, path: str) -> None:
        self.torch_fs.rm_file(path)

    def ls(self, path: str) -> list[str]:
        ls = getattr(self.torch_fs, "ls", None)
        if ls is None:
            raise NotImplementedError(f"{type(self.torch_fs).__name__} has no ls")
        return sorted({os.path.basename(os.fspath(p).rstrip("/")) for p in ls(path)})

    def mkdir(self, path: str) -> None:
        self.torch_fs.mkdir(path)


def _is_torch_fsspec(torch_fs: Any) -> bool:
    """``torch_fs`` is torch's fsspec ``FileSystem`` itself (not a subclass, whose
    ``create_stream`` may do something else): named by its module, which is private."""
    cls = type(torch_fs)
    return (cls.__module__, cls.__qualname__) == (
        "torch.distributed.checkpoint._fsspec_filesystem",
        "FileSystem",
    )


def _fsync(stream: Any) -> None:
    try:
        os.fsync(stream.fileno())
    except (AttributeError, OSError, io.UnsupportedOperation):
        pass  # no file descriptor: the wrapped filesystem's close is its commit


def _as_given(path: str, local: str, found: str) -> str:
    """``found`` (a local path found from ``local``, which ``path`` names on local disk)
    in the form ``path`` was given: a ``file://`` URL stays one, and a plain path stays
    plain even where a directory's name holds ``://``."""
    if path == local or not path.endswith(local):
        return found if path == local else f"file://{found}"
    return path[: len(path) - len(local)] + found
