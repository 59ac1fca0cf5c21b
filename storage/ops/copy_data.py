"""The data phase of a copy: a checkpoint's items streamed into new data files.

Each item streams from the source file to the destination through the same item code the
writer and the reader use (``storage.checkpoint.items``), kept as stored or decoded and
re-encoded on the fly when the transform chain changes, so memory stays at a few buffers
per file; its checksum is verified on the way. Nothing here commits: the files written
are handed back (:class:`CopiedFiles`) for the caller's
``storage.checkpoint.attempt.SaveAttempt`` to adopt and
``storage.ops.copy.publish_copy`` to commit. The tier drain runs :func:`copy_data_files`
in the persist worker process, which imports it by name.
"""

from __future__ import annotations

import concurrent.futures
import functools
import io
import threading
import uuid
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace
from typing import IO, Any, cast

from torch.distributed.checkpoint.metadata import MetadataIndex

from extensions.base import ItemInfo, Keys, cached_key_lookup
from extensions.errors import (
    CheckpointNotFoundError,
    CheckpointStorageError,
    IntegrityError,
    UnsafeCheckpointError,
    quote,
)
from extensions.registry import ExtensionRegistry
from extensions.streams import pump, skip
from storage.backends.base import FileSystemBase
from storage.checkpoint import heartbeat
from storage.checkpoint import storage_format as fmt
from storage.checkpoint.attempt import SaveAttempt
from storage.checkpoint.committed import open_committed
from storage.checkpoint.data_files import recorded_save
from storage.checkpoint.decode import MAX_OBJECT_BYTES, backed_value, plain_limit
from storage.checkpoint.incremental import (
    check_bases,
    item_directory,
    item_path,
    sibling_path,
    sibling_url,
)
from storage.checkpoint.items import ItemEncoder, StoredItemReader
from storage.checkpoint.layout import make_directory
from storage.checkpoint.options import default_thread_count
from storage.checkpoint.prefixes import refuse_linked_prefix, split
from storage.ops.parts import Part, Progress, chunk_facts


