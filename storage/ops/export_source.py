"""Where an exported tensor's bytes are in the source checkpoint, and their CRC-32C
before any of them is read: what lets ``export`` write a safetensors file header
first and stream the tensors' bytes after it.

A tensor is *direct* when every item holding it is stored untransformed, records its
CRC-32C and where the tensor's bytes start in its ``torch.save`` archive
(``data_offset``), holds the stored dtype and size the metadata says, is exported at
that dtype, and the items' chunks tile the tensor in contiguous byte ranges (whole
tensors, ``Shard(0)`` shards). Its bytes are then ranged reads of the items' data
files (:class:`Run`), and its CRC-32C comes from the records: the item's checksum
covers its whole archive, so each item's archive head and tail (a few hundred bytes)
are read and the checksum of the bytes between them solved for
(:func:`~storage.checkpoint.safetensors.crcs.crc32c_middle`); a tensor in several
items combines its runs' checksums. Every other tensor (a ``--dtype`` conversion,
zstd or encrypted items, stock checkpoints without records, other shard layouts, or
keys given so that plain items must be refused) is *loaded*: its checksum comes from a
first load, the export loads it again to write it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import crc32c
import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from extensions.errors import (
    CheckpointNotFoundError,
    CheckpointStorageError,
    IntegrityError,
    quote,
)
from extensions.streams import read_all
from storage.backends.base import FileSystemBase
from storage.checkpoint import incremental
from storage.checkpoint import storage_format as fmt
from storage.checkpoint.decode import ARCHIVE_ALLOWANCE
from storage.checkpoint.prefixes import refuse_linked_prefix
from storage.checkpoint.safetensors.consolidate import byte_range
from storage.checkpoint.safetensors.crcs import crc32c_combine, crc32c_middle
from storage.checkpoint.safetensors.header import nbytes
from storage.checkpoint.tensors import tensor_bytes

#: Loaded tensors are loaded this many bytes at a time (at least one tensor).
LOAD_BATCH = 64 << 20


@dataclass
class Run:
    """One item's share of a direct tensor: ``length`` bytes at ``start`` of the data
    file ``path``, whose CRC-32C the item's record implies (``crc32c``)."""

    label: str  #: the item, as errors name it
    path: str
    start: int
    length: int
    item_start: int  #: where the item's stored bytes begin in ``path``
    item_length: int
    item_crc: int
    crc32c: int = 0
    base: str | None = None  #: the base checkpoint whose file ``path`` is, quoted


@dataclass
class Tensor:
    """One exported tensor: its name in the model, its item, what it is written as,
    and where its bytes come from (``runs``, in order; ``None``: loaded)."""

    name: str
    fqn: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    runs: list[Run] | None
    crc32c: int = 0

    @property
    def nbytes(self) -> int:
        return nbytes(self.dtype, self.shape)


def plan_tensor(
    fs: FileSystemBase,
    root: str,
    metadata: Metadata,
    name: str,
    fqn: str,
    dtype: torch.dtype,
    *,
    direct: bool = True,
) -> Tensor:
    """``fqn`` exported as ``name`` at ``dtype``: direct where the module docstring
    allows it (and ``direct``), else loaded. Reads nothing."""
    meta: Any = metadata.state_dict_metadata[fqn]
    shape = tuple(int(s) for s in meta.size)
    stored = meta.properties.dtype
    tensor = Tensor(name, fqn, dtype, shape, None)
    if not direct or dtype != stored or metadata.storage_data is None:
        return tensor
    spans: list[tuple[int, Run]] = []
    for chunk in meta.chunks:
        index = MetadataIndex(fqn, chunk.offsets)
        info = metadata.storage_data.get(index)
        span = byte_range(chunk.offsets, chunk.sizes, shape, stored)
        if info is None or span is None:
            return tensor
        record = fmt.stored_item(info)
        size = nbytes(stored, chunk.sizes)
        offset = record.data_offset
        dtype_text = str(stored).removeprefix("torch.")
        if (
            record.descriptors
            or record.crc32c is None
            or offset is None
            or (record.dtype or dtype_text) != dtype_text
            or (record.nbytes if record.nbytes is not None else size) != size
            or offset < 0
            or offset + size > record.length
            # The archive around the tensor is read whole to solve for its checksum: a
            # record claiming more than an archive holds is loaded (and refused) instead.
            or offset > ARCHIVE_ALLOWANCE
            or record.length - offset - size > ARCHIVE_ALLOWANCE
        ):
            return tensor
        path = incremental.item_path(fs, root, info)
        label = fmt.item_label(index)
        start = int(info.offset)
        run = Run(label, path, start + offset, size, start, record.length, record.crc32c)
        if record.ref is not None:
            run.base = incremental.sibling_url(fs, root, record.ref)
        spans.append((span[0], run))
    spans.sort(key=lambda s: s[0])
    cursor = 0
    for start, run in spans:
        if start != cursor:
            return tensor  # not tiled by contiguous ranges: loaded
        cursor += run.length
    if cursor != tensor.nbytes:
        return tensor
    tensor.runs = [run for _, run in spans]
    return tensor


