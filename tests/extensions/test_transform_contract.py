"""The transform contract, version 2 (extensions/base.py): transforms are immutable
values with one per-item hook, ``for_item``; ``authenticated``, ``key_ids`` and
``fingerprint_key`` are capabilities any transform can declare, and the checkpoint
layer acts on them without knowing a transform by name; a transform written against
version 1's item hooks is still called through them; one block-buffering writer serves
every block codec."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import io
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any, ClassVar, cast

import pytest
import torch

import storage
from extensions import (
    AES256GCM,
    ByteShuffle,
    ExtensionRegistry,
    ItemInfo,
    MissingKeyError,
    StreamTransformExtension,
    UnsafeCheckpointError,
    WeightCodec,
    ZStandard,
)
from extensions import registry as registry_module
from extensions.registry import encoding_stream
from extensions.streams import BlockWriter, readinto_exact
from extensions.testing import FlushOnlyClose, TransformTests, payload
from storage.checkpoint import storage_format as fmt
from storage.checkpoint.incremental import fingerprint
from tests.support.trees import assert_tree_equal, zeros_like_tree

ROOT = Path(__file__).resolve().parents[2]
KEY = bytes(range(7, 39))
BF16 = ItemInfo(checkpoint="mem", item="layers.0.w", dtype="bfloat16", element_size=2)


# --- a third party's authenticated transform, declaring the capabilities -------------


class _SealWriter:
    """Passes the bytes through and appends an HMAC of the item's name and bytes."""

    def __init__(self, output: IO[bytes], key: bytes, name: str) -> None:
        self._output = output
        self._mac = hmac.new(key, name.encode() + b"\x00", "sha256")

    def write(self, data: Any) -> int:
        self._mac.update(data)
        return self._output.write(data)

    def flush(self) -> None:
        self._output.flush()

    def close(self) -> None:
        self._output.write(self._mac.digest())
        self._output.close()


def _unseal(input: IO[bytes], key: bytes, name: str) -> IO[bytes]:
    sealed = input.read()
    data, tag = sealed[:-32], sealed[-32:]
    expected = hmac.new(key, name.encode() + b"\x00" + data, "sha256").digest()
    if not hmac.compare_digest(tag, expected):
        raise ValueError("acme.seal: the tag does not match")
    return io.BytesIO(data)


@dataclass(frozen=True)
class AcmeSeal(StreamTransformExtension):
    authenticated: ClassVar[bool] = True

    key: bytes | None = dataclasses.field(default=None, repr=False)
    key_id: str = "acme"
    item: ItemInfo = ItemInfo()

    @staticmethod
    def registry_name() -> str:
        return "acme.seal"

    @staticmethod
    def from_descriptor(version: str) -> AcmeSeal:
        number, _, key_id = version.partition(";key_id=")
        if number != "1" or not key_id:
            raise ValueError(f"unknown acme.seal version {version!r}")
        return AcmeSeal(key_id=key_id)

    @classmethod
    def key_ids(cls, version: str) -> tuple[str, ...]:
        return (cls.from_descriptor(version).key_id,)

    def get_descriptor(self) -> str:
        return f"acme.seal/1;key_id={self.key_id}"

    def for_item(self, item: ItemInfo) -> AcmeSeal:
        return self if item == self.item else replace(self, item=item)

    def fingerprint_key(self) -> bytes | None:
        return None if self.key is None else hashlib.sha256(b"fingerprints" + self.key).digest()

    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        assert self.key is not None
        return cast(IO[bytes], _SealWriter(output, self.key, self.item.item))

    def transform_from(self, input: IO[bytes]) -> IO[bytes]:
        key = self.key
        if key is None:
            assert self.item.keys is not None
            key = self.item.keys(self.key_id)
        return _unseal(input, key, self.item.item)


class TestAcmeSeal(TransformTests):
    @pytest.fixture
    def transform(self) -> Any:
        return AcmeSeal(key=KEY)

    @pytest.fixture
    def item(self) -> ItemInfo:
        return replace(BF16, keys={"acme": KEY}.__getitem__)

    @pytest.fixture
    def registry(self) -> ExtensionRegistry:
        return ExtensionRegistry([AcmeSeal])


def test_an_authenticated_transform_satisfies_require_encryption(
    tmp_path: Path, state_dict: dict[str, Any]
) -> None:
    """Before version 2 only an AES-256-GCM descriptor counted as encrypted: the load
    with keys (which requires encryption) refused every item of this checkpoint."""
    storage.save(state_dict, tmp_path, transforms=[ZStandard(), AcmeSeal(key=KEY)])
    target = zeros_like_tree(state_dict)
    registry = ExtensionRegistry([AcmeSeal])
    storage.load(target, tmp_path, keys={"acme": KEY}, registry=registry)
    assert_tree_equal(state_dict, target)


