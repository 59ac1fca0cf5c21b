"""On-storage format: names, metadata (de)serialization, safe loading, item facts.

The format is stock DCP's: data files hold items back to back (each a ``torch.save``
archive for tensors, raw bytes for other objects, passed through the item's transform
chain) and ``.metadata`` is a pickled ``torch.distributed.checkpoint.Metadata``. Our
extra facts ride along where stock torch ignores them:

* ``Metadata.dcp_storage`` = ``{"format": FORMAT_VERSION}``, plus ``"origin"`` on a
  copy (``storage.ops.copy``, the tier drain): the save id of the save it copies;
* each ``_StorageInfo.dcp_storage`` = ``{"crc32c": int}`` (checksum of the stored
  bytes) plus, for tensors, ``"data_offset"``: where the tensor's raw bytes start in
  the decoded item, which lets a reader decode straight into the target tensor (all
  keys in docs/format.md).

This module owns the per-item record: its key names on storage are written here only,
:class:`StoredItem` is its typed form, :func:`new_storage_info` the one place it is
serialized. ``validate.check_metadata`` parses every loaded item's record once;
everything else reads :func:`stored_item` fields, never keys.

Loading never executes code from the checkpoint: the metadata unpickler only builds
torch's metadata classes and plain data, and every ``relative_path`` must name a file
directly inside the checkpoint.
"""

from __future__ import annotations

import contextlib
import gc
import io
import pickle
import re
import weakref
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from extensions._compat import StorageInfo
from extensions.errors import UnsafeCheckpointError, printable
from storage.checkpoint import pickle_scan

_RANK_OF_FILE = re.compile(r"__([0-9]+)_")

FORMAT_VERSION = 1
METADATA_NAME = ".metadata"
DATA_SUFFIX = ".distcp"
#: Largest ``.metadata`` (or rank-local metadata) a reader accepts: at ~200 bytes per
#: item (docs/scale.md), over 5 million items.
MAX_METADATA_BYTES = 1 << 30


def metadata_name(rank: int | None = None) -> str:
    """``.metadata``, or ``__{rank}.metadata`` for saves with ``use_collectives=False``."""
    return METADATA_NAME if rank is None else f"__{rank}{METADATA_NAME}"


def data_file_name(rank: int, number: int, save_id: str) -> str:
    """``__{rank}_{n}-{save_id}.distcp``: unique per save, so an overwrite never
    writes into a file that the committed metadata points at."""
    return f"__{rank}_{number}-{save_id}{DATA_SUFFIX}"


def file_rank(relative_path: str) -> int:
    """The rank that wrote the data file ``relative_path`` (``[<key prefix>/]__{rank}_{n}
    ...``, see :func:`data_file_name`; 0 for a name of another form)."""
    match = _RANK_OF_FILE.match(relative_path.rpartition("/")[2])
    return int(match.group(1)) if match else 0


def item_label(index: MetadataIndex) -> str:
    """The item's name in messages (and in the associated data of encrypted items of
    the legacy format 1). Not unambiguous: the key ``w@[4]`` and the chunk of ``w`` at
    offset 4 share it; :func:`item_identity` is what encryption binds now."""
    if index.offset is not None and any(index.offset):
        return f"{index.fqn}@{list(index.offset)}"
    return index.fqn


def item_identity(index: MetadataIndex) -> tuple[str, tuple[int, ...]]:
    """The item's key, as encryption binds it (``ItemInfo.identity``): the state-dict
    key and the chunk offsets, ``()`` where :func:`item_label` shows none (a whole
    tensor, an object), so the two name the same items, this one unambiguously."""
    offsets = tuple(int(o) for o in index.offset) if index.offset is not None else ()
    return index.fqn, offsets if any(offsets) else ()


# --- the per-item record --------------------------------------------------------------

