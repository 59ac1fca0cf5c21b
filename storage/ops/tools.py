"""Checkpoint tools behind the CLI: describe, verify and copy (or transcode) a checkpoint.

They work item by item on the stored records, so memory stays bounded: ``describe``
reads only the metadata; ``verify`` decodes each item into a scratch tensor of that
item's size (a few at a time) and drops it; ``copy_checkpoint`` streams each item
from the source to the destination, decoding and re-encoding on the fly when the
transform chain changes. Nothing here unpickles the checkpoint's objects.
"""

from __future__ import annotations

import concurrent.futures
import copy
import math
import re
import threading
import uuid
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from extensions.base import ItemInfo, Keys, cached_key_lookup
from extensions.errors import CheckpointExistsError, CheckpointStorageError, IntegrityError
from extensions.registry import ExtensionRegistry
from extensions.streams import pump, skip
from storage.backends.base import FileSystemBase
from storage.checkpoint import format as fmt
from storage.checkpoint._common import default_thread_count
from storage.checkpoint.commit import metadata_may_name, publish_metadata, remove_quietly
from storage.checkpoint.items import (
    ItemEncoder,
    StoredItem,
    check_before_read,
    encryption_required,
    is_encrypted,
)
from storage.checkpoint.layout import is_committed
from storage.checkpoint.reader import CheckpointReader

Progress = Callable[[int], None]
_RANK_OF_FILE = re.compile(r"__([0-9]+)_")


@dataclass(frozen=True)
class ItemRow:
    """One stored item. ``logical`` is the tensor's bytes (``None`` for an encoded
    non-tensor item, whose plain size is only known by decoding it)."""

    item: str
    shape: tuple[int, ...] | None
    dtype: str | None
    logical: int | None
    stored: int
    transforms: list[str]
    file: str

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


def read_metadata(
    fs: FileSystemBase, path: str, **reader_options: Any
) -> tuple[CheckpointReader, Metadata]:
    """A reader set up on the checkpoint at ``path`` (``reader_options`` go to
    :class:`CheckpointReader`) and its metadata.

    Raises :class:`CheckpointNotFoundError` naming what is missing when ``path`` is not
    a committed checkpoint."""
    reader = CheckpointReader(fs.url(path), filesystem=fs, **reader_options)
    metadata = reader.read_metadata()
    reader.set_up_storage_reader(metadata, True)
    return reader, metadata


def _chunk_facts(metadata: Metadata, index: MetadataIndex) -> tuple[torch.Size, torch.dtype] | None:
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
    """Items of the checkpoint at ``path``, from its metadata alone."""
    _, metadata = read_metadata(fs, path)
    rows = []
    for index, info in (metadata.storage_data or {}).items():
        facts = _chunk_facts(metadata, index)
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
                fmt.item_label(index),
                shape,
                dtype_name,
                logical,
                int(info.length),
                descriptors,
                info.relative_path,
            )
        )
    rows.sort(key=lambda r: r.item)
    files = len({r.file for r in rows})
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
    facts = _chunk_facts(metadata, index)
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
    reader, metadata = read_metadata(
        fs, path, keys=keys, registry=registry, require_encryption=require_encryption
    )
    report = VerifyReport(fs.url(path))
    storage_data = metadata.storage_data or {}
    for fqn, md in metadata.state_dict_metadata.items():
        expected = (
            [MetadataIndex(fqn, c.offsets) for c in md.chunks]
            if isinstance(md, TensorStorageMetadata)
            else [MetadataIndex(fqn)]
            if isinstance(md, BytesStorageMetadata)
            else []
        )
        for index in expected:
            if index not in storage_data:
                report.bad[fmt.item_label(index)] = "missing from the storage index"
    planner = _ScratchPlanner(metadata)
    lock = threading.Lock()

    def check(index: MetadataIndex, info: Any) -> None:
        label = fmt.item_label(index)
        try:
            reader.read_data(LoadPlan([_read_item_for(metadata, index)]), planner).wait()
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

    workers = max(1, thread_count or min(4, default_thread_count(fs)))
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="dcp-verify") as pool:
        for fut in [pool.submit(check, i, s) for i, s in storage_data.items()]:
            fut.result()
    report.ok.sort()
    report.unchecksummed.sort()
    return report


