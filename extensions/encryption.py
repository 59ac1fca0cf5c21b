"""AES-256-GCM encryption of stored items, and the key helpers readers and the CLI use.

Stream format of one encrypted item (descriptor
``dcp_storage.aes256gcm/3;key_id=<id>;chunk=<bytes>``)::

    header   "DCPE" | format (1 byte, 3) | salt (16) | nonce prefix (8) | key check (8)
    chunk 0  ciphertext of `chunk` plaintext bytes | tag (16)
    ...
    final    ciphertext of 0..chunk-1 plaintext bytes | tag (16)

Every item gets a fresh random salt, from which HKDF-SHA256 derives the item's own
AES key and a key-check value, so nonces can never repeat across items under the same
master key. Chunk ``i`` is sealed with nonce ``prefix || i`` and associated data that
binds the item's identity (``ItemInfo.identity``: its state-dict key and chunk offsets,
each length-prefixed, so no two items share it whatever their keys hold), the save that
wrote it (``ItemInfo.save``, recorded beside the item), ``i`` and whether it is the
final chunk; the final chunk is always shorter than a full one (empty when the
plaintext fills the last chunk exactly), so reordering, dropping, duplicating,
truncating or extending chunks, or moving chunks or whole items between items or saves,
fails authentication. Only two chunks are ever held in memory.

Format 3 also means *sealed metadata*: the checkpoint's metadata carries a MAC under a
key derived from the same master key (``seal_key``), which readers check before they
decode such an item (``storage.checkpoint.seal``), so its record (and the save it names)
cannot be changed either. An item written where no save is known (``ItemInfo.save`` is
``None``: the transform used outside a checkpoint of ours) is written in format 2, which
binds the identity only and needs no seal.

Formats 2 and 1 (descriptors ``.../2`` and ``.../1``, header bytes 2 and 1), written by
earlier releases, are still read. Format 1's associated data binds the item's name as
messages show it (``w@[4]`` for the chunk of ``w`` at offset 4, and for the key
``w@[4]`` as well), and is read only. The descriptor's version and the header's format
byte must agree, and each format's associated data starts with its own label, so an
item relabelled to an older format fails rather than being checked under its weaker
binding.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import IO, ClassVar, cast

from extensions._aes_stream import FORMAT as _FORMAT
from extensions._aes_stream import FORMATS as _FORMATS
from extensions._aes_stream import TAG_SIZE, Decryptor, Encryptor, derive
from extensions.base import (
    ItemInfo,
    StreamTransformExtension,
    descriptor_number,
    descriptor_settings,
)
from extensions.errors import MissingKeyError
from extensions.keys import (
    check_key,
    check_key_id,
    keys_from_environment,
    keys_from_file,
    lookup_key,
)

__all__ = ["AES256GCM", "TAG_SIZE", "keys_from_environment", "keys_from_file"]

DEFAULT_CHUNK_SIZE = 4 << 20
MIN_CHUNK_SIZE = 1 << 10
MAX_CHUNK_SIZE = 1 << 30

_UNBOUND = 2  # what is written where no save is known
_SEAL_LABEL = b"dcp-storage metadata seal v1"


def _check_chunk_size(chunk_size: object) -> int:
    if (
        not isinstance(chunk_size, int)
        or isinstance(chunk_size, bool)
        or not MIN_CHUNK_SIZE <= chunk_size <= MAX_CHUNK_SIZE
    ):
        raise ValueError(
            f"chunk_size must be an int between {MIN_CHUNK_SIZE} and {MAX_CHUNK_SIZE}, "
            f"got {chunk_size!r}"
        )
    return chunk_size


@dataclass(frozen=True, kw_only=True, repr=False)
class AES256GCM(StreamTransformExtension):
    """Authenticated AES-256-GCM encryption, chunked (descriptor ``dcp_storage.aes256gcm/2``).

    ``key`` is the 32-byte master key, ``key_id`` the name readers look it up by
    (recorded in the descriptor; the key never is), ``chunk_size`` the plaintext bytes
    per authenticated chunk. List it after compression: ``[ZStandard(), AES256GCM(...)]``.
    Readers pass ``keys={key_id: key}`` (or a callable); a missing key raises
    :class:`MissingKeyError`, a wrong key or any changed byte :class:`IntegrityError`.
    ``item`` is the item the ciphertext is bound to, filled in by ``for_item``;
    ``format`` the stream format, set by ``from_descriptor``; left unset, items are
    written in format 3 (bound to their save, sealed metadata) where the item names its
    save, else in format 2. Format 1 (earlier releases) is decoded only.
    """

    authenticated: ClassVar[bool] = True

    key: bytes | None = None
    key_id: str = "default"
    chunk_size: int = DEFAULT_CHUNK_SIZE
    item: ItemInfo = ItemInfo()
    format: int | None = None

    def __post_init__(self) -> None:
        if self.key is not None:
            object.__setattr__(self, "key", check_key(self.key))
        check_key_id(self.key_id)
        _check_chunk_size(self.chunk_size)
        if self.format is not None and (
            isinstance(self.format, bool) or self.format not in _FORMATS
        ):
            raise ValueError(f"format must be one of {_FORMATS}, got {self.format!r}")

    @property
    def stream_format(self) -> int:
        """The format this item is (or will be) stored in: the descriptor's, else 3 for
        an item of a save and 2 for one outside any."""
        if self.format is not None:
            return self.format
        return _FORMAT if self.item.save is not None else _UNBOUND

    def __repr__(self) -> str:
        return f"AES256GCM(key_id={self.key_id!r}, chunk_size={self.chunk_size})"

    @staticmethod
    def registry_name() -> str:
        return "dcp_storage.aes256gcm"

    @staticmethod
    def from_descriptor(version: str) -> AES256GCM:
        fields = descriptor_settings(
            AES256GCM.registry_name(), version, {"key_id", "chunk"}, ("1", "2", "3")
        )
        if "key_id" not in fields or "chunk" not in fields:
            raise ValueError("the descriptor must name key_id and chunk")
        chunk = descriptor_number(
            AES256GCM.registry_name(), "chunk", fields["chunk"], MIN_CHUNK_SIZE, MAX_CHUNK_SIZE
        )
        format = int(version.partition(";")[0])  # "1", "2" or "3", checked just above
        return AES256GCM(key_id=fields["key_id"], chunk_size=chunk, format=format)

    @classmethod
    def max_expansion(cls, version: str) -> int | None:
        return 1  # each chunk stored whole, with its tag

    @classmethod
    def key_ids(cls, version: str) -> tuple[str, ...]:
        return (cls.from_descriptor(version).key_id,)

    @classmethod
    def seal_key_ids(cls, version: str) -> tuple[str, ...]:
        stage = cls.from_descriptor(version)
        return (stage.key_id,) if stage.format == _FORMAT else ()

    def seal_key(self) -> tuple[str, bytes] | None:
        """For an item of format 3: the key id and the MAC key of its checkpoint's
        metadata seal, derived from the master key with HKDF under its own label (never
        the master key, an item key or the fingerprint key)."""
        if self.stream_format != _FORMAT:
            return None
        if self.key is None and self.format is None:  # a writer's, built without a key
            raise MissingKeyError(
                f"AES256GCM(key_id={self.key_id!r}) has no key; pass key=... to encrypt"
            )
        key = self.key if self.key is not None else lookup_key(self.key_id, self.item)
        return self.key_id, derive(key, _SEAL_LABEL)[0]

    def get_descriptor(self) -> str:
        return (
            f"{self.registry_name()}/{self.stream_format};key_id={self.key_id};"
            f"chunk={self.chunk_size}"
        )

    def for_item(self, item: ItemInfo) -> AES256GCM:
        return self if self.item == item else replace(self, item=item)

    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        if self.key is None:
            raise MissingKeyError(
                f"AES256GCM(key_id={self.key_id!r}) has no key; pass key=... to encrypt"
            )
        format = self.stream_format
        if format == 1:
            raise ValueError(
                "AES256GCM format 1 is read only (its binding of items is ambiguous); "
                "leave format unset"
            )
        if format == _FORMAT and self.item.save is None:
            raise ValueError(
                f"AES256GCM format {_FORMAT} binds each item to its save, and this item "
                "names none; leave format unset"
            )
        return cast(IO[bytes], Encryptor(output, self.key, self.chunk_size, self.item, format))

    def transform_from(self, input: IO[bytes]) -> IO[bytes]:
        key = self.key if self.key is not None else lookup_key(self.key_id, self.item)
        return cast(
            IO[bytes],
            Decryptor(input, key, self.key_id, self.chunk_size, self.item, self.stream_format),
        )

    def fingerprint_key(self) -> bytes:
        """A key for keyed content fingerprints (incremental saves), derived from the
        master key with HKDF under its own label: never the master key, never an item key.
        Someone without the master key cannot compute or compare such fingerprints."""
        if self.key is None:
            raise MissingKeyError(
                f"AES256GCM(key_id={self.key_id!r}) has no key; pass key=... to encrypt"
            )
        return derive(self.key, b"dcp-storage content fingerprint v1")[0]