def checksum(
    fs: FileSystemBase,
    root: str,
    metadata: Metadata,
    tensors: Sequence[Tensor],
    load: Callable[[list[Tensor]], dict[str, torch.Tensor]],
    pool: ThreadPoolExecutor,
) -> None:
    """Fill in every tensor's CRC-32C: direct ones from the item records and their
    archives' ends (read on ``pool``), loaded ones by loading them (``load``, a batch
    of at most :data:`LOAD_BATCH` bytes at a time)."""
    direct = [t for t in tensors if t.runs is not None]
    infos = []
    for tensor in direct:
        meta: Any = metadata.state_dict_metadata[tensor.fqn]
        assert metadata.storage_data is not None
        infos += [
            (tensor.fqn, metadata.storage_data[MetadataIndex(tensor.fqn, c.offsets)])
            for c in meta.chunks
        ]
    incremental.check_bases(fs, root, infos)
    for directory, relative in {
        (incremental.item_directory(fs, root, i), i.relative_path) for _, i in infos
    }:
        refuse_linked_prefix(fs, directory, relative)
    runs = [run for t in direct for run in t.runs or ()]
    list(pool.map(functools.partial(_run_crc, fs, fs.url(root)), runs))
    for tensor in direct:
        crc = 0
        for run in tensor.runs or ():
            crc = crc32c_combine(crc, run.crc32c, run.length)
        tensor.crc32c = crc
    for batch in batches([t for t in tensors if t.runs is None]):
        loaded = load(batch)
        for tensor in batch:
            tensor.crc32c = crc32c.crc32c(tensor_bytes(loaded.pop(tensor.name)))


def batches(tensors: Sequence[Tensor]) -> list[list[Tensor]]:
    """``tensors`` in order, cut into loads of at most :data:`LOAD_BATCH` bytes."""
    out: list[list[Tensor]] = []
    filled = 0
    for tensor in tensors:
        if not out or (out[-1] and filled + tensor.nbytes > LOAD_BATCH):
            out.append([])
            filled = 0
        out[-1].append(tensor)
        filled += tensor.nbytes
    return out


def damaged(checkpoint: str, run: Run, detail: str) -> IntegrityError:
    return IntegrityError(
        f"{checkpoint}: item {quote(run.label)} in {quote(run.path.rpartition('/')[2])}: "
        f"{detail}; the stored bytes are damaged: nothing was exported from them. Find every "
        "damaged item with `dcp-storage verify`, and export from a good copy of the checkpoint"
    )


def missing(checkpoint: str, run: Run, exc: FileNotFoundError) -> Exception:
    """What a read of ``run``'s data file that found no file raises: the checkpoint, the
    file, the item and the fix (an error of ours already says what is missing)."""
    if isinstance(exc, CheckpointStorageError):
        return exc
    where = "" if run.base is None else f" of its base {run.base}"
    return CheckpointNotFoundError(
        f"{checkpoint}: data file {quote(run.path.rpartition('/')[2])}{where} (item "
        f"{quote(run.label)}) is missing; the checkpoint is incomplete: restore the file or "
        "re-save the checkpoint"
    )


def _run_crc(fs: FileSystemBase, checkpoint: str, run: Run) -> None:
    head_length = run.start - run.item_start
    tail_start = run.start + run.length
    tail_length = run.item_start + run.item_length - tail_start
    try:
        head = _read(fs, run.path, run.item_start, head_length)
        tail = _read(fs, run.path, tail_start, tail_length)
    except FileNotFoundError as exc:
        raise missing(checkpoint, run, exc) from exc
    if len(head) != head_length or len(tail) != tail_length:
        raise damaged(checkpoint, run, "the data file ends inside the item (truncated)")
    run.crc32c = crc32c_middle(run.item_crc, head, tail, run.length)


def _read(fs: FileSystemBase, path: str, offset: int, length: int) -> bytes:
    if not length:
        return b""
    with fs.open_slice(path, offset, length) as stream:
        return read_all(stream, limit=length)