@dataclass
class CopiedFiles:
    """Data files :func:`copy_data_files` wrote, not yet named by any metadata: their
    names (relative to the destination) and the new storage index of their items."""

    save_id: str
    names: set[str]
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
    checksums on the way; nothing is committed. Referenced items (incremental saves) are
    read from their base, so the copy holds every byte it needs, unless
    ``keep_references``: then an item that references a base is recorded as a reference
    to the base of the same name beside ``dst_path`` when that one is committed, not a
    symbolic link, and holds the same stored bytes there (same index, transform chain,
    length and checksum, and the same content fingerprint where the item records one),
    and only copied otherwise, so a copy of an incremental checkpoint made after its
    bases' copies stays incremental. ``ranks`` limits the copy to the data files those
    ranks wrote (``__{rank}_*``), so each rank of a job can copy its own files from a
    node-local tier; new files are numbered from ``first``. ``pace``, when given, is
    called before each read of the source (at most ``streams.CHUNK`` bytes apart) and
    may block: a background copy pauses there while something more urgent runs. It
    writes under a heartbeat named by the save id (``heartbeat.beating``), so ``gc``
    leaves its uploads alone. Each file is recorded in a ``SaveAttempt`` before it
    opens; on failure, that removes what it wrote. A process killed meanwhile leaves
    files named with the save id, which no metadata names: the caller's attempt
    (``SaveAttempt.lost``) or ``gc`` removes them."""
    copied = CopiedFiles(save_id or uuid.uuid4().hex[:12], set(), {})
    attempt = SaveAttempt(dst_fs, dst_path, copied.save_id)
    infos = list((part.metadata.storage_data or {}).items())
    if keep_references:
        kept = _kept_references(dst_fs, dst_path, infos)
        for index, info in infos:
            if index in kept and (ranks is None or _owner(part, info) in ranks):
                copied.infos[index] = kept[index]
        infos = [(index, info) for index, info in infos if index not in kept]
    check_bases(src_fs, src_path, ((part.label(i), info) for i, info in infos))
    plan = _plan(src_fs, src_path, part, infos, ranks, first, copied.save_id)
    copied.names = {name for _, name, _ in plan}
    make_directory(dst_fs, dst_path)
    files = _FileCopy(src_fs, src_path, attempt, part, copied, transforms, keys)
    files.registry, files.progress, files.pace = registry, progress, pace
    workers = max(1, min(thread_count or default_thread_count(dst_fs), len(plan) or 1))
    try:
        with (
            heartbeat.beating(dst_fs, dst_path, copied.save_id, home=attempt.home),
            concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="dcp-copy") as pool,
        ):
            for fut in [pool.submit(files.copy, *p) for p in plan]:
                fut.result()
    except BaseException:
        attempt.abort()
        raise
    return copied


Items = list[tuple[MetadataIndex, Any]]


def _plan(
    src_fs: FileSystemBase,
    src_path: str,
    part: Part,
    infos: Items,
    ranks: Collection[int] | None,
    first: int,
    save_id: str,
) -> list[tuple[str, str, Items]]:
    """(source file, new data file name, its items) for each source file that one of
    ``ranks`` wrote, numbered from ``first``; each under the key prefix directory its
    source file had. Never reads through a linked prefix directory."""
    per_file: dict[str, Items] = {}
    for index, info in infos:
        src_file = item_path(src_fs, src_path, info)
        if src_file not in per_file:
            directory = item_directory(src_fs, src_path, info)
            refuse_linked_prefix(src_fs, directory, info.relative_path)
        per_file.setdefault(src_file, []).append((index, info))
    plan = []
    for number, (src_file, items_of) in enumerate(sorted(per_file.items()), start=first):
        rank = _owner(part, items_of[0][1])
        if ranks is None or rank in ranks:
            name = fmt.data_file_name(rank, number, save_id)
            prefix, _ = split(items_of[0][1].relative_path)  # key prefixes stay as saved
            plan.append((src_file, name if prefix is None else f"{prefix}/{name}", items_of))
    return plan


class _FileCopy:
    """Copies one source file's items into one new data file (:meth:`copy`, called
    from several threads), recording each item's new storage info in ``copied``."""

    registry: ExtensionRegistry | None = None
    progress: Progress | None = None
    pace: Callable[[], object] | None = None

    def __init__(
        self,
        src_fs: FileSystemBase,
        src_path: str,
        attempt: SaveAttempt,
        part: Part,
        copied: CopiedFiles,
        transforms: Sequence[Any] | None,
        keys: Keys | None,
    ) -> None:
        self.src_fs, self.src_path, self.src_url = src_fs, src_path, src_fs.url(src_path)
        self.attempt, self.dst_fs = attempt, attempt.fs
        self.part, self.copied = part, copied
        self.chain = None if transforms is None else list(transforms)
        # A transcoded item is written by this copy, bound to it where the chain binds.
        self.save = None if self.chain is None else recorded_save(self.chain, attempt.save_id)
        self.keys = cached_key_lookup(keys)
        self.lock = threading.Lock()

    def copy(self, src_file: str, dst_name: str, items: Items) -> None:
        try:
            self._copy(src_file, dst_name, items)
        except FileNotFoundError as exc:
            if isinstance(exc, CheckpointStorageError) or self.src_fs.exists(src_file):
                raise  # ours says what is missing; else not the source's file
            first, info = min(items, key=lambda it: int(it[1].offset))
            ref = fmt.stored_item(info).ref  # the file is a base's: say which
            base = None if ref is None else sibling_url(self.src_fs, self.src_path, ref)
            where = "" if base is None else f" of its base {base}"
            raise CheckpointNotFoundError(
                f"{self.src_url}: data file {quote(src_file.rpartition('/')[2])}{where} (item "
                f"{quote(fmt.item_label(first))}) is missing; the checkpoint is incomplete: "
                "restore the file or re-save the checkpoint"
            ) from exc

    def _copy(self, src_file: str, dst_name: str, items: Items) -> None:
        items = sorted(items, key=lambda it: int(it[1].offset))
        src_url, src_name = self.src_url, items[0][1].relative_path
        self.attempt.record(dst_name)  # before its stream opens
        start = int(items[0][1].offset)
        end = max(int(i.offset) + int(i.length) for _, i in items)
        item_infos = [self.part.item_info(index, src_url, self.keys) for index, _ in items]
        out_offset = 0
        with (
            self.src_fs.open_slice(src_file, start, end - start) as opened,
            self.dst_fs.create_stream_in(self.attempt.home, dst_name, "wb", sync=True) as out,
        ):
            pace = self.pace
            source = opened if pace is None else cast(IO[bytes], _Paced(opened, pace))
            position = start
            for (index, info), item in zip(items, item_infos):
                _skip(source, int(info.offset) - position, src_url, src_name)
                position = int(info.offset) + int(info.length)
                facts = chunk_facts(self.part.metadata, index)
                stored, limit = source, plain_limit(facts, int(info.length))
                if facts is None and self.chain is not None:
                    # What a load allows the value: past the floor, by the stored
                    # bytes that arrive (a transcoding copy never writes out more).
                    stored, limit = backed_value(source, int(info.length), MAX_OBJECT_BYTES)
                count, crc, descriptors = _copy_item(
                    stored, out, info, item, self.chain, self.registry, limit, self.save
                )
                self._record(index, info, dst_name, out_offset, count, crc, descriptors)
                out_offset += count
                if self.progress is not None:
                    self.progress(int(info.length))

    def _record(
        self,
        index: MetadataIndex,
        info: Any,
        dst_name: str,
        offset: int,
        count: int,
        crc: int,
        descriptors: list[str],
    ) -> None:
        # Copied into DST: its own bytes (no reference); transcoded, a new fingerprint.
        record = fmt.stored_item(info)
        content = record.content if self.chain is None else None
        copied = replace(
            record,
            relative_path=dst_name,
            offset=offset,
            length=count,
            descriptors=tuple(descriptors),
            crc32c=crc,
            ref=None,
            content=content,
            save=record.save if self.chain is None else self.save,
        )
        with self.lock:
            self.copied.infos[index] = fmt.new_storage_info(copied)


