"""The stream-transform contract, version 2.

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

**Version 2** adds, to subclasses of :class:`StreamTransformExtension`, one per-item
hook and six capabilities, each with a default that keeps a version-1 transform
working as it did:

``for_item(item)``
    Given what is known of the item (an :class:`ItemInfo`: its name, its identity,
    dtype, element size, the reader's keys), the transform to use for that item, built from this
    one; default: ``self``. The framework calls it for every item before it asks for
    the descriptor, the writer or the reader, on both sides: a filter learns the
    element size, a compressor the dtype, a cipher the item it binds and the keys it
    decodes with. Transforms are small immutable values: ``for_item`` returns a new
    one (or ``self``), never changes ``self``, and given the same item again returns
    what it returned the first time (the reader calls it once more on a decoder).
``authenticated`` (class attribute, default ``False``)
    ``True`` when decoding fails on any change to the stored bytes made without the
    transform's key (an AEAD, a MAC). Readers that require encryption accept an item
    only when its chain has such a stage.
``key_ids(version)`` (classmethod, default: none)
    The key ids decoding the descriptor ``name/version`` needs; readers look each up
    before any byte of the item is fetched, so a missing key or a failing key provider
    is reported as itself. ``ValueError`` for a version it cannot parse.
``fingerprint_key()`` (default ``None``)
    A secret key, derived from the transform's own, under which incremental saves key
    the content fingerprints they record (so nobody without it can test a guess of the
    content); the first transform of a chain that returns one keys the fingerprints.
``seal_key_ids(version)`` (classmethod) and ``seal_key()`` (default: none)
    Sealed metadata. A keyed transform that binds each item to the save that wrote it
    (``ItemInfo.save``) names, for the descriptor ``name/version``, the key ids under
    which the metadata of a checkpoint holding such items must be sealed; for one
    item, ``seal_key()`` gives that key id and the MAC key, derived from the
    transform's key (a decoder looks its key up as it would to decode). Writers seal
    the metadata under every such key of their chain; readers refuse such an item
    unless the metadata it was found through carries a seal that verifies
    (``storage.checkpoint.seal``), so no record of it can be changed or rolled back.
``max_expansion(version)`` (classmethod, default ``None``: unknown)
    The most plain bytes one stored byte under ``name/version`` can decode to, a bound
    of the format (a constant block from its shortest encoding); readers refuse a tensor
    chunk claiming more elements than its stored bytes could decode to before
    allocating it.
``frame_decoder(version)`` and ``frames(version, read_at, length)`` (classmethods, default: none)
    Splittable into independent frames. A transform whose output for an item is a
    sequence of pieces that each decode on their own offers, for the descriptor
    ``name/version``, a function decoding one piece (``frame_decoder``: a
    :data:`FrameDecoder`, ``None`` when not splittable) and, for one recorded item of
    ``length`` stored bytes, its list of :class:`Frame` (``frames``: ``read_at(offset,
    size)`` reads the item's stored bytes, e.g. an index at its end; ``None`` when this
    item has no list). When an item's chain is that transform alone, a reader decodes
    the frames on every core, each straight into its slice of the target, while its own
    threads read on; an item without a list but of at most :data:`MAX_FRAME_BYTES` is
    decoded whole from one buffer (``whole=True``). The list is a claim, checked as it
    is used: frames in stored order, not overlapping, inside the item, each at most
    :data:`MAX_FRAME_BYTES` stored bytes, their decoded pieces tiling the plain bytes
    from 0, and each must decode to exactly its ``decoded_length``; the CRC-32C of every
    stored byte is checked before the target is handed over. The decoder is called
    from several threads at once. ``zstd`` offers it from its seek table.

Version 1's item hooks (``descriptor_for``, ``encode``, ``decoder_for``, ``decode``,
each given an :class:`ItemInfo`) are still offered, now derived from ``for_item``; a
transform written against version 1 that overrides them (and not ``for_item``) is
still called through them (:func:`stage_for`).
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Any, ClassVar

from extensions._compat import TorchStreamTransform
from extensions.errors import quote

KeyLookup = Callable[[str], bytes]
Keys = Mapping[str, bytes] | KeyLookup

#: The most stored bytes one frame of a splittable transform may hold (readers buffer
#: a frame whole): 4 MiB and 64 KiB, zstd's frame of 4 MiB input and its worst-case growth.
MAX_FRAME_BYTES = (4 << 20) + (64 << 10)


@dataclass(frozen=True)
class Frame:
    """One independently decodable piece of a stored item: its stored bytes are
    ``[stored_offset, stored_offset + stored_length)`` of the item, and they decode to
    its plain bytes ``[decoded_offset, decoded_offset + decoded_length)``."""

    stored_offset: int
    stored_length: int
    decoded_offset: int
    decoded_length: int


#: ``decode(source, whole)``: a reader of the plain bytes that ``source`` (the stored
#: bytes of one frame, held in memory) decodes to, ending where the frame ends; with
#: ``whole=True`` ``source`` is every stored byte of an item without a frame list, and
#: the reader decodes all of it.
FrameDecoder = Callable[[memoryview, bool], IO[bytes]]
#: ``read_at(offset, size)``: ``size`` stored bytes of an item from ``offset``.
ReadAt = Callable[[int, int], bytes]


@dataclass(frozen=True)
class ItemInfo:
    """What the framework knows about the item being encoded or decoded.

    ``checkpoint`` and ``item`` (the item's name) are for error messages; ``identity``,
    set by the framework for an item of a checkpoint, is its key there, the state-dict
    key and the chunk offsets (``()`` for a whole tensor or an object), the
    unambiguous name a cipher binds ciphertext to (``None`` outside a checkpoint: then
    ``item`` is the name, with no offsets); ``dtype`` (e.g. ``"bfloat16"``) and
    ``element_size`` are set for tensor items and ``None`` for opaque bytes; ``keys``
    resolves a key id to key bytes. ``save`` is the id of the save that wrote the item
    (set by the writer, and by a reader from the item's record; ``None`` outside a
    checkpoint, or for an item recorded without one): what a cipher binds the item to
    beside its identity, so the same item of another save does not authenticate.
    ``plain_bytes``, set by a reader, is the most plain bytes it accepts from the item
    once every stage is undone (from the request, never from what the checkpoint
    claims; ``None`` when unknown): a decoder may size what a stored header asks for by
    it (zstd's window), allowing that a stage feeding another may produce a little more.
    """

    checkpoint: str = ""
    item: str = ""
    identity: tuple[str, tuple[int, ...]] | None = None
    dtype: str | None = None
    element_size: int | None = None
    keys: KeyLookup | None = None
    plain_bytes: int | None = None
    save: str | None = None


class StreamTransformExtension(TorchStreamTransform):  # type: ignore[misc,valid-type]
    """Base class of every transform; see the module docstring for the contract."""

    authenticated: ClassVar[bool] = False

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

    # --- version 2: the per-item hook and the capabilities --------------------------

    def for_item(self, item: ItemInfo) -> StreamTransformExtension:
        """The transform to use for ``item`` (default: ``self``)."""
        return self

    @classmethod
    def key_ids(cls, version: str) -> tuple[str, ...]:
        """The key ids decoding ``name/version`` needs (default: none)."""
        return ()

    def fingerprint_key(self) -> bytes | None:
        """The key of keyed content fingerprints (default: ``None``, not keyed)."""
        return None

    @classmethod
    def seal_key_ids(cls, version: str) -> tuple[str, ...]:
        """The key ids under which the metadata of a checkpoint holding an item stored
        as ``name/version`` must be sealed (default: none, no seal required)."""
        return ()

    def seal_key(self) -> tuple[str, bytes] | None:
        """The key id and MAC key of the metadata seal for this item's stage (default:
        ``None``); a decoder looks its key up as it would to decode."""
        return None

    @classmethod
    def max_expansion(cls, version: str) -> int | None:
        """The most plain bytes one stored byte of an item stored under ``name/version``
        can decode to, as a bound the format itself sets (a constant block decoded from
        its shortest encoding), not a typical ratio; ``None`` (the default): unknown.
        Readers refuse a tensor claiming more elements than its stored bytes could
        decode to before allocating it."""
        return None

    @classmethod
    def frame_decoder(cls, version: str) -> FrameDecoder | None:
        """The decoder of one frame of items stored under ``name/version`` (default:
        ``None``, not splittable into frames)."""
        return None

    @classmethod
    def frames(cls, version: str, read_at: ReadAt, length: int) -> Sequence[Frame] | None:
        """The frames of one item of ``length`` stored bytes under ``name/version``,
        found with ``read_at`` (default: ``None``, no frame list)."""
        return None

    # --- version 1's item hooks, derived from for_item ------------------------------

    def descriptor_for(self, item: ItemInfo) -> str:
        """The descriptor recorded for ``item``."""
        return str(self.for_item(item).get_descriptor())

    def encode(self, output: IO[bytes], item: ItemInfo) -> IO[bytes]:
        """Writer that encodes ``item`` into ``output``."""
        return self.for_item(item).transform_to(output)

    @classmethod
    def decoder_for(cls, version: str, item: ItemInfo) -> Any:
        """A transform able to decode ``item`` stored under ``name/version``."""
        return cls.from_descriptor(version).for_item(item)

    def decode(self, input: IO[bytes], item: ItemInfo) -> IO[bytes]:
        """Reader that decodes ``item`` from ``input``."""
        return self.for_item(item).transform_from(input)


_V1_HOOKS = ("descriptor_for", "encode", "decode")


def _uses_v1_hooks(cls: type[StreamTransformExtension]) -> bool:
    """Written against version 1: overrides an item hook, and not ``for_item``."""
    base = StreamTransformExtension
    return cls.for_item is base.for_item and any(
        getattr(cls, hook) is not getattr(base, hook) for hook in _V1_HOOKS
    )


class _ItemHooks:
    """A version-1 transform seen through torch's methods for one item."""

    def __init__(self, transform: StreamTransformExtension, item: ItemInfo) -> None:
        self._transform = transform
        self._item = item

    def registry_name(self) -> str:
        return str(self._transform.registry_name())

    def get_descriptor(self) -> str:
        return self._transform.descriptor_for(self._item)

    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        return self._transform.encode(output, self._item)

    def transform_from(self, input: IO[bytes]) -> IO[bytes]:
        return self._transform.decode(input, self._item)


def stage_for(transform: Any, item: ItemInfo) -> Any:
    """``transform`` made ready for ``item``, as an object offering torch's methods
    (``get_descriptor``, ``transform_to``, ``transform_from``): a version-2 transform's
    ``for_item(item)``, a version-1 transform seen through its item hooks, and a
    transform that offers torch's API only, as it is. The one place the framework
    tells the contract's versions apart."""
    if not isinstance(transform, StreamTransformExtension):
        return transform
    if _uses_v1_hooks(type(transform)):
        return _ItemHooks(transform, item)
    return transform.for_item(item)


def descriptor_settings(
    name: str, version: str, allowed: set[str], known: tuple[str, ...] = ("1",)
) -> dict[str, str]:
    """Parse ``"1;key=value;..."`` (everything after ``name/``) for a transform whose
    readers know the versions ``known``.

    Raises ``ValueError`` (reported as an unknown transform version) for another
    version, an unknown or repeated setting, or a setting without ``=``."""
    number, _, config = version.partition(";")
    if number not in known:
        raise ValueError(
            f"unsupported {name} version {quote(number)} (this reader knows {', '.join(known)})"
        )
    settings: dict[str, str] = {}
    for part in config.split(";") if config else ():
        key, sep, value = part.partition("=")
        if not sep or key not in allowed or key in settings:
            raise ValueError(f"unexpected {name} setting {quote(part)}")
        settings[key] = value
    return settings


def whole_number(text: str, low: int, high: int) -> int | None:
    """``text`` as a whole number from ``low`` to ``high`` (``0 <= low <= high``) written
    in ASCII digits, else ``None``. Other digits ``str.isdigit`` accepts are refused
    (``int`` fails on ``"\\u00b2"`` and reads ``"\\u0663"`` as 3), and so is any text
    longer than ``high`` written out: what a checkpoint or the environment claims costs
    nothing to refuse, however long (``int`` refuses 4300 digits with advice to raise
    the limit)."""
    if not (0 < len(text) <= len(str(high)) and text.isascii() and text.isdigit()):
        return None
    value = int(text)
    return value if low <= value <= high else None


def descriptor_number(name: str, key: str, value: str, low: int, high: int) -> int:
    """The setting ``key=value`` of a ``name`` descriptor as a whole number from ``low``
    to ``high`` (see :func:`whole_number`), else ``ValueError`` (reported, with the
    checkpoint and the item, as a descriptor that cannot be decoded)."""
    number = whole_number(value, low, high)
    if number is None:
        raise ValueError(
            f"{name} setting {key} must be {low} to {high} in ASCII digits, got "
            f"{quote(value, 24)} (damaged or altered metadata: restore it or re-save)"
        )
    return number


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
