"""Decoding one item into what the planner gets, bounded by the request and the stored
size: a tensor straight into its target where the layout allows (else through
``torch.load`` of a bounded archive), a non-tensor value rebuilt from plain data only.
The reader and read-once sharing both decode through here."""

from __future__ import annotations

import io
import math
import pickle
from collections.abc import Sequence
from typing import IO

import crc32c
import torch
from torch.distributed.checkpoint.planner import ReadItem

from extensions.errors import IntegrityError, UnsafeCheckpointError, printable
from extensions.streams import BoundedReader, pump, read_all, readinto_exact, skip
from storage.checkpoint import storage_format as fmt
from storage.checkpoint.archives import check_archive
from storage.checkpoint.tensors import (
    copy_into_memory,
    has_plain_memory,
    holds_its_bytes,
    tensor_bytes,
)

#: Default floor of the decoded size of a non-tensor item (``max_object_bytes``).
MAX_OBJECT_BYTES = 16 << 20
#: A non-tensor item may also decode to this many times its stored size.
OBJECT_RATIO = 64
#: What a tensor's ``torch.save`` archive may hold beyond its raw bytes (records,
#: pickle, alignment, directory: ~1 KiB in practice).
ARCHIVE_ALLOWANCE = 64 << 10


def plain_limit(
    chunk: tuple[Sequence[int], torch.dtype] | None,
    stored: int,
    max_object_bytes: int = MAX_OBJECT_BYTES,
) -> int:
    """The most plain bytes a reader takes from an item of ``stored`` bytes: a tensor
    item's archive, of its ``chunk`` (sizes, dtype: checked against the request), in up
    to 8 bytes an element (a planner that cast), with header and trailer; a non-tensor
    item, ``max_object_bytes`` or :data:`OBJECT_RATIO` times its stored size. Decoders
    learn it (``ItemInfo.plain_bytes``) to bound what a stored header asks for."""
    if chunk is None:
        return max(max_object_bytes, OBJECT_RATIO * stored)
    sizes, dtype = chunk
    return math.prod(sizes) * max(8, dtype.itemsize) + 2 * ARCHIVE_ALLOWANCE


def backed_value(stream: IO[bytes], stored: int, max_object_bytes: int) -> tuple[IO[bytes], int]:
    """Where to read a non-tensor item of ``stored`` bytes (as its record claims) from
    ``stream``, and the most plain bytes it may decode to (:func:`plain_limit`).

    Past ``max_object_bytes`` the bound grows with the stored size, so it counts only
    stored bytes that arrived: those are read first (held, as its decoded value is)
    and the bound taken from their count. A size the metadata or the store merely
    claims never raises it: a HEAD that overstated the data file let an 8 KiB zstd bomb
    claiming 2**40 bytes decode whole before the read found the file shorter."""
    limit = plain_limit(None, stored, max_object_bytes)
    if limit <= max_object_bytes:
        return stream, limit
    held = read_all(BoundedReader(stream, stored))
    return io.BytesIO(held), plain_limit(None, len(held), max_object_bytes)


