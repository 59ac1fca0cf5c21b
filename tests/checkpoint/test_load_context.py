"""One owner for a load's lifetime: the reader builds a ``LoadContext`` per load and the
parts that carry the load out read through it alone (storage/checkpoint/load_context.py).
That those parts never import the reader is import-linter's to check
(tests/test_layering.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

import storage
from extensions import ZStandard
from storage.checkpoint import fetch
from storage.checkpoint.deadline import Budget
from storage.checkpoint.decode import MAX_OBJECT_BYTES
from storage.checkpoint.load_context import LoadContext


def _saved(tmp_path: Path) -> tuple[Path, dict[str, object]]:
    source: dict[str, object] = {"w": torch.randn(64, 8), "b": torch.arange(10), "step": 7}
    storage.save(source, tmp_path / "c", transforms=[ZStandard(level=3)])
    return tmp_path / "c", source


def _planned(target: dict[str, object], metadata: object) -> DefaultLoadPlanner:
    planner = DefaultLoadPlanner()
    planner.set_up_planner(target, metadata, is_coordinator=True)  # type: ignore[arg-type]
    return planner


def test_a_load_reads_through_its_context_alone(tmp_path: Path) -> None:
    """A context built from the metadata, with no reader at all, is everything
    ``fetch.read_items`` needs to read, verify and decode a load; and it is frozen."""
    path, source = _saved(tmp_path)
    fs, location = storage.filesystem_from_url(str(path))
    metadata = storage.CheckpointReader(path).read_metadata()
    load = LoadContext.for_metadata(
        metadata,
        fs=fs,
        path=location,
        registry=None,
        keys=None,
        require_encryption=False,
        max_object_bytes=MAX_OBJECT_BYTES,
        thread_count=2,
        budget=Budget(None),
        process_group=None,
    )
    assert load.url == fs.url(location)
    assert set(load.chunks) == {i for i in load.storage_data if i.fqn != "step"}
    target: dict[str, object] = {"w": torch.zeros(64, 8), "b": torch.zeros(10, dtype=torch.long)}
    target["step"] = 0
    planner = _planned(target, metadata)
    fetch.read_items(load, planner.create_local_plan().items, planner, load.budget)
    assert torch.equal(target["w"], source["w"])  # type: ignore[arg-type]
    assert torch.equal(target["b"], source["b"])  # type: ignore[arg-type]
    assert target["step"] == 7
    with pytest.raises(dataclasses.FrozenInstanceError):
        load.thread_count = 1  # type: ignore[misc]


def test_reset_drops_the_set_up_load(tmp_path: Path) -> None:
    """``reset`` forgets the load set up before it, all of it: it used to clear the
    storage index but keep the previous load's tensor chunks."""
    path, _ = _saved(tmp_path)
    reader = storage.CheckpointReader(path)
    reader.set_up_storage_reader(reader.read_metadata(), True)
    assert reader.storage_data and reader.chunks
    reader.reset()
    assert dict(reader.storage_data) == {} and dict(reader.chunks) == {}


def test_read_data_before_set_up_says_so(tmp_path: Path) -> None:
    """Reading with a reader no load was set up on names the missing step; it used to
    report every planned item as missing from a damaged metadata."""
    path, _ = _saved(tmp_path)
    reader = storage.CheckpointReader(path)
    metadata = reader.read_metadata()
    planner = _planned({"w": torch.zeros(64, 8)}, metadata)
    with pytest.raises(RuntimeError, match="set_up_storage_reader") as info:
        reader.read_data(planner.create_local_plan(), planner)
    assert str(path) in str(info.value)
