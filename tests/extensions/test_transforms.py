"""Conformance of the built-in transforms and chains, plus ByteShuffle specifics."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch

from extensions import (
    AES256GCM,
    ByteShuffle,
    ExtensionRegistry,
    ItemInfo,
    UnknownTransformError,
    ZStandard,
)
from extensions.testing import TransformTests, encode, payload, read_all

KEY = bytes(range(32))


def _keyed_item(**overrides: Any) -> ItemInfo:
    fields: dict[str, Any] = {
        "checkpoint": "memory://transform-tests",
        "item": "layers.0.weight",
        "dtype": "bfloat16",
        "element_size": 2,
        "keys": {"k1": KEY}.__getitem__,
    }
    fields.update(overrides)
    return ItemInfo(**fields)


class TestZStandard(TransformTests):
    @pytest.fixture
    def transform(self) -> Any:
        return ZStandard(level=3)


class TestAES256GCM(TransformTests):
    @pytest.fixture
    def transform(self) -> Any:
        return AES256GCM(key=KEY, key_id="k1")

    @pytest.fixture
    def item(self) -> ItemInfo:
        return _keyed_item()


class TestAES256GCMSmallChunks(TestAES256GCM):
    """64 KiB chunks: the 64 KiB +- 1 sizes land exactly on and around a chunk edge."""

    @pytest.fixture
    def transform(self) -> Any:
        return AES256GCM(key=KEY, key_id="k1", chunk_size=64 << 10)


class TestByteShuffle(TransformTests):
    @pytest.fixture
    def transform(self) -> Any:
        return ByteShuffle()


class TestByteShuffleWide(TransformTests):
    """Element size 8 (float64/int64) through the generic plane loop, with a tail."""

    @pytest.fixture
    def transform(self) -> Any:
        return ByteShuffle()

    @pytest.fixture
    def item(self) -> ItemInfo:
        return ItemInfo(checkpoint="memory://t", item="step", dtype="int64", element_size=8)


class TestByteShuffleOpaque(TransformTests):
    identity = True

    @pytest.fixture
    def transform(self) -> Any:
        return ByteShuffle()

    @pytest.fixture
    def item(self) -> ItemInfo:
        return ItemInfo(checkpoint="memory://t", item="optimizer.param_groups")


class TestShuffleZstdAESChain(TransformTests):
    @pytest.fixture
    def transform(self) -> Any:
        return AES256GCM(key=KEY, key_id="k1", chunk_size=64 << 10)

    @pytest.fixture
    def chain(self, transform: Any) -> list[Any]:
        return [ByteShuffle(), ZStandard(level=1), transform]

    @pytest.fixture
    def item(self) -> ItemInfo:
        return _keyed_item()


# --- ByteShuffle specifics ------------------------------------------------------------


def _encoded(chain: list[Any], data: bytes, item: ItemInfo) -> tuple[bytes, list[str]]:
    out = io.BytesIO()
    descriptors = encode(chain, data, item, out)
    return out.getvalue(), descriptors


def test_shuffle_records_element_size_per_item() -> None:
    shuffle = ByteShuffle()
    for element_size in (1, 2, 4, 8):
        item = ItemInfo(item="t", element_size=element_size)
        assert shuffle.descriptor_for(item) == f"dcp_storage.shuffle/1;es={element_size}"
    assert shuffle.descriptor_for(ItemInfo(item="bytes")) == "dcp_storage.shuffle/1;es=1"
    assert ByteShuffle(element_size=4).descriptor_for(ItemInfo(element_size=2)).endswith("es=4")


def test_shuffle_is_identity_for_opaque_bytes() -> None:
    data = payload(100_000)
    encoded, descriptors = _encoded([ByteShuffle()], data, ItemInfo(item="blob"))
    assert encoded == data and descriptors == ["dcp_storage.shuffle/1;es=1"]


def test_shuffle_layout_is_byte_planes() -> None:
    # Two bf16-sized elements: planes are (low bytes)(high bytes); a 1-byte tail stays.
    encoded, _ = _encoded([ByteShuffle()], b"\x01\x02\x03\x04\x05", ItemInfo(element_size=2))
    assert encoded == b"\x01\x03\x02\x04\x05"
    encoded, _ = _encoded([ByteShuffle()], bytes(range(8)), ItemInfo(element_size=4))
    assert encoded == bytes([0, 4, 1, 5, 2, 6, 3, 7])


def test_shuffle_then_zstd_compresses_bf16_weights_better() -> None:
    gen = torch.Generator().manual_seed(0)
    weights = (torch.randn(1 << 20, generator=gen) * 0.02).to(torch.bfloat16)
    data = weights.view(torch.uint8).numpy().tobytes()
    item = ItemInfo(item="w", dtype="bfloat16", element_size=2)
    plain_zstd, _ = _encoded([ZStandard(level=3)], data, item)
    shuffled_zstd, _ = _encoded([ByteShuffle(), ZStandard(level=3)], data, item)
    ratio_zstd = len(data) / len(plain_zstd)
    ratio_shuffled = len(data) / len(shuffled_zstd)
    assert ratio_shuffled > ratio_zstd * 1.05, (ratio_zstd, ratio_shuffled)
    stream = ExtensionRegistry().decoding_stream(
        ["dcp_storage.shuffle/1;es=2", "stream.zstd/1"], io.BytesIO(shuffled_zstd), item
    )
    assert read_all(stream) == data


@pytest.mark.parametrize(
    "descriptor",
    ["dcp_storage.shuffle/2;es=2", "dcp_storage.shuffle/1", "dcp_storage.shuffle/1;es=0"],
)
def test_shuffle_bad_descriptor_names_the_item(descriptor: str) -> None:
    item = ItemInfo(checkpoint="/ckpt", item="layers.3.w", element_size=2)
    with pytest.raises(UnknownTransformError, match=r"/ckpt.*layers\.3\.w"):
        ExtensionRegistry().decoder(descriptor, item)


@pytest.mark.parametrize("element_size", [0, -2, 65, 2.0, True])
def test_shuffle_rejects_bad_element_size(element_size: Any) -> None:
    with pytest.raises(ValueError, match="element_size"):
        ByteShuffle(element_size=element_size)


def test_a_suite_class_missing_its_transform_fails_by_name() -> None:
    """Before, a transform's test class without the ``transform`` fixture failed in each
    of its tests; now defining the class fails, naming the fixture."""
    with pytest.raises(TypeError, match=r"TestNoTransform does not provide `transform`"):

        class TestNoTransform(TransformTests):
            @pytest.fixture
            def item(self) -> ItemInfo:
                return _keyed_item()

    class TestInherited(TestZStandard):  # the fixture comes from the parent test class
        identity = True

    assert TestInherited.identity
