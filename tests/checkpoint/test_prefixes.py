"""Data files under key prefixes (``key_prefixes=N``): the checkpoint loads with our
reader and stock DCP's, the relative_path rule accepts exactly the prefix form, and
every deletion path (delete, retention, cleanup, ``dcp-storage rm``) sees into it."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import storage
from extensions.errors import UnsafeCheckpointError
from storage.checkpoint import storage_format as fmt
from storage.checkpoint.deletion import delete_checkpoint
from storage.checkpoint.layout import is_data_file_name
from storage.checkpoint.prefixes import place
from storage.checkpoint.validate import check_relative_path
from storage.cli import main as cli_main
from storage.ops.describe import describe
from storage.ops.manager import CheckpointManager


def _state() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    return {f"t{i}": torch.randn(256, 64, generator=gen) for i in range(6)} | {"step": 3}


def _blank() -> dict[str, Any]:
    return {
        k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in _state().items()
    }


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_place_spreads_ranks_over_hex_prefixes() -> None:
    assert place("__5_0-x.distcp", 5, 0) == "__5_0-x.distcp"
    assert place("__5_0-x.distcp", 5, 1) == "__5_0-x.distcp"
    assert place("__5_0-x.distcp", 5, 16) == "05/__5_0-x.distcp"
    assert place("__300_0.distcp", 300, 256) == "2c/__300_0.distcp"
    assert place("__300_0.distcp", 300, 4096) == "12c/__300_0.distcp"
    with pytest.raises(TypeError, match="key_prefixes"):
        storage.CheckpointWriter("x", key_prefixes=-1)


def test_file_rank_reads_past_the_prefix() -> None:
    # Before, the rank of a prefixed data file was read from its prefix and came out
    # as 0: every rank's prefixed files looked like rank 0's to the tier code and to a
    # per-rank copy.
    assert fmt.file_rank(place(fmt.data_file_name(10, 0, "abc"), 10, 16)) == 10
    assert fmt.file_rank("__3_1.distcp") == 3 and fmt.file_rank("other.bin") == 0


@pytest.mark.parametrize(
    "path", ["__0_0.distcp", "0a/__0_0.distcp", "deadbeef/__0_0-ab.distcp", "f/x"]
)
def test_relative_path_rule_accepts_one_hex_prefix(path: str) -> None:
    check_relative_path(path, "ckpt", "w")


@pytest.mark.parametrize(
    "path",
    [
        "../x",
        "0a/../x",
        "0a/..",
        "0a/b/c",
        "0A/x",
        "g1/x",
        "123456789/x",
        "/abs",
        "0a/",
        "/0a/x",
        "0a\\x",
        "s3://b/k",
        "0a/c:x",
    ],
)
def test_relative_path_rule_refuses_anything_else(path: str) -> None:
    with pytest.raises(UnsafeCheckpointError, match="not a file inside the checkpoint"):
        check_relative_path(path, "ckpt", "w")


def test_prefixed_checkpoint_loads_with_ours_and_stock(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    state = _state()
    storage.save(state, str(path), key_prefixes=8, single_file_per_rank=False)
    data = [f for f in _files(path) if f.endswith(".distcp")]
    assert data and all(f.startswith("00/") for f in data)  # one rank: one prefix
    assert all(is_data_file_name(f) for f in data)
    ours = _blank()
    storage.load(ours, str(path))
    stock = _blank()
    dcp.load(stock, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
    for got in (ours, stock):
        assert all(torch.equal(got[k], v) for k, v in state.items() if k != "step")
        assert got["step"] == 3


def test_linked_prefix_directory_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    storage.save(_state(), str(path), key_prefixes=8)
    elsewhere = tmp_path / "elsewhere"
    os.rename(path / "00", elsewhere)
    os.symlink(elsewhere, path / "00")
    with pytest.raises(UnsafeCheckpointError, match="symbolic link"):
        storage.load(_blank(), str(path))


def test_every_deletion_path_sees_into_prefixes(tmp_path: Path) -> None:
    root = tmp_path / "run"
    manager = CheckpointManager(str(root), keep_last=1, key_prefixes=4)
    manager.save(1, _state())
    assert any("/00/" in f"/{f}" for f in _files(root / "step-1"))
    manager.save(2, _state())  # retention removes step 1, prefix directory included
    assert not (root / "step-1").exists()
    # A save that died before its metadata: cleanup removes its prefixed files.
    leftover = root / "step-3" / "00"
    leftover.mkdir(parents=True)
    (leftover / "__0_0-abc.distcp").write_bytes(b"x")
    old = time.time() - 7200
    os.utime(leftover / "__0_0-abc.distcp", (old, old))
    assert manager.cleanup(grace_seconds=3600) == [3]
    assert not (root / "step-3").exists()
    # An unrelated file in a prefix directory is never touched.
    (root / "step-2" / "00" / "notes.txt").write_text("mine")
    kept = delete_checkpoint(storage.LocalFileSystem(), str(root / "step-2"))
    assert kept == ["00/notes.txt"]
    assert _files(root / "step-2") == ["00/notes.txt"]


def test_cli_rm_removes_prefixed_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    storage.save(_state(), str(path), key_prefixes=16)
    assert cli_main(["rm", str(path)]) == 0
    assert not path.exists()


def test_incremental_manager_with_key_prefixes(tmp_path: Path) -> None:
    # Before: the second save always failed ("base ... lost
    # '00/__0_0-....distcp' during the save"): the pre-publish check listed the base
    # without looking into its prefix directories.
    manager = CheckpointManager(str(tmp_path / "run"), incremental=True, key_prefixes=4)
    manager.save(1, _state())
    changed = _state() | {"t0": torch.ones(256, 64)}
    manager.save(2, changed)
    refs = {r.item: r.ref for r in describe(storage.LocalFileSystem(), manager.step_path(2)).items}
    assert refs["t1"] == "step-1" and refs["t0"] is None
    assert any(f.startswith("00/") for f in _files(tmp_path / "run" / "step-2"))
    out = _blank()
    assert manager.load(out, 2) == 2
    assert all(torch.equal(out[k], v) for k, v in changed.items() if k != "step")


def test_cli_cp_keeps_the_key_prefixes(tmp_path: Path) -> None:
    # Before: a copy (and the tier drain, which copies the same way) wrote every data
    # file flat under the destination, losing the prefixes where they matter: the bucket.
    src, dst = tmp_path / "src", tmp_path / "dst"
    storage.save(_state(), str(src), key_prefixes=16)
    assert cli_main(["cp", str(src), str(dst)]) == 0
    data = [f for f in _files(dst) if f.endswith(".distcp")]
    assert data and all(f.startswith("00/") for f in data)
    copied = _blank()
    storage.load(copied, str(dst))
    assert all(torch.equal(copied[k], v) for k, v in _state().items() if k != "step")
