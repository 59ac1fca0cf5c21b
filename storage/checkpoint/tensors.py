"""Tensors as the read path meets them: a target checked against the stored chunk
before any byte is read, and a tensor's memory as writable bytes."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.planner import ReadItem


def check_shapes(
    req: ReadItem, target: torch.Tensor, chunk: tuple[torch.Size, Any] | None, where: str
) -> None:
    """A target that does not fit the stored chunk is the caller's mismatch (a
    ``ValueError``, as torch's planner says), found before any byte is read."""
    requested, offsets = tuple(req.lengths), tuple(req.storage_offsets)
    stored = tuple(chunk[0]) if chunk is not None else None
    if tuple(target.size()) != requested or (
        stored is not None
        and not (
            len(offsets) == len(requested) == len(stored)
            and all(o >= 0 and o + n <= s for o, n, s in zip(offsets, requested, stored))
        )
    ):
        raise ValueError(
            f"{where}: size mismatch: the target has shape {tuple(target.size())}, the "
            f"stored chunk {stored if stored is not None else '(unknown)'} (region at "
            f"{offsets} of sizes {requested}); load into a state dict shaped like the "
            "checkpoint (dcp-storage inspect lists its shapes)"
        )


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (no copy)."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray(0))
    flat = tensor.reshape(-1).view(torch.uint8)
    return flat.numpy().data.cast("B")
