"""How :class:`~storage.ops.transport.StorageTransport` loads a received checkpoint:
into an empty state dict rebuilt from the sender's metadata alone, which is checked
before it sizes anything (the sender may be damaged or hostile)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem

from extensions._compat import EmptyStateDictLoadPlanner, set_element
from extensions.errors import UnsafeCheckpointError, quote
from storage.checkpoint.decode import MAX_OBJECT_BYTES, refused_pickle
from storage.checkpoint.tensors import empty_stored


class PlainDataPlanner(EmptyStateDictLoadPlanner):
    """Rebuilds the whole state dict from the metadata; non-tensor values are
    unpickled with ``weights_only=True`` (plain data only, never code).

    What the metadata claims is checked before it sizes anything: each tensor is
    allocated by ``tensors.empty_stored`` (a claim its stored bytes cannot hold is
    refused, a failed allocation names the item; zeroed, so what no chunk covers is
    never this process's old memory), and the list indices of the paths in
    ``planner_data`` may ask for at most :data:`MAX_OBJECT_BYTES` list slots in all
    (torch's ``set_element`` grows a list to an index one ``None`` at a time).

    Its targets are made from the stored chunks (``targets_from_metadata``): a sender
    stores only its own shards of a sharded tensor, so what no chunk covers is no
    damage here (the reader does not refuse it; it stays zero)."""

    targets_from_metadata = True

    def __init__(self, where: str) -> None:
        super().__init__()
        self._where = where

    def set_up_planner(
        self, state_dict: Any, metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        if state_dict or metadata is None:
            raise ValueError("the transport's planner loads into an empty state dict")
        paths = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
        check_paths(paths, self._where)
        for fqn, stored in metadata.state_dict_metadata.items():
            value = (
                empty_stored(metadata, fqn, self._where, whole=False)
                if isinstance(stored, TensorStorageMetadata)
                else stored
            )
            if fqn in paths:
                set_element(state_dict, paths[fqn], value)
            else:
                state_dict[fqn] = value
        DefaultLoadPlanner.set_up_planner(self, state_dict, metadata, is_coordinator)

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as exc:
            raise refused_pickle(f"{self._where}: item {quote(fqn)}", exc) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def check_paths(paths: Mapping[str, Any], where: str) -> None:
    """Refuse ``planner_data`` paths that are not a key then keys and list indices, or
    whose indices would build lists of more than :data:`MAX_OBJECT_BYTES` slots in all
    (a sent list's length is bounded so: the shape item records a byte per element)."""
    longest: dict[tuple[Any, ...], int] = {}
    for fqn, path in paths.items():
        if (
            not isinstance(path, (tuple, list))
            or not path
            or not isinstance(path[0], str)
            or not all(
                isinstance(p, str) or (type(p) is int and 0 <= p < MAX_OBJECT_BYTES) for p in path
            )
        ):
            raise UnsafeCheckpointError(
                f"{where}: item {quote(fqn)}: its planner_data path {quote(path)} is not a key "
                f"then keys and list indices below {MAX_OBJECT_BYTES}; the metadata is damaged "
                "or hostile: send the checkpoint again"
            )
        for at, part in enumerate(path):
            if type(part) is int:
                prefix = tuple(path[:at])
                longest[prefix] = max(longest.get(prefix, 0), part + 1)
    slots = sum(longest.values())
    if slots > MAX_OBJECT_BYTES:
        raise UnsafeCheckpointError(
            f"{where}: the paths of its planner_data build lists of {slots} slots in all, "
            f"more than {MAX_OBJECT_BYTES}; the metadata is damaged or hostile: send the "
            "checkpoint again"
        )