def test_key_ids_are_looked_up_before_decoding(tmp_path: Path, state_dict: dict[str, Any]) -> None:
    """Before version 2 the reader looked up AES keys only; this transform's missing key
    surfaced from inside its decoder as a bare KeyError, not as a MissingKeyError that
    names the key id, the item and how to pass the key."""
    storage.save(state_dict, tmp_path, transforms=[AcmeSeal(key=KEY)])
    registry = ExtensionRegistry([AcmeSeal])
    with pytest.raises(MissingKeyError, match=r"item '.*' is encrypted with key_id 'acme'"):
        storage.load(zeros_like_tree(state_dict), tmp_path, keys={"other": KEY}, registry=registry)


def test_a_plain_item_is_refused_naming_the_authenticated_transforms(
    tmp_path: Path, state_dict: dict[str, Any]
) -> None:
    storage.save(state_dict, tmp_path)
    registry = ExtensionRegistry([AcmeSeal])
    with pytest.raises(UnsafeCheckpointError, match="is not encrypted") as info:
        storage.load(zeros_like_tree(state_dict), tmp_path, keys={"acme": KEY}, registry=registry)
    assert "acme.seal" in str(info.value) and "dcp_storage.aes256gcm" in str(info.value)


def test_fingerprint_key_keys_the_content_fingerprints() -> None:
    tensor = torch.arange(64, dtype=torch.float32)
    assert fingerprint(tensor, [ZStandard(), AcmeSeal(key=KEY)]).record().startswith("keyed-")
    assert fingerprint(tensor, [ZStandard(), AES256GCM(key=KEY)]).record().startswith("keyed-")
    assert not fingerprint(tensor, [ZStandard(), ByteShuffle()]).record().startswith("keyed-")


def test_capabilities_default_to_none_and_are_read_off_the_descriptors() -> None:
    assert not ZStandard.authenticated and AES256GCM.authenticated
    assert ZStandard.key_ids("1") == () and ZStandard().fingerprint_key() is None
    registry = ExtensionRegistry([AcmeSeal])
    chain = [
        "stream.zstd/1",
        "acme.seal/1;key_id=a",
        "dcp_storage.aes256gcm/1;key_id=b;chunk=1024",
        "acme.seal/1;key_id=a",
        "acme.seal/9",  # does not parse: left to decoding to report, naming the item
        "unknown.name/1",
    ]
    assert registry.key_ids(chain) == ["a", "b"]
    assert registry.authenticated(chain) and not registry.authenticated(["stream.zstd/1"])
    assert not registry.authenticated(["unknown.name/1"])


# --- transforms are values; for_item is the one per-item hook ------------------------


def test_for_item_returns_the_transform_for_the_item_and_changes_nothing() -> None:
    shuffle, weights, zstd = ByteShuffle(), WeightCodec(), ZStandard()
    assert shuffle.for_item(BF16) == ByteShuffle(element_size=2)
    assert shuffle.for_item(ItemInfo(item="opaque")) == ByteShuffle(element_size=1)
    assert weights.for_item(BF16) == WeightCodec(element_size=2, dtype="bfloat16")
    assert zstd.for_item(BF16) == ZStandard(dtype="bfloat16")
    assert (shuffle.element_size, weights.element_size, zstd.dtype) == (None, None, None)
    aes = AES256GCM(key=KEY, key_id="k")
    bound = aes.for_item(BF16)
    assert bound.item == BF16 and bound.key == KEY and aes.item == ItemInfo()
    # An explicit setting is the item's already; asked again, the same value comes back.
    assert ByteShuffle(element_size=4).for_item(BF16) == ByteShuffle(element_size=4)
    level3 = ZStandard(level=3)
    assert level3.for_item(BF16) is level3
    for transform in (shuffle, weights, zstd, aes, ZStandard(level=3)):
        once = transform.for_item(BF16)
        assert once.for_item(BF16) is once
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(transform, "item", BF16)  # noqa: B010


def test_descriptor_and_writer_come_from_the_same_per_item_transform() -> None:
    chain = [ByteShuffle(), ZStandard(), AES256GCM(key=KEY, key_id="k", chunk_size=4096)]
    _, descriptors = encoding_stream(chain, cast(IO[bytes], FlushOnlyClose(io.BytesIO())), BF16)
    assert descriptors == [t.for_item(BF16).get_descriptor() for t in chain]
    assert descriptors[0] == "dcp_storage.shuffle/1;es=2"
    # Version 1's hooks are still offered, derived from for_item.
    assert [t.descriptor_for(BF16) for t in chain] == descriptors


# --- a transform written against version 1's item hooks still works -----------------


class _Pass:
    def __init__(self, output: IO[bytes]) -> None:
        self._output = output

    def write(self, data: Any) -> int:
        return self._output.write(data)

    def flush(self) -> None:
        self._output.flush()

    def close(self) -> None:
        self._output.close()


