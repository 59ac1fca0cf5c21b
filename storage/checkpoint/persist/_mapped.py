"""The persist worker's side of the staging segments: the mappings of those the
training process sent it (:func:`keep`, :func:`forget`; :mod:`._shm`), and the data a
write item's reference stands for (:func:`rebuild`), read straight from them."""

from __future__ import annotations

import io
import math
import mmap
import threading
from typing import Any

import torch

from extensions.errors import CheckpointStorageError


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


class SegmentLost(CheckpointStorageError):
    """A staging segment a save reads is not mapped in the persist worker: it never
    arrived there, or could not be mapped. The save fails; the training process then
    stages the next one in new segments, sent afresh (:meth:`._worker.Worker.restage`)."""


_maps: dict[str, mmap.mmap] = {}
_maps_lock = threading.Lock()


def _mapping(name: str) -> mmap.mmap:
    with _maps_lock:
        found = _maps.get(name)
    if found is None:
        raise SegmentLost(
            f"staging segment {name} never reached this persist worker, or could not be "
            "mapped there (a process had no descriptor left for it: ulimit -n, or no "
            "memory); this save fails, the next one stages afresh"
        )
    return found


def keep(maps: dict[str, mmap.mmap]) -> None:
    """Keep the segments the training process just sent, mapped, by name."""
    with _maps_lock:
        _maps.update(maps)


def forget(names: list[str]) -> None:
    """Forget segments the training process dropped: each is unmapped once no tensor of
    a running call uses it (none does: it drops them only between saves)."""
    with _maps_lock:
        for name in names:
            _maps.pop(name, None)
