"""A committed Hub-layout model read: which files are the model, each file's header
read once and checked, and a tensor's bytes read straight into its target.

The model in a folder is ``model.safetensors`` where that file is there, else the files
``model.safetensors.index.json`` names: transformers' ``from_pretrained`` chooses so,
and so does every reader here (``load``, ``verify``, the CLI), which makes the removal
of that file the commit of a model in several files replacing it (``files``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor

import crc32c
import torch

from extensions.errors import (
    CheckpointNotFoundError,
    IntegrityError,
    UnsafeCheckpointError,
    quote,
)
from extensions.streams import read_all, readinto_exact
from storage.backends.base import FileSystemBase
from storage.checkpoint.safetensors.header import INDEX_NAME, MAX_HEADER, SINGLE_NAME, TensorEntry
from storage.checkpoint.safetensors.parse import (
    Header,
    Index,
    header_length,
    parse_header,
    parse_index,
)
from storage.checkpoint.tensors import tensor_bytes

_PREFETCH = 64 << 10  # the first read of a file: its header length and most headers


def read_model(fs: FileSystemBase, root: str, threads: int = 1) -> dict[str, TensorEntry]:
    """Every tensor of the committed model at ``root``: ``model.safetensors`` where it is
    there, else the files its index names (transformers' choice: a model in several
    files replacing a single one is committed when that file is removed), each file's
    header read once and checked (see ``header``), and the files an index names checked
    to come from the write that wrote it (:func:`_same_write`). A ``root`` that is a
    neighbour's link is refused before anything is read (``resolve_link``)."""
    fs.resolve_link(root)
    if fs.exists(fs.concat_path(root, SINGLE_NAME)):
        return read_files(fs, root, None, threads)
    return read_files(fs, root, read_index(fs, root), threads)


def read_index(fs: FileSystemBase, root: str) -> Index:
    """The checked index at ``root``; ``CheckpointNotFoundError`` where there is none."""
    path = fs.concat_path(root, INDEX_NAME)
    try:
        return parse_index(read_limited(fs, path), fs.url(path))
    except FileNotFoundError:
        raise CheckpointNotFoundError(
            f"{fs.url(root)}: no safetensors model there (neither {SINGLE_NAME} nor "
            f"{INDEX_NAME}); an export that did not finish has no index: export it again"
        ) from None


def read_files(
    fs: FileSystemBase, root: str, index: Index | None, threads: int
) -> dict[str, TensorEntry]:
    """The tensors of the files ``index`` names (``None``: of ``model.safetensors``)."""
    weight_map = index.weight_map if index is not None else {}
    files = sorted(set(weight_map.values())) if index is not None else [SINGLE_NAME]
    with ThreadPoolExecutor(max(1, min(threads, len(files)))) as pool:
        headers = list(pool.map(lambda f: read_header(fs, root, f), files))
    if index is not None:
        _same_write(fs, root, index.write_id, zip(files, headers))
    entries: dict[str, TensorEntry] = {}
    for header in headers:
        for name, entry in header.entries.items():
            if name in entries:
                raise IntegrityError(
                    f"{fs.url(root)}: tensor {quote(name)} is in both {quote(entries[name].file)} "
                    f"and {quote(entry.file)}; the model is damaged: export or download it again"
                )
            entries[name] = entry
    for name, file in weight_map.items():
        if name not in entries or entries[name].file != file:
            raise IntegrityError(
                f"{fs.url(fs.concat_path(root, INDEX_NAME))}: tensor {quote(name)} is mapped to "
                f"{quote(file)}, whose header does not hold it; the model is incomplete or its "
                "index is stale: export or download it again"
            )
    return entries


def _same_write(
    fs: FileSystemBase, root: str, write_id: str | None, headers: Iterable[tuple[str, Header]]
) -> None:
    """Refuse a model whose index and files do not all carry one write id: two saves or
    exports to the folder at once each published their own files under the same names
    (each file whole), so the folder holds files of both. None carrying an id (other
    writers, ours before ids) is not checked."""
    for file, header in headers:
        if header.write_id == write_id:
            continue
        raise IntegrityError(
            f"{fs.url(root)}: {quote(file)} was written by another save or export than the "
            f"index {INDEX_NAME} (write id {show_id(header.write_id)}, the index's "
            f"{show_id(write_id)}); two writes to this folder overlapped and it mixes their "
            "files: export or save the model again, one writer at a time"
        )


def show_id(write_id: str | None) -> str:
    """A write id as an error message quotes it (``none`` where there is none)."""
    return "none" if write_id is None else quote(write_id)


