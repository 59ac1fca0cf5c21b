"""The backend registry: one table of built-in backends, registrations, and third-party
backends advertised under the ``dcp_storage.filesystems`` entry-point group."""

from __future__ import annotations

import logging
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
import tomllib
import torch

import storage
from storage.backends import registry
from storage.backends.registry import BUILTIN, FSSPEC, LAZY_NAMES

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def fresh_plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    """The entry points are scanned again in this test, and forgotten after it."""
    monkeypatch.setattr(registry, "_plugins", {})
    monkeypatch.setattr(registry, "_plugins_loaded", False)
    monkeypatch.setattr(registry, "_registered", {})


def _plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, entries: str, code: str) -> str:
    """An installed distribution ``acme-fs`` (a dist-info on sys.path, as pip leaves
    one) whose module is ``code``; ``entries`` are its filesystem entry points, with
    ``{module}`` standing for the module's name. Returns the module's name."""
    module = f"acme_fs_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(code))
    dist = tmp_path / "acme_fs-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-fs\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[dcp_storage.filesystems]\n" + entries.format(module=module)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return module


_ACME = """
    from storage import MemoryFileSystem

    class AcmeFileSystem(MemoryFileSystem):
        SCHEME = "acme://"
"""


def test_entry_point_backend_serves_its_scheme(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_plugins: None
) -> None:
    module = _plugin(tmp_path, monkeypatch, "acme = {module}:AcmeFileSystem\n", _ACME)
    storage.filesystem_from_url(str(tmp_path))  # a built-in scheme: no scan
    assert not registry._plugins_loaded
    state = {"w": torch.arange(10.0), "b": torch.ones(3)}
    url = f"acme://{uuid.uuid4().hex}/ckpt"
    assert module not in sys.modules  # the scan reads metadata; the module loads on use
    storage.save(state, url)
    assert registry._plugins_loaded and module in sys.modules
    fs, path = storage.filesystem_from_url(url)
    assert type(fs) is sys.modules[module].AcmeFileSystem and path == "ckpt"
    target = {"w": torch.zeros(10), "b": torch.zeros(3)}
    storage.load(target, url)
    assert torch.equal(target["w"], state["w"]) and torch.equal(target["b"], state["b"])


def test_entry_points_never_replace_builtins_and_bad_ones_say_why(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    fresh_plugins: None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    entries = (
        "s3 = {module}:AcmeFileSystem\n"
        "broken = {module}_missing:Nothing\n"
        "notfs = {module}:NotAFileSystem\n"
    )
    _plugin(tmp_path, monkeypatch, entries, _ACME + "\n    class NotAFileSystem:\n        pass\n")
    with caplog.at_level(logging.WARNING, logger="storage.backends.registry"):
        assert registry.backend_for("broken") is not FSSPEC  # scanned now
    assert registry.backend_for("s3") is BUILTIN["s3"]
    assert "s3:// is built in" in caplog.text and "acme-fs" in caplog.text
    with pytest.raises(storage.MissingDependencyError, match="check the installation of acme-fs"):
        storage.filesystem_from_url("broken://x/y")
    with pytest.raises(TypeError, match="NotAFileSystem.*not a storage.FileSystemBase"):
        storage.filesystem_from_url("notfs://x/y")


def test_register_filesystem_wins_over_builtins(fresh_plugins: None) -> None:
    class Mine(storage.MemoryFileSystem):
        SCHEME = "s3://"

    storage.register_filesystem("s3", Mine)
    fs, path = storage.filesystem_from_url("s3://bucket/ckpt")
    assert type(fs) is Mine and path == "ckpt"
    with pytest.raises(ValueError, match="invalid URL scheme"):
        storage.register_filesystem("no/slash", Mine)


def test_unknown_schemes_go_to_fsspec(fresh_plugins: None) -> None:
    fs, path = storage.filesystem_from_url(f"memory://{uuid.uuid4().hex}/ckpt")
    assert type(fs).__name__ == "FsspecFileSystem"


def test_every_extra_in_the_table_exists() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    rows = [*BUILTIN.values(), FSSPEC]
    assert {b.extra for b in rows if b.extra} <= set(extras)
    assert sorted(LAZY_NAMES) == ["FsspecFileSystem", "GCSFileSystem", "S3FileSystem"]
    for name in LAZY_NAMES:
        assert getattr(storage, name) is getattr(storage.backends, name)
        assert name in dir(storage) and name not in storage.__all__
