"""On-storage format: names, metadata (de)serialization, safe loading, item facts.

The format is stock DCP's: data files hold items back to back (each a ``torch.save``
archive for tensors, raw bytes for other objects, passed through the item's transform
chain) and ``.metadata`` is a pickled ``torch.distributed.checkpoint.Metadata``. Our
extra facts ride along where stock torch ignores them:

* ``Metadata.dcp_storage`` = ``{"format": FORMAT_VERSION}``, plus ``"origin"`` on a
  copy (``storage.ops.copy``, the tier drain): the save id of the save it copies;
* each ``_StorageInfo.dcp_storage`` = ``{"crc32c": int}`` (checksum of the stored
  bytes) plus, for tensors, ``"data_offset"``: where the tensor's raw bytes start in
  the decoded item, which lets a reader decode straight into the target tensor.

Loading never executes code from the checkpoint: the metadata unpickler only builds
torch's metadata classes and plain data, and every ``relative_path`` must name a file
directly inside the checkpoint.
"""

from __future__ import annotations

import io
import pickle
import pickletools
import re
import struct
import zipfile
from typing import IO, Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

from extensions._compat import StorageInfo
from extensions.errors import UnsafeCheckpointError, printable
from storage.checkpoint.validate import (  # noqa: F401 - EXTRA, REF, item_label: re-exported
    EXTRA,
    REF,
    check_metadata,
    item_label,
)

_RANK_OF_FILE = re.compile(r"__([0-9]+)_")

FORMAT_VERSION = 1
METADATA_NAME = ".metadata"
DATA_SUFFIX = ".distcp"


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


def item_extra(info: Any) -> dict[str, Any]:
    extra = getattr(info, EXTRA, None)
    return extra if isinstance(extra, dict) else {}


def new_storage_info(
    relative_path: str,
    offset: int,
    length: int,
    descriptors: list[str],
    extra: dict[str, Any],
) -> StorageInfo:
    # torch leaves transform_descriptors out when empty; so do we (older readers).
    info = StorageInfo(relative_path, offset, length, descriptors or None)
    setattr(info, EXTRA, extra)
    return info


def dump_metadata(metadata: Metadata, **extra: Any) -> bytes:
    """Pickle ``metadata`` with our facts (``format``, plus ``extra``) attached."""
    setattr(metadata, EXTRA, {"format": FORMAT_VERSION, **extra})
    return pickle.dumps(metadata)


ORIGIN = "origin"  # Metadata extra: the save id of the save a copy was made from


def save_of(metadata: Metadata) -> str | None:
    """The id of the save that produced ``metadata``'s checkpoint: a copy's
    ``origin``, else its own ``storage_meta.save_id`` (``None`` when it has neither,
    as stock DCP's checkpoints may). Two checkpoints with the same id hold the same
    state, whatever their data files are called."""
    extra = getattr(metadata, EXTRA, None)
    origin = extra.get(ORIGIN) if isinstance(extra, dict) else None
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
    try:
        _check_memo(data)
        metadata = _RestrictedUnpickler(io.BytesIO(data), where).load()
    except UnsafeCheckpointError:
        raise
    except Exception as exc:
        raise UnsafeCheckpointError(
            f"{where}: metadata is not a readable DCP metadata file "
            f"({printable(str(exc), 200)}); the checkpoint is damaged or was not written by DCP"
        ) from exc
    return check_metadata(metadata, where, len(data))


def _check_memo(data: bytes) -> None:
    """Refuse a memo index beyond the opcodes seen so far before the C unpickler sees
    it: that unpickler sizes (and zeroes) its memo table by the largest index, so
    ``LONG_BINPUT 0x7fffffff`` in a 12-byte file would cost 32 GiB. Well-formed pickles
    number memo entries densely (protocol 4+ never even states them). A scan of opcode
    boundaries only, several times faster than ``pickletools.genops``."""
    pos, end, count = 0, len(data), 0
    while pos < end:
        op = data[pos]
        kind = _ARG_KIND[op]
        pos += 1
        if kind is None:
            raise ValueError(f"invalid pickle opcode {op:#x} at byte {pos - 1}")
        if op == _STOP:
            return
        if kind >= 0:
            if op == _LONG_BINPUT and int.from_bytes(data[pos : pos + 4], "little") > count:
                raise ValueError(f"memo index out of range at byte {pos - 1}")
            pos += kind
        elif kind in (_LINE, _TWO_LINES):
            line_end = data.index(b"\n", pos)
            if op == _PUT and int(data[pos:line_end]) > count:
                raise ValueError(f"memo index out of range at byte {pos - 1}")
            pos = line_end + 1
            if kind == _TWO_LINES:
                pos = data.index(b"\n", pos) + 1
        else:
            width = -kind
            pos += width + int.from_bytes(data[pos : pos + width], "little")
        count += 1


