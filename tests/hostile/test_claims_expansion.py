"""A compressed tensor chunk claiming more elements than its stored bytes could decode to.

Where a reader allocates a tensor at the size the metadata claims (the recovery
transport's receiver, ``export``, the Lightning integration, ``verify``'s scratch
tensors) the claim is checked against the stored bytes first: an untransformed item
holds at least a byte per element, and a transformed one at most its chain's
``max_expansion`` plain bytes per stored byte (zstd: 32768, its shortest block; the
weight codec: 65536). A claim past that is refused naming the item before anything is
allocated; a real compressed tensor (zeros, the best case of every codec) still loads.
"""

from __future__ import annotations

import pickle
import struct
from datetime import timedelta
from pathlib import Path
from typing import IO, Any

import pytest
import torch
import zstandard

import storage
from extensions import AES256GCM, ByteShuffle, WeightCodec, ZStandard
from extensions.base import StreamTransformExtension
from extensions.errors import IntegrityError
from extensions.registry import ExtensionRegistry
from extensions.zstd import MAX_EXPANSION
from storage.backends import LocalFileSystem
from storage.ops.export import export_safetensors
from storage.ops.verify import verify

KEY = bytes(range(32))
WAIT = timedelta(seconds=30)


def _claim(metadata_path: Path, fqn: str, elements: int) -> Any:
    """Have ``fqn`` (one chunk) claim ``elements`` elements, its stored bytes unchanged."""
    metadata = pickle.loads(metadata_path.read_bytes())  # the test's own file: trusted
    entry = metadata.state_dict_metadata[fqn]
    entry.size = entry.chunks[0].sizes = torch.Size([elements])
    metadata_path.write_bytes(pickle.dumps(metadata))
    return next(v for k, v in metadata.storage_data.items() if k.fqn == fqn)


def test_a_receiver_allocates_nothing_for_a_claim_its_compressed_bytes_cannot_hold(
    tmp_path: Path,
) -> None:
    # The sender stores 4 float32 elements through zstd (a few hundred bytes) and claims
    # a chunk, and a tensor, of 2**36 elements (256 GiB). Before, the chunk's claim was
    # believed (it covers its tensor) and the receiver asked the allocator for 256 GiB:
    # reserved where the machine overcommits, a MemoryError where it does not, and a
    # bigger claim in a bigger bucket either way; the 4 elements decode to far less.
    sender = storage.StorageTransport(str(tmp_path), rank=0, transforms=[ZStandard()])
    sender.send_checkpoint([1], 1, {"w": torch.ones(4)}, timedelta(seconds=60))
    info = _claim(tmp_path / "replica-0" / "step-1" / ".metadata", "w", 1 << 36)
    receiver = storage.StorageTransport(str(tmp_path), rank=1)
    with pytest.raises(
        IntegrityError,
        match=rf"'w' claims {1 << 36} elements but stores {info.length} bytes, through "
        r"\['stream.zstd/1'\], which decode to at most "
        rf"{info.length * MAX_EXPANSION} bytes.*nothing was allocated",
    ):
        receiver.recv_checkpoint(0, sender.metadata(), 1, WAIT)


class _Opaque(StreamTransformExtension):
    """A user's transform that says nothing of how far it expands (an identity)."""

    @staticmethod
    def registry_name() -> str:
        return "acme.opaque"

    @staticmethod
    def from_descriptor(version: str) -> _Opaque:
        return _Opaque()

    def get_descriptor(self) -> str:
        return "acme.opaque/1"

    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        return output

    def transform_from(self, input: IO[bytes]) -> IO[bytes]:
        return input


def test_export_refuses_the_claim_before_allocating(tmp_path: Path) -> None:
    # The same claim in a checkpoint: export allocated each tensor at its claim to load
    # it whole (the allocator's refusal, or 4 TiB reserved, before a byte was read).
    ckpt = tmp_path / "c"
    storage.save({"w": torch.ones(4)}, ckpt, transforms=[ZStandard()])
    _claim(ckpt / ".metadata", "w", 1 << 40)
    fs = LocalFileSystem()
    with pytest.raises(IntegrityError, match=r"'w' claims 1099511627776 elements but stores"):
        export_safetensors(fs, str(ckpt), fs, str(tmp_path / "out"))


