"""``SafetensorsWriter``: ``dcp.save`` into a Hugging Face Hub layout on any backend."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import crc32c
import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from extensions.errors import quote
from storage.backends.registry import filesystem_from_url
from storage.checkpoint import heartbeat, savable
from storage.checkpoint.hook_errors import records_error
from storage.checkpoint.safetensors.consolidate import Piece, Staged, byte_range, consolidate
from storage.checkpoint.safetensors.files import (
    Replaced,
    commit_model,
    new_names,
    refuse_existing,
    split,
    write_file,
)
from storage.checkpoint.safetensors.header import check_name, dtype_name, nbytes, new_write_id
from storage.checkpoint.safetensors.staging import (
    STALE_AFTER,
    beating,
    new_area,
    object_name,
    remove_staging,
    sweep,
)
from storage.checkpoint.tensors import tensor_bytes

log = logging.getLogger(__name__)


def refuse_transforms(transforms: object) -> None:
    """Transforms have no place in a safetensors file: every reader maps its bytes."""
    if transforms:
        raise ValueError(
            "safetensors files hold plain tensor bytes that every reader (transformers, "
            "vLLM, safetensors itself) maps as they are: transforms (compression, "
            "encryption) do not apply; drop transforms=, or save a DCP checkpoint with "
            "storage.CheckpointWriter to keep them"
        )


class SafetensorsWriter(StorageWriter):
    """A ``StorageWriter`` that saves a state dict of tensors as a Hub-layout model
    (``model.safetensors``, or ``model-0000N-of-0000M.safetensors`` plus
    ``model.safetensors.index.json``) at ``path``: a local directory or any URL our
    backends serve (``s3://``, ``gs://``, fsspec). Files are byte for byte what
    ``safetensors.torch.save`` writes, plus each tensor's CRC-32C in ``__metadata__``.

    ``dcp.save(state_dict, storage_writer=SafetensorsWriter(url))`` on one process or on
    N ranks. Whole tensors (replicated ones are saved once, by the planner's choice of
    rank): each rank writes its own files (default: one file per rank), the coordinator
    the index last, then commits (``files.commit_model``). DTensor/ShardedTensor shards
    along dimension 0 are consolidated (see ``consolidate``): each rank stages its
    shards' bytes under ``path``, the coordinator writes whole tensors into the files
    (default: one file) from those, a bounded buffer at a time, then the index, commits
    and removes the staging area; shards whose bytes are not one contiguous range
    (``Shard(1)`` of a matrix) are refused with the fix. The coordinator first removes
    the staging areas that killed saves left at ``path``: those without a live heartbeat
    whose objects are all older than an hour (``staging``; ``dcp-storage gc`` does the
    same with its ``--grace``). Files are cut at ``max_shard_size`` bytes. A committed
    model already at ``path`` is refused unless ``overwrite``; one replaced stays whole
    until the new one is committed, its files removed after. ``transforms`` are refused.
    ``thread_count`` files are written at once (each holds a file's tensors on the CPU
    while it writes).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        storage_options: dict[str, Any] | None = None,
        max_shard_size: int | None = None,
        overwrite: bool = False,
        thread_count: int = 1,
        transforms: Sequence[object] | None = None,
    ) -> None:
        super().__init__()
        refuse_transforms(transforms)
        if max_shard_size is not None and max_shard_size <= 0:
            raise ValueError(f"max_shard_size must be a positive byte count, got {max_shard_size}")
        if thread_count < 1:
            raise ValueError(f"thread_count must be at least 1, got {thread_count}")
        self.storage_options = storage_options
        self.max_shard_size = max_shard_size
        self.overwrite = overwrite
        self.thread_count = thread_count
        self.fs, self.path = filesystem_from_url(path, storage_options)
        self.last_error: BaseException | None = None
        self.is_coordinator = False
        self.write_id = new_write_id()
        self.replaced: Replaced | None = None  # what commit_model may remove (new_names)
        #: The folder as resolved when this rank's save began (``heartbeat.resolved``):
        #: every file is written and removed inside it, never through a link swapped in.
        self.home = self.path

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.last_error = None
        if checkpoint_id is not None:
            self.fs, self.path = filesystem_from_url(checkpoint_id, self.storage_options)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False  # chosen explicitly, never by torch's auto-selection

    @records_error
    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.home = heartbeat.resolved(self.fs, self.path)
        if is_coordinator:  # the old model stays until the new one is committed
            refuse_existing(self.fs, self.path, overwrite=self.overwrite)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.fs.url(self.path))

    @records_error
    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        for item in plan.items:
            _check_item(item, self.fs.url(self.path))
        return plan

    @records_error
    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # Every rank's prepare_local_plan passed: a state dict refused there (an item
        # that is no tensor, a dtype or name safetensors cannot hold) left the old model.
        shards = any(_is_shard(i) for plan in plans for i in plan.items)
        groups = [
            split(
                [(i.index.fqn, _size(i)) for i in plan.items if i.tensor_data is not None],
                self.max_shard_size,
            )
            for plan in plans
        ]
        count = sum(len(g) for g in groups)
        if not count:
            raise ValueError(
                f"{self.fs.url(self.path)}: the state dict holds no tensors; nothing to save"
            )
        # A model committed since set_up_storage_writer is refused too; the one this
        # replaces stays whole until the commit (finish: files.commit_model).
        refuse_existing(self.fs, self.path, overwrite=self.overwrite)
        # One id per save, the coordinator's, in every file and the index (files.py).
        self.write_id = new_write_id()
        try:
            sweep(self.fs, self.path, STALE_AFTER)
        except Exception as exc:  # the save does not depend on it; gc sweeps too
            log.warning("%s: staging areas not swept: %s", self.fs.url(self.path), exc)
        if shards:
            area = new_area()
            return [
                dataclasses.replace(plan, storage_data=Staged(object_name(area, rank)))
                for rank, plan in enumerate(plans)
            ]
        names, self.replaced = new_names(self.fs, self.path, count, self.write_id, home=self.home)
        named = iter(names)
        out = []
        for plan, rank_groups in zip(plans, groups):
            mapping = {fqn: name for group, name in zip(rank_groups, named) for fqn in group}
            out.append(dataclasses.replace(plan, storage_data=_Files(mapping, self.write_id)))
        return out

    @records_error
    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        fut: Future[list[WriteResult]] = Future()
        if isinstance(plan.storage_data, Staged):
            fut.set_result(self._stage(plan.storage_data.object, plan, planner))
            return fut
        files: _Files = plan.storage_data
        by_file: dict[str, list[WriteItem]] = defaultdict(list)
        for item in plan.items:
            by_file[files.names[item.index.fqn]].append(item)

        url = self.fs.url(self.path)

        def write(name: str) -> list[WriteResult]:
            items = by_file[name]
            tensors = [(i.index.fqn, _cpu(savable.resolve(planner, i, url))) for i in items]
            path = self.fs.concat_path(self.path, name)
            write_file(self.fs, path, tensors, write_id=files.write_id, home=self.home)
            return [
                WriteResult(index=i.index, size_in_bytes=_size(i), storage_data=name) for i in items
            ]

        with ThreadPoolExecutor(max(1, min(self.thread_count, len(by_file)))) as pool:
            results = [r for rs in pool.map(write, sorted(by_file)) for r in rs]
        fut.set_result(results)
        return fut

    def _stage(self, name: str, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        """Consolidation, step 1: this rank's shards back to back in its staging object."""
        results: list[WriteResult] = []
        if not plan.items:
            return results
        at = 0
        area = name.rsplit("/", 1)[0]
        with (
            beating(self.fs, self.path, area, home=self.home),
            self.fs.create_stream_in(self.home, name, "wb", sync=True) as out,
        ):
            for item in plan.items:
                assert item.tensor_data is not None
                data = item.tensor_data
                span = byte_range(
                    data.chunk.offsets, data.chunk.sizes, data.size, data.properties.dtype
                )
                assert span is not None  # prepare_local_plan refused the others
                raw = tensor_bytes(_cpu(savable.resolve(planner, item, self.fs.url(self.path))))
                out.write(raw)
                piece = Piece(name, at, span[0], span[1], crc32c.crc32c(raw))
                results.append(WriteResult(item.index, span[1], piece))
                at += span[1]
        return results

    @records_error
    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        flat = [r for rank in results for r in rank]
        pieces = [(r.index.fqn, r.storage_data) for r in flat if isinstance(r.storage_data, Piece)]
        if pieces:
            area = pieces[0][1].object.rsplit("/", 1)[0]
            try:
                with beating(self.fs, self.path, area, home=self.home):
                    consolidate(
                        self.fs,
                        self.path,
                        metadata,
                        pieces,
                        max_shard_size=self.max_shard_size,
                        threads=self.thread_count,
                        write_id=self.write_id,
                        home=self.home,
                    )
            finally:
                remove_staging(self.fs, self.path, [p.object for _, p in pieces])
            return
        weight_map = {r.index.fqn: str(r.storage_data) for r in flat}
        total = sum(r.size_in_bytes for r in flat)
        assert self.replaced is not None  # prepare_global_plan ran on the coordinator
        commit_model(self.fs, self.path, weight_map, total, self.write_id, self.replaced)


@dataclasses.dataclass(frozen=True)
class _Files:
    """A rank's save plan (whole tensors): the file each of its tensors goes into, and
    the save's write id, which every file records."""

    names: dict[str, str]  #: fqn -> file name
    write_id: str


def _check_item(item: WriteItem, url: str) -> None:
    fqn = item.index.fqn
    where = f"{url}: item {quote(fqn)}"
    if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
        raise TypeError(
            f"{where} is not a tensor; a safetensors file holds tensors only: leave it out of "
            "the state dict (save it with storage.save beside the model if it is needed)"
        )
    data = item.tensor_data
    check_name(fqn, where)
    dtype_name(data.properties.dtype, where)
    if byte_range(data.chunk.offsets, data.chunk.sizes, data.size, data.properties.dtype) is None:
        raise ValueError(
            f"{where} is a shard (offsets {tuple(data.chunk.offsets)}, sizes "
            f"{tuple(data.chunk.sizes)} of {tuple(data.size)}) whose bytes are not one "
            "contiguous range of the tensor; SafetensorsWriter consolidates shards along "
            "dimension 0 only: reshard it to Shard(0), or gather full tensors first, e.g. "
            "get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, "
            "cpu_offload=True))"
        )


def _is_shard(item: WriteItem) -> bool:
    data = item.tensor_data
    return data is not None and tuple(data.chunk.sizes) != tuple(data.size)


def _size(item: WriteItem) -> int:
    assert item.tensor_data is not None
    return nbytes(item.tensor_data.properties.dtype, item.tensor_data.size)


def _cpu(data: Any) -> torch.Tensor:
    assert isinstance(data, torch.Tensor)
    return data.detach().cpu().contiguous()
