"""User transforms: written against torch's minimal API, registered three ways, read by
every reader (local, MemoryFileSystem, fsspec) alone and chained with the built-ins."""

from __future__ import annotations

import sys
import textwrap
import uuid
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest
from torch.distributed.checkpoint._extension import (
    StreamTransformExtension as TorchStreamTransformExtension,
)

import extensions
import storage
from extensions import (
    AES256GCM,
    ByteShuffle,
    ExtensionRegistry,
    StreamTransformExtension,
    UnknownTransformError,
    ZStandard,
)
from extensions import registry as registry_module
from extensions.testing import TransformTests
from tests.support.trees import assert_tree_equal, zeros_like_tree

KEY = bytes(range(100, 132))


# --- the sample transform, written the torch way: five methods, nothing else ---------


class _ZlibWriter:
    def __init__(self, output: IO[bytes]) -> None:
        self._output = output
        self._compressor = zlib.compressobj(1)

    def write(self, data: Any) -> int:
        self._output.write(self._compressor.compress(data))
        return memoryview(data).nbytes

    def flush(self) -> None:
        self._output.flush()

    def close(self) -> None:
        self._output.write(self._compressor.flush())
        self._output.close()  # only flushes: the framework hands us a no-close stream


class _ZlibReader:
    def __init__(self, input: IO[bytes]) -> None:
        self._input = input
        self._decompressor = zlib.decompressobj()
        self._pending = b""

    def read(self, size: int = -1) -> bytes:
        while (size < 0 or len(self._pending) < size) and not self._decompressor.eof:
            raw = self._input.read(1 << 16)
            if not raw:
                raise ValueError("zlib stream ended early")
            self._pending += self._decompressor.decompress(raw)
        cut = len(self._pending) if size < 0 else size
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out


class AcmeZlib(StreamTransformExtension):
    @staticmethod
    def registry_name() -> str:
        return "acme.zlib"

    @staticmethod
    def from_descriptor(version: str) -> AcmeZlib:
        if version != "1":
            raise ValueError(f"unknown acme.zlib version {version!r}")
        return AcmeZlib()

    def get_descriptor(self) -> str:
        return "acme.zlib/1"

    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        return _ZlibWriter(output)  # type: ignore[return-value]

    def transform_from(self, input: IO[bytes]) -> IO[bytes]:
        return _ZlibReader(input)  # type: ignore[return-value]


class _XorStream:
    def __init__(self, stream: IO[bytes]) -> None:
        self._stream = stream

    def write(self, data: Any) -> int:
        return self._stream.write(bytes(b ^ 0x5A for b in bytes(data)))

    def read(self, size: int = -1) -> bytes:
        return bytes(b ^ 0x5A for b in self._stream.read(size))

    def flush(self) -> None:
        self._stream.flush()

    def close(self) -> None:
        self._stream.close()


class AcmeXor(TorchStreamTransformExtension):
    """Subclasses *stock torch's* base class: dcp-storage accepts it unchanged."""

    @staticmethod
    def registry_name() -> str:
        return "acme.xor"

    @staticmethod
    def from_descriptor(version: str) -> AcmeXor:
        return AcmeXor()

    def get_descriptor(self) -> str:
        return "acme.xor/1"

    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        return _XorStream(output)  # type: ignore[return-value]

    def transform_from(self, input: IO[bytes]) -> IO[bytes]:
        return _XorStream(input)  # type: ignore[return-value]


class TestAcmeZlib(TransformTests):
    @pytest.fixture
    def transform(self) -> Any:
        return AcmeZlib()

    @pytest.fixture
    def registry(self) -> ExtensionRegistry:
        return ExtensionRegistry([AcmeZlib])


@pytest.fixture
def clean_registry() -> Iterator[None]:
    """Process-wide registrations made by a test are undone after it."""
    saved = dict(registry_module._global)
    loaded = registry_module._entry_points_loaded
    yield
    registry_module._global.clear()
    registry_module._global.update(saved)
    registry_module._entry_points_loaded = loaded


# --- registering ----------------------------------------------------------------------


