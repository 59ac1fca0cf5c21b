"""A load's item reads (``CheckpointReader.read_data``, and each batch of a read-once
load), with what the load was set up with (``load_context.LoadContext``): the requested
items grouped by the file their bytes are in, adjacent ones coalesced into one ranged
request of at most :data:`COALESCE_LIMIT` bytes, biggest runs first; every item checked
before any byte is fetched (encryption required, keys at hand), then read, its CRC-32C
verified and decoded into its target, frame by frame on every core where the item's
transform splits into frames (zstd does). A run of small plain items is read into
memory a window at a time and each tensor copied from there (:func:`_read_held`)."""

from __future__ import annotations

import contextlib
import functools
import io
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import IO

import torch
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from extensions._compat import narrow_tensor_by_index
from extensions.base import ItemInfo, KeyLookup, cached_key_lookup
from extensions.errors import (
    CheckpointNotFoundError,
    CheckpointStorageError,
    IntegrityError,
    quote,
)
from extensions.registry import Framing
from extensions.streams import readinto_exact
from storage.backends import RangeMismatchError
from storage.checkpoint import frames, incremental
from storage.checkpoint import storage_format as fmt
from storage.checkpoint.deadline import Budget, cancellable, note
from storage.checkpoint.decode import (
    backed_value,
    copy_held,
    decode_tensor,
    direct_offset,
    plain_limit,
    plain_value,
    read_bounded,
)
from storage.checkpoint.items import (
    StoredItemReader,
    check_before_read,
    require_an_encrypted_item,
)
from storage.checkpoint.load_context import LoadContext
from storage.checkpoint.prefixes import refuse_linked_prefix
from storage.checkpoint.tensors import check_shapes, tensor_bytes

# Adjacent items are fetched with one request up to this many bytes.
COALESCE_LIMIT = 32 << 20
#: A run of plain items of at most this many stored bytes each is read into memory a
#: window of at most :data:`HELD_WINDOW` bytes at a time, and each item decoded from
#: there: for small items the per-item work of a stream is the cost, not the bytes.
HELD_ITEM = 256 << 10
HELD_WINDOW = 4 << 20


@dataclass
class _PlannedRead:
    """One requested item and its record (where its bytes are stored, and how)."""

    req: ReadItem
    info: fmt.StoredItem

    @property
    def offset(self) -> int:
        return self.info.offset

    @property
    def length(self) -> int:
        return self.info.length


def read_items(
    load: LoadContext, reqs: Sequence[ReadItem], planner: LoadPlanner, budget: Budget
) -> None:
    """Fetch, verify and decode ``reqs`` into ``planner``, within ``budget``."""
    keys = cached_key_lookup(load.keys)
    if not reqs:
        # This rank planned with the metadata all the same (a partial load that found
        # nothing it asked for, a read-once rank that only receives, a planner that
        # takes whatever the checkpoint holds): it is checked.
        load.check_seal(keys)
        if load.require_encryption:
            require_an_encrypted_item(load.storage_data.values(), load.registry, load.url)
        return
    first = fmt.item_label(reqs[0].storage_index)
    runs = budget.call(
        functools.partial(_plan_runs, load, reqs),  # checks the bases: requests
        action="loading",
        location=load.url,
        item=first,
        url=load.url,
    )
    lock = threading.Lock()
    # Before any byte is fetched: a plain item where encryption is required, a
    # missing key or a failing key provider is reported as itself; then, where keys
    # were given, the seal of the whole metadata (every encrypted item of a sealed
    # checkpoint needs a key, which the first check finds missing otherwise).
    for _, run in runs:
        for item in run:
            descriptors = item.info.descriptors
            if not descriptors and not load.require_encryption:
                continue  # nothing to refuse, no key to find
            info = _item_info(load, item, keys)
            check_before_read(
                descriptors,
                info,
                load.registry,
                require_encryption=load.require_encryption,
                decode=True,
                seal=None,
            )
    load.check_seal(keys)
    if not runs:
        return
    # Items in frames are decoded on every core while these threads read on (frames.py).
    workers = frames.decoder_count()
    decoders = frames.Decoders(workers, slots=workers + 2)
    tasks = [
        functools.partial(_read_run, load, p, r, planner, lock, keys, decoders) for p, r in runs
    ]
    try:
        budget.run(tasks, workers=load.thread_count, action="loading", location=load.url)
    except BaseException:
        with contextlib.suppress(BaseException):  # the readers' error comes first
            decoders.close()
        raise
    decoders.close()


