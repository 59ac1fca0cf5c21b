"""A recovery transport's sender whose ``planner_data`` paths (where each received item
goes in the rebuilt state dict) are hostile: nested past any state dict, or colliding
(one item's place inside another's, or a list's place used as a mapping's). Each is
refused naming the item, before anything is allocated."""

from __future__ import annotations

import pickle
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

import storage
from extensions.errors import UnsafeCheckpointError

WAIT = timedelta(seconds=30)


def _receive_with(tmp_path: Path, fqn: str, path: tuple[Any, ...]) -> None:
    sender = storage.StorageTransport(str(tmp_path), rank=0)
    state = {"a": torch.ones(4), "b": torch.ones(2), "c": [torch.ones(1)]}
    sender.send_checkpoint([1], 1, state, timedelta(seconds=60))
    file = tmp_path / "replica-0" / "step-1" / ".metadata"
    metadata = pickle.loads(file.read_bytes())  # the test's own file
    metadata.planner_data[fqn] = path
    file.write_bytes(pickle.dumps(metadata))
    receiver = storage.StorageTransport(str(tmp_path), rank=1)
    receiver.recv_checkpoint(0, sender.metadata(), 1, WAIT)


def test_a_path_nested_past_any_state_dict_is_refused(tmp_path: Path) -> None:
    # Before: a path of 1000 keys built 1000 nested dicts, whose flattening failed with
    # a raw RecursionError.
    with pytest.raises(UnsafeCheckpointError, match=r"'b': its planner_data path"):
        _receive_with(tmp_path, "b", ("b",) * 1000)


@pytest.mark.parametrize(
    "fqn, path",
    [
        # Before: a raw TypeError from indexing item a's tensor with "x".
        ("b", ("a", "x")),
        # Before: item a was put inside b's place, then b's tensor replaced it: a was
        # silently lost.
        ("a", ("b", "x")),
        # Before: a raw RuntimeError ("Missing key in checkpoint state_dict: c.x").
        ("b", ("c", "x")),
    ],
    ids=["inside a tensor", "overwritten", "list as mapping"],
)
def test_colliding_paths_are_refused_naming_the_item(
    tmp_path: Path, fqn: str, path: tuple[Any, ...]
) -> None:
    with pytest.raises(UnsafeCheckpointError, match=r"planner_data path"):
        _receive_with(tmp_path, fqn, path)