def copy_checkpoint(
    src_fs: FileSystemBase,
    src_path: str,
    dst_fs: FileSystemBase,
    dst_path: str,
    *,
    transforms: Sequence[Any] | None = None,
    overwrite: bool = False,
    keys: Keys | None = None,
    registry: ExtensionRegistry | None = None,
    thread_count: int | None = None,
    progress: Progress | None = None,
    require_encryption: bool | None = None,
) -> Summary:
    """Copy the checkpoint at ``src_path`` to ``dst_path`` (any two backends).

    ``transforms=None`` keeps every item's stored bytes as they are (no keys needed;
    checksums are verified on the way). A list re-encodes every item with that chain
    (``[]`` stores items plain): each is decoded with ``keys``/``registry`` and encoded
    again, streaming, so memory stays at a few buffers per file. The destination is
    committed like a save (data first, metadata last); an existing committed
    checkpoint there is refused unless ``overwrite``, and then replaced only once the
    new metadata lands.

    ``require_encryption=True`` refuses, before anything is written, a source item that
    is not encrypted. The default (``None``) does so when items are re-encoded with
    ``keys`` from a source that holds encrypted items: re-encoding would otherwise seal
    a forged plain item (what a downgrade leaves behind) under a fresh, valid
    encryption. It stays off for a source with no encrypted item at all, since ``keys``
    here also serve the new chain (encrypting a plain checkpoint is a normal copy), and
    for a verbatim copy, which keeps plain items plain for the reader's policy."""
    _, metadata = read_metadata(src_fs, src_path, keys=keys, registry=registry)
    src_url, dst_url = src_fs.url(src_path), dst_fs.url(dst_path)
    key_lookup = cached_key_lookup(keys)
    items = (metadata.storage_data or {}).items()
    required = (
        encryption_required(require_encryption, keys)
        if require_encryption is not None
        else encryption_required(None, keys)
        and transforms is not None
        and any(is_encrypted(info.transform_descriptors or ()) for _, info in items)
    )
    for index, info in items:  # before anything is written
        check_before_read(
            info.transform_descriptors or (),
            _item_info(metadata, index, src_url, key_lookup),
            require_encryption=required,
            decode=transforms is not None,
        )
    if src_url.rstrip("/") == dst_url.rstrip("/"):
        raise ValueError(f"cannot copy {src_url} onto itself; choose another destination")
    if not overwrite and is_committed(dst_fs, dst_path):
        raise CheckpointExistsError(
            f"{dst_url} already holds a committed checkpoint; pass --overwrite "
            "(overwrite=True) to replace it"
        )
    copied = copy_data_files(
        src_fs,
        src_path,
        dst_fs,
        dst_path,
        metadata,
        transforms=transforms,
        keys=keys,
        registry=registry,
        thread_count=thread_count,
        progress=progress,
    )
    publish_copy(dst_fs, dst_path, metadata, [copied], overwrite=overwrite)
    return describe(dst_fs, dst_path)


@dataclass
class CopiedFiles:
    """Data files :func:`copy_data_files` wrote, not yet named by any metadata: their
    names, backend paths and the new storage index of their items."""

    save_id: str
    names: set[str]
    written: list[str]
    infos: dict[MetadataIndex, Any]


def copy_data_files(
    src_fs: FileSystemBase,
    src_path: str,
    dst_fs: FileSystemBase,
    dst_path: str,
    metadata: Metadata,
    *,
    ranks: Collection[int] | None = None,
    transforms: Sequence[Any] | None = None,
    keys: Keys | None = None,
    registry: ExtensionRegistry | None = None,
    thread_count: int | None = None,
    progress: Progress | None = None,
) -> CopiedFiles:
    """The data phase of :func:`copy_checkpoint`: copy the items of the checkpoint at
    ``src_path`` (described by ``metadata``) into new data files under ``dst_path``,
    verifying checksums on the way; nothing is committed. ``ranks`` limits the copy to
    the data files those ranks wrote (``__{rank}_*``), so each rank of a job can copy
    its own files from a node-local tier. On failure, removes what it wrote and raises."""
    src_url = src_fs.url(src_path)
    key_lookup = cached_key_lookup(keys)
    save_id = uuid.uuid4().hex[:12]
    per_file: dict[str, list[tuple[MetadataIndex, Any]]] = {}
    for index, info in (metadata.storage_data or {}).items():
        per_file.setdefault(info.relative_path, []).append((index, info))
    plan = []
    for number, (name, items) in enumerate(sorted(per_file.items())):
        rank = file_rank(name)
        if ranks is None or rank in ranks:
            plan.append((name, fmt.data_file_name(rank, number, save_id), items))
    dst_fs.mkdir(dst_path)
    copied = CopiedFiles(save_id, {name for _, name, _ in plan}, [], {})
    lock = threading.Lock()
    chain = None if transforms is None else list(transforms)

    def copy_file(src_name: str, dst_name: str, items: list[tuple[MetadataIndex, Any]]) -> None:
        items = sorted(items, key=lambda it: int(it[1].offset))
        src_file = src_fs.concat_path(src_path, src_name)
        dst_file = dst_fs.concat_path(dst_path, dst_name)
        with lock:
            copied.written.append(dst_file)
        start = int(items[0][1].offset)
        end = max(int(i.offset) + int(i.length) for _, i in items)
        infos = [_item_info(metadata, index, src_url, key_lookup) for index, _ in items]
        out_offset = 0
        with (
            src_fs.open_slice(src_file, start, end - start) as source,
            dst_fs.create_stream(dst_file, "wb", sync=True) as out,
        ):
            position = start
            for (index, info), item in zip(items, infos):
                _skip(source, int(info.offset) - position, src_url, src_name)
                position = int(info.offset) + int(info.length)
                count, crc, descriptors = _copy_item(source, out, info, item, chain, registry)
                extra = {k: v for k, v in fmt.item_extra(info).items() if k != "crc32c"}
                extra["crc32c"] = crc
                with lock:
                    copied.infos[index] = fmt.new_storage_info(
                        dst_name, out_offset, count, descriptors, extra
                    )
                out_offset += count
                if progress is not None:
                    progress(int(info.length))

    try:
        workers = max(1, min(thread_count or default_thread_count(dst_fs), len(plan) or 1))
        with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="dcp-copy") as pool:
            for fut in [pool.submit(copy_file, *p) for p in plan]:
                fut.result()
    except BaseException:
        remove_quietly(dst_fs, copied.written)
        raise
    return copied


