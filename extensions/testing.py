"""``TransformTests``: the conformance suite every stream transform subclasses.

A subclass provides a ``transform`` fixture and inherits every check::

    class TestMyTransform(TransformTests):
        @pytest.fixture
        def transform(self):
            return MyTransform()

        @pytest.fixture
        def registry(self):  # only if MyTransform is not registered globally
            return ExtensionRegistry([MyTransform])

A subclass pytest collects (its name starts with ``Test``) that lacks the
``transform`` fixture fails when it is defined, with a ``TypeError`` naming it.
Optional overrides: ``chain`` (several transforms in application order, e.g.
``[ByteShuffle(), ZStandard(), AES256GCM(...)]``), ``item`` (the :class:`ItemInfo`
used to encode and decode, e.g. with ``keys`` for encryption), and the class
attribute ``identity = True`` for transforms that may leave bytes unchanged.

Every item goes through the framework path (``encoding_stream`` into a sink whose
``close`` only flushes, ``ExtensionRegistry.decoding_stream`` out), and is checked at
sizes around 64 KiB, with writes of 1 byte, 4093 bytes and whole, read back with
``read()``, small ``read(n)`` and ``readinto``, through a slice of a larger stream
with junk on both sides. A transform's ``for_item`` (contract version 2) must leave the
transform as it was and, applied again for the same item, describe the same encoding;
its ``max_expansion``, where it states one, must hold for zeros (its best case).
This module imports ``pytest``; use it only from tests.
"""

from __future__ import annotations

import io
from typing import IO, Any, ClassVar, cast

import numpy as np
import pytest

from extensions.base import ItemInfo, stage_for
from extensions.registry import ExtensionRegistry, encoding_stream, parse_descriptor

KIB = 1 << 10
SIZES = [0, 1, 64 * KIB - 1, 64 * KIB, 64 * KIB + 1, 8 << 20]


