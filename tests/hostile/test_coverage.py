"""Metadata whose chunks leave part of a tensor without a stored value.

DCP plans reads for the chunks a metadata lists and nothing else, so a tensor whose
chunks do not cover what a load asks for used to load without a word, the rest of the
target keeping whatever it held (freshly initialised weights). The checkpoints here are
saved by two ranks together (each holding half of a sharded ``w``), then a chunk is
taken out of their ``.metadata`` (the test's own pickle round-trip; an unencrypted save
carries no seal): a load asking for the item is refused naming it, a load of the other
keys still works, and ``verify`` reports the item. A save by one process of its own
shards of a sharded tensor records no more than those: that is no damage, and loading
it back shard by shard still works. A conversion (torch's ``dcp_to_torch_save``
through our reader) is refused like a load. Chunks that overlap: ``test_coverage_overlap.py``.
"""

from __future__ import annotations

import pickle
import shutil
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
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import storage
from extensions.errors import IntegrityError
from storage.backends import LocalFileSystem
from storage.checkpoint import storage_format as fmt
from storage.cli.main import main
from storage.ops.verify import verify
from tests.support.distributed import gloo_group, spawn

TIMEOUT = timedelta(seconds=60)


def _save_worker(rank: int, store: str, path: str) -> None:
    with gloo_group(rank, 2, store, timeout=TIMEOUT):
        mesh = init_device_mesh("cpu", (2,))
        state = {
            "w": distribute_tensor(torch.arange(128.0), mesh, [Shard(0)]),
            "v": distribute_tensor(torch.arange(8.0), mesh, [Shard(0)]),
            "b": torch.ones(4),
            "step": torch.tensor(7),
            "e": torch.zeros(0, 4),
        }
        storage.save(state, path)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint two ranks saved together: ``w`` (128 elements) as two chunks of 64,
    one in each rank's data file, ``v`` likewise (8 elements); ``b``, a scalar ``step``
    and an empty ``e``."""
    root = tmp_path_factory.mktemp("saved")
    spawn(_save_worker, (str(root / "store"), str(root / "ckpt")))
    return root / "ckpt"


@pytest.fixture
def ckpt(saved: Path, tmp_path: Path) -> Path:
    """A copy of :func:`saved` for one test to damage."""
    return Path(shutil.copytree(saved, tmp_path / "ckpt"))


def _meta(ckpt: Path) -> Any:
    return pickle.loads((ckpt / ".metadata").read_bytes())  # the test's own file: trusted


def _write_meta(ckpt: Path, metadata: Any) -> None:
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))


def _drop_chunk(ckpt: Path, fqn: str, offset: int | None) -> None:
    """Take the chunk of ``fqn`` at ``offset`` (every chunk: ``None``) and its record out
    of the metadata, as if the rank that saved it had never reported it."""
    metadata = _meta(ckpt)
    md = metadata.state_dict_metadata[fqn]
    gone = [c for c in md.chunks if offset is None or list(c.offsets) == [offset]]
    assert gone
    md.chunks = [c for c in md.chunks if c not in gone]
    for chunk in gone:
        del metadata.storage_data[MetadataIndex(fqn, chunk.offsets)]
    _write_meta(ckpt, metadata)


def _target() -> dict[str, torch.Tensor]:
    return {"w": torch.full((128,), -1.0), "b": torch.zeros(4), "step": torch.tensor(0)}


def test_the_two_rank_checkpoint_loads_whole_in_one_process(ckpt: Path) -> None:
    # What the other tests damage: w's two chunks, from the two ranks' files.
    assert [list(c.offsets) for c in _meta(ckpt).state_dict_metadata["w"].chunks] == [[0], [64]]
    target = _target()
    storage.load(target, ckpt)
    assert torch.equal(target["w"], torch.arange(128.0))
    assert verify(LocalFileSystem(), str(ckpt)).bad == {}


def test_a_load_of_a_tensor_its_chunks_do_not_cover_is_refused_naming_it(ckpt: Path) -> None:
    # Without the check the load succeeded and w[64:] kept its -1s.
    _drop_chunk(ckpt, "w", 64)
    target = _target()
    with pytest.raises(IntegrityError, match=r"'w'.*cover 64 of the 128 elements") as info:
        storage.load(target, ckpt)
    assert str(ckpt) in str(info.value)
    assert "Re-save the checkpoint, or load from another step" in str(info.value)
    assert (target["w"] == -1).all()  # refused before anything was read


def test_a_stock_dcp_load_through_the_reader_is_refused_too(ckpt: Path) -> None:
    _drop_chunk(ckpt, "w", 64)
    reader = storage.CheckpointReader(ckpt)
    with pytest.raises(CheckpointException, match=r"'w'.*cover 64 of the 128 elements"):
        dcp.load(_target(), storage_reader=reader, no_dist=True)


@pytest.mark.parametrize("offset", [64, None], ids=["one chunk gone", "every chunk gone"])
def test_a_load_that_leaves_the_uncovered_tensor_out_still_works(
    ckpt: Path, offset: int | None
) -> None:
    _drop_chunk(ckpt, "w", offset)
    model_only = {"b": torch.zeros(4)}
    storage.load(model_only, ckpt)
    assert torch.equal(model_only["b"], torch.ones(4))
    partial = {"b": torch.zeros(4), "not_saved": torch.zeros(2)}
    dcp.load(
        partial,
        storage_reader=storage.CheckpointReader(ckpt),
        planner=DefaultLoadPlanner(allow_partial_load=True),
        no_dist=True,
    )
    assert torch.equal(partial["b"], torch.ones(4))


def test_a_tensor_with_no_chunk_at_all_is_refused(ckpt: Path) -> None:
    # Its load plans no read at all: only the planner's targets say it was asked for.
    _drop_chunk(ckpt, "w", None)
    target = _target()
    with pytest.raises(IntegrityError, match=r"'w'.*cover 0 of the 128 elements"):
        storage.load(target, ckpt)
    assert (target["w"] == -1).all()


def test_a_scalar_with_no_chunk_is_refused(ckpt: Path) -> None:
    _drop_chunk(ckpt, "step", None)
    with pytest.raises(IntegrityError, match=r"'step'.*cover 0 of the 1 elements"):
        storage.load({"step": torch.tensor(0)}, ckpt)


def test_an_empty_tensor_with_no_chunk_loads(ckpt: Path) -> None:
    # Nothing of it is left without a value.
    _drop_chunk(ckpt, "e", None)
    target = {"e": torch.zeros(0, 4), "b": torch.zeros(4)}
    storage.load(target, ckpt)
    assert torch.equal(target["b"], torch.ones(4))


def test_overlapping_chunks_that_hold_more_than_the_tensor_load(tmp_path: Path) -> None:
    # Replicated chunks saved without dedup (a custom planner's choice) are not damage:
    # w's chunks [0, 96) and [64, 128) hold 160 elements of its 128.
    storage.save({"w0": torch.arange(96.0), "w1": torch.arange(64.0, 128.0)}, tmp_path)
    metadata = _meta(tmp_path)
    props = metadata.state_dict_metadata["w0"].properties
    chunks = [
        ChunkStorageMetadata(torch.Size([0]), torch.Size([96])),
        ChunkStorageMetadata(torch.Size([64]), torch.Size([64])),
    ]
    for part, chunk in zip(("w0", "w1"), chunks):
        del metadata.state_dict_metadata[part]
        index = next(k for k in metadata.storage_data if k.fqn == part)
        metadata.storage_data[MetadataIndex("w", chunk.offsets)] = metadata.storage_data.pop(index)
    metadata.state_dict_metadata["w"] = TensorStorageMetadata(props, torch.Size([128]), chunks)
    _write_meta(tmp_path, metadata)
    target = {"w": torch.zeros(128)}
    storage.load(target, tmp_path)
    assert torch.equal(target["w"], torch.arange(128.0))


def test_a_chunk_listed_twice_never_stands_in_for_a_missing_one(ckpt: Path) -> None:
    # Before: w's chunk at 0 listed twice in place of the one at 64 summed to 128
    # elements, so the load passed the check, read [0, 64) twice and left w[64:] at -1.
    _drop_chunk(ckpt, "w", 64)
    metadata = _meta(ckpt)
    chunks = metadata.state_dict_metadata["w"].chunks
    metadata.state_dict_metadata["w"].chunks = [chunks[0], chunks[0]]
    _write_meta(ckpt, metadata)
    target = _target()
    with pytest.raises(IntegrityError, match=r"'w'.*cover 64 of the 128 elements"):
        storage.load(target, ckpt)
    assert (target["w"] == -1).all()
    assert "cover 64 of its 128 elements" in verify(LocalFileSystem(), str(ckpt)).bad["w"]


def test_verify_reports_the_uncovered_tensor_by_name(ckpt: Path) -> None:
    _drop_chunk(ckpt, "w", 64)
    report = verify(LocalFileSystem(), str(ckpt))
    assert "cover 64 of its 128 elements" in report.bad["w"]
    assert "w" not in report.ok  # its chunk at offset 0 shares its name
    assert "b" in report.ok


def test_verify_reports_a_tensor_with_no_chunk(ckpt: Path, capsys: Any) -> None:
    _drop_chunk(ckpt, "w", None)
    assert "cover 0 of its 128 elements" in verify(LocalFileSystem(), str(ckpt)).bad["w"]
    assert main(["verify", str(ckpt)]) == 1
    assert "cover 0 of its 128 elements" in capsys.readouterr().out


def test_verify_reports_a_lost_rank_whose_every_chunk_and_file_is_gone(ckpt: Path) -> None:
    # Rank 1's chunks and records all gone from the metadata: every record left names
    # rank 0's data file. Before the save recorded how many ranks saved, verify told a
    # two-rank save from such data files alone, so it saw a save by one process (whose
    # metadata may hold only its own shards) and called this checkpoint good.
    assert fmt.ranks_of(_meta(ckpt)) == 2
    metadata = _meta(ckpt)
    lost = [
        index
        for index, info in metadata.storage_data.items()
        if fmt.file_rank(info.relative_path) == 1
    ]
    assert {index.fqn for index in lost} >= {"w", "v"}
    for index in lost:
        del metadata.storage_data[index]
        md = metadata.state_dict_metadata[index.fqn]
        md.chunks = [c for c in md.chunks if c.offsets != index.offset]
    _write_meta(ckpt, metadata)
    (_,) = {info.relative_path for info in metadata.storage_data.values()}  # rank 0's alone
    report = verify(LocalFileSystem(), str(ckpt))
    assert "cover 64 of its 128 elements" in report.bad["w"]
    assert "cover 4 of its 8 elements" in report.bad["v"]


def test_a_chunk_without_its_record_is_refused_naming_it(ckpt: Path) -> None:
    # A chunk the metadata lists whose record (its storage index entry) is gone.
    metadata = _meta(ckpt)
    del metadata.storage_data[MetadataIndex("w", torch.Size([64]))]
    _write_meta(ckpt, metadata)
    with pytest.raises(IntegrityError, match=r"'w@\[64\]'.*not in the checkpoint's storage"):
        storage.load(_target(), ckpt)
    assert verify(LocalFileSystem(), str(ckpt)).bad == {"w@[64]": "missing from the storage index"}


def _one_process_worker(rank: int, store: str, root: str) -> None:
    with gloo_group(rank, 2, store, timeout=TIMEOUT):
        mesh = init_device_mesh("cpu", (2,))
        path = f"{root}/rank-{rank}"
        # Each rank saves its own shard alone: the metadata records w's global size
        # and this rank's chunk only (the recovery transport saves so).
        dcp.save(
            {"w": distribute_tensor(torch.arange(128.0), mesh, [Shard(0)])},
            storage_writer=storage.CheckpointWriter(path),
            no_dist=True,
        )
        shard = distribute_tensor(torch.zeros(128), mesh, [Shard(0)])
        dcp.load({"w": shard}, storage_reader=storage.CheckpointReader(path), no_dist=True)
        assert torch.equal(shard.to_local(), torch.arange(64.0) + 64 * rank)
        assert verify(LocalFileSystem(), path).bad == {}  # no damage
        # A load of the whole tensor from it would leave the other half as it was.
        with pytest.raises(CheckpointException, match=r"'w'.*cover 64 of the 128 elements"):
            dcp.load(
                {"w": torch.zeros(128)},
                storage_reader=storage.CheckpointReader(path),
                no_dist=True,
            )


def test_a_save_by_one_process_of_its_shards_loads_back_shard_by_shard(tmp_path: Path) -> None:
    spawn(_one_process_worker, (str(tmp_path / "store"), str(tmp_path)))


def _read_once_worker(rank: int, store: str, path: str) -> None:
    with gloo_group(rank, 2, store, timeout=TIMEOUT):
        # Both ranks need "b" (shared: one fetches it); rank 0 alone asks for "w".
        target = {"b": torch.zeros(4)} | ({"w": torch.zeros(128)} if rank == 0 else {})
        reader = storage.CheckpointReader(path, read_once=True)
        with pytest.raises(CheckpointException) as info:
            dcp.load(target, storage_reader=reader)
        failures = info.value.failures
        assert set(failures) == {0, 1}, failures
        assert all("cover 0 of the 128 elements" in str(e) for e in failures.values()), failures


def test_a_read_once_rank_asking_for_an_uncovered_tensor_fails_every_rank(
    ckpt: Path, tmp_path: Path
) -> None:
    # The rank that asks for it refuses it at the read-once agreement, so the rank that
    # does not hears of it there rather than waiting for bytes that never come.
    _drop_chunk(ckpt, "w", None)
    spawn(_read_once_worker, (str(tmp_path / "store"), str(ckpt)))


def test_a_conversion_to_torch_save_of_an_uncovered_tensor_is_refused(
    ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # torch's dcp_to_torch_save, reading through ours: its planner makes every target
    # from the metadata with torch.empty, so what no chunk holds would be written out
    # as uninitialised memory. Refused, naming that, and nothing is written.
    from torch.distributed.checkpoint import format_utils

    _drop_chunk(ckpt, "w", 64)
    monkeypatch.setattr(format_utils, "FileSystemReader", storage.CheckpointReader)
    out = tmp_path / "model.pt"
    with pytest.raises(CheckpointException, match=r"'w'.*cover 64 of the 128 elements") as info:
        format_utils.dcp_to_torch_save(ckpt, out)
    assert "uninitialised memory" in str(info.value)
    assert not out.exists()