def _plan_runs(load: LoadContext, reqs: Sequence[ReadItem]) -> list[tuple[str, list[_PlannedRead]]]:
    per_file: dict[str, list[_PlannedRead]] = {}
    # Keyed by where the bytes are: a referenced item's are in its base's file. Items
    # share a few files: each file's path is worked out (and checked) once.
    paths: dict[tuple[str | None, str], str] = {}
    for req in reqs:
        info = load.storage_data.get(req.storage_index)
        if info is None:
            raise IntegrityError(
                f"{load.url}: item {quote(fmt.item_label(req.storage_index))} is in the plan "
                "but not in the checkpoint's storage index; the metadata is damaged: "
                "re-save the checkpoint, or load from another step"
            )
        record = fmt.stored_item(info)
        path = paths.get((record.ref, record.relative_path))
        if path is None:
            path = incremental.item_path(load.fs, load.path, info)
            directory = incremental.item_directory(load.fs, load.path, info)
            refuse_linked_prefix(load.fs, directory, info.relative_path)
            paths[record.ref, record.relative_path] = path
        per_file.setdefault(path, []).append(_PlannedRead(req, record))
    incremental.check_bases(
        load.fs,
        load.path,
        (
            (fmt.item_label(i.req.storage_index), i.info)
            for r in per_file.values()
            for i in r
            if i.info.ref is not None
        ),
    )
    runs: list[tuple[str, list[_PlannedRead]]] = []
    for path, items in per_file.items():
        items.sort(key=lambda i: i.offset)
        current: list[_PlannedRead] = []
        for item in items:
            if current and (
                item.offset != current[-1].offset + current[-1].length
                or item.offset + item.length - current[0].offset > COALESCE_LIMIT
            ):
                runs.append((path, current))
                current = []
            current.append(item)
        if current:
            runs.append((path, current))
    # Biggest runs first, so the tail of the load is made of small ones.
    runs.sort(key=lambda r: -(r[1][-1].offset + r[1][-1].length - r[1][0].offset))
    return runs


def _read_run(
    load: LoadContext,
    path: str,
    run: list[_PlannedRead],
    planner: LoadPlanner,
    lock: threading.Lock,
    keys: KeyLookup | None,
    decoders: frames.Decoders | None = None,
) -> None:
    start = run[0].offset
    length = run[-1].offset + run[-1].length - start
    note(fmt.item_label(run[0].req.storage_index), load.fs.url(path))
    label = fmt.item_label(run[0].req.storage_index)  # the item being read
    try:
        with load.fs.open_slice(path, start, length) as opened:
            stream = cancellable(opened)
            # Finding a seek table costs two small reads: free where reads are
            # local, a request each on object stores (their readers stream).
            if not load.fs.local_reads:
                decoders = None
            if len(run) > 1 and all(not i.info.descriptors and i.length <= HELD_ITEM for i in run):
                for window in _windows(run):
                    label = fmt.item_label(window[0].req.storage_index)
                    _read_held(load, stream, path, window, planner, lock, keys)
                return
            for item in run:
                label = fmt.item_label(item.req.storage_index)
                _read_item(load, stream, path, item, planner, lock, keys, decoders)
    except RangeMismatchError as exc:
        # The store answered with other bytes than those asked for: say for which item.
        raise RangeMismatchError(f"{load.url}: item {quote(label)}: {exc}") from exc
    except FileNotFoundError as exc:
        if isinstance(exc, CheckpointStorageError):
            raise
        ref = run[0].info.ref  # the file is a base's: say which, not this one's
        where = (
            ""
            if ref is None
            else f" of its base {incremental.sibling_url(load.fs, load.path, ref)}"
        )
        raise CheckpointNotFoundError(
            f"{load.url}: data file {quote(os.path.basename(path))}{where} (item "
            f"{quote(fmt.item_label(run[0].req.storage_index))}) is missing; the checkpoint "
            "is incomplete: restore the file or re-save the checkpoint"
        ) from exc


def _windows(run: list[_PlannedRead]) -> list[list[_PlannedRead]]:
    """``run`` (adjacent items, each at most :data:`HELD_ITEM` bytes) cut into windows
    of adjacent items of at most :data:`HELD_WINDOW` bytes (or one item)."""
    windows: list[list[_PlannedRead]] = [[]]
    for item in run:
        window = windows[-1]
        if window and item.offset + item.length - window[0].offset > HELD_WINDOW:
            windows.append(window := [])
        window.append(item)
    return windows


def _read_held(
    load: LoadContext,
    stream: IO[bytes],
    path: str,
    window: list[_PlannedRead],
    planner: LoadPlanner,
    lock: threading.Lock,
    keys: KeyLookup | None,
) -> None:
    """Read the window's stored bytes from ``stream`` (where its first item starts)
    into memory, then each item from there: a tensor copied straight into its target
    (:func:`~storage.checkpoint.decode.copy_held`) or, where that does not apply, its
    bytes decoded as a stream, as a stream read from storage would be. A file cut short
    leaves the items past its end short, which that way names."""
    start = window[0].offset
    held = bytearray(window[-1].offset + window[-1].length - start)
    got = readinto_exact(stream, memoryview(held))
    memory = memoryview(held)[:got]
    for item in window:
        begin = item.offset - start
        _read_item(
            load, stream, path, item, planner, lock, keys, None, memory[begin : begin + item.length]
        )


