"""``TorchFileSystem`` on local disk hands back the paths it resolves (``realpath``,
``resolve_link``) in the form they were given: a ``file://`` URL over torch's fsspec
filesystem stays one, and a plain path over torch's own stays plain, whatever its
directories are named."""

from __future__ import annotations

import os
from pathlib import Path

import storage


def test_a_plain_path_with_a_scheme_like_directory_resolves_to_itself(tmp_path: Path) -> None:
    """A directory named ``x:`` makes a plain path hold ``://``: it was taken for a
    URL's scheme, and the path resolved to the directory's name glued to the whole
    path (``.../x://tmp/.../x:/y``), a place that does not exist."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    (tmp_path / "x:" / "y").mkdir(parents=True)
    path = f"{tmp_path}/x://y"
    fs = storage.TorchFileSystem(FileSystem())
    assert fs.realpath(path) == os.path.realpath(path) == str(tmp_path / "x:" / "y")
    assert os.path.isdir(fs.resolve_link(path))


def test_a_file_url_resolves_to_a_file_url(tmp_path: Path) -> None:
    from torch.distributed.checkpoint._fsspec_filesystem import FileSystem

    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    fs = storage.TorchFileSystem(FileSystem())
    fs.init_path(f"file://{tmp_path}")
    assert fs.realpath(f"file://{tmp_path}/link") == f"file://{tmp_path}/real"
    assert fs.resolve_link(f"file://{tmp_path}/real") == f"file://{tmp_path}/real"
