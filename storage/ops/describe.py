"""``describe``: the items of a checkpoint (every rank's), from its metadata alone."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from storage.backends.base import FileSystemBase
from storage.checkpoint import storage_format as fmt
from storage.ops.parts import chunk_facts, read_metadata


@dataclass(frozen=True)
class ItemRow:
    """One stored item. ``logical`` is the tensor's bytes (``None`` for an encoded
    non-tensor item, whose plain size is only known by decoding it); ``ref`` names the
    base checkpoint beside this one whose ``file`` holds the bytes (incremental saves)."""

    item: str
    shape: tuple[int, ...] | None
    dtype: str | None
    logical: int | None
    stored: int
    transforms: list[str]
    file: str
    ref: str | None = None

    @property
    def ratio(self) -> float | None:
        return self.logical / self.stored if self.logical is not None and self.stored else None


@dataclass
class Summary:
    url: str
    items: list[ItemRow]
    files: int

    @property
    def stored(self) -> int:
        return sum(r.stored for r in self.items)

    @property
    def referenced(self) -> int:
        """Stored bytes held by base checkpoints (incremental saves), not by this one."""
        return sum(r.stored for r in self.items if r.ref is not None)

    @property
    def logical(self) -> int:
        """Logical bytes of the items whose logical size is known."""
        return sum(r.logical for r in self.items if r.logical is not None)

    @property
    def ratio(self) -> float | None:
        known = sum(r.stored for r in self.items if r.logical is not None)
        return self.logical / known if known else None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def describe(fs: FileSystemBase, path: str) -> Summary:
    """Items of the checkpoint at ``path`` (every rank's), from its metadata alone."""
    rows = []
    for part in read_metadata(fs, path):
        metadata = part.metadata
        for index, info in (metadata.storage_data or {}).items():
            facts = chunk_facts(metadata, index)
            descriptors = list(info.transform_descriptors or ())
            if facts is not None:
                sizes, dtype = facts
                shape: tuple[int, ...] | None = tuple(sizes)
                logical: int | None = math.prod(sizes) * dtype.itemsize
                dtype_name: str | None = _dtype_name(dtype)
            else:
                shape, dtype_name = None, None
                logical = int(info.length) if not descriptors else None
            rows.append(
                ItemRow(
                    part.label(index),
                    shape,
                    dtype_name,
                    logical,
                    int(info.length),
                    descriptors,
                    info.relative_path,
                    fmt.stored_item(info).ref,
                )
            )
    rows.sort(key=lambda r: r.item)
    files = len({(r.ref, r.file) for r in rows})
    return Summary(fs.url(path), rows, files)
