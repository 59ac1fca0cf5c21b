"""``CheckpointWriter``: a DCP ``StorageWriter`` over any ``FileSystemBase``."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import io
import os
import threading
import uuid
from collections.abc import Sequence
from typing import IO, Any, cast

import torch
from torch.distributed.checkpoint.filesystem import SerializationFormat
from torch.distributed.checkpoint.metadata import STATE_DICT_TYPE, Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.staging import AsyncStager, DefaultStager, StagingOptions
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from extensions._compat import item_size, save_tensor_archive, split_by_size_and_type
from extensions.base import ItemInfo
from extensions.errors import CheckpointExistsError
from storage.backends.base import FileSystemBase
from storage.checkpoint import format as fmt
from storage.checkpoint._common import (
    check_thread_count,
    default_thread_count,
    records_error,
    resolve_location,
    stock_checkpoint_id,
)
from storage.checkpoint.commit import (
    commit_may_have_landed,
    mark_may_have_landed,
    metadata_may_name,
    publish_metadata,
    remove_quietly,
)
from storage.checkpoint.items import ItemEncoder

DCP_VERSION = "1.0.0"
SMALL_TENSOR = 1 << 20
BYTES_PER_THREAD = 32 << 20


@dataclasses.dataclass(frozen=True)
class _RankPlan:
    rank: int


class CheckpointWriter(StorageWriter, AsyncStager):
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
    pinned where CUDA is available; wait for a save's future before the next one, as
    with torch), ``serialization_format`` (only ``SerializationFormat.TORCH_SAVE``).

    Commit protocol: data files get a per-save unique name; the metadata is published
    last and atomically; files of the checkpoint it replaces are removed only after it
    lands; a failed save removes the files it wrote.
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
    ) -> None:
        super().__init__()
        _check_serialization_format(serialization_format)
        self.transforms = _check_transforms(transforms)
        self.storage_options = storage_options
        self._explicit_fs = filesystem
        self.fs, self.path = resolve_location(path, storage_options, filesystem)
        self._location = path  # as given: checkpoint_id reports it as stock does
        self.thread_count = check_thread_count(thread_count) or default_thread_count(self.fs)
        for name, value in (
            ("single_file_per_rank", single_file_per_rank),
            ("sync_files", sync_files),
            ("overwrite", overwrite),
            ("cache_staged_state_dict", cache_staged_state_dict),
        ):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, got {value!r}")
        self.single_file_per_rank = single_file_per_rank
        self.sync_files = sync_files
        self.per_thread_copy_ahead = per_thread_copy_ahead
        self.overwrite = overwrite
        self.cache_staged_state_dict = cache_staged_state_dict
        self.serialization_format = serialization_format
        self._stager: DefaultStager | None = None  # kept between saves when caching
        self.rank = 0
        self.use_collectives = True
        self.is_coordinator = True
        self.save_id = uuid.uuid4().hex[:12]
        self.last_error: BaseException | None = None
        self._written: list[str] = []  # data files this save wrote (for abort)
        self._committed = False

    # --- AsyncStager ----------------------------------------------------------------

    # Staging blocks until the copy is done: dcp.async_save has nothing to wait for.
    _synchronize_after_execute: bool = False

    def stage(self, state_dict: STATE_DICT_TYPE) -> STATE_DICT_TYPE:
        """A CPU copy of ``state_dict`` that training may not change (``dcp.async_save``)."""
        if self.cache_staged_state_dict:
            if self._stager is None:
                self._stager = DefaultStager(_staging_options(pin=torch.cuda.is_available()))
            return cast(STATE_DICT_TYPE, self._stager.stage(state_dict))
        stager = DefaultStager(_staging_options(pin=False))
        try:
            return cast(STATE_DICT_TYPE, stager.stage(state_dict))
        finally:
            stager.close()

    def synchronize_staging(self) -> None:
        """Nothing to wait for: :meth:`stage` returns once the copy is done."""

    def close(self) -> None:
        """Release the cached staging buffers (``cache_staged_state_dict``)."""
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    def __getstate__(self) -> dict[str, Any]:
        # A process-based async save ships the writer, never its staging buffers.
        state = self.__dict__.copy()
        state["_stager"] = None
        return state

    # --- StorageWriter --------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id:
            self.fs, self.path = resolve_location(
                checkpoint_id, self.storage_options, self._explicit_fs
            )
            self._location = checkpoint_id
        self.save_id = uuid.uuid4().hex[:12]
        self.last_error = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        # Called once per save (reset() only when a checkpoint_id is passed): a fresh
        # save id keeps a reused writer from writing into the committed files.
        self.save_id = uuid.uuid4().hex[:12]
        self.last_error = None
        self._written = []
        self._committed = False
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank") or 0)
        self.use_collectives = bool(kwargs.get("use_collectives", True))

    @records_error
    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        meta_path = self._metadata_path()
        if not self.overwrite and self.fs.exists(meta_path):
            raise CheckpointExistsError(
                f"Checkpoint already exists at {self.url} and overwrite=False; "
                "pick a new location or pass overwrite=True"
            )
        self.fs.mkdir(self.path)
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
        # Per-item work (pickling, torch.save's archive) holds the GIL: parallel files pay
        # off only with enough bytes per thread to overlap I/O and compression.
        total = sum(item_size(i) for i in plan.items if i.type != WriteItemType.BYTE_IO)
        threads = max(1, min(self.thread_count, total // BYTES_PER_THREAD))
        if self.single_file_per_rank:
            buckets = [b for b in split_by_size_and_type(threads, plan.items) if b]
        else:
            buckets = [[item] for item in plan.items]
        files = [(fmt.data_file_name(rank, n, self.save_id), b) for n, b in enumerate(buckets)]
        lock = threading.Lock()

        def write_one(name: str, items: list[WriteItem]) -> list[WriteResult]:
            path = self.fs.concat_path(self.path, name)
            with lock:
                self._written.append(path)
            return self._write_file(path, name, items, planner)

        results: list[WriteResult] = []
        with concurrent.futures.ThreadPoolExecutor(
            max_workers=max(1, min(threads, len(files))),
            thread_name_prefix="dcp-storage-write",
        ) as pool:
            futures = [pool.submit(write_one, name, items) for name, items in files]
            errors = []
            for fut in futures:
                try:
                    results.extend(fut.result())
                except BaseException as exc:  # noqa: BLE001 - re-raised below
                    errors.append(exc)
        if errors:
            self.abort()
            raise errors[0]
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    @records_error
    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        new_files = {wr.storage_data.relative_path for rs in results for wr in rs}
        try:
            publish_metadata(
                self.fs,
                self.path,
                self._metadata_path(),
                self.metadata_payload(metadata, results),
                new_files=new_files,
                overwrite=self.overwrite,
                sync=self.sync_files,
            )
        except BaseException as exc:
            if metadata_may_name(self.fs, self._metadata_path(), self.save_id):
                self._committed = True  # it landed (or may have): its files must stay
                mark_may_have_landed(exc)  # ... and every other rank's files too
            else:
                remove_quietly(self.fs, [self.fs.concat_path(self.path, f) for f in new_files])
            raise
        self._committed = True

    def metadata_payload(self, metadata: Metadata, results: list[list[WriteResult]]) -> bytes:
        """The serialized metadata :meth:`finish` publishes: ``metadata`` completed with
        the storage index of ``results`` and this save's id."""
        metadata.storage_data = {wr.index: wr.storage_data for rs in results for wr in rs}
        metadata.storage_meta = self.storage_meta()
        metadata.version = DCP_VERSION
        return fmt.dump_metadata(metadata)

    def abort(self, error: BaseException | None = None) -> None:
        """Remove the data files this rank wrote in the current save, unless it was
        committed or ``error`` (the save's error, e.g. DCP's ``CheckpointException``)
        says the coordinator's commit may have landed: only the coordinator can tell,
        and every rank follows its verdict. DCP calls nothing on a rank when another
        rank's part failed; the one-call helpers call this so such saves leave nothing
        behind."""
        if not self._committed and not commit_may_have_landed(error):
            remove_quietly(self.fs, list(self._written))
            self._written.clear()

    def storage_meta(self) -> StorageMeta | None:
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
        return isinstance(checkpoint_id, (str, os.PathLike))

    # --- internals ------------------------------------------------------------------

    def _metadata_path(self) -> str:
        rank = None if self.use_collectives else self.rank
        return self.fs.concat_path(self.path, fmt.metadata_name(rank))

    def _write_file(
        self, path: str, name: str, items: list[WriteItem], planner: SavePlanner
    ) -> list[WriteResult]:
        # Opaque bytes first, then tensors (largest first), as torch orders them.
        ordered = [i for i in items if i.type == WriteItemType.BYTE_IO] + [
            i for i in items if i.type != WriteItemType.BYTE_IO
        ]
        results = []
        with self.fs.create_stream(path, "wb", sync=self.sync_files) as stream:
            offset = 0
            for item in ordered:
                result = self._write_item(stream, name, offset, item, planner)
                offset += result.storage_data.length
                results.append(result)
        return results

    def _write_item(
        self, stream: Any, name: str, offset: int, item: WriteItem, planner: SavePlanner
    ) -> WriteResult:
        label = fmt.item_label(item.index)
        data = planner.resolve_data(item)
        tensor: torch.Tensor | None = None
        if item.type != WriteItemType.BYTE_IO:
            tensor = _plain_cpu_tensor(data)
        info = ItemInfo(
            checkpoint=self.url,
            item=label,
            dtype=str(tensor.dtype).removeprefix("torch.") if tensor is not None else None,
            element_size=tensor.element_size() if tensor is not None else None,
        )
        encoder = ItemEncoder(stream, self.transforms, info)
        plain = encoder.plain
        extra: dict[str, Any] = {}
        if tensor is None:
            assert isinstance(data, io.BytesIO)
            plain.write(data.getbuffer())
        else:
            nbytes = tensor.numel() * tensor.element_size()
            if nbytes < SMALL_TENSOR:
                # torch.save makes ~40 tiny writes per tensor: let a BytesIO take them
                # and hand the archive on in one piece.
                archive = io.BytesIO()
                save_tensor_archive(tensor, archive)
                tracker = fmt.ArchiveTracker(plain, keep_below=archive.tell() + 1)
                tracker.write(archive.getbuffer())
            else:
                tracker = fmt.ArchiveTracker(plain)
                save_tensor_archive(tensor, cast(IO[bytes], tracker))
            tracker.flush()
            data_offset = tracker.data_offset(nbytes)
            if data_offset is not None:
                extra["data_offset"] = data_offset
                extra["dtype"] = str(tensor.dtype).removeprefix("torch.")
                extra["nbytes"] = nbytes
        count, extra["crc32c"] = encoder.close()
        return WriteResult(
            index=item.index,
            size_in_bytes=count,
            storage_data=fmt.new_storage_info(name, offset, count, encoder.descriptors, extra),
        )


