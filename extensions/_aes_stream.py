"""The AES-256-GCM stream of one item: its header, its chunks and what each chunk's
associated data binds (the format is described in :mod:`extensions.encryption`, whose
transform builds these streams)."""

from __future__ import annotations

import hmac
import io
import secrets
import struct
from typing import IO, Any

from extensions.base import ItemInfo
from extensions.errors import IntegrityError, MissingDependencyError, quote
from extensions.keys import KEY_SIZE
from extensions.streams import BlockWriter, fill, read_all, readinto_exact

TAG_SIZE = 16
FORMAT = 3  # what is written for an item of a save; 2 where no save is known
FORMATS = (1, 2, 3)
_MAGIC = b"DCPE"
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


def derive(key: bytes, salt: bytes) -> tuple[bytes, bytes]:
    """The item key and the key-check value for ``salt`` under the master ``key``."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    okm = HKDF(
        algorithm=hashes.SHA256(), length=KEY_SIZE + 8, salt=salt, info=b"dcp-storage aes256gcm v1"
    ).derive(key)
    return okm[:KEY_SIZE], okm[KEY_SIZE:]


def associated_prefix(item: ItemInfo, format: int) -> bytes:
    """What every chunk's associated data starts with: the format's label and the item
    it is bound to (chunk index and final flag follow). Format 2 writes the identity
    length-prefixed; format 1 wrote the name, which two items may share."""
    if format == 1:
        return b"dcp_storage.aes256gcm/1\x00" + item.item.encode("utf-8") + b"\x00"
    fqn, offsets = item.identity if item.identity is not None else (item.item, ())
    name = fqn.encode("utf-8", "surrogatepass")
    bound = (
        f"dcp_storage.aes256gcm/{format}".encode()
        + b"\x00"
        + struct.pack(">I", len(name))
        + name
        + struct.pack(f">I{len(offsets)}q", len(offsets), *offsets)
    )
    if format == 2:
        return bound
    save = (item.save or "").encode("utf-8", "surrogatepass")
    return bound + struct.pack(">I", len(save)) + save


class Encryptor(BlockWriter):
    def __init__(
        self, out: IO[bytes], key: bytes, chunk_size: int, item: ItemInfo, format: int
    ) -> None:
        super().__init__(out, chunk_size)
        salt = secrets.token_bytes(16)
        self._prefix = secrets.token_bytes(8)
        item_key, check = derive(key, salt)
        self._aead = _aead(item_key)
        self._ad = associated_prefix(item, format)
        self._index = 0
        self._sealed = bytearray()
        out.write(_HEADER.pack(_MAGIC, format, salt, self._prefix, check))

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


class Decryptor(io.RawIOBase):
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
        self._ad = associated_prefix(item, format)
        self._unbound = format == FORMAT and item.save is None
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
        if magic == _MAGIC and version in FORMATS and version != self._format:
            legacy = " (never checked under an older binding)" if self._format < version else ""
            raise self._fail(
                f"the item's header says format {version} but its descriptor says format "
                f"{self._format}: the metadata or the item was altered{legacy}"
            )
        if magic != _MAGIC or version != self._format:
            raise self._fail(f"the bytes are not an AES-256-GCM item of format {self._format}")
        if self._unbound:
            raise self._fail(
                f"the item is of format {FORMAT}, bound to the save that wrote it, but its "
                "record names no save: the metadata was altered"
            )
        assert self._key is not None
        item_key, expected = derive(self._key, salt)
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
                "encrypted bytes (or this item's from another save's) put in this item's "
                "place"
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
