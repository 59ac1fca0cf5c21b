"""Copy (or transcode) a checkpoint between any two locations, item by item.

Each item streams from the source to the destination through the same item code the
writer and the reader use (``storage.checkpoint.items``), decoded and re-encoded on the
fly when the transform chain changes, so memory stays at a few buffers per file. The
destination is committed like a save: data first, metadata last.
"""

from __future__ import annotations

import concurrent.futures
import copy
import io
import threading
import uuid
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import IO, Any, cast

from torch.distributed.checkpoint.metadata import MetadataIndex, StorageMeta

from extensions.base import ItemInfo, Keys, cached_key_lookup
from extensions.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointStorageError,
    IntegrityError,
    quote,
)
from extensions.registry import ExtensionRegistry
from extensions.streams import pump, skip
from storage.backends.base import FileSystemBase
from storage.checkpoint import format as fmt
from storage.checkpoint._common import default_thread_count
from storage.checkpoint.commit import metadata_may_name, publish_metadata, remove_quietly
from storage.checkpoint.committed import open_committed
from storage.checkpoint.incremental import (
    CONTENT,
    check_bases,
    check_referenced_files,
    item_directory,
    item_path,
    sibling_path,
)
from storage.checkpoint.items import (
    ItemEncoder,
    StoredItem,
    check_before_read,
    encryption_required,
)
from storage.checkpoint.layout import metadata_names
from storage.checkpoint.prefixes import refuse_linked_prefix, split
from storage.ops.tools import Part, Progress, Summary, chunk_facts, describe, read_metadata


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
    parts = read_metadata(src_fs, src_path, keys=keys, registry=registry)
    src_url, dst_url = src_fs.url(src_path), dst_fs.url(dst_path)
    key_lookup = cached_key_lookup(keys)
    known = registry or ExtensionRegistry()
    stored = [
        (part, index, info)
        for part in parts
        for index, info in (part.metadata.storage_data or {}).items()
    ]
    required = (
        encryption_required(require_encryption, keys)
        if require_encryption is not None
        else encryption_required(None, keys)
        and transforms is not None
        and any(known.authenticated(info.transform_descriptors or ()) for _, _, info in stored)
    )
    for part, index, info in stored:  # before anything is written
        check_before_read(
            info.transform_descriptors or (),
            _item_info(part, index, src_url, key_lookup),
            known,
            require_encryption=required,
            decode=transforms is not None,
        )
    if src_url.rstrip("/") == dst_url.rstrip("/"):
        raise ValueError(f"cannot copy {src_url} onto itself; choose another destination")
    existing = metadata_names(dst_fs, dst_path)
    if existing and not overwrite:
        raise CheckpointExistsError(
            f"{dst_url} already holds a committed checkpoint; pass --overwrite "
            "(overwrite=True) to replace it"
        )
    if existing and set(existing) != {part.name for part in parts}:
        # Publishing ours would leave its metadata in place, still winning or lingering.
        raise CheckpointExistsError(
            f"{dst_url} holds a checkpoint committed by {', '.join(existing)}, which a copy "
            f"committed by {', '.join(p.name for p in parts)} cannot replace; remove it "
            "first (dcp-storage rm)"
        )
    save_id = uuid.uuid4().hex[:12]
    copies: list[CopiedFiles] = []
    try:
        for part in parts:
            first = sum(len(c.names) for c in copies)
            copies.append(
                copy_data_files(
                    src_fs,
                    src_path,
                    dst_fs,
                    dst_path,
                    part,
                    transforms=transforms,
                    keys=keys,
                    registry=registry,
                    thread_count=thread_count,
                    progress=progress,
                    save_id=save_id,
                    first=first,
                )
            )
        for part, copied in zip(parts, copies):
            publish_copy(dst_fs, dst_path, part, [copied], overwrite=overwrite)
    except BaseException:
        meta_paths = [dst_fs.concat_path(dst_path, part.name) for part in parts]
        if not any(metadata_may_name(dst_fs, m, save_id) for m in meta_paths):
            remove_quietly(dst_fs, [p for c in copies for p in c.written])
        raise
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
    part: Part,
    *,
    ranks: Collection[int] | None = None,
    transforms: Sequence[Any] | None = None,
    keys: Keys | None = None,
    registry: ExtensionRegistry | None = None,
    thread_count: int | None = None,
    progress: Progress | None = None,
    save_id: str | None = None,
    first: int = 0,
    pace: Callable[[], object] | None = None,
    keep_references: bool = False,
) -> CopiedFiles:
    """The data phase of :func:`copy_checkpoint`: copy the items that ``part`` (one
    metadata of the checkpoint at ``src_path``) names into new data files under
    ``dst_path`` (under the key prefix directory each source file had), verifying
    checksums on the way; nothing is committed. Referenced items
    (incremental saves) are read from their base, so the copy holds every byte it
    needs, unless ``keep_references``: then an item that references a base is
    recorded as a reference to the base of the same name beside ``dst_path`` when that
    one is committed and holds the same stored bytes there (same index, transform
    chain, length and checksum), and only copied otherwise, so a copy of an
    incremental checkpoint made after its bases' copies stays incremental. ``ranks``
    limits the copy to the data files those ranks wrote
    (``__{rank}_*``), so each rank of a job can copy its own files from a node-local
    tier; new files are numbered from ``first``. ``pace``, when given, is called before
    each read of the source (at most ``streams.CHUNK`` bytes apart) and may block: a
    background copy pauses there while something more urgent runs. On failure, removes
    what it wrote."""
    src_url = src_fs.url(src_path)
    key_lookup = cached_key_lookup(keys)
    copied = CopiedFiles(save_id or uuid.uuid4().hex[:12], set(), [], {})
    infos = list((part.metadata.storage_data or {}).items())
    if keep_references:
        kept = _kept_references(dst_fs, dst_path, infos)
        for index, info in infos:
            if index in kept and (ranks is None or _owner(part, info) in ranks):
                copied.infos[index] = kept[index]
        infos = [(index, info) for index, info in infos if index not in kept]
    check_bases(src_fs, src_path, ((part.label(i), info) for i, info in infos))
    per_file: dict[str, list[tuple[MetadataIndex, Any]]] = {}
    for index, info in infos:
        src_file = item_path(src_fs, src_path, info)
        if src_file not in per_file:  # never read through a linked prefix directory
            directory = item_directory(src_fs, src_path, info)
            refuse_linked_prefix(src_fs, directory, info.relative_path)
        per_file.setdefault(src_file, []).append((index, info))
    plan: list[tuple[str, str, list[tuple[MetadataIndex, Any]]]] = []
    for number, (src_file, items_of) in enumerate(sorted(per_file.items()), start=first):
        rank = _owner(part, items_of[0][1])
        if ranks is None or rank in ranks:
            name = fmt.data_file_name(rank, number, copied.save_id)
            prefix, _ = split(items_of[0][1].relative_path)  # key prefixes stay as saved
            plan.append((src_file, name if prefix is None else f"{prefix}/{name}", items_of))
    copied.names = {name for _, name, _ in plan}
    dst_fs.mkdir(dst_path)
    lock = threading.Lock()
    chain = None if transforms is None else list(transforms)

    def copy_file(src_file: str, dst_name: str, items: list[tuple[MetadataIndex, Any]]) -> None:
        items = sorted(items, key=lambda it: int(it[1].offset))
        src_name = items[0][1].relative_path
        dst_file = dst_fs.concat_path(dst_path, dst_name)
        with lock:
            copied.written.append(dst_file)
        start = int(items[0][1].offset)
        end = max(int(i.offset) + int(i.length) for _, i in items)
        item_infos = [_item_info(part, index, src_url, key_lookup) for index, _ in items]
        out_offset = 0
        with (
            src_fs.open_slice(src_file, start, end - start) as opened,
            dst_fs.create_stream(dst_file, "wb", sync=True) as out,
        ):
            source = opened if pace is None else cast(IO[bytes], _Paced(opened, pace))
            position = start
            for (index, info), item in zip(items, item_infos):
                _skip(source, int(info.offset) - position, src_url, src_name)
                position = int(info.offset) + int(info.length)
                count, crc, descriptors = _copy_item(source, out, info, item, chain, registry)
                dropped = ("crc32c", fmt.REF) if chain is None else ("crc32c", fmt.REF, CONTENT)
                extra = {k: v for k, v in fmt.item_extra(info).items() if k not in dropped}
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


