"""No path under a checkpoint is followed through a symbolic link.

A key-prefix directory (``ck/00``) that is a link to a directory outside the checkpoint
(``/shared/pretrained``) must never be deleted, read, copied, drained or written through,
on local disk and on fsspec's local filesystem (the backends with links). Every test names,
in a comment, what happened before the fix.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import storage
from extensions.errors import UnsafeCheckpointError
from storage import CheckpointManager, FsspecFileSystem, LocalFileSystem
from storage.backends.base import FileSystemBase
from storage.cli import main

_OLD = 1_000_000_000  # 2001: older than any grace period


def _state(value: float = 1.0) -> dict[str, Any]:
    return {"w": torch.full((16,), value), "step": int(value)}


def _backends() -> list[Any]:
    return [
        pytest.param(LocalFileSystem, id="local"),
        pytest.param(lambda: FsspecFileSystem(protocol="file"), id="fsspec-file"),
    ]


def _link_prefix(ckpt: Path, shared: Path) -> list[Path]:
    """Move ``ckpt/00`` (its data files) to ``shared`` and put a link in its place: the
    checkpoint's metadata now names files that live outside it, someone else's."""
    shared.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(ckpt / "00"), str(shared))
    (ckpt / "00").symlink_to(shared, target_is_directory=True)
    files = sorted(shared.iterdir())
    assert files, "the checkpoint had data files under 00"
    return files


@pytest.fixture
def linked(tmp_path: Path) -> tuple[Path, Path, list[Path]]:
    """``root/step-1``, saved with key prefixes, whose ``00`` links to ``shared``."""
    root, shared = tmp_path / "root", tmp_path / "shared" / "pretrained"
    CheckpointManager(root, key_prefixes=2).save(1, _state(1.0))
    return root, shared, _link_prefix(root / "step-1", shared)


def _intact(files: list[Path]) -> None:
    for f in files:
        assert f.is_file() and f.stat().st_size > 0, f


# --- deleting -----------------------------------------------------------------------------


def test_rm_refuses_a_linked_prefix(
    linked: tuple[Path, Path, list[Path]], capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: `dcp-storage rm root/step-1` deleted /shared/pretrained/__0_0-*.distcp
    # through the link.
    root, _, files = linked
    assert main(["rm", str(root / "step-1")]) == 1
    assert "symbolic link" in capsys.readouterr().err
    _intact(files)
    assert (root / "step-1" / ".metadata").exists()  # nothing was deleted


@pytest.mark.parametrize("make_fs", _backends())
def test_manager_delete_refuses_a_linked_prefix(
    linked: tuple[Path, Path, list[Path]], make_fs: Any
) -> None:
    # Before: CheckpointManager.delete removed the files through the link.
    root, _, files = linked
    fs: FileSystemBase = make_fs()
    with pytest.raises(UnsafeCheckpointError, match="symbolic link"):
        CheckpointManager(f"file://{root}", filesystem=fs).delete(1)
    _intact(files)


def test_retention_keeps_a_step_with_a_linked_prefix(
    linked: tuple[Path, Path, list[Path]], caplog: pytest.LogCaptureFixture
) -> None:
    # Before: retention (keep_last=1) deleted step-1's files through the link.
    root, _, files = linked
    mgr = CheckpointManager(root, keep_last=1)
    mgr.save(2, _state(2.0))
    _intact(files)
    assert mgr.steps() == [1, 2]
    assert "kept" in caplog.text and "symbolic link" in caplog.text


def test_saving_over_keeps_files_under_a_linked_prefix(
    linked: tuple[Path, Path, list[Path]], caplog: pytest.LogCaptureFixture
) -> None:
    # Before: the save over step-1 removed the replaced checkpoint's files, those under
    # the linked 00 included.
    root, _, files = linked
    storage.save(_state(5.0), str(root / "step-1"))
    _intact(files)
    out = {"w": torch.zeros(16), "step": 0}
    storage.load(out, str(root / "step-1"))
    assert out["step"] == 5
    assert "symbolic link" in caplog.text


def test_gc_never_sweeps_through_a_linked_prefix(
    linked: tuple[Path, Path, list[Path]], capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: gc listed the committed step-1 through the link and removed the data files
    # its metadata does not name (here someone else's old file in the shared directory).
    root, shared, files = linked
    theirs = shared / "__0_7-0123456789ab.distcp"
    theirs.write_bytes(b"someone else's")
    os.utime(theirs, (_OLD, _OLD))
    assert main(["gc", str(root), "--keep-last", "5", "--grace", "0"]) == 0
    _intact([*files, theirs])


def test_gc_keeps_an_interrupted_step_whose_prefix_links_elsewhere(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Before: the interrupted step-3 (no metadata) looked stale and its "leftovers",
    # /shared/data/__0_0-*.distcp, were removed through the link.
    root, shared = tmp_path / "root", tmp_path / "shared" / "data"
    CheckpointManager(root).save(1, _state(1.0))
    shared.mkdir(parents=True)
    theirs = shared / "__0_0-0123456789ab.distcp"
    theirs.write_bytes(b"someone else's")
    os.utime(theirs, (_OLD, _OLD))
    (root / "step-3").mkdir()
    (root / "step-3" / "00").symlink_to(shared, target_is_directory=True)
    assert main(["gc", str(root), "--keep-last", "5", "--grace", "0"]) == 0
    _intact([theirs])
    assert (root / "step-3" / "00").is_symlink()
    assert "symbolic link" in caplog.text


# --- reading, copying, draining, writing ----------------------------------------------------


def test_cp_refuses_a_source_with_a_linked_prefix(
    linked: tuple[Path, Path, list[Path]], capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: `dcp-storage cp` read the files through the link and copied them to the
    # destination (with stock metadata, which has no checksums, any bytes would do).
    root, _, _ = linked
    dst = root.parent / "copy"
    assert main(["cp", str(root / "step-1"), str(dst)]) == 1
    assert "symbolic link" in capsys.readouterr().err
    assert not dst.exists() or not any(p.suffix == ".distcp" for p in dst.rglob("*"))


def test_drain_refuses_a_local_step_with_a_linked_prefix(tmp_path: Path) -> None:
    # Before: the drain copied the files under the linked 00 of the local step to the
    # durable root, as if they were the step's own.
    durable, local = tmp_path / "durable", tmp_path / "local"
    durable.write_text("down")  # the first drain fails: the step stays local
    crashed = CheckpointManager(durable, local=local, key_prefixes=2)
    crashed.save(1, _state(1.0))
    with pytest.raises(OSError):
        crashed.wait()
    files = _link_prefix(local / "step-1", tmp_path / "shared" / "secret")
    durable.unlink()  # the root is back; the restarted job drains what is only local
    restarted = CheckpointManager(durable, local=local, key_prefixes=2)
    with pytest.raises(UnsafeCheckpointError, match="symbolic link"):
        restarted.wait()
    assert restarted.durable_steps() == []
    assert not any(p.suffix == ".distcp" for p in durable.rglob("*"))
    _intact(files)


@pytest.mark.parametrize("make_fs", _backends())
def test_save_never_writes_through_a_linked_prefix(tmp_path: Path, make_fs: Any) -> None:
    # Before: save(key_prefixes=2) wrote its data file into ck/00 -> elsewhere.
    ckpt, elsewhere = tmp_path / "ck", tmp_path / "elsewhere"
    elsewhere.mkdir()
    ckpt.mkdir()
    (ckpt / "00").symlink_to(elsewhere, target_is_directory=True)
    fs: FileSystemBase = make_fs()
    with pytest.raises(UnsafeCheckpointError, match="symbolic link"):
        storage.save(_state(), f"file://{ckpt}", key_prefixes=2, filesystem=fs)
    assert list(elsewhere.iterdir()) == []
    assert not (ckpt / ".metadata").exists()


# --- saving over a step directory that is itself a link -----------------------------------


@pytest.fixture
def linked_step(tmp_path: Path) -> tuple[Path, Path, list[Path]]:
    """``root/step-0``: a link to ``shared``, a committed checkpoint of someone else's
    (the shared pretrained checkpoint linked in as step 0)."""
    root, shared = tmp_path / "root", tmp_path / "shared" / "pretrained"
    storage.save(_state(1.0), str(shared))
    root.mkdir()
    (root / "step-0").symlink_to(shared, target_is_directory=True)
    return root, shared, sorted(shared.iterdir())


def test_saving_or_copying_over_a_linked_checkpoint_keeps_its_files(
    linked_step: tuple[Path, Path, list[Path]], caplog: pytest.LogCaptureFixture
) -> None:
    # Before: `storage.save` and `cp --overwrite` at the link removed the replaced
    # checkpoint's data files through it, though `rm` refuses to delete through a link.
    root, shared, files = linked_step
    storage.save(_state(5.0), str(root / "step-0"))
    storage.save(_state(6.0), str(root.parent / "other"))
    assert main(["cp", str(root.parent / "other"), str(root / "step-0"), "--overwrite"]) == 0
    data = [f for f in files if f.suffix == ".distcp"]
    _intact(data)
    assert "symbolic link" in caplog.text
