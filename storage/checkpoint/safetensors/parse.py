"""A stored safetensors header (or index) checked before a single byte of tensor data
is trusted (the format is :mod:`.header`'s).

Hostile headers are refused by :func:`parse_header` with an error naming the file, the
tensor and the fix; the caller bounds the header's length (:data:`.header.MAX_HEADER`,
:func:`header_length`) before reading it. Python's JSON objects cost many times the
text they come from (a dict per ``{}``, some 50 bytes per short string), so before
``json`` builds any of them the header's structure is checked on its bytes
(:mod:`._structure`): only what a header holds, each tensor's entry at least as long as
the shortest real one. A header then costs about what a real one of its size does
(6-12x its length), not the 25x a crafted one took.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from extensions.errors import IntegrityError, UnsafeCheckpointError, quote
from storage.checkpoint.safetensors._structure import header_problem, index_problem, map_problem
from storage.checkpoint.safetensors.header import (
    CRC_KEY,
    DTYPES,
    MAX_HEADER,
    SUFFIX,
    WRITE_KEY,
    TensorEntry,
    nbytes,
)
from storage.checkpoint.validate import MAX_SIZE, is_plain_name, multiplied_out

_TENSOR_KEYS = frozenset(("dtype", "shape", "data_offsets"))
_DTYPE_NAMES = {name: name for name in DTYPES}


@dataclass(frozen=True)
class Header:
    """A checked header: its tensors and the id of the write that made the file
    (``None`` when it records none: written by others, or before ids)."""

    entries: dict[str, TensorEntry]
    write_id: str | None


@dataclass(frozen=True)
class Index:
    """A checked index: tensor name -> file name, and the id of the write that made it."""

    weight_map: dict[str, str]
    write_id: str | None


def header_length(prefix: bytes, file: str, size: int) -> int:
    """The header length in the first 8 bytes of ``file`` (``size`` bytes long),
    refused before anything is allocated for it when it cannot be a real one."""
    if len(prefix) < 8:
        raise IntegrityError(
            f"{file}: {size} bytes is too short for a safetensors file (no 8-byte header "
            "length); the file is truncated: export or download it again"
        )
    (length,) = struct.unpack("<Q", prefix[:8])
    if length > MAX_HEADER:
        raise UnsafeCheckpointError(
            f"{file}: its header claims {length} bytes, more than the {MAX_HEADER >> 20} MiB "
            "any safetensors file needs; the file is damaged or not a safetensors file: "
            "refused without reading it"
        )
    if 8 + length > size:
        raise IntegrityError(
            f"{file}: its header claims {length} bytes but the file has only {size}; the "
            "file is truncated or damaged: export or download it again"
        )
    return int(length)


def parse_header(text: bytes, file: str, size: int) -> Header:
    """The tensors of ``file`` (``size`` bytes, header ``text`` without its length
    prefix), each checked: a known dtype, a shape whose bytes are its extent, extents
    inside the file that tile its data region in order with no overlap or gap, names
    unique, and our CRC-32C metadata well formed where present; and its write id."""
    decoded = _utf8(text, file, "header")
    problem = header_problem(text)
    if problem is not None:
        raise _bad(file, None, problem)
    raw = _load_json(decoded, file, "header", _compact)
    if not isinstance(raw, dict):  # "{}" around a value: json refuses it unless "{}"
        raise _bad(file, None, "the header is not a JSON object")
    meta = raw.pop("__metadata__", None)
    crcs = _crcs(meta, file, len(raw))
    write_id = meta.get(WRITE_KEY) if isinstance(meta, dict) else None
    data_start = 8 + len(text)
    entries: dict[str, TensorEntry] = {}
    for name in list(raw):  # each entry freed once checked: never both forms of all
        entries[name] = _entry(name, raw.pop(name), file, data_start, crcs)
    cursor = data_start
    for entry in sorted(entries.values(), key=lambda e: (e.begin, e.end)):
        if entry.begin != cursor:
            what = "overlaps the tensor before it" if entry.begin < cursor else "leaves a gap"
            raise _bad(
                file,
                entry.name,
                f"its data_offsets {what} (it starts at byte {entry.begin - data_start} of "
                f"the data, the tensor before it ends at {cursor - data_start})",
            )
        cursor = entry.end
    if cursor != size:
        raise _bad(
            file,
            None,
            f"the tensors end at byte {cursor} but the file has {size} bytes",
        )
    return Header(entries, write_id)


def _compact(info: dict[str, Any]) -> Any:
    """A tensor's entry as a :class:`_Raw`, its dtype the known name's own string: a
    dict per entry costs more than the entry's text."""
    if len(info) == 3 and info.keys() == _TENSOR_KEYS:
        dtype = info["dtype"]
        dtype = _DTYPE_NAMES.get(dtype, dtype) if isinstance(dtype, str) else dtype
        return _Raw(dtype, info["shape"], info["data_offsets"])
    return info


@dataclass(frozen=True, slots=True)
class _Raw:
    """A tensor's entry as the header has it, before it is checked."""

    dtype: object
    shape: object
    data_offsets: object


