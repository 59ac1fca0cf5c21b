"""Regenerate the golden checkpoints (run only when the format version changes on purpose).

    python tests/golden/make_golden.py

Writes ``expected.pt`` (the state dict, saved with torch.save) and one checkpoint per
flavour: ours without transforms and with zstd, stock DCP without and with torch's
ZStandard. ``tests/checkpoint/test_core.py::test_golden_checkpoints_keep_loading`` loads them all.

``safetensors-v1`` is not made here: it is a model ``SafetensorsWriter`` saved (the
golden state dict's tensors, ``max_shard_size=200``) before files recorded a write id,
kept as it is so that ``tests/checkpoint/test_safetensors_mixed.py`` proves such models
keep loading.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._extension import ZStandard as TorchZStandard

import storage
from extensions import ZStandard


def golden_state_dict() -> dict[str, object]:
    gen = torch.Generator().manual_seed(1234)
    return {
        "layer.weight": torch.randn(16, 8, generator=gen).to(torch.bfloat16),
        "layer.bias": torch.randn(8, generator=gen),
        "ids": torch.arange(32, dtype=torch.int32),
        "optim": {"step": torch.tensor(3.0), "lr": 0.001, "betas": [0.9, 0.999]},
        "epoch": 2,
    }


def main() -> None:
    here = Path(__file__).parent
    state = golden_state_dict()
    torch.save(state, here / "expected.pt")
    flavours = {
        "v1-none": lambda p: storage.save(state, p, thread_count=1),
        "v1-zstd": lambda p: storage.save(state, p, transforms=[ZStandard()], thread_count=1),
        "stock-none": lambda p: dcp.save(state, storage_writer=dcp.FileSystemWriter(p)),
        "stock-zstd": lambda p: dcp.save(
            state, storage_writer=dcp.FileSystemWriter(p, _extensions=[TorchZStandard()])
        ),
    }
    for name, write in flavours.items():
        shutil.rmtree(here / name, ignore_errors=True)
        write(str(here / name))


if __name__ == "__main__":
    main()