def _owner(part: Part, info: Any) -> int:
    return part.rank if part.rank is not None else fmt.file_rank(info.relative_path)


def _kept_references(
    dst_fs: FileSystemBase, dst_path: str, infos: Sequence[tuple[MetadataIndex, Any]]
) -> dict[MetadataIndex, Any]:
    """For the items of ``infos`` that reference a base: the storage info referencing
    the destination's sibling of that name, where it is committed and holds the same
    stored bytes (see :func:`copy_data_files`)."""
    bases: dict[str, dict[MetadataIndex, Any]] = {}
    kept: dict[MetadataIndex, Any] = {}
    for index, info in infos:
        extra = fmt.item_extra(info)
        ref = extra.get(fmt.REF)
        if ref is None or extra.get("crc32c") is None:
            continue
        if ref not in bases:
            bases[ref] = _committed_items(dst_fs, dst_path, ref)
        theirs = bases[ref].get(index)
        if theirs is None:
            continue
        their_extra = fmt.item_extra(theirs)
        descriptors = list(info.transform_descriptors or [])
        if (
            list(theirs.transform_descriptors or []) != descriptors
            or int(theirs.length) != int(info.length)
            or their_extra.get("crc32c") != extra["crc32c"]
        ):
            continue
        kept[index] = fmt.new_storage_info(
            theirs.relative_path,
            theirs.offset,
            theirs.length,
            descriptors,
            dict(their_extra, ref=their_extra.get(fmt.REF, ref)),
        )
    return kept


