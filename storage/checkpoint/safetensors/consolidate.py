"""Consolidation: a sharded ``dcp.save`` (DTensor / ShardedTensor shards on N ranks)
written as whole tensors in Hub-layout files, with no rank holding the model.

The design, the same on every backend (object stores cannot write at offsets):

1. Each rank streams the bytes of its shards, back to back, into one staging object
   ``<model>/.dcp-staging-<save id>/rank-<R>.bin`` and reports, per shard, where its
   bytes are there, where they go in the full tensor and their CRC-32C.
2. The coordinator (``finish``) plans the files from the global metadata (each
   tensor's dtype and full shape), combines the shards' CRC-32Cs into each tensor's,
   writes every file as header + each tensor's shards in order, copied from the
   staging objects in bounded ranged reads (``thread_count`` files at once), then the
   index, commits (``files.commit_model``), then removes the staging area.

Each rank and the coordinator keep a heartbeat in the area while they use it; an area a
killed save left is swept later (``staging``).

A shard is supported when its bytes are one contiguous range of the full tensor in
row-major order: shards along dimension 0 (``Shard(0)``, FSDP's layout), or along a
later dimension when every dimension before it has one row in the shard. Others
(``Shard(1)`` of a matrix, 2-D meshes that split columns) are refused with the fix.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import IO

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from extensions.errors import IntegrityError, quote
from extensions.streams import readinto_exact
from storage.backends.base import FileSystemBase
from storage.checkpoint.safetensors.crcs import crc32c_combine
from storage.checkpoint.safetensors.files import commit_model, new_names, publish_file, split
from storage.checkpoint.safetensors.header import encode_header, layout, nbytes

_COPY = 8 << 20  # bytes per ranged read while assembling a file


@dataclass(frozen=True)
class Staged:
    """A rank's save plan in consolidation mode: where its shards are staged."""

    object: str  #: the staging object, relative to the model's root


@dataclass(frozen=True)
class Piece:
    """One shard's bytes: ``length`` bytes at ``at`` in staging object ``object``,
    which belong at byte ``start`` of the full tensor."""

    object: str
    at: int
    start: int
    length: int
    crc32c: int


def byte_range(
    offsets: Sequence[int], sizes: Sequence[int], shape: Sequence[int], dtype: torch.dtype
) -> tuple[int, int] | None:
    """``(start, length)`` in bytes of the chunk (``offsets``, ``sizes``) of a
    row-major tensor of ``shape``, or ``None`` when its bytes are not contiguous."""
    partial = [d for d in range(len(shape)) if sizes[d] != shape[d]]
    if partial and any(sizes[d] != 1 for d in range(partial[-1])):
        return None
    itemsize = dtype.itemsize
    stride = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    start = sum(o * s for o, s in zip(offsets, stride))
    return start * itemsize, nbytes(dtype, sizes)


@dataclass
class _Tensor:
    dtype: torch.dtype
    shape: tuple[int, ...]
    pieces: list[Piece]
    crc32c: int = 0


def consolidate(
    fs: FileSystemBase,
    root: str,
    metadata: Metadata,
    pieces: Iterable[tuple[str, Piece]],
    *,
    max_shard_size: int | None,
    threads: int,
    write_id: str,
    home: str | None = None,
) -> None:
    """Write the model at ``root`` (in ``home``, ``root`` as the save resolved it when it
    began; default: resolved now) from the staged ``pieces`` (fqn, piece) of every
    rank, as described in the module docstring; the index (or the single file) is
    published last. Raises ``IntegrityError`` naming the tensor when its shards do not
    tile it exactly. Every file and the index record ``write_id``."""
    by_fqn: dict[str, list[Piece]] = defaultdict(list)
    for fqn, piece in pieces:
        by_fqn[fqn].append(piece)
    tensors: dict[str, _Tensor] = {}
    for fqn, meta in metadata.state_dict_metadata.items():
        if fqn not in by_fqn or not isinstance(meta, TensorStorageMetadata):
            continue
        tensor = _Tensor(meta.properties.dtype, tuple(meta.size), sorted(by_fqn[fqn], key=_at))
        tensor.crc32c = _check_tiling(fs.url(root), fqn, tensor)
        tensors[fqn] = tensor
    groups = split([(f, nbytes(t.dtype, t.shape)) for f, t in tensors.items()], max_shard_size)
    names, replaced = new_names(fs, root, len(groups), write_id, home=home)

    def write(job: tuple[list[str], str]) -> None:
        group, name = job
        _assemble(fs, root, name, {f: tensors[f] for f in group}, write_id, replaced.home)

    with ThreadPoolExecutor(max(1, min(threads, len(groups)))) as pool:
        list(pool.map(write, zip(groups, names)))
    weight_map = {f: name for group, name in zip(groups, names) for f in group}
    total = sum(nbytes(t.dtype, t.shape) for t in tensors.values())
    commit_model(fs, root, weight_map, total, write_id, replaced)


def _at(piece: Piece) -> int:
    return piece.start


def _check_tiling(url: str, fqn: str, tensor: _Tensor) -> int:
    cursor, crc = 0, 0
    for piece in tensor.pieces:
        if piece.start != cursor:
            what = "overlap" if piece.start < cursor else "leave a gap"
            raise IntegrityError(
                f"{url}: tensor {quote(fqn)}: its shards {what} at byte {min(cursor, piece.start)}"
                "; every byte of a tensor must be saved by exactly one rank: check the "
                "state dict's DTensor placements"
            )
        crc = crc32c_combine(crc, piece.crc32c, piece.length) if cursor else piece.crc32c
        cursor += piece.length
    size = nbytes(tensor.dtype, tensor.shape)
    if cursor != size:
        raise IntegrityError(
            f"{url}: tensor {quote(fqn)}: its shards cover {cursor} of its {size} bytes; "
            "every byte of a tensor must be saved by exactly one rank: check the state "
            "dict's DTensor placements"
        )
    return crc


def _assemble(
    fs: FileSystemBase,
    root: str,
    name: str,
    tensors: dict[str, _Tensor],
    write_id: str,
    home: str,
) -> None:
    shapes = {fqn: (t.dtype, t.shape) for fqn, t in tensors.items()}
    order = layout(shapes)
    crcs = {fqn: tensors[fqn].crc32c for fqn in order}
    header = encode_header(shapes, order, crcs, write_id)
    buffer = bytearray(_COPY)
    with publish_file(fs, fs.concat_path(root, name), home=home) as out:
        out.write(header)
        for fqn in order:
            for piece in tensors[fqn].pieces:
                _copy(fs, root, piece, out, buffer, fqn)


def _copy(
    fs: FileSystemBase, root: str, piece: Piece, out: IO[bytes], buffer: bytearray, fqn: str
) -> None:
    path = fs.concat_path(root, piece.object)
    done = 0
    view = memoryview(buffer)
    with fs.open_slice(path, piece.at, piece.length) as stream:
        while done < piece.length:
            want = min(len(buffer), piece.length - done)
            got = readinto_exact(stream, view[:want])
            if got < want:
                raise IntegrityError(
                    f"{fs.url(path)}: the staged bytes of tensor {quote(fqn)} end early; a "
                    "rank's staging object is damaged: save again"
                )
            out.write(view[:want])
            done += want
