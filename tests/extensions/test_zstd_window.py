"""The window a zstd frame may make a reader allocate: bounded by what the item can need,
at every level a writer accepts, for items written before the bound, and against frames
made by hand to claim more."""

from __future__ import annotations

import io
import struct
import subprocess
import sys
import uuid
from pathlib import Path

import fsspec
import pytest
import torch
import zstandard

import storage
from extensions import ItemInfo, ZStandard
from extensions._zstd_window import WINDOW_FLOOR, declared_window
from extensions.errors import IntegrityError
from extensions.testing import FlushOnlyClose
from extensions.zstd import FRAME, MAX_LEVEL, MIN_LEVEL, WINDOW_LOG, _FramedWriter, frame_reader
from tests.extensions.test_encryption import rewrite
from tests.support.subprocess_jobs import REPO

MiB = 1 << 20
_BLOCK = 128 << 10


def _state() -> dict[str, object]:
    """A tensor of two frames (over :data:`FRAME` bytes) and a small value."""
    return {"w": torch.arange((FRAME + MiB) // 4, dtype=torch.float32), "v": "x" * 500}


def _zeros_like(state: dict[str, object]) -> dict[str, object]:
    return {"w": torch.zeros_like(state["w"]), "v": ""}  # type: ignore[arg-type]


def _frames_of(stored: bytes) -> list[bytes]:
    """The frames of one item our writer stored (its seek table lists them)."""
    found = ZStandard.frames("1", lambda at, n: stored[at : at + n], len(stored))
    if found is None:
        return [stored]
    return [stored[f.stored_offset : f.stored_offset + f.stored_length] for f in found]


def _stored_items(ckpt: Path) -> dict[str, bytes]:
    found: dict[str, bytes] = {}
    rewrite(ckpt, found.update)
    return found


def _in_memory(ckpt: Path) -> str:
    """The checkpoint copied to fsspec's memory://, whose reads are not local: items are
    read as streams (the object stores' path), not from buffers in frames."""
    url = f"memory://zstd-window-{uuid.uuid4().hex}/ckpt"
    fs = fsspec.filesystem("memory")
    for path in ckpt.iterdir():
        fs.pipe(f"{url}/{path.name}", path.read_bytes())
    return url


def test_a_level_outside_zstds_levels_is_refused() -> None:
    for level in (MAX_LEVEL + 1, MIN_LEVEL - 1):
        with pytest.raises(ValueError, match=f"level must be {MIN_LEVEL} to {MAX_LEVEL}"):
            ZStandard(level=level)


@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_checkpoint_at_the_highest_level_declares_small_windows_and_loads(
    tmp_path: Path, where: str
) -> None:
    # Without the bound level 22 declared a 128 MiB window for every frame (level 19:
    # 8 MiB), which a reader bounded by the item's size would have to refuse.
    state = _state()
    storage.save(state, tmp_path, transforms=[ZStandard(level=MAX_LEVEL)])
    for fqn, stored in _stored_items(tmp_path).items():
        for frame in _frames_of(stored):
            # A frame of a tensor's storage declares its size instead (single segment):
            # that size is its window.
            window = declared_window(frame) or zstandard.get_frame_parameters(frame).content_size
            assert window <= 1 << WINDOW_LOG, fqn
    target = _zeros_like(state)
    storage.load(target, tmp_path if where == "local" else _in_memory(tmp_path))
    assert torch.equal(target["w"], state["w"]) and target["v"] == state["v"]  # type: ignore[arg-type]


def test_the_frames_of_a_tensors_storage_declare_their_size() -> None:
    """A frame whose header declares its size decodes in one pass straight into the
    target's slice (one of unknown size goes through zstd's window buffer and a copy):
    every frame of a tensor's storage declares it, whatever the level."""
    plain = torch.arange((2 * FRAME + MiB) // 4, dtype=torch.float32).numpy().tobytes()
    for level in (1, 3, MAX_LEVEL):
        out = io.BytesIO()
        writer = _FramedWriter(zstandard.ZstdCompressor(level=level), FlushOnlyClose(out))
        writer.write(b"header")
        writer.write(plain)
        writer.write(b"trailer")
        writer.close()
        stored = out.getvalue()
        sizes = [zstandard.get_frame_parameters(f).content_size for f in _frames_of(stored)]
        assert sizes[1:-1] == [FRAME, FRAME, MiB], level
        assert zstandard.ZstdDecompressor().stream_reader(
            stored, read_across_frames=True
        ).read() == (b"header" + plain + b"trailer")


def _as_before_the_bound(stored: bytes, level: int) -> bytes:
    """``stored`` (an item of ours) re-encoded as dcp-storage wrote it at ``level``
    before its frames' windows were bounded (the same writer, zstd's own windows)."""
    plain = zstandard.ZstdDecompressor().stream_reader(stored, read_across_frames=True).read()
    out = io.BytesIO()
    writer = _FramedWriter(zstandard.ZstdCompressor(level=level), FlushOnlyClose(out))
    for start in range(0, len(plain), MiB):  # streamed: frames that declare a window
        writer.write(plain[start : start + MiB])
    writer.close()
    return out.getvalue()


@pytest.mark.parametrize("where", ["local", "memory"])
def test_items_written_at_an_ultra_level_before_the_bound_still_load(
    tmp_path: Path, where: str
) -> None:
    # Their frames declare 128 MiB for at most 4 MiB each: without decoding them within
    # the bound (one at a time, their headers rewritten) every one would be refused.
    state = _state()
    storage.save(state, tmp_path, transforms=[ZStandard()])

    def legacy(stored: dict[str, bytes]) -> None:
        for fqn in stored:
            stored[fqn] = _as_before_the_bound(stored[fqn], MAX_LEVEL)
            assert declared_window(stored[fqn]) == 128 * MiB

    rewrite(tmp_path, legacy)
    target = _zeros_like(state)
    storage.load(target, tmp_path if where == "local" else _in_memory(tmp_path))
    assert torch.equal(target["w"], state["w"]) and target["v"] == state["v"]  # type: ignore[arg-type]


def frame_claiming(window_log: int, plain: int, rle: bool = False) -> bytes:
    """A zstd frame declaring a window of ``2**window_log`` bytes and no content size
    (as zstd's streaming encoders write), holding ``plain`` zero bytes in blocks of 128
    KiB: raw (a byte stored per plain byte) or RLE (4 bytes per block)."""
    out = struct.pack("<IBB", 0xFD2FB528, 0, (window_log - 10) << 3)
    sizes = [min(_BLOCK, plain - at) for at in range(0, plain, _BLOCK)] or [0]
    for i, size in enumerate(sizes):
        head = (i == len(sizes) - 1) | (int(rle) << 1) | size << 3
        out += head.to_bytes(3, "little") + (b"\0" if rle else bytes(size))
    return out


_GROWTH = """
import io, sys
from extensions import ItemInfo, ZStandard
from extensions.zstd import frame_reader
from tests.extensions.test_zstd_window import frame_claiming

def mapped():
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmSize"))
    return int(line.split()[1]) << 10

frame = frame_claiming(27, 4096)
before = mapped()
if sys.argv[1] == "stream":
    reader = ZStandard().for_item(ItemInfo()).transform_from(io.BytesIO(frame))
else:
    reader = frame_reader(memoryview(frame), across_frames=True)
assert reader.read() == bytes(4096)
print(mapped() - before)
"""


@pytest.mark.parametrize("path", ["stream", "buffer"])
def test_a_small_frame_claiming_a_large_window_costs_no_more_than_the_bound(path: str) -> None:
    # Without the bound this 4 KiB frame made the decoder allocate the 128 MiB window it
    # declares, and each reader thread kept its context (and the window) for reuse.
    # Measured in a process of its own: zstd's allocations are not Python's, so what is
    # counted is the process's mapped memory, which any other thread here (one an earlier
    # test left) could grow meanwhile.
    child = subprocess.run(
        [sys.executable, "-c", _GROWTH, path],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert child.returncode == 0, child.stderr
    assert int(child.stdout) < 4 * WINDOW_FLOOR


@pytest.mark.parametrize("path", ["stream", "buffer"])
def test_a_frame_claiming_a_large_window_and_holding_more_is_refused_quickly(path: str) -> None:
    # A frame that does hold more than the item can need (16 MiB in 500 bytes) is
    # refused once it passes the bound, never decoded in the 128 MiB it asks for.
    frame = frame_claiming(27, 16 * MiB, rle=True)
    with pytest.raises(ValueError) as info:
        if path == "stream":
            ZStandard().for_item(ItemInfo(plain_bytes=MiB)).transform_from(io.BytesIO(frame)).read()
        else:
            frame_reader(memoryview(frame), across_frames=True).read()
    assert (  # refused at the bound, not after decoding what the frame holds
        f"a frame declares a window of {128 * MiB} bytes, more than the {WINDOW_FLOOR} this "
        f"item can need, and does not decode within {WINDOW_FLOOR}"
    ) in str(info.value)


@pytest.mark.parametrize("fqn", ["w", "v"])
def test_an_item_claiming_a_huge_window_fails_its_load_naming_it(tmp_path: Path, fqn: str) -> None:
    # The tensor is decoded from a buffer on the frame decoders, the value as a stream:
    # both refuse the frame (1 GiB claimed, 32 MiB of zeros held) naming the item.
    state = {"w": torch.ones(16), "v": "x"}
    storage.save(state, tmp_path, transforms=[ZStandard()])

    def plant(stored: dict[str, bytes]) -> None:
        stored[fqn] = frame_claiming(30, 32 * MiB, rle=True)

    rewrite(tmp_path, plant)
    with pytest.raises(IntegrityError, match=f"item '{fqn}'.*declares a window of {1 << 30}"):
        storage.load({"w": torch.zeros(16), "v": ""}, tmp_path)