def _arg_kinds() -> list[int | None]:
    # Per opcode byte: a fixed argument width (>= 0), a length prefix of -k bytes
    # (k = 1, 4, 8), _LINE / _TWO_LINES for text arguments, None for no opcode.
    kinds: list[int | None] = [None] * 256
    for op in pickletools.opcodes:
        n = op.arg.n if op.arg is not None else 0
        if op.arg is not None and op.arg.name == "stringnl_noescape_pair":
            n = _TWO_LINES
        elif n == pickletools.UP_TO_NEWLINE:
            n = _LINE
        elif n == pickletools.TAKEN_FROM_ARGUMENT1:
            n = -1
        elif n in (pickletools.TAKEN_FROM_ARGUMENT4, pickletools.TAKEN_FROM_ARGUMENT4U):
            n = -4
        elif n == pickletools.TAKEN_FROM_ARGUMENT8U:
            n = -8
        kinds[ord(op.code)] = n
    return kinds


_LINE, _TWO_LINES = -100, -101
_ARG_KIND = _arg_kinds()
_STOP, _PUT, _LONG_BINPUT = ord(pickle.STOP), ord(pickle.PUT), ord(pickle.LONG_BINPUT)


# --- BytesIO values ------------------------------------------------------------------
#
# DCP's planner stores an io.BytesIO value (its idiom for opaque blobs) as
# torch.save(the BytesIO): a pickle that builds BytesIO from its bytes, which torch's
# weights_only loader refuses. This loader accepts exactly that and nothing more: no
# global but BytesIO and the latin-1 bytes constructor pickle protocol 2 uses, no storage
# records, and a result that must be a BytesIO.


def _latin1_bytes(text: object, encoding: object = "latin1") -> bytes:
    if not isinstance(text, str) or encoding != "latin1":
        raise pickle.UnpicklingError("only latin-1 encoded bytes are allowed")
    return text.encode("latin1")


_BYTES_IO_GLOBALS: dict[tuple[str, str], Any] = {
    ("_io", "BytesIO"): io.BytesIO,
    ("io", "BytesIO"): io.BytesIO,
    ("_codecs", "encode"): _latin1_bytes,
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


# --- locating the raw tensor bytes inside a torch.save archive ----------------------

_LOCAL_HEADER = b"PK\x03\x04"


class ArchiveTracker(io.RawIOBase):
    """Passes ``torch.save`` output through to ``sink`` and notes where the tensor's
    storage record starts, by reading the zip local headers as they go by.

    ``torch.save`` issues dozens of tiny writes per tensor (headers, descriptors) and
    one large write of the storage: the tiny ones are kept (headers are parsed from
    them) and forwarded in one piece, the large one is forwarded without a copy. Call
    ``flush`` before closing ``sink``."""

    def __init__(self, sink: IO[bytes], *, keep_below: int = 1 << 16) -> None:
        super().__init__()
        self._sink = sink
        self._keep_below = keep_below
        self.position = 0
        self._segments: list[tuple[int, bytearray]] = []  # small writes, adjacent merged
        self._unsent = 0  # bytes at the end of the last segment not yet forwarded

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n = view.nbytes
        if n < self._keep_below:
            last = self._segments[-1] if self._segments else None
            if last is not None and last[0] + len(last[1]) == self.position:
                last[1].extend(view)
            else:
                self._segments.append((self.position, bytearray(view)))
            self._unsent += n
        else:
            self.flush()
            self._sink.write(view)
        self.position += n
        return n

    def flush(self) -> None:
        if self._unsent:
            segment = self._segments[-1][1]
            self._sink.write(memoryview(segment)[len(segment) - self._unsent :])
            self._unsent = 0

    def data_offset(self, nbytes: int) -> int | None:
        """Offset of the single storage record of ``nbytes`` bytes, if it is there."""
        found: list[int] = []
        for start, seg in self._segments:
            at = seg.find(_LOCAL_HEADER)
            while at != -1 and at + 30 <= len(seg):
                name_len, extra_len = struct.unpack_from("<HH", seg, at + 26)
                name = bytes(seg[at + 30 : at + 30 + name_len])
                if name.endswith(b"/data/0"):
                    found.append(start + at + 30 + name_len + extra_len)
                elif name.split(b"/")[-2:-1] == [b"data"]:
                    return None  # more than one storage: not a plain tensor
                at = seg.find(_LOCAL_HEADER, at + 4)
        if len(found) != 1 or found[0] + nbytes > self.position:
            return None
        return found[0]