def _plain_cpu_tensor(data: object) -> torch.Tensor:
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"planner resolved a tensor item to {type(data).__name__}")
    tensor = data.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    # torch.save stores the whole storage and its strides: keep exactly the bytes of
    # this tensor, in row-major order, so the stored record is the tensor itself.
    if (
        not tensor.is_contiguous()
        or tensor.storage_offset() != 0
        or tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size()
    ):
        tensor = tensor.contiguous().clone() if tensor.is_contiguous() else tensor.contiguous()
    return tensor


def _staging_options(*, pin: bool) -> StagingOptions:
    # What dcp.async_save stages with by default, plus pinned buffers when caching on GPU.
    return StagingOptions(
        use_pinned_memory=pin,
        use_shared_memory=False,
        use_async_staging=False,
        use_non_blocking_copy=False,
    )


def _check_serialization_format(value: object) -> None:
    if value == SerializationFormat.TORCH_SAVE:
        return
    if value == getattr(SerializationFormat, "SAFETENSORS", None):
        raise ValueError(
            "serialization_format=SAFETENSORS is not supported: items are stored as torch.save "
            "archives (SerializationFormat.TORCH_SAVE), which is what stock readers expect; "
            "for safetensors files use torch's HuggingFaceStorageWriter"
        )
    raise TypeError(f"serialization_format must be a torch SerializationFormat, got {value!r}")


def _check_transforms(transforms: Sequence[Any] | None) -> list[Any]:
    if transforms is None:
        return []
    if isinstance(transforms, (str, bytes)) or not isinstance(transforms, Sequence):
        raise TypeError(
            "transforms must be a list of transform instances, e.g. [extensions.ZStandard()]"
        )
    for t in transforms:
        if isinstance(t, type) or not all(
            hasattr(t, a) for a in ("transform_to", "get_descriptor", "registry_name")
        ):
            raise TypeError(
                f"{t!r} is not a stream transform instance; pass e.g. extensions.ZStandard(), "
                "not the class"
            )
    return list(transforms)
