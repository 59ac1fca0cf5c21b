"""Memory and time bounded by the caller and the stored sizes; malformed metadata.

Each test plays a hostile checkpoint. Memory is measured with tracemalloc (every buffer
at stake here - decoded bytes, block buffers, the unpickler's memo table - is allocated
through Python's allocators), never with wall time.
"""

from __future__ import annotations

import io
import pickle
import re
import struct
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import zstandard

import storage
from extensions import AES256GCM, ByteShuffle, WeightCodec, ZStandard
from extensions.base import ItemInfo
from extensions.errors import (
    IntegrityError,
    UnknownTransformError,
    UnsafeCheckpointError,
    quote,
)
from extensions.registry import ExtensionRegistry
from storage.checkpoint import pickle_scan, validate
from storage.checkpoint import storage_format as fmt
from storage.checkpoint.items import ItemEncoder, StoredItemReader
from storage.cli.main import main
from tests.support.planting import plant_item
from tests.support.sealing import resealed

MiB = 1 << 20
KEY = bytes(range(32))


class Peak:
    """Peak bytes allocated through Python since the last :meth:`reset` (or the start),
    above what was allocated then: what a test set up before (and the modules a first
    save imported, which stay) is not the code under test's cost."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        tracemalloc.reset_peak()
        self._base = tracemalloc.get_traced_memory()[0]

    def __call__(self) -> int:
        return tracemalloc.get_traced_memory()[1] - self._base


@pytest.fixture
def peak() -> Iterator[Peak]:
    tracemalloc.start()
    yield Peak()
    tracemalloc.stop()


def _meta(ckpt: Path) -> Any:
    return pickle.loads((ckpt / ".metadata").read_bytes())  # the test's own file: trusted


def _write_meta(ckpt: Path, metadata: Any) -> None:
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))


def _info(metadata: Any, fqn: str) -> Any:
    return next(v for k, v in metadata.storage_data.items() if k.fqn == fqn)


def _zstd_bomb(size: int) -> bytes:
    out = io.BytesIO()
    writer = zstandard.ZstdCompressor(level=3).stream_writer(out, closefd=False)
    zeros = bytes(MiB)
    for _ in range(size // MiB):
        writer.write(zeros)
    writer.close()
    return out.getvalue()


# --- decoding bounded by the request and the stored size -------------------------


def test_zstd_bomb_in_a_non_tensor_item_is_refused_within_the_bound(
    tmp_path: Path, peak: Peak
) -> None:
    # Without the bound the reader inflated all 256 MiB of the 8 KiB item (+520 MB
    # with the copies) before torch.load even looked at it.
    storage.save({"blob": b"small", "t": torch.ones(4)}, tmp_path, transforms=[ZStandard()])
    bomb = _zstd_bomb(256 * MiB)
    assert len(bomb) < 16 << 10
    plant_item(tmp_path, "blob", bomb)
    peak.reset()  # the bomb's construction is not the reader's cost
    with pytest.raises(UnsafeCheckpointError, match="blob.*decodes to more than"):
        storage.load({"blob": b"", "t": torch.zeros(4)}, tmp_path)
    # max_object_bytes (16 MiB) of decoded bytes, held twice while they are joined.
    assert peak() < 40 * MiB


def test_a_stored_length_the_file_does_not_hold_does_not_raise_the_bomb_bound(
    tmp_path: Path, peak: Peak
) -> None:
    # A non-tensor item may decode to 64 times its stored size: without counting only the
    # bytes its data file holds, this 8 KiB bomb claiming 2**40 stored bytes was allowed
    # 64 TiB and decoded whole (256 MiB here, +517 MB with the copies; 32 GiB a MiB of
    # stored bomb) before the read noticed the file was shorter.
    storage.save({"blob": b"small", "t": torch.ones(4)}, tmp_path, transforms=[ZStandard()])
    plant_item(tmp_path, "blob", _zstd_bomb(256 * MiB))
    metadata = _meta(tmp_path)
    _info(metadata, "blob").length = 1 << 40
    _write_meta(tmp_path, metadata)
    peak.reset()
    with pytest.raises(UnsafeCheckpointError, match="'blob'.*decodes to more than 16777216"):
        storage.load({"blob": b"", "t": torch.zeros(4)}, tmp_path)
    assert peak() < 40 * MiB


def test_a_transcoding_copy_bounds_a_value_by_the_bytes_its_file_holds(tmp_path: Path) -> None:
    # The same claim through `cp --transforms`: without the check the copy decoded the
    # whole bomb into the new chain.
    from storage.backends import LocalFileSystem
    from storage.ops.copy import copy_checkpoint

    src = tmp_path / "src"
    storage.save({"blob": b"small", "t": torch.ones(4)}, src, transforms=[ZStandard()])
    plant_item(src, "blob", _zstd_bomb(256 * MiB))
    metadata = _meta(src)
    _info(metadata, "blob").length = 1 << 40
    _write_meta(src, metadata)
    fs = LocalFileSystem()
    with pytest.raises(UnsafeCheckpointError, match="'blob'.*decodes to more than 16777216"):
        copy_checkpoint(fs, str(src), fs, str(tmp_path / "dst"), transforms=[ZStandard()])
    assert not (tmp_path / "dst" / ".metadata").exists()


def test_zstd_bomb_in_a_tensor_item_without_layout_facts_is_refused(
    tmp_path: Path, peak: Peak
) -> None:
    # Without the bound a stock-style item (no data_offset) was read whole for
    # torch.load: 256 MiB for a 16-element tensor.
    storage.save({"t": torch.ones(16)}, tmp_path, transforms=[ZStandard()])
    plant_item(tmp_path, "t", _zstd_bomb(256 * MiB), data_offset=None, nbytes=None)
    peak.reset()
    with pytest.raises(UnsafeCheckpointError, match="'t'.*decodes to more than"):
        storage.load({"t": torch.zeros(16)}, tmp_path)
    assert peak() < 4 * MiB  # 16 x 8 bytes + the 64 KiB archive allowance


def _rle_zeros(size: int) -> bytes:
    """A zstd frame of ``size`` zero bytes (a multiple of 128 KiB) in RLE blocks of 128
    KiB, 4 bytes each, declaring no content size: 32 KiB per GiB."""
    blocks = size >> 17
    block = (1 << 1 | (128 << 10) << 3).to_bytes(3, "little") + b"\0"
    last = (1 | 1 << 1 | (128 << 10) << 3).to_bytes(3, "little") + b"\0"
    return struct.pack("<IBB", 0xFD2FB528, 0, 10 << 3) + block * (blocks - 1) + last


def _archive_of(ckpt: Path, fqn: str) -> bytes:
    """The plain archive of the zstd item ``fqn``."""
    info = _info(_meta(ckpt), fqn)
    with (ckpt / info.relative_path).open("rb") as f:
        f.seek(info.offset)
        stored = f.read(info.length)
    reader = zstandard.ZstdDecompressor().stream_reader(stored, read_across_frames=True)
    return reader.read()


@pytest.mark.parametrize("where", ["trailer", "header"])
def test_zstd_bomb_around_a_tensor_is_refused_not_decoded(tmp_path: Path, where: str) -> None:
    # A tensor item decodes to its archive: a header of well under 64 KiB, the tensor,
    # a trailer of the same order. Without the bound the reader decoded and dropped
    # whatever followed the tensor (a 5 MiB item read on one thread: 4 GiB of zeros
    # here, 128 GiB for every 4 MiB of bomb) and skipped whatever data_offset claimed
    # before it, and loaded the tensor without a word.
    storage.save({"t": torch.arange(16.0)}, tmp_path, transforms=[ZStandard()])
    archive = _archive_of(tmp_path, "t")
    offset = getattr(_info(_meta(tmp_path), "t"), fmt.EXTRA)["data_offset"]
    compress = zstandard.ZstdCompressor(level=1).compress
    bomb = _rle_zeros(4 << 30)
    if where == "trailer":
        # Over one frame buffer (4 MiB), without a seek table: the sequential path.
        stored = (
            compress(archive)
            + compress(torch.randint(0, 256, (5 << 20,), dtype=torch.uint8).numpy().tobytes())
            + bomb
        )
        changes: dict[str, Any] = {}
    else:
        stored = bomb + compress(archive)
        changes = {"data_offset": offset + (4 << 30)}
    plant_item(tmp_path, "t", stored, **changes)
    target = {"t": torch.zeros(16)}
    with pytest.raises(UnsafeCheckpointError, match="'t'.*(more than its tensor|archive)"):
        storage.load(target, tmp_path)


def test_a_transcoding_copy_refuses_a_zstd_bomb_instead_of_writing_it_out(
    tmp_path: Path,
) -> None:
    # Without the bound `cp --transforms` decoded every byte of a source item into the
    # new chain: a 16-element tensor whose item decodes to 4 GiB more than its archive
    # was decoded and re-encoded whole (into a plain chain: 4 GiB written out), and the
    # copy committed an item no load accepts.
    from storage.backends import LocalFileSystem
    from storage.ops.copy import copy_checkpoint

    src = tmp_path / "src"
    storage.save({"t": torch.arange(16.0)}, src, transforms=[ZStandard()])
    compress = zstandard.ZstdCompressor(level=1).compress
    plant_item(src, "t", compress(_archive_of(src, "t")) + _rle_zeros(4 << 30))
    fs = LocalFileSystem()
    with pytest.raises(UnsafeCheckpointError, match="'t'.*decodes to more than"):
        copy_checkpoint(fs, str(src), fs, str(tmp_path / "dst"), transforms=[ZStandard()])
    assert not (tmp_path / "dst" / ".metadata").exists()


@pytest.mark.parametrize("offset", [1 << 40, 1 << 61])
def test_an_item_past_the_end_of_its_file_fails_naming_it(tmp_path: Path, offset: int) -> None:
    # Without the check an offset past the largest one the file system allows (2**61
    # here, within the metadata's 2**62) failed the load with a bare "OSError: [Errno 22]
    # Invalid argument" from the seek, naming neither the checkpoint nor the item.
    storage.save({"t": torch.ones(4)}, tmp_path)
    metadata = _meta(tmp_path)
    _info(metadata, "t").offset = offset
    _write_meta(tmp_path, metadata)
    with pytest.raises(IntegrityError, match=f"{re.escape(str(tmp_path))}: item 't'.*truncated"):
        storage.load({"t": torch.zeros(4)}, tmp_path)


def test_chunk_declared_larger_than_its_tensor_is_refused(tmp_path: Path) -> None:
    # Without the check a chunk claiming 64 Mi elements for a 16-element tensor made
    # the reader allocate 256 MiB and then load successfully from the stored archive.
    storage.save({"t": torch.arange(16.0)}, tmp_path)
    metadata = _meta(tmp_path)
    metadata.state_dict_metadata["t"].chunks[0].sizes = torch.Size([64 << 20])
    _write_meta(tmp_path, metadata)
    target = {"t": torch.zeros(16)}
    with pytest.raises(UnsafeCheckpointError, match="'t'.*does not lie inside the tensor"):
        storage.load(target, tmp_path)
    assert not target["t"].any()


def test_stored_tensor_of_another_size_than_its_chunk_is_refused(tmp_path: Path) -> None:
    # Without the check torch.load's result was narrowed to whatever the request asked
    # for: a stored 64-element tensor filled a 16-element chunk without complaint.
    storage.save({"t": torch.zeros(16)}, tmp_path)
    archive = io.BytesIO()
    torch.save(torch.arange(64.0), archive)
    plant_item(tmp_path, "t", archive.getvalue(), data_offset=None, nbytes=None)
    with pytest.raises(IntegrityError, match="does not have the chunk size"):
        storage.load({"t": torch.zeros(16)}, tmp_path)


def test_an_export_of_a_tensor_its_chunks_do_not_cover_is_refused(tmp_path: Path) -> None:
    # Without the check the export allocated the claimed 2**24 elements uninitialised,
    # loaded the 16 its one chunk holds and published the rest: zeros, or (for smaller
    # tensors) this process's old memory, in a committed model.
    from storage.backends import LocalFileSystem
    from storage.ops.export import export_safetensors

    storage.save({"t": torch.arange(16.0)}, tmp_path / "c")
    metadata = _meta(tmp_path / "c")
    metadata.state_dict_metadata["t"].size = torch.Size([1 << 24])
    _write_meta(tmp_path / "c", metadata)
    fs = LocalFileSystem()
    with pytest.raises(IntegrityError, match="'t' is a .*16 of its 16777216 elements"):
        export_safetensors(fs, str(tmp_path / "c"), fs, str(tmp_path / "out"))
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_a_tensor_allocated_for_a_stored_one_holds_no_old_memory(tmp_path: Path) -> None:
    # A receiver (the transport) loads only the chunks a sender stored: without the
    # zeroing, the rest of the tensor was whatever the allocator handed out, here the
    # NaNs of the tensor freed just before.
    from storage.checkpoint.tensors import empty_stored

    storage.save({"t": torch.arange(16.0)}, tmp_path)
    metadata = _meta(tmp_path)
    metadata.state_dict_metadata["t"].size = torch.Size([256])
    for _ in range(8):
        old = torch.full((256,), float("nan"))
        del old
        assert not empty_stored(metadata, "t", str(tmp_path), whole=False).isnan().any()


def test_aes_chunk_claim_does_not_size_the_buffers(tmp_path: Path, peak: Peak) -> None:
    # Without the fix a 1 KiB item whose descriptor claims chunk=256 MiB allocated
    # 2 x 256 MiB per reader thread before authentication failed.
    chain = [AES256GCM(key=KEY, key_id="k", chunk_size=1024)]  # two chunks for ~1.3 KiB
    storage.save({"t": torch.ones(16)}, tmp_path, transforms=chain)
    metadata = _meta(tmp_path)
    _info(metadata, "t").transform_descriptors = [
        f"dcp_storage.aes256gcm/3;key_id=k;chunk={256 * MiB}"
    ]
    # Resealed, so the claim reaches the decryptor (without the key the seal refuses it).
    (tmp_path / ".metadata").write_bytes(resealed(metadata, *chain))
    peak.reset()
    with pytest.raises(IntegrityError, match="'t'.*failed authentication"):
        storage.load({"t": torch.zeros(16)}, tmp_path, keys={"k": KEY})
    assert peak() < 4 * MiB


_AES = "dcp_storage.aes256gcm/2;key_id=k;chunk="
_NUMBERS = {"superscript": "\u00b2", "arabic-indic": "\u0663", "5000 digits": "9" * 5000}


@pytest.mark.parametrize(
    ("chain", "descriptor"),
    [
        *[([AES256GCM(key=KEY, key_id="k")], _AES + v) for v in _NUMBERS.values()],
        ([AES256GCM(key=KEY, key_id="k")], _AES + str(10**15)),
        *[([ByteShuffle()], "dcp_storage.shuffle/1;es=" + v) for v in _NUMBERS.values()],
        ([ByteShuffle()], "dcp_storage.shuffle/1;es=65"),
        *[([WeightCodec()], "dcp_storage.weights/2;es=" + v) for v in _NUMBERS.values()],
        *[([WeightCodec()], f"dcp_storage.weights/{v};es=4") for v in _NUMBERS.values()],
    ],
    ids=[
        *[f"aes chunk {k}" for k in _NUMBERS],
        "aes chunk 10**15",
        *[f"shuffle es {k}" for k in _NUMBERS],
        "shuffle es 65",
        *[f"weights es {k}" for k in _NUMBERS],
        *[f"weights format {k}" for k in _NUMBERS],
    ],
)
def test_a_descriptor_number_that_is_no_number_fails_naming_the_item(
    tmp_path: Path, chain: list[Any], descriptor: str, peak: Peak
) -> None:
    # Without the shared parser "\u00b2" passed str.isdigit and int() failed ("invalid
    # literal for int()"), 5000 digits hit int's digit limit (with advice to raise it),
    # "\u0663" was read as 3 and 10**15 was reported as a bad chunk_size argument: none
    # said which setting is wrong, what it may be, or what to do.
    storage.save({"t": torch.ones(16)}, tmp_path, transforms=chain)
    metadata = _meta(tmp_path)
    _info(metadata, "t").transform_descriptors = [descriptor]
    _write_meta(tmp_path, metadata)
    keys = {"k": KEY} if descriptor.startswith(_AES) else None
    peak.reset()
    with pytest.raises(UnknownTransformError) as info:
        storage.load({"t": torch.zeros(16)}, tmp_path, keys=keys)
    message = str(info.value)
    assert f"{tmp_path}: item 't': cannot decode descriptor" in message
    if "/2;" in descriptor or "/1;" in descriptor:
        assert re.search(r"setting (chunk|es) must be \d+ to \d+ in ASCII digits", message)
        assert "restore it or re-save" in message
    else:
        assert "unsupported dcp_storage.weights version" in message
    assert len(message) < 600
    assert peak() < 4 * MiB


@pytest.mark.parametrize(
    "chain",
    [
        [AES256GCM(key=KEY, key_id="k", chunk_size=4 * MiB)],
        [ByteShuffle(element_size=16)],
        [ByteShuffle(element_size=16), ZStandard(), AES256GCM(key=KEY, key_id="k")],
    ],
    ids=["aes", "shuffle", "shuffle+zstd+aes"],
)
def test_small_items_get_small_buffers(chain: list[Any], peak: Peak) -> None:
    # Without the fix each 4-byte item cost a full chunk (AES: 2 x 4 MiB) or block
    # (shuffle, es=16: 2 x 4 MiB) of zeroed buffers to encode and again to decode.
    info = ItemInfo(checkpoint="mem", item="x", keys=lambda _: KEY)

    def round_trip() -> None:
        out = io.BytesIO()
        encoder = ItemEncoder(out, chain, info)
        encoder.plain.write(b"abcd")
        length, crc = encoder.close()
        data = io.BytesIO(out.getvalue())
        stored = StoredItemReader(data, length, encoder.descriptors, crc, "x")
        assert stored.decoded(ExtensionRegistry(), info).read() == b"abcd"
        stored.finish()

    round_trip()  # the first imports the codecs' modules: not the items' cost
    peak.reset()
    round_trip()
    assert peak() < 512 << 10


# --- a zstd frame's declared content size never sizes an allocation ---------------------


def frame_declaring(declared: int, plain: int = 64 << 10) -> bytes:
    """A zstd frame whose header declares ``declared`` content bytes (and a 1 MiB window)
    but that holds one RLE block of ``plain`` zero bytes: 18 bytes in all."""
    header = struct.pack("<IBBQ", 0xFD2FB528, 0xC0, 10 << 3, declared)  # 8-byte size
    block = 1 | 1 << 1 | plain << 3  # the last block, RLE, ``plain`` bytes
    return header + block.to_bytes(3, "little") + b"\0"


def _weights_stream(mode: int, frame: bytes, nbytes: int = 64 << 10, version: int = 2) -> bytes:
    """One es=1 block of ``nbytes`` whose one plane is ``frame`` in ``mode`` (ZSTD, or
    PACK two codes to a byte), then the end record, in stream format ``version`` (format
    2 frames go without their 4-byte magic number)."""
    from extensions import _layout as layout

    a, b = (0, 2) if mode == layout.PACK else (0, 0)
    if version == 1:
        head = layout.V1_HEAD.pack(layout.BLOCK_TAG, nbytes, 0)
        plane = layout.V1_PLANE.pack(mode, a, b, 0, len(frame), 0)
        return head + plane + frame + layout.V1_END.pack(layout.END_TAG, nbytes)
    frame = frame[4:]
    head = layout.pack_v2_block(nbytes, 0, [(mode, a, b, len(frame), 0)])
    return head + frame + layout.pack_v2_end(nbytes)


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("mode", ["zstd", "pack"])
def test_weights_plane_declaring_a_huge_size_is_refused_before_decoding(
    mode: str, version: int, peak: Peak
) -> None:
    # Without the check zstd sized the plane's output by the frame's header, ignoring
    # max_output_size: this 18-byte frame of a 64 KiB plane allocated 1 GiB (a frame
    # within the block's bound could declare ~32 GiB and fill it). Format 2 frames
    # declare no size at all: one that does is refused the same way.
    from extensions import _layout as layout

    kind = layout.ZSTD if mode == "zstd" else layout.PACK
    stored = _weights_stream(kind, frame_declaring(1 << 30), version=version)
    item = ItemInfo(checkpoint="ckpt", item="w")
    decoding = ExtensionRegistry().decoding_stream(
        [f"dcp_storage.weights/{version};es=1"], io.BytesIO(stored), item
    )
    peak.reset()
    with pytest.raises(ValueError, match=r"declares 1073741824 bytes.*expected \d+"):
        decoding.read()
    assert peak() < 4 * MiB


def test_weights_item_declaring_a_huge_plane_fails_the_load_naming_it(tmp_path: Path) -> None:
    # The same refusal through a load, an IntegrityError naming the item; without the
    # check this 18-byte frame asked for 32 GiB (a MemoryError, or an OOM kill).
    from extensions import WeightCodec
    from extensions import _layout as layout

    storage.save({"w": torch.ones(4), "v": "value"}, tmp_path, transforms=[WeightCodec()])
    plant_item(tmp_path, "v", _weights_stream(layout.ZSTD, frame_declaring(1 << 35)))  # es=1
    with pytest.raises(IntegrityError, match=r"'v'.*declares 34359738368 bytes"):
        storage.load({"w": torch.zeros(4), "v": ""}, tmp_path)


@pytest.mark.parametrize("item", ["tensor", "value"])
def test_zstd_item_declaring_a_huge_size_decodes_only_what_it_holds(
    tmp_path: Path, item: str, peak: Peak
) -> None:
    # Guards the streaming decoders (a tensor's frames decoded into it, a value read
    # under its bound): they decode into buffers sized by the target and the request,
    # never by the 32 GiB this 18-byte frame declares.
    storage.save({"t": torch.ones(16), "v": "value"}, tmp_path, transforms=[ZStandard()])
    plant_item(tmp_path, "t" if item == "tensor" else "v", frame_declaring(1 << 35))
    peak.reset()
    with pytest.raises((IntegrityError, UnsafeCheckpointError), match="'[tv]'"):
        storage.load({"t": torch.zeros(16), "v": ""}, tmp_path)
    assert peak() < 8 * MiB


# --- items 9 and 10: metadata refused while loading, named errors ------------------------


def _shared_reference_bomb(levels: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(levels):
        value = [value, value]
    return value


@pytest.mark.timeout(30)  # a safety net only: the assertions are on the error
def test_shared_reference_metadata_is_refused(tmp_path: Path) -> None:
    # Without the walk budget quoting relative_path in the error message expanded 2**24
    # nodes (14 s, 384 MB at 24 levels; 26 levels, 4 times that).
    storage.save({"t": torch.ones(4)}, tmp_path)
    metadata = _meta(tmp_path)
    _info(metadata, "t").relative_path = _shared_reference_bomb(26)
    _write_meta(tmp_path, metadata)
    assert len((tmp_path / ".metadata").read_bytes()) < 4096
    with pytest.raises(UnsafeCheckpointError, match="share references"):
        storage.load({"t": torch.zeros(4)}, tmp_path)


@pytest.mark.timeout(30)  # a safety net only: the assertions are on the error
def test_shared_lists_of_plain_values_count_against_the_walk_budget(tmp_path: Path) -> None:
    # The walk counts the plain values of a list where it finds them instead of
    # visiting each: a list of 4,096 ints referenced 4,000 times (~30 KB pickled)
    # unfolds into 16 million of them and must still be refused.
    storage.save({"t": torch.ones(4)}, tmp_path)
    metadata = _meta(tmp_path)
    values = list(range(4096))
    _info(metadata, "t").relative_path = [values] * 4000
    _write_meta(tmp_path, metadata)
    with pytest.raises(UnsafeCheckpointError, match="share references"):
        storage.load({"t": torch.zeros(4)}, tmp_path)


@pytest.mark.parametrize(
    "bottom", [0, "name", torch.float32, []], ids=["int", "str", "dtype", "list"]
)
def test_the_nesting_bound_counts_plain_values_at_the_bottom(bottom: object) -> None:
    # The walk counts plain values where it finds them instead of visiting each: one
    # below the deepest level allowed is still a level too deep, as an empty list is.
    nested: object = bottom
    for _ in range(validate.MAX_DEPTH + 1):
        nested = [nested]
    with pytest.raises(UnsafeCheckpointError, match="nests deeper"):
        validate.check_metadata(nested, "m", 1 << 20)
    with pytest.raises(UnsafeCheckpointError, match="not DCP Metadata"):
        validate.check_metadata(nested[0], "m", 1 << 20)  # type: ignore[index]


@pytest.fixture(params=["compiled", "python"])
def memo_scan(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each memo test on both scans: the compiled one (where it was built) and Python's."""
    if request.param == "compiled" and pickle_scan._native is None:
        pytest.skip("extensions._native was not built (no C compiler at install)")
    if request.param == "python":
        monkeypatch.setattr(pickle_scan, "_native", None)
    return str(request.param)


