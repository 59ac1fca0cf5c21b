"""The stream-transform contract.

A transform encodes the bytes of one stored item on the way out and decodes them on
the way in. The minimum a transform provides is torch's experimental ``_extension``
API, unchanged, so a transform written for stock DCP works here as is:

``registry_name()``
    A stable name. Built-ins use ``stream.*`` / ``dcp_storage.*``; third parties
    namespace theirs (``acme.lz4``). A name never changes meaning.
``from_descriptor(version)``
    Rebuilds a decoder from everything after the first ``/`` of the descriptor.
``get_descriptor()``
    ``"name/version"``, optionally followed by configuration that decoding needs
    (``"acme.lz4/1;level=3"``). Never a secret.
``transform_to(output)``
    Returns a writer that needs only ``write``, ``flush`` and ``close``; closing it
    writes the transform's trailer. The ``output`` handed in has a ``close`` that only
    flushes, so a transform may close what it wraps.
``transform_from(input)``
    Returns a reader that needs only ``read`` (``readinto`` where it is cheap).

**Order rule.** ``transforms=[A, B]`` lists transforms in the order they are applied
when writing: data goes through A, then B, then to storage (compress, then encrypt).
Each item records the descriptors in that same order (``[A, B]``), which is also the
order torch records them in; a reader undoes them in reverse (B first, then A).

Transforms that need more than torch's API offers (the item's dtype, a key looked up
by id, associated data bound to the item) override the optional hooks ``encode``,
``descriptor_for`` and ``decoder_for``, which receive an :class:`ItemInfo`.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import IO, Any

from extensions._compat import TorchStreamTransform
from extensions.errors import quote

KeyLookup = Callable[[str], bytes]
Keys = Mapping[str, bytes] | KeyLookup


@dataclass(frozen=True)
class ItemInfo:
    """What the framework knows about the item being encoded or decoded.

    ``checkpoint`` and ``item`` are for error messages and for binding ciphertext to
    its item; ``dtype`` (e.g. ``"bfloat16"``) and ``element_size`` are set for tensor
    items and ``None`` for opaque bytes; ``keys`` resolves a key id to key bytes.
    """

    checkpoint: str = ""
    item: str = ""
    dtype: str | None = None
    element_size: int | None = None
    keys: KeyLookup | None = None


class StreamTransformExtension(TorchStreamTransform):  # type: ignore[misc,valid-type]
    """Base class of every transform; see the module docstring for the contract."""

    @staticmethod
    @abc.abstractmethod
    def registry_name() -> str: ...

    @staticmethod
    @abc.abstractmethod
    def from_descriptor(version: str) -> StreamTransformExtension: ...

    @abc.abstractmethod
    def get_descriptor(self) -> str: ...

    @abc.abstractmethod
    def transform_to(self, output: IO[bytes]) -> IO[bytes]: ...

    @abc.abstractmethod
    def transform_from(self, input: IO[bytes]) -> IO[bytes]: ...

    # Optional hooks; the defaults fall back to torch's API.
    def descriptor_for(self, item: ItemInfo) -> str:
        """The descriptor recorded for ``item`` (default: ``get_descriptor()``)."""
        return str(self.get_descriptor())

    def encode(self, output: IO[bytes], item: ItemInfo) -> IO[bytes]:
        """Writer that encodes ``item`` into ``output`` (default: ``transform_to``)."""
        return self.transform_to(output)

    @classmethod
    def decoder_for(cls, version: str, item: ItemInfo) -> Any:
        """A transform able to decode ``item`` (default: ``from_descriptor(version)``)."""
        return cls.from_descriptor(version)

    def decode(self, input: IO[bytes], item: ItemInfo) -> IO[bytes]:
        """Reader that decodes ``item`` from ``input`` (default: ``transform_from``)."""
        return self.transform_from(input)


def descriptor_settings(name: str, version: str, allowed: set[str]) -> dict[str, str]:
    """Parse ``"1;key=value;..."`` (everything after ``name/``) for a version-1 transform.

    Raises ``ValueError`` (reported as an unknown transform version) for another
    version, an unknown or repeated setting, or a setting without ``=``."""
    number, _, config = version.partition(";")
    if number != "1":
        raise ValueError(f"unsupported {name} version {quote(number)} (this reader knows 1)")
    settings: dict[str, str] = {}
    for part in config.split(";") if config else ():
        key, sep, value = part.partition("=")
        if not sep or key not in allowed or key in settings:
            raise ValueError(f"unexpected {name} setting {quote(part)}")
        settings[key] = value
    return settings


def resolve_key_lookup(keys: Keys | None) -> KeyLookup | None:
    """Turn a mapping or a callable of key_id -> key into a callable (or None)."""
    if keys is None or callable(keys):
        return keys
    mapping = keys

    def lookup(key_id: str) -> bytes:
        return mapping[key_id]

    return lookup


def cached_key_lookup(keys: Keys | None) -> KeyLookup | None:
    """:func:`resolve_key_lookup` that asks the source at most once per key id: one load
    needs the same key for every item, and a secret manager may be slow or metered.
    What the source returns is kept (``None`` too); what it raises is not."""
    lookup = resolve_key_lookup(keys)
    if lookup is None:
        return None
    source = lookup
    found: dict[str, bytes] = {}
    lock = threading.Lock()

    def cached(key_id: str) -> bytes:
        with lock:
            if key_id in found:
                return found[key_id]
        key = source(key_id)
        with lock:
            found[key_id] = key
        return key

    return cached
