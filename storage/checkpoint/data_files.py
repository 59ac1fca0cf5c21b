"""A save's data files: the items split into files (:func:`split_into_files`), then
written on the writer's threads (:func:`write_files`), each item encoded through the
transform chain with its checksum and, for incremental saves, its content fingerprint,
taken on the thread that writes the item, just before it does (an item whose base holds
the same content is referenced instead, and a file none of whose items is written is
never created).
``CheckpointWriter.write_files`` runs this, in the training process or in the persist
worker with the staged data, for the save's :class:`~storage.checkpoint.attempt.SaveAttempt`
(which records every file before it opens and removes them when the save fails) with the
writer's :class:`FileSettings`."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from extensions._compat import item_size
from extensions.base import ItemInfo
from extensions.registry import chain_descriptors, chain_seal_keys
from storage.checkpoint import heartbeat, incremental, savable
from storage.checkpoint import storage_format as fmt
from storage.checkpoint.attempt import SaveAttempt
from storage.checkpoint.deadline import cancellable, note
from storage.checkpoint.encode import encode_item, plain_cpu_tensor
from storage.checkpoint.prefixes import place, refuse_linked_prefix

#: Tensor bytes per writing thread, at least: more threads than this allows do not pay.
BYTES_PER_THREAD = 32 << 20
#: Items below this many bytes cost mostly their per-item work (torch.save's archive,
#: records), which holds the GIL: they share one file, written on one thread.
SMALL_ITEM = 1 << 20
#: What the per-item work of one item costs, in bytes written (~170 us per item on one
#: thread, where a thread writes ~1.5 GB/s): the weight of an item in the split.
ITEM_COST = 256 << 10


@dataclasses.dataclass(frozen=True)
class FileSettings:
    """What writing a save's data files needs of its writer: the transform chain, the
    rank writing, whether each file is made durable, whether each item records its
    content fingerprint (``fingerprint``) and the base whose items of the same content
    and chain are referenced instead of written (``base``)."""

    transforms: Sequence[Any]
    rank: int
    sync: bool
    fingerprint: bool = False
    base: incremental.Base | None = None
    #: The save id each item records and its transforms bind (``recorded_save``).
    save: str | None = None


def recorded_save(transforms: Sequence[Any], save_id: str) -> str | None:
    """The save id items written with ``transforms`` in save ``save_id`` record and are
    bound to (``ItemInfo.save``): ``save_id`` when a stage of the chain seals the
    metadata (AES-256-GCM with a key), else ``None`` (nothing would check it)."""
    return save_id if chain_seal_keys(transforms, ItemInfo(save=save_id)) else None


def split_into_files(
    items: list[WriteItem],
    *,
    rank: int,
    save_id: str,
    thread_count: int,
    single_file_per_rank: bool,
    key_prefixes: int,
) -> tuple[list[tuple[str, list[WriteItem]]], int]:
    """``items`` as (data file name, its items), and the threads to write them on."""
    # Per-item work (pickling, torch.save's archive) holds the GIL: parallel files pay
    # off only with enough bytes per thread to overlap I/O and compression.
    total = sum(item_size(i) for i in items if i.type != WriteItemType.BYTE_IO)
    threads = max(1, min(thread_count, total // BYTES_PER_THREAD))
    if single_file_per_rank:
        buckets = [b for b in _split(threads, items) if b]
    else:
        buckets = [[item] for item in items]
    files = [
        (place(fmt.data_file_name(rank, n, save_id), rank, key_prefixes), b)
        for n, b in enumerate(buckets)
    ]
    return files, threads


def _split(bins: int, items: list[WriteItem]) -> list[list[WriteItem]]:
    """``items`` in ``bins`` files of about equal cost (bytes, plus :data:`ITEM_COST` per
    item), the small ones and opaque values all in the first: spread over files, their
    per-item work ran on threads that only took the GIL from each other (20,000 items of
    4 KB saved 40% slower on 4 threads than on one)."""
    small = [i for i in items if i.type == WriteItemType.BYTE_IO or item_size(i) < SMALL_ITEM]
    large = sorted(
        (i for i in items if i.type != WriteItemType.BYTE_IO and item_size(i) >= SMALL_ITEM),
        key=item_size,
        reverse=True,
    )
    buckets: list[list[WriteItem]] = [small] + [[] for _ in range(bins - 1)]
    costs = [
        len(small) * ITEM_COST + sum(item_size(i) for i in small if i.type != WriteItemType.BYTE_IO)
    ]
    costs += [0] * (bins - 1)
    for item in large:
        cheapest = min(range(bins), key=costs.__getitem__)
        buckets[cheapest].append(item)
        costs[cheapest] += item_size(item) + ITEM_COST
    return buckets


def write_files(
    attempt: SaveAttempt,
    settings: FileSettings,
    files: list[tuple[str, list[WriteItem]]],
    threads: int,
    planner: Any,
) -> list[list[WriteResult]]:
    """Write ``files`` (name, items) on up to ``threads`` threads with the data
    ``planner.resolve_data`` gives, each recorded in ``attempt`` before it opens, under
    a heartbeat (``heartbeat.beating``: ``gc`` leaves this save's uploads and files
    alone while it writes); on failure remove what was written (``attempt.abort``:
    past the deadline, in the background) and raise. An incremental save passes every
    item: each file's thread fingerprints its items and writes those its base does
    not hold, so one thread's writes overlap the others' fingerprints."""
    fs, url = attempt.fs, attempt.url
    token = heartbeat_token(attempt.save_id, settings.rank)
    marker = fs.url(fs.concat_path(attempt.path, heartbeat.name_of(token)))

    def guard(request: Callable[[], None]) -> None:
        item = heartbeat.name_of(token)
        attempt.budget.call(request, action="saving", location=url, item=item, url=marker)

    tasks = [
        functools.partial(_write_file, attempt, settings, name, items, planner)
        for name, items in files
    ]
    try:
        with heartbeat.beating(fs, attempt.path, token, guard=guard, home=attempt.home):
            per_file = attempt.budget.run(tasks, workers=threads, action="saving", location=url)
    except BaseException:
        attempt.abort()
        raise
    return per_file


def heartbeat_token(save_id: str, rank: int) -> str:
    """The token of ``rank``'s heartbeat in save ``save_id`` (known to the training
    process too, which records it for removal before the persist worker writes)."""
    return f"{save_id}r{rank}"


def _write_file(
    attempt: SaveAttempt,
    settings: FileSettings,
    name: str,
    items: list[WriteItem],
    planner: SavePlanner,
) -> list[WriteResult]:
    """Write the file ``name`` of ``items`` (those the base holds referenced instead),
    opened at its first item to write: recorded in ``attempt`` first, in the checkpoint
    directory as resolved when the save began, never through a link swapped in since
    (``refuse_linked_prefix``, ``create_stream_in``). A write that fails for want of
    room names the file (the backend's doing)."""
    # Opaque bytes first, then tensors (largest first), as torch orders them.
    ordered = [i for i in items if i.type == WriteItemType.BYTE_IO] + [
        i for i in items if i.type != WriteItemType.BYTE_IO
    ]
    results = []
    fs = attempt.fs
    url = fs.url(fs.concat_path(attempt.path, name))
    checkpoint = attempt.url  # once: it resolves the path through the backend
    with contextlib.ExitStack() as stack:
        stream: Any = None
        offset = 0
        for item in ordered:
            note(fmt.item_label(item.index), url)
            item_data = _Item(checkpoint, settings, item, planner)
            referenced = item_data.reference()
            if referenced is not None:
                results.append(referenced)
                continue
            if stream is None:
                refuse_linked_prefix(fs, attempt.path, name)
                attempt.record(name)
                opened = fs.create_stream_in(attempt.home, name, "wb", sync=settings.sync)
                stream = cancellable(stack.enter_context(opened))
            result = item_data.write(stream, name, offset)
            offset += result.storage_data.length
            results.append(result)
    return results


def item_info(url: str, item: WriteItem, tensor: torch.Tensor | None, save: str | None) -> ItemInfo:
    """What the transforms are told of ``item`` (of the checkpoint at ``url``, written
    by save ``save`` when its chain binds items to their save)."""
    return ItemInfo(
        checkpoint=url,
        item=fmt.item_label(item.index),
        identity=fmt.item_identity(item.index),
        dtype=str(tensor.dtype).removeprefix("torch.") if tensor is not None else None,
        element_size=tensor.element_size() if tensor is not None else None,
        save=save,
    )


class _Item:
    """One item of a file being written: its data as the planner resolves it, its
    fingerprint when the save records them (taken here, on the writing thread, of the
    very tensor :meth:`write` then encodes), and whether the base holds it."""

    def __init__(
        self, url: str, settings: FileSettings, item: WriteItem, planner: SavePlanner
    ) -> None:
        self.settings, self.item = settings, item
        self.data = savable.resolve(planner, item, url)
        self.tensor: torch.Tensor | None = None
        if item.type != WriteItemType.BYTE_IO:
            self.tensor = plain_cpu_tensor(self.data)
        self.info = item_info(url, item, self.tensor, settings.save)
        self.content = self._fingerprint() if settings.fingerprint else None

    def _fingerprint(self) -> incremental.Fingerprint:
        plain = self.tensor if self.tensor is not None else self.data.getbuffer()
        return incremental.fingerprint(plain, self.settings.transforms)

    def reference(self) -> WriteResult | None:
        """The item as a reference to the base's bytes, when the base holds the same
        content under the same transform chain; ``None``: it must be written."""
        base = self.settings.base
        if base is None or self.content is None:
            return None
        descriptors = chain_descriptors(self.settings.transforms, self.info)
        info = base.reference(self.item.index, descriptors, self.content)
        return None if info is None else WriteResult(self.item.index, 0, info)

    def write(self, stream: Any, name: str, offset: int) -> WriteResult:
        """Encode the item into ``stream`` (the file ``name``) at ``offset``. Its
        fingerprint is taken again once it is written: an item that changed since its
        fingerprint was taken (changed during the save) records none, so no later save
        takes the bytes written for content they may not hold."""
        start = fmt.StoredItem(name, offset, 0, save=self.settings.save)
        record = encode_item(
            stream, self.settings.transforms, self.info, self.data, self.tensor, start
        )
        if self.content is not None and self._fingerprint().digest == self.content.digest:
            record = dataclasses.replace(record, content=self.content.record())
        return WriteResult(
            index=self.item.index,
            size_in_bytes=record.length,
            storage_data=fmt.new_storage_info(record),
        )
