"""Metadata whose chunks leave part of a tensor without a stored value.

DCP plans reads for the chunks a metadata lists and nothing else, so a tensor whose
chunks do not cover it used to load without a word, the rest of the target keeping
whatever it held (freshly initialised weights). Each test forges such a metadata from a
real save (the test's own pickle round-trip; an unencrypted save carries no seal) and
checks that a load asking for the item is refused naming it, that a load of the other
keys still works, and that ``verify`` reports the item.
"""

from __future__ import annotations

import pickle
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorStorageMetadata,
)

import storage
from extensions.errors import IntegrityError
from storage.backends import LocalFileSystem
from storage.cli.main import main
from storage.ops.verify import verify
from tests.support.distributed import gloo_group, spawn


def _meta(ckpt: Path) -> Any:
    return pickle.loads((ckpt / ".metadata").read_bytes())  # the test's own file: trusted


def _write_meta(ckpt: Path, metadata: Any) -> None:
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))


def _index(metadata: Any, fqn: str) -> MetadataIndex:
    return next(k for k in metadata.storage_data if k.fqn == fqn)


def _two_chunks(ckpt: Path, second: int = 96) -> None:
    """A checkpoint whose 128-element ``w`` is stored as two chunks, as two ranks save
    it: ``[0, 96)`` and ``[second, 128)`` (overlapping the first where ``second`` is
    below 96); and a plain ``b``."""
    storage.save(
        {"w0": torch.arange(96.0), "w1": torch.arange(float(second), 128.0), "b": torch.ones(4)},
        ckpt,
    )
    metadata = _meta(ckpt)
    props = metadata.state_dict_metadata["w0"].properties
    chunks = [
        ChunkStorageMetadata(torch.Size([0]), torch.Size([96])),
        ChunkStorageMetadata(torch.Size([second]), torch.Size([128 - second])),
    ]
    for part, chunk in zip(("w0", "w1"), chunks):
        del metadata.state_dict_metadata[part]
        info = metadata.storage_data.pop(_index(metadata, part))
        metadata.storage_data[MetadataIndex("w", chunk.offsets)] = info
    metadata.state_dict_metadata["w"] = TensorStorageMetadata(props, torch.Size([128]), chunks)
    _write_meta(ckpt, metadata)


def _drop_chunk(ckpt: Path, fqn: str, offset: int | None) -> None:
    """Remove the chunk of ``fqn`` at ``offset`` (every chunk: ``None``) and its record."""
    metadata = _meta(ckpt)
    md = metadata.state_dict_metadata[fqn]
    gone = [c for c in md.chunks if offset is None or list(c.offsets) == [offset]]
    md.chunks = [c for c in md.chunks if c not in gone]
    for chunk in gone:
        del metadata.storage_data[MetadataIndex(fqn, chunk.offsets)]
    _write_meta(ckpt, metadata)


def _target() -> dict[str, torch.Tensor]:
    return {"w": torch.full((128,), -1.0), "b": torch.zeros(4)}


def test_a_tensor_stored_as_two_chunks_loads_whole(tmp_path: Path) -> None:
    # The forgery the other tests start from is a checkpoint the reader loads.
    _two_chunks(tmp_path)
    target = _target()
    storage.load(target, tmp_path)
    assert torch.equal(target["w"], torch.arange(128.0))
    assert verify(LocalFileSystem(), str(tmp_path)).bad == {}


def test_a_load_of_a_tensor_its_chunks_do_not_cover_is_refused_naming_it(
    tmp_path: Path,
) -> None:
    # Without the check the load succeeded and w[96:] kept its -1s.
    _two_chunks(tmp_path)
    _drop_chunk(tmp_path, "w", 96)
    target = _target()
    with pytest.raises(IntegrityError, match=r"'w'.*cover 96 of its 128 elements") as info:
        storage.load(target, tmp_path)
    assert str(tmp_path) in str(info.value)
    assert "Re-save the checkpoint, or load from another step" in str(info.value)
    assert (target["w"] == -1).all()  # refused before anything was read


def test_a_stock_dcp_load_through_the_reader_is_refused_too(tmp_path: Path) -> None:
    _two_chunks(tmp_path)
    _drop_chunk(tmp_path, "w", 96)
    reader = storage.CheckpointReader(tmp_path)
    with pytest.raises(BaseException, match=r"'w'.*cover 96 of its 128 elements"):
        dcp.load(_target(), storage_reader=reader, no_dist=True)


