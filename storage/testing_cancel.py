"""``CancellationTests``: the checks of :class:`storage.testing.FileSystemTests` for
requests made under a cancelled :class:`~storage.backends.cancel.Cancel` (a save or
load past its deadline). Backends get them by subclassing ``FileSystemTests``; use this
module only from tests."""

from __future__ import annotations

from typing import TYPE_CHECKING

from extensions.testing import payload
from storage.backends.base import FileSystemBase
from storage.backends.cancel import Cancel, installed


class CancellationTests:
    """Mixed into ``FileSystemTests``, whose hooks (``fs``, ``root``, the bypass) these
    checks use."""

    if TYPE_CHECKING:  # provided by FileSystemTests' subclasses; declared for the checks

        def bypass_write(self, fs: FileSystemBase, path: str, data: bytes) -> None: ...

        def bypass_read(self, fs: FileSystemBase, path: str) -> bytes: ...

    def test_a_live_cancel_changes_nothing(self, fs: FileSystemBase, root: str) -> None:
        """Requests of a thread with a Cancel installed and not cancelled behave as
        without one, and the thread's previous Cancel comes back after the block."""
        path = fs.concat_path(root, "obj.bin")
        data = payload(100_000)
        with installed(Cancel()):
            with fs.create_stream(path, "wb") as stream:
                stream.write(data)
            with fs.open_slice(path, 10, 1000) as view:
                assert view.read() == data[10:1010]
        assert self.bypass_read(fs, path) == data

    def test_a_write_cancelled_midway_publishes_nothing(
        self, fs: FileSystemBase, root: str
    ) -> None:
        """A write whose task is cancelled between two writes (another thread, past the
        deadline) raises ``InterruptedError`` on an interruptible backend, and leaves
        what was at the path before; a backend that is not interruptible completes it."""
        path = fs.concat_path(root, "obj.bin")
        self.bypass_write(fs, path, b"before")
        data = payload(200_000)
        task = Cancel()
        raised = False
        with installed(task):
            try:
                with fs.create_stream(path, "wb") as stream:
                    stream.write(data[:100_000])
                    task.cancel()
                    stream.write(data[100_000:])
            except InterruptedError:
                raised = True
        if fs.interruptible:
            assert raised, f"{type(fs).__name__} is interruptible but finished a cancelled write"
        assert self.bypass_read(fs, path) == (b"before" if raised else data)
        assert fs.pending_uploads(root) == []

    def test_a_read_under_a_cancelled_task_raises_or_reads_everything(
        self, fs: FileSystemBase, root: str
    ) -> None:
        """A cancelled task's read never returns short or wrong bytes: it raises
        ``InterruptedError`` (interruptible backends must) or returns them all."""
        path = fs.concat_path(root, "obj.bin")
        data = payload(300_000)
        self.bypass_write(fs, path, data)
        task = Cancel()
        task.cancel()
        got: bytes | None = None
        with installed(task):
            try:
                with fs.open_slice(path, 1000, 250_000) as view:
                    got = view.read()
            except InterruptedError:
                got = None
        if fs.interruptible:
            assert got is None, f"{type(fs).__name__} is interruptible but read when cancelled"
        else:
            assert got == data[1000:251_000]
