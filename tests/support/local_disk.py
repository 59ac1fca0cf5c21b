"""Fixtures for conformance tests of backends that keep their files on local disk (the
suite's ground truth is read and written with plain ``open``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from storage.backends.base import FileSystemBase


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` (relative name) with its bytes."""
    return {
        str(p.relative_to(directory)): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


class LocalDiskFixtures:
    """Mixed into a ``FileSystemTests`` subclass whose ``fs`` stores plain files."""

    @pytest.fixture
    def root(self, fs: FileSystemBase, tmp_path: object) -> str:
        return fs.init_path(os.path.join(str(tmp_path), "root"))

    def bypass_write(self, fs: FileSystemBase, path: str, data: bytes) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)

    def bypass_read(self, fs: FileSystemBase, path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def bypass_link(self, fs: FileSystemBase, target: str, link: str) -> None:
        os.symlink(target, link)