def payload(size: int, seed: int = 0) -> bytes:
    """Deterministic bytes that compress somewhat: random low nibbles, runs of zeros."""
    rng = np.random.default_rng(seed + size)
    data = rng.integers(0, 16, size, dtype=np.uint8)
    data[(np.arange(size) // 512) % 4 == 3] = 0
    return data.tobytes()


class FlushOnlyClose(io.RawIOBase):
    """What the framework hands a transform: writes pass through, ``close`` only flushes."""

    def __init__(self, out: IO[bytes]) -> None:
        super().__init__()
        self._out = out
        self.close_calls = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        return self._out.write(memoryview(data).cast("B"))

    def close(self) -> None:
        self.close_calls += 1
        if not self.closed:
            self._out.flush()
        super().close()


def encode(
    chain: list[Any], data: bytes, item: ItemInfo, out: IO[bytes], write_size: int | None = None
) -> list[str]:
    """Encode ``data`` into ``out`` through the framework path; returns the descriptors."""
    sink = FlushOnlyClose(out)
    writer, descriptors = encoding_stream(chain, cast(IO[bytes], sink), item)
    view = memoryview(data)
    step = write_size or max(1, len(data))
    for start in range(0, len(data), step):
        writer.write(view[start : start + step])
    writer.close()
    return descriptors


def read_all(stream: IO[bytes], mode: str = "read") -> bytes:
    """Drain ``stream`` with ``read()``, ``read(4093)`` or ``readinto`` (where it has one)."""
    if mode == "read":
        return stream.read()
    parts = []
    if mode == "small":
        while chunk := stream.read(4093):
            parts.append(chunk)
        return b"".join(parts)
    readinto = getattr(stream, "readinto", None)
    if readinto is None:  # the minimum contract is read(); readinto is optional
        while chunk := stream.read(100_003):
            parts.append(chunk)
        return b"".join(parts)
    buffer = bytearray(100_003)
    while n := readinto(buffer):
        parts.append(bytes(buffer[:n]))
    return b"".join(parts)


class ConformanceSuite:
    """The base of a conformance suite (this module's, ``storage.testing``'s): the suite
    declares in ``required_hooks`` the fixtures and methods its subclasses provide, and
    a test class pytest collects (its name starts with ``Test``) that lacks any of them
    fails when it is defined, with a ``TypeError`` naming each one, rather than with an
    error in every test. Classes with another name may provide part of them (bases
    shared by several test classes). A hook counts as provided when the test class or
    one of its bases other than the suite defines it, so a mixin can provide it."""

    #: Hook name (fixture or method) -> what it is, declared by the suite class itself.
    required_hooks: ClassVar[dict[str, str]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not cls.__name__.startswith("Test"):
            return
        missing = [
            f"`{name}` ({what})"
            for name, what in cls.required_hooks.items()
            if not _provided(cls, name)
        ]
        if missing:
            suite = next(k for k in cls.__mro__ if vars(k).get("required_hooks"))
            raise TypeError(
                f"{cls.__module__}.{cls.__qualname__} does not provide "
                f"{', '.join(missing)}: a subclass of {suite.__module__}.{suite.__qualname__} "
                "defines each of them (or inherits it from a mixin)"
            )


def _provided(cls: type, name: str) -> bool:
    """``name`` is defined by ``cls`` or a base of it that is not a suite's declaration."""
    return any(
        name in vars(k) for k in cls.__mro__ if k is not object and "required_hooks" not in vars(k)
    )


class TransformTests(ConformanceSuite):
    """Conformance checks for one transform (or chain); see the module docstring."""

    required_hooks: ClassVar[dict[str, str]] = {
        "transform": "fixture: the transform under test",
    }

    #: The transform may leave the bytes unchanged (a filter that is the identity here).
    identity: ClassVar[bool] = False

    @pytest.fixture
    def transform(self) -> Any:
        raise NotImplementedError(f"{type(self).__qualname__} provides no `transform` fixture")

    @pytest.fixture
    def chain(self, transform: Any) -> list[Any]:
        return [transform]

    @pytest.fixture
    def item(self) -> ItemInfo:
        return ItemInfo(
            checkpoint="memory://transform-tests",
            item="layers.0.weight",
            dtype="bfloat16",
            element_size=2,
        )

    @pytest.fixture
    def registry(self) -> ExtensionRegistry:
        return ExtensionRegistry()

    def round_trip(
        self,
        chain: list[Any],
        registry: ExtensionRegistry,
        item: ItemInfo,
        data: bytes,
        *,
        write_size: int | None = None,
        mode: str = "read",
    ) -> bytes:
        out = io.BytesIO()
        descriptors = encode(chain, data, item, out, write_size)
        stream = registry.decoding_stream(descriptors, io.BytesIO(out.getvalue()), item)
        return read_all(stream, mode)

    @pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s}B")
    def test_round_trip_sizes(
        self, chain: list[Any], registry: ExtensionRegistry, item: ItemInfo, size: int
    ) -> None:
        data = payload(size)
        assert self.round_trip(chain, registry, item, data) == data

    @pytest.mark.parametrize("write_size", [1, 4093, None], ids=["1B", "4093B", "whole"])
    def test_write_chunk_sizes(
        self,
        chain: list[Any],
        registry: ExtensionRegistry,
        item: ItemInfo,
        write_size: int | None,
    ) -> None:
        data = payload(64 * KIB + 1 if write_size == 1 else 3 * 64 * KIB + 7, seed=1)
        assert self.round_trip(chain, registry, item, data, write_size=write_size) == data

    @pytest.mark.parametrize("mode", ["read", "small", "readinto"])
    def test_read_patterns(
        self, chain: list[Any], registry: ExtensionRegistry, item: ItemInfo, mode: str
    ) -> None:
        data = payload(300 * KIB + 3, seed=2)
        assert self.round_trip(chain, registry, item, data, mode=mode) == data

    def test_decode_through_slice_with_junk(
        self, chain: list[Any], registry: ExtensionRegistry, item: ItemInfo
    ) -> None:
        from extensions.streams import SliceView

        data = payload(200 * KIB + 5, seed=3)
        out = io.BytesIO()
        descriptors = encode(chain, data, item, out)
        encoded = out.getvalue()
        junk = np.random.default_rng(4).integers(0, 256, 70_001, dtype=np.uint8).tobytes()
        base = io.BytesIO(junk[:30_011] + encoded + junk[30_011:])
        view = cast(IO[bytes], SliceView(base, 30_011, len(encoded)))
        assert read_all(registry.decoding_stream(descriptors, view, item), "readinto") == data

    def test_wrapped_stream_never_closed(
        self, chain: list[Any], registry: ExtensionRegistry, item: ItemInfo
    ) -> None:
        from extensions.streams import SliceView

        underlying = io.BytesIO()
        first, second = payload(100 * KIB, seed=5), payload(1000, seed=6)
        spans = []
        for data in (first, second):
            start = underlying.tell()
            descriptors = encode(chain, data, item, underlying)
            # The item is finished (trailers written) and the stream is still usable.
            assert not underlying.closed
            spans.append((start, underlying.tell() - start, descriptors))
        underlying.write(b"still writable")
        for (start, length, descriptors), data in zip(spans, (first, second)):
            view = cast(IO[bytes], SliceView(underlying, start, length))
            assert read_all(registry.decoding_stream(descriptors, view, item)) == data

    def test_descriptor_round_trip(
        self, chain: list[Any], registry: ExtensionRegistry, item: ItemInfo
    ) -> None:
        out = io.BytesIO()
        descriptors = encode(chain, payload(1000), item, out)
        assert len(descriptors) == len(chain)
        for transform, descriptor in zip(chain, descriptors):
            name, version = parse_descriptor(descriptor)
            assert name == transform.registry_name() and version, descriptor
            assert registry.get(name) is type(transform)
            decoder: Any = registry.decoder(descriptor, item)
            describe = getattr(decoder, "descriptor_for", None)
            rebuilt = describe(item) if describe else decoder.get_descriptor()
            assert rebuilt == descriptor
            assert type(decoder) is type(transform)

    def test_for_item_is_stable(self, chain: list[Any], item: ItemInfo) -> None:
        """The reader applies ``for_item`` again to a decoder it built with it: doing so
        changes nothing, and the transform it was asked of is left as it was."""
        for transform in chain:
            before = transform.get_descriptor()
            stage = stage_for(transform, item)
            assert stage_for(stage, item).get_descriptor() == stage.get_descriptor()
            assert transform.get_descriptor() == before

    def test_torch_api_round_trip(self, transform: Any, item: ItemInfo) -> None:
        """``transform_to`` / ``transform_from`` alone, as stock torch calls them."""
        data = payload(70 * KIB, seed=7)
        out = io.BytesIO()
        writer = transform.transform_to(FlushOnlyClose(out))
        writer.write(data)
        writer.close()
        assert read_all(transform.transform_from(io.BytesIO(out.getvalue()))) == data

    def test_encoded_output_differs(self, chain: list[Any], item: ItemInfo) -> None:
        if self.identity:
            pytest.skip("identity transform for this item")
        data = payload(64 * KIB, seed=8)
        out = io.BytesIO()
        encode(chain, data, item, out)
        assert out.getvalue() != data

    @pytest.mark.parametrize("size", [0, 1, 8 << 20], ids=lambda s: f"{s}B")
    def test_max_expansion_holds(
        self, chain: list[Any], registry: ExtensionRegistry, item: ItemInfo, size: int
    ) -> None:
        # Readers refuse a tensor claiming more than its stored bytes times the chain's
        # bound (max_expansion): a bound the encoder can beat would refuse real items.
        # Zeros are every codec's best case.
        out = io.BytesIO()
        descriptors = encode(chain, bytes(size), item, out)
        bound = registry.max_expansion(descriptors)
        if bound is None:
            pytest.skip("the chain states no max_expansion")
        assert size <= len(out.getvalue()) * bound
