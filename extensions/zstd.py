"""Zstandard compression with torch's descriptor, so stock DCP reads it and vice versa."""

from __future__ import annotations

from typing import IO, cast

from extensions.base import StreamTransformExtension
from extensions.errors import MissingDependencyError


def _zstandard():  # type: ignore[no-untyped-def]
    try:
        import zstandard
    except ImportError as exc:  # pragma: no cover - zstandard is a core dependency
        raise MissingDependencyError(
            "zstd compression needs the 'zstandard' package: pip install zstandard"
        ) from exc
    return zstandard


class ZStandard(StreamTransformExtension):
    """Zstandard compression (descriptor ``stream.zstd/1``, torch's).

    ``level`` trades speed for ratio (1-22, negative for fast modes). ``threads`` > 0
    compresses each item with that many zstd worker threads; the default 0 keeps one
    thread per item because the writer already compresses items in parallel. The
    output is one standard zstd frame, readable by stock torch and the ``zstd`` tool.
    """

    def __init__(self, level: int = 3, *, threads: int = 0) -> None:
        if not isinstance(level, int) or isinstance(level, bool):
            raise TypeError(f"ZStandard level must be an int, got {level!r}")
        if not isinstance(threads, int) or threads < 0:
            raise TypeError(f"ZStandard threads must be an int >= 0, got {threads!r}")
        self.level = level
        self.threads = threads

    def __repr__(self) -> str:
        return f"ZStandard(level={self.level}, threads={self.threads})"

    @staticmethod
    def registry_name() -> str:
        return "stream.zstd"

    @staticmethod
    def from_descriptor(version: str) -> ZStandard:
        if version.partition(".")[0] != "1":
            raise ValueError(f"unsupported stream.zstd version {version!r} (this reader knows 1)")
        return ZStandard()

    def get_descriptor(self) -> str:
        return "stream.zstd/1"

    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        compressor = _zstandard().ZstdCompressor(level=self.level, threads=self.threads)
        return cast(IO[bytes], compressor.stream_writer(output))

    def transform_from(self, input: IO[bytes]) -> IO[bytes]:
        decompressor = _zstandard().ZstdDecompressor()
        return cast(IO[bytes], decompressor.stream_reader(input, read_across_frames=True))
