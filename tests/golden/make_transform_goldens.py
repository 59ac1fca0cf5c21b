"""Regenerate the golden encoded items and checkpoints under ``tests/golden/transforms``.

    python tests/golden/make_transform_goldens.py

Run it only when a transform's format changes on purpose (with a new descriptor
version): the committed files prove that what older releases wrote keeps decoding.
Encryption is randomised per item, so every run writes different bytes. The key is a
fixed test key, ``bytes(range(32))`` under key_id ``golden``; it protects nothing.
``tests/test_encryption.py`` decodes every item in ``manifest.json`` and loads both
checkpoints.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
from pathlib import Path
from typing import Any

import torch

import storage
from extensions import AES256GCM, ByteShuffle, ItemInfo, ZStandard
from extensions.testing import encode

OUT = Path(__file__).parent / "transforms"
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


def main() -> None:
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
        item = ItemInfo(checkpoint="golden", item="golden.item", dtype="bfloat16", element_size=2)
        out = io.BytesIO()
        descriptors = encode(chain, data, item, out)
        (OUT / name).write_bytes(out.getvalue())
        items.append(
            {"file": name, "item": item.item, "element_size": 2, "descriptors": descriptors}
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