@pytest.mark.parametrize("chain", ["plain", "zstd", "opaque"])
def test_verify_allocates_nothing_for_a_chunk_its_bytes_cannot_hold(
    tmp_path: Path, chain: str
) -> None:
    # verify allocated each chunk's scratch tensor at the size the metadata claims: for
    # a 64-byte item claiming 2**40 float32 elements, torch's "DefaultCPUAllocator: can't
    # allocate memory: you tried to allocate 4398046511104 bytes" was the item's
    # damage (where the machine did not overcommit first). An item is refused before
    # anything is allocated where its chain's expansion is known (none, or zstd: before,
    # only an untransformed one was); where it is not (a user's transform), an
    # allocation that fails says the item is more than the machine can allocate.
    transforms = {"plain": [], "zstd": [ZStandard()], "opaque": [_Opaque()]}[chain]
    storage.save({"t": torch.ones(16)}, tmp_path, transforms=transforms)
    _claim(tmp_path / ".metadata", "t", 1 << 40 if chain == "plain" else 1 << 58)
    report = verify(LocalFileSystem(), str(tmp_path), registry=ExtensionRegistry([_Opaque]))
    why = report.bad["t"]
    if chain == "opaque":
        assert "more than this machine can allocate" in why, why
    else:
        assert why.startswith(f"it claims {1 << 40 if chain == 'plain' else 1 << 58} "), why
        assert "nothing was allocated" in why


@pytest.mark.parametrize(
    "chain",
    [
        [ZStandard()],
        [ZStandard(level=19)],
        [WeightCodec()],
        [ByteShuffle(), ZStandard()],
        [ZStandard(), AES256GCM(key=KEY, key_id="k")],
    ],
    ids=["zstd", "zstd19", "weights", "shuffle-zstd", "zstd-aes"],
)
def test_the_bound_leaves_every_real_compressed_tensor_alone(
    tmp_path: Path, chain: list[Any]
) -> None:
    # 64 MiB of zeros, each codec's best case, exported whole: its claim is believed.
    n = 1 << 24
    ckpt = tmp_path / "c"
    storage.save({"z": torch.zeros(n, dtype=torch.uint8)}, ckpt, transforms=chain)
    metadata = pickle.loads((ckpt / ".metadata").read_bytes())  # the test's own file
    info = next(iter(metadata.storage_data.values()))
    bound = ExtensionRegistry().max_expansion(info.transform_descriptors)
    assert bound is not None and n <= info.length * bound
    fs = LocalFileSystem()
    keys = {"k": KEY} if isinstance(chain[-1], AES256GCM) else None
    export_safetensors(fs, str(ckpt), fs, str(tmp_path / "out"), keys=keys)
    assert (tmp_path / "out" / "model.safetensors").stat().st_size > n


def test_the_bound_is_what_a_stream_can_hold() -> None:
    # zstd's bound is a property of the format: no frame beats RLE blocks (128 KiB
    # each from a 3-byte header and the byte), here 64 of them built by hand.
    blocks = 64
    frame = struct.pack("<IBB", 0xFD2FB528, 0, 7 << 3)  # no content size, 128 KiB window
    for i in range(blocks):
        header = (128 << 10) << 3 | 1 << 1 | (i == blocks - 1)
        frame += header.to_bytes(3, "little") + b"\x00"
    plain = zstandard.ZstdDecompressor().decompressobj().decompress(frame)
    assert plain == bytes(blocks << 17)
    assert len(frame) * MAX_EXPANSION >= len(plain) > (len(frame) - 6) * MAX_EXPANSION * 0.99
    assert ExtensionRegistry().max_expansion(["acme.unknown/1"]) is None
    assert ExtensionRegistry().max_expansion([]) == 1
