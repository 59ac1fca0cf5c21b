"""Chunks that overlap: counted for the elements they hold together, never for their
sizes' sum, so two chunks overlapping in part cannot stand in for a missing one.

A torch save never writes overlapping chunks; a custom planner saving replicated chunks
without dedup does (no damage), and a crafted metadata can: two chunks whose sizes sum
to the tensor's while they overlap leave a gap the load used to leave as it was. The
checkpoints here store each chunk as a tensor of its own, the metadata rewritten to name
them chunks of one ``w`` (the test's own pickle round-trip; an unencrypted save carries
no seal). Counting stays cheap for torch's layouts (thousands of chunks), and a layout
too irregular to count is refused when a load asks for it.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

import storage
from extensions.errors import IntegrityError
from storage.checkpoint.coverage import Shortfall, check_covered, uncovered
from tests.hostile.test_coverage import _meta, _write_meta


def _tensor_of_parts(root: Path, size: tuple[int, ...], boxes: list[Any]) -> None:
    """A checkpoint at ``root`` of one tensor ``w`` of ``size`` whose chunks are
    ``boxes`` (``(offsets, sizes)`` pairs), each stored as a saved tensor of its own
    holding ``arange`` values (the metadata rewritten to name them chunks of ``w``)."""
    parts = {
        f"p{i}": torch.arange(float(math.prod(sizes))).reshape(sizes)
        for i, (_, sizes) in enumerate(boxes)
    }
    storage.save(parts, root)
    metadata = _meta(root)
    props = metadata.state_dict_metadata["p0"].properties
    chunks = []
    for part, (offsets, sizes) in zip(parts, boxes):
        del metadata.state_dict_metadata[part]
        chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
        index = next(k for k in metadata.storage_data if k.fqn == part)
        metadata.storage_data[MetadataIndex("w", chunk.offsets)] = metadata.storage_data.pop(index)
        chunks.append(chunk)
    metadata.state_dict_metadata["w"] = TensorStorageMetadata(props, torch.Size(size), chunks)
    _write_meta(root, metadata)


@pytest.mark.parametrize(
    ("size", "boxes", "held"),
    [
        # Rows 0-2 x cols 0-5 and rows 1-3 x cols 3-8: 18 + 18 elements of 36, 6 of them
        # twice; row 0's cols 6-8 and row 3's cols 0-2 have no chunk.
        ((4, 9), [((0, 0), (3, 6)), ((1, 3), (3, 6))], 30),
        # [0, 70) and [50, 108): 70 + 58 elements of 128; [108, 128) has no chunk.
        ((128,), [((0,), (70,)), ((50,), (58,))], 108),
    ],
    ids=["2-D", "1-D"],
)
def test_chunks_overlapping_in_part_never_hide_a_gap(
    tmp_path: Path, size: tuple[int, ...], boxes: list[Any], held: int
) -> None:
    # Before: the chunks' volumes summed to the tensor's, so the metadata counted as
    # covering it and the load left the gap's -1s in place without a word.
    _tensor_of_parts(tmp_path, size, boxes)
    total = math.prod(size)
    assert uncovered(_meta(tmp_path)) == {"w": (held, total)}
    target = {"w": torch.full(size, -1.0)}
    with pytest.raises(IntegrityError, match=rf"'w'.*cover {held} of the {total} elements"):
        storage.load(target, tmp_path)
    assert (target["w"] == -1).all()  # refused before anything was read


@pytest.mark.parametrize(
    ("size", "boxes"),
    [
        # Uneven rows and columns, a grid as a torch save of a 2-D sharding lays out.
        ((5, 7), [((r, c), (h, w)) for r, h in ((0, 3), (3, 2)) for c, w in ((0, 4), (4, 3))]),
        # Disjoint, though no torch save lays them out so: the last spans both columns.
        ((5, 6), [((0, 0), (3, 4)), ((0, 4), (3, 2)), ((3, 0), (2, 6))]),
    ],
    ids=["uneven grid", "bricks"],
)
def test_disjoint_chunks_that_cover_a_tensor_load(
    tmp_path: Path, size: tuple[int, ...], boxes: list[Any]
) -> None:
    _tensor_of_parts(tmp_path, size, boxes)
    assert uncovered(_meta(tmp_path)) == {}
    target = {"w": torch.full(size, -1.0)}
    storage.load(target, tmp_path)
    assert not (target["w"] == -1).any()


def test_chunks_overlapping_beyond_what_can_be_counted_are_refused_when_asked_for(
    tmp_path: Path,
) -> None:
    # A staircase of 3000 nested squares cuts the tensor into 9 million grid cells:
    # counting them exactly would cost more than a load may spend, so the load asking
    # for it is refused with what is wrong, and one leaving it out still works.
    _tensor_of_parts(tmp_path, (4, 4), [((0, 0), (4, 4))])
    metadata = _meta(tmp_path)
    record = metadata.storage_data.pop(MetadataIndex("w", torch.Size([0, 0])))
    n = 3000
    chunks = [
        ChunkStorageMetadata(torch.Size([i, i]), torch.Size([n - i, n - i])) for i in range(n)
    ]
    md = metadata.state_dict_metadata["w"]
    metadata.state_dict_metadata["w"] = TensorStorageMetadata(
        md.properties, torch.Size([n, n]), chunks
    )
    metadata.storage_data.update({MetadataIndex("w", c.offsets): record for c in chunks})
    metadata.state_dict_metadata["b"] = md  # another item, its one chunk the 4x4 one
    metadata.storage_data[MetadataIndex("b", torch.Size([0, 0]))] = record
    _write_meta(tmp_path, metadata)
    assert uncovered(metadata) == {"w": (None, n * n)}
    with pytest.raises(IntegrityError, match=r"'w'.*overlap in a way no torch save makes"):
        storage.load({"w": torch.zeros(n, n)}, tmp_path)
    other = {"b": torch.zeros(4, 4)}
    storage.load(other, tmp_path)
    assert torch.equal(other["b"], torch.arange(16.0).reshape(4, 4))


@pytest.mark.parametrize("missing", [None, 1234], ids=["whole", "one chunk gone"])
def test_thousands_of_chunks_are_counted_exactly(missing: int | None) -> None:
    # As many chunks as a 4096-rank save writes: 1-D, and a 64 x 64 grid of a 2-D
    # tensor; counted as the load counts them (no timing asserted: the disjoint case
    # is sorted once, never marked cell by cell).
    props = TensorProperties(dtype=torch.float32)
    one = [ChunkStorageMetadata(torch.Size([i * 3]), torch.Size([3])) for i in range(4096)]
    two = [
        ChunkStorageMetadata(torch.Size([r * 2, c * 5]), torch.Size([2, 5]))
        for r in range(64)
        for c in range(64)
    ]
    if missing is not None:
        del one[missing], two[missing]
    metadata = Metadata(
        {
            "one": TensorStorageMetadata(props, torch.Size([4096 * 3]), one),
            "two": TensorStorageMetadata(props, torch.Size([128, 320]), two),
        }
    )
    expected = {} if missing is None else {"one": (4095 * 3, 4096 * 3), "two": (4095 * 10, 40960)}
    assert uncovered(metadata) == expected


def test_reads_overlapping_in_part_never_fill_a_target_chunk() -> None:
    # The reads side counts exactly too: two reads into one target chunk of 128
    # elements, [0, 70) and [50, 108), sum to 128 but leave [108, 128) unread (before,
    # they counted whole and the load went ahead).
    planner = DefaultLoadPlanner()
    planner.state_dict = {"w": torch.zeros(128)}
    reads = [
        ReadItem(
            type=LoadItemType.TENSOR,
            dest_index=MetadataIndex("w", torch.Size([0])),
            dest_offsets=torch.Size([start]),
            storage_index=MetadataIndex("w", torch.Size([start])),
            storage_offsets=torch.Size([0]),
            lengths=torch.Size([length]),
        )
        for start, length in ((0, 70), (50, 58))
    ]
    short = {"w": Shortfall(108, 256)}
    with pytest.raises(IntegrityError, match=r"'w'.*cover 108 of the 128 elements"):
        check_covered("ckpt", short, planner, reads)
    check_covered(
        "ckpt",
        short,
        planner,
        [*reads, replace(reads[1], dest_offsets=torch.Size([108]), lengths=torch.Size([20]))],
    )