def _read_item(
    load: LoadContext,
    stream: IO[bytes],
    path: str,
    item: _PlannedRead,
    planner: LoadPlanner,
    lock: threading.Lock,
    keys: KeyLookup | None,
    decoders: frames.Decoders | None,
    held: memoryview | None = None,
) -> None:
    """Read ``item``, next in ``stream``, or from ``held``, its stored bytes read
    already (:func:`_read_held`), and hand it to ``planner``."""
    label = fmt.item_label(item.req.storage_index)
    note(label, load.fs.url(path))
    where = f"{load.url}: item {quote(label)} in {quote(os.path.basename(path))}"
    chunk = load.chunks.get(item.req.storage_index)
    target: torch.Tensor | None = None
    if item.req.type != LoadItemType.BYTE_IO:
        with lock:
            target = planner.resolve_tensor(item.req).detach()
        check_shapes(item.req, target, chunk, where)
        if held is not None and copy_held(held, item.info, chunk, item.req, target):
            with lock:
                planner.commit_tensor(item.req, target)
            return
    source = stream if held is None else io.BytesIO(held)
    if item.req.type == LoadItemType.BYTE_IO:
        source, limit = backed_value(source, item.length, load.max_object_bytes)
    else:
        limit = plain_limit(chunk, item.length)
    stored = StoredItemReader(
        source,
        item.length,
        item.info.descriptors,
        item.info.crc32c,
        where,
        block=load.fs.read_block,
    )
    info = replace(_item_info(load, item, keys), plain_bytes=limit)
    if target is not None:
        framing = None if decoders is None else load.registry.framing(stored.descriptors)
        if (
            framing is not None
            and decoders is not None
            and _decode_framed(
                stream, item, stored, chunk, target, planner, lock, decoders, framing
            )
        ):
            return
    try:
        decoded = stored.decoded(load.registry, info)
        if target is None:
            payload = read_bounded(decoded, limit, where, "pass a larger max_object_bytes=")
        else:
            decoded_tensor = decode_tensor(decoded, item.req, item.info, chunk, target, where)
        stored.finish()
    except (CheckpointStorageError, OSError):
        raise  # already named, or the storage failed (not the bytes)
    except Exception as exc:
        # A decoder choking on damaged bytes: report it as the integrity failure it is.
        raise stored.damaged(exc) from exc
    if target is None:
        plain = plain_value(payload, where)
        with lock:
            planner.load_bytes(item.req, plain)
        return
    if decoded_tensor is not target:
        _copy_into(decoded_tensor, item.req, target, where)
    with lock:
        planner.commit_tensor(item.req, target)


def _decode_framed(
    stream: IO[bytes],
    item: _PlannedRead,
    stored: StoredItemReader,
    chunk: tuple[torch.Size, torch.dtype] | None,
    target: torch.Tensor,
    planner: LoadPlanner,
    lock: threading.Lock,
    decoders: frames.Decoders,
    framing: Framing,
) -> bool:
    """Hand a tensor item in frames to the frame decoders, which decode it straight
    into ``target`` and commit it; ``False`` when its layout does not allow that (no
    direct offset, or too large to buffer without a frame list)."""
    offset = direct_offset(item.req, item.info, chunk, target)
    table = None if offset is None else frames.frame_list(framing, stream, item.length)
    if offset is None or not (table or item.length <= frames.MAX_BUFFER):
        return False
    req = item.req

    def commit() -> None:
        with lock:
            planner.commit_tensor(req, target)

    frames.decode_framed(
        decoders, stored, table, framing.decode, tensor_bytes(target), offset, commit
    )
    return True


def _copy_into(decoded: torch.Tensor, req: ReadItem, target: torch.Tensor, where: str) -> None:
    """Copy the requested region of a decoded chunk into ``target``."""
    narrowed = narrow_tensor_by_index(decoded, req.storage_offsets, req.lengths)
    if narrowed.size() != target.size():
        # The target fits the metadata (checked before reading): the stored
        # bytes hold another shape than the metadata says.
        raise IntegrityError(
            f"{where}: the stored tensor (shape {tuple(decoded.size())}) does "
            "not match the shape the metadata records; the checkpoint is damaged"
        )
    target.copy_(narrowed)


def _item_info(load: LoadContext, item: _PlannedRead, keys: KeyLookup | None) -> ItemInfo:
    return load.item_info(item.req.storage_index, keys, item.info)