def read_header(fs: FileSystemBase, root: str, file: str) -> Header:
    """The checked header of ``file`` under ``root``: its length first (one read of
    the file's start), the rest of the header only if that read did not cover it."""
    path = fs.concat_path(root, file)
    label = fs.url(path)
    try:
        size = fs.size(path)
        with fs.open_slice(path, 0, min(size, _PREFETCH)) as stream:
            head = read_all(stream, limit=_PREFETCH)
        length = header_length(head, label, size)
        text = head[8 : 8 + length]
        if len(text) < length:
            with fs.open_slice(path, len(head), length - len(text)) as stream:
                text += read_all(stream, limit=length - len(text))
    except FileNotFoundError as exc:
        raise CheckpointNotFoundError(
            f"{label} is missing; the model is incomplete: export or download it again"
        ) from exc
    if len(text) < length:
        raise IntegrityError(f"{label}: the file ended inside its header; it is truncated")
    header = parse_header(text, label, size)
    entries = {name: _named(entry, file) for name, entry in header.entries.items()}
    return Header(entries, header.write_id)


def _named(entry: TensorEntry, file: str) -> TensorEntry:
    return TensorEntry(
        file, entry.name, entry.dtype, entry.shape, entry.begin, entry.end, entry.crc32c
    )


def read_limited(fs: FileSystemBase, path: str) -> bytes:
    """The bytes of the index at ``path``, refused unread past ``MAX_HEADER``."""
    with fs.open_slice(path, 0, MAX_HEADER + 1) as stream:
        text = read_all(stream, limit=MAX_HEADER)
    if len(text) > MAX_HEADER:
        raise UnsafeCheckpointError(
            f"{fs.url(path)} is over {MAX_HEADER >> 20} MiB, more than any safetensors index "
            "needs; it is damaged or not an index: refused without reading the rest"
        )
    return text


def read_region(
    fs: FileSystemBase,
    root: str,
    entry: TensorEntry,
    offsets: Sequence[int],
    lengths: Sequence[int],
    target: torch.Tensor,
) -> None:
    """Fill ``target`` with the region (``offsets``, ``lengths``) of the stored tensor:
    one ranged read of the rows it spans, straight into ``target`` where it is the
    whole rows (a CPU contiguous tensor of the stored dtype), else into a buffer of
    those rows that is then copied. A whole tensor's CRC-32C is checked."""
    shape = entry.shape
    where = f"{fs.url(fs.concat_path(root, entry.file))}: tensor {quote(entry.name)}"
    if len(offsets) != len(shape) or any(
        o < 0 or o + n > s for o, n, s in zip(offsets, lengths, shape)
    ):
        raise ValueError(
            f"{where}: region at {tuple(offsets)} of sizes {tuple(lengths)} is outside its shape "
            f"{shape}; load into a state dict shaped like the model"
        )
    rows = (offsets[0], lengths[0]) if shape else (0, 1)
    row_bytes = entry.length // shape[0] if shape and shape[0] else entry.length
    inner_whole = all(o == 0 and n == s for o, n, s in zip(offsets[1:], lengths[1:], shape[1:]))
    direct = (
        inner_whole
        and target.device.type == "cpu"
        and target.dtype == entry.torch_dtype
        and target.is_contiguous()
    )
    stored = (rows[1], *shape[1:]) if shape else ()
    buffer = target if direct else torch.empty(stored, dtype=entry.torch_dtype)
    span = rows[1] * row_bytes if shape else entry.length
    if span:
        path = fs.concat_path(root, entry.file)
        with fs.open_slice(path, entry.begin + rows[0] * row_bytes, span) as stream:
            got = readinto_exact(stream, tensor_bytes(buffer))
        if got < span:
            raise IntegrityError(
                f"{where}: the file ended {span - got} bytes early; it is truncated: export "
                "or download it again"
            )
    whole = rows == (0, shape[0] if shape else 1) and inner_whole
    if whole and entry.crc32c is not None:
        crc = crc32c.crc32c(tensor_bytes(buffer))
        if crc != entry.crc32c:
            raise IntegrityError(
                f"{where}: checksum mismatch (crc32c {crc:08x}, expected {entry.crc32c:08x}); "
                "the stored bytes are damaged: export or download the model again"
            )
    if not direct:
        inner = tuple(slice(o, o + n) for o, n in zip(offsets[1:], lengths[1:]))
        target.copy_(buffer[(slice(None), *inner)] if shape else buffer)
