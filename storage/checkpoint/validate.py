"""What a well-formed ``.metadata`` is: the checks every reader relies on.

:func:`check_metadata` runs once, right after the restricted unpickler
(``format.load_metadata``) built the object and before anything uses it or quotes it in
a message, so every reader - ``CheckpointReader``, ``describe``/``verify``/``copy``, the
CLI, the commit steps - sees only metadata whose values have the types and ranges the
code assumes. A hostile or damaged file is refused with :class:`UnsafeCheckpointError`
naming the item, never with an ``OverflowError`` or ``AttributeError`` from deep inside.

Two passes. The first walks the whole object graph counting every visit, so shared
references cannot make the graph an exponential tree for later code (a ~2 KB pickle of
lists that each hold the previous one twice is a tree of 2**24 nodes at 24 levels): the
walk stops after a budget proportional to the file size, and at a nesting depth no DCP
metadata has. The second checks the schema: names are strings, offsets, lengths and
sizes non-negative ints below :data:`MAX_SIZE`, at most :data:`MAX_DIMS` dimensions to
a tensor, every chunk inside its tensor, every
``relative_path`` a file inside the checkpoint (a plain name, or one hex key prefix
and a plain name) and every base reference the plain name of a sibling checkpoint.
Such names are also bounded (:data:`MAX_NAME` printable characters, a file name's
limit), so a path built from them never fails with a raw ``ENAMETOOLONG`` and never
carries terminal escape sequences into a message.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from enum import Enum
from pathlib import PurePath
from typing import Any, NoReturn

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from extensions._compat import LegacyTensorProperties, StorageInfo
from extensions.errors import UnsafeCheckpointError, quote
from storage.checkpoint.prefixes import is_prefix, split
from storage.checkpoint.storage_format import (
    CONTENT,
    CRC32C,
    DATA_OFFSET,
    DTYPE,
    EXTRA,
    NBYTES,
    ORIGIN,
    REF,
    SAVE,
    StoredItem,
    item_label,
    parse_facts,
)

#: Bound on every offset, length, dimension and byte count a metadata may state: no
#: file or tensor is larger, and sums of two such values still fit in an int64.
MAX_SIZE = 1 << 62
#: Most dimensions a tensor may state: torch makes no tensor of more (its counts of
#: chunks would fail with a raw ``RuntimeError``, in every load of the checkpoint).
MAX_DIMS = 64
#: Longest file or checkpoint name a metadata may state (a path component's limit on
#: common filesystems; stock DCP's names are a few dozen characters).
MAX_NAME = 255
#: Deepest nesting accepted (DCP metadata nests about 6 levels).
MAX_DEPTH = 32
#: Most transforms one item's chain may list (a chain is 1-3 in practice): each stage is
#: a decoder with its own buffers and a level of nesting in every read.
MAX_CHAIN = 16
#: Longest save id accepted (ours are 12 hex digits, torch's a 36-character uuid4).
MAX_SAVE_ID = 128


def is_save_id(value: object) -> bool:
    """Whether ``value`` can be a save id: 1 to :data:`MAX_SAVE_ID` printable characters
    and no path separator. Ours and torch's are letters, digits and dashes; another
    writer's (a timestamp, say) loads too, but nothing that would retitle a terminal,
    flood a message or name a path where data file names embed it."""
    return (
        isinstance(value, str)
        and 0 < len(value) <= MAX_SAVE_ID
        and value.isprintable()
        and "/" not in value
        and "\\" not in value
    )


_SAVE_ID_RULE = f"a save id (1 to {MAX_SAVE_ID} printable characters, no '/' or '\\')"
#: Object-graph visits allowed per byte of metadata, plus a floor. Each node of a
#: well-formed metadata costs at least one opcode byte, and its few shared objects
#: (dtypes, a shared offsets tuple) a couple of visits each; measured: ~1 visit/byte.
VISITS_PER_BYTE = 8
MIN_VISITS = 1 << 16

_LEAVES = (
    str,
    bytes,
    int,
    float,
    complex,
    bool,
    type(None),
    torch.dtype,
    torch.layout,
    torch.memory_format,
    Enum,
    PurePath,
)
_EXACT_LEAVES = frozenset(
    {str, bytes, int, float, bool, type(None), torch.dtype, torch.layout, torch.memory_format}
)
_MISSING = object()


def is_plain_name(name: object) -> bool:
    """Whether ``name`` is one plain path component: not empty, ``.`` or ``..``, no
    separator, drive or URL colon, at most :data:`MAX_NAME` characters, all printable."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and len(name) <= MAX_NAME
        and name.isprintable()
        and not any(c in name for c in "/\\:")
    )