@pytest.mark.parametrize(
    "bomb",
    [
        b"\x80\x04N" + b"r" + struct.pack("<I", 0x7FFFFFFF) + b".",  # LONG_BINPUT
        b"(lp2147483647\n.",  # protocol 0's text PUT
    ],
    ids=["long-binput", "text-put"],
)
def test_memo_index_bomb_is_refused_before_unpickling(
    peak: Peak, memo_scan: str, bomb: bytes
) -> None:
    # Without the pre-scan the C unpickler sized its memo table by the index: these 12
    # bytes allocated (and zeroed) 32 GiB.
    with pytest.raises(UnsafeCheckpointError, match="memo index"):
        fmt.load_metadata(bomb, "mem")
    assert peak() < MiB


def test_reading_metadata_leaves_the_garbage_collector_as_it_found_it(tmp_path: Path) -> None:
    """Metadata is unpickled with Python's cyclic collector paused: it is on again
    afterwards, also when the unpickling failed, and stays off where the caller had
    turned it off."""
    import gc

    storage.save({"t": torch.ones(4)}, tmp_path)
    data = (tmp_path / ".metadata").read_bytes()
    assert gc.isenabled()
    fmt.load_metadata(data, "mem")
    assert gc.isenabled()
    with pytest.raises(UnsafeCheckpointError):
        fmt.load_metadata(data[: len(data) // 2], "mem")
    assert gc.isenabled()
    gc.disable()
    try:
        fmt.load_metadata(data, "mem")
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_an_argument_longer_than_the_metadata_is_refused_saying_so(
    peak: Peak, memo_scan: str
) -> None:
    """A length prefix past the end of the file (64 GiB claimed by 15 bytes) is refused
    with a reason, before the unpickler reserves what it claims."""
    claim = b"\x80\x04\x8e" + struct.pack("<Q", 1 << 36) + b"abc"
    with pytest.raises(UnsafeCheckpointError, match="ends inside the argument at byte 2"):
        fmt.load_metadata(claim, "mem")
    assert peak() < MiB


def _scan_outcome(data: bytes) -> str:
    try:
        pickle_scan.check(data)
    except ValueError as exc:
        return str(exc)
    return "passed"


def test_the_compiled_and_python_memo_scans_agree_on_damaged_metadata(tmp_path: Path) -> None:
    """The scan refuses the same pickles, with the same message, with or without the
    compiled loop: a real metadata file, truncated and with bytes changed at random."""
    if pickle_scan._native is None:
        pytest.skip("extensions._native was not built (no C compiler at install)")
    storage.save({"t": torch.ones(4), "n": {"step": 3, "name": "x"}}, tmp_path)
    data = (tmp_path / ".metadata").read_bytes()
    generator = torch.Generator().manual_seed(0)
    cases = [data, data[:-1], data[: len(data) // 2], b"", b"\xff", b"p", b"(lp0\np"]
    cases += [b"cos\nsystem", b"cos\nsystem\n.", b"I12", b"\x80\x04N\x94r\x01\x00"]
    for _ in range(400):
        damaged = bytearray(data)
        for _ in range(int(torch.randint(1, 4, (1,), generator=generator))):
            at = int(torch.randint(0, len(damaged), (1,), generator=generator))
            damaged[at] = int(torch.randint(0, 256, (1,), generator=generator))
        cases.append(bytes(damaged))
    for case in cases:
        try:
            pickle_scan.scan_in_python(case)
            expected = "passed"
        except ValueError as exc:
            expected = str(exc)
        assert _scan_outcome(case) == expected, case


def _malformed(case: str) -> Callable[[Any], None]:
    def set_info(name: str, value: Any) -> Callable[[Any], None]:
        return lambda m: setattr(_info(m, "t"), name, value)

    def chunk(name: str, value: Any) -> Callable[[Any], None]:
        return lambda m: setattr(m.state_dict_metadata["t"].chunks[0], name, value)

    def nest(m: Any) -> None:
        value: Any = "x"
        for _ in range(200):
            value = [value]
        m.planner_data = value

    def drop_path(m: Any) -> None:
        del _info(m, "t").__dict__["relative_path"]

    return {
        "negative offset": set_info("offset", -1),
        "huge offset": set_info("offset", 1 << 70),
        "huge length": set_info("length", 1 << 70),
        "str length": set_info("length", "12"),
        "bool offset": set_info("offset", True),
        "missing relative_path": drop_path,
        "list relative_path": set_info("relative_path", ["__0_0.distcp"]),
        "descriptor not a str": set_info("transform_descriptors", [3]),
        "crc32c out of range": lambda m: getattr(_info(m, "t"), fmt.EXTRA).update(crc32c=-5),
        "data_offset str": lambda m: getattr(_info(m, "t"), fmt.EXTRA).update(data_offset="0"),
        "chunk sizes of str": chunk("sizes", ["4"]),
        "chunk offsets negative": chunk("offsets", [-1]),
        "chunk of another rank": chunk("sizes", torch.Size([4, 1])),
        "chunks not a list": lambda m: setattr(m.state_dict_metadata["t"], "chunks", None),
        "tensor size huge": lambda m: setattr(m.state_dict_metadata["t"], "size", [1 << 61] * 2),
        "deep nesting": nest,
    }[case]


MALFORMED = [
    "negative offset",
    "huge offset",
    "huge length",
    "str length",
    "bool offset",
    "missing relative_path",
    "list relative_path",
    "descriptor not a str",
    "crc32c out of range",
    "data_offset str",
    "chunk sizes of str",
    "chunk offsets negative",
    "chunk of another rank",
    "chunks not a list",
    "tensor size huge",
    "deep nesting",
]


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_metadata_value_raises_a_named_error(tmp_path: Path, case: str) -> None:
    # Without validation these surfaced as OverflowError, TypeError or AttributeError
    # from deep inside a reader (or loaded), never naming the item.
    storage.save({"t": torch.ones(4)}, tmp_path)
    metadata = _meta(tmp_path)
    _malformed(case)(metadata)
    _write_meta(tmp_path, metadata)
    with pytest.raises(UnsafeCheckpointError) as info:
        fmt.load_metadata((tmp_path / ".metadata").read_bytes(), str(tmp_path))
    if case != "deep nesting":
        assert "'t'" in str(info.value)
    with pytest.raises(UnsafeCheckpointError):
        storage.load({"t": torch.zeros(4)}, tmp_path)


def test_an_empty_tensor_whose_sizes_multiply_past_the_bound_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Sizes (2**62, 2**62, 0) hold no element, so their product (0) passed the bound:
    # inspect listed the tensor, verify reported torch's "Storage size calculation
    # overflowed" as the item's damage and export called it more than the machine can
    # allocate. No tensor of that shape can be made: the metadata is refused, naming it.
    from torch.distributed.checkpoint.metadata import MetadataIndex

    storage.save({"t": torch.ones(4)}, tmp_path)
    metadata = _meta(tmp_path)
    size = torch.Size([1 << 62, 1 << 62, 0])
    entry = metadata.state_dict_metadata["t"]
    entry.size, entry.chunks[0].sizes, entry.chunks[0].offsets = size, size, torch.Size([0] * 3)
    ((index, info),) = metadata.storage_data.items()
    metadata.storage_data = {MetadataIndex("t", torch.Size([0] * 3), index.index): info}
    _write_meta(tmp_path, metadata)
    for command in ("inspect", "verify"):
        assert main([command, str(tmp_path)]) == 1
        assert "'t': its size is" in capsys.readouterr().err
    with pytest.raises(UnsafeCheckpointError, match="'t'.*its non-zero sizes multiplied"):
        fmt.load_metadata((tmp_path / ".metadata").read_bytes(), str(tmp_path))


def test_a_chain_of_thousands_of_transforms_is_refused_before_any_decoder_is_built(
    tmp_path: Path,
) -> None:
    # Without the bound each of these 20,000 descriptors (40 KB of metadata: a pickle
    # stores the repeated string once) built a zstd decoder, ~170 MB of native memory
    # for the item (~850 MB for 200 KB of metadata, per reader thread), and the load
    # failed with "cannot decode: maximum recursion depth exceeded", naming no cause.
    storage.save({"t": torch.ones(4)}, tmp_path, transforms=[ZStandard()])
    metadata = _meta(tmp_path)
    _info(metadata, "t").transform_descriptors = ["stream.zstd/1"] * 20_000
    _write_meta(tmp_path, metadata)
    with pytest.raises(UnsafeCheckpointError, match="'t'.*a list of at most 16 str") as info:
        storage.load({"t": torch.zeros(4)}, tmp_path)
    assert len(str(info.value)) < 600


def test_a_writer_refuses_a_chain_readers_would_refuse() -> None:
    with pytest.raises(ValueError, match="17 transforms.*more than 16"):
        storage.CheckpointWriter("/nonexistent/c", transforms=[ZStandard()] * 17)


def test_a_copy_refuses_a_chain_readers_would_refuse_before_writing(tmp_path: Path) -> None:
    from storage.ops.copy import copy_checkpoint

    storage.save({"t": torch.ones(4)}, tmp_path / "src")
    fs = storage.LocalFileSystem()
    with pytest.raises(ValueError, match="17 transforms.*more than 16"):
        copy_checkpoint(
            fs, str(tmp_path / "src"), fs, str(tmp_path / "dst"), transforms=[ZStandard()] * 17
        )
    assert not (tmp_path / "dst").exists()  # nothing a load would refuse was written


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_cli_reports_malformed_metadata_in_one_line(
    tmp_path: Path, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Without validation `inspect` and `verify` died with an OverflowError traceback
    # (human_size of a 2**70-byte length).
    storage.save({"t": torch.ones(4)}, tmp_path)
    metadata = _meta(tmp_path)
    _info(metadata, "t").length = 1 << 70
    _write_meta(tmp_path, metadata)
    assert main([command, str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and "'t'" in captured.err
    assert "Traceback" not in captured.err + captured.out


def test_cli_escapes_item_names(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Without escaping an item name carried terminal escape sequences to the user's
    # terminal through `inspect` and `verify`.
    evil = "w\x1b]0;owned\x07\x1b[2J"
    storage.save({evil: torch.ones(4)}, tmp_path)
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "w\\x1b]0;owned\\x07" in out
    metadata = _meta(tmp_path)
    _info(metadata, evil).length -= 1  # make the item bad, so verify names it
    _write_meta(tmp_path, metadata)
    assert main(["verify", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert "\x1b" not in captured.out + captured.err and "w\\x1b" in captured.out


def test_cli_inspect_prints_in_proportion_to_its_items_whatever_one_name_holds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Without the bound every row of the table was padded to its widest cell: one name
    # of 100,000 characters among 300 items printed 30 MB (a name of 100 MB, as many
    # gigabytes, built in memory before the first line).
    state = {f"t{i}": torch.ones(1) for i in range(300)}
    state["x" * 100_000] = torch.ones(1)
    storage.save(state, tmp_path)
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert len(out) < 300 * 1000 and "x" * 400 + "..." in out
    assert main(["inspect", "--json", str(tmp_path)]) == 0  # JSON keeps the whole name
    assert "x" * 100_000 in capsys.readouterr().out


def test_quote_is_bounded_and_escaped() -> None:
    # The helper every message uses for checkpoint values: bounded work and length.
    assert len(quote(_shared_reference_bomb(1000))) < 200
    assert quote("a\x1b[2Jb") == "'a\\x1b[2Jb'"
    assert quote(1 << 100000) == "<int of 100001 bits>"
    assert len(quote("x" * 10**6)) < 200


# --- an unsafe rank-local metadata is reported as unsafe ------------------------


class _Evil:
    def __reduce__(self) -> tuple[Any, ...]:
        return (print, ("owned",))


def test_unsafe_rank_local_metadata_is_reported_as_unsafe(tmp_path: Path) -> None:
    # Without the fix the first probe's "has no .metadata" hid the real refusal of
    # __0.metadata.
    storage.save({"t": torch.ones(4)}, tmp_path)
    metadata = _meta(tmp_path)
    metadata.planner_data = _Evil()
    (tmp_path / "__0.metadata").write_bytes(pickle.dumps(metadata))
    (tmp_path / ".metadata").unlink()
    with pytest.raises(UnsafeCheckpointError, match="__0.metadata.*builtins.print"):
        storage.load({"t": torch.zeros(4)}, tmp_path)


def test_a_huge_metadata_file_is_refused_before_it_is_read_whole(
    tmp_path: Path, peak: Peak, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Without the bound every reader of a checkpoint (a load, ls, gc, the commit's check of
    # the old metadata) read .metadata whole: a sparse file of 10 GB, free to make for
    # anyone who can write into the root, cost 10 GB of memory before the unpickler
    # refused its first byte. (The bound is lowered here to keep the test small.)
    from storage.checkpoint import committed

    storage.save({"t": torch.ones(4)}, tmp_path)
    monkeypatch.setattr(fmt, "MAX_METADATA_BYTES", MiB)
    with open(tmp_path / ".metadata", "r+b") as f:
        f.truncate(64 * MiB)  # sparse: no disk, and no memory until it is read
    fs, path = storage.filesystem_from_url(str(tmp_path))
    peak.reset()
    with pytest.raises(UnsafeCheckpointError, match="larger than"):
        storage.load({"t": torch.zeros(4)}, tmp_path)
    with pytest.raises(UnsafeCheckpointError, match="larger than"):
        committed.read_metadata_file(fs, fs.concat_path(path, ".metadata"))
    assert peak() < 4 * MiB
