"""Regenerate the golden encoded items and checkpoints under ``tests/golden``.

    python tests/golden/make_transform_goldens.py             # both sets
    python tests/golden/make_transform_goldens.py weights     # tests/golden/weights-3 only
    python tests/golden/make_transform_goldens.py aes         # tests/golden/transforms-aes3 only

Run it only when a transform's format changes on purpose (with a new descriptor
version): the committed files prove that what older releases wrote keeps decoding.

``transforms/`` (AES format 1, ``dcp_storage.aes256gcm/1``), ``transforms-aes2/``
(format 2) and ``transforms-aes3/`` (format 3: items bound to their save, checkpoints
with sealed metadata): AES, zstd and shuffle chains. The first two were written by
earlier releases and are kept as they are; this script writes ``transforms-aes3/``
only (its items as items of the save ``golden-save``, recorded in the manifest).
Encryption is randomised per item, so every run writes
different bytes. The key is a fixed test key, ``bytes(range(32))`` under key_id
``golden``; it protects nothing. ``tests/extensions/test_encryption.py`` decodes every
item in each ``manifest.json`` and loads each set's checkpoints.

``weights/``: ``dcp_storage.weights/1`` items covering each plane mode (raw, constant,
one bit, zstd, packed pairs and quads with escapes; sign moved or not; a tail; several
blocks) and a checkpoint, written by an earlier release and kept as they are.
``weights-3/``: the same cases as ``WeightCodec(compact=True)`` writes them now (this
script): format 3 for bfloat16 (JOINT blocks, with escapes), format 2 for the rest
(with the seven-bit and 16-bit low planes of fp32), and one bfloat16 item as the
default ``WeightCodec()`` writes it (format 2). ``tests/extensions/test_weights.py``
decodes and loads both.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

import storage
from extensions import AES256GCM, ByteShuffle, ItemInfo, WeightCodec, ZStandard
from extensions.testing import encode

OUT = Path(__file__).parent / "transforms-aes3"
SAVE = "golden-save"  # the save the manifest's items are bound to
WEIGHTS = Path(__file__).parent / "weights-3"
KEY = bytes(range(32))


def aes() -> AES256GCM:
    return AES256GCM(key=KEY, key_id="golden", chunk_size=4096)


def golden_state_dict() -> dict[str, object]:
    gen = torch.Generator().manual_seed(4321)
    return {
        "layer.weight": (torch.randn(48, 64, generator=gen) * 0.02).to(torch.bfloat16),
        "layer.bias": torch.randn(64, generator=gen),
        "ids": torch.arange(100, dtype=torch.int64),
        "optim": {"step": torch.tensor(5.0), "lr": 0.0003},
    }


def weights_items() -> dict[str, tuple[torch.Tensor | bytes, str | None]]:
    """Plain items (a tensor, or opaque bytes) and their dtypes, one per case."""
    gen = torch.Generator().manual_seed(7)
    crepe_like = (torch.randn(8192, generator=gen) * 0.05).view(torch.int32) & ~0x7F
    odd = (torch.randn(5000, generator=gen) * 0.02).to(torch.bfloat16)
    second_moment = torch.randn(8192, 16, generator=gen).pow(2).mean(1) * 1e-6
    second_moment[5::2999] *= 1e4  # rare outliers, away from the sampled positions: escapes
    bf16 = torch.randn(16384, generator=gen) * 0.02
    bf16[7::4001] = 3e30  # exponents outside the JOINT window: escapes
    return {
        # format 3: a JOINT block (with escapes); format 1: sign moved, exponents in pairs
        "bf16-weights": (bf16.to(torch.bfloat16), None),
        # the same as the default writes it (format 2: byte planes)
        "bf16-weights-format2": (bf16.to(torch.bfloat16), None),
        # sign kept; exponents packed in quads (with escapes)
        "fp32-second-moment": (second_moment, None),
        # a float plane in zstd (five exponent bits and three mantissa bits)
        "fp16-weights": ((torch.randn(8192, generator=gen) * 0.02).half(), None),
        # one varying bit in the lowest byte
        "fp32-low-bits-zero": (crepe_like.view(torch.float32), None),
        # constant planes, zstd planes; 70000 x 8 bytes is two blocks and a bit
        "int64-arange": (torch.arange(70000, dtype=torch.int64), None),
        # 10001 bytes as bfloat16: a one-byte tail
        "bf16-tail": (odd.view(torch.uint8).numpy().tobytes() + b"!", "bfloat16"),
        # opaque bytes: zstd level 3
        "opaque": (json.dumps({"steps": list(range(3000))}).encode(), None),
    }


def make_weights() -> None:
    if WEIGHTS.exists():
        shutil.rmtree(WEIGHTS)
    WEIGHTS.mkdir(parents=True)
    items = []
    for name, (value, dtype) in weights_items().items():
        if isinstance(value, torch.Tensor):
            dtype = str(value.dtype).removeprefix("torch.")
            data = value.view(torch.uint8).numpy().tobytes()
            es = value.element_size()
        else:
            data, es = value, 2 if dtype == "bfloat16" else 1
        item = ItemInfo(checkpoint="golden", item=name, dtype=dtype, element_size=es)
        out = io.BytesIO()
        codec = WeightCodec(compact=not name.endswith("-format2"))
        descriptors = encode([codec], data, item, out)
        (WEIGHTS / f"{name}.bin").write_bytes(out.getvalue())
        entry: dict[str, Any] = {"file": f"{name}.bin", "dtype": dtype, "es": es}
        if name == "int64-arange":
            entry["arange_int64"] = 70000  # regenerated by the test: 560 KB not stored
        else:
            (WEIGHTS / f"{name}.plain").write_bytes(data)
            entry["plain"] = f"{name}.plain"
        entry["plain_sha256"] = hashlib.sha256(data).hexdigest()
        entry["descriptors"] = descriptors
        items.append(entry)
    (WEIGHTS / "manifest.json").write_text(json.dumps({"items": items}, indent=1) + "\n")
    state = golden_state_dict()
    torch.save(state, WEIGHTS / "expected.pt")
    storage.save(state, WEIGHTS / "ckpt", transforms=[WeightCodec(compact=True)], thread_count=1)


def main() -> None:
    if sys.argv[1:] != ["aes"]:
        make_weights()
    if sys.argv[1:] != ["weights"]:
        make_aes()


def make_aes() -> None:
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    gen = torch.Generator().manual_seed(99)
    plain = (torch.randn(10_000, generator=gen) * 0.02).to(torch.bfloat16)
    data = plain.view(torch.uint8).numpy().tobytes()
    (OUT / "plain.bin").write_bytes(data)
    chains: dict[str, list[Any]] = {
        "aes.bin": [aes()],
        "zstd-aes.bin": [ZStandard(), aes()],
        "shuffle-zstd-aes.bin": [ByteShuffle(), ZStandard(), aes()],
    }
    items = []
    for name, chain in chains.items():
        item = ItemInfo(
            checkpoint="golden", item="golden.item", dtype="bfloat16", element_size=2, save=SAVE
        )
        out = io.BytesIO()
        descriptors = encode(chain, data, item, out)
        (OUT / name).write_bytes(out.getvalue())
        items.append(
            {
                "file": name,
                "item": item.item,
                "element_size": 2,
                "save": SAVE,
                "descriptors": descriptors,
            }
        )
    manifest = {
        "plain": "plain.bin",
        "plain_sha256": hashlib.sha256(data).hexdigest(),
        "key": "bytes(range(32)), key_id 'golden'",
        "items": items,
    }
    (OUT / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")

    state = golden_state_dict()
    torch.save(state, OUT / "expected.pt")
    storage.save(state, OUT / "ckpt-zstd-aes", transforms=[ZStandard(), aes()], thread_count=1)
    storage.save(
        state,
        OUT / "ckpt-shuffle-zstd-aes",
        transforms=[ByteShuffle(), ZStandard(), aes()],
        thread_count=1,
    )


if __name__ == "__main__":
    main()