def check_relative_path(path: object, where: str, item: str) -> None:
    """Refuse anything but a file inside the checkpoint: a plain file name, or one
    prefix directory of the fixed form ``prefixes.PREFIX`` (1-8 lowercase hex digits)
    and a plain file name (``CheckpointWriter(key_prefixes=N)``)."""
    prefix, name = split(path) if isinstance(path, str) else (None, path)
    if not (is_plain_name(name) and (prefix is None or is_prefix(prefix))):
        raise UnsafeCheckpointError(
            f"{where}: item {quote(item)} points at {quote(path)}, which is not a file inside "
            "the checkpoint (absolute paths, '..', sub-directories other than one hex key "
            f"prefix, URLs, names over {MAX_NAME} characters and unprintable characters are "
            "refused)"
        )


def check_reference(name: object, where: str, item: str) -> None:
    """Refuse a base reference (incremental checkpoints) that is anything but the plain
    name of a sibling checkpoint: the bytes of a referenced item are read from
    ``<parent>/<name>/<relative_path>``, so no other directory, bucket or URL is reachable."""
    if not is_plain_name(name):
        raise UnsafeCheckpointError(
            f"{where}: item {quote(item)} references base checkpoint {quote(name)}, which is "
            "not the name of a checkpoint beside this one (absolute paths, '..', "
            f"sub-directories, URLs, other buckets, names over {MAX_NAME} characters and "
            "unprintable characters are refused)"
        )


def check_metadata(metadata: object, where: str, size: int) -> Metadata:
    """``metadata`` (unpickled from ``size`` bytes) if well-formed, else
    :class:`UnsafeCheckpointError` naming the first bad item."""
    _check_graph(metadata, where, VISITS_PER_BYTE * size + MIN_VISITS)
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(
            f"{where}: metadata holds a {type(metadata).__name__}, not DCP Metadata"
        )
    state = _attr(metadata, "state_dict_metadata", where, "metadata")
    if not isinstance(state, dict):
        _bad(where, "metadata", "state_dict_metadata", state, "a dict")
    for fqn, md in state.items():
        if not isinstance(fqn, str):
            _bad(where, "metadata", "a state_dict key", fqn, "a str")
        _check_entry(md, where, fqn)
    storage_data = getattr(metadata, "storage_data", None)
    if storage_data is not None and not isinstance(storage_data, dict):
        _bad(where, "metadata", "storage_data", storage_data, "a dict")
    for index, info in (storage_data or {}).items():
        _check_storage_info(index, info, where)
    _check_save_ids(metadata, where)
    return metadata


def _check_save_ids(metadata: Metadata, where: str) -> None:
    """Refuse a ``storage_meta`` that is not one, and a save id (its ``save_id``, a
    copy's ``origin``) that is not one: readers set their load id on the first, and
    copies, drains, restores and the seal compare the others and quote them."""
    storage_meta = getattr(metadata, "storage_meta", None)
    if storage_meta is not None and not isinstance(storage_meta, StorageMeta):
        _bad(where, "metadata", "storage_meta", storage_meta, "a StorageMeta")
    facts = getattr(metadata, EXTRA, None)
    ids = (
        ("storage_meta.save_id", getattr(storage_meta, "save_id", None)),
        (f"{EXTRA}[{ORIGIN!r}]", facts.get(ORIGIN) if isinstance(facts, dict) else None),
    )
    for what, save_id in ids:
        if save_id is not None and not is_save_id(save_id):
            _bad(where, "metadata", what, save_id, _SAVE_ID_RULE)


