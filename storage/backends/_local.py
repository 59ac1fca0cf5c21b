"""Local disk backend."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from typing import IO, ClassVar, cast

from extensions.streams import SliceView
from storage.backends.base import FileSystemBase


class LocalFileSystem(FileSystemBase):
    atomic_rename: ClassVar[bool] = True

    def __init__(self, *, storage_options: dict[str, object] | None = None) -> None:
        if storage_options:
            raise TypeError(
                f"local paths take no storage_options (got {sorted(storage_options)}); "
                "drop them or use an fsspec URL"
            )
        super().__init__()

    def init_path(self, path: str | os.PathLike[str]) -> str:
        text = os.fspath(path)
        if text.startswith("file://"):
            text = text[len("file://") :]
        return os.path.abspath(os.path.expanduser(text))

    def concat_path(self, path: str, suffix: str) -> str:
        return os.path.join(path, suffix)

    @contextlib.contextmanager
    def create_stream(self, path: str, mode: str, *, sync: bool = False) -> Iterator[IO[bytes]]:
        if mode == "rb":
            with open(path, "rb") as stream:
                yield stream
            return
        if mode != "wb":
            raise ValueError(f"unsupported mode {mode!r}: use 'rb' or 'wb'")
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        out = open(path, "wb")  # noqa: SIM115 - closed below on every path
        try:
            yield out
            out.flush()
            if sync:
                os.fsync(out.fileno())
        except BaseException:
            out.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            raise
        out.close()

    @contextlib.contextmanager
    def open_slice(self, path: str, offset: int, length: int) -> Iterator[IO[bytes]]:
        with open(path, "rb", buffering=0) as stream:
            yield cast(IO[bytes], SliceView(stream, offset, length))

    def write_atomic(self, path: str, data: bytes, *, exclusive: bool = False) -> None:
        directory = os.path.dirname(path) or "."
        os.makedirs(directory, exist_ok=True)
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
        try:
            with open(tmp, "wb") as stream:
                stream.write(data)
                stream.flush()
                os.fsync(stream.fileno())
            if exclusive:
                os.link(tmp, path)  # fails with FileExistsError, atomically
                os.unlink(tmp)
            else:
                os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        self.sync_dir(directory)

    def size(self, path: str) -> int:
        return os.stat(path).st_size

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def modified(self, path: str) -> float | None:
        return os.stat(path).st_mtime

    def rm_file(self, path: str) -> None:
        os.unlink(path)

    def is_link(self, path: str) -> bool:
        return os.path.islink(path)

    def ls(self, path: str) -> list[str]:
        return sorted(os.listdir(path))

    def mkdir(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def rm_dir(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.rmdir(path)

    def sync_dir(self, path: str) -> None:
        # The parent too: a checkpoint directory created by this save is itself a name.
        for directory in (path, os.path.dirname(path.rstrip(os.sep)) or os.sep):
            fd = os.open(directory, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def rename(self, path: str, new_path: str) -> None:
        os.replace(path, new_path)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        text = os.fspath(checkpoint_id)
        return "://" not in text or text.startswith("file://")