EXTRA = "dcp_storage"  # attribute name of our facts on Metadata and _StorageInfo
# Keys of an item's facts (``_StorageInfo.dcp_storage``), as stored:
CRC32C = "crc32c"  # CRC-32C of the stored bytes
DATA_OFFSET = "data_offset"  # where the tensor's raw bytes start in the decoded archive
DTYPE = "dtype"  # the stored tensor bytes' dtype ...
NBYTES = "nbytes"  # ... and size
CONTENT = "content"  # the fingerprint of the item's plain content (incremental saves)
REF = "ref"  # the sibling checkpoint holding a referenced item's bytes
SAVE = "save"  # the save that wrote the item, for a transform that binds it (AES)
# Keys of a checkpoint's facts (``Metadata.dcp_storage``):
FORMAT = "format"
ORIGIN = "origin"  # the save id of the save a copy was made from
CHAIN = "chain"  # incremental saves since the last full one
SEAL = "seal"  # the metadata's MACs by key id (``storage.checkpoint.seal``)
RANKS = "ranks"  # how many ranks saved a global metadata's checkpoint together


@dataclass(frozen=True)
class StoredItem:
    """One stored item's record: where its stored bytes are (torch's ``_StorageInfo``:
    ``[offset, offset + length)`` of ``relative_path``, in the checkpoint or, with
    ``ref``, in that sibling checkpoint), the transform chain they went through, and our
    facts about them, ``None`` where the writer recorded none (stock DCP records none).
    ``others`` keeps facts this version does not know, so a copy carries them on."""

    relative_path: str
    offset: int
    length: int
    descriptors: tuple[str, ...] = ()
    crc32c: int | None = None
    data_offset: int | None = None
    dtype: str | None = None
    nbytes: int | None = None
    content: str | None = None
    ref: str | None = None
    save: str | None = None
    others: tuple[tuple[str, Any], ...] = ()

    def facts(self) -> dict[str, Any]:
        """The facts as stored (``_StorageInfo.dcp_storage``)."""
        facts = dict(self.others)
        for key, value in (
            (CONTENT, self.content),
            (DATA_OFFSET, self.data_offset),
            (DTYPE, self.dtype),
            (NBYTES, self.nbytes),
            (CRC32C, self.crc32c),
            (REF, self.ref),
            (SAVE, self.save),
        ):
            if value is not None:
                facts[key] = value
        return facts


_KNOWN = frozenset({CRC32C, DATA_OFFSET, DTYPE, NBYTES, CONTENT, REF, SAVE})


def parse_facts(info: Any, facts: dict[str, Any]) -> StoredItem:
    """The record of ``info`` with its ``facts`` (types checked by the caller,
    ``validate``), kept on ``info`` for :func:`stored_item`."""
    record = StoredItem(
        info.relative_path,
        info.offset,
        info.length,
        tuple(info.transform_descriptors or ()),
        crc32c=facts.get(CRC32C),
        data_offset=facts.get(DATA_OFFSET),
        dtype=facts.get(DTYPE),
        nbytes=facts.get(NBYTES),
        content=facts.get(CONTENT) if isinstance(facts.get(CONTENT), str) else None,
        ref=facts.get(REF),
        save=facts.get(SAVE),
        others=tuple((k, v) for k, v in facts.items() if k not in _KNOWN),
    )
    _keep(info, record)
    return record


# Parsed records by the id of their _StorageInfo, beside it rather than on it, so that
# whoever pickles the metadata (DCP, a user, a test) stores exactly what was loaded;
# an entry goes with its _StorageInfo.
_RECORDS: dict[int, tuple[weakref.ref[Any], StoredItem]] = {}


def _keep(info: Any, record: StoredItem) -> None:
    key = id(info)

    def forget(ref: weakref.ref[Any]) -> None:
        if _RECORDS.get(key, (None,))[0] is ref:
            _RECORDS.pop(key, None)

    _RECORDS[key] = (weakref.ref(info, forget), record)


