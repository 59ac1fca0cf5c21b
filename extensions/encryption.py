"""AES-256-GCM encryption of stored items, and the key helpers readers and the CLI use.

Stream format of one encrypted item (descriptor
``dcp_storage.aes256gcm/2;key_id=<id>;chunk=<bytes>``)::

    header   "DCPE" | format (1 byte, 2) | salt (16) | nonce prefix (8) | key check (8)
    chunk 0  ciphertext of `chunk` plaintext bytes | tag (16)
    ...
    final    ciphertext of 0..chunk-1 plaintext bytes | tag (16)

Every item gets a fresh random salt, from which HKDF-SHA256 derives the item's own
AES key and a key-check value, so nonces can never repeat across items under the same
master key. Chunk ``i`` is sealed with nonce ``prefix || i`` and associated data that
binds the item's identity (``ItemInfo.identity``: its state-dict key and chunk offsets,
each length-prefixed, so no two items share it whatever their keys hold), ``i`` and
whether it is the final chunk; the final chunk is always shorter than a full one (empty
when the plaintext fills the last chunk exactly), so reordering, dropping, duplicating,
truncating or extending chunks, or moving chunks or whole items between items, fails
authentication. Only two chunks are ever held in memory.

Format 1 (descriptor ``.../1``, header byte 1), written by earlier releases, is read
only: its associated data binds the item's name as messages show it
(``w@[4]`` for the chunk of ``w`` at offset 4, and for the key ``w@[4]`` as well).
The descriptor's version and the header's format byte must agree, and each format's
associated data starts with its own label, so a format-2 item relabelled as format 1
fails rather than being checked under the weaker binding.
"""

from __future__ import annotations

import hmac
import io
import secrets
import struct
from dataclasses import dataclass, replace
from typing import IO, Any, ClassVar, cast

from extensions.base import (
    ItemInfo,
    StreamTransformExtension,
    descriptor_number,
    descriptor_settings,
)
from extensions.errors import IntegrityError, MissingDependencyError, MissingKeyError, quote
from extensions.keys import (
    KEY_SIZE,
    check_key,
    check_key_id,
    keys_from_environment,
    keys_from_file,
    lookup_key,
)
from extensions.streams import BlockWriter, fill, read_all, readinto_exact

__all__ = ["AES256GCM", "keys_from_environment", "keys_from_file"]

TAG_SIZE = 16
DEFAULT_CHUNK_SIZE = 4 << 20
MIN_CHUNK_SIZE = 1 << 10
MAX_CHUNK_SIZE = 1 << 30

_MAGIC = b"DCPE"
_FORMAT = 2  # what is written; 1 is still read (the legacy binding, see above)
_FORMATS = (1, 2)
_HEADER = struct.Struct(">4sB16s8s8s")
_MAX_CHUNKS = 1 << 32  # the chunk counter is the last 4 bytes of the nonce


def _aead(key: bytes) -> Any:
    try:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    except ImportError as exc:  # pragma: no cover - cryptography is a core dependency
        raise MissingDependencyError(
            "AES-256-GCM needs the 'cryptography' package: pip install cryptography"
        ) from exc
    return AESGCM(key)


