"""Shared fixtures. Backend-specific servers live next to the tests that use them."""

from __future__ import annotations

import warnings

import pytest
import torch

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


def zeros_like_tree(tree: object) -> object:
    """Same structure with every tensor zeroed and plain values blanked."""
    if isinstance(tree, torch.Tensor):
        return torch.zeros_like(tree.contiguous())
    if isinstance(tree, dict):
        return {k: zeros_like_tree(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [0 for _ in tree]
    if isinstance(tree, str):
        return ""
    if isinstance(tree, int):
        return 0
    return tree


def assert_tree_equal(a: object, b: object) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{type(b)} is not a tensor"
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for k in a:
            assert_tree_equal(a[k], b[k])
    else:
        assert a == b, f"{a!r} != {b!r}"
