"""The safetensors file format: its names and keys, its dtypes, and a header built
exactly as the ``safetensors`` library lays one out. A stored header (or index) is
checked on read by :mod:`.parse`.

A file is an 8-byte little-endian header length ``N``, ``N`` bytes of JSON (padded with
spaces to a multiple of 8) and the tensors' bytes back to back. The JSON maps each
tensor's name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets from the
end of the header) and may hold ``"__metadata__"``, a string-to-string map. Ours records
``"format": "pt"`` (what transformers requires), under :data:`CRC_KEY`, each tensor's
CRC-32C and, under :data:`WRITE_KEY`, the id of the save or export that wrote the file
(the index records it too, so files of two writes to one folder are told apart); other
readers ignore them, ours checks them.
"""

from __future__ import annotations

import json
import math
import struct
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
SUFFIX = ".safetensors"
CRC_KEY = "dcp_storage.crc32c"
#: The id of the write (save, export) that wrote a file, in its ``__metadata__`` and in
#: the index's ``metadata``: every file an index names must carry the index's.
WRITE_KEY = "dcp_storage.write_id"
METADATA_KEY = "__metadata__"
#: Longest header (and index) accepted: the safetensors library's limit (100 MB).
MAX_HEADER = 100 << 20
_ALIGN = 8

#: safetensors' dtype names, in the order of its ``Dtype`` enum (the library writes the
#: tensors of the widest dtype first: it sorts by this order, descending, then by name).
DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3": torch.float8_e4m3fn,
    "I16": torch.int16,
    "U16": torch.uint16,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "F32": torch.float32,
    "C64": torch.complex64,
    "F64": torch.float64,
    "I64": torch.int64,
    "U64": torch.uint64,
}
_RANK = {name: i for i, name in enumerate(DTYPES)}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor of a safetensors file: where its bytes are (absolute offsets in the
    file), what they are, and the CRC-32C our writer recorded (``None`` otherwise)."""

    file: str  #: the file's name under the checkpoint
    name: str
    dtype: str  #: safetensors' name, a key of :data:`DTYPES`
    shape: tuple[int, ...]
    begin: int
    end: int
    crc32c: int | None = None

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def length(self) -> int:
        return self.end - self.begin


def new_write_id() -> str:
    """A fresh id for one save or export, recorded in every file it writes."""
    return uuid.uuid4().hex


def dtype_name(dtype: torch.dtype, where: str) -> str:
    """safetensors' name of ``dtype``; a dtype it cannot hold is a ``TypeError``."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise TypeError(
            f"{where}: dtype {dtype} has no safetensors equivalent (it holds "
            f"{', '.join(str(d) for d in DTYPES.values())}); convert the tensor first"
        ) from None


def check_name(name: str, where: str) -> None:
    """Refuse a tensor name a safetensors file cannot hold: ``__metadata__`` is the
    header's metadata map (a tensor of that name wrote a file no reader can open), and
    the header is UTF-8 (a name holding a lone surrogate, which a pickled checkpoint key
    can, has none: the header could not be written)."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(
            f"{where}: the name is not UTF-8 text (it holds a lone surrogate), and a "
            "safetensors header is UTF-8; rename the item, or leave it out (export: --only, "
            "--strip)"
        ) from None
    if name == METADATA_KEY:
        raise ValueError(
            f"{where}: a tensor cannot be named {METADATA_KEY!r} in a safetensors file (the "
            "header keeps its metadata under that name); rename the item, or leave it out "
            "(export: --only, --strip)"
        )


def nbytes(dtype: torch.dtype, shape: Sequence[int]) -> int:
    return math.prod(shape) * dtype.itemsize


def layout(tensors: Mapping[str, tuple[torch.dtype, Sequence[int]]]) -> list[str]:
    """The order in which the ``safetensors`` library stores ``tensors`` (name ->
    (dtype, shape)): widest dtype first, then by name."""
    ranked = {name: _RANK[dtype_name(dtype, name)] for name, (dtype, _) in tensors.items()}
    return sorted(tensors, key=lambda name: (-ranked[name], name))


def encode_header(
    tensors: Mapping[str, tuple[torch.dtype, Sequence[int]]],
    order: Sequence[str],
    crcs: Mapping[str, int] | None,
    write_id: str | None = None,
) -> bytes:
    """The 8-byte length and the padded JSON header of a file holding ``tensors``
    in ``order``, byte for byte as ``safetensors.torch.save`` writes it (with our
    ``__metadata__``: the CRC-32Cs, and ``write_id`` when given)."""
    meta = {"format": "pt"}
    if crcs is not None:
        meta[CRC_KEY] = json.dumps({n: f"{crcs[n]:08x}" for n in order}, separators=(",", ":"))
    if write_id is not None:
        meta[WRITE_KEY] = write_id
    header: dict[str, Any] = {"__metadata__": meta}
    offset = 0
    for name in order:
        dtype, shape = tensors[name]
        size = nbytes(dtype, shape)
        header[name] = {
            "dtype": _NAMES[dtype],
            "shape": [int(s) for s in shape],
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % _ALIGN)
    return struct.pack("<Q", len(text)) + text