def _committed_items(fs: FileSystemBase, path: str, name: str) -> dict[MetadataIndex, Any]:
    """The storage index of the committed checkpoint ``name`` beside ``path`` (empty
    when there is none, or it cannot be read: its items are then copied, not kept as
    references)."""
    try:
        base = sibling_path(fs, path, name)
    except CheckpointNotFoundError:
        return {}
    return open_committed(fs, base).items()


def publish_copy(
    dst_fs: FileSystemBase,
    dst_path: str,
    part: Part,
    copies: Sequence[CopiedFiles],
    *,
    overwrite: bool,
) -> None:
    """The commit phase of :func:`copy_checkpoint`: publish ``part``'s metadata over the
    data files of ``copies`` (every rank's share of one copy) under ``dst_path``. On
    failure, removes those files unless the metadata may have landed, and raises."""
    meta_path = dst_fs.concat_path(dst_path, part.name)
    save_id = copies[0].save_id if copies else uuid.uuid4().hex[:12]
    new_meta = copy.copy(part.metadata)
    new_meta.storage_data = {i: info for c in copies for i, info in c.infos.items()}
    new_meta.storage_meta = StorageMeta(checkpoint_id=dst_fs.url(dst_path), save_id=save_id)
    origin = fmt.save_of(part.metadata)  # the copy holds the same save's state
    try:
        check_referenced_files(dst_fs, dst_path, new_meta.storage_data.values())
        publish_metadata(
            dst_fs,
            dst_path,
            meta_path,
            fmt.dump_metadata(new_meta, **({} if origin is None else {fmt.ORIGIN: origin})),
            new_files={n for c in copies for n in c.names},
            overwrite=overwrite,
            sync=True,
        )
    except BaseException:
        if not metadata_may_name(dst_fs, meta_path, save_id):
            remove_quietly(dst_fs, [p for c in copies for p in c.written])
        raise


class _Paced(io.RawIOBase):
    """``base``, calling ``pace()`` before each read."""

    def __init__(self, base: IO[bytes], pace: Callable[[], object]) -> None:
        super().__init__()
        self._base = base
        self._pace = pace

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        self._pace()
        return self._base.readinto(buffer) or 0  # type: ignore[attr-defined]


def _item_info(part: Part, index: MetadataIndex, url: str, keys: Any) -> ItemInfo:
    facts = chunk_facts(part.metadata, index)
    return ItemInfo(
        checkpoint=url,
        item=part.label(index),
        dtype=str(facts[1]).removeprefix("torch.") if facts else None,
        element_size=facts[1].itemsize if facts else None,
        keys=keys,
    )


def _skip(source: IO[bytes], n: int, url: str, name: str) -> None:
    if n < 0:
        raise IntegrityError(f"{url}: items in {quote(name)} overlap; the metadata is damaged")
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
        f"{item.checkpoint}: item {quote(item.item)}",
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
