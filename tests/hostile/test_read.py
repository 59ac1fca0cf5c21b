"""Reading what is not ours: links and special files in a checkpoint, encryption
downgrade, and errors reported as what they are (issue 10, items 6, 7 and 12).

Each test says what happened before the fix it guards."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import storage
from extensions.errors import UnsafeCheckpointError
from storage.cli import main

SECRET = torch.full((256,), 1234.5)


def _stock_save(state: dict[str, torch.Tensor], path: Path) -> None:
    # Stock DCP records no checksums, so nothing ties a data file's bytes to the metadata.
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    """A private checkpoint's data file: what a hostile checkpoint links to."""
    _stock_save({"w": SECRET}, tmp_path / "private")
    return tmp_path / "private" / "__0_0.distcp"


@pytest.fixture
def linked(tmp_path: Path, secret: Path) -> Path:
    """A checkpoint of the same shape whose data file is a symlink to ``secret``."""
    ckpt = tmp_path / "shared"
    _stock_save({"w": torch.zeros(256)}, ckpt)
    (ckpt / "__0_0.distcp").unlink()
    (ckpt / "__0_0.distcp").symlink_to(secret)
    return ckpt


@pytest.fixture(autouse=True)
def _no_env_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DCP_STORAGE_KEYS", raising=False)


# --- item 6: links and special files -------------------------------------------------


def test_load_refuses_a_data_file_that_links_elsewhere(linked: Path) -> None:
    # Before: the load followed the link and handed the private checkpoint's values over.
    target = {"w": torch.zeros(256)}
    with pytest.raises(UnsafeCheckpointError, match="symbolic link") as info:
        storage.load(target, linked)
    assert "__0_0.distcp" in str(info.value) and str(linked) in str(info.value)
    assert "cp --remove-destination" in str(info.value)
    assert not torch.equal(target["w"], SECRET)


def test_load_refuses_linked_metadata(tmp_path: Path) -> None:
    # Before: a .metadata linked from anywhere on the machine was read as this checkpoint's.
    storage.save({"w": torch.ones(4)}, tmp_path / "other")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for data in (tmp_path / "other").glob("*.distcp"):
        (ckpt / data.name).write_bytes(data.read_bytes())
    (ckpt / ".metadata").symlink_to(tmp_path / "other" / ".metadata")
    with pytest.raises(UnsafeCheckpointError, match="symbolic link"):
        storage.load({"w": torch.zeros(4)}, ckpt)


def test_cp_never_copies_what_a_link_points_at(
    linked: Path, secret: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: `dcp-storage cp` copied the private data file to the destination.
    dst = tmp_path / "dst"
    assert main(["cp", "-q", str(linked), str(dst)]) == 1
    assert "symbolic link" in capsys.readouterr().err
    assert not (dst / ".metadata").exists()
    leaked = secret.read_bytes()
    for path in dst.rglob("*") if dst.exists() else ():
        assert not path.is_file() or leaked not in path.read_bytes()


def test_verify_reports_a_linked_data_file(
    linked: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: verify read the private file, found nothing wrong and said OK.
    assert main(["verify", "-q", str(linked)]) == 1
    assert "symbolic link" in capsys.readouterr().out


@pytest.mark.timeout(60)  # a safety net only: the assertion does not depend on time
def test_load_refuses_a_fifo_without_hanging(tmp_path: Path) -> None:
    # Before: opening the FIFO blocked until a writer came along, i.e. forever.
    ckpt = tmp_path / "ckpt"
    storage.save({"w": torch.ones(4)}, ckpt)
    (data,) = ckpt.glob("*.distcp")
    data.unlink()
    os.mkfifo(data)
    with pytest.raises(UnsafeCheckpointError, match="FIFO"):
        storage.load({"w": torch.zeros(4)}, ckpt)


def test_a_linked_checkpoint_directory_still_loads(tmp_path: Path) -> None:
    # The policy's other half: `ckpt -> /mnt/...` is the user's own link and is followed.
    storage.save({"w": torch.arange(4.0)}, tmp_path / "real")
    (tmp_path / "link").symlink_to(tmp_path / "real", target_is_directory=True)
    target = {"w": torch.zeros(4)}
    storage.load(target, tmp_path / "link")
    assert torch.equal(target["w"], torch.arange(4.0))
