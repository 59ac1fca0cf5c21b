"""Export a committed DCP checkpoint (ours or stock) as a Hugging Face Hub-layout model
in a bucket or directory, one file's worth of tensors in memory at a time."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from extensions.base import Keys
from extensions.errors import quote
from storage.backends.base import FileSystemBase
from storage.checkpoint.api import load
from storage.checkpoint.reader import CheckpointReader
from storage.checkpoint.safetensors.files import (
    clear_destination,
    file_names,
    publish_index,
    split,
    write_file,
)
from storage.checkpoint.safetensors.header import INDEX_NAME, dtype_name, nbytes

#: The Hub's customary largest file.
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9


@dataclass
class ExportResult:
    source: str
    destination: str
    files: list[str]  #: the model's files, the commit (index or single file) last
    tensors: int
    size: int  #: bytes of tensor data written
    skipped: list[str] = field(default_factory=list)  #: items that are not tensors


def export_safetensors(
    src_fs: FileSystemBase,
    src: str,
    dst_fs: FileSystemBase,
    dst: str,
    *,
    dtype: torch.dtype | None = None,
    max_shard_size: int | None = DEFAULT_MAX_SHARD_SIZE,
    only: Sequence[str] = (),
    strip: str = "",
    overwrite: bool = False,
    keys: Keys | None = None,
    require_encryption: bool | None = None,
    progress: Callable[[int, int], Any] | None = None,
) -> ExportResult:
    """Write the tensors of the checkpoint at ``src`` as a safetensors model at ``dst``.

    ``only``: keep the items whose names start with one of these prefixes (all when
    empty); ``strip``: remove this prefix from the names that have it (``model.``);
    ``dtype``: convert floating-point tensors (integer and bool ones keep theirs);
    ``max_shard_size``: bytes per file (``None``: one file). Items that are not
    tensors are skipped and listed. Each file's tensors are loaded (``keys`` decrypt
    encrypted items), converted and written before the next file's are loaded, so
    memory holds about one file; the index is written last (the commit: see
    ``storage.checkpoint.safetensors.files``), and a model already at ``dst`` is
    refused unless ``overwrite``. ``progress(done, total)`` is called with the bytes of
    tensor data written so far and in all after each tensor is written."""
    reader_options: dict[str, Any] = {"keys": keys, "require_encryption": require_encryption}
    metadata = CheckpointReader(src, filesystem=src_fs, **reader_options).read_metadata()
    chosen: dict[str, tuple[str, torch.dtype, torch.Size]] = {}  # name -> (fqn, dtype, size)
    skipped: list[str] = []
    for fqn, meta in metadata.state_dict_metadata.items():
        if only and not any(fqn.startswith(prefix) for prefix in only):
            continue
        if not isinstance(meta, TensorStorageMetadata):
            skipped.append(fqn)
            continue
        name = fqn[len(strip) :] if strip and fqn.startswith(strip) else fqn
        if name in chosen:
            raise ValueError(
                f"{src_fs.url(src)}: items {quote(chosen[name][0])} and {quote(fqn)} are both "
                f"named {quote(name)} once {quote(strip)} is stripped; narrow them with --only "
                "or strip less"
            )
        stored = meta.properties.dtype
        out = dtype if dtype is not None and stored.is_floating_point else stored
        dtype_name(out, f"{src_fs.url(src)}: item {quote(fqn)}")
        chosen[name] = (fqn, out, meta.size)
    if not chosen:
        raise ValueError(
            f"{src_fs.url(src)}: no tensors to export"
            + (f" under {', '.join(quote(p) for p in only)}" if only else "")
            + "; check the item names with `dcp-storage inspect`"
        )
    sizes = [(name, nbytes(out, size)) for name, (_, out, size) in chosen.items()]
    everything = sum(size for _, size in sizes)
    groups = split(sizes, max_shard_size)
    names = file_names(len(groups))
    clear_destination(dst_fs, dst, overwrite=overwrite)
    weight_map: dict[str, str] = {}
    total = 0
    for group, file in zip(groups, names):
        state = {
            chosen[n][0]: torch.empty(chosen[n][2], dtype=_stored(metadata, chosen[n][0]))
            for n in group
        }
        load(state, src_fs.url(src), filesystem=src_fs, **reader_options)
        tensors = [(n, state.pop(chosen[n][0]).to(chosen[n][1]).contiguous()) for n in group]
        done = total

        def wrote(n: int, done_before: int = done) -> None:
            if progress is not None:
                progress(done_before + n, everything)

        written = write_file(dst_fs, dst_fs.concat_path(dst, file), tensors, progress=wrote)
        del tensors
        total += written
        weight_map.update(dict.fromkeys(group, file))
    if len(names) > 1:
        publish_index(dst_fs, dst, weight_map, total)
        names.append(INDEX_NAME)
    else:
        dst_fs.sync_dir(dst)
    return ExportResult(src_fs.url(src), dst_fs.url(dst), names, len(chosen), total, skipped)


def _stored(metadata: Any, fqn: str) -> torch.dtype:
    return metadata.state_dict_metadata[fqn].properties.dtype  # type: ignore[no-any-return]
