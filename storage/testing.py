"""``FileSystemTests``: the conformance suite every backend subclasses.

A backend's test module subclasses :class:`FileSystemTests` and provides three
fixtures - ``fs`` (the backend under test), ``root`` (a fresh, empty path in that
backend's form for each test) - and the *bypass* hooks, which reach the same storage
without going through the backend (plain ``open`` for local disk, boto3 for S3, the
emulator's JSON API for GCS...), so every behaviour is checked against ground truth
rather than against the backend itself::

    class TestMyBackend(FileSystemTests):
        @pytest.fixture
        def fs(self): return MyFileSystem(...)
        @pytest.fixture
        def root(self, fs): return fs.init_path("my://bucket/" + uuid4().hex)
        def bypass_write(self, fs, path, data): ...
        def bypass_read(self, fs, path): ...

A test class pytest collects (its name starts with ``Test``) that lacks one of the
four fails when it is defined, with a ``TypeError`` naming each one it lacks; a mixin
may provide them (``tests/support/local_disk.py`` provides ``root`` and the bypass hooks for
backends that store plain files).
"""

from __future__ import annotations

import io
import os
import pathlib
import pickle
import time
from typing import Any, ClassVar

import pytest

from extensions.testing import ConformanceSuite
from storage.backends.base import FileSystemBase
from storage.testing_cancel import CancellationTests
from storage.testing_walks import DirectoryWriteTests

_SIZES = {"empty": 0, "small": 1, "block": 64 * 1024 + 3, "multi_mb": 5 * 1024 * 1024 + 17}


