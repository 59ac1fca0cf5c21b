"""What stock DCP refuses to save (or we refuse to load), our paths refuse too, with an
error naming the item and the fix rather than a raw exception from deep inside; and the
values the round-trip fuzzing (test_roundtrip_fuzz.py) found we refused where stock
does not."""

from __future__ import annotations

import io
import pickle
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

import storage
from storage.checkpoint.storage_format import load_bytes_io

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


# --- empty BytesIO values --------------------------------------------------------------


@pytest.mark.parametrize("writer", ["stock", "ours"])
def test_an_empty_bytes_io_value_round_trips(writer: str, tmp_path: Path) -> None:
    """DCP pickles an empty ``io.BytesIO`` with ``bytes()`` where one with content has
    latin-1 text; stock loads both. Before: ours refused the empty one as not plain
    data."""
    state = {"blob": io.BytesIO(), "full": io.BytesIO(b"\x00\xff")}
    if writer == "stock":
        dcp.save(state, storage_writer=FileSystemWriter(tmp_path), no_dist=True)
    else:
        storage.save(state, tmp_path)
    target: dict[str, Any] = {"blob": io.BytesIO(b"old"), "full": io.BytesIO()}
    storage.load(target, tmp_path)
    assert target["blob"].getvalue() == b"" and target["full"].getvalue() == b"\x00\xff"


class _BytesOf:
    def __init__(self, n: int) -> None:
        self.n = n

    def __reduce__(self) -> tuple[Any, ...]:
        return (bytes, (self.n,))  # unpickled: bytes(n), n zero bytes


def test_the_bytes_io_loader_builds_no_bytes_from_a_count() -> None:
    """``bytes()`` is allowed for an empty BytesIO, but never ``bytes(n)``, which would
    allocate what the checkpoint says."""
    archive = io.BytesIO()
    torch.save(io.BytesIO(), archive)
    empty = load_bytes_io(archive.getvalue())
    assert empty is not None and empty.getvalue() == b""
    for hostile in (_BytesOf(1 << 40), [io.BytesIO(), _BytesOf(3)]):
        archive = io.BytesIO()
        torch.save(hostile, archive, pickle_protocol=2)
        assert load_bytes_io(archive.getvalue()) is None
    archive = io.BytesIO()
    torch.save(_BytesOf(1 << 40), archive, pickle_protocol=pickle.HIGHEST_PROTOCOL)
    assert load_bytes_io(archive.getvalue()) is None