def stored_bytes(
    part: Part, ranks: Collection[int] | None = None, *, references: bool = True
) -> int:
    """The stored bytes of the items ``part`` names in the data files of ``ranks``
    (every rank's: ``None``): what :func:`copy_data_files` reads at most. Without
    ``references``, only the items stored in the checkpoint itself: what a copy with
    ``keep_references`` writes where every base is already at the destination."""
    infos = (part.metadata.storage_data or {}).values()
    return sum(
        info.length
        for info in infos
        if (ranks is None or _owner(part, info) in ranks)
        and (references or fmt.stored_item(info).ref is None)
    )


def _owner(part: Part, info: Any) -> int:
    return part.rank if part.rank is not None else fmt.file_rank(info.relative_path)


def _kept_references(
    dst_fs: FileSystemBase, dst_path: str, infos: Sequence[tuple[MetadataIndex, Any]]
) -> dict[MetadataIndex, Any]:
    """For the items of ``infos`` that reference a base: the storage info referencing
    the destination's sibling of that name, where it is committed and holds the same
    stored bytes (see :func:`copy_data_files`). Never a reference into a sibling that
    is a symbolic link (a checkpoint from elsewhere, whose owner may replace or delete
    it): those bytes are copied."""
    bases: dict[str, dict[MetadataIndex, Any]] = {}
    linked = functools.cache(lambda name: _linked_sibling(dst_fs, dst_path, name))
    kept: dict[MetadataIndex, Any] = {}
    for index, info in infos:
        record = fmt.stored_item(info)
        ref = record.ref
        if ref is None or record.crc32c is None:
            continue
        if ref not in bases:
            # empty where there is none, or unreadable: its items are then copied
            base = None if linked(ref) else sibling_path(dst_fs, dst_path, ref)
            bases[ref] = {} if base is None else open_committed(dst_fs, base).items()
        theirs = bases[ref].get(index)
        if theirs is None:
            continue
        their = fmt.stored_item(theirs)
        if (
            their.descriptors != record.descriptors
            or their.length != record.length
            or their.crc32c != record.crc32c
            or (record.content is not None and their.content != record.content)
            or (their.ref is not None and linked(their.ref))
        ):
            continue
        kept[index] = fmt.new_storage_info(replace(their, ref=their.ref or ref))
    return kept


def _linked_sibling(fs: FileSystemBase, path: str, name: str) -> bool:
    """Whether the checkpoint ``name`` beside ``path`` is a symbolic link (or there can
    be none: nothing to reference either)."""
    try:
        return fs.is_link(sibling_path(fs, path, name))
    except CheckpointNotFoundError:
        return True


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
    limit: int,
    save: str | None,
) -> tuple[int, int, list[str]]:
    """Stream one stored item into ``out`` (as stored when ``chain`` is None, else
    decoded, at most ``limit`` plain bytes, and encoded with ``chain`` as an item of
    the save ``save``); returns (stored length, crc32c, descriptors)."""
    stored = StoredItemReader(
        source,
        int(info.length),
        info.transform_descriptors or (),
        fmt.stored_item(info).crc32c,
        f"{item.checkpoint}: item {quote(item.item)}",
    )
    try:
        if chain is None:
            encoder = ItemEncoder(out, [], item)
            pump(stored.raw, encoder.plain)
        else:
            encoder = ItemEncoder(out, chain, replace(item, save=save))
            decoded = stored.decoded(
                registry or ExtensionRegistry(), replace(item, plain_bytes=limit)
            )
            if pump(decoded, encoder.plain, limit=limit + 1) > limit:
                raise UnsafeCheckpointError(
                    f"{stored.where}: the item decodes to more than {limit} bytes, more than "
                    "its chunk (or a value of its stored size) holds and any load accepts (a "
                    "decompression bomb?); refusing to copy it: restore it from a good copy"
                )
        count, crc = encoder.close()
        stored.finish()
    except (CheckpointStorageError, OSError):
        raise  # already named, or the storage failed (not the bytes)
    except Exception as exc:
        raise stored.damaged(exc) from exc
    return count, crc, stored.descriptors if chain is None else encoder.descriptors