def _payload(n: int) -> bytes:
    # Distinct bytes at every offset, so an off-by-one in a slice read shows up.
    return (bytes(range(251)) * (n // 251 + 1))[:n]


class FileSystemTests(CancellationTests, DirectoryWriteTests, ConformanceSuite):
    """Conformance checks (those of cancelled requests in :mod:`storage.testing_cancel`,
    of writes inside a directory in :mod:`storage.testing_walks`);
    see the module docstring for the fixtures to provide."""

    # --- hooks a subclass provides ---------------------------------------------------

    required_hooks: ClassVar[dict[str, str]] = {
        "fs": "fixture: the backend under test",
        "root": "fixture: a fresh, empty path in the backend's form for each test",
        "bypass_write": "method: write bytes to a path without the backend",
        "bypass_read": "method: read a path's bytes without the backend",
    }

    @pytest.fixture
    def fs(self) -> FileSystemBase:
        raise NotImplementedError(f"{type(self).__qualname__} provides no `fs` fixture")

    @pytest.fixture
    def root(self, fs: FileSystemBase) -> str:
        raise NotImplementedError(f"{type(self).__qualname__} provides no `root` fixture")

    def bypass_write(self, fs: FileSystemBase, path: str, data: bytes) -> None:
        raise NotImplementedError(f"{type(self).__qualname__} provides no `bypass_write`")

    def bypass_read(self, fs: FileSystemBase, path: str) -> bytes:
        raise NotImplementedError(f"{type(self).__qualname__} provides no `bypass_read`")

    # Optional hooks: a backend that has the feature provides them; the tests that need
    # one skip where it is not provided.

    def bypass_link(self, fs: FileSystemBase, target: str, link: str) -> None:
        """Make ``link`` a symbolic link to ``target`` (backends that have links)."""
        pytest.skip(f"{type(self).__qualname__} has no symbolic links")

    def bypass_begin_upload(self, fs: FileSystemBase, path: str) -> None:
        """Begin an upload to ``path`` and leave it unfinished (backends whose
        unfinished uploads stay behind invisibly, as S3's multipart uploads)."""
        pytest.skip(f"{type(self).__qualname__} leaves no unfinished uploads")

    # --- writes, checked through the bypass ------------------------------------------

    @pytest.mark.parametrize("size", list(_SIZES.values()), ids=list(_SIZES))
    def test_write_then_bypass_read(self, fs: FileSystemBase, root: str, size: int) -> None:
        path = fs.concat_path(root, "obj.bin")
        data = _payload(size)
        with fs.create_stream(path, "wb") as stream:
            for start in range(0, size, 1 << 20):
                stream.write(data[start : start + (1 << 20)])
        assert self.bypass_read(fs, path) == data
        assert fs.size(path) == size
        assert fs.exists(path)

    @pytest.mark.parametrize("size", list(_SIZES.values()), ids=list(_SIZES))
    def test_bypass_write_then_read(self, fs: FileSystemBase, root: str, size: int) -> None:
        path = fs.concat_path(root, "obj.bin")
        data = _payload(size)
        self.bypass_write(fs, path, data)
        with fs.create_stream(path, "rb") as stream:
            assert stream.read() == data
        assert fs.read_bytes(path) == data

    def test_parents_are_created(self, fs: FileSystemBase, root: str) -> None:
        path = fs.concat_path(fs.concat_path(fs.concat_path(root, "a"), "b"), "c.bin")
        with fs.create_stream(path, "wb") as stream:
            stream.write(b"nested")
        assert self.bypass_read(fs, path) == b"nested"
        assert fs.ls(fs.concat_path(root, "a")) == ["b"]

    def test_failed_write_leaves_nothing(self, fs: FileSystemBase, root: str) -> None:
        path = fs.concat_path(root, "partial.bin")
        with pytest.raises(RuntimeError, match="boom"), fs.create_stream(path, "wb") as stream:
            stream.write(_payload(100_000))
            raise RuntimeError("boom")
        assert not fs.exists(path)

    def test_overwrite_replaces(self, fs: FileSystemBase, root: str) -> None:
        path = fs.concat_path(root, "obj.bin")
        self.bypass_write(fs, path, b"old content that is longer")
        with fs.create_stream(path, "wb") as stream:
            stream.write(b"new")
        assert self.bypass_read(fs, path) == b"new"

    # --- missing paths ---------------------------------------------------------------

    def test_missing_paths_raise_file_not_found(self, fs: FileSystemBase, root: str) -> None:
        missing = fs.concat_path(root, "missing.bin")
        assert not fs.exists(missing)
        with pytest.raises(FileNotFoundError), fs.create_stream(missing, "rb") as stream:
            stream.read()
        with pytest.raises(FileNotFoundError):
            fs.read_bytes(missing)
        with pytest.raises(FileNotFoundError):
            fs.size(missing)
        with pytest.raises(FileNotFoundError):
            fs.rm_file(missing)
        with pytest.raises(FileNotFoundError):
            fs.ls(fs.concat_path(root, "no-such-dir"))
        with pytest.raises(FileNotFoundError), fs.open_slice(missing, 0, 10) as stream:
            stream.read()

    # --- listing and removal ---------------------------------------------------------

    def test_ls_and_rm(self, fs: FileSystemBase, root: str) -> None:
        for name in ("b.bin", "a.bin"):
            self.bypass_write(fs, fs.concat_path(root, name), b"x")
        self.bypass_write(fs, fs.concat_path(fs.concat_path(root, "sub"), "c.bin"), b"y")
        assert fs.ls(root) == ["a.bin", "b.bin", "sub"]
        fs.rm_file(fs.concat_path(root, "a.bin"))
        assert fs.ls(root) == ["b.bin", "sub"]
        assert not fs.exists(fs.concat_path(root, "a.bin"))

    def _assert_directory_gone(self, fs: FileSystemBase, root: str, name: str) -> None:
        """``root/name`` is no longer listed, where the backend removes directories."""
        if type(fs).rm_dir is FileSystemBase.rm_dir:
            return  # a backend without directories (or that cannot remove them)
        try:
            names = fs.ls(root)
        except FileNotFoundError:
            names = []  # an object store: nothing is left under the prefix
        assert name not in names

    def test_removal_inside_a_directory(self, fs: FileSystemBase, root: str) -> None:
        """What deletion uses: ``rm_file_in`` removes a name (nested ones too) under a
        directory, ``FileNotFoundError`` for a missing one; ``rename_in`` moves one
        there; ``rm_dir_in`` removes an empty directory and never a file."""
        step = fs.concat_path(root, "step")
        self.bypass_write(fs, fs.concat_path(step, "a.bin"), b"a")
        self.bypass_write(fs, fs.concat_path(fs.concat_path(step, "0a"), "b.bin"), b"b")
        fs.rename_in(step, "a.bin", "moved.bin")
        assert self.bypass_read(fs, fs.concat_path(step, "moved.bin")) == b"a"
        fs.rm_file_in(step, "moved.bin")
        fs.rm_file_in(step, "0a/b.bin")
        with pytest.raises(FileNotFoundError):
            fs.rm_file_in(step, "0a/b.bin")
        fs.rm_dir_in(step, "0a")
        fs.rm_dir_in(step)
        assert not fs.exists(fs.concat_path(step, "moved.bin"))
        self._assert_directory_gone(fs, root, "step")

    def test_modified_is_the_writes_time_or_unknown(self, fs: FileSystemBase, root: str) -> None:
        """``gc`` deletes leftovers by age: a backend tells the time of the last write
        (this machine's clock, within the store's skew) or ``None``, never a guess."""
        path = fs.concat_path(root, "obj.bin")
        before = time.time()
        self.bypass_write(fs, path, b"x")
        stamp = fs.modified(path)
        if stamp is None:
            return
        assert before - 300 <= stamp <= time.time() + 300
        with pytest.raises(FileNotFoundError):
            fs.modified(fs.concat_path(root, "missing.bin"))

    def test_directories_come_and_go_with_their_files(self, fs: FileSystemBase, root: str) -> None:
        """``mkdir`` is idempotent; ``rm_dir`` removes an empty directory and never a
        file (a no-op, or an ``OSError``, on a directory that still holds one; a backend
        that does not override it has no directories to remove); ``sync_dir`` on a
        directory that holds files keeps them."""
        sub = fs.concat_path(root, "sub")
        fs.mkdir(sub)
        fs.mkdir(sub)
        path = fs.concat_path(sub, "kept.bin")
        self.bypass_write(fs, path, b"kept")
        fs.sync_dir(sub)
        try:
            fs.rm_dir(sub)
        except OSError:
            pass
        assert self.bypass_read(fs, path) == b"kept"
        fs.rm_file(path)
        fs.rm_dir(sub)
        self._assert_directory_gone(fs, root, "sub")

    def test_links_are_told_and_resolved(self, fs: FileSystemBase, root: str) -> None:
        """Deletion never goes through a link: ``is_link`` tells one, ``realpath``
        names where its files really are, and a plain path is neither; ``resolve_link``
        leaves a plain path as it is and follows the user's own link (one of another
        user's, refused, needs root to make: ``tests/hostile/test_swapped_writes.py``)."""
        real = fs.concat_path(root, "real")
        self.bypass_write(fs, fs.concat_path(real, "obj.bin"), b"x")
        assert not fs.is_link(real)
        assert fs.realpath(real) == fs.realpath(fs.realpath(real))
        assert fs.resolve_link(real) == real
        link = fs.concat_path(root, "link")
        self.bypass_link(fs, real, link)
        assert fs.is_link(link)
        assert fs.realpath(link) == fs.realpath(real)
        assert fs.resolve_link(link) == fs.realpath(real)
        assert fs.read_bytes(fs.concat_path(link, "obj.bin")) == b"x"

    def test_unfinished_uploads_are_listed_and_aborted(self, fs: FileSystemBase, root: str) -> None:
        """What a killed save leaves invisible is found under its prefix, at any depth,
        and aborted; aborting one that is gone is not an error."""
        assert fs.pending_uploads(root) == []
        path = fs.concat_path(fs.concat_path(root, "step-1"), "__0_0.distcp")
        self.bypass_begin_upload(fs, path)
        (upload,) = fs.pending_uploads(root)
        assert upload.path == path
        fs.abort_upload(upload)
        assert fs.pending_uploads(root) == []
        fs.abort_upload(upload)
        assert not fs.exists(path)

    # --- slices ----------------------------------------------------------------------

    @pytest.mark.parametrize(
        "offset,length", [(0, 0), (0, 10), (1000, 4096), (70_000, 100), (5, 99_995)]
    )
    def test_slice_reads_exact_range(
        self, fs: FileSystemBase, root: str, offset: int, length: int
    ) -> None:
        path = fs.concat_path(root, "obj.bin")
        data = _payload(100_000)
        self.bypass_write(fs, path, data)
        with fs.open_slice(path, offset, length) as view:
            got = view.read()
        assert got == data[offset : offset + length]

    def test_slice_seek_stays_inside(self, fs: FileSystemBase, root: str) -> None:
        path = fs.concat_path(root, "obj.bin")
        data = _payload(10_000)
        self.bypass_write(fs, path, data)
        with fs.open_slice(path, 1000, 500) as view:
            if not view.seekable():
                pytest.skip("forward-only slice stream")
            assert view.seek(-10, os.SEEK_END) == 490
            assert view.read() == data[1490:1500]
            view.seek(0)
            assert view.read(3) == data[1000:1003]
            assert view.seek(5, os.SEEK_CUR) == 8
            assert view.read(2) == data[1008:1010]
            view.seek(10_000)
            assert view.read() == b""

    def test_slice_past_end_is_short(self, fs: FileSystemBase, root: str) -> None:
        path = fs.concat_path(root, "obj.bin")
        self.bypass_write(fs, path, _payload(1000))
        with fs.open_slice(path, 900, 500) as view:
            got = view.read()
        assert got == _payload(1000)[900:]

    @pytest.mark.parametrize("size", [0, 1, 1000, 100_000])
    def test_read_bytes_with_a_limit_returns_at_most_one_byte_more(
        self, fs: FileSystemBase, root: str, size: int
    ) -> None:
        """A caller that refuses objects over ``limit`` bytes (metadata) gets the first
        ``limit + 1`` at most: enough to tell, and what a ranged request fetches."""
        path = fs.concat_path(root, "obj.bin")
        data = _payload(size)
        self.bypass_write(fs, path, data)
        for limit in (0, 1, 999, 1000, 1001, 70_000, 1 << 30):
            assert fs.read_bytes(path, limit=limit) == data[: limit + 1]
        assert fs.read_bytes(path, limit=None) == data
        with pytest.raises(ValueError):
            fs.read_bytes(path, limit=-1)
        with pytest.raises(FileNotFoundError):
            fs.read_bytes(fs.concat_path(root, "missing.bin"), limit=10)

    # --- atomic publish --------------------------------------------------------------

    def test_write_atomic_and_exclusive(self, fs: FileSystemBase, root: str) -> None:
        path = fs.concat_path(root, ".metadata")
        fs.write_atomic(path, b"first")
        assert self.bypass_read(fs, path) == b"first"
        fs.write_atomic(path, b"second")
        assert self.bypass_read(fs, path) == b"second"
        with pytest.raises(FileExistsError):
            fs.write_atomic(path, b"third", exclusive=True)
        assert self.bypass_read(fs, path) == b"second"
        fresh = fs.concat_path(root, "fresh")
        fs.write_atomic(fresh, b"ok", exclusive=True)
        assert self.bypass_read(fs, fresh) == b"ok"

    def test_rename_moves_one_object(self, fs: FileSystemBase, root: str) -> None:
        src, dst = fs.concat_path(root, "src"), fs.concat_path(root, "dst")
        self.bypass_write(fs, src, b"payload")
        self.bypass_write(fs, dst, b"old")
        fs.rename(src, dst)
        assert self.bypass_read(fs, dst) == b"payload"
        assert not fs.exists(src)
        with pytest.raises(FileNotFoundError):
            fs.rename(src, fs.concat_path(root, "elsewhere"))

    # --- paths as callers of torch's filesystems give them ------------------------------

    def test_urls_are_taken_wherever_a_path_is(self, fs: FileSystemBase, root: str) -> None:
        """``writer.fs.rm_file("s3://bucket/key")``, ``fs.exists(Path(...))``: every
        method that takes a path takes the backend's URL (or an ``os.PathLike`` where
        the backend has no scheme), and never doubles the scheme."""

        def given(path: str) -> Any:  # what the methods' hints do not show, on purpose
            url = fs.url(path)
            return url if "://" in url else pathlib.Path(url)

        path = fs.concat_path(root, "obj.bin")
        with fs.create_stream(given(path), "wb") as stream:
            stream.write(b"payload")
        assert self.bypass_read(fs, path) == b"payload"
        assert fs.concat_path(given(root), "obj.bin") == path
        assert fs.url(given(path)) == fs.url(path)
        assert fs.exists(given(path)) and fs.size(given(path)) == 7
        assert fs.read_bytes(given(path)) == b"payload"
        with fs.open_slice(given(path), 1, 3) as view:
            assert view.read() == b"ayl"
        assert fs.ls(given(root)) == ["obj.bin"]
        moved = fs.concat_path(root, "moved.bin")
        fs.rename(given(path), given(moved))
        assert self.bypass_read(fs, moved) == b"payload"
        fs.write_atomic(given(path), b"again")
        fs.rm_file(given(moved))
        assert not fs.exists(moved)
        with pytest.raises(FileNotFoundError) as info:
            fs.rm_file(given(moved))
        scheme = fs.url(moved).partition("://")[0]
        assert f"{scheme}://{scheme}://" not in str(info.value)

    # --- pickling ----------------------------------------------------------------------

    def test_pickle_round_trip(self, fs: FileSystemBase, root: str) -> None:
        path = fs.concat_path(root, "obj.bin")
        self.bypass_write(fs, path, b"pickled")
        clone: Any = pickle.loads(pickle.dumps(fs))
        assert type(clone) is type(fs)
        assert clone.read_bytes(path) == b"pickled"
        with clone.create_stream(fs.concat_path(root, "from-clone"), "wb") as stream:
            stream.write(io.BytesIO(b"clone wrote").getvalue())
        assert self.bypass_read(fs, fs.concat_path(root, "from-clone")) == b"clone wrote"
