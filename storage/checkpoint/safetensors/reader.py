"""``SafetensorsReader``: ``dcp.load`` of a Hub-layout model from any backend."""

from __future__ import annotations

import os
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from extensions.errors import quote
from storage.backends.registry import filesystem_from_url
from storage.checkpoint.hook_errors import records_error
from storage.checkpoint.safetensors.header import TensorEntry
from storage.checkpoint.safetensors.reading import read_model, read_region
from storage.checkpoint.tensors import check_writable


class SafetensorsReader(StorageReader):
    """A ``StorageReader`` for a Hugging Face model at ``path`` (a local directory or
    any URL our backends serve): ``model.safetensors.index.json`` and its shards, or a
    single ``model.safetensors``, as transformers' ``save_pretrained``, torch's
    ``HuggingFaceStorageWriter`` and :class:`SafetensorsWriter` write them.

    ``dcp.load(state_dict, storage_reader=SafetensorsReader(url))`` fills a state dict
    of tensors shaped like the model's (any dtype and device: a tensor of another dtype
    is converted). The coordinator reads the index and each file's header once and
    checks them (hostile headers are refused, see ``docs/safetensors.md``); every rank
    then fetches only the bytes its own tensors or shards cover, one ranged read per
    tensor straight into it where it is a CPU tensor of the stored dtype. A tensor read
    whole is checked against the CRC-32C our writer records; a DTensor's shard (part of
    a stored tensor) is not. ``thread_count`` reads run at once (default: the
    backend's ``io_concurrency``).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        storage_options: dict[str, Any] | None = None,
        thread_count: int | None = None,
    ) -> None:
        super().__init__()
        self.storage_options = storage_options
        self.fs, self.path = filesystem_from_url(path, storage_options)
        self.last_error: BaseException | None = None
        self.thread_count = thread_count or self.fs.io_concurrency
        self.load_id = uuid.uuid4().hex
        self.entries: dict[MetadataIndex, TensorEntry] = {}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.last_error = None
        self.load_id = uuid.uuid4().hex
        if checkpoint_id is not None:
            self.fs, self.path = filesystem_from_url(checkpoint_id, self.storage_options)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False  # chosen explicitly, never by torch's auto-selection

    @records_error
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        entries = read_model(self.fs, self.path, self.thread_count)
        tensors: dict[str, Any] = {}
        storage: dict[MetadataIndex, TensorEntry] = {}
        for name, entry in entries.items():
            size = torch.Size(entry.shape)
            zeros = torch.Size([0] * len(size))
            tensors[name] = TensorStorageMetadata(
                properties=TensorProperties(dtype=entry.torch_dtype),
                size=size,
                chunks=[ChunkStorageMetadata(offsets=zeros, sizes=size)],
            )
            storage[MetadataIndex(fqn=name, offset=zeros)] = entry
        meta = StorageMeta(checkpoint_id=self.fs.url(self.path), load_id=self.load_id)
        return Metadata(state_dict_metadata=tensors, storage_data=storage, storage_meta=meta)

    @records_error
    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self.entries = dict(metadata.storage_data or {})

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    @records_error
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        lock = threading.Lock()

        def read(req: ReadItem) -> None:
            entry = self.entries[req.storage_index]
            with lock:
                target = planner.resolve_tensor(req).detach()
            if tuple(target.shape) != tuple(req.lengths):
                raise ValueError(
                    f"{self.fs.url(self.path)}: tensor {quote(entry.name)}: the target has shape "
                    f"{tuple(target.shape)}, the region read {tuple(req.lengths)}; load into a "
                    "state dict shaped like the model"
                )
            check_writable(target, f"{self.fs.url(self.path)}: tensor {quote(entry.name)}")
            read_region(self.fs, self.path, entry, req.storage_offsets, req.lengths, target)
            with lock:
                planner.commit_tensor(req, target)

        items = sorted(
            plan.items, key=lambda r: (self.entries[r.storage_index].file, r.dest_index.fqn)
        )
        with ThreadPoolExecutor(max(1, min(self.thread_count, len(items)))) as pool:
            for done in [pool.submit(read, req) for req in items]:
                done.result()
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut
