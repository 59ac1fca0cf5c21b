"""The persist worker's side of the staging segments: the data a write item's reference
stands for (:func:`rebuild`), read straight from the segments it maps by name, each
checked against what the training process staged into it (:mod:`._shm`)."""

from __future__ import annotations

import io
import math
import mmap
import threading
from typing import Any

import torch

from extensions.errors import CheckpointStorageError
from storage.checkpoint.persist._shm import check_mapped, map_segment


def rebuild(ref: tuple[Any, ...]) -> object:
    """The data a write item resolves to, from its reference (see ``persist.item_ref``)."""
    kind = ref[0]
    if kind == "bytes":
        return io.BytesIO(ref[1])
    if kind == "shm":
        _, name, offset, dtype, shape = ref
        numel = math.prod(shape)
        if numel == 0:
            return torch.empty(shape, dtype=dtype)
        data = torch.frombuffer(_mapping(name), dtype=dtype, count=numel, offset=offset)
        return data.view(shape)
    _, raw, dtype, shape = ref
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)


_maps: dict[str, mmap.mmap] = {}
#: Each live segment's inode and size in the training process (``options["live"]``).
_staged: dict[str, tuple[int, int]] = {}
_maps_lock = threading.Lock()


def _mapping(name: str) -> mmap.mmap:
    """The segment ``name`` mapped, checked against what the training process staged
    into (a file truncated since would read as zeros, or kill this process)."""
    with _maps_lock:
        identity = _staged.get(name)
        if identity is None:
            raise CheckpointStorageError(
                f"staging segment {name} is not one the training process stages into"
            )
        found = _maps.get(name)
        if found is None:
            found = _maps[name] = map_segment(name, identity)
        else:
            check_mapped(name, identity)
        return found


def keep_mapped(live: dict[str, tuple[int, int]]) -> None:
    """Keep mapped the segments in use, ``live`` (each one's inode and size), and no
    other (sent with every call: the training process removes segments between saves)."""
    with _maps_lock:
        _staged.update(live)
        for name in set(_staged) - set(live):
            del _staged[name]
        for name in set(_maps) - set(live):
            del _maps[name]  # unmapped once no tensor of a running call uses it
