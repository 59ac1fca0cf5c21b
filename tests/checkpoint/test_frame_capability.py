"""The transform contract's frame capability (``frame_decoder`` / ``frames``): a user's
transform that offers it gets its items decoded frame by frame on the decoders, one
that does not is decoded as one stream; the checkpoint layer asks the registry, never
a transform by name."""

from __future__ import annotations

import io
import threading
import zlib
from pathlib import Path
from typing import IO, Any

import torch

import storage
from extensions import ExtensionRegistry, StreamTransformExtension
from extensions.base import Frame, FrameDecoder, ReadAt

_FRAME = 1 << 20  # plain bytes per frame


class _Writer:
    """zlib, one independent stream per :data:`_FRAME` plain bytes, then an index of
    the frames' sizes and its entry count (4 bytes)."""

    def __init__(self, output: IO[bytes]) -> None:
        self._output, self._pending, self._sizes = output, bytearray(), []

    def write(self, data: Any) -> int:
        self._pending += memoryview(data).cast("B")
        while len(self._pending) >= _FRAME:
            self._frame(bytes(self._pending[:_FRAME]))
            del self._pending[:_FRAME]
        return memoryview(data).nbytes

    def _frame(self, plain: bytes) -> None:
        stored = zlib.compress(plain, 1)
        self._output.write(stored)
        self._sizes.append((len(stored), len(plain)))

    def flush(self) -> None:
        self._output.flush()

    def close(self) -> None:
        if self._pending or not self._sizes:
            self._frame(bytes(self._pending))
        for stored, plain in self._sizes:
            self._output.write(stored.to_bytes(4, "little") + plain.to_bytes(4, "little"))
        self._output.write(len(self._sizes).to_bytes(4, "little"))
        self._output.close()


class _Streamed(StreamTransformExtension):
    """The frame format above, decoded as one stream (no frame capability)."""

    decoded = 0  # items decoded as a stream

    @staticmethod
    def registry_name() -> str:
        return "tests.zframes"

    @classmethod
    def from_descriptor(cls, version: str) -> StreamTransformExtension:
        return cls()

    def get_descriptor(self) -> str:
        return f"{self.registry_name()}/1"

    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        return _Writer(output)  # type: ignore[return-value]

    def transform_from(self, input: IO[bytes]) -> IO[bytes]:
        type(self).decoded += 1
        stored = input.read()
        count = int.from_bytes(stored[-4:], "little")
        index = stored[-4 - 8 * count : -4]
        plain, at = bytearray(), 0
        for i in range(count):
            size = int.from_bytes(index[8 * i : 8 * i + 4], "little")
            plain += zlib.decompress(stored[at : at + size])
            at += size
        return io.BytesIO(bytes(plain))


class _Framed(_Streamed):
    """The same format, offering its frames."""

    decoded = 0
    frame_calls = 0
    threads: set[int] = set()
    lock = threading.Lock()

    @staticmethod
    def registry_name() -> str:
        return "tests.zframes-split"

    @classmethod
    def frame_decoder(cls, version: str) -> FrameDecoder | None:
        def decode(source: memoryview, whole: bool) -> IO[bytes]:
            with cls.lock:
                cls.frame_calls += 1
                cls.threads.add(threading.get_ident())
            return io.BytesIO(zlib.decompress(source))

        return decode

    @classmethod
    def frames(cls, version: str, read_at: ReadAt, length: int) -> list[Frame] | None:
        count = int.from_bytes(read_at(length - 4, 4), "little")
        index = read_at(length - 4 - 8 * count, 8 * count)
        found, stored, plain = [], 0, 0
        for i in range(count):
            size = int.from_bytes(index[8 * i : 8 * i + 4], "little")
            decoded = int.from_bytes(index[8 * i + 4 : 8 * i + 8], "little")
            found.append(Frame(stored, size, plain, decoded))
            stored, plain = stored + size, plain + decoded
        return found


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"big": torch.randn(5 * _FRAME // 4 * 2, generator=g), "small": torch.arange(9)}


def test_a_transform_offering_frames_is_decoded_frame_by_frame(tmp_path: Path) -> None:
    """Before the capability, only the built-in zstd (named in the checkpoint layer) was
    decoded in frames: this transform's items were decoded as one stream."""
    state = _state()
    storage.save(state, tmp_path / "ck", transforms=[_Framed()])
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    storage.load(out, tmp_path / "ck", registry=ExtensionRegistry([_Framed]))
    assert all(torch.equal(out[k], state[k]) for k in state)
    assert _Framed.decoded == 0  # no item went through the stream decoder
    # "big" is ~10 MiB of plain bytes: 10 frames and more, "small" one.
    assert _Framed.frame_calls >= 11
    assert len(_Framed.threads) >= 1 and threading.get_ident() not in _Framed.threads


def test_a_transform_without_the_capability_is_decoded_as_a_stream(tmp_path: Path) -> None:
    state = _state()
    storage.save(state, tmp_path / "ck", transforms=[_Streamed()])
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    storage.load(out, tmp_path / "ck", registry=ExtensionRegistry([_Streamed]))
    assert all(torch.equal(out[k], state[k]) for k in state)
    assert _Streamed.decoded == 2  # both items, each as one stream


def test_the_registry_answers_for_a_chain_of_one_splittable_stage() -> None:
    registry = ExtensionRegistry([_Framed, _Streamed])
    assert registry.framing(["tests.zframes-split/1"]) is not None
    assert registry.framing(["stream.zstd/1"]) is not None  # the built-in offers it too
    assert registry.framing(["tests.zframes/1"]) is None
    assert registry.framing(["stream.zstd/1", "tests.zframes-split/1"]) is None  # a chain
    assert registry.framing([]) is None
