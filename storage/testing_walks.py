"""``DirectoryWriteTests``: the checks of :class:`storage.testing.FileSystemTests` for
writes of a checkpoint's files inside its directory (``create_stream_in``,
``write_atomic_in``): they write as ``create_stream`` and ``write_atomic`` do, and where
the backend has symbolic links never through one at the directory or below it. Backends
get them by subclassing ``FileSystemTests``; use this module only from tests."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from extensions.errors import UnsafeCheckpointError
from storage.backends.base import FileSystemBase


class DirectoryWriteTests:
    """Mixed into ``FileSystemTests``, whose hooks (``fs``, ``root``, the bypass) these
    checks use."""

    if TYPE_CHECKING:  # provided by FileSystemTests' subclasses; declared for the checks

        def bypass_write(self, fs: FileSystemBase, path: str, data: bytes) -> None: ...

        def bypass_read(self, fs: FileSystemBase, path: str) -> bytes: ...

        def bypass_link(self, fs: FileSystemBase, target: str, link: str) -> None: ...

    def test_writes_inside_a_directory(self, fs: FileSystemBase, root: str) -> None:
        """What a save writes with: ``create_stream_in`` writes a name (under a key
        prefix too, its directories made) inside a directory that need not exist yet,
        and removes it when the block raises; ``write_atomic_in`` publishes and
        replaces one, and with ``exclusive`` refuses one that is there."""
        step = fs.concat_path(root, "step")
        with fs.create_stream_in(step, "a.bin", sync=True) as out:
            out.write(b"a")
        with fs.create_stream_in(step, "0a/b.bin") as out:
            out.write(b"b")
        assert self.bypass_read(fs, fs.concat_path(step, "a.bin")) == b"a"
        assert self.bypass_read(fs, fs.concat_path(fs.concat_path(step, "0a"), "b.bin")) == b"b"
        with pytest.raises(RuntimeError, match="boom"), fs.create_stream_in(step, "c.bin") as out:
            out.write(b"partial")
            raise RuntimeError("boom")
        assert not fs.exists(fs.concat_path(step, "c.bin"))
        fs.write_atomic_in(step, "meta", b"first")
        fs.write_atomic_in(step, "meta", b"second")
        assert self.bypass_read(fs, fs.concat_path(step, "meta")) == b"second"
        with pytest.raises(FileExistsError):
            fs.write_atomic_in(step, "meta", b"third", exclusive=True)
        fs.write_atomic_in(step, "0a/fresh", b"ok", exclusive=True)
        assert self.bypass_read(fs, fs.concat_path(step, "meta")) == b"second"
        assert self.bypass_read(fs, fs.concat_path(fs.concat_path(step, "0a"), "fresh")) == b"ok"

    def test_writes_inside_a_directory_never_go_through_a_link(
        self, fs: FileSystemBase, root: str
    ) -> None:
        """Where the backend has links: a checkpoint directory, or a directory below it,
        that is a link (swapped in by whoever can write its parent) is refused by
        ``create_stream_in`` and ``write_atomic_in`` with ``UnsafeCheckpointError``, and
        nothing lands in its target; the directory it resolves to (a link the user named,
        resolved once) is written as any other."""
        victim = fs.concat_path(root, "victim")
        self.bypass_write(fs, fs.concat_path(victim, "meta"), b"victim's")
        step = fs.concat_path(root, "step")
        self.bypass_link(fs, victim, step)
        with pytest.raises(UnsafeCheckpointError), fs.create_stream_in(step, "a.bin") as out:
            out.write(b"ours")
        with pytest.raises(UnsafeCheckpointError):
            fs.write_atomic_in(step, "meta", b"ours")
        real = fs.concat_path(root, "real")
        self.bypass_write(fs, fs.concat_path(real, "kept.bin"), b"k")
        self.bypass_link(fs, victim, fs.concat_path(real, "0a"))
        with pytest.raises(UnsafeCheckpointError), fs.create_stream_in(real, "0a/b.bin") as out:
            out.write(b"ours")
        with pytest.raises(UnsafeCheckpointError):
            fs.write_atomic_in(real, "0a/meta", b"ours")
        assert fs.ls(victim) == ["meta"]
        assert self.bypass_read(fs, fs.concat_path(victim, "meta")) == b"victim's"
        fs.write_atomic_in(fs.realpath(step), "meta2", b"resolved")
        assert self.bypass_read(fs, fs.concat_path(victim, "meta2")) == b"resolved"