def decode_tensor(
    decoded: IO[bytes],
    req: ReadItem,
    record: fmt.StoredItem,
    chunk: tuple[torch.Size, torch.dtype] | None,
    target: torch.Tensor,
    where: str,
) -> torch.Tensor:
    """The stored chunk as a tensor: ``target`` itself when the bytes could be
    decoded straight into it, else a new tensor to narrow and copy from."""
    if chunk is None:
        raise UnsafeCheckpointError(
            f"{where}: a tensor item without a chunk in the metadata's state_dict_metadata; "
            "the metadata is damaged or hostile"
        )
    sizes, dtype = chunk
    offsets, lengths = list(req.storage_offsets), list(req.lengths)
    if len(offsets) != len(sizes) or any(
        o < 0 or n < 0 or o + n > s for o, n, s in zip(offsets, lengths, sizes)
    ):
        raise UnsafeCheckpointError(
            f"{where}: the request (offsets {offsets}, lengths {lengths}) does not lie "
            f"inside the stored chunk of size {list(sizes)}; the metadata does not match "
            "the state dict being loaded"
        )
    data_offset = record.data_offset
    if data_offset is not None and data_offset > ARCHIVE_ALLOWANCE:
        raise UnsafeCheckpointError(
            f"{where}: its record puts the tensor {data_offset} bytes into the item's "
            f"archive, past the {ARCHIVE_ALLOWANCE} bytes an archive's header takes; the "
            "metadata is damaged or hostile: restore it or re-save the checkpoint"
        )
    if data_offset is None or not _stored_as(record, dtype, sizes):
        # A stock archive without our layout facts, or stored bytes of another dtype
        # or size than the metadata says (a planner that cast): let torch parse it.
        # A planner that cast may have stored up to 8 bytes per element (16: complex).
        limit = math.prod(sizes) * max(8, dtype.itemsize) + ARCHIVE_ALLOWANCE
        payload = read_bounded(decoded, limit, where, "the metadata understates it")
        check_archive(payload, where)
        try:
            loaded = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            raise refused_pickle(where, exc) from None
        if not isinstance(loaded, torch.Tensor) or tuple(loaded.size()) != tuple(sizes):
            raise IntegrityError(
                f"{where}: the stored tensor does not have the chunk size "
                f"{list(sizes)} that the metadata declares"
            )
        return loaded  # copy_ into the target casts if needed
    whole = list(req.lengths) == list(sizes) and not any(req.storage_offsets)
    direct = (
        whole
        and holds_its_bytes(target)
        and target.dtype == dtype
        and tuple(target.size()) == tuple(sizes)
    )
    dest = target if direct else torch.empty(tuple(sizes), dtype=dtype)
    nbytes = math.prod(sizes) * dtype.itemsize
    if skip(decoded, int(data_offset)) != data_offset:
        raise IntegrityError(f"{where}: item is truncated")
    if readinto_exact(decoded, tensor_bytes(dest)) != nbytes:
        raise IntegrityError(f"{where}: item is truncated")
    # The archive's trailer, and the transforms' own trailers, decoded to their end
    # (an AEAD checks its last tag there) but never past what an archive holds.
    if pump(decoded, None, limit=ARCHIVE_ALLOWANCE + 1, chunk=1 << 16) > ARCHIVE_ALLOWANCE:
        raise UnsafeCheckpointError(
            f"{where}: the item decodes to more than its tensor and archive (a "
            "decompression bomb?); refusing it: restore the file or re-save the checkpoint"
        )
    return dest


def copy_held(
    held: memoryview,
    record: fmt.StoredItem,
    chunk: tuple[torch.Size, torch.dtype] | None,
    req: ReadItem,
    target: torch.Tensor,
) -> bool:
    """Copy a plain (untransformed) tensor item whose stored bytes are ``held`` in
    (writable) memory straight into ``target``, once its length and CRC-32C match the record;
    ``False`` (nothing written) where anything does not fit the direct way: the caller
    then decodes ``held`` as a stream, which names what is wrong. For many small
    items, where per-item work is the cost, not bytes (:func:`decode_tensor` is the
    general way, and the same checks)."""
    offset = record.data_offset
    if chunk is None or offset is None or record.descriptors or any(req.storage_offsets):
        return False
    sizes, dtype = chunk
    if not (
        target.dtype == dtype
        and tuple(target.size()) == tuple(sizes)
        and has_plain_memory(target)  # the checked way refuses the others, naming them
        and _stored_as(record, dtype, sizes)
    ):
        return False
    end = offset + math.prod(sizes) * dtype.itemsize
    if (
        len(held) != record.length
        or offset > ARCHIVE_ALLOWANCE
        or end > len(held)
        or len(held) - end > ARCHIVE_ALLOWANCE
        or (record.crc32c is not None and crc32c.crc32c(held) != record.crc32c)
    ):
        return False
    # One call: a byte view of the target costs four, most of a small item's time.
    copy_into_memory(target, held[offset:end])
    return True


