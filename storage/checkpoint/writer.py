"""``CheckpointWriter``: a DCP ``StorageWriter`` over any ``FileSystemBase``."""

from __future__ import annotations

import dataclasses
import os
import uuid
from collections.abc import Sequence
from typing import Any

from torch.distributed.checkpoint.filesystem import SerializationFormat
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem
from torch.distributed.checkpoint.staging import DefaultStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from extensions.errors import CheckpointExistsError
from storage.backends.base import FileSystemBase
from storage.backends.registry import serves
from storage.checkpoint import data_files, incremental
from storage.checkpoint import persist as _persist
from storage.checkpoint import storage_format as fmt
from storage.checkpoint._metadata_payload import DCP_VERSION as DCP_VERSION
from storage.checkpoint._metadata_payload import metadata_payload
from storage.checkpoint.attempt import SaveAttempt
from storage.checkpoint.commit import commit_checkpoint
from storage.checkpoint.committed import CommittedCheckpoint
from storage.checkpoint.deadline import Budget
from storage.checkpoint.hook_errors import records_error
from storage.checkpoint.layout import make_directory
from storage.checkpoint.options import (
    WriterSettings,
    check_transforms,
    default_thread_count,
    resolve_location,
    stock_checkpoint_id,
    torch_alias,
)
from storage.checkpoint.staging import WriterStaging


@dataclasses.dataclass(frozen=True)
class _RankPlan:
    rank: int