def stored_item(info: Any) -> StoredItem:
    """The record of ``info`` (a ``_StorageInfo``, or a record already): parsed once,
    when its metadata was loaded; an item that did not come from ``load_metadata``
    (another rank's copy of the metadata, a write result) is checked and parsed now."""
    if isinstance(info, StoredItem):
        return info
    kept = _RECORDS.get(id(info))
    if kept is not None and kept[0]() is info:
        return kept[1]
    from storage.checkpoint.validate import parse_item  # validate builds on this module

    return parse_item(info, "metadata", str(getattr(info, "relative_path", "item")))


def new_storage_info(record: StoredItem) -> StorageInfo:
    """``record`` as stored: a ``_StorageInfo`` with our facts (the one serialization)."""
    # torch leaves transform_descriptors out when empty; so do we (older readers).
    info = StorageInfo(
        record.relative_path, record.offset, record.length, list(record.descriptors) or None
    )
    setattr(info, EXTRA, record.facts())
    _keep(info, record)
    return info


def dump_metadata(metadata: Metadata, **extra: Any) -> bytes:
    """Pickle ``metadata`` with our facts (``format``, plus ``extra``) attached."""
    setattr(metadata, EXTRA, {FORMAT: FORMAT_VERSION, **extra})
    return pickle.dumps(metadata)


def checkpoint_facts(metadata: Metadata | None) -> dict[str, Any]:
    """``Metadata.dcp_storage`` (checked by ``validate``), empty when absent."""
    facts = getattr(metadata, EXTRA, None)
    return facts if isinstance(facts, dict) else {}


def ranks_of(metadata: Metadata) -> int | None:
    """How many ranks saved the checkpoint of a global ``metadata`` together, as its
    save recorded; ``None`` where it did not (older saves, copies of them, stock DCP's
    checkpoints, rank-local metadata) or recorded no positive int."""
    ranks = checkpoint_facts(metadata).get(RANKS)
    return ranks if type(ranks) is int and ranks > 0 else None


def save_of(metadata: Metadata) -> str | None:
    """The id of the save that produced ``metadata``'s checkpoint: a copy's
    ``origin``, else its own ``storage_meta.save_id`` (``None`` when it has neither,
    as stock DCP's checkpoints may). Two checkpoints with the same id hold the same
    state, whatever their data files are called."""
    origin = checkpoint_facts(metadata).get(ORIGIN)
    if isinstance(origin, str):
        return origin
    save_id = getattr(getattr(metadata, "storage_meta", None), "save_id", None)
    return save_id if isinstance(save_id, str) else None


