"""Every metadata that commits a checkpoint, each with a reader set up on it.

The tools behind the CLI (``describe``, ``verify``, ``copy``) and the tier drain work
item by item on these: a :class:`Part` per metadata (the global ``.metadata``, or each
rank's ``__{rank}.metadata``), read through the checkpoint's one read model
(``storage.checkpoint.committed``). Nothing here unpickles the checkpoint's objects.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

from extensions.base import ItemInfo
from storage.backends.base import FileSystemBase
from storage.checkpoint import storage_format as fmt
from storage.checkpoint.committed import CommittedCheckpoint, open_committed
from storage.checkpoint.layout import metadata_rank
from storage.checkpoint.reader import CheckpointReader

Progress = Callable[[int], None]  # called with the stored bytes of each item done


@dataclass(frozen=True)
class Part:
    """One metadata of a checkpoint and a reader set up on it: the global
    ``.metadata`` (``rank`` is ``None``) or one rank's ``__{rank}.metadata``."""

    name: str
    rank: int | None
    reader: CheckpointReader
    metadata: Metadata

    def label(self, index: MetadataIndex) -> str:
        """The item's name, with its rank where each rank has metadata of its own."""
        label = fmt.item_label(index)
        return label if self.rank is None else f"rank {self.rank}: {label}"

    def item_info(self, index: MetadataIndex, url: str, keys: Any) -> ItemInfo:
        """What a transform needs to know about the item at ``index`` of the checkpoint
        at ``url`` (its name, dtype and element size; ``keys`` to decrypt it)."""
        facts = chunk_facts(self.metadata, index)
        # ``identity`` is what encryption binds the ciphertext to: the writer's key for
        # it, which never holds the rank (messages get the rank through ``checkpoint``).
        return ItemInfo(
            checkpoint=url if self.rank is None else f"{url} (rank {self.rank})",
            item=fmt.item_label(index),
            identity=fmt.item_identity(index),
            dtype=str(facts[1]).removeprefix("torch.") if facts else None,
            element_size=facts[1].itemsize if facts else None,
            keys=keys,
            save=fmt.stored_item(self.metadata.storage_data[index]).save,
        )


def read_metadata(
    fs: FileSystemBase,
    path: str,
    *,
    opened: CommittedCheckpoint | None = None,
    **reader_options: Any,
) -> list[Part]:
    """Every metadata that commits the checkpoint at ``path`` (layout's rule: the
    global one, else each rank's), each with a reader set up on it (``reader_options``
    go to :class:`CheckpointReader`); ``opened``: its read model, when the caller holds
    it already.

    Raises :class:`CheckpointNotFoundError` naming what is missing when ``path`` is not
    a committed checkpoint, and why its metadata cannot be read when it cannot."""
    if opened is None:
        fs.resolve_link(path)  # a checkpoint path that is a neighbour's link is not read
    checkpoint = opened or open_committed(fs, path)
    checkpoint.require()
    parts = []
    for name in checkpoint.committing:
        reader = CheckpointReader(fs.url(path), filesystem=fs, **reader_options)
        metadata = checkpoint.metadata[name]
        reader.set_up_storage_reader(metadata, True, metadata_name=name)
        parts.append(Part(name, metadata_rank(name), reader, metadata))
    return parts


def chunk_facts(metadata: Metadata, index: MetadataIndex) -> tuple[torch.Size, torch.dtype] | None:
    """The stored chunk's sizes and the tensor's dtype (``None`` for a non-tensor item)."""
    md = metadata.state_dict_metadata.get(index.fqn)
    if not isinstance(md, TensorStorageMetadata):
        return None
    offsets = list(index.offset or [])
    for chunk in md.chunks:
        if list(chunk.offsets) == offsets or (not offsets and len(md.chunks) == 1):
            return chunk.sizes, md.properties.dtype
    return None
