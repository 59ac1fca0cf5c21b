"""A stored ``torch.save`` archive whose records are deflated: ``torch.load`` reads it with
miniz, which allocates each record at the size the central directory claims and
inflates into it, a thousand times the stored bytes, before torch compares the record
with the tensor it should hold. ``torch.save`` never compresses a record, so a reader
refuses such an archive before ``torch.load`` sees it, wherever the archive is: a
non-tensor item, a stock-style tensor item, a tree that an integration packed.
"""

from __future__ import annotations

import io
import os
import struct
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

import storage
from extensions.errors import UnsafeCheckpointError
from storage.checkpoint.archives import check_archive
from tests.support.planting import plant_item

MiB = 1 << 20
ROOT = Path(__file__).resolve().parents[2]


def _archive(value: Any) -> bytes:
    out = io.BytesIO()
    torch.save(value, out)
    return out.getvalue()


def _deflated(archive: bytes) -> bytes:
    """``archive`` with every record deflated: what torch.load inflates."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(archive)) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info), compress_type=zipfile.ZIP_DEFLATED)
    return out.getvalue()


def _bomb(nbytes: int) -> bytes:
    """A value holding a tensor of ``nbytes`` zeros, its storage record deflated."""
    return _deflated(_archive({"t": torch.zeros(nbytes, dtype=torch.uint8)}))


def test_a_deflated_record_in_a_non_tensor_item_is_refused_before_torch_inflates_it(
    tmp_path: Path,
) -> None:
    # Without the check torch.load inflated the 4 MiB record of this 4 KiB item and the
    # load handed the caller a 4 MiB tensor (a MiB stored is a GiB in memory; a value of
    # max_object_bytes, 16 GiB).
    storage.save({"extra": "text", "t": torch.ones(4)}, tmp_path)
    bomb = _bomb(4 * MiB)
    assert len(bomb) < 16 << 10
    plant_item(tmp_path, "extra", bomb)
    with pytest.raises(UnsafeCheckpointError, match=r"'extra'.*compressed.*decompression bomb"):
        storage.load({"extra": "", "t": torch.zeros(4)}, tmp_path)


def test_a_deflated_record_in_a_stock_tensor_item_is_refused(tmp_path: Path) -> None:
    # A stock-style item (no layout facts) goes through torch.load: without the check a
    # 16-element tensor's item of 4 KiB inflated the 4 MiB tensor its deflated record
    # held (up to a thousand times the archive's bound) before its size was compared.
    storage.save({"t": torch.ones(16)}, tmp_path)
    archive = _deflated(_archive(torch.zeros(4 * MiB, dtype=torch.uint8)))
    plant_item(tmp_path, "t", archive, data_offset=None, nbytes=None)
    with pytest.raises(UnsafeCheckpointError, match=r"'t'.*compressed"):
        storage.load({"t": torch.zeros(16)}, tmp_path)


def _two_directories(archive: bytes) -> bytes:
    """``archive`` (deflated records) given a second central directory, just before its
    end record, that claims every record stored; the end record still names the first.
    Python's ``zipfile`` reads the directory before the end record, miniz (torch.load)
    the one the end record names."""
    end = archive.rindex(b"PK\x05\x06")
    size, offset = struct.unpack_from("<II", archive, end + 12)
    directory = bytearray(archive[offset : offset + size])
    at = 0
    while at < len(directory):
        assert directory[at : at + 4] == b"PK\x01\x02"
        struct.pack_into("<H", directory, at + 10, 0)  # stored
        plain = struct.unpack_from("<I", directory, at + 24)[0]
        struct.pack_into("<I", directory, at + 20, plain)  # compressed size = plain size
        names = struct.unpack_from("<HHH", directory, at + 28)
        at += 46 + sum(names)
    return archive[:end] + bytes(directory) + archive[end:]


def test_a_second_central_directory_that_only_python_reads_is_refused(tmp_path: Path) -> None:
    # Checking the records as Python's zipfile lists them is not enough: without
    # holding its directory to the one the end record names, this archive passed as
    # all-stored while torch.load inflated the 4 MiB record of its real directory.
    payload = _two_directories(_bomb(4 * MiB))
    with zipfile.ZipFile(io.BytesIO(payload)) as seen_by_python:
        assert {i.compress_type for i in seen_by_python.infolist()} == {zipfile.ZIP_STORED}
    assert torch.load(io.BytesIO(payload), weights_only=True)["t"].numel() == 4 * MiB
    storage.save({"extra": "text", "t": torch.ones(4)}, tmp_path)
    plant_item(tmp_path, "extra", payload)
    with pytest.raises(UnsafeCheckpointError, match=r"'extra'.*central directory at byte"):
        storage.load({"extra": "", "t": torch.zeros(4)}, tmp_path)


def _two_zip64_records(archive: bytes) -> bytes:
    """``archive`` (deflated records) with zip64 end records: the locator names one
    whose directory is the real one, and just before the locator lies another, whose
    directory (a copy claiming every record stored) Python's ``zipfile`` reads; miniz
    (torch.load) reads the one the locator names."""
    end = archive.rindex(b"PK\x05\x06")
    count, size, offset = struct.unpack_from("<HII", archive, end + 10)
    stored = _two_directories(archive)[end : end + size]

    def record(at: int) -> bytes:
        return struct.pack("<4sQHHIIQQQQ", b"PK\x06\x06", 44, 45, 45, 0, 0, count, count, size, at)

    body = archive[:end]
    first = len(body)  # the record the locator names, for the deflated directory
    body += record(offset)
    copy = len(body)
    body += stored + record(copy)
    locator = struct.pack("<4sIQI", b"PK\x06\x07", 0, first, 1)
    tail = struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0)
    return body + locator + tail


def test_a_zip64_locator_naming_another_record_than_pythons_is_refused(tmp_path: Path) -> None:
    # Python's zipfile reads the zip64 record just before the locator, miniz the one the
    # locator names: without holding the two to one record, this archive passed as
    # all-stored while torch.load inflated the 4 MiB record of the other directory.
    payload = _two_zip64_records(_bomb(4 * MiB))
    with zipfile.ZipFile(io.BytesIO(payload)) as seen_by_python:
        assert {i.compress_type for i in seen_by_python.infolist()} == {zipfile.ZIP_STORED}
    assert torch.load(io.BytesIO(payload), weights_only=True)["t"].numel() == 4 * MiB
    storage.save({"extra": "text", "t": torch.ones(4)}, tmp_path)
    plant_item(tmp_path, "extra", payload)
    with pytest.raises(UnsafeCheckpointError, match=r"'extra'.*no end record"):
        storage.load({"extra": "", "t": torch.zeros(4)}, tmp_path)


def test_real_archives_pass(tmp_path: Path) -> None:
    # What torch.save writes (zip64 included) and its legacy format are left alone.
    check_archive(_archive({"a": torch.ones(3), "b": [1, "x"]}), "item 'a'")
    check_archive(_archive(torch.zeros(0)), "item 'e'")
    legacy = io.BytesIO()
    torch.save(torch.ones(3), legacy, _use_new_zipfile_serialization=False)
    check_archive(legacy.getvalue(), "item 'l'")
    values = {"extra": {"x": [1, 2], "s": "text"}, "t": torch.arange(10.0), "b": io.BytesIO(b"x")}
    storage.save(values, tmp_path)
    back: dict[str, Any] = {
        "extra": {"x": [0, 0], "s": ""},
        "t": torch.zeros(10),
        "b": io.BytesIO(),
    }
    storage.load(back, tmp_path)
    assert back["extra"] == values["extra"] and torch.equal(back["t"], values["t"])


def test_the_refusal_allocates_nothing_near_the_claim(tmp_path: Path) -> None:
    # Measured in a process of its own (torch's allocator is not traced; VmHWM, the peak
    # resident size of its own memory, not inherited across exec as ru_maxrss is):
    # without the check the 64 KiB item cost twice the 64 MiB its record claims (the
    # inflated tensor and its re-pickled copy) and the caller got the tensor.
    storage.save({"extra": "text", "t": torch.ones(4)}, tmp_path)
    plant_item(tmp_path, "extra", _bomb(64 * MiB))
    code = textwrap.dedent(
        f"""
        import re, torch, storage

        def peak():
            status = open("/proc/self/status").read()
            return int(re.search(r"VmHWM:\\s*(\\d+) kB", status).group(1)) * 1024

        storage.load({{"t": torch.zeros(4)}}, {str(tmp_path)!r})  # imports, warm
        before = peak()
        try:
            storage.load({{"extra": "", "t": torch.zeros(4)}}, {str(tmp_path)!r})
            print("loaded")
        except Exception as exc:
            print(type(exc).__name__)
        print(peak() - before)
        """
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    run = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr
    kind, grown = run.stdout.split()
    assert int(grown) < 32 * MiB, f"{kind}: the peak resident size grew by {grown} bytes"
    assert kind == "UnsafeCheckpointError"


def test_a_deflated_tree_blob_is_refused_before_torch_inflates_it() -> None:
    # The Lightning integration's tree of non-tensor state is a torch.save blob in a
    # uint8 item: without the check torch.load inflated the 4 MiB record of this 4 KiB
    # blob first and only then found it was no tree.
    from storage.integrations import _tree

    blob = torch.frombuffer(bytearray(_bomb(4 * MiB)), dtype=torch.uint8)
    with pytest.raises(UnsafeCheckpointError, match=r"'state'.*compressed"):
        _tree.unpack({"state": blob}, "state", where="s3://bucket/step-1", weights_only=True)