class CheckpointWriter(StorageWriter, WriterStaging):
    """Write a DCP checkpoint to a local path or any supported URL.

    ``transforms`` are applied in list order to every item (compress, then encrypt).
    Options keep torch's ``FileSystemWriter`` names: ``thread_count`` (parallel files,
    at most one per 32 MiB of tensor data; default from the backend's concurrency),
    ``single_file_per_rank``, ``sync_files`` (data durable before the metadata is
    published), ``per_thread_copy_ahead`` (accepted for compatibility; staging is done
    by DCP's stager), ``overwrite`` (``False`` raises :class:`CheckpointExistsError` if
    a committed checkpoint is there), ``cache_staged_state_dict`` (``dcp.async_save``
    stages through this writer, as through torch's ``FileSystemWriter``: with ``True``
    the staging buffers are kept and reused by the next async save of the same tensors,
    those of CUDA tensors pinned; wait for a save's future before the next one, as
    with torch), ``serialization_format`` (only ``SerializationFormat.TORCH_SAVE``).

    Incremental saves (docs/format.md): ``fingerprint=True`` records a content
    fingerprint per item, so the checkpoint can serve as a base; ``base`` (the path or URL
    of a committed checkpoint beside this one, same parent directory or prefix, or its
    ``committed.CommittedCheckpoint`` read model when the caller has opened it already;
    implies ``fingerprint``) stores every item whose content and transform chain equal the
    base's as a reference to the base's bytes instead of writing it again. Loading such
    a checkpoint needs its bases (``dcp-storage cp`` makes a self-contained copy).

    ``timeout`` (seconds) bounds this rank's storage work in a save, every request of
    it (checking for a checkpoint there, reading the base, the data writes, publishing
    the metadata and the listings around it; ``deadline.Budget``): past it the save
    fails on every rank with :class:`DeadlineExceededError` naming the rank, the item
    and the URL (a request that never completes is cancelled, not waited for; one that
    publishes the metadata may still land, so the save's files are kept).

    ``key_prefixes=N`` (N > 1) puts each rank's data files one directory down, under
    one of N short hex key prefixes (``rank % N``), so an object store spreads the
    requests of a large save over N partitions (storage/checkpoint/prefixes.py,
    docs/scale.md); stock readers load such checkpoints too.

    ``persist`` says where an asynchronous save (``dcp.async_save``, ``async_save``, the
    manager's ``blocking=False`` and its drain) encodes and uploads: ``"process"`` (the
    default where available and the host has a core beyond one per training process on
    it: :func:`storage.checkpoint.persist.default_mode`) in a persist worker process,
    niced, reading the state from shared staging buffers that the training thread copies
    it into, so that the work does not compete with training for the GIL; ``"thread"``
    in DCP's background thread, as stock torch. ``max_bandwidth`` (bytes/s) caps what
    the worker writes to storage. Blocking saves always write in this process. See
    :mod:`storage.checkpoint.persist` and docs/operations.md.

    Staging from CUDA (``persist="process"``): the staging buffers of CUDA tensors are
    pinned (registered with the CUDA host allocator) and the device-to-host copies are
    issued without blocking on a side stream, ordered after the work already queued on
    the current stream. By default :meth:`stage` returns once they completed, so the
    caller may change its tensors when ``dcp.async_save`` returns, as with a CPU state
    dict. ``async_staging=True`` follows torch's ``StagingOptions(use_async_staging=True,
    use_non_blocking_copy=True)`` contract instead: :meth:`stage` returns a future once
    the copies are enqueued, so ``dcp.async_save`` returns an ``AsyncSaveResponse``
    whose ``staging_completion`` resolves when they completed; the tensors must not be
    changed (no optimizer step) before it resolves (or :meth:`synchronize_staging`
    returns). The save's writes wait for the copies either way; the source state dict
    is kept referenced until they completed.

    ``_extensions`` is ``FileSystemWriter``'s (experimental) name for ``transforms``,
    accepted so code written for stock DCP runs unchanged.

    Commit protocol: data files get a per-save unique name; the metadata is published
    last and atomically; files of the checkpoint it replaces are removed only after it
    lands; a failed save removes the files it wrote (``commit.commit_checkpoint``).
    ``publish=False`` writes the data files and keeps the metadata instead of
    publishing it (``unpublished``): a tiered save publishes each node's copy itself.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        transforms: Sequence[Any] | None = None,
        storage_options: dict[str, Any] | None = None,
        thread_count: int | None = None,
        single_file_per_rank: bool = True,
        sync_files: bool = True,
        per_thread_copy_ahead: int = 10_000_000,
        overwrite: bool = True,
        cache_staged_state_dict: bool = False,
        serialization_format: SerializationFormat = SerializationFormat.TORCH_SAVE,
        filesystem: FileSystemBase | None = None,
        base: str | os.PathLike[str] | CommittedCheckpoint | None = None,
        fingerprint: bool = False,
        timeout: float | None = None,
        key_prefixes: int = 0,
        persist: str | None = None,
        max_bandwidth: int | None = None,
        publish: bool = True,
        async_staging: bool = False,
        _extensions: Sequence[Any] | None = None,
    ) -> None:
        super().__init__()
        transforms = torch_alias("transforms", transforms, "_extensions", _extensions)
        settings = WriterSettings(
            thread_count=thread_count,
            single_file_per_rank=single_file_per_rank,
            sync_files=sync_files,
            per_thread_copy_ahead=per_thread_copy_ahead,
            overwrite=overwrite,
            cache_staged_state_dict=cache_staged_state_dict,
            serialization_format=serialization_format,
            base=base,
            fingerprint=fingerprint,
            timeout=timeout,
            key_prefixes=key_prefixes,
            persist=persist,
            max_bandwidth=max_bandwidth,
            publish=publish,
            async_staging=async_staging,
        )
        self._lease: _persist.Lease | None = None  # staging buffers kept between saves, held
        self.timeout = settings.timeout
        self.budget = Budget(self.timeout)
        self.key_prefixes = key_prefixes
        self.transforms = check_transforms(transforms)
        self.storage_options = storage_options
        self._explicit_fs = filesystem
        self.fs, self.path = resolve_location(path, storage_options, filesystem)
        self._location = path  # as given: checkpoint_id reports it as stock does
        self.persist_mode = settings.persist_mode(self.fs)
        self.thread_count = thread_count or default_thread_count(self.fs)
        self.async_staging = async_staging
        self.single_file_per_rank, self.sync_files = single_file_per_rank, sync_files
        self.per_thread_copy_ahead, self.overwrite = per_thread_copy_ahead, overwrite
        self.cache_staged_state_dict = cache_staged_state_dict
        self.serialization_format = serialization_format
        self.base = base
        self.fingerprint = fingerprint or base is not None
        self._base: incremental.Base | None = None
        self._stager: DefaultStager | None = None  # kept between saves when caching
        self.rank = 0
        self.use_collectives = True
        self.is_coordinator = True
        self.save_id = uuid.uuid4().hex[:12]
        self._save_id_used = False  # a save was set up with it: the next one needs another
        self.last_error: BaseException | None = None
        #: The save in progress (or the last one): what it wrote, its deadline, its commit.
        self.attempt = SaveAttempt(self.fs, self.path, self.save_id, self.budget)
        #: The metadata the last save published (``None`` before, or when it failed).
        self.published: Metadata | None = None
        self.publish = publish
        #: With ``publish=False``: the metadata the last save made and its serialized
        #: payload, for the caller to publish (``None`` on ranks that do not commit).
        self.unpublished: tuple[Metadata, bytes] | None = None

    # --- StorageWriter --------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id:
            self.fs, self.path = resolve_location(
                checkpoint_id, self.storage_options, self._explicit_fs
            )
            self._location = checkpoint_id
            self.persist_mode = _persist.for_filesystems(self.persist_mode, self.fs)
        self.save_id = uuid.uuid4().hex[:12]
        self._save_id_used = False
        self.last_error = None

    def _next_save_id(self) -> None:
        """A fresh save id once a save was set up with the current one (DCP calls
        reset() only when a checkpoint_id is passed): it names the data files, so a
        reused writer never writes into the files a committed metadata points at."""
        if self._save_id_used:
            self.save_id = uuid.uuid4().hex[:12]
            self._save_id_used = False

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        # DCP asks storage_meta() for the planner just before this: both name one save.
        self._next_save_id()
        self._save_id_used = True
        self.last_error = None
        self.published = None
        self.unpublished = None
        self._base = None
        self.budget.restart()
        self.attempt = SaveAttempt(self.fs, self.path, self.save_id, self.budget)
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank") or 0)
        self.use_collectives = bool(kwargs.get("use_collectives", True))

    @records_error
    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        meta_path = self._metadata_path()
        # With collectives the coordinator alone asks (its error reaches every rank):
        # one request per save, not one per rank. Without, each rank asks for its own
        # metadata only (stock asks for rank 0's, which a faster rank 0 of this very save
        # may already have published).
        asks = self.is_coordinator or not self.use_collectives

        def prepare() -> None:
            if not self.overwrite and asks and self.fs.exists(meta_path):
                raise CheckpointExistsError(
                    f"Checkpoint already exists at {self.url} and overwrite=False; "
                    "pick a new location or pass overwrite=True"
                )
            if self.base is not None:
                self._base = incremental.open_base(self.fs, self.path, self.base, self.transforms)
            make_directory(self.fs, self.path)

        try:
            self.budget.call(
                prepare,
                action="saving",
                location=self.url,
                item=fmt.METADATA_NAME,
                url=self.fs.url(meta_path),
            )
        except BaseException:
            # DCP calls nothing more on this writer: this save never writes, and the
            # staging buffers must not stay held by a writer the caller still keeps.
            self._release()
            raise
        return dataclasses.replace(plan, storage_data=_RankPlan(self.rank))

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [
            dataclasses.replace(plan, storage_data=_RankPlan(rank))
            if self.use_collectives
            else plan
            for rank, plan in enumerate(plans)
        ]

    @records_error
    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        rank = plan.storage_data.rank if isinstance(plan.storage_data, _RankPlan) else self.rank
        items: list[WriteItem] = list(plan.items)
        lease = self._take_staged()  # its copies from a device done: the writes read it
        files, threads = data_files.split_into_files(
            items,
            rank=rank,
            save_id=self.attempt.save_id,
            thread_count=self.thread_count,
            single_file_per_rank=self.single_file_per_rank,
            key_prefixes=self.key_prefixes,
        )
        per_file = self._write_staged(lease, files, threads, planner)
        results = [result for rs in per_file for result in rs]
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def write_files(
        self, files: list[tuple[str, list[WriteItem]]], threads: int, planner: Any
    ) -> list[list[WriteResult]]:
        """Write ``files`` (name, items) on up to ``threads`` threads with the data
        ``planner.resolve_data`` gives; on failure remove what was written and raise.
        The persist worker runs this too, with the staged data (``data_files.py``)."""
        settings = data_files.FileSettings(
            self.transforms,
            self.rank,
            self.sync_files,
            self.fingerprint,
            self._base,
            data_files.recorded_save(self.transforms, self.attempt.save_id),
        )
        return data_files.write_files(self.attempt, settings, files, threads, planner)

    @records_error
    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        if not self.publish:
            self.unpublished = (metadata, self.metadata_payload(metadata, results))
            return
        try:
            commit_checkpoint(
                self.fs,
                self.path,
                self._metadata_name(),
                lambda: self.metadata_payload(metadata, results),
                save_id=self.attempt.save_id,
                infos=[wr.storage_data for rs in results for wr in rs],
                overwrite=self.overwrite,
                sync=self.sync_files,
                budget=self.budget,
                home=self.attempt.home,
            )
        except BaseException as exc:
            # Landed, may have (the answer was lost), or still may (a publish past the
            # deadline goes on): its files must stay, and every other rank's files too.
            self.attempt.commit_failed(exc)
            raise
        self.attempt.landed()
        self.published = metadata

    def metadata_payload(self, metadata: Metadata, results: list[list[WriteResult]]) -> bytes:
        """The serialized metadata :meth:`finish` publishes: ``metadata`` completed and
        sealed as :mod:`storage.checkpoint._metadata_payload` says."""
        return metadata_payload(
            metadata,
            results,
            url=self.url,
            save_id=self.attempt.save_id,
            name=self._metadata_name(),
            transforms=self.transforms,
            fingerprint=self.fingerprint,
            base=self._base,
        )

    def abort(self, error: BaseException | None = None) -> None:
        """Remove the data files this rank wrote in the current save, unless it was
        committed or ``error`` (the save's error, e.g. DCP's ``CheckpointException``)
        says the coordinator's commit may have landed: only the coordinator can tell,
        and every rank follows its verdict. DCP calls nothing on a rank when another
        rank's part failed; the one-call helpers call this so such saves leave nothing
        behind. :class:`~storage.checkpoint.attempt.SaveAttempt` does it: within what
        is left of the deadline, then in the background."""
        self._release()
        self.attempt.abort(error)

    def storage_meta(self) -> StorageMeta | None:
        """The next save's: DCP asks for it (for the planner) just before
        ``set_up_storage_writer``, and that save's metadata records this save id."""
        self._next_save_id()
        return StorageMeta(checkpoint_id=self.url, save_id=self.save_id)

    @property
    def checkpoint_id(self) -> str | os.PathLike[str]:
        """The location as torch reports it: a ``pathlib.Path`` for a local path, the
        URL string otherwise (``url`` is the normalized URL, ``path`` the backend's)."""
        return stock_checkpoint_id(self._location)

    @property
    def url(self) -> str:
        return self.fs.url(self.path)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        # As torch's: no to a URL whose protocol nothing here serves, so a caller picking
        # a storage by this answer does not pick one that then fails to open it.
        return serves(checkpoint_id)

    # --- internals ------------------------------------------------------------------

    def _metadata_name(self) -> str:
        return fmt.metadata_name(None if self.use_collectives else self.rank)

    def _metadata_path(self) -> str:
        return self.fs.concat_path(self.path, self._metadata_name())