def _derive(key: bytes, salt: bytes) -> tuple[bytes, bytes]:
    """The item key and the key-check value for ``salt`` under the master ``key``."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    okm = HKDF(
        algorithm=hashes.SHA256(), length=KEY_SIZE + 8, salt=salt, info=b"dcp-storage aes256gcm v1"
    ).derive(key)
    return okm[:KEY_SIZE], okm[KEY_SIZE:]


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


def _associated_prefix(item: ItemInfo, format: int) -> bytes:
    """What every chunk's associated data starts with: the format's label and the item
    it is bound to (chunk index and final flag follow). Format 2 writes the identity
    length-prefixed; format 1 wrote the name, which two items may share."""
    if format == 1:
        return b"dcp_storage.aes256gcm/1\x00" + item.item.encode("utf-8") + b"\x00"
    fqn, offsets = item.identity if item.identity is not None else (item.item, ())
    name = fqn.encode("utf-8", "surrogatepass")
    return (
        b"dcp_storage.aes256gcm/2\x00"
        + struct.pack(">I", len(name))
        + name
        + struct.pack(f">I{len(offsets)}q", len(offsets), *offsets)
    )


@dataclass(frozen=True, kw_only=True, repr=False)
class AES256GCM(StreamTransformExtension):
    """Authenticated AES-256-GCM encryption, chunked (descriptor ``dcp_storage.aes256gcm/2``).

    ``key`` is the 32-byte master key, ``key_id`` the name readers look it up by
    (recorded in the descriptor; the key never is), ``chunk_size`` the plaintext bytes
    per authenticated chunk. List it after compression: ``[ZStandard(), AES256GCM(...)]``.
    Readers pass ``keys={key_id: key}`` (or a callable); a missing key raises
    :class:`MissingKeyError`, a wrong key or any changed byte :class:`IntegrityError`.
    ``item`` is the item the ciphertext is bound to, filled in by ``for_item``;
    ``format`` the stream format, set by ``from_descriptor``: 1 (earlier releases) is
    decoded only, new items are always written in format 2.
    """

    authenticated: ClassVar[bool] = True

    key: bytes | None = None
    key_id: str = "default"
    chunk_size: int = DEFAULT_CHUNK_SIZE
    item: ItemInfo = ItemInfo()
    format: int = _FORMAT

    def __post_init__(self) -> None:
        if self.key is not None:
            object.__setattr__(self, "key", check_key(self.key))
        check_key_id(self.key_id)
        _check_chunk_size(self.chunk_size)
        if isinstance(self.format, bool) or self.format not in _FORMATS:
            raise ValueError(f"format must be one of {_FORMATS}, got {self.format!r}")

    def __repr__(self) -> str:
        return f"AES256GCM(key_id={self.key_id!r}, chunk_size={self.chunk_size})"

    @staticmethod
    def registry_name() -> str:
        return "dcp_storage.aes256gcm"

    @staticmethod
    def from_descriptor(version: str) -> AES256GCM:
        fields = descriptor_settings(
            AES256GCM.registry_name(), version, {"key_id", "chunk"}, ("1", "2")
        )
        if "key_id" not in fields or "chunk" not in fields:
            raise ValueError("the descriptor must name key_id and chunk")
        chunk = descriptor_number(
            AES256GCM.registry_name(), "chunk", fields["chunk"], MIN_CHUNK_SIZE, MAX_CHUNK_SIZE
        )
        format = int(version.partition(";")[0])  # "1" or "2", checked just above
        return AES256GCM(key_id=fields["key_id"], chunk_size=chunk, format=format)

    @classmethod
    def key_ids(cls, version: str) -> tuple[str, ...]:
        return (cls.from_descriptor(version).key_id,)

    def get_descriptor(self) -> str:
        return f"{self.registry_name()}/{self.format};key_id={self.key_id};chunk={self.chunk_size}"

    def for_item(self, item: ItemInfo) -> AES256GCM:
        return self if self.item == item else replace(self, item=item)

    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        if self.key is None:
            raise MissingKeyError(
                f"AES256GCM(key_id={self.key_id!r}) has no key; pass key=... to encrypt"
            )
        if self.format != _FORMAT:
            raise ValueError(
                f"AES256GCM format {self.format} is read only (its binding of items is "
                f"ambiguous); new items are written in format {_FORMAT}: leave format unset"
            )
        return cast(IO[bytes], _Encryptor(output, self.key, self.chunk_size, self.item))

    def transform_from(self, input: IO[bytes]) -> IO[bytes]:
        key = self.key if self.key is not None else lookup_key(self.key_id, self.item)
        return cast(
            IO[bytes],
            _Decryptor(input, key, self.key_id, self.chunk_size, self.item, self.format),
        )

    def fingerprint_key(self) -> bytes:
        """A key for keyed content fingerprints (incremental saves), derived from the
        master key with HKDF under its own label: never the master key, never an item key.
        Someone without the master key cannot compute or compare such fingerprints."""
        if self.key is None:
            raise MissingKeyError(
                f"AES256GCM(key_id={self.key_id!r}) has no key; pass key=... to encrypt"
            )
        return _derive(self.key, b"dcp-storage content fingerprint v1")[0]


class _Encryptor(BlockWriter):
    def __init__(self, out: IO[bytes], key: bytes, chunk_size: int, item: ItemInfo) -> None:
        super().__init__(out, chunk_size)
        salt = secrets.token_bytes(16)
        self._prefix = secrets.token_bytes(8)
        item_key, check = _derive(key, salt)
        self._aead = _aead(item_key)
        self._ad = _associated_prefix(item, _FORMAT)
        self._index = 0
        self._sealed = bytearray()
        out.write(_HEADER.pack(_MAGIC, _FORMAT, salt, self._prefix, check))

    def emit(self, block: memoryview) -> None:
        self._seal(block, final=False)

    def finish(self, rest: memoryview) -> None:
        # Always sealed, empty or not: only the final chunk is short.
        self._seal(rest, final=True)

    def _seal(self, plain: memoryview, *, final: bool) -> None:
        if self._index >= _MAX_CHUNKS:
            raise ValueError("item too large for this chunk_size; use a larger chunk_size")
        nonce = self._prefix + self._index.to_bytes(4, "big")
        ad = self._ad + struct.pack(">QB", self._index, final)
        if len(self._sealed) < len(plain) + TAG_SIZE:
            self._sealed = bytearray(len(plain) + TAG_SIZE)
        out = memoryview(self._sealed)[: len(plain) + TAG_SIZE]
        self._aead.encrypt_into(nonce, plain, ad, out)
        self._out.write(out)
        self._index += 1


class _Decryptor(io.RawIOBase):
    def __init__(
        self,
        source: IO[bytes],
        key: bytes,
        key_id: str,
        chunk_size: int,
        item: ItemInfo,
        format: int,
    ) -> None:
        super().__init__()
        self._src = source
        self._key: bytes | None = key
        self._key_id = key_id
        self._chunk = chunk_size
        self._format = format
        self._ad = _associated_prefix(item, format)
        self._where = (
            f"{item.checkpoint}: item {quote(item.item)}" if item.item else item.checkpoint
        )
        self._aead: Any = None
        self._prefix = b""
        self._index = 0
        self._done = False
        # Both grow with the bytes actually stored (see streams.fill): the chunk size is
        # the checkpoint's claim, and a 1 KiB item claiming 256 MiB chunks must not cost
        # 512 MiB before authentication fails.
        self._record = bytearray()
        self._plain = bytearray()
        self._pos = 0
        self._end = 0

    def readable(self) -> bool:
        return True

    def _fail(self, what: str) -> IntegrityError:
        return IntegrityError(
            f"{self._where or 'encrypted item'}: {what} (AES-256-GCM, key_id "
            f"{self._key_id!r}); restore the file or re-save the checkpoint"
        )

    def _start(self) -> None:
        header = bytearray(_HEADER.size)
        if readinto_exact(self._src, memoryview(header)) != _HEADER.size:
            raise self._fail("the encrypted item is truncated inside its header")
        magic, version, salt, prefix, check = _HEADER.unpack(header)
        if magic == _MAGIC and version in _FORMATS and version != self._format:
            legacy = " (never checked under the legacy binding)" if self._format == 1 else ""
            raise self._fail(
                f"the item's header says format {version} but its descriptor says format "
                f"{self._format}: the metadata or the item was altered{legacy}"
            )
        if magic != _MAGIC or version != self._format:
            raise self._fail(f"the bytes are not an AES-256-GCM item of format {self._format}")
        assert self._key is not None
        item_key, expected = _derive(self._key, salt)
        self._key = None
        if not hmac.compare_digest(check, expected):
            raise self._fail(
                "wrong key: the key given for this key_id is not the key the item was "
                "encrypted with (or the item header is damaged)"
            )
        self._aead = _aead(item_key)
        self._prefix = prefix

    def _open_next(self, dest: memoryview | None) -> int:
        """Authenticate the next chunk into ``dest`` when it fits there, else into the
        internal buffer; returns the plaintext length, or -1 for the internal buffer."""
        if self._aead is None:
            self._start()
        n = fill(self._src, self._record, self._chunk + TAG_SIZE)
        final = n < self._chunk + TAG_SIZE
        record = memoryview(self._record)
        if n < TAG_SIZE:
            raise self._fail(
                f"the item is truncated: chunk {self._index} is missing or cut short"
                if n or self._index
                else "the item is truncated: no chunk follows the header"
            )
        size = n - TAG_SIZE
        internal = dest is None or len(dest) < size
        if internal and len(self._plain) < size:
            self._plain = bytearray(size)
        out = memoryview(self._plain)[:size] if internal or dest is None else dest[:size]
        nonce = self._prefix + self._index.to_bytes(4, "big")
        ad = self._ad + struct.pack(">QB", self._index, final)
        try:
            self._aead.decrypt_into(nonce, record[:n], ad, out)
        except Exception as exc:  # cryptography's InvalidTag
            raise self._fail(
                f"chunk {self._index} failed authentication: the key is right, so the "
                "stored bytes were altered, truncated or reordered, or are another item's "
                "encrypted bytes put in this item's place"
            ) from exc
        self._index += 1
        # A short record means the source is exhausted, so nothing can follow it.
        self._done = final
        if internal:
            self._pos, self._end = 0, size
            return -1
        return size

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        while True:
            if self._pos < self._end:
                n = min(len(view), self._end - self._pos)
                view[:n] = memoryview(self._plain)[self._pos : self._pos + n]
                self._pos += n
                return n
            if self._done or not len(view):
                return 0
            n = self._open_next(view)
            if n >= 0:
                return n

    def read(self, size: int | None = -1) -> bytes:
        # Slices of the decrypted chunk, one copy each (RawIOBase.read would make two).
        if size is None or size < 0:
            return read_all(self)
        while self._pos == self._end:
            if self._done or not size:
                return b""
            self._open_next(None)
        n = min(size, self._end - self._pos)
        self._pos += n
        return bytes(memoryview(self._plain)[self._pos - n : self._pos])

    def readall(self) -> bytes:
        return self.read(-1)
