"""The ``torch.save`` archives a checkpoint stores, checked before ``torch.load`` reads one.

``torch.save`` writes a zip archive whose records (the pickle, each tensor's storage)
are stored as they are, never compressed. ``torch.load`` reads one with miniz, which
allocates each record at the size its central directory entry claims and, for a
deflated record, inflates into it: a record of 1 MiB of deflated zeros fills 1 GiB
before torch compares it with the tensor it should hold, and 16 MiB (a non-tensor
item's bound) fill 16 GiB. Every bound on what a read decodes counts the archive's
bytes, so an archive torch would inflate is refused here, before ``torch.load`` sees
it (:func:`check_archive`).

The check reads the central directory with Python's ``zipfile`` and holds it to the
one miniz reads: where the two would find different directories (an end record whose
directory offset is not where the directory ends, a zip64 locator naming another
record than the one before it), the archive is refused too. An archive that is no zip
(``torch.save``'s legacy format, which holds nothing compressed) is left to torch.
"""

from __future__ import annotations

import io
import struct
import zipfile

from extensions.errors import UnsafeCheckpointError, quote

_LOCAL_HEADER = b"PK\x03\x04"  # what torch.load tells a zip archive by
_END = b"PK\x05\x06"
_END_SIZE = 22
_LOCATOR = b"PK\x06\x07"
_LOCATOR_SIZE = 20
_END64 = b"PK\x06\x06"
_END64_SIZE = 56


def check_archive(payload: bytes, where: str) -> None:
    """Refuse ``payload`` (a stored ``torch.save`` archive, of the item ``where`` names)
    when ``torch.load`` would allocate or inflate more than it holds: a record that is
    compressed, or whose sizes differ, or a central directory other readers would find
    elsewhere (module docstring). Raises :class:`UnsafeCheckpointError`."""
    if payload[: len(_LOCAL_HEADER)] != _LOCAL_HEADER:
        return  # torch reads it as its legacy format: nothing in it is inflated
    problem = _problem(payload)
    if problem is not None:
        raise UnsafeCheckpointError(
            f"{where}: the stored torch.save archive {problem}; torch.save never writes one "
            "so, and torch.load would allocate or inflate it before checking it (a "
            "decompression bomb?): refusing it. Restore the file or re-save the checkpoint"
        )


def _problem(payload: bytes) -> str | None:
    offset = _directory_offset(payload)
    if offset is None:
        return "has no end record that every zip reader finds at one place"
    try:
        with zipfile.ZipFile(io.BytesIO(payload)) as archive:
            if archive.start_dir != offset:
                return (
                    f"names its central directory at byte {offset}, but it lies at byte "
                    f"{archive.start_dir}"
                )
            for info in archive.infolist():
                if info.compress_type != zipfile.ZIP_STORED:
                    method = info.compress_type
                    return f"holds record {quote(info.filename)} compressed (method {method})"
                if info.file_size != info.compress_size:
                    return (
                        f"claims {info.file_size} bytes for record {quote(info.filename)} "
                        f"of {info.compress_size}"
                    )
    except (zipfile.BadZipFile, ValueError, OverflowError, struct.error) as exc:
        return f"is not a zip archive that can be read ({quote(str(exc), 200)})"
    return None


def _directory_offset(payload: bytes) -> int | None:
    """The offset of the central directory that miniz (``torch.load``'s reader) reads:
    the one the last end record names (within the 64 KiB of comment an end record may
    have after it), or the zip64 record's where a locator comes just before it; ``None``
    where there is no such record, or where the locator names another zip64 record than
    the one before it (Python's ``zipfile`` reads that one)."""
    start = max(0, len(payload) - (0xFFFF + _END_SIZE))
    end = payload.rfind(_END, start, len(payload) - _END_SIZE + len(_END))
    if end < 0:
        return None
    (offset,) = struct.unpack_from("<I", payload, end + 16)
    locator = end - _LOCATOR_SIZE
    if locator >= 0 and payload[locator : locator + len(_LOCATOR)] == _LOCATOR:
        (record,) = struct.unpack_from("<Q", payload, locator + 8)
        if record != locator - _END64_SIZE or payload[record : record + 4] != _END64:
            return None
        (offset,) = struct.unpack_from("<Q", payload, record + 48)
    return int(offset)
