"""``LoadContext``: what one load needs, owned in one place for the load's lifetime."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlanner, ReadItem

from extensions.base import ItemInfo, KeyLookup, Keys
from extensions.errors import IntegrityError
from extensions.registry import ExtensionRegistry
from storage.backends.base import FileSystemBase
from storage.checkpoint import storage_format as fmt
from storage.checkpoint.coverage import Shortfall, check_covered, uncovered
from storage.checkpoint.deadline import Budget
from storage.checkpoint.items import encryption_required
from storage.checkpoint.seal import SealCheck

#: A tensor item's stored chunk: its sizes and dtype, as the metadata records them.
Chunk = tuple[torch.Size, torch.dtype]
Chunks = Mapping[MetadataIndex, Chunk]


@dataclass(frozen=True)
class LoadContext:
    """Everything one load reads with, fixed when the load is set up.

    ``CheckpointReader`` builds one per load, in ``set_up_storage_reader``, from the
    metadata the load validated (:meth:`for_metadata`), and hands it to the parts that
    carry the load out: ``fetch.py`` (item reads), ``read_once.py`` (reading once and
    sharing over the process group), and through them ``frames.py`` and ``decode.py``.
    Those parts see the load only through this object, never the reader, so what a load
    reads with is what it was set up with: a later ``reset`` or ``set_up_storage_reader``
    builds a new context and leaves one in use untouched.

    It holds the location (``fs``, ``path`` and its ``url``, which every error names),
    the metadata's read model (``storage_data``: each item's record; ``chunks``: each
    tensor item's stored sizes and dtype; ``uncovered``: the tensor items whose chunks
    leave elements without a stored value, ``coverage.uncovered``), how items decode
    (``registry``, resolved once per load so registrations made before the load count;
    ``keys``, the caller's keys or key provider; ``require_encryption``), the bound on
    a non-tensor item's decoded size (``max_object_bytes``), the reader's
    ``thread_count``, the load's deadline (``budget``, the reader's, restarted when the
    load reads its global metadata), the ``process_group`` read-once shares over, and
    the check of the metadata's ``seal`` (``storage.checkpoint.seal``, made once, by
    the first read that needs it). Nothing else changes once built (the mappings are
    the load's and nobody writes them); it tracks nothing a load reads (each read's
    progress lives in the read)."""

    fs: FileSystemBase
    path: str
    url: str
    storage_data: Mapping[MetadataIndex, Any]
    chunks: Chunks
    uncovered: Mapping[str, Shortfall]
    registry: ExtensionRegistry
    keys: Keys | None = field(repr=False)  # key bytes: never in a repr
    require_encryption: bool
    max_object_bytes: int
    thread_count: int
    budget: Budget
    process_group: Any
    seal: SealCheck = field(repr=False)

    def item_info(self, index: MetadataIndex, keys: KeyLookup | None, record: Any) -> ItemInfo:
        """What the transforms are told of the item at ``index`` (recorded as
        ``record``): its name, identity, dtype, the save it is bound to, ``keys``."""
        chunk = self.chunks.get(index)
        return ItemInfo(
            checkpoint=self.url,
            item=fmt.item_label(index),
            identity=fmt.item_identity(index),
            dtype=str(chunk[1]).removeprefix("torch.") if chunk else None,
            element_size=chunk[1].itemsize if chunk else None,
            keys=keys,
            save=fmt.stored_item(record).save,
        )

    def check_covered(self, planner: LoadPlanner, reads: Iterable[ReadItem]) -> None:
        """Refuse, before anything is read, a load whose ``reads`` leave part of a target
        of ``planner`` without a value, where the item's stored chunks hold fewer
        elements than the tensor has (``coverage.py``)."""
        check_covered(self.url, self.uncovered, planner, reads)

    def check_seal(self, keys: KeyLookup | None) -> None:
        """Where keys were given, the seal of the whole metadata (checked once per load,
        whichever items it reads: ``seal.SealCheck.require_all``)."""
        if encryption_required(None, self.keys):
            self.seal.require_all(
                self.registry, lambda index: self.item_info(index, keys, self.storage_data[index])
            )

    @classmethod
    def for_metadata(
        cls,
        metadata: Metadata,
        *,
        fs: FileSystemBase,
        path: str,
        registry: ExtensionRegistry | None,
        keys: Keys | None,
        require_encryption: bool,
        max_object_bytes: int,
        thread_count: int,
        budget: Budget,
        process_group: Any,
        name: str = ".metadata",
    ) -> LoadContext:
        """The context of a load of ``metadata`` (stored as the file ``name``) at
        ``path`` on ``fs``; ``registry``
        ``None`` is the default registry, built here. Raises :class:`IntegrityError`
        naming the checkpoint when the metadata has no storage index."""
        url = fs.url(path)
        if metadata.storage_data is None:
            raise IntegrityError(f"{url}: metadata has no storage index")
        chunks: dict[MetadataIndex, Chunk] = {}
        for fqn, md in metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                for chunk in md.chunks:
                    chunks[MetadataIndex(fqn, chunk.offsets)] = (chunk.sizes, md.properties.dtype)
        return cls(
            fs=fs,
            path=path,
            url=url,
            storage_data=metadata.storage_data,
            chunks=chunks,
            uncovered=uncovered(metadata),
            registry=ExtensionRegistry() if registry is None else registry,
            keys=keys,
            require_encryption=require_encryption,
            max_object_bytes=max_object_bytes,
            thread_count=thread_count,
            budget=budget,
            process_group=process_group,
            seal=SealCheck(metadata, url, name),
        )