def direct_offset(
    req: ReadItem,
    record: fmt.StoredItem,
    chunk: tuple[torch.Size, torch.dtype] | None,
    target: torch.Tensor,
) -> int | None:
    """Where the tensor's bytes start in the item's plain archive when
    :func:`decode_tensor` would decode them straight into ``target`` as they are (the
    whole stored chunk, same dtype and size, a contiguous CPU target), else ``None``."""
    if chunk is None:
        return None
    sizes, dtype = chunk
    data_offset = record.data_offset
    if (
        data_offset is None
        or data_offset > ARCHIVE_ALLOWANCE
        or not _stored_as(record, dtype, sizes)
        or list(req.lengths) != list(sizes)
        or any(req.storage_offsets)
        or not holds_its_bytes(target)
        or target.dtype != dtype
        or tuple(target.size()) != tuple(sizes)
    ):
        return None
    return int(data_offset)


def _stored_as(record: fmt.StoredItem, dtype: torch.dtype, sizes: Sequence[int]) -> bool:
    """Whether the stored tensor bytes are of ``dtype`` and ``sizes`` (as the metadata
    says), as far as the record tells (a stock item's record does not)."""
    name = str(dtype).removeprefix("torch.")
    return record.dtype in (None, name) and record.nbytes in (
        None,
        math.prod(sizes) * dtype.itemsize,
    )


def read_bounded(decoded: IO[bytes], limit: int, where: str, hint: str) -> bytes:
    payload = read_all(decoded, limit=limit)
    if len(payload) > limit:
        raise UnsafeCheckpointError(
            f"{where}: the item decodes to more than {limit} bytes, more than its stored "
            f"size and the request allow (a decompression bomb?); refusing it ({hint})"
        )
    return payload


def plain_value(payload: bytes, where: str) -> io.BytesIO:
    """A non-tensor value, rebuilt from plain data only, as a pickle for the planner.

    DCP's default planner unpickles these values with ``weights_only=False``. The value
    is loaded here with torch's ``weights_only`` unpickler (plain data, plus what the
    user allowed with ``torch.serialization.add_safe_globals``) or, for the
    ``io.BytesIO`` values DCP stores as opaque blobs, with a loader that builds nothing
    but a BytesIO (``storage_format.load_bytes_io``), and pickled again, so
    the planner's unpickler only ever sees our own pickle of those objects - never the
    checkpoint's bytes, whose opcodes might act differently under the two unpicklers."""
    value: object
    check_archive(payload, where)
    try:
        value = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        value = fmt.load_bytes_io(payload)  # DCP's own io.BytesIO values
        if value is None:
            raise refused_pickle(where, exc) from None
    except Exception as exc:
        raise IntegrityError(
            f"{where}: the stored value cannot be read: {printable(str(exc), 200)}"
        ) from exc
    plain = io.BytesIO()
    torch.save(value, plain)
    plain.seek(0)
    return plain


def refused_pickle(where: str, exc: BaseException) -> UnsafeCheckpointError:
    """The error for a stored pickle that torch's ``weights_only`` unpickler refused
    (``exc``), naming ``where`` (the checkpoint and the item) and what was refused.

    Every path that unpickles a checkpoint's value reports a refusal through here, as
    :class:`UnsafeCheckpointError`. torch's own message advises loading again with
    ``weights_only=False``, the one setting that would run the payload: only the reason
    is kept, and the error is raised ``from None`` so no traceback repeats the advice."""
    text = str(exc)
    _, found, detail = text.rpartition("WeightsUnpickler error:")
    reasons = [
        line.partition("Please use")[0].strip()
        for line in (detail if found else text).splitlines()
        if not line.startswith(("Weights only load failed", "Check the documentation"))
        and "weights_only" not in line
    ]
    reason = printable(" ".join(r for r in reasons if r), 200) or type(exc).__name__
    return UnsafeCheckpointError(
        f"{where}: the stored value is not plain data ({reason}); refusing to unpickle it "
        "(it could run code). If you trust this checkpoint, allow the classes it needs with "
        "torch.serialization.add_safe_globals([...])"
    )
