"""Encoding one item: the tensor's ``torch.save`` archive (or a non-tensor value's
pickled bytes) through the transform chain into a data file, with the layout facts
that let readers decode straight into the target. The writer encodes through here;
``storage.checkpoint.decode`` is the way back."""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import IO, Any, cast

import torch

from extensions._compat import save_tensor_archive
from extensions.base import ItemInfo
from storage.checkpoint import storage_format as fmt
from storage.checkpoint.items import ItemEncoder

#: Below this many bytes a tensor's archive is built in memory first.
SMALL_TENSOR = 1 << 20


def encode_item(
    stream: IO[bytes],
    transforms: Sequence[Any],
    info: ItemInfo,
    data: object,
    tensor: torch.Tensor | None,
    extra: dict[str, Any],
) -> tuple[int, list[str]]:
    """Write one item (``tensor``, or the ``io.BytesIO`` ``data`` of a non-tensor value)
    through ``transforms`` into ``stream``. Adds the layout facts and the CRC-32C of the
    stored bytes to ``extra``; returns the stored length and the descriptors."""
    encoder = ItemEncoder(stream, transforms, info)
    plain = encoder.plain
    if tensor is None:
        assert isinstance(data, io.BytesIO)
        plain.write(data.getbuffer())
    else:
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes < SMALL_TENSOR:
            # torch.save makes ~40 tiny writes per tensor: let a BytesIO take them and
            # hand the archive on in one piece.
            archive = io.BytesIO()
            save_tensor_archive(tensor, archive)
            tracker = fmt.ArchiveTracker(plain, keep_below=archive.tell() + 1)
            tracker.write(archive.getbuffer())
        else:
            tracker = fmt.ArchiveTracker(plain)
            save_tensor_archive(tensor, cast(IO[bytes], tracker))
        tracker.flush()
        data_offset = tracker.data_offset(nbytes)
        if data_offset is not None:
            extra["data_offset"] = data_offset
            extra["dtype"] = str(tensor.dtype).removeprefix("torch.")
            extra["nbytes"] = nbytes
    count, extra["crc32c"] = encoder.close()
    return count, encoder.descriptors


def plain_cpu_tensor(data: object) -> torch.Tensor:
    """``data`` as a contiguous CPU tensor holding exactly its own bytes (what the
    archive must store)."""
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"planner resolved a tensor item to {type(data).__name__}")
    tensor = data.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    # torch.save stores the whole storage and its strides: keep exactly the bytes of
    # this tensor, in row-major order, so the stored record is the tensor itself.
    if (
        not tensor.is_contiguous()
        or tensor.storage_offset() != 0
        or tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size()
    ):
        tensor = tensor.contiguous().clone() if tensor.is_contiguous() else tensor.contiguous()
    return tensor
