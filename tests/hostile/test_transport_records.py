"""A recovery transport's sender whose records of its state dict (the containers' shape
record, a DTensor's layout record) share references so that walking them, or making
their keys strings, costs exponentially more than their few KiB of pickle.

The records are unpickled with ``weights_only=True``, which keeps a pickle's shared
references: 30 levels of ``(k, k)`` is a key whose string is 2**30 copies of its leaf,
and 8 levels of a 64-element list of one list is a mesh of 64**8 ranks to walk. Each is
refused from what it states, before anything walks it.
"""

from __future__ import annotations

import tracemalloc
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor, Shard

import storage
from extensions._compat import mesh_without_groups
from extensions.errors import UnsafeCheckpointError
from storage.ops import transport, transport_dtensor, transport_shape

WAIT = timedelta(seconds=30)


def _shared(leaf: Any, levels: int, width: int, kind: type = tuple) -> Any:
    """``levels`` nested containers of ``width`` references each to the one below."""
    value = leaf
    for _ in range(levels):
        value = kind([value] * width)
    return value


def _send_and_receive(root: Path, state: dict[str, Any], most: int = 64 << 10) -> dict[str, Any]:
    sender = storage.StorageTransport(str(root), rank=0)
    sender.send_checkpoint([1], 1, state, timedelta(seconds=60))
    step = root / "replica-0" / "step-1"
    assert sum(f.stat().st_size for f in step.iterdir()) < most  # what was sent
    receiver = storage.StorageTransport(str(root), rank=1)
    return receiver.recv_checkpoint(0, sender.metadata(), 1, WAIT)


@pytest.mark.timeout(120)  # a safety net only: the assertion is on the error
def test_a_shape_records_key_that_is_no_plain_key_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The shape record keeps a mapping's keys as the sender's state dict had them:
    # strings, ints, floats, bools, None. Before, any key was taken and made a string
    # to find its value: 24 levels of shared pairs, a 2**24-leaf string (~100 MB, ~10 s;
    # 30 levels, 7 GB).
    hostile = _shared("x", 24, 2)

    def record(value: Any, path: str) -> Any:
        shape = transport_shape.record(value, path)
        shape[1].append((hostile, None))
        return shape

    monkeypatch.setattr(transport, "record", record)
    with pytest.raises(UnsafeCheckpointError, match="record of the state dict's containers"):
        _send_and_receive(tmp_path, {"w": torch.ones(4)})


@pytest.mark.timeout(120)  # a safety net only: the assertion is on the error
def test_a_dtensor_layout_whose_mesh_shares_its_rows_is_refused_unwalked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, one_rank_group: None
) -> None:
    # The layout record's mesh is a nested list of ranks, checked rectangular by
    # walking it. Before, 8 levels of 64 references to one list (~5 KiB sent) were
    # walked whole: 64**8 calls, years, before its size (64**8 ranks, past the 2**20
    # allowed) refused it; 8 of 8 already took seconds.
    describe = transport_dtensor.describe

    def shared_mesh(value: DTensor, where: str) -> Any:
        layout = describe(value, where)
        layout[1], layout[2] = _shared(0, 8, 64, list), None
        return layout

    monkeypatch.setattr(transport_dtensor, "describe", shared_mesh)
    mesh = mesh_without_groups("cpu", [0], None)
    w = DTensor.from_local(
        torch.ones(4), mesh, [Shard(0)], run_check=False, shape=(4,), stride=(1,)
    )
    with pytest.raises(UnsafeCheckpointError, match="'w': the record of this DTensor's layout"):
        _send_and_receive(tmp_path, {"w": w})


def test_a_long_key_shared_by_every_level_costs_its_size_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One 64 KiB key (one object in the pickle) names a mapping at each of 99 levels.
    # The rebuild carries each value's path for its messages; before, each level's path
    # held the key once more, all alive down the recursion: 99 * 100 / 2 copies, 316 MB
    # for 64 KiB sent (a 1 MiB key: 5 GB; 10 MiB, 50 GB).
    long = "k" * (64 << 10)

    def record(value: Any, path: str) -> Any:
        shape: Any = ("d", [("w", None)])
        for _ in range(98):
            shape = ("d", [(long, shape)])
        return ("d", [(long, shape)])

    monkeypatch.setattr(transport, "record", record)
    tracemalloc.start()
    try:
        got = _send_and_receive(tmp_path, {"w": torch.ones(4)}, most=1 << 20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    for _ in range(99):  # rebuilt level by level (the sent "w" is not down there)
        got = got[long]
    assert got == {}
    assert peak < 32 << 20, peak
