"""ZStandard's per-item settings and its compatibility with torch's descriptor."""

from __future__ import annotations

import io

import torch
import zstandard

from extensions import ItemInfo, ZStandard


class _Sink(io.BytesIO):
    def close(self) -> None:  # keep the bytes readable after the transform closes us
        self.flush()


def _encode(transform: ZStandard, data: bytes, item: ItemInfo) -> bytes:
    sink = _Sink()
    writer = transform.encode(sink, item)
    writer.write(data)
    writer.close()
    return sink.getvalue()


def test_auto_level_uses_fast_settings_for_floats_only() -> None:
    weights = (torch.randn(1 << 18) * 0.02).to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
    fast = zstandard.ZstdCompressionParameters.from_level(1, min_match=7, hash_log=8)
    expected = zstandard.ZstdCompressor(compression_params=fast).compress(weights)
    got = _encode(ZStandard(), weights, ItemInfo(dtype="bfloat16", element_size=2))
    assert zstandard.ZstdDecompressor().decompress(got, max_output_size=len(weights)) == weights
    assert len(got) == len(expected)

    ids = torch.arange(1 << 16).repeat(4).numpy().tobytes()
    level3 = zstandard.ZstdCompressor(level=3).compress(ids)
    for item in (ItemInfo(dtype="int64", element_size=8), ItemInfo()):
        assert len(_encode(ZStandard(), ids, item)) == len(level3)


def test_explicit_level_applies_to_every_item() -> None:
    data = (torch.randn(1 << 16) * 0.02).numpy().tobytes()
    level5 = zstandard.ZstdCompressor(level=5).compress(data)
    assert len(_encode(ZStandard(level=5), data, ItemInfo(dtype="float32"))) == len(level5)


def test_descriptor_is_torchs() -> None:
    from torch.distributed.checkpoint._extension import ExtensionRegistry

    assert ZStandard().get_descriptor() == "stream.zstd/1"
    (decoder,) = ExtensionRegistry().from_descriptor_list([ZStandard().get_descriptor()])
    assert decoder.registry_name() == "stream.zstd"
