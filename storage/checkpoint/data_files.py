"""A save's data files: the items split into files (:func:`split_into_files`), then
written on the writer's threads (:func:`write_files`), each item encoded through the
transform chain with its checksum and, for incremental saves, its content fingerprint.
``CheckpointWriter.write_files`` runs this, in the training process or in the persist
worker with the staged data."""

from __future__ import annotations

import functools
import io
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from extensions._compat import item_size, split_by_size_and_type
from extensions.base import ItemInfo
from extensions.registry import chain_descriptors
from storage.backends.base import FileSystemBase
from storage.checkpoint import heartbeat, incremental
from storage.checkpoint import storage_format as fmt
from storage.checkpoint.commit import remove_quietly
from storage.checkpoint.deadline import Budget, cancellable, note
from storage.checkpoint.encode import encode_item, plain_cpu_tensor
from storage.checkpoint.prefixes import place, refuse_linked_prefix

if TYPE_CHECKING:
    from storage.checkpoint.writer import CheckpointWriter

#: Tensor bytes per writing thread, at least: more threads than this allows do not pay.
BYTES_PER_THREAD = 32 << 20


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
        buckets = [b for b in split_by_size_and_type(threads, items) if b]
    else:
        buckets = [[item] for item in items]
    files = [
        (place(fmt.data_file_name(rank, n, save_id), rank, key_prefixes), b)
        for n, b in enumerate(buckets)
    ]
    return files, threads


def fingerprint_items(
    items: list[WriteItem],
    planner: SavePlanner,
    transforms: Sequence[Any],
    url: str,
    base: incremental.Base | None,
    fingerprints: dict[Any, incremental.Fingerprint],
) -> tuple[list[WriteItem], list[WriteResult]]:
    """Fingerprint every item into ``fingerprints``; returns the items to write and the
    references to ``base``'s bytes for those whose content and chain it holds already."""
    to_write, referenced = [], []
    for item in items:
        data = planner.resolve_data(item)
        tensor = None if item.type == WriteItemType.BYTE_IO else plain_cpu_tensor(data)
        plain = tensor if tensor is not None else cast(io.BytesIO, data).getbuffer()
        content = incremental.fingerprint(plain, transforms)
        fingerprints[item.index] = content
        info = None
        if base is not None:
            descriptors = chain_descriptors(transforms, item_info(url, item, tensor))
            info = base.reference(item.index, descriptors, content)
        if info is None:
            to_write.append(item)
        else:
            referenced.append(WriteResult(item.index, 0, info))
    return to_write, referenced


def write_files(
    writer: CheckpointWriter, files: list[tuple[str, list[WriteItem]]], threads: int, planner: Any
) -> list[list[WriteResult]]:
    """Write ``files`` (name, items) on up to ``threads`` threads with the data
    ``planner.resolve_data`` gives, noting each in ``writer.written``, under a heartbeat
    (``heartbeat.beating``: ``gc`` leaves this save's uploads and files alone while it
    writes); on failure remove what was written (``writer.abort``) and raise."""
    lock = threading.Lock()

    def write_one(name: str, items: list[WriteItem]) -> list[WriteResult]:
        refuse_linked_prefix(writer.fs, writer.path, name)  # never write through a link
        path = writer.fs.concat_path(writer.path, name)
        with lock:
            writer.written.append(path)
        return _write_file(writer, path, name, items, planner)

    token = heartbeat_token(writer)
    marker = writer.fs.url(writer.fs.concat_path(writer.path, heartbeat.name_of(token)))

    def guard(request: Callable[[], None]) -> None:
        item = heartbeat.name_of(token)
        writer.budget.call(request, action="saving", location=writer.url, item=item, url=marker)

    tasks = [functools.partial(write_one, name, items) for name, items in files]
    try:
        with heartbeat.beating(writer.fs, writer.path, token, guard=guard):
            per_file = writer.budget.run(
                tasks, workers=threads, action="saving", location=writer.url
            )
    except BaseException:
        writer.abort()  # past the deadline, in the background: the error goes out now
        raise
    return per_file


def heartbeat_token(writer: CheckpointWriter) -> str:
    """The token of this rank's heartbeat in a save (known to the training process too,
    which removes it when the persist worker dies with it live)."""
    return f"{writer.save_id}r{writer.rank}"


def _write_file(
    writer: CheckpointWriter, path: str, name: str, items: list[WriteItem], planner: SavePlanner
) -> list[WriteResult]:
    # Opaque bytes first, then tensors (largest first), as torch orders them.
    ordered = [i for i in items if i.type == WriteItemType.BYTE_IO] + [
        i for i in items if i.type != WriteItemType.BYTE_IO
    ]
    results = []
    if ordered:
        note(fmt.item_label(ordered[0].index), writer.fs.url(path))
    with writer.fs.create_stream(path, "wb", sync=writer.sync_files) as opened:
        stream = cancellable(opened)
        offset = 0
        for item in ordered:
            result = _write_item(writer, stream, name, offset, item, planner)
            offset += result.storage_data.length
            results.append(result)
    return results


def item_info(url: str, item: WriteItem, tensor: torch.Tensor | None) -> ItemInfo:
    """What the transforms are told of ``item`` (of the checkpoint at ``url``)."""
    return ItemInfo(
        checkpoint=url,
        item=fmt.item_label(item.index),
        dtype=str(tensor.dtype).removeprefix("torch.") if tensor is not None else None,
        element_size=tensor.element_size() if tensor is not None else None,
    )


def _write_item(
    writer: CheckpointWriter,
    stream: Any,
    name: str,
    offset: int,
    item: WriteItem,
    planner: SavePlanner,
) -> WriteResult:
    label = fmt.item_label(item.index)
    note(label, writer.fs.url(writer.fs.concat_path(writer.path, name)))
    data = planner.resolve_data(item)
    tensor: torch.Tensor | None = None
    if item.type != WriteItemType.BYTE_IO:
        tensor = plain_cpu_tensor(data)
    content = writer.fingerprints.get(item.index)
    start = fmt.StoredItem(name, offset, 0, content=None if content is None else content.record())
    info = item_info(writer.url, item, tensor)
    record = encode_item(stream, writer.transforms, info, data, tensor, start)
    return WriteResult(
        index=item.index,
        size_in_bytes=record.length,
        storage_data=fmt.new_storage_info(record),
    )


def remove_written(fs: FileSystemBase, paths: list[str], budget: Budget) -> None:
    """Remove the data files a failed save wrote (``CheckpointWriter.abort``), quietly."""
    if budget.timeout is None:
        remove_quietly(fs, paths)
        return
    # Storage may be stalled: the removal waits for what is left of the timeout,
    # then goes on in the background.
    cleanup = threading.Thread(
        target=remove_quietly, args=(fs, paths), daemon=True, name="dcp-storage-abort"
    )
    cleanup.start()
    cleanup.join(budget.left())
