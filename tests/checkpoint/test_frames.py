"""zstd items in frames with a seek table (extensions/zstd.py) and their parallel
decoding (storage/checkpoint/frames.py): readable by every zstd reader, decoded on
several cores, and every byte still checked."""

from __future__ import annotations

import io
import struct
import threading
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import zstandard
from torch.distributed.checkpoint._extension import ZStandard as TorchZStandard

import storage
from extensions import ItemInfo, ZStandard
from extensions.base import Frame
from extensions.errors import IntegrityError
from extensions.registry import ExtensionRegistry
from extensions.zstd import _SKIPPABLE, FOOTER, FRAME, parse_seek_table, seek_table, table_size
from storage.checkpoint import frames
from storage.checkpoint import storage_format as fmt


class _Sink(io.BytesIO):
    def close(self) -> None:  # the framework's streams only flush on close
        self.flush()


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    big = (torch.randn(5 * FRAME // 2 + 123, generator=g) * 0.02).to(torch.bfloat16)
    return {"big": big, "small": torch.randn(1000, generator=g), "ids": torch.arange(7)}


def test_a_large_write_is_cut_into_frames_that_every_zstd_reader_reads() -> None:
    head, body, tail = b"h" * 300, bytes(range(256)) * (9 * FRAME // 256 + 5), b"t" * 1000
    sink = _Sink()
    writer = ZStandard().encode(sink, ItemInfo(dtype="bfloat16", element_size=2))
    for part in (head, body, tail):
        writer.write(part)
    writer.close()
    stored = sink.getvalue()
    size = table_size(stored[-FOOTER:])
    assert size is not None
    listed = parse_seek_table(stored[-size:], len(stored))
    # The large write starts and ends frames of its own: the tensor's bytes never share one.
    assert listed is not None and [d for _, d in listed] == [300, *[FRAME] * 9, 1280, 1000]
    plain = head + body + tail
    ours = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(stored), read_across_frames=True)
    assert ours.read() == plain
    assert TorchZStandard().transform_from(io.BytesIO(stored)).read(-1) == plain  # stock torch


def test_one_frame_has_no_seek_table() -> None:
    sink = _Sink()
    writer = ZStandard().encode(sink, ItemInfo())
    writer.write(b"x" * 1000)
    writer.close()
    stored = sink.getvalue()
    assert table_size(stored[-FOOTER:]) is None
    assert zstandard.ZstdDecompressor().decompress(stored, max_output_size=1000) == b"x" * 1000


def test_a_seek_table_of_more_frames_than_its_item_could_hold_is_not_read() -> None:
    """A frame list costs a few hundred bytes of objects per frame: a table of 1-byte
    frames (an item of 9 MB listing a million) would cost the reader ~200 MB. A table
    listing more frames than the item's stored bytes could hold as frames our writer
    makes is not read (only its footer is), and the item decodes as one stream; the
    densest table the writer makes (writes of FRAME + 1 bytes of zeros: a full frame
    and a 1-byte frame each) is still listed."""
    count = 10_000
    hostile = bytes(count) + seek_table([(1, 1)] * count)
    reads: list[int] = []

    def read_at(offset: int, size: int) -> bytes:
        reads.append(size)
        return hostile[offset : offset + size]

    assert ZStandard.frames("1", read_at, len(hostile)) is None
    assert reads == [FOOTER]
    sink = _Sink()
    writer = ZStandard().encode(sink, ItemInfo())
    for _ in range(3):
        writer.write(bytes(FRAME + 1))
    writer.close()
    stored = sink.getvalue()
    listed = ZStandard.frames("1", lambda at, size: stored[at : at + size], len(stored))
    assert listed is not None and [f.decoded_length for f in listed] == [FRAME, 1] * 3


def test_a_large_tensor_decodes_on_several_cores_and_stock_reads_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = _state()
    storage.save(state, tmp_path / "ck", transforms=[ZStandard()])
    threads: set[int] = set()
    decode = frames._decode_part

    def spy(*args: object, **kwargs: object) -> None:
        threads.add(threading.get_ident())
        decode(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(frames, "_decode_part", spy)
    monkeypatch.setattr(frames, "decoder_count", lambda: 3)
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    storage.load(out, tmp_path / "ck")
    assert all(torch.equal(out[k], state[k]) for k in state)
    assert len(threads) >= 2  # one item, frames decoded by more than one thread
    stock = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(stock, storage_reader=dcp.FileSystemReader(tmp_path / "ck"), no_dist=True)
    assert all(torch.equal(stock[k], state[k]) for k in state)


def test_a_damaged_frame_is_reported_and_the_tensor_not_committed(tmp_path: Path) -> None:
    state = _state()
    storage.save(state, tmp_path / "ck", transforms=[ZStandard()])
    meta = fmt.load_metadata((tmp_path / "ck" / ".metadata").read_bytes(), "x")
    (info,) = [i for idx, i in meta.storage_data.items() if idx.fqn == "big"]
    data = tmp_path / "ck" / info.relative_path
    raw = bytearray(data.read_bytes())
    raw[info.offset + info.length // 2] ^= 0xFF  # inside a middle frame
    data.write_bytes(bytes(raw))
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    with pytest.raises(IntegrityError, match="'big'"):
        storage.load(out, tmp_path / "ck")


def test_a_frame_that_decodes_to_another_size_than_listed_is_refused() -> None:
    plain = bytes(range(256)) * 64
    frame = memoryview(zstandard.ZstdCompressor().compress(plain))
    framing = ExtensionRegistry().framing(["stream.zstd/1"])
    assert framing is not None
    decode = framing.decode
    target = memoryview(bytearray(len(plain)))
    frames._decode_part(frame, 0, len(plain), target, 0, "item 'x'", decode)
    assert bytes(target) == plain
    with pytest.raises(IntegrityError, match="seek table lists"):
        frames._decode_part(frame, 0, len(plain) - 1, target[:-1], 0, "item 'x'", decode)
    with pytest.raises(IntegrityError, match="seek table lists"):
        frames._decode_part(
            frame, 0, len(plain) + 1, memoryview(bytearray(len(plain) + 1)), 0, "x", decode
        )


def _frames_of(stored: bytes) -> Any:
    return ZStandard.frames("1", lambda at, size: stored[at : at + size], len(stored))


def test_a_seek_table_of_small_frames_decodes_as_one_stream() -> None:
    """A table our writer did not make (frames of a few bytes each, at the density the
    stored bytes allow) was listed frame by frame: ~240 MB of frame objects per 64 MB
    stored before anything checked it, and each tiny frame decoded on its own. Frames
    averaging under FRAME / 8 plain bytes, or one over FRAME, are not ours: the item
    decodes as one stream, which still checks every byte."""
    piece = bytes(torch.randint(0, 256, (256,), generator=torch.Generator().manual_seed(0)))
    frame = zstandard.ZstdCompressor().compress(piece)  # 256 plain bytes, ~265 stored
    count = 2000
    small = frame * count + seek_table([(len(frame), len(piece))] * count)
    assert _frames_of(small) is None
    plain = piece * count
    reader = zstandard.ZstdDecompressor().stream_reader(small, read_across_frames=True)
    assert reader.read() == plain  # a valid archive: what the stream decoder reads
    big = bytes(range(256)) * ((FRAME + 256) // 256)
    oversized = zstandard.ZstdCompressor().compress(big)
    over = oversized * 2 + seek_table([(len(oversized), len(big))] * 2)
    assert _frames_of(over) is None


def test_a_seek_table_is_listed_without_an_object_a_frame() -> None:
    """A hostile table whose frames each claim FRAME plain bytes passes the average,
    then fails the reader's check against the tensor's size: the frames it lists are
    made one at a time as the check walks them, not all at once."""
    count = 200_000
    hostile = bytes(64 * count) + seek_table([(64, FRAME)] * count)
    tracemalloc.start()
    try:
        listed = _frames_of(hostile)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert listed is not None and len(listed) == count
    assert peak < 40 * count  # the table and arrays of sizes and offsets
    assert listed[-1] == Frame(64 * (count - 1), 64, FRAME * (count - 1), FRAME)
    assert listed[1:3] == [Frame(64, 64, FRAME, FRAME), Frame(128, 64, 2 * FRAME, FRAME)]


def test_the_writers_frames_are_still_listed() -> None:
    """Every table our writer makes stays splittable: a tensor just over FRAME (its
    item at worst a header, a full frame, a 1-byte frame and a trailer) and the
    alternating writes of the densest table."""
    g = torch.Generator().manual_seed(0)
    noise = torch.randint(0, 256, (FRAME + 1,), dtype=torch.uint8, generator=g).numpy().tobytes()
    for writes in ([b"h" * 300, noise, b"t" * 1000], [bytes(FRAME + 1)] * 3):
        out = _Sink()
        writer = ZStandard().encode(out, ItemInfo())
        for part in writes:
            writer.write(part)
        writer.close()
        listed = _frames_of(out.getvalue())
        assert listed is not None and len(listed) in (4, 6)


def test_a_seek_table_of_part_of_an_entry_is_none() -> None:
    """A table whose entries do not come whole (a short read of its bytes) lists no
    frames: half an entry was read as a frame with no plain size (a table of it came
    back as an empty list, the item's frames failed with a raw ``ValueError``), and a
    part not of 4 bytes failed ``array.frombytes`` the same way."""
    for entry in (struct.pack("<I", 1), b"\x01\x00"):
        table = struct.pack("<II", _SKIPPABLE, len(entry) + FOOTER) + entry + bytes(FOOTER)
        assert parse_seek_table(table, len(table) + 1) is None
