"""Encoding one item: the tensor's ``torch.save`` archive (or a non-tensor value's
pickled bytes) through the transform chain into a data file, with the layout facts
that let readers decode straight into the target. The writer encodes through here;
``storage.checkpoint.decode`` is the way back."""

from __future__ import annotations

import dataclasses
import io
import struct
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
    record: fmt.StoredItem,
) -> fmt.StoredItem:
    """Write one item (``tensor``, or the ``io.BytesIO`` ``data`` of a non-tensor value)
    through ``transforms`` into ``stream``; returns ``record`` (where it starts, its
    fingerprint) completed with the stored length, the descriptors, the layout facts
    and the CRC-32C of the stored bytes."""
    encoder = ItemEncoder(stream, transforms, info)
    plain = encoder.plain
    data_offset: int | None = None
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
            tracker = ArchiveTracker(plain, keep_below=archive.tell() + 1)
            tracker.write(archive.getbuffer())
        else:
            tracker = ArchiveTracker(plain)
            save_tensor_archive(tensor, cast(IO[bytes], tracker))
        tracker.flush()
        data_offset = tracker.data_offset(nbytes)
    count, crc = encoder.close()
    facts: dict[str, Any] = {}
    if tensor is not None and data_offset is not None:
        facts = {
            "data_offset": data_offset,
            "dtype": str(tensor.dtype).removeprefix("torch."),
            "nbytes": tensor.numel() * tensor.element_size(),
        }
    return dataclasses.replace(
        record, length=count, descriptors=tuple(encoder.descriptors), crc32c=crc, **facts
    )


def plain_cpu_tensor(data: object) -> torch.Tensor:
    """``data`` as a contiguous CPU tensor holding exactly its own bytes (what the
    archive must store)."""
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"planner resolved a tensor item to {type(data).__name__}")
    tensor = data.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    # A lazy conjugate or negative view (x.conj(), x.conj().imag) holds the bits of its
    # base and a flag that only torch.load applies: the raw bytes a reader decodes
    # straight into its target must be the values themselves.
    if tensor.is_conj() or tensor.is_neg():
        tensor = tensor.resolve_conj().resolve_neg()
    # torch.save stores the whole storage and its strides: keep exactly the bytes of
    # this tensor, in row-major order, so the stored record is the tensor itself.
    if (
        not tensor.is_contiguous()
        or tensor.storage_offset() != 0
        or tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size()
    ):
        tensor = tensor.contiguous().clone() if tensor.is_contiguous() else tensor.contiguous()
    return tensor


# --- locating the raw tensor bytes inside a torch.save archive ----------------------

_LOCAL_HEADER = b"PK\x03\x04"


class ArchiveTracker(io.RawIOBase):
    """Passes ``torch.save`` output through to ``sink`` and notes where the tensor's
    storage record starts, by reading the zip local headers as they go by.

    ``torch.save`` issues dozens of tiny writes per tensor (headers, descriptors) and
    one large write of the storage: the tiny ones are kept (headers are parsed from
    them) and forwarded in one piece, the large one is forwarded without a copy. Call
    ``flush`` before closing ``sink``."""

    def __init__(self, sink: IO[bytes], *, keep_below: int = 1 << 16) -> None:
        super().__init__()
        self._sink = sink
        self._keep_below = keep_below
        self.position = 0
        self._segments: list[tuple[int, bytearray]] = []  # small writes, adjacent merged
        self._unsent = 0  # bytes at the end of the last segment not yet forwarded

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n = view.nbytes
        if n < self._keep_below:
            last = self._segments[-1] if self._segments else None
            if last is not None and last[0] + len(last[1]) == self.position:
                last[1].extend(view)
            else:
                self._segments.append((self.position, bytearray(view)))
            self._unsent += n
        else:
            self.flush()
            self._sink.write(view)
        self.position += n
        return n

    def flush(self) -> None:
        if self._unsent:
            segment = self._segments[-1][1]
            self._sink.write(memoryview(segment)[len(segment) - self._unsent :])
            self._unsent = 0

    def data_offset(self, nbytes: int) -> int | None:
        """Offset of the single storage record of ``nbytes`` bytes, if it is there."""
        found: list[int] = []
        for start, seg in self._segments:
            at = seg.find(_LOCAL_HEADER)
            while at != -1 and at + 30 <= len(seg):
                name_len, extra_len = struct.unpack_from("<HH", seg, at + 26)
                name = bytes(seg[at + 30 : at + 30 + name_len])
                if name.endswith(b"/data/0"):
                    found.append(start + at + 30 + name_len + extra_len)
                elif name.split(b"/")[-2:-1] == [b"data"]:
                    return None  # more than one storage: not a plain tensor
                at = seg.find(_LOCAL_HEADER, at + 4)
        if len(found) != 1 or found[0] + nbytes > self.position:
            return None
        return found[0]