class AcmeTaggedV1(StreamTransformExtension):
    """Version 1 style: records the item's dtype in its descriptor and writes the item's
    name ahead of the bytes, through ``descriptor_for``/``encode``/``decoder_for``/
    ``decode``, with no ``for_item``."""

    def __init__(self, dtype: str = "none") -> None:
        self.dtype = dtype

    @staticmethod
    def registry_name() -> str:
        return "acme.tagged"

    @staticmethod
    def from_descriptor(version: str) -> AcmeTaggedV1:
        number, _, dtype = version.partition(";dtype=")
        if number != "1":
            raise ValueError(f"unknown acme.tagged version {version!r}")
        return AcmeTaggedV1(dtype or "none")

    def get_descriptor(self) -> str:
        return f"acme.tagged/1;dtype={self.dtype}"

    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        return self.encode(output, ItemInfo())

    def transform_from(self, input: IO[bytes]) -> IO[bytes]:
        return self.decode(input, ItemInfo())

    def descriptor_for(self, item: ItemInfo) -> str:
        return f"acme.tagged/1;dtype={item.dtype or 'none'}"

    def encode(self, output: IO[bytes], item: ItemInfo) -> IO[bytes]:
        output.write(item.item.encode() + b"\n")
        return cast(IO[bytes], _Pass(output))

    @classmethod
    def decoder_for(cls, version: str, item: ItemInfo) -> AcmeTaggedV1:
        decoder = cls.from_descriptor(version)
        if decoder.dtype != (item.dtype or "none"):
            raise ValueError(f"recorded dtype {decoder.dtype}, the item is {item.dtype}")
        return decoder

    def decode(self, input: IO[bytes], item: ItemInfo) -> IO[bytes]:
        header = bytearray(len(item.item.encode()) + 1)
        readinto_exact(input, memoryview(header))
        if bytes(header) != item.item.encode() + b"\n":
            raise ValueError(f"acme.tagged: bytes of {bytes(header)!r}, not of {item.item!r}")
        return input


class TestAcmeTaggedV1(TransformTests):
    @pytest.fixture
    def transform(self) -> Any:
        return AcmeTaggedV1()

    @pytest.fixture
    def registry(self) -> ExtensionRegistry:
        return ExtensionRegistry([AcmeTaggedV1])


def test_version_1_item_hooks_are_still_called(tmp_path: Path, state_dict: dict[str, Any]) -> None:
    storage.save(state_dict, tmp_path, transforms=[AcmeTaggedV1(), ZStandard()])
    metadata = fmt.load_metadata((tmp_path / ".metadata").read_bytes(), str(tmp_path))
    recorded = {i.transform_descriptors[0] for i in metadata.storage_data.values()}
    assert {"acme.tagged/1;dtype=bfloat16", "acme.tagged/1;dtype=none"} <= recorded
    target = zeros_like_tree(state_dict)
    storage.load(target, tmp_path, registry=ExtensionRegistry([AcmeTaggedV1]))
    assert_tree_equal(state_dict, target)


# --- one block-buffering writer ------------------------------------------------------


class _Blocks(BlockWriter):
    def __init__(self, out: IO[bytes], block_size: int) -> None:
        super().__init__(out, block_size)
        self.blocks: list[bytes] = []
        self.copied: list[bool] = []
        self.rest: bytes | None = None
        self.caller: object = None

    def emit(self, block: memoryview) -> None:
        self.blocks.append(bytes(block))
        self.copied.append(block.obj is not self.caller)
        self._out.write(block)

    def finish(self, rest: memoryview) -> None:
        self.rest = bytes(rest)
        super().finish(rest)


@pytest.mark.parametrize("write_size", [1, 4093, 10_000, None])
def test_block_writer_emits_whole_blocks_then_the_rest(write_size: int | None) -> None:
    data = payload(3 * 4096 + 5)
    out = io.BytesIO()
    sink = FlushOnlyClose(out)
    writer = _Blocks(cast(IO[bytes], sink), 4096)
    step = write_size or len(data)
    for start in range(0, len(data), step):
        writer.write(data[start : start + step])
        writer.flush()  # never cuts a block short
    assert all(len(b) == 4096 for b in writer.blocks)
    writer.close()
    assert writer.rest == data[-5:] and [len(b) for b in writer.blocks] == [4096] * 3 + [5]
    assert out.getvalue() == data and sink.close_calls == 1 and writer.closed


def test_block_writer_emits_large_writes_from_the_callers_buffer() -> None:
    data = bytearray(payload(2 * 4096 + 100))
    writer = _Blocks(cast(IO[bytes], FlushOnlyClose(io.BytesIO())), 4096)
    writer.caller = data
    writer.write(data)
    writer.close()
    assert writer.copied == [False, False, True]  # the 100-byte rest was staged


def test_block_writer_of_block_size_zero_emits_each_write() -> None:
    writer = _Blocks(cast(IO[bytes], FlushOnlyClose(io.BytesIO())), 0)
    for piece in (b"ab", b"", b"cde"):
        writer.write(piece)
    writer.close()
    assert writer.blocks == [b"ab", b"", b"cde"] and writer.rest == b""


# --- the checkpoint layer never imports a built-in transform's module ----------------


def test_every_built_in_transform_module_is_forbidden_to_storage() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (contract,) = [
        c
        for c in config["tool"]["importlinter"]["contracts"]
        if c.get("source_modules") == ["storage"]
    ]
    modules = {cls.__module__ for cls in registry_module._builtin_classes().values()}
    assert modules and modules <= set(contract["forbidden_modules"])
