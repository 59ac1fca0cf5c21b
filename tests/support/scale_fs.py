"""A local-disk backend of ours that counts what each rank asks of storage, and can
make one rank fail or stall: the ground truth for tests/checkpoint/test_scale.py and
benchmarks/read_once.py (no client mock: it is a ``FileSystemBase`` like any other)."""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections import Counter
from collections.abc import Iterator
from typing import IO, Any

import torch.distributed as dist

from storage import LocalFileSystem
from storage.backends import cancel as cancelling


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class _Release:
    """Ends every stall of one filesystem, now and later (``set``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done = False
        self._waiting: list[threading.Event] = []

    def set(self) -> None:
        with self._lock:
            self._done = True
            waiting, self._waiting = self._waiting, []
        for event in waiting:
            event.set()

    def waiter(self) -> threading.Event:
        """An event set once ``set`` is called."""
        event = threading.Event()
        with self._lock:
            if self._done:
                event.set()
            else:
                self._waiting.append(event)
        return event


class _Blocking:
    """A write stream whose first write stalls (see ``ProbeFileSystem``)."""

    def __init__(self, inner: IO[bytes], owner: ProbeFileSystem) -> None:
        self.inner, self.owner, self.stalled = inner, owner, False

    def write(self, data: Any) -> int:
        if not self.stalled:
            self.stalled = True
            self.owner.stall_here()
        return self.inner.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class ProbeFileSystem(LocalFileSystem):
    """Local disk that counts requests (by method) and the bytes of data file reads.

    ``fail`` / ``stall``: ``(rank, "read" | "write")``: on that rank, data file reads
    (``open_slice``) or writes (the first ``write`` of a data file: inside torch's
    archive writer for a tensor of 1 MiB or more) raise ``OSError`` or stall. A stall
    is a request that hangs: it fails once :attr:`release` is set or, when
    ``interruptible``, once the task's ``Cancel`` fires (as our S3 and GCS requests
    do); after ``stall_seconds`` (if given) it completes normally."""

    def __init__(
        self,
        *,
        fail: tuple[int, str] | None = None,
        stall: tuple[int, str] | None = None,
        interruptible: bool = True,
        stall_seconds: float | None = None,
    ) -> None:
        super().__init__()
        self.fail, self.stall = fail, stall
        self.interruptible, self.stall_seconds = interruptible, stall_seconds
        self.release = _Release()
        self.requests: Counter[str] = Counter()
        self.data_bytes = 0
        self._lock = threading.Lock()

    def _count(self, method: str, nbytes: int = 0) -> None:
        with self._lock:
            self.requests[method] += 1
            self.data_bytes += nbytes

    def _fault(self, kind: str, path: str) -> bool:
        if self.fail == (_rank(), kind):
            raise OSError(f"injected {kind} failure on {os.path.basename(path)}")
        return self.stall == (_rank(), kind)

    def stall_here(self) -> None:
        """Hang as a stalled request does (see the class docstring)."""
        wake = self.release.waiter()
        cancel = cancelling.current() if self.interruptible else None
        with cancel.hook(wake.set) if cancel is not None else contextlib.nullcontext():
            if wake.wait(self.stall_seconds):
                raise OSError("stalled request interrupted")

    @contextlib.contextmanager
    def create_stream(self, path: str, mode: str, *, sync: bool = False) -> Iterator[IO[bytes]]:
        self._count("create_stream_" + mode)
        stall = mode == "wb" and path.endswith(".distcp") and self._fault("write", path)
        with super().create_stream(path, mode, sync=sync) as stream:
            yield _Blocking(stream, self) if stall else stream  # type: ignore[misc]

    @contextlib.contextmanager
    def open_slice(self, path: str, offset: int, length: int) -> Iterator[IO[bytes]]:
        self._count("open_slice", length)
        if self._fault("read", path):
            self.stall_here()
        with super().open_slice(path, offset, length) as stream:
            yield stream

    def read_bytes(self, path: str, *, limit: int | None = None) -> bytes:
        self._count("read_bytes")
        return super().read_bytes(path, limit=limit)

    def exists(self, path: str) -> bool:
        self._count("exists")
        return super().exists(path)

    def ls(self, path: str) -> list[str]:
        self._count("ls")
        return super().ls(path)

    def reset(self) -> None:
        with self._lock:
            self.requests.clear()
            self.data_bytes = 0

    def dump(self, path: str) -> None:
        """Write this rank's counts to ``path`` (JSON) for the parent process."""
        with open(path, "w") as out:
            json.dump({"requests": dict(self.requests), "data_bytes": self.data_bytes}, out)


def load_counts(directory: str, tag: str, world: int) -> list[dict[str, Any]]:
    """The counts each rank dumped as ``{tag}-{rank}.json`` under ``directory``."""
    counts = []
    for rank in range(world):
        with open(os.path.join(directory, f"{tag}-{rank}.json")) as f:
            counts.append(json.load(f))
    return counts