def test_register_as_decorator(clean_registry: None) -> None:
    @extensions.register
    class AcmeNoop(AcmeZlib):
        @staticmethod
        def registry_name() -> str:
            return "acme.noop"

    assert ExtensionRegistry().get("acme.noop") is AcmeNoop
    assert extensions.register(AcmeNoop) is AcmeNoop  # the same class again is fine


def test_reregistering_a_taken_name_raises(clean_registry: None) -> None:
    extensions.register(AcmeZlib)

    class Impostor(AcmeZlib):
        pass

    with pytest.raises(ValueError, match=r"'acme\.zlib' is already registered.*AcmeZlib"):
        extensions.register(Impostor)

    class Builtin(AcmeZlib):
        @staticmethod
        def registry_name() -> str:
            return "stream.zstd"

    with pytest.raises(ValueError, match="already registered"):
        extensions.register(Builtin)
    with pytest.raises(ValueError, match="already registered"):
        ExtensionRegistry([AcmeZlib, Impostor])


def test_unregistered_descriptor_lists_names_and_how_to_register(tmp_path: Path) -> None:
    state = {"w": __import__("torch").arange(10.0)}
    storage.save(state, tmp_path, transforms=[AcmeZlib()])
    target = zeros_like_tree(state)
    assert isinstance(target, dict)
    with pytest.raises(UnknownTransformError) as info:
        storage.load(target, tmp_path)
    message = str(info.value)
    for text in ("'acme.zlib'", "stream.zstd", "dcp_storage.aes256gcm", "extensions.register"):
        assert text in message
    assert "registry=ExtensionRegistry" in message
    storage.load(target, tmp_path, registry=ExtensionRegistry([AcmeZlib]))
    assert_tree_equal(state, target)


def test_entry_point_plugin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clean_registry: None
) -> None:
    module = f"acme_plugin_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text(
        textwrap.dedent(
            """
            import zlib
            from extensions import StreamTransformExtension

            class Rot(StreamTransformExtension):
                @staticmethod
                def registry_name():
                    return "acme.plugin-rot"

                @staticmethod
                def from_descriptor(version):
                    return Rot()

                def get_descriptor(self):
                    return "acme.plugin-rot/1"

                def transform_to(self, output):
                    return output

                def transform_from(self, input):
                    return input
            """
        )
    )
    dist = tmp_path / "acme_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[dcp_storage.transforms]\nrot = {module}:Rot\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    registry_module._entry_points_loaded = False
    assert "acme.plugin-rot" in ExtensionRegistry().names()
    assert ExtensionRegistry().get("acme.plugin-rot") is sys.modules[module].Rot


# --- every reader, alone and in chains ------------------------------------------------


@pytest.fixture(params=["local", "memory", "fsspec"])
def location(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Any, dict[str, Any]]:
    if request.param == "local":
        return tmp_path / "ckpt", {}
    if request.param == "memory":
        return "ckpt", {"filesystem": storage.MemoryFileSystem()}
    pytest.importorskip("fsspec")
    return f"memory://{uuid.uuid4().hex}/ckpt", {}


@pytest.mark.parametrize(
    "chain",
    ["zlib", "xor", "shuffle+zlib+aes", "xor+zstd+aes"],
)
def test_custom_transforms_round_trip(
    location: tuple[Any, dict[str, Any]], state_dict: dict[str, Any], chain: str
) -> None:
    path, options = location
    aes = AES256GCM(key=KEY, key_id="acme", chunk_size=4096)
    chains: dict[str, list[Any]] = {
        "zlib": [AcmeZlib()],
        "xor": [AcmeXor()],
        "shuffle+zlib+aes": [ByteShuffle(), AcmeZlib(), aes],
        "xor+zstd+aes": [AcmeXor(), ZStandard(), aes],
    }
    storage.save(state_dict, path, transforms=chains[chain], **options)
    target = zeros_like_tree(state_dict)
    assert isinstance(target, dict)
    storage.load(
        target,
        path,
        keys={"acme": KEY} if "aes" in chain else None,  # keys make encryption required
        registry=ExtensionRegistry([AcmeZlib, AcmeXor]),
        **options,
    )
    assert_tree_equal(state_dict, target)
