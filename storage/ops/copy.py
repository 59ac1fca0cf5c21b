"""Copy (or transcode) a checkpoint between any two locations, item by item.

Each item streams from the source to the destination through the same item code the
writer and the reader use (``storage.checkpoint.items``), decoded and re-encoded on the
fly when the transform chain changes, so memory stays at a few buffers per file
(:mod:`storage.ops.copy_data`). The destination is committed like a save, data first,
metadata last, through the commit transaction (:func:`publish_copy`).
"""

from __future__ import annotations

import copy
import functools
import uuid
from collections.abc import Sequence
from typing import Any

from torch.distributed.checkpoint.metadata import StorageMeta

from extensions.base import Keys, cached_key_lookup
from extensions.errors import CheckpointExistsError
from extensions.registry import ExtensionRegistry
from storage.backends.base import FileSystemBase
from storage.checkpoint import storage_format as fmt
from storage.checkpoint.attempt import SaveAttempt
from storage.checkpoint.commit import commit_checkpoint
from storage.checkpoint.items import check_before_read, encryption_required
from storage.checkpoint.layout import metadata_names
from storage.checkpoint.options import check_transforms
from storage.checkpoint.seal import SealCheck, make_seals, seals_of
from storage.ops.copy_data import CopiedFiles, copy_data_files
from storage.ops.describe import Summary, describe
from storage.ops.parts import Part, Progress, read_metadata


def copy_checkpoint(
    src_fs: FileSystemBase,
    src_path: str,
    dst_fs: FileSystemBase,
    dst_path: str,
    *,
    transforms: Sequence[Any] | None = None,
    overwrite: bool = False,
    keys: Keys | None = None,
    registry: ExtensionRegistry | None = None,
    thread_count: int | None = None,
    progress: Progress | None = None,
    require_encryption: bool | None = None,
) -> Summary:
    """Copy the checkpoint at ``src_path`` to ``dst_path`` (any two backends).

    ``transforms=None`` keeps every item's stored bytes as they are (no keys needed;
    checksums are verified on the way). A list re-encodes every item with that chain
    (``[]`` stores items plain): each is decoded with ``keys``/``registry`` and encoded
    again, streaming, so memory stays at a few buffers per file. The destination is
    committed like a save (data first, metadata last); an existing committed
    checkpoint there is refused unless ``overwrite``, and then replaced only once the
    new metadata lands.

    ``require_encryption=True`` refuses, before anything is written, a source item that
    is not encrypted. The default (``None``) does so when items are re-encoded with
    ``keys`` from a source that holds encrypted items: re-encoding would otherwise seal
    a forged plain item (what a downgrade leaves behind) under a fresh, valid
    encryption. It stays off for a source with no encrypted item at all, since ``keys``
    here also serve the new chain (encrypting a plain checkpoint is a normal copy), and
    for a verbatim copy, which keeps plain items plain for the reader's policy."""
    if transforms is not None:  # a chain the readers refuse is refused before a read
        transforms = check_transforms(transforms)
    parts = read_metadata(src_fs, src_path, keys=keys, registry=registry)
    _check_items(parts, src_fs.url(src_path), transforms, keys, registry, require_encryption)
    _check_destination(parts, src_fs.url(src_path), dst_fs, dst_path, overwrite)
    attempt = SaveAttempt(dst_fs, dst_path, uuid.uuid4().hex[:12])
    copies: list[CopiedFiles] = []
    try:
        for part in parts:  # the data phase: every part's files, numbered on
            copies.append(
                copy_data_files(
                    src_fs,
                    src_path,
                    dst_fs,
                    dst_path,
                    part,
                    transforms=transforms,
                    keys=keys,
                    registry=registry,
                    thread_count=thread_count,
                    progress=progress,
                    save_id=attempt.save_id,
                    first=sum(len(c.names) for c in copies),
                )
            )
            attempt.adopt(copies[-1].names)
        for part, copied in zip(parts, copies):  # then each metadata, committed
            publish_copy(
                dst_fs,
                dst_path,
                part,
                [copied],
                overwrite=overwrite,
                transforms=transforms,
                home=attempt.home,
            )
            attempt.landed()  # a metadata names this save's files: they all stay
    except BaseException as exc:
        attempt.abort(exc)  # unless a commit may have landed
        raise
    return describe(dst_fs, dst_path)


