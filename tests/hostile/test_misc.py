"""Races and edge cases in the registry, the backends, the manager and the CLI (issue 10,
items 13-18). Each test says what would happen without the fix it guards."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import types
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from extensions import ExtensionRegistry
from extensions import registry as registry_module

# --- 13: entry-point plugins are loaded once, and every registry sees them ------------


@pytest.fixture
def fresh_plugin_scan() -> Iterator[None]:
    """Forget the process-wide plugin scan for one test, and restore it after."""
    saved = dict(registry_module._global)
    loaded = registry_module._entry_points_loaded
    registry_module._entry_points_loaded = False
    yield
    registry_module._global.clear()
    registry_module._global.update(saved)
    registry_module._entry_points_loaded = loaded


def _install_fake_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str) -> str:
    """An installed distribution advertising one transform; ``body`` runs on import."""
    module = f"acme_race_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text(
        textwrap.dedent(body)
        + textwrap.dedent(
            """
            from extensions import StreamTransformExtension

            class Plugin(StreamTransformExtension):
                @staticmethod
                def registry_name():
                    return "acme.race"

                @staticmethod
                def from_descriptor(version):
                    return Plugin()

                def get_descriptor(self):
                    return "acme.race/1"

                def transform_to(self, output):
                    return output

                def transform_from(self, input):
                    return input
            """
        )
    )
    dist = tmp_path / f"{module}-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[dcp_storage.transforms]\nrace = {module}:Plugin\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return module


def test_registries_built_in_threads_all_see_the_installed_plugin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_plugin_scan: None
) -> None:
    # Without the fix the first thread marked the scan done before scanning, so the
    # others built registries without the plugin (3 of 4 in the reproduction)
    # and `dcp-storage verify` failed items with "unknown transform 'acme.race'".
    # The plugin's import holds the scan open until the other threads have finished
    # (the bug) or for half a second (the fix: they wait for the scan, so they cannot
    # finish first); the wait only bounds how long a correct run takes.
    gate = types.ModuleType("acme_race_gate")
    gate.others_done = threading.Event()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "acme_race_gate", gate)
    _install_fake_plugin(
        tmp_path, monkeypatch, "import acme_race_gate\nacme_race_gate.others_done.wait(0.5)\n"
    )
    scans = []
    real_entry_points = registry_module.importlib_metadata.entry_points

    def counting_entry_points(**kwargs: Any) -> Any:
        scans.append(kwargs)
        return real_entry_points(**kwargs)

    monkeypatch.setattr(
        registry_module,
        "importlib_metadata",
        types.SimpleNamespace(entry_points=counting_entry_points),
    )
    threads_n = 4
    start = threading.Barrier(threads_n)
    lock = threading.Lock()
    seen: list[bool] = []

    def build() -> None:
        start.wait()
        names = ExtensionRegistry().names()
        with lock:
            seen.append("acme.race" in names)
            if len(seen) == threads_n - 1:
                gate.others_done.set()  # type: ignore[attr-defined]

    threads = [threading.Thread(target=build) for _ in range(threads_n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == [True] * threads_n
    assert len(scans) == 1  # the scan runs once per process, not once per registry
    ExtensionRegistry()
    assert len(scans) == 1


# --- 15: the star import works without the optional client libraries ------------------

_WITHOUT_CLIENTS = """
import sys
for name in ("s3fs", "gcsfs", "fsspec"):
    sys.modules[name] = None  # as if not installed: importing it raises ImportError
from storage import *
from storage.backends import *
import storage
assert "S3FileSystem" in dir(storage)
extras = {"S3FileSystem": "s3", "GCSFileSystem": "gcs", "FsspecFileSystem": "fsspec"}
for name, extra in extras.items():
    try:
        getattr(storage, name)
    except storage.MissingDependencyError as exc:
        assert f"dcp-storage[{extra}]" in str(exc), exc
    else:
        raise AssertionError(f"storage.{name} resolved without its client library")
print("ok", CheckpointManager.__name__, LocalFileSystem.__name__)
"""


def test_star_import_without_cloud_clients() -> None:
    # Without the fix __all__ listed the lazy cloud backends, so the star import
    # resolved each one and died with MissingDependencyError (no s3fs) on import.
    result = subprocess.run(
        [sys.executable, "-c", _WITHOUT_CLIENTS],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["ok", "CheckpointManager", "LocalFileSystem"]