# --- safe loading -------------------------------------------------------------------

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED: dict[str, set[str]] = {
    _DCP_METADATA: {
        "Metadata",
        "TensorStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
        "ChunkStorageMetadata",
        "BytesStorageMetadata",
        "MetadataIndex",
        "StorageMeta",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo", "_StoragePrefix"},
    # Older torch releases pickled the legacy ShardedTensor TensorProperties (and its enum)
    # into TensorStorageMetadata; stock still reads those checkpoints, so we do too.
    "torch.distributed._shard.sharded_tensor.metadata": {"TensorProperties", "MEM_FORMAT_ENCODING"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"} | {n for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype)},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "complex"},
}


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, file: IO[bytes], where: str) -> None:
        super().__init__(file)
        self._where = where

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(
            f"{self._where}: metadata refers to {printable(f'{module}.{name}', 200)}, which is "
            "not a DCP metadata "
            "class or plain data; refusing to load it (it could run code). Only load "
            "checkpoints from sources you trust, and re-save this one with dcp-storage or "
            "stock DCP."
        )


def load_metadata(data: bytes, where: str) -> Metadata:
    """Unpickle ``.metadata`` safely and check it (``validate.check_metadata``)."""
    from storage.checkpoint.validate import check_metadata  # validate builds on this module

    _check_memo_refusing(data, where)
    with _collector_paused():
        try:
            metadata = _RestrictedUnpickler(io.BytesIO(data), where).load()
        except UnsafeCheckpointError:
            raise
        except Exception as exc:
            raise _unreadable(where, exc, data) from exc
        return check_metadata(metadata, where, len(data))


def _check_memo_refusing(data: bytes, where: str) -> None:
    try:
        pickle_scan.check(data)
    except Exception as exc:
        raise _unreadable(where, exc, data) from exc


#: How a page of markup begins (an error page of a store or proxy): no pickle does.
_MARKUP = re.compile(rb"\s*<(?:!doctype|\?xml|html|head|body|error)\b", re.IGNORECASE)


def _unreadable(where: str, exc: Exception, data: bytes) -> UnsafeCheckpointError:
    if _MARKUP.match(data[:256]):
        # The store (or a proxy) answered a read with a page of its own, as if it were
        # the file: that, not damage, is what the caller must hear.
        return UnsafeCheckpointError(
            f"{where}: what the store returned for the metadata is an HTML/XML page "
            f"({printable(repr(data[:80]), 120)}), not a DCP metadata file: the store or a "
            "proxy in front of it answered the read with a page of its own (an error or "
            "login page) as if it were the file; check the endpoint and any proxy between"
        )
    return UnsafeCheckpointError(
        f"{where}: metadata is not a readable DCP metadata file "
        f"({printable(str(exc), 200)}); the checkpoint is damaged or was not written by DCP"
    )


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block (where it was on). Unpickling
    a metadata makes ~40 objects per item, all kept, and checking it walks them all: the
    collector's full passes over them (seven for 20,000 items) took as long as the
    unpickling itself, and find nothing to free. Objects freed meanwhile still go at
    once; only cycles wait."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


# --- BytesIO values ------------------------------------------------------------------
#
# DCP's planner stores an io.BytesIO value (its idiom for opaque blobs) as
# torch.save(the BytesIO): a pickle that builds BytesIO from its bytes, which torch's
# weights_only loader refuses. This loader accepts exactly that and nothing more: no
# global but BytesIO and the bytes constructors pickle protocol 2 uses (latin-1 text; no
# argument for an empty BytesIO), no storage records, and a result that must be a BytesIO.


def _latin1_bytes(text: object, encoding: object = "latin1") -> bytes:
    if not isinstance(text, str) or encoding != "latin1":
        raise pickle.UnpicklingError("only latin-1 encoded bytes are allowed")
    return text.encode("latin1")


def _no_bytes(*args: object) -> bytes:
    if args:  # an empty BytesIO pickles as bytes() alone; bytes(n) allocates n bytes
        raise pickle.UnpicklingError("only an empty bytes() is allowed")
    return b""


_BYTES_IO_GLOBALS: dict[tuple[str, str], Any] = {
    ("_io", "BytesIO"): io.BytesIO,
    ("io", "BytesIO"): io.BytesIO,
    ("_codecs", "encode"): _latin1_bytes,
    ("__builtin__", "bytes"): _no_bytes,  # protocol 2 names Python 2's module
    ("builtins", "bytes"): _no_bytes,
}


class _BytesIOUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = _BYTES_IO_GLOBALS.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(f"{module}.{name} is not part of a BytesIO value")
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("a BytesIO value has no tensor storages")


def load_bytes_io(archive: bytes) -> io.BytesIO | None:
    """The ``io.BytesIO`` that ``archive`` (a ``torch.save`` archive) holds, or ``None``
    if it holds anything else. Decompression is refused, so memory stays bounded by
    the archive's size."""
    try:
        with zipfile.ZipFile(io.BytesIO(archive)) as zf:
            pickles = [i for i in zf.infolist() if i.filename.endswith("/data.pkl")]
            if len(pickles) != 1 or pickles[0].compress_type != zipfile.ZIP_STORED:
                return None
            data = zf.read(pickles[0])
        value = _BytesIOUnpickler(io.BytesIO(data)).load()
    except Exception:  # not a zip, not a pickle, or a refused global: not a BytesIO value
        return None
    return value if type(value) is io.BytesIO else None