def _check_items(
    parts: list[Part],
    src_url: str,
    transforms: Sequence[Any] | None,
    keys: Keys | None,
    registry: ExtensionRegistry | None,
    require_encryption: bool | None,
) -> None:
    """Refuse, before anything is written, an item that cannot be read as asked (see
    :func:`copy_checkpoint` for the encryption policy)."""
    key_lookup = cached_key_lookup(keys)
    known = registry or ExtensionRegistry()
    stored = [
        (part, index, info)
        for part in parts
        for index, info in (part.metadata.storage_data or {}).items()
    ]
    required = (
        encryption_required(require_encryption, keys)
        if require_encryption is not None
        else encryption_required(None, keys)
        and transforms is not None
        and any(known.authenticated(info.transform_descriptors or ()) for _, _, info in stored)
    )
    for part, index, info in stored:
        check_before_read(
            info.transform_descriptors or (),
            part.item_info(index, src_url, key_lookup),
            known,
            require_encryption=required,
            decode=transforms is not None,
            seal=None,  # below, for the whole metadata
        )
    if transforms is not None:  # re-encoded: nothing is sealed again unless it verifies
        for part in parts:
            SealCheck(part.metadata, src_url, part.name).require_all(
                known, functools.partial(part.item_info, url=src_url, keys=key_lookup)
            )


def _check_destination(
    parts: list[Part], src_url: str, dst_fs: FileSystemBase, dst_path: str, overwrite: bool
) -> None:
    """Refuse a copy onto itself, or over a committed checkpoint unless ``overwrite``
    and it is committed by the same metadata files."""
    dst_url = dst_fs.url(dst_path)
    if src_url.rstrip("/") == dst_url.rstrip("/"):
        raise ValueError(f"cannot copy {src_url} onto itself; choose another destination")
    existing = metadata_names(dst_fs, dst_path)
    if existing and not overwrite:
        raise CheckpointExistsError(
            f"{dst_url} already holds a committed checkpoint; pass --overwrite "
            "(overwrite=True) to replace it"
        )
    if existing and set(existing) != {part.name for part in parts}:
        # Publishing ours would leave its metadata in place, still winning or lingering.
        raise CheckpointExistsError(
            f"{dst_url} holds a checkpoint committed by {', '.join(existing)}, which a copy "
            f"committed by {', '.join(p.name for p in parts)} cannot replace; remove it "
            "first (dcp-storage rm)"
        )


def publish_copy(
    dst_fs: FileSystemBase,
    dst_path: str,
    part: Part,
    copies: Sequence[CopiedFiles],
    *,
    overwrite: bool,
    transforms: Sequence[Any] | None = None,
    home: str | None = None,
) -> bytes:
    """The commit phase of :func:`copy_checkpoint`: publish ``part``'s metadata over the
    data files of ``copies`` (every rank's share of one copy, its items re-encoded with
    ``transforms`` unless ``None``) under ``dst_path`` (in ``home``, ``dst_path`` as
    resolved when the copy began: ``SaveAttempt.home``); returns the metadata's bytes as
    published. On failure, removes those files unless the metadata may have landed, and
    raises. The source's seal carries over to a copy of the stored bytes (it seals no
    location); a re-encoded copy is sealed afresh under its chain's keys."""
    save_id = copies[0].save_id if copies else uuid.uuid4().hex[:12]
    new_meta = copy.copy(part.metadata)
    new_meta.storage_data = {i: info for c in copies for i, info in c.infos.items()}
    new_meta.storage_meta = StorageMeta(checkpoint_id=dst_fs.url(dst_path), save_id=save_id)
    extra: dict[str, Any] = {}
    origin = fmt.save_of(part.metadata)  # the copy holds the same save's state
    if origin is not None:
        extra[fmt.ORIGIN] = origin
    ranks = fmt.ranks_of(part.metadata)
    if ranks is not None:  # the copy holds the same chunks
        extra[fmt.RANKS] = ranks
    setattr(new_meta, fmt.EXTRA, dict(extra))  # as stored, for the seal (it names the save)
    seals = seals_of(part.metadata) if transforms is None else None
    if seals is None:
        seals = make_seals(new_meta, transforms or [], save_id, part.name)
    if seals:
        extra[fmt.SEAL] = seals
    published: list[bytes] = []

    def payload() -> bytes:  # serialized inside the commit: its failure rolls back too
        published.append(fmt.dump_metadata(new_meta, **extra))
        return published[-1]

    commit_checkpoint(
        dst_fs,
        dst_path,
        part.name,
        payload,
        save_id=save_id,
        infos=new_meta.storage_data.values(),
        new_files={n for c in copies for n in c.names},
        overwrite=overwrite,
        sync=True,
        home=home,
    )
    return published[-1]
