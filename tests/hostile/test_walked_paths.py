"""The directories and names a write that walks directory handles is given, at their
edges: a checkpoint directory that is empty, ``.`` or ends in ``..``, relative while
the process changes its current directory, a name that ends in a slash, and what sits
at a file's name (a directory), with the error naming the path in full and escaped.
Every test names, in a comment, what happened before the fix it guards.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from extensions.errors import UnsafeCheckpointError
from storage import LocalFileSystem
from storage.backends import _local_writes


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
