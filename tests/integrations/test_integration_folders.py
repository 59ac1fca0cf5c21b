"""Folder checkpoints (storage/integrations/folders.py) on local disk: the commit unit of
the Hugging Face integration. The Trainer and Accelerate runs against SeaweedFS are in
tests/integrations/test_integration_huggingface.py."""

from __future__ import annotations

import errno
import os
import shutil
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch

import storage
from extensions import ZStandard
from extensions.errors import CheckpointNotFoundError, IntegrityError, UnsafeCheckpointError
from storage.integrations.folders import FolderCheckpoints, read_folder, restore_folder
from tests.checkpoint.test_thread_staging import wait_exit


def _folder(root: Path) -> dict[str, bytes]:
    files = {
        "model.safetensors": os.urandom(300_000),
        "optimizer.pt": bytes(range(256)) * 100,
        "trainer_state.json": b'{"global_step": 3}',
        "empty.txt": b"",
        "sub/deeper/shard_0.distcp": os.urandom(1000),
    }
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return files


def _contents(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_folder_round_trip_with_retention(tmp_path: Path) -> None:
    folder = tmp_path / "checkpoint-3"
    files = _folder(folder)
    ckpts = FolderCheckpoints(tmp_path / "bucket", keep_last=2, transforms=[ZStandard()])
    for step in (1, 2, 3):
        ckpts.save(folder, step)
    ckpts.close()
    assert ckpts.steps() == [2, 3]  # keep_last=2 removed step-1
    restored = ckpts.restore(tmp_path / "restored")
    assert _contents(Path(restored)) == files
    assert not [p for p in tmp_path.iterdir() if ".restoring-" in p.name]


def test_a_forked_child_uploads_with_folder_checkpoints_made_in_the_parent(
    tmp_path: Path,
) -> None:
    """The parent's upload thread is not in a child made with fork: a save there was
    queued to it and never ran, and wait() waited for ever."""
    folder = tmp_path / "checkpoint-1"
    files = _folder(folder)
    ckpts = FolderCheckpoints(tmp_path / "bucket")
    ckpts.save(folder, 1)
    ckpts.wait()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            torch.set_num_threads(1)  # the parent's OpenMP pool does not survive fork
            ckpts.save(folder, 2)
            ckpts.close()
            code = 0 if ckpts.steps() == [1, 2] else 2
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    assert wait_exit(pid, timeout=60) == 0
    assert _contents(Path(ckpts.restore(tmp_path / "back", 2))) == files
    ckpts.close()


def test_the_folder_may_go_once_save_returns(tmp_path: Path) -> None:
    """save() maps the files before it returns; the upload reads the mappings, so the
    Trainer's save_total_limit may delete the local folder meanwhile."""
    folder = tmp_path / "checkpoint-1"
    files = _folder(folder)
    ckpts = FolderCheckpoints(tmp_path / "bucket")
    ckpts.save(folder, 1)
    shutil.rmtree(folder)
    ckpts.wait()
    assert _contents(Path(ckpts.restore(tmp_path / "back"))) == files


def test_a_failed_upload_is_raised_by_wait_and_the_next_save(tmp_path: Path) -> None:
    (tmp_path / "not-a-dir").write_bytes(b"x")
    folder = tmp_path / "f"
    _folder(folder)
    ckpts = FolderCheckpoints(tmp_path / "not-a-dir" / "root")
    ckpts.save(folder, 1)
    with pytest.raises(OSError):
        ckpts.wait()
    ckpts.wait()  # reported once
    ckpts.save(folder, 2)
    with pytest.raises(OSError):
        ckpts.save(folder, 3)


def test_links_and_special_files_are_refused(tmp_path: Path) -> None:
    folder = tmp_path / "f"
    _folder(folder)
    (folder / "link").symlink_to(folder / "optimizer.pt")
    with pytest.raises(ValueError, match="not a regular file"):
        read_folder(folder)
    with pytest.raises(FileNotFoundError):
        read_folder(tmp_path / "missing")


def test_restore_refuses_an_existing_destination_and_a_missing_step(tmp_path: Path) -> None:
    folder = tmp_path / "f"
    _folder(folder)
    ckpts = FolderCheckpoints(tmp_path / "bucket", blocking=True)
    with pytest.raises(CheckpointNotFoundError):
        ckpts.restore(tmp_path / "x")
    ckpts.save(folder, 7)
    with pytest.raises(FileExistsError):
        ckpts.restore(folder)


@pytest.mark.parametrize(
    "name",
    [
        *("../evil", "/etc/evil", "a/../../evil", "a//b", "a\\..\\b", ".", "a\nb"),
        *("x\x1b[2Jy", "z\x7f", "nul\x00byte"),
    ],
)
def test_item_names_that_leave_the_destination_are_refused(tmp_path: Path, name: str) -> None:
    # Also names with control characters: restored, a line break or an escape sequence
    # in a file name reached whoever listed the folder (a terminal, a script's loop).
    storage.save({name: torch.ones(3, dtype=torch.uint8)}, tmp_path / "forged")
    with pytest.raises(UnsafeCheckpointError, match="not a plain relative file path"):
        restore_folder(tmp_path / "forged", tmp_path / "out" / "dest")
    assert not (tmp_path / "evil").exists() and not (tmp_path / "out").exists()


def test_items_that_are_not_files_are_refused(tmp_path: Path) -> None:
    storage.save({"a": torch.ones(3), "b/c": torch.ones(2, dtype=torch.uint8)}, tmp_path / "ckpt")
    with pytest.raises(UnsafeCheckpointError, match="not a file"):
        restore_folder(tmp_path / "ckpt", tmp_path / "dest")
    storage.save(
        {"a": torch.ones(3, dtype=torch.uint8), "a/b": torch.ones(2, dtype=torch.uint8)},
        tmp_path / "clash",
    )
    with pytest.raises(UnsafeCheckpointError, match="both as a file and as a directory"):
        restore_folder(tmp_path / "clash", tmp_path / "dest")


def test_a_damaged_file_fails_the_restore_and_leaves_nothing(tmp_path: Path) -> None:
    folder = tmp_path / "f"
    _folder(folder)
    ckpts = FolderCheckpoints(tmp_path / "bucket", blocking=True)
    ckpts.save(folder, 1)
    data = next((tmp_path / "bucket" / "step-1").glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(IntegrityError):
        ckpts.restore(tmp_path / "out" / "dest")
    assert os.listdir(tmp_path / "out") == []


@pytest.mark.parametrize("damage", ["longer", "gap"])
def test_a_file_its_stored_chunks_do_not_cover_is_refused_not_zero_filled(
    tmp_path: Path, damage: str
) -> None:
    # Before: restore_folder sized each file by the metadata's claim and loaded the
    # chunks it has into it, so a file listed 1 MiB longer than what was stored (or with
    # a chunk left out) was restored padded with zeros, checksums passing, no error.
    from storage.checkpoint import storage_format as fmt

    folder = tmp_path / "f"
    _folder(folder)
    FolderCheckpoints(tmp_path / "bucket", blocking=True).save(folder, 1)
    path = tmp_path / "bucket" / "step-1" / ".metadata"
    meta = fmt.load_metadata(path.read_bytes(), str(path))
    item = meta.state_dict_metadata["optimizer.pt"]
    if damage == "longer":
        item.size = torch.Size([item.size[0] + (1 << 20)])
    else:  # the one chunk listed twice: its bytes twice as many as the file's, half missing
        item.size = torch.Size([item.size[0] * 2])
        item.chunks = [item.chunks[0], item.chunks[0]]
    path.write_bytes(fmt.dump_metadata(meta))
    with pytest.raises(IntegrityError, match="'optimizer.pt'.*cover.*damaged") as info:
        restore_folder(tmp_path / "bucket" / "step-1", tmp_path / "out" / "dest")
    assert "step-1" in str(info.value)
    assert not (tmp_path / "out").exists()


def _forge(tmp_path: Path, edit: Any) -> Path:
    """A folder checkpoint saved from ``_folder``, its metadata then edited by
    ``edit(metadata)``; its path."""
    from storage.checkpoint import storage_format as fmt

    folder = tmp_path / "f"
    _folder(folder)
    FolderCheckpoints(tmp_path / "bucket", blocking=True).save(folder, 1)
    path = tmp_path / "bucket" / "step-1" / ".metadata"
    meta = fmt.load_metadata(path.read_bytes(), str(path))
    edit(meta)
    path.write_bytes(fmt.dump_metadata(meta))
    return path.parent


def _rename(meta: Any, old: str, new: str) -> None:
    """Item ``old`` listed as ``new`` (its chunks' indexes renamed with it)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    meta.state_dict_metadata[new] = meta.state_dict_metadata.pop(old)
    for index in [i for i in meta.storage_data if i.fqn == old]:
        meta.storage_data[MetadataIndex(new, index.offset, index.index)] = meta.storage_data.pop(
            index
        )


def test_a_file_listed_with_a_huge_size_is_refused_before_anything_is_written(
    tmp_path: Path,
) -> None:
    # Before: the restore created the file and truncated it to the listed size first,
    # failing with a bare OSError ("File too large") or leaving a huge sparse file to a
    # read that then failed; the error named neither the checkpoint nor the item.
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    def huge(meta: Any) -> None:
        item = meta.state_dict_metadata["optimizer.pt"]
        item.size = torch.Size([1 << 60])
        item.chunks = [ChunkStorageMetadata(torch.Size([0]), torch.Size([1 << 60]))]

    ckpt = _forge(tmp_path, huge)
    with pytest.raises(OSError, match=r"step-1.*'optimizer.pt'.*free.*forged") as info:
        restore_folder(ckpt, tmp_path / "out" / "dest")
    assert info.value.errno == errno.ENOSPC
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "clash",
    [
        ("trainer_state.json", "OPTIMIZER.pt"),  # letter case
        ("optimizer.pt", "caf\u00e9.pt"),  # then "cafe\u0301.pt" below: normalization
        ("optimizer.pt", "Sub/x.bin"),  # a directory "Sub" beside "sub"
    ],
    ids=["case", "normalization", "directory-case"],
)
def test_names_one_on_the_destinations_file_system_are_refused_there(
    tmp_path: Path, clash: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: restored on macOS (or Windows), the second file was written over the
    # first, or its exclusive create failed half-way with a bare FileExistsError. This
    # machine's file system keeps such names apart: the probe is told it folds them.
    from storage.integrations import _folder_listing

    old, new = clash

    def edit(meta: Any) -> None:
        _rename(meta, old, new)
        if new.startswith("caf"):
            _rename(meta, "trainer_state.json", "cafe\u0301.pt")

    ckpt = _forge(tmp_path, edit)
    monkeypatch.setattr(_folder_listing, "folds", lambda directory: True)
    with pytest.raises(UnsafeCheckpointError, match=r"step-1.*differ only in letter case"):
        restore_folder(ckpt, tmp_path / "out" / "dest")
    assert not (tmp_path / "out").exists()


def test_names_that_differ_only_in_case_save_and_restore_where_the_file_system_keeps_them(
    tmp_path: Path,
) -> None:
    # A folder holding A.txt and a.txt is an ordinary folder on Linux: it saves and
    # restores byte for byte on a file system that keeps the names apart (refusing it
    # everywhere stranded folders saved before on such a file system).
    from storage.integrations._folder_listing import folds

    assert not folds(str(tmp_path))  # the probe leaves nothing behind either
    assert list(tmp_path.iterdir()) == []
    folder = tmp_path / "f"
    files = _folder(folder)
    for name in ("Empty.txt", "cafe\u0301.pt", "caf\u00e9.pt"):
        (folder / name).write_bytes(name.encode())
        files[name] = name.encode()
    FolderCheckpoints(tmp_path / "bucket", blocking=True).save(folder, 1)
    restore_folder(tmp_path / "bucket" / "step-1", tmp_path / "dest")
    assert _contents(tmp_path / "dest") == files


@pytest.mark.parametrize("where", ["component", "path"])
def test_names_too_long_for_the_destination_are_refused_before_anything_is_written(
    tmp_path: Path, where: str
) -> None:
    # Before: the restore failed half-way with a bare "File name too long" (ENAMETOOLONG).
    long = "x" * 300 if where == "component" else "/".join(["d" * 200] * 21)

    ckpt = _forge(tmp_path, lambda meta: _rename(meta, "optimizer.pt", long))
    match = "name component of 300 bytes" if where == "component" else "shorter destination"
    with pytest.raises(UnsafeCheckpointError, match=rf"step-1.*{match}"):
        restore_folder(ckpt, tmp_path / "out" / "dest")
    assert not (tmp_path / "out").exists()


def test_restore_names_the_checkpoint_when_the_destination_exists(tmp_path: Path) -> None:
    ckpt = _forge(tmp_path, lambda meta: None)
    (tmp_path / "dest").mkdir()
    (tmp_path / "dest" / "mine").write_text("keep")
    with pytest.raises(FileExistsError, match=r"dest exists; restoring .*step-1.*new directory"):
        restore_folder(ckpt, tmp_path / "dest")
    assert os.listdir(tmp_path / "dest") == ["mine"]


def test_a_destination_made_during_the_restore_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: an empty directory made at the destination while the files were written
    # was replaced by the rename without a word.
    from storage.integrations import folders

    ckpt = _forge(tmp_path, lambda meta: None)
    dest = tmp_path / "out" / "dest"
    real_sync = folders._sync_tree

    def sync_then_make(root: str) -> None:
        real_sync(root)
        dest.mkdir()

    monkeypatch.setattr(folders, "_sync_tree", sync_then_make)
    with pytest.raises(FileExistsError, match="appeared while"):
        restore_folder(ckpt, dest)
    assert os.listdir(dest) == [] and os.listdir(tmp_path / "out") == ["dest"]