def _check_graph(root: object, where: str, budget: int) -> None:
    """Refuse a metadata graph that unfolds into more than ``budget`` nodes (shared
    references walked each time) or nests deeper than :data:`MAX_DEPTH`. Children of
    the commonest leaf types are counted where they are found, not pushed and popped:
    a metadata of 20,000 items holds about a million of them."""
    stack: list[tuple[object, int]] = [(root, 0)]
    visits = 0
    while stack:
        obj, depth = stack.pop()
        visits += 1
        if visits > budget:
            raise _too_many_nodes(where, budget)
        if depth > MAX_DEPTH:
            raise _too_deep(where)
        if isinstance(obj, _LEAVES):
            continue
        if isinstance(obj, dict):
            children: Any = [*obj.keys(), *obj.values()]
        elif isinstance(obj, (list, tuple, set, frozenset)):
            children = obj
        else:
            children = getattr(obj, "__dict__", {}).values()
        depth += 1
        if depth > MAX_DEPTH and children:  # plain values are nodes too: not pushed
            raise _too_deep(where)
        for child in children:
            if type(child) in _EXACT_LEAVES:
                visits += 1  # checked against the budget at the next pop
            else:
                stack.append((child, depth))
    if visits > budget:  # leaves counted after the last pop
        raise _too_many_nodes(where, budget)


def _too_deep(where: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"{where}: metadata is refused: it nests deeper than {MAX_DEPTH} levels; "
        "the file is damaged or hostile"
    )


def _too_many_nodes(where: str, budget: int) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"{where}: metadata is refused: its objects share references so that it "
        f"unfolds into more than {budget} nodes (a well-formed metadata has about "
        "one per byte); the file is damaged or hostile"
    )


def _attr(obj: object, name: str, where: str, item: str) -> Any:
    value = getattr(obj, name, _MISSING)
    if value is _MISSING:
        raise UnsafeCheckpointError(
            f"{where}: item {quote(item)}: its {type(obj).__name__} has no {name!r}; the "
            "metadata is damaged or was not written by DCP"
        )
    return value


def _bad(where: str, item: str, what: str, value: object, expected: str) -> NoReturn:
    raise UnsafeCheckpointError(
        f"{where}: item {quote(item)}: {what} is {quote(value)}, expected {expected}; the "
        "metadata is damaged or hostile"
    )


def multiplied_out(sizes: Sequence[int]) -> int:
    """The product of ``sizes``' non-zero dimensions: what torch's stride and storage
    computations multiply out, also for a tensor with no element (no tensor of shape
    ``(2**62, 2**62, 0)`` can be made: "Storage size calculation overflowed")."""
    return math.prod(s for s in sizes if s)