def publish_copy(
    dst_fs: FileSystemBase,
    dst_path: str,
    metadata: Metadata,
    copies: Sequence[CopiedFiles],
    *,
    overwrite: bool,
) -> None:
    """The commit phase of :func:`copy_checkpoint`: publish ``metadata`` over the data
    files of ``copies`` (every rank's part of one copy) under ``dst_path``. On failure,
    removes those files unless the metadata may have landed, and raises."""
    meta_path = dst_fs.concat_path(dst_path, fmt.METADATA_NAME)
    save_id = copies[0].save_id if copies else uuid.uuid4().hex[:12]
    new_meta = copy.copy(metadata)
    new_meta.storage_data = {i: info for c in copies for i, info in c.infos.items()}
    new_meta.storage_meta = StorageMeta(checkpoint_id=dst_fs.url(dst_path), save_id=save_id)
    try:
        publish_metadata(
            dst_fs,
            dst_path,
            meta_path,
            fmt.dump_metadata(new_meta),
            new_files={n for c in copies for n in c.names},
            overwrite=overwrite,
            sync=True,
        )
    except BaseException:
        if not metadata_may_name(dst_fs, meta_path, save_id):
            remove_quietly(dst_fs, [p for c in copies for p in c.written])
        raise


def file_rank(name: str) -> int:
    """The rank that wrote the data file ``name`` (``__{rank}_{n}...``; 0 if unnamed)."""
    match = _RANK_OF_FILE.match(name)
    return int(match.group(1)) if match else 0


def _item_info(metadata: Metadata, index: MetadataIndex, url: str, keys: Any) -> ItemInfo:
    facts = _chunk_facts(metadata, index)
    return ItemInfo(
        checkpoint=url,
        item=fmt.item_label(index),
        dtype=_dtype_name(facts[1]) if facts else None,
        element_size=facts[1].itemsize if facts else None,
        keys=keys,
    )


def _skip(source: IO[bytes], n: int, url: str, name: str) -> None:
    if n < 0:
        raise IntegrityError(f"{url}: items in {name!r} overlap; the metadata is damaged")
    skip(source, n)


def _copy_item(
    source: IO[bytes],
    out: IO[bytes],
    info: Any,
    item: ItemInfo,
    chain: list[Any] | None,
    registry: ExtensionRegistry | None,
) -> tuple[int, int, list[str]]:
    """Stream one stored item into ``out`` (as stored when ``chain`` is None, else
    decoded and encoded with ``chain``); returns (stored length, crc32c, descriptors)."""
    stored = StoredItem(
        source,
        int(info.length),
        info.transform_descriptors or (),
        fmt.item_extra(info).get("crc32c"),
        f"{item.checkpoint}: item {item.item!r}",
    )
    try:
        if chain is None:
            encoder = ItemEncoder(out, [], item)
            pump(stored.raw, encoder.plain)
        else:
            encoder = ItemEncoder(out, chain, item)
            pump(stored.decoded(registry or ExtensionRegistry(), item), encoder.plain)
        count, crc = encoder.close()
        stored.finish()
    except (CheckpointStorageError, OSError):
        raise  # already named, or the storage failed (not the bytes)
    except Exception as exc:
        raise stored.damaged(exc) from exc
    return count, crc, stored.descriptors if chain is None else encoder.descriptors
