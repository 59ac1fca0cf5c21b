"""Checkpoint tools behind the CLI: read every metadata of a checkpoint, describe it,
verify it (``storage.ops.copy`` copies it).

They work item by item on the stored records, so memory stays bounded: ``describe``
reads only the metadata; ``verify`` decodes each item into a scratch tensor of that
item's size (a few at a time) and drops it. Nothing here unpickles the checkpoint's
objects.
"""

from __future__ import annotations

import concurrent.futures
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from extensions.base import Keys
from extensions.errors import (
    CheckpointStorageError,
)
from extensions.registry import ExtensionRegistry
from storage.backends.base import FileSystemBase
from storage.checkpoint import format as fmt
from storage.checkpoint._common import default_thread_count
from storage.checkpoint.committed import CommittedCheckpoint, open_committed
from storage.checkpoint.layout import metadata_rank
from storage.checkpoint.reader import CheckpointReader

Progress = Callable[[int], None]


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


@dataclass
class VerifyReport:
    url: str
    ok: list[str] = field(default_factory=list)
    bad: dict[str, str] = field(default_factory=dict)
    unchecksummed: list[str] = field(default_factory=list)
    bytes_read: int = 0


@dataclass(frozen=True)
class Part:
    """One metadata of a checkpoint and a reader set up on it: the global
    ``.metadata`` (``rank`` is ``None``) or one rank's ``__{rank}.metadata``."""

    name: str
    rank: int | None
    reader: CheckpointReader
    metadata: Metadata

    def label(self, index: MetadataIndex) -> str:
        """The item's name, with its rank where each rank has metadata of its own."""
        label = fmt.item_label(index)
        return label if self.rank is None else f"rank {self.rank}: {label}"


def read_metadata(
    fs: FileSystemBase,
    path: str,
    *,
    opened: CommittedCheckpoint | None = None,
    **reader_options: Any,
) -> list[Part]:
    """Every metadata that commits the checkpoint at ``path`` (layout's rule: the
    global one, else each rank's), each with a reader set up on it (``reader_options``
    go to :class:`CheckpointReader`); ``opened``: its read model, when the caller holds
    it already.

    Raises :class:`CheckpointNotFoundError` naming what is missing when ``path`` is not
    a committed checkpoint, and why its metadata cannot be read when it cannot."""
    checkpoint = opened or open_committed(fs, path)
    checkpoint.require()
    parts = []
    for name in checkpoint.committing:
        reader = CheckpointReader(fs.url(path), filesystem=fs, **reader_options)
        metadata = checkpoint.metadata[name]
        reader.set_up_storage_reader(metadata, True)
        parts.append(Part(name, metadata_rank(name), reader, metadata))
    return parts


def chunk_facts(metadata: Metadata, index: MetadataIndex) -> tuple[torch.Size, torch.dtype] | None:
    """The stored chunk's sizes and the tensor's dtype (``None`` for a non-tensor item)."""
    md = metadata.state_dict_metadata.get(index.fqn)
    if not isinstance(md, TensorStorageMetadata):
        return None
    offsets = list(index.offset or [])
    for chunk in md.chunks:
        if list(chunk.offsets) == offsets or (not offsets and len(md.chunks) == 1):
            return chunk.sizes, md.properties.dtype
    return None


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
                    fmt.item_extra(info).get(fmt.REF),
                )
            )
    rows.sort(key=lambda r: r.item)
    files = len({(r.ref, r.file) for r in rows})
    return Summary(fs.url(path), rows, files)


class _ScratchPlanner(LoadPlanner):
    """Decodes items into scratch tensors that are dropped at once (for verify)."""

    def __init__(self, metadata: Metadata) -> None:
        self.metadata = metadata

    def set_up_planner(self, *args: Any, **kwargs: Any) -> None:
        pass

    def create_local_plan(self) -> LoadPlan:
        return LoadPlan([])

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        pass  # the reader has read, checked and decoded every byte; never unpickle

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        md = self.metadata.state_dict_metadata[read_item.dest_index.fqn]
        assert isinstance(md, TensorStorageMetadata)
        return torch.empty(tuple(read_item.lengths), dtype=md.properties.dtype)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass


def _read_item_for(metadata: Metadata, index: MetadataIndex) -> ReadItem:
    facts = chunk_facts(metadata, index)
    if facts is None:
        zero = torch.Size([0])
        return ReadItem(LoadItemType.BYTE_IO, index, zero, index, zero, zero)
    sizes = facts[0]
    zeros = torch.Size([0] * len(sizes))
    return ReadItem(LoadItemType.TENSOR, index, zeros, index, zeros, torch.Size(sizes))


def verify(
    fs: FileSystemBase,
    path: str,
    *,
    keys: Keys | None = None,
    registry: ExtensionRegistry | None = None,
    thread_count: int | None = None,
    progress: Progress | None = None,
    require_encryption: bool | None = None,
) -> VerifyReport:
    """Read every item of the checkpoint at ``path``: check its CRC32C and decode its
    transform chain (which authenticates encrypted items). With ``keys``, an item that
    is not encrypted is bad unless ``require_encryption=False``. Returns which items
    are good and why the others are not; raises only if the metadata cannot be read."""
    parts = read_metadata(
        fs, path, keys=keys, registry=registry, require_encryption=require_encryption
    )
    report = VerifyReport(fs.url(path))
    for part in parts:
        storage_data = part.metadata.storage_data or {}
        for fqn, md in part.metadata.state_dict_metadata.items():
            expected = (
                [MetadataIndex(fqn, c.offsets) for c in md.chunks]
                if isinstance(md, TensorStorageMetadata)
                else [MetadataIndex(fqn)]
                if isinstance(md, BytesStorageMetadata)
                else []
            )
            for index in expected:
                if index not in storage_data:
                    report.bad[part.label(index)] = "missing from the storage index"
    lock = threading.Lock()

    def check(part: Part, planner: _ScratchPlanner, index: MetadataIndex, info: Any) -> None:
        label = part.label(index)
        try:
            plan = LoadPlan([_read_item_for(part.metadata, index)])
            part.reader.read_data(plan, planner).wait()
        except (CheckpointStorageError, OSError, ValueError, KeyError, RuntimeError) as exc:
            with lock:
                report.bad[label] = str(exc) or type(exc).__name__
        else:
            with lock:
                report.ok.append(label)
                if "crc32c" not in fmt.item_extra(info):
                    report.unchecksummed.append(label)
        with lock:
            report.bytes_read += int(info.length)
        if progress is not None:
            progress(int(info.length))

    planners = [_ScratchPlanner(part.metadata) for part in parts]
    work = [
        (part, planner, index, info)
        for part, planner in zip(parts, planners)
        for index, info in (part.metadata.storage_data or {}).items()
    ]
    workers = max(1, thread_count or min(4, default_thread_count(fs)))
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="dcp-verify") as pool:
        for fut in [pool.submit(check, *args) for args in work]:
            fut.result()
    report.ok.sort()
    report.unchecksummed.sort()
    return report
