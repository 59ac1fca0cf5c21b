"""Incremental checkpoints: items whose content equals a base checkpoint's are
referenced, not written again.

A save that fingerprints (``CheckpointWriter(fingerprint=True)``, implied by ``base=``)
records in each item's extras a content fingerprint of its plain bytes (``"content"``).
A save with a ``base`` (a committed checkpoint beside it, under the same parent
directory or prefix) compares each item with the base's item of the same index: when the
transform descriptors are the same and the fingerprints match, nothing is written and
the item's ``_StorageInfo`` copies the base's (file, offset, length, descriptors,
extras) with ``"ref": NAME`` added, ``NAME`` being the sibling checkpoint whose data
file holds the bytes. References are flattened (a base item that is itself a reference
is copied with its own ``ref``), so a reference always names the checkpoint that holds
the bytes and the longest chain is one hop.

Fingerprints are xxHash3-128 (one core of the reference machine: ~24 GB/s when quiet,
6-14 GB/s while other work shares it; BLAKE2b-128 when the ``xxhash`` package is
missing, ~1 GB/s) of the tensor's dtype, shape and raw bytes, or of a non-tensor item's
bytes. Each item's is taken on the thread that writes its data file, just before the
item is written or referenced, so one thread's writes overlap the others' fingerprints,
and taken again once the item is written: an item that changed during its save records
none (``data_files``). When a transform of the chain returns a key from
``fingerprint_key()`` (part of the transform contract; AES-256-GCM does), the record is
keyed and salted instead:
``HMAC-SHA256(key, salt || digest)``, so without the key nobody can compare two
fingerprints or test a guess of the content.

Readers resolve ``ref`` to ``<parent>/<NAME>/<relative_path>``; ``NAME`` must be a plain
name (checked when the metadata is loaded) and the base must be committed, else
:class:`CheckpointNotFoundError` names the item, the base and the fix. Deleting or
overwriting a checkpoint that a sibling references is refused
(:class:`CheckpointInUseError`). See docs/format.md and docs/operations.md.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from extensions.base import StreamTransformExtension
from extensions.errors import CheckpointNotFoundError, UnsafeCheckpointError, quote
from storage.backends.base import FileSystemBase
from storage.checkpoint import storage_format as fmt
from storage.checkpoint.committed import (
    CommittedCheckpoint,
    chain_of,
    open_committed,
    read_metadata_file,
)
from storage.checkpoint.layout import is_committed, split_location
from storage.checkpoint.prefixes import absent
from storage.checkpoint.seal import base_verifies
from storage.checkpoint.tensors import tensor_bytes
from storage.checkpoint.validate import MAX_NAME, is_plain_name

# --- fingerprints -------------------------------------------------------------------


def _hasher() -> tuple[str, Any]:
    try:
        import xxhash
    except ImportError:  # pragma: no cover - xxhash is a dependency; stay correct without
        return "blake2b128", hashlib.blake2b(digest_size=16)
    return "xxh3_128", xxhash.xxh3_128()


class Fingerprint:
    """The fingerprint of one item's plain content. :meth:`record` is what goes into
    the item's extras; :meth:`matches` compares with a recorded one (a keyed record can
    only be compared by whoever holds the key)."""

    def __init__(self, header: bytes, data: memoryview | bytes, key: bytes | None) -> None:
        self.algorithm, hasher = _hasher()
        hasher.update(b"dcp-storage content v1\x00" + header + b"\x00")
        hasher.update(data)
        self.digest: bytes = hasher.digest()
        self._key = key

    def record(self) -> str:
        if self._key is None:
            return f"{self.algorithm}:{self.digest.hex()}"
        salt = secrets.token_bytes(16)
        return f"keyed-{self.algorithm}:{salt.hex()}:{self._tag(salt).hex()}"

    def matches(self, recorded: object) -> bool:
        if not isinstance(recorded, str):
            return False
        fields = recorded.split(":")
        if self._key is None:
            return fields == [self.algorithm, self.digest.hex()]
        if len(fields) != 3 or fields[0] != f"keyed-{self.algorithm}":
            return False
        try:
            salt, tag = bytes.fromhex(fields[1]), bytes.fromhex(fields[2])
        except ValueError:
            return False
        return hmac.compare_digest(self._tag(salt), tag)

    def _tag(self, salt: bytes) -> bytes:
        assert self._key is not None
        return hmac.new(self._key, salt + self.digest, "sha256").digest()[:16]


def fingerprint(data: torch.Tensor | memoryview, transforms: Sequence[Any]) -> Fingerprint:
    """Fingerprint a contiguous CPU tensor (dtype, shape and bytes) or a non-tensor
    item's bytes, keyed by the first transform of the chain whose ``fingerprint_key()``
    returns a key."""
    keys = (t.fingerprint_key() for t in transforms if isinstance(t, StreamTransformExtension))
    key = next((k for k in keys if k is not None), None)
    if isinstance(data, torch.Tensor):
        header = f"tensor;{data.dtype};{list(data.shape)}".encode()
        return Fingerprint(header, tensor_bytes(data), key)
    return Fingerprint(b"bytes", data, key)


# --- where a checkpoint's siblings are ------------------------------------------------


def sibling_path(fs: FileSystemBase, path: str, name: str) -> str:
    """The path of the checkpoint ``name`` beside the one at ``path``."""
    location = split_location(fs, path)
    if location is None:
        raise CheckpointNotFoundError(
            f"{fs.url(path)} references checkpoint {quote(name)} beside it, but it has no parent "
            "directory or prefix to hold one; copy it with `dcp-storage cp` from where it was "
            "written"
        )
    return fs.concat_path(location[0], name)


def sibling_url(fs: FileSystemBase, path: str, name: str) -> str:
    """The URL of the checkpoint ``name`` beside the one at ``path``, quoted (the name is
    the checkpoint's to choose), for messages."""
    return quote(fs.url(sibling_path(fs, path, name)))


def check_base_name(fs: FileSystemBase, base_path: str) -> None:
    """Refuse a base whose name could not be read back as a reference: every checkpoint
    that references the base records its name, which loads check (``validate``)."""
    name = base_path.rstrip("/").rpartition("/")[2]
    if not is_plain_name(name):
        raise ValueError(
            f"base {quote(fs.url(base_path))}: its name is recorded in every checkpoint "
            f"that references it, so it must be a plain name of at most {MAX_NAME} "
            "printable characters; rename the base, or save without one"
        )


def item_directory(fs: FileSystemBase, path: str, info: Any) -> str:
    """The checkpoint whose files hold the stored bytes of ``info`` (an item of the
    checkpoint at ``path``): ``path`` itself, or the base it references."""
    ref = fmt.stored_item(info).ref
    return path if ref is None else sibling_path(fs, path, ref)


def item_path(fs: FileSystemBase, path: str, info: Any) -> str:
    """Where the stored bytes of ``info`` (an item of the checkpoint at ``path``) are."""
    return fs.concat_path(item_directory(fs, path, info), info.relative_path)


def check_bases(fs: FileSystemBase, path: str, items: Iterable[tuple[str, Any]]) -> None:
    """Before reading ``items`` (``(label, _StorageInfo)`` pairs) of the checkpoint at
    ``path``: every base they reference must be a committed checkpoint, else
    :class:`CheckpointNotFoundError` names the item, the base and the fix; and not a
    symbolic link, else :class:`UnsafeCheckpointError`: a save records its base by the
    name its files really have (:func:`open_base`), so a reference never needs one, and
    one planted at a base's name would read the bytes of any checkpoint it points at
    (another user's private one) as this checkpoint's."""
    seen: set[str] = set()
    for label, info in items:
        ref = fmt.stored_item(info).ref
        if ref is None or ref in seen:
            continue
        base = sibling_path(fs, path, ref)
        if fs.is_link(base):
            raise UnsafeCheckpointError(
                f"{fs.url(path)}: item {quote(label)} is stored in base checkpoint "
                f"{fs.url(base)} ({quote(ref)}), which is a symbolic link; a base is read "
                "only as the directory beside the checkpoint that a save recorded, never "
                "through a link (it could point at any checkpoint on the machine): replace "
                "the link with the base itself (move or `dcp-storage cp` it there), or load "
                "a self-contained copy"
            )
        if not is_committed(fs, base):
            state = "not committed" if fs.exists(base) else "missing"
            raise CheckpointNotFoundError(
                f"{fs.url(path)}: item {quote(label)} is stored in base checkpoint {fs.url(base)} "
                f"({quote(ref)}), which is {state}; an incremental checkpoint needs its bases: "
                "restore the base, or load a self-contained copy made with `dcp-storage cp` "
                "while the base existed"
            )
        seen.add(ref)


# --- the base of a save ---------------------------------------------------------------


@dataclass(frozen=True)
class Base:
    """A committed checkpoint a save may reference: its canonical name beside the new
    one, its items as its ``.metadata`` records them, its chain length, and the
    canonical name of the checkpoint being written (``own``), which no reference may
    name (its files go when the save replaces them)."""

    name: str
    url: str
    items: dict[MetadataIndex, Any]
    chain: int
    own: str

    def reference(
        self, index: MetadataIndex, descriptors: list[str], content: Fingerprint
    ) -> Any | None:
        """The ``_StorageInfo`` referencing the base's bytes of ``index`` when they hold
        the same content under the same transform chain, else ``None``."""
        info = self.items.get(index)
        if info is None:
            return None
        record = fmt.stored_item(info)
        ref = record.ref or self.name
        if (
            list(record.descriptors) != descriptors
            or ref == self.own
            or record.crc32c is None
            or not content.matches(record.content)
        ):
            return None
        return fmt.new_storage_info(replace(record, ref=ref))


def open_base(
    fs: FileSystemBase,
    path: str,
    base: str | os.PathLike[str] | CommittedCheckpoint,
    transforms: Sequence[Any] = (),
) -> Base:
    """Read the base ``base`` (a path or URL, or its read model already opened: then
    its metadata is not read again) of a save to ``path``. It must be a
    committed checkpoint beside ``path`` (same parent directory or prefix) with a
    ``.metadata`` (rank-local metadata never makes a base), and not the checkpoint being
    written. Links are resolved where the backend has them (``root/latest -> step-5``
    is recorded as ``step-5``, the name whose files hold the bytes); a base or a
    destination that resolves outside the parent directory is refused. A save whose
    ``transforms`` seal its metadata takes references only from a base whose seal under
    the same keys verifies (``seal.base_verifies``): it seals the records it takes."""
    if isinstance(base, CommittedCheckpoint):
        opened: CommittedCheckpoint | None = base
        base_path = base.path
    else:
        opened, base_path = None, fs.init_path(os.fspath(base))
    check_base_name(fs, base_path)
    here, there = split_location(fs, path), split_location(fs, base_path)
    if here is None or there is None or here[0] != there[0]:
        raise ValueError(
            f"base {fs.url(base_path)} must be another checkpoint beside {fs.url(path)} (in "
            "the same directory or prefix, as the manager's step-<N> are): references are "
            "stored as sibling names, never as paths"
        )
    parent = fs.realpath(here[0])
    own, name = _canonical_name(fs, path, parent), _canonical_name(fs, base_path, parent)
    if name == own:
        alias = "" if there[1] == here[1] else f" ({there[1]} resolves to {name})"
        raise ValueError(
            f"base {fs.url(base_path)} is the checkpoint being written, {fs.url(path)}"
            f"{alias}: a save cannot reference the files it replaces; name the previous "
            "checkpoint as its base, or save without one"
        )
    if opened is not None:
        if not opened.readable:
            opened.require()  # the read's own error, as reading it here would raise
        metadata = opened.global_metadata
    else:
        metadata = read_metadata_file(fs, fs.concat_path(base_path, fmt.METADATA_NAME))
    if metadata is None:
        rank_local = (opened or open_committed(fs, base_path)).committing
        state = (
            f"committed only by rank-local metadata ({', '.join(rank_local)}, a save with "
            "use_collectives=False), which never serves as a base"
            if rank_local
            else "not a committed checkpoint (no .metadata)"
        )
        raise CheckpointNotFoundError(
            f"base {fs.url(base_path)} of the save to {fs.url(path)} is {state}; save a "
            "full checkpoint (no base) or name a committed one"
        )
    url = fs.url(base_path)
    items = dict(metadata.storage_data or {}) if base_verifies(metadata, transforms, url) else {}
    return Base(name, url, items, chain_of(metadata), own)


def _canonical_name(fs: FileSystemBase, path: str, parent: str) -> str:
    """The name of ``path`` under ``parent`` (a canonical path) once links are resolved;
    ``ValueError`` when it resolves elsewhere."""
    real = fs.realpath(path)
    location = split_location(fs, real)
    if location is None or location[0] != parent:
        raise ValueError(
            f"{fs.url(path)} is a symbolic link to {fs.url(real)}, outside {fs.url(parent)}: "
            "an incremental save and its base must be checkpoints in the same directory "
            "(references are sibling names); save without a base, or use the real path"
        )
    return location[1]


def check_referenced_files(fs: FileSystemBase, path: str, infos: Iterable[Any]) -> None:
    """Just before a save's metadata is published: every base it references is still
    committed and still holds the referenced files, so a reference is recorded only to
    bytes that exist (a base removed meanwhile fails the save, nothing is published)."""
    wanted: dict[str, set[str]] = {}
    for info in infos:
        ref = fmt.stored_item(info).ref
        if ref is not None:
            wanted.setdefault(sibling_path(fs, path, ref), set()).add(info.relative_path)
    lost = _first_absent(fs, wanted)
    if lost is not None:
        raise CheckpointNotFoundError(
            f"{fs.url(path)}: base checkpoint {fs.url(lost[0])} lost {quote(lost[1])} during "
            "the save (deleted or overwritten meanwhile); nothing was committed: save "
            "again (a full save if the base is gone)"
        )


def missing_file(fs: FileSystemBase, path: str, infos: Iterable[Any]) -> tuple[str, str] | None:
    """The first file that ``infos`` (items of the checkpoint at ``path``) keep their
    bytes in, in the checkpoint itself or a base it references, that is not there (or
    the ``.metadata`` of either), as (checkpoint path, file name); ``None`` when all are."""
    wanted: dict[str, set[str]] = {}
    for info in infos:
        wanted.setdefault(item_directory(fs, path, info), set()).add(info.relative_path)
    return _first_absent(fs, wanted)


def _first_absent(fs: FileSystemBase, wanted: dict[str, set[str]]) -> tuple[str, str] | None:
    for directory, names in sorted(wanted.items()):
        gone = absent(fs, directory, names | {fmt.METADATA_NAME})  # a lagging listing too
        missing = [n for n in gone if n != fmt.METADATA_NAME] + (
            [fmt.METADATA_NAME] if fmt.METADATA_NAME in gone else []
        )
        if missing:
            return directory, missing[0]
    return None
