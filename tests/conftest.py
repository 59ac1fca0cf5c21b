"""Shared fixtures. Helpers (servers, proxies, tree comparisons) are in tests/support/."""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


@pytest.fixture
def state_dict() -> dict[str, object]:
    """A small mixed state dict: bf16/fp32/int tensors, a view, nested dicts, non-tensors."""
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(64, 32, generator=gen)
    return {
        "w": torch.randn(128, 64, generator=gen).to(torch.bfloat16),
        "b": torch.randn(64, generator=gen),
        "ids": torch.arange(1000, dtype=torch.int64),
        "view": base[:, 3],  # non-contiguous view of a larger storage
        "empty": torch.empty(0, 4),
        "nested": {"scale": torch.tensor(2.5), "name": "layer", "steps": [1, 2, 3]},
        "step": 7,
    }


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    """A gloo group of this process alone, as torchft's harness makes (a DTensor needs
    one)."""
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield
    finally:
        dist.destroy_process_group()
