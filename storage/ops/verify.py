"""``verify``: read every item of a checkpoint, check its checksum and decode it.

Each item is decoded into a scratch tensor of that item's size (a few at a time) and
dropped, so memory stays bounded; nothing is unpickled.
"""

from __future__ import annotations

import concurrent.futures
import math
import threading
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
from extensions.errors import CheckpointStorageError, IntegrityError, printable
from extensions.registry import ExtensionRegistry
from storage.backends.base import FileSystemBase
from storage.checkpoint import storage_format as fmt
from storage.checkpoint.coverage import uncovered
from storage.checkpoint.options import default_thread_count
from storage.checkpoint.tensors import unbacked_claim
from storage.ops.parts import Part, Progress, chunk_facts, read_metadata


@dataclass
class VerifyReport:
    url: str
    ok: list[str] = field(default_factory=list)
    bad: dict[str, str] = field(default_factory=dict)
    unchecksummed: list[str] = field(default_factory=list)
    bytes_read: int = 0


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
        shape, dtype = tuple(read_item.lengths), md.properties.dtype
        try:
            return torch.empty(shape, dtype=dtype)
        except (RuntimeError, MemoryError) as exc:
            raise RuntimeError(
                f"its chunk is a {shape} {dtype} tensor, more than this machine can allocate "
                f"({printable(str(exc), 200)}); verify it where there is more memory"
            ) from None

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass


def _missing(metadata: Metadata) -> list[MetadataIndex]:
    """The items ``metadata`` declares that its storage index does not hold."""
    storage_data = metadata.storage_data or {}
    missing = []
    for fqn, md in metadata.state_dict_metadata.items():
        expected = (
            [MetadataIndex(fqn, c.offsets) for c in md.chunks]
            if isinstance(md, TensorStorageMetadata)
            else [MetadataIndex(fqn)]
            if isinstance(md, BytesStorageMetadata)
            else []
        )
        missing += [index for index in expected if index not in storage_data]
    return missing


def _report_uncovered(part: Part, report: VerifyReport) -> None:
    """Report as bad, under the item's name, each tensor item of a metadata written by
    several ranks together whose chunks hold fewer elements than the tensor has: torch
    checked at save time that they cover it, so some are lost. (A save by one process,
    or rank-local metadata, holds only that process's shards of a sharded tensor: no
    damage, not reported.) Several ranks saved where the save recorded so, or where
    data files come from two ranks or more (what older saves say). The item's chunk
    at offset 0 shares its name: its own verdict is kept after this one, and the item
    is not counted good."""
    if part.rank is not None:
        return
    records = (part.metadata.storage_data or {}).values()
    writers = len({fmt.file_rank(i.relative_path) for i in records})
    if max(fmt.ranks_of(part.metadata) or 0, writers) < 2:
        return
    for fqn, (covered, total) in uncovered(part.metadata).items():
        label = part.label(MetadataIndex(fqn))
        held = (
            "overlap in a way no torch save makes (too irregularly to count what they hold)"
            if covered is None
            else f"cover {covered} of its {total} elements"
        )
        problem = (
            f"its stored chunks {held}, though the ranks that saved it together covered "
            "it whole: the checkpoint is damaged or incomplete (a rank's part missing); "
            "re-save it, or load from another step"
        )
        earlier = report.bad.get(label)
        report.bad[label] = problem if earlier is None else f"{problem}; and {earlier}"
        if label in report.ok:
            report.ok.remove(label)
            if label in report.unchecksummed:
                report.unchecksummed.remove(label)


def _refuse_unbacked_claim(metadata: Metadata, index: MetadataIndex, info: Any) -> None:
    """Refuse, before its scratch tensor is allocated, a chunk claiming more elements
    than its stored bytes could hold (as a load refuses it: ``tensors.unbacked_claim``)."""
    facts = chunk_facts(metadata, index)
    if facts is not None:
        problem = unbacked_claim(fmt.stored_item(info), math.prod(facts[0]))
        if problem is not None:
            raise IntegrityError(f"it {problem}")


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
        for index in _missing(part.metadata):
            report.bad[part.label(index)] = "missing from the storage index"
    lock = threading.Lock()

    def check(part: Part, planner: _ScratchPlanner, index: MetadataIndex, info: Any) -> None:
        label = part.label(index)
        try:
            _refuse_unbacked_claim(part.metadata, index, info)
            plan = LoadPlan([_read_item_for(part.metadata, index)])
            part.reader.read_data(plan, planner).wait()
        except (CheckpointStorageError, OSError, ValueError, KeyError, RuntimeError) as exc:
            with lock:
                report.bad[label] = str(exc) or type(exc).__name__
        else:
            with lock:
                report.ok.append(label)
                if fmt.stored_item(info).crc32c is None:
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
    for part in parts:
        _report_uncovered(part, report)
    report.ok.sort()
    report.unchecksummed.sort()
    return report
