"""A save's data files: the items split into files (:func:`split_into_files`), then
written on the writer's threads (:func:`write_files`), each item encoded through the
transform chain with its checksum and, for incremental saves, its content fingerprint.
``CheckpointWriter.write_files`` runs this, in the training process or in the persist
worker with the staged data, for the save's :class:`~storage.checkpoint.attempt.SaveAttempt`
(which records every file before it opens and removes them when the save fails) with the
writer's :class:`FileSettings`."""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import io
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, cast

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
#: An incremental save's fingerprints are spread over threads (xxHash and BLAKE2 let go of
#: the GIL) where the items hold at least this many bytes.
SPREAD_FINGERPRINTS = 64 << 20


@dataclasses.dataclass(frozen=True)
class FileSettings:
    """What writing a save's data files needs of its writer: the transform chain, the
    rank writing, whether each file is made durable, and the content fingerprints of
    its items (``fingerprint=True``)."""

    transforms: Sequence[Any]
    rank: int
    sync: bool
    fingerprints: Mapping[Any, incremental.Fingerprint]
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


def fingerprint_items(
    items: list[WriteItem],
    planner: SavePlanner,
    transforms: Sequence[Any],
    url: str,
    base: incremental.Base | None,
    fingerprints: dict[Any, incremental.Fingerprint],
    save: str | None,
    threads: int = 1,
) -> tuple[list[WriteItem], list[WriteResult]]:
    """Fingerprint every item into ``fingerprints``; returns the items to write and the
    references to ``base``'s bytes for those whose content and chain it holds already.
    Items are resolved on this thread, one after another; where they hold at least
    :data:`SPREAD_FINGERPRINTS` bytes their fingerprints run on up to ``threads``
    threads, at most twice that many items resolved and not yet fingerprinted at once."""
    to_write, referenced = [], []
    for item, tensor, content in _fingerprinted(items, planner, transforms, url, threads):
        fingerprints[item.index] = content
        info = None
        if base is not None:
            descriptors = chain_descriptors(transforms, item_info(url, item, tensor, save))
            info = base.reference(item.index, descriptors, content)
        if info is None:
            to_write.append(item)
        else:
            referenced.append(WriteResult(item.index, 0, info))
    return to_write, referenced


Fingerprinted = tuple[WriteItem, "torch.Tensor | None", incremental.Fingerprint]


def _fingerprinted(
    items: list[WriteItem],
    planner: SavePlanner,
    transforms: Sequence[Any],
    url: str,
    threads: int,
) -> Iterator[Fingerprinted]:
    """Each item with its plain tensor (``None`` for bytes) and fingerprint, in order."""

    def resolved(item: WriteItem) -> tuple[torch.Tensor | None, torch.Tensor | memoryview]:
        data = savable.resolve(planner, item, url)
        tensor = None if item.type == WriteItemType.BYTE_IO else plain_cpu_tensor(data)
        return tensor, tensor if tensor is not None else cast(io.BytesIO, data).getbuffer()

    tensors = (i for i in items if i.type != WriteItemType.BYTE_IO)
    if threads < 2 or sum(map(item_size, tensors)) < SPREAD_FINGERPRINTS:
        for item in items:
            tensor, plain = resolved(item)
            yield item, tensor, incremental.fingerprint(plain, transforms)
        return
    pending: collections.deque[tuple[WriteItem, torch.Tensor | None, Any]] = collections.deque()
    with concurrent.futures.ThreadPoolExecutor(
        threads, thread_name_prefix="dcp-storage-fingerprint"
    ) as pool:
        for item in items:
            tensor, plain = resolved(item)
            pending.append((item, tensor, pool.submit(incremental.fingerprint, plain, transforms)))
            if len(pending) >= 2 * threads:
                done, tensor_done, future = pending.popleft()
                yield done, tensor_done, future.result()
        while pending:
            done, tensor_done, future = pending.popleft()
            yield done, tensor_done, future.result()


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
    past the deadline, in the background) and raise."""
    fs, url = attempt.fs, attempt.url

    def write_one(name: str, items: list[WriteItem]) -> list[WriteResult]:
        refuse_linked_prefix(fs, attempt.path, name)  # never write through a link
        path = attempt.record(name)
        return _write_file(attempt, settings, path, name, items, planner)

    token = heartbeat_token(attempt.save_id, settings.rank)
    marker = fs.url(fs.concat_path(attempt.path, heartbeat.name_of(token)))

    def guard(request: Callable[[], None]) -> None:
        item = heartbeat.name_of(token)
        attempt.budget.call(request, action="saving", location=url, item=item, url=marker)

    tasks = [functools.partial(write_one, name, items) for name, items in files]
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
    path: str,
    name: str,
    items: list[WriteItem],
    planner: SavePlanner,
) -> list[WriteResult]:
    # Opaque bytes first, then tensors (largest first), as torch orders them.
    ordered = [i for i in items if i.type == WriteItemType.BYTE_IO] + [
        i for i in items if i.type != WriteItemType.BYTE_IO
    ]
    results = []
    url = attempt.fs.url(path)
    checkpoint = attempt.url  # once: it resolves the path through the backend
    if ordered:
        note(fmt.item_label(ordered[0].index), url)
    # In the checkpoint directory as resolved when the save began, never through a link
    # swapped in since (create_stream_in).
    # A write that fails for want of room names the file (the backend's doing).
    with attempt.fs.create_stream_in(attempt.home, name, "wb", sync=settings.sync) as opened:
        stream = cancellable(opened)
        offset = 0
        for item in ordered:
            note(fmt.item_label(item.index), url)
            result = _write_item(checkpoint, settings, stream, name, offset, item, planner)
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


def _write_item(
    url: str,
    settings: FileSettings,
    stream: Any,
    name: str,
    offset: int,
    item: WriteItem,
    planner: SavePlanner,
) -> WriteResult:
    data = savable.resolve(planner, item, url)
    tensor: torch.Tensor | None = None
    if item.type != WriteItemType.BYTE_IO:
        tensor = plain_cpu_tensor(data)
    content = settings.fingerprints.get(item.index)
    start = fmt.StoredItem(
        name,
        offset,
        0,
        content=None if content is None else content.record(),
        save=settings.save,
    )
    info = item_info(url, item, tensor, settings.save)
    record = encode_item(stream, settings.transforms, info, data, tensor, start)
    return WriteResult(
        index=item.index,
        size_in_bytes=record.length,
        storage_data=fmt.new_storage_info(record),
    )
