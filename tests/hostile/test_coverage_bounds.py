"""The count of what a tensor's chunks hold, against metadata crafted to make it costly
or to break it: many dimensions, a few chunks overlapping in each of a dozen of them
(their list shared by many tensors for a few bytes each); and
layouts no less unusual that real saves make, which must still load.

Every load counts the chunks of every tensor in its metadata (``coverage.uncovered``),
asked for or not, so what a count costs is what any load of the checkpoint costs. No
time is asserted: what is asserted is which layouts are counted cell by cell.
"""

from __future__ import annotations

import pickle
import random
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)

import storage
from extensions.errors import IntegrityError, UnsafeCheckpointError
from storage.checkpoint.boxes import Irregular, union_volume
from storage.checkpoint.coverage import uncovered
from tests.hostile.test_coverage import _meta, _write_meta
from tests.support.distributed import gloo_group, spawn

TIMEOUT = timedelta(seconds=60)


def _with_item(root: Path, fqn: str, size: tuple[int, ...], chunks: list[Any]) -> Metadata:
    """A checkpoint at ``root`` holding ``b`` (four ones) and, in its metadata only, a
    float tensor ``fqn`` of ``size`` whose chunks are ``chunks`` (``(offsets, sizes)``)."""
    storage.save({"b": torch.ones(4)}, root)
    metadata = _meta(root)
    props = metadata.state_dict_metadata["b"].properties
    listed = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks]
    metadata.state_dict_metadata[fqn] = TensorStorageMetadata(props, torch.Size(size), listed)
    _write_meta(root, metadata)
    return metadata


def test_a_tensor_of_more_dimensions_than_torch_makes_is_refused_naming_it(
    tmp_path: Path,
) -> None:
    # Before: two chunks overlapping in a 65-dimension tensor reached the grid count,
    # whose torch.zeros failed with a raw RuntimeError ("only tensors with up to 64
    # dims") in every load of the checkpoint, one leaving the item out included.
    d = 65
    ones = (1,) * (d - 1)
    _with_item(
        tmp_path, "x", (3, *ones), [((0,) * d, (2, *ones)), ((1, *(0,) * (d - 1)), (2, *ones))]
    )
    with pytest.raises(UnsafeCheckpointError, match=r"'x'.*at most 64 dimensions"):
        storage.load({"b": torch.zeros(4)}, tmp_path)


def test_few_chunks_overlapping_in_many_dimensions_are_not_counted_cell_by_cell(
    tmp_path: Path,
) -> None:
    # Two chunks overlapping in part in each of 13 dimensions cut the tensor into 3**13
    # (1.6 million) grid cells. Before, they were counted cell by cell (~50 ms), for
    # every tensor listing them: a 7 KB metadata of 200 tensors sharing that chunk list
    # made every load of the checkpoint spend 10 s before reading a byte, and 300 KB
    # half an hour. Now a count spends a bounded number of cells (and of corners, 2**d)
    # per chunk: such a tensor is refused when a load asks for it, other loads go ahead.
    d = 13
    chunks = [((0,) * d, (2,) * d), ((1,) * d, (2,) * d)]
    with pytest.raises(Irregular):
        union_volume(chunks)
    metadata = _with_item(tmp_path, "x", (3,) * d, chunks)
    assert uncovered(metadata) == {"x": (None, 3**d)}
    target = {"b": torch.zeros(4)}
    storage.load(target, tmp_path)
    assert torch.equal(target["b"], torch.ones(4))
    with pytest.raises(IntegrityError, match=r"'x'.*overlap in a way no torch save makes"):
        storage.load({"x": torch.zeros((3,) * d)}, tmp_path)


@pytest.mark.parametrize(
    ("boxes", "held"),
    [
        # Two shardings of a 3-D tensor (2 x 2 x 2 and 3 x 3 x 3 blocks of a 6 x 6 x 6).
        (
            [
                ((r, c, k), (n, n, n))
                for n in (3, 2)
                for r in range(0, 6, n)
                for c in range(0, 6, n)
                for k in range(0, 6, n)
            ],
            216,
        ),
        # A whole replica beside the 64 x 64 shards of a 128 x 320 tensor, one shard gone.
        (
            [((0, 0), (128, 320))]
            + [((r * 2, c * 5), (2, 5)) for r in range(64) for c in range(64)][1:],
            128 * 320,
        ),
        # Chunks overlapping in part in each of 4 dimensions.
        ([((0,) * 4, (2,) * 4), ((1,) * 4, (2,) * 4)], 2 * 2**4 - 1),
    ],
    ids=["two shardings", "replica beside shards", "4-D overlap"],
)
def test_overlapping_layouts_that_are_no_damage_are_still_counted(
    boxes: list[Any], held: int
) -> None:
    assert union_volume(boxes) == held


def test_overlapping_boxes_are_counted_as_a_cell_by_cell_fill_counts_them() -> None:
    rng = random.Random(7)
    for _ in range(500):
        size = [rng.randint(1, 6) for _ in range(rng.randint(2, 4))]
        boxes = []
        for _ in range(rng.randint(2, 7)):
            offsets = [rng.randint(0, s - 1) for s in size]
            boxes.append(
                (tuple(offsets), tuple(rng.randint(0, s - o) for o, s in zip(offsets, size)))
            )
        filled = torch.zeros(size, dtype=torch.bool)
        for offsets, sizes in boxes:
            filled[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] = True
        assert union_volume(boxes) == int(filled.sum()), boxes


# --- layouts real saves make -------------------------------------------------------

_FULL = torch.arange(35.0).reshape(5, 7)
# Disjoint bricks that are no grid: the last spans the columns the first two split.
_BRICKS = [([0, 0], [3, 4]), ([0, 4], [3, 3]), ([3, 0], [2, 7])]


def _save_unusual(rank: int, store: str, path: str) -> None:
    from torch.distributed._shard import sharded_tensor
    from torch.distributed._shard.sharding_spec import EnumerableShardingSpec, ShardMetadata
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    with gloo_group(rank, 4, store, timeout=TIMEOUT):
        mesh = init_device_mesh("cpu", (2, 2))
        spec = EnumerableShardingSpec(
            [ShardMetadata(o, s, f"rank:{i}/cpu") for i, (o, s) in enumerate(_BRICKS)]
        )
        st = sharded_tensor.zeros(spec, *_FULL.shape, init_rrefs=False)
        for shard in st.local_shards():
            (r, c), (h, w) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
            shard.tensor.copy_(_FULL[r : r + h, c : c + w])
        # Rows 3 + 2 and columns 4 + 3: uneven shards of a 2-D mesh.
        state = {"dt": distribute_tensor(_FULL, mesh, [Shard(0), Shard(1)]), "st": st}
        storage.save(state, path)


def test_uneven_and_brick_layouts_of_real_saves_load_whole(tmp_path: Path) -> None:
    spawn(_save_unusual, (str(tmp_path / "store"), str(tmp_path / "ckpt")), nprocs=4)
    metadata = pickle.loads((tmp_path / "ckpt" / ".metadata").read_bytes())
    assert len(metadata.state_dict_metadata["dt"].chunks) == 4
    assert len(metadata.state_dict_metadata["st"].chunks) == 3
    assert uncovered(metadata) == {}
    target = {"dt": torch.zeros(5, 7), "st": torch.zeros(5, 7)}
    storage.load(target, tmp_path / "ckpt")
    assert torch.equal(target["dt"], _FULL)
    assert torch.equal(target["st"], _FULL)
