"""In-memory backend: the reference behaviour for tests, with object-store semantics."""

from __future__ import annotations

import contextlib
import io
import os
import posixpath
import threading
import uuid
import weakref
from collections.abc import Iterator
from typing import IO, Any, ClassVar

from storage.backends.base import FileSystemBase


class MemoryFileSystem(FileSystemBase):
    local_reads: ClassVar[bool] = True
    """Objects in a dict keyed by ``/``-separated path.

    Like an object store it has no real directories (``mkdir`` only records a marker so
    ``exists`` and ``ls`` see empty prefixes) and no rename.

    Stores are named and process-wide, as fsspec's ``memory://`` is process-global: the
    URL ``dcpmem://NAME/path`` is ``path`` in the store ``NAME``, so a save and a later
    load by URL meet in the same store, and instances with the same ``name`` (or a
    pickled copy, in this process) share it. A named store lives until
    :meth:`drop_store`; the store of an instance made without a name (``url()`` gives
    its URL) lives as long as that instance. An instance serves paths in its own store:
    given a ``dcpmem://`` URL naming another store, it keeps that name as the first
    path component."""

    SCHEME: ClassVar[str] = "dcpmem://"
    _stores: ClassVar[dict[str, tuple[dict[str, bytes], set[str], threading.Lock]]] = {}
    _stores_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(
        self, name: str | None = None, *, storage_options: dict[str, object] | None = None
    ) -> None:
        super().__init__()
        self.name = name or uuid.uuid4().hex
        self._attach()
        if name is None:
            # Nobody named it: unlist it with its instance (copies keep their reference).
            weakref.finalize(self, self._stores.pop, self.name, None)

    @classmethod
    def from_url(
        cls, url: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None
    ) -> MemoryFileSystem:
        name = os.fspath(url)[len(cls.SCHEME) :].partition("/")[0]
        if not name:
            raise ValueError(f"{os.fspath(url)!r}: name the store, as in dcpmem://NAME/path")
        return cls(name, storage_options=storage_options)

    @classmethod
    def drop_store(cls, name: str) -> None:
        """Forget the store ``name`` and free its objects (instances still attached to
        it see it empty); a later ``dcpmem://NAME/...`` starts a new, empty store."""
        with cls._stores_lock:
            store = cls._stores.pop(name, None)
        if store is not None:
            objects, dirs, lock = store
            with lock:
                objects.clear()
                dirs.clear()

    def _attach(self) -> None:
        with self._stores_lock:
            store = self._stores.setdefault(self.name, ({}, set(), threading.Lock()))
        self.objects, self.dirs, self._lock = store

    def __getstate__(self) -> dict[str, object]:
        return {"name": self.name, "storage_options": self.storage_options}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._attach()

    @property
    def in_process(self) -> bool:
        return True

    def init_path(self, path: str | os.PathLike[str]) -> str:
        text = os.fspath(path)
        if text.startswith(self.SCHEME):
            name, _, rest = text[len(self.SCHEME) :].partition("/")
            text = rest if name == self.name else f"{name}/{rest}"
        return text.removeprefix("/").rstrip("/")

    def concat_path(self, path: str, suffix: str) -> str:
        return posixpath.join(path, suffix) if path else suffix

    @contextlib.contextmanager
    def create_stream(self, path: str, mode: str, *, sync: bool = False) -> Iterator[IO[bytes]]:
        if mode == "rb":
            with self._lock:
                if path not in self.objects:
                    raise FileNotFoundError(path)
                data = self.objects[path]
            yield io.BytesIO(data)
            return
        if mode != "wb":
            raise ValueError(f"unsupported mode {mode!r}: use 'rb' or 'wb'")
        buffer = io.BytesIO()
        yield buffer
        with self._lock:
            self.objects[path] = buffer.getvalue()

    def write_atomic(self, path: str, data: bytes, *, exclusive: bool = False) -> None:
        with self._lock:
            if exclusive and path in self.objects:
                raise FileExistsError(path)
            self.objects[path] = bytes(data)

    def size(self, path: str) -> int:
        with self._lock:
            if path not in self.objects:
                raise FileNotFoundError(path)
            return len(self.objects[path])

    def exists(self, path: str) -> bool:
        with self._lock:
            return path in self.objects or self._is_dir(path)

    def _is_dir(self, path: str) -> bool:
        prefix = path.rstrip("/") + "/" if path else ""
        return path in self.dirs or any(k.startswith(prefix) for k in self.objects)

    def rm_file(self, path: str) -> None:
        with self._lock:
            if self.objects.pop(path, None) is None:
                raise FileNotFoundError(path)

    def rename(self, path: str, new_path: str) -> None:
        with self._lock:  # a move in one step, as on local disk
            if path not in self.objects:
                raise FileNotFoundError(path)
            self.objects[new_path] = self.objects.pop(path)

    def ls(self, path: str) -> list[str]:
        prefix = path.rstrip("/") + "/" if path else ""
        with self._lock:
            names = {
                k[len(prefix) :].split("/", 1)[0] for k in self.objects if k.startswith(prefix)
            }
            names |= {d[len(prefix) :].split("/", 1)[0] for d in self.dirs if d.startswith(prefix)}
            if not names and not self._is_dir(path):
                raise FileNotFoundError(path)
        return sorted(n for n in names if n)

    def mkdir(self, path: str) -> None:
        with self._lock:
            self.dirs.add(path.rstrip("/"))

    def rm_dir(self, path: str) -> None:
        with self._lock:
            self.dirs.discard(path.rstrip("/"))

    def url(self, path: str) -> str:
        return f"{self.SCHEME}{self.name}/{path}"