def _entry(
    name: str, info: object, file: str, data_start: int, crcs: dict[str, int] | None
) -> TensorEntry:
    if not isinstance(info, _Raw):
        raise _bad(file, name, f"its entry {quote(info)} is not {{dtype, shape, data_offsets}}")
    dtype, shape, offsets = info.dtype, info.shape, info.data_offsets
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise _bad(file, name, f"unknown dtype {quote(dtype)} (known: {', '.join(DTYPES)})")
    if (
        not isinstance(shape, list)
        or len(shape) > 64
        or not all(_count(s) and s <= MAX_SIZE for s in shape)
    ):
        raise _bad(file, name, f"shape {quote(shape)} is not a list of integers in [0, 2**62]")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_count(o) and o <= MAX_SIZE for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise _bad(
            file, name, f"data_offsets {quote(offsets)} is not [begin, end] in order in [0, 2**62]"
        )
    expected = nbytes(DTYPES[dtype], shape)
    if offsets[1] - offsets[0] != expected:
        raise _bad(
            file,
            name,
            f"dtype {dtype} and shape {quote(shape)} need {quote(expected)} bytes but its "
            f"data_offsets {offsets} span {offsets[1] - offsets[0]}",
        )
    if nbytes(DTYPES[dtype], [multiplied_out(shape)]) > MAX_SIZE:  # one of them 0
        raise _bad(file, name, f"shape {quote(shape)} multiplies out past 2**62 bytes")
    crc = None
    if crcs is not None:
        if name not in crcs:
            raise _bad(file, name, "the CRC-32C metadata has no checksum for it")
        crc = crcs[name]
    return TensorEntry(
        file, name, dtype, tuple(shape), data_start + offsets[0], data_start + offsets[1], crc
    )


def _crcs(meta: object, file: str, tensors: int) -> dict[str, int] | None:
    if meta is None:
        return None
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise _bad(file, None, "__metadata__ is not a map of strings to strings")
    text = meta.get(CRC_KEY)
    if text is None:
        return None
    what = f"__metadata__[{CRC_KEY!r}]"
    raw = text.encode()
    problem = map_problem(raw, what, tensors)
    if problem is not None:
        raise _bad(file, None, problem)
    table = _load_json(_utf8(raw, file, what), file, what)
    if not isinstance(table, dict) or not all(
        isinstance(v, str) and re.fullmatch(r"[0-9a-f]{8}", v) for v in table.values()
    ):
        raise _bad(file, None, f"{what} is not a map of names to CRC-32Cs")
    return {name: int(value, 16) for name, value in table.items()}


def parse_index(text: bytes, index: str) -> Index:
    """The ``weight_map`` of an index (tensor name -> file name), every file name a
    plain ``*.safetensors`` name beside the index (at most 255 printable characters, as
    a checkpoint's file names): one that climbs out (``../``), is absolute or names
    another location (``s3://...``) is refused; and the write id in its ``metadata``."""
    decoded = _utf8(text, index, "index")
    problem = index_problem(text)
    if problem is not None:
        raise IntegrityError(
            f"{index}: not a safetensors index ({problem}); export the model again or load "
            "its files without the index"
        )
    raw = _load_json(decoded, index, "index")
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise IntegrityError(
            f'{index}: not a safetensors index (no "weight_map" of tensor names to files); '
            "export the model again or load its files without the index"
        )
    files: dict[str, str] = {}
    for name, file in weight_map.items():
        if not (is_plain_name(file) and file.endswith(SUFFIX) and len(file) > len(SUFFIX)):
            raise UnsafeCheckpointError(
                f"{index}: tensor {quote(name)} is mapped to {quote(file)}, which is not a "
                "*.safetensors file beside the index (a plain name of at most 255 printable "
                "characters); refused (nothing outside the checkpoint "
                "is read): fix the index's weight_map"
            )
        weight_map[name] = files.setdefault(file, file)  # one string per file, not per tensor
    meta = raw.get("metadata")
    write_id = meta.get(WRITE_KEY) if isinstance(meta, dict) else None
    if write_id is not None and not isinstance(write_id, str):
        raise IntegrityError(
            f"{index}: its metadata's {WRITE_KEY!r} is {quote(write_id)}, not a string; the "
            "index is damaged: export the model again"
        )
    return Index(weight_map, write_id)


def _utf8(text: bytes, file: str, what: str) -> str:
    # UTF-8 only, as the safetensors library reads it: json.loads would take bytes
    # in UTF-16 or UTF-32 too, and load a file every other reader refuses.
    try:
        return text.decode("utf-8")
    except ValueError as exc:
        raise IntegrityError(
            f"{file}: its {what} is not valid JSON ({str(exc)[:200]}); the file is damaged: "
            "export or download it again"
        ) from None


def _load_json(
    text: str,
    file: str,
    what: str,
    build: Callable[[dict[str, Any]], Any] | None = None,
) -> Any:
    """``text`` parsed, each object refused when it names a key twice (then made by
    ``build`` from its dict, where given)."""

    def made(pairs: list[tuple[str, Any]]) -> Any:
        out = _unique(pairs, file, what)
        return out if build is None else build(out)

    try:
        return json.loads(text, object_pairs_hook=made)
    except (ValueError, RecursionError) as exc:
        if isinstance(exc, (IntegrityError, UnsafeCheckpointError)):
            raise
        raise IntegrityError(
            f"{file}: its {what} is not valid JSON ({str(exc)[:200]}); the file is damaged: "
            "export or download it again"
        ) from None


def _unique(pairs: list[tuple[str, Any]], file: str, what: str) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise IntegrityError(
            f"{file}: its {what} names {quote(dup)} twice; the file is damaged or was not "
            "written by a safetensors writer: export or download it again"
        )
    return out


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _bad(file: str, name: str | None, problem: str) -> IntegrityError:
    tensor = f" tensor {quote(name)}:" if name is not None else ""
    return IntegrityError(
        f"{file}:{tensor} {problem}; the file is damaged or was not written by a "
        "safetensors writer: export or download it again"
    )