@pytest.mark.parametrize("offset", [96, None], ids=["one chunk gone", "every chunk gone"])
def test_a_load_that_leaves_the_uncovered_tensor_out_still_works(
    tmp_path: Path, offset: int | None
) -> None:
    _two_chunks(tmp_path)
    _drop_chunk(tmp_path, "w", offset)
    model_only = {"b": torch.zeros(4)}
    storage.load(model_only, tmp_path)
    assert torch.equal(model_only["b"], torch.ones(4))
    partial = {"b": torch.zeros(4), "not_saved": torch.zeros(2)}
    dcp.load(
        partial,
        storage_reader=storage.CheckpointReader(tmp_path),
        planner=DefaultLoadPlanner(allow_partial_load=True),
        no_dist=True,
    )
    assert torch.equal(partial["b"], torch.ones(4))


def test_a_tensor_with_no_chunk_at_all_is_refused(tmp_path: Path) -> None:
    # Its load plans no read at all: only the keys asked for say it was wanted.
    _two_chunks(tmp_path)
    _drop_chunk(tmp_path, "w", None)
    target = _target()
    with pytest.raises(IntegrityError, match=r"'w'.*cover 0 of its 128 elements"):
        storage.load(target, tmp_path)
    assert (target["w"] == -1).all()


def test_a_scalar_with_no_chunk_is_refused(tmp_path: Path) -> None:
    storage.save({"step": torch.tensor(7), "b": torch.ones(4)}, tmp_path)
    _drop_chunk(tmp_path, "step", None)
    with pytest.raises(IntegrityError, match=r"'step'.*cover 0 of its 1 elements"):
        storage.load({"step": torch.tensor(0), "b": torch.zeros(4)}, tmp_path)


def test_an_empty_tensor_with_no_chunk_loads(tmp_path: Path) -> None:
    # Nothing of it is left without a value.
    storage.save({"e": torch.zeros(0, 4), "b": torch.ones(4)}, tmp_path)
    _drop_chunk(tmp_path, "e", None)
    target = {"e": torch.zeros(0, 4), "b": torch.zeros(4)}
    storage.load(target, tmp_path)
    assert torch.equal(target["b"], torch.ones(4))


def test_overlapping_chunks_that_hold_more_than_the_tensor_load(tmp_path: Path) -> None:
    # Replicated chunks saved without dedup (a custom planner's choice) are not damage.
    _two_chunks(tmp_path, second=64)
    target = _target()
    storage.load(target, tmp_path)
    assert torch.equal(target["w"], torch.arange(128.0))


def test_verify_reports_the_uncovered_tensor_by_name(tmp_path: Path) -> None:
    _two_chunks(tmp_path)
    _drop_chunk(tmp_path, "w", 96)
    report = verify(LocalFileSystem(), str(tmp_path))
    assert "cover 96 of its 128 elements" in report.bad["w"]
    assert "w" not in report.ok  # its chunk at offset 0 shares its name
    assert "b" in report.ok


def test_verify_reports_a_tensor_with_no_chunk(tmp_path: Path, capsys: Any) -> None:
    _two_chunks(tmp_path)
    _drop_chunk(tmp_path, "w", None)
    assert "cover 0 of its 128 elements" in verify(LocalFileSystem(), str(tmp_path)).bad["w"]
    assert main(["verify", str(tmp_path)]) == 1
    assert "cover 0 of its 128 elements" in capsys.readouterr().out


def test_a_chunk_without_its_record_is_refused_naming_it(tmp_path: Path) -> None:
    # A chunk the metadata lists whose record (its storage index entry) is gone.
    _two_chunks(tmp_path)
    metadata = _meta(tmp_path)
    del metadata.storage_data[MetadataIndex("w", torch.Size([96]))]
    _write_meta(tmp_path, metadata)
    with pytest.raises(IntegrityError, match=r"'w@\[96\]'.*not in the checkpoint's storage"):
        storage.load(_target(), tmp_path)
    assert verify(LocalFileSystem(), str(tmp_path)).bad == {
        "w@[96]": "missing from the storage index"
    }


def _read_once_worker(rank: int, store: str, path: str) -> None:
    with gloo_group(rank, 2, store, timeout=timedelta(seconds=60)):
        # Both ranks need "b" (shared: one fetches it); rank 0 alone asks for "w".
        target = {"b": torch.zeros(4)} | ({"w": torch.zeros(128)} if rank == 0 else {})
        reader = storage.CheckpointReader(path, read_once=True)
        with pytest.raises(CheckpointException) as info:
            dcp.load(target, storage_reader=reader)
        failures = info.value.failures
        assert set(failures) == {0, 1}, failures
        assert all("cover 0 of its 128 elements" in str(e) for e in failures.values()), failures


def test_a_read_once_rank_asking_for_an_uncovered_tensor_fails_every_rank(
    tmp_path: Path,
) -> None:
    # The rank that asks for it refuses it at the read-once agreement, so the rank that
    # does not hears of it there rather than waiting for bytes that never come.
    ckpt = tmp_path / "ckpt"
    _two_chunks(ckpt)
    _drop_chunk(ckpt, "w", None)
    spawn(_read_once_worker, (str(tmp_path / "store"), str(ckpt)))
