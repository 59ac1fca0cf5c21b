"""The read model of a committed checkpoint (storage/checkpoint/committed.py): what it
reports, and its one error policy (missing: not committed; anything else: unreadable,
which may reference any sibling)."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import storage
from extensions.errors import CheckpointNotFoundError, UnsafeCheckpointError
from storage import LocalFileSystem, MemoryFileSystem
from storage.checkpoint.committed import Siblings, open_committed


def _state(value: float) -> dict[str, Any]:
    return {"frozen": torch.arange(64.0), "w": torch.full((4,), value)}


def test_a_missing_location_is_not_committed(tmp_path: Path) -> None:
    for fs, path in ((LocalFileSystem(), str(tmp_path / "nope")), (MemoryFileSystem(), "x/y")):
        checkpoint = open_committed(fs, path)
        assert not checkpoint.committed and checkpoint.readable
        assert checkpoint.data_files() == frozenset() and not checkpoint.may_reference("a")
        with pytest.raises(CheckpointNotFoundError, match="does not exist"):
            checkpoint.require()
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointNotFoundError, match="not a committed checkpoint"):
        open_committed(LocalFileSystem(), str(tmp_path / "empty")).require()


def test_files_references_and_chain_across_rank_local_metadata(tmp_path: Path) -> None:
    storage.save(_state(1.0), str(tmp_path / "a"), fingerprint=True)
    writer = storage.CheckpointWriter(tmp_path / "b", base=str(tmp_path / "a"))
    dcp.save(_state(2.0), storage_writer=writer, no_dist=True, use_collectives=False)
    a = open_committed(LocalFileSystem(), str(tmp_path / "a"))
    b = open_committed(LocalFileSystem(), str(tmp_path / "b"))
    assert a.committing == (".metadata",) and a.references() == frozenset() and a.chain == 0
    assert len(a.data_files()) == 1 and a.global_metadata is not None
    assert b.committing == ("__0.metadata",) and b.references() == {"a"}
    assert b.may_reference("a") and not b.may_reference("b")
    assert b.global_metadata is None and b.items() == {}  # never a base
    assert set(b.data_files()) == {p.name for p in (tmp_path / "b").glob("*.distcp")}


class _Broken(LocalFileSystem):
    def read_bytes(self, path: str) -> bytes:
        raise OSError(errno.EIO, "Input/output error", path)


def test_unreadable_metadata_may_reference_anything(tmp_path: Path) -> None:
    for name in ("a", "b"):
        storage.save(_state(1.0), str(tmp_path / name))
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / ".metadata").write_bytes(b"not a pickle")
    damaged = open_committed(LocalFileSystem(), str(tmp_path / "c"))
    failing = open_committed(_Broken(), str(tmp_path / "a"))
    for checkpoint, error in ((damaged, UnsafeCheckpointError), (failing, OSError)):
        assert checkpoint.committed and not checkpoint.readable
        assert checkpoint.may_reference("anything") and checkpoint.data_files() == frozenset()
        with pytest.raises(error):
            checkpoint.require()
    siblings = Siblings(LocalFileSystem(), str(tmp_path))
    assert [c.name for c in siblings.users("a")] == ["c"]
    with pytest.raises(UnsafeCheckpointError, match="c beside it cannot be read"):
        siblings.refuse_if_referenced("a")