def _is_size(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_SIZE


def _sizes(value: object, where: str, item: str, what: str) -> Sequence[int]:
    if not isinstance(value, (tuple, list)) or not all(_is_size(v) for v in value):
        _bad(where, item, what, value, "a sequence of ints in [0, 2**62]")
    return value  # type: ignore[return-value]


def _check_entry(md: object, where: str, fqn: str) -> None:
    if isinstance(md, BytesStorageMetadata):
        return
    if not isinstance(md, TensorStorageMetadata):
        _bad(where, fqn, "its state_dict_metadata entry", md, "tensor or bytes metadata")
    properties = _attr(md, "properties", where, fqn)
    if not isinstance(properties, (TensorProperties, LegacyTensorProperties)) or not isinstance(
        _attr(properties, "dtype", where, fqn), torch.dtype
    ):
        _bad(where, fqn, "its tensor properties", properties, "TensorProperties with a dtype")
    size = _sizes(_attr(md, "size", where, fqn), where, fqn, "its size")
    if len(size) > MAX_DIMS:
        _bad(where, fqn, "its size", size, f"at most {MAX_DIMS} dimensions (torch's limit)")
    if multiplied_out(size) * properties.dtype.itemsize > MAX_SIZE:
        _bad(where, fqn, "its size", size, "at most 2**62 bytes (its non-zero sizes multiplied)")
    chunks = _attr(md, "chunks", where, fqn)
    if not isinstance(chunks, list):
        _bad(where, fqn, "its chunk list", chunks, "a list")
    for chunk in chunks:
        if not isinstance(chunk, ChunkStorageMetadata):
            _bad(where, fqn, "a chunk", chunk, "ChunkStorageMetadata")
        offsets = _sizes(_attr(chunk, "offsets", where, fqn), where, fqn, "a chunk's offsets")
        sizes = _sizes(_attr(chunk, "sizes", where, fqn), where, fqn, "a chunk's sizes")
        if (
            len(offsets) != len(size)
            or len(sizes) != len(size)
            or any(o + s > d for o, s, d in zip(offsets, sizes, size))
        ):
            # A chunk larger than its tensor would make a reader allocate what the
            # checkpoint claims, not what the caller asked for.
            raise UnsafeCheckpointError(
                f"{where}: item {quote(fqn)}: chunk at {quote(list(offsets))} of size "
                f"{quote(list(sizes))} does not lie inside the tensor of size "
                f"{quote(list(size))}; the metadata is damaged or hostile"
            )


def _check_storage_info(index: object, info: object, where: str) -> None:
    if not isinstance(index, MetadataIndex) or not isinstance(getattr(index, "fqn", None), str):
        _bad(where, "storage index", "a key", index, "a MetadataIndex with a str fqn")
    offset = getattr(index, "offset", None)
    if offset is not None:
        _sizes(offset, where, index.fqn, "its index offset")
    parse_item(info, where, item_label(index))


def parse_item(info: object, where: str, label: str) -> StoredItem:
    """The record of one item (its ``_StorageInfo``) checked and parsed, once, into a
    :class:`StoredItem` kept on it (``storage_format.stored_item``)."""
    if not isinstance(info, StorageInfo):
        _bad(where, label, "its storage info", info, "a _StorageInfo")
    check_relative_path(_attr(info, "relative_path", where, label), where, label)
    start = _attr(info, "offset", where, label)
    length = _attr(info, "length", where, label)
    if not _is_size(start):
        _bad(where, label, "its offset", start, "an int in [0, 2**62]")
    if not _is_size(length) or start + length > MAX_SIZE:
        _bad(where, label, "its length", length, "an int in [0, 2**62 - offset]")
    descriptors = getattr(info, "transform_descriptors", None)
    if descriptors is not None and (
        not isinstance(descriptors, (list, tuple))
        or len(descriptors) > MAX_CHAIN
        or not all(isinstance(d, str) for d in descriptors)
    ):
        _bad(
            where,
            label,
            "its transform descriptors",
            descriptors,
            f"a list of at most {MAX_CHAIN} str",
        )
    extra = getattr(info, EXTRA, None)
    if extra is None:
        extra = {}
    if not isinstance(extra, dict):
        _bad(where, label, f"its {EXTRA} facts", extra, "a dict")
    crc = extra.get(CRC32C)
    if crc is not None and not (_is_size(crc) and crc < 1 << 32):
        _bad(where, label, f"its {CRC32C}", crc, "a 32-bit unsigned int")
    for key in (DATA_OFFSET, NBYTES):
        if key in extra and not _is_size(extra[key]):
            _bad(where, label, f"its {key}", extra[key], "an int in [0, 2**62]")
    if DTYPE in extra and not isinstance(extra[DTYPE], str):
        _bad(where, label, f"its {DTYPE}", extra[DTYPE], "a str")
    if REF in extra:
        check_reference(extra[REF], where, label)
    save = extra.get(SAVE)
    if save is not None and not is_save_id(save):
        _bad(where, label, f"its {SAVE}", save, _SAVE_ID_RULE)
    # A fingerprint that is not a string matches nothing (the item is written again).
    return parse_facts(info, {k: v for k, v in extra.items() if k != CONTENT or isinstance(v, str)})
