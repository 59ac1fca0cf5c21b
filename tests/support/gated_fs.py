"""A local-disk backend of ours that holds a copy in the middle of a data file, across
processes: the first write of a data file goes through, marks ``gate_dir/started``, then
waits until ``gate_dir/open`` exists. Tests kill the writer (a persist worker, a ``cp``
process) while it is held there, with no timing window. It pickles, so the persist
worker receives it like any backend (no client mock: a ``FileSystemBase`` like any
other)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from storage import LocalFileSystem
from storage.checkpoint import storage_format as fmt

#: How long a held write waits for ``open`` before going on (generous: CI is loaded).
HOLD_AT_MOST = 300.0


class GatedFileSystem(LocalFileSystem):
    def __init__(self, gate_dir: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.gate_dir = gate_dir

    @contextlib.contextmanager
    def create_stream(self, path: str, mode: str, *, sync: bool = False) -> Iterator[IO[bytes]]:
        with super().create_stream(path, mode, sync=sync) as stream:
            if "w" in mode and path.endswith(fmt.DATA_SUFFIX):
                yield _Held(stream, Path(self.gate_dir))  # type: ignore[misc]
            else:
                yield stream


class _Held:
    def __init__(self, inner: IO[bytes], gate: Path) -> None:
        self.inner, self.gate, self.held = inner, gate, False

    def write(self, data: Any) -> int:
        n = self.inner.write(data)
        if not self.held:
            self.held = True
            self.inner.flush()
            (self.gate / "started").touch()
            deadline = time.monotonic() + HOLD_AT_MOST
            while not (self.gate / "open").exists() and time.monotonic() < deadline:
                time.sleep(0.01)
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def wait_for(path: Path, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.01)
