"""``CheckpointReader``: a DCP ``StorageReader`` over any ``FileSystemBase``."""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO, Any

import torch
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from extensions._compat import TorchExtensionRegistry, narrow_tensor_by_index
from extensions.base import ItemInfo, KeyLookup, Keys, cached_key_lookup
from extensions.errors import (
    CheckpointNotFoundError,
    CheckpointStorageError,
    IntegrityError,
    quote,
)
from extensions.registry import ExtensionRegistry, as_registry, parse_descriptor
from extensions.zstd import ZStandard
from storage.backends import LocalFileSystem, MemoryFileSystem
from storage.backends.base import FileSystemBase
from storage.checkpoint import format as fmt
from storage.checkpoint import frames, incremental, read_once, share_groups
from storage.checkpoint._common import (
    check_shapes,
    check_thread_count,
    default_thread_count,
    records_error,
    resolve_location,
    stock_checkpoint_id,
    tensor_bytes,
)
from storage.checkpoint.deadline import Budget, cancellable, check_timeout, note
from storage.checkpoint.decode import (
    MAX_OBJECT_BYTES,
    OBJECT_RATIO,
    decode_tensor,
    direct_offset,
    plain_value,
    read_bounded,
)
from storage.checkpoint.items import StoredItem, check_before_read, encryption_required
from storage.checkpoint.layout import metadata_rank
from storage.checkpoint.prefixes import refuse_linked_prefix
from storage.checkpoint.shared import on_coordinator

# Adjacent items are fetched with one request up to this many bytes.
COALESCE_LIMIT = 32 << 20


@dataclass
class _Item:
    req: ReadItem
    info: Any  # _StorageInfo

    @property
    def offset(self) -> int:
        return int(self.info.offset)

    @property
    def length(self) -> int:
        return int(self.info.length)


@dataclass(frozen=True)
class _Absent:
    """What one listing says of a location without ``.metadata``: whether it exists,
    and the rank-local metadata files it holds (``None``: the listing failed)."""

    exists: bool
    rank_files: frozenset[str] | None


