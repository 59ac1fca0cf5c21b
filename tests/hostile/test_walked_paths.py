"""The directories and names a write that walks directory handles is given, at their
edges: a checkpoint directory that is empty, ``.`` or ends in ``..``, relative while
the process changes its current directory, a name that ends in a slash, and what sits
at a file's name (a directory), with the error naming the path in full and escaped.
Every test names, in a comment, what happened before the fix it guards.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import storage
from extensions.errors import UnsafeCheckpointError
from storage import LocalFileSystem
from storage.backends import _local_writes


def _state(value: float) -> dict[str, Any]:
    return {"w": torch.full((4,), value), "step": int(value)}


def _loaded(path: str, **options: Any) -> int:
    out = {"w": torch.zeros(4), "step": 0}
    storage.load(out, path, **options)
    return int(out["step"])


def _torch_local() -> storage.TorchFileSystem:
    from torch.distributed.checkpoint.filesystem import FileSystem

    return storage.TorchFileSystem(FileSystem())


@pytest.mark.parametrize("directory", ["", ".", "ck/..", "ck/."])
def test_a_directory_with_no_name_of_its_own_is_written_where_it_points(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, directory: str
) -> None:
    # Before: "" was walked from "/" (the file landed at /f.bin), and ".", "ck/.." and
    # "ck/." were refused as if the file's name climbed out of its directory.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ck").mkdir()
    with _local_writes.write_stream_in(directory, "00/f.bin") as out:
        out.write(b"data")
    _local_writes.write_atomic_in(directory, "g.bin", b"more")
    where = tmp_path / "ck" if directory.endswith("/.") else tmp_path
    assert (where / "00" / "f.bin").read_bytes() == b"data"
    assert (where / "g.bin").read_bytes() == b"more"
    assert not Path("/00/f.bin").exists() and not Path("/g.bin").exists()


@pytest.mark.parametrize("name", ["sub/", "00/f.bin/"])
def test_a_file_name_ending_in_a_slash_is_refused(tmp_path: Path, name: str) -> None:
    # Before: the slash was dropped and a file written at "sub", where a write by path
    # (or a store's key) names a directory.
    with (
        pytest.raises(UnsafeCheckpointError, match="not a plain relative name"),
        _local_writes.write_stream_in(str(tmp_path), name) as out,
    ):
        out.write(b"x")
    with pytest.raises(UnsafeCheckpointError, match="not a plain relative name"):
        _local_writes.write_atomic_in(str(tmp_path), name, b"x")
    assert list(tmp_path.iterdir()) == []


def test_a_directory_at_a_files_name_is_named_in_full_and_escaped(tmp_path: Path) -> None:
    # Before: the stream's error named only "f.bin" (its name inside the walked
    # directory), and the publish's printed the path raw, control characters included.
    step = tmp_path / "step\x1b[31m\n"
    (step / "00" / "f.bin").mkdir(parents=True)
    fs = LocalFileSystem()
    with (
        pytest.raises(IsADirectoryError) as caught,
        fs.create_stream_in(str(step), "00/f.bin") as out,
    ):
        out.write(b"x")
    with pytest.raises(IsADirectoryError) as published:
        fs.write_atomic_in(str(step), "00/f.bin", b"x")
    for error in (caught.value, published.value):
        shown = str(error)
        assert repr(str(step / "00" / "f.bin")) in shown and "move or remove" in shown
        assert "\x1b" not in shown and "\n" not in shown
    assert [p.name for p in (step / "00").iterdir()] == ["f.bin"]


@pytest.mark.parametrize("directory", [".", "rel/sub/.."])
def test_torch_local_disk_saves_to_a_dot_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, directory: str
) -> None:
    # Before: every write of such a save was refused ("not a plain relative name").
    monkeypatch.chdir(tmp_path)
    storage.save(_state(1.0), directory, filesystem=_torch_local())
    assert _loaded(directory, filesystem=_torch_local()) == 1


def test_a_relative_torch_path_names_one_directory_while_the_process_moves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: torch's local disk kept the path relative; with the process's current
    # directory changed after the save made its directory, every file went to a
    # directory of that name under the new one.
    from storage.checkpoint import writer

    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path)
    made = writer.make_directory

    def make_then_move(fs: Any, path: str) -> None:
        made(fs, path)
        os.chdir(tmp_path / "elsewhere")

    monkeypatch.setattr(writer, "make_directory", make_then_move)
    storage.save(_state(2.0), "ck", filesystem=_torch_local())
    assert list((tmp_path / "elsewhere").iterdir()) == []
    assert _loaded(str(tmp_path / "ck")) == 2


def _torch_fsspec() -> storage.TorchFileSystem:
    from torch.distributed.checkpoint._fsspec_filesystem import FileSystem

    return storage.TorchFileSystem(FileSystem())


@pytest.mark.parametrize(
    ("location", "make"),
    [("ck", _torch_local), ("file://ck", _torch_fsspec)],
    ids=["torch-local", "torch-fsspec-file"],
)
def test_an_async_torch_save_to_a_relative_path_after_a_chdir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, location: str, make: Any
) -> None:
    # Before: the persist worker, started in the first directory, wrote the second
    # save's data files under it, and the commit (in the training process, now in the
    # second) refused the save: its data files had "vanished".
    for name in ("one", "two"):
        (tmp_path / name).mkdir()
    monkeypatch.chdir(tmp_path / "one")
    storage.async_save(_state(1.0), location, filesystem=make()).result()
    os.chdir(tmp_path / "two")
    storage.async_save(_state(2.0), location, filesystem=make()).result()
    assert _loaded(str(tmp_path / "one" / "ck")) == 1
    assert _loaded(str(tmp_path / "two" / "ck")) == 2
    assert len(list((tmp_path / "one" / "ck").iterdir())) == 2


@pytest.mark.parametrize("name", ["../x", "{tmp}/x", "a\0b", "00/../../x", "sub/"])
def test_names_are_refused_where_the_platform_writes_by_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    # Before: without dir_fd support the write went by path and a name climbing out of
    # the directory (or absolute) was written wherever it pointed.
    from storage.backends import _local_walk

    monkeypatch.setattr(_local_walk, "WRITES_SAFELY", False)
    (tmp_path / "d").mkdir()
    name = name.format(tmp=tmp_path)  # absolute, outside "d"
    with (
        pytest.raises(UnsafeCheckpointError, match="not a plain relative name"),
        _local_writes.write_stream_in(str(tmp_path / "d"), name) as out,
    ):
        out.write(b"x")
    with pytest.raises(UnsafeCheckpointError, match="not a plain relative name"):
        _local_writes.write_atomic_in(str(tmp_path / "d"), name, b"x")
    assert [p.name for p in tmp_path.iterdir()] == ["d"]


def test_a_data_file_write_that_fails_names_the_file(tmp_path: Path) -> None:
    # Before: a disk filling up mid-write failed the save with a bare "[Errno 28] No
    # space left on device", naming neither the checkpoint nor the file.
    class _Full(LocalFileSystem):
        @contextlib.contextmanager
        def create_stream(self, path: str, mode: str, *, sync: bool = False) -> Iterator[Any]:
            with super().create_stream(path, mode, sync=sync) as out:
                if path.endswith(".distcp"):
                    out.write = _no_space  # type: ignore[method-assign]
                yield out

    def _no_space(data: Any) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(OSError, match="No space left on device") as caught:
        storage.save(_state(1.0), str(tmp_path / "ck"), filesystem=_Full())
    assert caught.value.errno == errno.ENOSPC
    assert f"{tmp_path / 'ck'}{os.sep}__0_" in str(caught.value)
    assert not list((tmp_path / "ck").glob("*.distcp"))


_FULL_CHILD = r"""
import errno, os, resource, signal, sys
from storage.backends._local import LocalFileSystem

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
fs, root = LocalFileSystem(), sys.argv[1]
writes = {
    "write_atomic_in": lambda: fs.write_atomic_in(root, "ck/.metadata", b"m" * 10000),
    "write_atomic": lambda: fs.write_atomic(os.path.join(root, "ck2", "latest"), b"l" * 10000),
    "create_stream_in": lambda: fs.create_stream_in(root, "ck3/.heartbeat-x", "wb"),
}
for what, write in writes.items():
    try:
        if what == "create_stream_in":
            with write() as out:
                out.write(b"h" * 10000)
                out.flush()
        else:
            write()
    except OSError as exc:
        assert exc.errno == errno.EFBIG, exc
        print(what, exc.filename)
"""


def test_a_write_past_what_the_disk_takes_names_its_file(tmp_path: Path) -> None:
    # Before: only a data file's failed write was named; the metadata's publish, the
    # latest-step pointer and a heartbeat failed with a bare "[Errno 27] File too large"
    # (or "No space left on device"). A real limit of the OS (RLIMIT_FSIZE, in a child).
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run(
        [sys.executable, "-c", _FULL_CHILD, str(tmp_path)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": root},
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    named = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert named == {
        "write_atomic_in": os.path.join(str(tmp_path), "ck/.metadata"),
        "write_atomic": os.path.join(str(tmp_path), "ck2", "latest"),
        "create_stream_in": os.path.join(str(tmp_path), "ck3/.heartbeat-x"),
    }
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]  # no temporary left
