"""An incremental checkpoint whose base, at its recorded name, is a symbolic link.

A save records its base by the name the base's files really have (links resolved, and
refused when they lead outside the directory), so a reference never needs a link. A
hostile checkpoint in a shared directory plants one at its base's name, pointing at a
private checkpoint elsewhere on the machine that the loading user can read and the
attacker cannot, and points its items at that checkpoint's files: every reader that
follows references (a load, ``verify``, ``cp``, ``export``) refuses the base instead
of reading another checkpoint's bytes as this one's.
"""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import storage
from extensions.errors import UnsafeCheckpointError
from storage.backends.base import FileSystemBase
from storage.backends.registry import filesystem_from_url
from storage.checkpoint import storage_format as fmt
from storage.cli import main
from storage.ops.copy import copy_checkpoint
from storage.ops.export import export_safetensors

SECRET = torch.full((256,), 1234.5)


@pytest.fixture
def hostile(tmp_path: Path) -> Path:
    """``shared/step-2``, referencing ``step-1`` for its item, where ``step-1`` is a link
    to ``private`` (stock DCP: no checksum ties its bytes to the hostile metadata) and
    the item's record names the private data file's bytes."""
    private = tmp_path / "private"
    dcp.save({"w": SECRET}, storage_writer=dcp.FileSystemWriter(str(private)), no_dist=True)
    (info,) = pickle.loads((private / ".metadata").read_bytes()).storage_data.values()
    root = tmp_path / "shared"
    storage.save({"w": torch.zeros(256)}, root / "step-1", fingerprint=True)
    storage.save({"w": torch.zeros(256)}, root / "step-2", base=root / "step-1")
    metadata = pickle.loads((root / "step-2" / ".metadata").read_bytes())  # the test's own
    (record,) = metadata.storage_data.values()
    assert getattr(record, fmt.EXTRA)["ref"] == "step-1"
    record.relative_path, record.offset, record.length = (
        info.relative_path,
        info.offset,
        info.length,
    )
    setattr(record, fmt.EXTRA, {"ref": "step-1"})  # a stock item's record: no checksum
    (root / "step-2" / ".metadata").write_bytes(pickle.dumps(metadata))
    shutil.rmtree(root / "step-1")
    (root / "step-1").symlink_to(private, target_is_directory=True)
    return root / "step-2"


def test_load_refuses_a_base_that_is_a_link(hostile: Path) -> None:
    # Before: the load followed the link and handed the private checkpoint's values over.
    target = {"w": torch.zeros(256)}
    with pytest.raises(UnsafeCheckpointError, match="'w'.*step-1.*symbolic link") as info:
        storage.load(target, hostile)
    assert str(hostile) in str(info.value) and "dcp-storage cp" in str(info.value)
    assert not torch.equal(target["w"], SECRET)


def test_verify_reports_a_base_that_is_a_link(
    hostile: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: verify read the private file through the link and called the step OK.
    assert main(["verify", str(hostile)]) == 1
    out = capsys.readouterr().out
    assert out.startswith("BAD: 1 of 1") and "'w'" in out and "symbolic link" in out


def test_cp_never_copies_a_base_through_a_link(hostile: Path, tmp_path: Path) -> None:
    # Before: the copy made a self-contained checkpoint of the private values, readable
    # by whoever can read the destination.
    fs: FileSystemBase
    fs, src = filesystem_from_url(str(hostile))
    with pytest.raises(UnsafeCheckpointError, match="symbolic link"):
        copy_checkpoint(fs, src, fs, str(tmp_path / "copy"))
    assert not (tmp_path / "copy" / ".metadata").exists()


def test_export_never_reads_a_base_through_a_link(hostile: Path, tmp_path: Path) -> None:
    # Before: the export wrote the private values into a model.safetensors.
    fs: FileSystemBase
    fs, src = filesystem_from_url(str(hostile))
    with pytest.raises(UnsafeCheckpointError, match="symbolic link"):
        export_safetensors(fs, src, fs, str(tmp_path / "model"))
    assert not list((tmp_path).glob("model/*.safetensors"))


def test_a_real_base_still_loads(tmp_path: Path) -> None:
    root = tmp_path / "root"
    storage.save({"w": torch.ones(8), "v": torch.zeros(2)}, root / "step-1", fingerprint=True)
    storage.save({"w": torch.ones(8), "v": torch.ones(2)}, root / "step-2", base=root / "step-1")
    target = {"w": torch.zeros(8), "v": torch.zeros(2)}
    storage.load(target, root / "step-2")
    assert torch.equal(target["w"], torch.ones(8)) and torch.equal(target["v"], torch.ones(2))
