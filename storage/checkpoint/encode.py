"""Encoding one item: the tensor's ``torch.save`` archive (or a non-tensor value's
pickled bytes) through the transform chain into a data file, with the layout facts
that let readers decode straight into the target. The writer encodes through here;
``storage.checkpoint.decode`` is the way back.

A small tensor's archive is mostly torch's fixed records (the pickle, the version, the
zip directory) around its bytes, and building it takes ~130 us of Python per tensor,
which dominated saves of thousands of small tensors. Those records depend only on the
tensor's dtype, shape and strides (torch's record CRCs are off, see
:func:`~extensions._compat.save_tensor_archive`), so :func:`archive_frame` keeps,
per such signature, the bytes torch wrote before and after the tensor's, and an archive
is the frame around the tensor's bytes: the same bytes ``torch.save`` writes, checked
once per signature against two archives torch built.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import struct
from collections.abc import Sequence
from typing import IO, Any, cast

import torch

from extensions._compat import save_tensor_archive
from extensions.base import ItemInfo
from storage.checkpoint import storage_format as fmt
from storage.checkpoint.items import ItemEncoder
from storage.checkpoint.tensors import tensor_bytes

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
        data_offset = _write_archive(plain, tensor)
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


def _write_archive(sink: IO[bytes], tensor: torch.Tensor) -> int | None:
    """Write ``tensor``'s ``torch.save`` archive to ``sink``; where its bytes start in
    it (``None``: not one plain storage record)."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes >= SMALL_TENSOR:
        tracker = ArchiveTracker(sink)
        save_tensor_archive(tensor, cast(IO[bytes], tracker))
    elif (frame := archive_frame(tensor)) is not None:
        before, after = frame
        sink.write(before)
        sink.write(tensor_bytes(tensor))
        sink.write(after)
        return len(before)
    else:
        # torch.save makes ~40 tiny writes per tensor: let a BytesIO take them and
        # hand the archive on in one piece.
        archive = io.BytesIO()
        save_tensor_archive(tensor, archive)
        tracker = ArchiveTracker(sink, keep_below=archive.tell() + 1)
        tracker.write(archive.getbuffer())
    tracker.flush()
    return tracker.data_offset(nbytes)


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


# --- a small tensor's archive: torch's records around its bytes ---------------------


def archive_frame(tensor: torch.Tensor) -> tuple[bytes, bytes] | None:
    """The bytes ``save_tensor_archive`` writes before and after ``tensor``'s own, for a
    :func:`plain_cpu_tensor` of torch's own class with nothing else to pickle (no
    subclass, attributes or quantizer); ``None`` where its archive is built by
    torch."""
    if (
        type(tensor) is not torch.Tensor
        or tensor.layout != torch.strided
        or tensor.is_quantized
        or tensor.requires_grad
        or tensor.numel() == 0
        or tensor.__dict__
        or tensor.storage_offset() != 0
        or tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size()
        or not tensor.is_contiguous()
    ):
        return None
    return _frame(tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()), _alignment())


def _alignment() -> int | None:
    """torch's storage alignment setting now (a process may change it between saves):
    frames built under another would not be the bytes torch.save writes."""
    get = getattr(torch.serialization, "_get_storage_alignment", None)
    return None if get is None else int(get())


@functools.lru_cache(maxsize=4096)
def _frame(
    dtype: torch.dtype, shape: tuple[int, ...], stride: tuple[int, ...], alignment: int | None
) -> tuple[bytes, bytes] | None:
    """Built from an archive of a zero tensor of that signature, and kept only where an
    archive of the same signature with other bytes is exactly the frame around them
    (so a torch whose records depend on the values, e.g. one that writes their CRC,
    gets no frame). ``alignment``: torch's storage alignment setting, which the records
    depend on (it only keys the cache: torch reads it again while building)."""
    zeros = torch.zeros(shape, dtype=dtype).as_strided(shape, stride)
    filled = zeros.clone()
    tensor_bytes(filled)[:] = b"\xa5" * filled.nbytes
    nbytes = zeros.numel() * zeros.element_size()
    if zeros.untyped_storage().nbytes() != nbytes or filled.stride() != stride:
        return None
    archives = []
    for tensor in (zeros, filled):
        archive = io.BytesIO()
        save_tensor_archive(tensor, archive)
        archives.append(archive.getvalue())
    tracker = ArchiveTracker(io.BytesIO(), keep_below=len(archives[0]) + 1)
    tracker.write(archives[0])
    at = tracker.data_offset(nbytes)
    if at is None:
        return None
    before, after = archives[0][:at], archives[0][at + nbytes :]
    if archives[0] != before + bytes(nbytes) + after:
        return None
    if archives[1] != before + b"\xa5" * nbytes + after:
        return None
    return before, after


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
