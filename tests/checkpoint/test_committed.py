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
from storage.checkpoint.committed import ReadModels, files_read, open_committed
from storage.checkpoint.siblings import Siblings


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
    def read_bytes(self, path: str, *, limit: int | None = None) -> bytes:
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


class _Counting(LocalFileSystem):
    """Local disk that counts the metadata files it reads (those that exist)."""

    def __init__(self) -> None:
        super().__init__()
        self.metadata_reads: list[str] = []

    def read_bytes(self, path: str, *, limit: int | None = None) -> bytes:
        data = super().read_bytes(path, limit=limit)  # a missing one is no read
        if path.endswith("metadata"):
            self.metadata_reads.append(path)
        return data


def test_read_models_serve_unchanged_metadata_and_reread_a_new_save(tmp_path: Path) -> None:
    fs, path = _Counting(), str(tmp_path / "a")
    storage.save(_state(1.0), path, fingerprint=True)
    models = ReadModels()
    first = models.open(fs, path)
    assert models.open(fs, path) is first and len(fs.metadata_reads) == 1
    # A new save of the same path is a new metadata file: read again, never the old model.
    storage.save(_state(2.0), path, fingerprint=True)
    second = models.open(fs, path)
    assert second is not first and len(fs.metadata_reads) == 2
    assert second.global_metadata is not None
    assert second.global_metadata.storage_meta.save_id != first.global_metadata.storage_meta.save_id
    # A lingering rank-local metadata beside it: remembering is refused, all are read.
    (tmp_path / "a" / "__0.metadata").write_bytes((tmp_path / "a" / ".metadata").read_bytes())
    models.remember(fs, path, second.global_metadata)
    assert set(models.open(fs, path).metadata) == {".metadata", "__0.metadata"}
    # Unreadable: never kept, read every time.
    (tmp_path / "a" / "__0.metadata").write_bytes(b"not a pickle")
    reads = len(fs.metadata_reads)
    assert not models.open(fs, path).readable and not models.open(fs, path).readable
    assert len(fs.metadata_reads) == reads + 4


def test_an_incremental_manager_save_reads_no_metadata_it_knows(tmp_path: Path) -> None:
    """Before: each save read the base's metadata twice (manager, then writer) and every
    step's again in retention (6 reads per step here); now a warm manager reads none,
    and a step rewritten behind its back is read again."""
    fs = _Counting()
    mgr = storage.CheckpointManager(tmp_path, keep_last=2, incremental=True, filesystem=fs)
    for step in range(1, 4):
        mgr.save(step, _state(float(step)))
    fs.metadata_reads.clear()
    mgr.save(4, _state(4.0))
    assert fs.metadata_reads == []
    assert mgr.steps() == [1, 3, 4]  # step 1 holds the frozen bytes every step references
    # Someone else saves step 4 again: the next save reads that metadata, once.
    storage.save(_state(5.0), mgr.step_url(4), fingerprint=True)
    mgr.save(6, _state(6.0))
    assert fs.metadata_reads == [mgr.step_path(4) + "/.metadata"]
    for step, value in ((4, 5.0), (6, 6.0)):
        out = {"frozen": torch.zeros(64), "w": torch.zeros(4)}
        mgr.load(out, step)
        assert torch.equal(out["w"], torch.full((4,), value))
        assert torch.equal(out["frozen"], torch.arange(64.0))


def test_a_tiered_save_reads_no_local_metadata_it_knows(tmp_path: Path) -> None:
    """Before: making room and choosing the base re-read every local step's metadata
    twice per blocking save, and the commit unpickled the payload it had just built."""
    fs = _Counting()
    mgr = storage.CheckpointManager(
        tmp_path / "durable",
        local=tmp_path / "local",
        keep_local=1,
        incremental=True,
        local_filesystem=fs,
    )
    for step in range(1, 4):
        mgr.save(step, _state(float(step)))
        mgr.wait()
    fs.metadata_reads.clear()
    mgr.save(4, _state(4.0))
    mgr.wait()
    assert fs.metadata_reads == []
    out = {"frozen": torch.zeros(64), "w": torch.zeros(4)}
    assert mgr.load(out, 4).tier == "local"
    assert torch.equal(out["w"], torch.full((4,), 4.0))


def test_the_files_a_load_reads_pass_over_a_chunk_without_its_record(tmp_path: Path) -> None:
    # Without the check a tiered restore's planning failed on a raw KeyError; the load
    # itself refuses such an item, naming it.
    import pickle

    storage.save({"a": torch.ones(4), "b": torch.zeros(4)}, tmp_path)
    metadata = pickle.loads((tmp_path / ".metadata").read_bytes())  # the test's own file
    del metadata.storage_data[next(k for k in metadata.storage_data if k.fqn == "a")]
    files = files_read(metadata, {"a": torch.ones(4), "b": torch.zeros(4)})
    assert [name for _, name in files] == [next(iter(metadata.storage_data.values())).relative_path]
