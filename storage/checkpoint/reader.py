"""``CheckpointReader``: a DCP ``StorageReader`` over any ``FileSystemBase``."""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from extensions._compat import TorchExtensionRegistry
from extensions.base import Keys
from extensions.errors import CheckpointNotFoundError, CheckpointStorageError
from extensions.registry import ExtensionRegistry, as_registry
from storage.backends.base import FileSystemBase
from storage.backends.registry import serves
from storage.checkpoint import fetch, read_once, share_groups
from storage.checkpoint import storage_format as fmt
from storage.checkpoint.committed import read_metadata_bytes
from storage.checkpoint.deadline import Budget, check_timeout
from storage.checkpoint.decode import MAX_OBJECT_BYTES
from storage.checkpoint.hook_errors import records_error
from storage.checkpoint.items import encryption_required
from storage.checkpoint.layout import metadata_rank
from storage.checkpoint.load_context import Chunks, LoadContext
from storage.checkpoint.options import (
    check_thread_count,
    default_thread_count,
    resolve_location,
    stock_checkpoint_id,
    torch_alias,
)
from storage.checkpoint.shared import on_coordinator


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
    local disk, see docs/scale.md; never under rank-local metadata, where one key names
    each rank's own item). The exchange sends CPU tensors: over that group if
    it has gloo; for an NCCL-only default group, over a gloo group made once for it;
    any other group needs a gloo group passed here (storage/checkpoint/share_groups.py).
    ``timeout`` (seconds) bounds this rank's storage work in a load, every request of
    it (the metadata, its bases, the data; ``deadline.Budget``): past it the load fails
    on every rank with :class:`DeadlineExceededError` naming the rank, the item and the
    URL.
    ``share_metadata``: the global ``.metadata`` is read by the group's rank 0 alone and
    broadcast (one request per load, not one per rank); a collective, so only for
    reads every rank makes together (``storage.load`` turns it on under a process group).

    ``_extension_registry`` is ``FileSystemReader``'s (experimental) name for
    ``registry``, accepted so code written for stock DCP runs unchanged.

    Each load is carried out with a :class:`~storage.checkpoint.load_context.LoadContext`
    built in ``set_up_storage_reader`` from these settings and the load's metadata.
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
        _extension_registry: ExtensionRegistry | TorchExtensionRegistry | None = None,
    ) -> None:
        super().__init__()
        registry = torch_alias("registry", registry, "_extension_registry", _extension_registry)
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
        # What the load set up last reads with (set_up_storage_reader); None: none yet.
        self._load: LoadContext | None = None
        self.last_error: BaseException | None = None
        # What this load's probe of .metadata listed, when the file was missing.
        self._absent: _Absent | None = None
        # The rank whose rank-local metadata this load read (None: the global .metadata).
        self._metadata_rank: int | None = None
        # One id per load, handed to planners and loggers in metadata.storage_meta (stock).
        self.load_id = str(uuid.uuid4())

    # --- StorageReader --------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._load = None
        self.last_error = None
        self._absent = None
        self._metadata_rank = None
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
    def storage_data(self) -> Mapping[MetadataIndex, Any]:
        """The set-up load's storage index (each item's record), as stock readers
        keep it; empty before ``set_up_storage_reader``."""
        return {} if self._load is None else self._load.storage_data

    @property
    def chunks(self) -> Chunks:
        """Each tensor item's stored chunk (sizes, dtype) in the set-up load's
        metadata; empty before ``set_up_storage_reader``."""
        return {} if self._load is None else self._load.chunks

    @property
    def read_once(self) -> bool:
        """Whether items several ranks need are fetched once and shared; by default on
        for every backend but local disk (where page-cache reads beat the exchange),
        when the exchange has a group to send CPU tensors over (a gloo or gloo+NCCL
        group, or the default group, for which one is made: share_groups.py)."""
        if self._read_once is None:
            return not self.fs.local_reads and share_groups.can_share(self.process_group)
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
                return read_metadata_bytes(self.fs, meta_path)
            except FileNotFoundError:
                return absent or self._look()

        def fetch() -> bytes | _Absent:
            if rank is None:  # a checkpoint path that is a neighbour's link is not read
                self.fs.resolve_link(self.path)
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
        self._metadata_rank = rank
        return metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        # ``metadata_name`` (ours): the file ``metadata`` was read from, when it was not
        # read by read_metadata (the copy and verify tools); its seal names it.
        name = kwargs.get("metadata_name") or fmt.metadata_name(self._metadata_rank)
        self._load = LoadContext.for_metadata(
            metadata,
            fs=self.fs,
            path=self.path,
            registry=self.registry,
            keys=self.keys,
            require_encryption=self.require_encryption,
            max_object_bytes=self.max_object_bytes,
            thread_count=self.thread_count,
            budget=self.budget,
            process_group=self.process_group,
            name=name,
        )

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        # Which process each of DCP's ranks is, for the coordinator (prepare_global_plan).
        if plan.storage_data is None:
            return replace(plan, storage_data=share_groups.member())
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        # Under rank-local metadata one key names each rank's own item: nothing is shared.
        if self.read_once and len(plans) > 1 and self._metadata_rank is None:
            share_groups.check_can_share(self.process_group, self.url)
            if share_groups.spans(self.process_group, [p.storage_data for p in plans]):
                load = self._set_up()
                return read_once.assign(plans, load.storage_data, load.chunks)
            if self._read_once:
                raise CheckpointStorageError(
                    f"{self.url}: read_once=True exchanges over the reader's process_group, "
                    "but dcp.load runs on another group; pass the group given to dcp.load "
                    "as process_group= (a gloo one), or read_once=False"
                )
        return plans

    @records_error
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        load = self._set_up()
        if isinstance(plan.storage_data, read_once.SharePlan):
            read_once.read_shared(load, plan, planner)
        else:
            # Before any byte: a target the plan leaves partly without a value.
            load.check_covered(planner, plan.items)
            fetch.read_items(load, plan.items, planner, load.budget)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    @property
    def checkpoint_id(self) -> str | os.PathLike[str]:
        """The location as torch reports it: a ``pathlib.Path`` for a local path, the
        URL string otherwise (``url`` is the normalized URL, ``path`` the backend's)."""
        return stock_checkpoint_id(self._location)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        # As torch's: no to a URL whose protocol nothing here serves, so a caller picking
        # a storage by this answer does not pick one that then fails to open it.
        return serves(checkpoint_id)

    # --- internals ------------------------------------------------------------------

    def _set_up(self) -> LoadContext:
        if self._load is None:
            raise RuntimeError(
                f"{self.url}: the reader has no load set up; call "
                "set_up_storage_reader(metadata, ...) before planning and reading, as dcp.load does"
            )
        return self._load

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