class CheckpointReader(StorageReader):
    """Read a DCP checkpoint from a local path or any supported URL.

    Every item is fetched as an exact byte range (adjacent items coalesced), its
    CRC32C verified, its transform chain rebuilt from the recorded descriptors with
    ``registry`` (built-ins and registered transforms by default; torch's own
    ``_extension.ExtensionRegistry`` is accepted too), and tensors decoded
    straight into the target tensor where layout allows. ``keys`` (a mapping
    key_id -> key, or a callable) serves encrypted items. Checkpoints written by stock
    DCP load too; they carry no checksums, so those items are not verified.

    ``require_encryption`` (default: on when ``keys`` are given) refuses, before
    anything is read, an item that is not AES-256-GCM encrypted, so nobody can swap an
    encrypted item for a plain one in the (unauthenticated) metadata; see
    docs/transforms.md for what it does not cover.

    Decoding is bounded by the request and the stored sizes, never by what the
    checkpoint merely claims: a tensor item decodes to at most its chunk's bytes (the
    chunk must lie inside the tensor, whose size torch's planner matches against the
    caller's) plus ``ARCHIVE_ALLOWANCE``; a non-tensor item to at most
    ``max(max_object_bytes, 64 x its stored size)``. Past the bound the item is refused
    with :class:`UnsafeCheckpointError` naming it.

    ``read_once`` (multi-rank loads): a stored item that several ranks need is fetched
    and decoded by one of them and sent to the others over ``process_group`` (default:
    the default group; pass the group given to ``dcp.load``), so each byte is fetched
    once per job (storage/checkpoint/read_once.py; default: on for every backend but
    local disk, see docs/scale.md). The exchange sends CPU tensors: over that group if
    it has gloo; for an NCCL-only default group, over a gloo group made once for it;
    any other group needs a gloo group passed here (storage/checkpoint/share_groups.py).
    ``timeout`` (seconds) bounds this rank's storage work in a load, every request of
    it (the metadata, its bases, the data; ``deadline.Budget``): past it the load fails
    on every rank with :class:`DeadlineExceededError` naming the rank, the item and the
    URL.
    ``share_metadata``: the global ``.metadata`` is read by the group's rank 0 alone and
    broadcast (one request per load, not one per rank); a collective, so only for
    reads every rank makes together (``storage.load`` turns it on under a process group).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        storage_options: dict[str, Any] | None = None,
        keys: Keys | None = None,
        registry: ExtensionRegistry | TorchExtensionRegistry | None = None,
        thread_count: int | None = None,
        filesystem: FileSystemBase | None = None,
        require_encryption: bool | None = None,
        max_object_bytes: int = MAX_OBJECT_BYTES,
        read_once: bool | None = None,
        timeout: float | None = None,
        process_group: Any = None,
        share_metadata: bool = False,
    ) -> None:
        super().__init__()
        if not isinstance(share_metadata, bool):
            raise TypeError(f"share_metadata must be a bool, got {share_metadata!r}")
        self.share_metadata = share_metadata
        if read_once is not None and not isinstance(read_once, bool):
            raise TypeError(f"read_once must be a bool or None, got {read_once!r}")
        self.timeout = check_timeout(timeout)
        self.budget = Budget(self.timeout)
        self.process_group = process_group
        if not isinstance(max_object_bytes, int) or max_object_bytes < 0:
            raise TypeError(f"max_object_bytes must be an int >= 0, got {max_object_bytes!r}")
        self.max_object_bytes = max_object_bytes
        if keys is not None and not (callable(keys) or hasattr(keys, "__getitem__")):
            raise TypeError("keys must be a mapping key_id -> bytes or a callable key_id -> bytes")
        self.storage_options = storage_options
        self._explicit_fs = filesystem
        self.fs, self.path = resolve_location(path, storage_options, filesystem)
        self._location = path  # as given: checkpoint_id reports it as stock does
        self.keys = keys
        self.require_encryption = encryption_required(require_encryption, keys)
        # None: the default registry, built per load so later registrations count.
        self.registry = None if registry is None else as_registry(registry)
        self.thread_count = check_thread_count(thread_count) or default_thread_count(self.fs)
        self._read_once = read_once
        self.storage_data: dict[MetadataIndex, Any] = {}
        self._chunks: dict[MetadataIndex, tuple[torch.Size, torch.dtype]] = {}
        self.last_error: BaseException | None = None
        # What this load's probe of .metadata listed, when the file was missing.
        self._absent: _Absent | None = None
        # One id per load, handed to planners and loggers in metadata.storage_meta (stock).
        self.load_id = str(uuid.uuid4())

    # --- StorageReader --------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.storage_data = {}
        self.last_error = None
        self._absent = None
        self.load_id = str(uuid.uuid4())
        if checkpoint_id:
            self.fs, self.path = resolve_location(
                checkpoint_id, self.storage_options, self._explicit_fs
            )
            self._location = checkpoint_id

    @property
    def url(self) -> str:
        return self.fs.url(self.path)

    @property
    def read_once(self) -> bool:
        """Whether items several ranks need are fetched once and shared; by default on
        for every backend but local disk (where page-cache reads beat the exchange),
        when the exchange has a group to send CPU tensors over (a gloo or gloo+NCCL
        group, or the default group, for which one is made: share_groups.py)."""
        if self._read_once is None:
            local = isinstance(self.fs, (LocalFileSystem, MemoryFileSystem))
            return not local and share_groups.can_share(self.process_group)
        return self._read_once

    @records_error
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        # torch asks for the global metadata, then (rank=N) for the rank-local one.
        rank = kwargs.get("rank")
        if rank is None:
            self.budget.restart()  # a load begins with the global metadata
        meta_path = self.fs.concat_path(self.path, fmt.metadata_name(rank))
        if rank is None:
            self._absent = None
        absent = self._absent  # the global probe of this load found no .metadata
        if absent is not None and (
            not absent.exists
            or (absent.rank_files is not None and fmt.metadata_name(rank) not in absent.rank_files)
        ):
            # Its listing already said there is no such file: nothing to ask storage.
            raise CheckpointNotFoundError(self._missing_message(rank, absent))

        def read() -> bytes | _Absent:
            try:
                return self.fs.read_bytes(meta_path)
            except FileNotFoundError:
                return absent or self._look()

        def fetch() -> bytes | _Absent:
            name, url = fmt.metadata_name(rank), self.fs.url(meta_path)
            return self.budget.call(read, action="loading", location=self.url, item=name, url=url)

        # The global metadata is the same for every rank, and so is the listing that
        # says why it is missing; a rank-local metadata is not.
        shared = self.share_metadata and rank is None
        found = on_coordinator(fetch, self.process_group) if shared else fetch()
        if isinstance(found, _Absent):
            self._absent = found
            raise CheckpointNotFoundError(self._missing_message(rank, found))
        payload = found
        try:
            metadata = fmt.load_metadata(payload, self.fs.url(meta_path))
        except CheckpointStorageError as exc:
            # The rank-local file exists but is refused: that, not the missing global
            # .metadata of the first probe, is what the caller must hear.
            if isinstance(self.last_error, CheckpointNotFoundError):
                self.last_error = exc
            raise
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        self.last_error = None  # an earlier probe (global vs rank-local) may have failed
        return metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if metadata.storage_data is None:
            raise IntegrityError(f"{self.url}: metadata has no storage index")
        self.storage_data = metadata.storage_data
        self._chunks = {}
        for fqn, md in metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                for chunk in md.chunks:
                    index = MetadataIndex(fqn, chunk.offsets)
                    self._chunks[index] = (chunk.sizes, md.properties.dtype)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        if self.read_once and len(plans) > 1:
            share_groups.check_can_share(self.process_group, self.url)
            return read_once.assign(plans, self.storage_data, self._chunks)
        return plans

    @records_error
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if isinstance(plan.storage_data, read_once.SharePlan):
            read_once.read_shared(self, plan, planner)
        else:
            self._read_items(plan.items, planner, self.budget)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_items(self, reqs: Sequence[ReadItem], planner: LoadPlanner, budget: Budget) -> None:
        """Fetch, verify and decode ``reqs`` into ``planner``, within ``budget``."""
        if not reqs:
            return
        first = fmt.item_label(reqs[0].storage_index)
        runs = budget.call(
            functools.partial(self._plan_runs, reqs),  # checks the bases: requests
            action="loading",
            location=self.url,
            item=first,
            url=self.url,
        )
        lock = threading.Lock()
        registry = self.registry or ExtensionRegistry()
        keys = cached_key_lookup(self.keys)
        # Before any byte is fetched: a plain item where encryption is required, a
        # missing key or a failing key provider is reported as itself.
        for _, run in runs:
            for item in run:
                descriptors = item.info.transform_descriptors or ()
                info = self._item_info(item, keys)
                check_before_read(
                    descriptors,
                    info,
                    registry,
                    require_encryption=self.require_encryption,
                    decode=True,
                )
        if not runs:
            return
        # zstd items are decoded on every core while these threads read on (frames.py).
        workers = frames.decoder_count()
        decoders = frames.Decoders(workers, slots=workers + 2)
        tasks = [
            functools.partial(self._read_run, p, r, planner, lock, registry, keys, decoders)
            for p, r in runs
        ]
        try:
            budget.run(tasks, workers=self.thread_count, action="loading", location=self.url)
        except BaseException:
            with contextlib.suppress(BaseException):  # the readers' error comes first
                decoders.close()
            raise
        decoders.close()

    @property
    def checkpoint_id(self) -> str | os.PathLike[str]:
        """The location as torch reports it: a ``pathlib.Path`` for a local path, the
        URL string otherwise (``url`` is the normalized URL, ``path`` the backend's)."""
        return stock_checkpoint_id(self._location)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    # --- internals ------------------------------------------------------------------

    def _look(self) -> _Absent:
        """One listing of the location, for a load that found no metadata there."""
        try:
            names = self.fs.ls(self.path)
        except (FileNotFoundError, NotADirectoryError):
            return _Absent(exists=False, rank_files=frozenset())
        except Exception:  # listing may be forbidden; the metadata is what matters
            return _Absent(exists=True, rank_files=None)
        ranks = frozenset(n for n in names if metadata_rank(n) is not None)
        return _Absent(exists=True, rank_files=ranks)

    def _missing_message(self, rank: int | None, absent: _Absent) -> str:
        if not absent.exists:
            return f"no checkpoint at {self.url}: the location does not exist"
        return (
            f"{self.url} is not a committed checkpoint: it has no {fmt.metadata_name(rank)} "
            "(an interrupted save, or not a checkpoint directory); point at a checkpoint "
            "directory"
        )

    def _plan_runs(self, reqs: Sequence[ReadItem]) -> list[tuple[str, list[_Item]]]:
        per_file: dict[str, list[_Item]] = {}
        for req in reqs:
            info = self.storage_data.get(req.storage_index)
            if info is None:
                raise IntegrityError(
                    f"{self.url}: item {quote(fmt.item_label(req.storage_index))} is in the plan "
                    "but not in the checkpoint's storage index; the metadata is damaged"
                )
            # Keyed by where the bytes are: a referenced item's are in its base's file.
            path = incremental.item_path(self.fs, self.path, info)
            if path not in per_file:
                directory = incremental.item_directory(self.fs, self.path, info)
                refuse_linked_prefix(self.fs, directory, info.relative_path)
            per_file.setdefault(path, []).append(_Item(req, info))
        incremental.check_bases(
            self.fs,
            self.path,
            ((fmt.item_label(i.req.storage_index), i.info) for r in per_file.values() for i in r),
        )
        runs: list[tuple[str, list[_Item]]] = []
        for path, items in per_file.items():
            items.sort(key=lambda i: i.offset)
            current: list[_Item] = []
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
        self,
        path: str,
        run: list[_Item],
        planner: LoadPlanner,
        lock: threading.Lock,
        registry: ExtensionRegistry,
        keys: KeyLookup | None,
        decoders: frames.Decoders | None = None,
    ) -> None:
        start = run[0].offset
        length = run[-1].offset + run[-1].length - start
        note(fmt.item_label(run[0].req.storage_index), self.fs.url(path))
        try:
            with self.fs.open_slice(path, start, length) as opened:
                stream = cancellable(opened)
                # Finding a seek table costs two small reads: free on local disk and
                # memory, a request each on object stores (their readers stream).
                if not isinstance(self.fs, (LocalFileSystem, MemoryFileSystem)):
                    decoders = None
                for item in run:
                    self._read_item(stream, path, item, planner, lock, registry, keys, decoders)
        except FileNotFoundError as exc:
            if isinstance(exc, CheckpointStorageError):
                raise
            raise CheckpointNotFoundError(
                f"{self.url}: data file {quote(os.path.basename(path))} (item "
                f"{quote(fmt.item_label(run[0].req.storage_index))}) is missing; the checkpoint "
                "is incomplete: restore the file or re-save the checkpoint"
            ) from exc

    def _read_item(
        self,
        stream: IO[bytes],
        path: str,
        item: _Item,
        planner: LoadPlanner,
        lock: threading.Lock,
        registry: ExtensionRegistry,
        keys: KeyLookup | None,
        decoders: frames.Decoders | None = None,
    ) -> None:
        label = fmt.item_label(item.req.storage_index)
        note(label, self.fs.url(path))
        where = f"{self.url}: item {quote(label)} in {quote(os.path.basename(path))}"
        extra = fmt.item_extra(item.info)
        stored = StoredItem(
            stream,
            item.length,
            item.info.transform_descriptors or (),
            extra.get("crc32c"),
            where,
            block=self.fs.read_block,
        )
        chunk = self._chunks.get(item.req.storage_index)
        info = self._item_info(item, keys)
        target: torch.Tensor | None = None
        if item.req.type != LoadItemType.BYTE_IO:
            with lock:
                target = planner.resolve_tensor(item.req).detach()
            check_shapes(item.req, target, chunk, where)
            if decoders is not None and self._zstd_only(stored.descriptors, registry):
                offset = direct_offset(item.req, extra, chunk, target)
                table = None if offset is None else frames.seek_table(stream, item.length)
                if offset is not None and (table or item.length <= frames.MAX_BUFFER):
                    req, tensor = item.req, target

                    def commit() -> None:
                        with lock:
                            planner.commit_tensor(req, tensor)

                    frames.decode_framed(
                        decoders, stored, table, tensor_bytes(target), offset, commit
                    )
                    return
        try:
            decoded = stored.decoded(registry, info)
            if target is None:
                limit = max(self.max_object_bytes, OBJECT_RATIO * item.length)
                payload = read_bounded(decoded, limit, where, "pass a larger max_object_bytes=")
            else:
                decoded_tensor = decode_tensor(decoded, item.req, extra, chunk, target, where)
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
            narrowed = narrow_tensor_by_index(
                decoded_tensor, item.req.storage_offsets, item.req.lengths
            )
            if narrowed.size() != target.size():
                # The target fits the metadata (checked before reading): the stored
                # bytes hold another shape than the metadata says.
                raise IntegrityError(
                    f"{where}: the stored tensor (shape {tuple(decoded_tensor.size())}) does "
                    "not match the shape the metadata records; the checkpoint is damaged"
                )
            target.copy_(narrowed)
        with lock:
            planner.commit_tensor(item.req, target)

    @staticmethod
    def _zstd_only(descriptors: Sequence[str], registry: ExtensionRegistry) -> bool:
        """Whether the chain is our zstd alone (what the frame decoders handle)."""
        if len(descriptors) != 1:
            return False
        name, version = parse_descriptor(descriptors[0])
        return (
            name == ZStandard.registry_name()
            and version.partition(".")[0] == "1"
            and registry.get(name) is ZStandard
        )

    def _item_info(self, item: _Item, keys: KeyLookup | None) -> ItemInfo:
        chunk = self._chunks.get(item.req.storage_index)
        return ItemInfo(
            checkpoint=self.url,
            item=fmt.item_label(item.req.storage_index),
            dtype=str(chunk[1]).removeprefix("torch.") if chunk else None,
            element_size=chunk[1].itemsize if chunk else None,
            keys=keys,
        )
